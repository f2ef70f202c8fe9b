"""deploy/warm_executor.py's executor: which worker process serves which task, when workers
end, and a task's deadline. A fake Runtime API hands out tasks of given runs (run id, FAB hash)
the way the SuperNode's ``AcquireTask`` does; the workers are real spawned processes, whose body
answers each task's token instead of calling a ClientApp (the ClientApp path runs in
tests/test_warm_deployment.py)."""

from __future__ import annotations

import hashlib
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.app import Message, Metadata, RecordDict
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.message_pb2 import ObjectTree, PushObjectResponse  # pylint: disable=E0611
from flwr.proto.runtime_pb2 import (  # pylint: disable=E0611
    AcquireTaskResponse,
    PushAppMessagesResponse,
    PushTaskOutputResponse,
)
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.constant import TaskType

from tests.deployment import process_gone

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import warm_executor  # noqa: E402  pylint: disable=wrong-import-position
from warm_executor import RunKey, TaskDeadline  # noqa: E402  pylint: disable=wrong-import-position

TASK_LOG = "FEDPAC_TEST_TASK_LOG"  # where the workers write "<token> <pid>" per task
HANG_SECONDS = 20  # how long a hanging task sleeps: far past the deadlines below


def task_metadata(token: str, run_id: int) -> Metadata:
    """The metadata of the message a task with ``token`` pulled (a train message of the server)."""
    return Metadata(run_id=run_id, message_id=f"message-of-{token}", src_node_id=1, dst_node_id=77,
                    reply_to_message_id="", group_id="3", created_at=time.time(), ttl=3600, message_type="train")


def answering_worker(connection: Connection, endpoint: warm_executor.RuntimeEndpoint,
                     options: warm_executor.WorkerOptions, executor_pid: int) -> None:
    """A worker's loop with the ClientApp call left out: each token is written to the task log
    with this process's pid and answered as completed; the loop ends when the executor closes
    the pipe, as ``worker_main``'s does.

    A token's first part says what its task does besides: ``hang`` starts a process (written to
    the log as ``<token>/child <pid>``) and sleeps ``HANG_SECONDS``, ``slow`` sleeps 1.5 s;
    ``@S`` after it reports the task as ``TaskRunner`` does, with a run config whose
    round-timeout is S seconds."""
    del endpoint, options, executor_pid
    while True:
        try:
            token = connection.recv()
        except EOFError:
            return
        kind, _, round_timeout = token.split("-")[0].partition("@")
        with open(os.environ[TASK_LOG], "a", encoding="ascii") as log:
            log.write(f"{token} {os.getpid()}\n")
        if round_timeout:
            run_id = int(token.rsplit("-", 1)[1])
            connection.send(warm_executor.TaskStarted(task_metadata(token, run_id), float(round_timeout)))
        if kind == "hang":
            child = subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({3 * HANG_SECONDS})"])
            with open(os.environ[TASK_LOG], "a", encoding="ascii") as log:
                log.write(f"{token}/child {child.pid}\n")
            time.sleep(HANG_SECONDS)
        elif kind == "slow":
            time.sleep(1.5)
        connection.send("completed")


class FakeRuntime:
    """The executor's side of the SuperNode's Runtime API: ``AcquireTask`` hands out the queued
    tasks in order, then answers that there is none."""

    def __init__(self) -> None:
        self.queue: list[AcquireTaskResponse] = []
        self.added = 0
        self.closed = False

    def add(self, run_id: int, fab_hash: str, kind: str = "token") -> str:
        self.added += 1
        token = f"{kind}-{self.added}-run-{run_id}"
        task = Task(task_id=self.added, type=TaskType.CLIENT_APP, run_id=run_id, fab_hash=fab_hash)
        self.queue.append(AcquireTaskResponse(task=task, token=token))
        return token

    def AcquireTask(self, request) -> AcquireTaskResponse:  # noqa: ANN001, N802  # the RPC's name
        assert list(request.supported_task_types) == [TaskType.CLIENT_APP]
        return self.queue.pop(0) if self.queue else AcquireTaskResponse()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def task_log(tmp_path, monkeypatch) -> Path:
    path = tmp_path / "tasks.log"
    monkeypatch.setenv(TASK_LOG, str(path))  # the spawned workers inherit it
    return path


class FakeTaskClient:
    """The Runtime API as one task's token reaches it: what the executor pushes when it answers
    a task in its ended worker's place."""

    def __init__(self, token: str) -> None:
        self.token = token
        self.messages: list = []  # the pushed messages (protobuf), content left out
        self.objects: list[str] = []
        self.output = None  # the PushTaskOutputRequest
        self.closed = False

    def PushMessages(self, request) -> PushAppMessagesResponse:  # noqa: ANN001, N802  # the RPC's name
        self.messages.extend(request.messages_list)

        def ids(tree: ObjectTree) -> list[str]:
            return [tree.object_id, *(i for child in tree.children for i in ids(child))]

        return PushAppMessagesResponse(objects_to_push=ids(request.message_object_trees[0]), session_id="session")

    def PushObject(self, request) -> PushObjectResponse:  # noqa: ANN001, N802
        self.objects.append(request.object_id)
        return PushObjectResponse(stored=True)

    def PushTaskOutput(self, request) -> PushTaskOutputResponse:  # noqa: ANN001, N802
        self.output = request
        return PushTaskOutputResponse()

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def answered() -> list[FakeTaskClient]:
    """The task clients the executors made to answer tasks themselves, in order."""
    return []


@pytest.fixture
def executors(task_log, answered):
    """Makes executors with a fake Runtime API and answering workers; stops them all after."""
    made: list[warm_executor.WarmExecutor] = []

    def task_client(token: str) -> FakeTaskClient:
        answered.append(FakeTaskClient(token))
        return answered[-1]

    def make(idle_timeout: float, deadline: TaskDeadline | None = None) -> tuple[warm_executor.WarmExecutor,
                                                                                 FakeRuntime]:
        runtime = FakeRuntime()
        made.append(warm_executor.WarmExecutor(
            runtime, warm_executor.RuntimeEndpoint("127.0.0.1:1", True, None), poll_interval=0.01,  # type: ignore[arg-type]
            idle_timeout=idle_timeout, main=answering_worker, deadline=deadline or TaskDeadline(),
            task_client=task_client))  # type: ignore[arg-type]
        return made[-1], runtime

    yield make
    for executor in made:
        executor.close()
        assert executor.client.closed
    assert not multiprocessing.active_children()  # every worker, standby included, was stopped


def served_by(task_log: Path) -> dict[str, int]:
    """The pid that ran each task, by token (and of what a task started, by ``<token>/child``)."""
    lines = task_log.read_text(encoding="ascii").split() if task_log.exists() else []
    return {token: int(pid) for token, pid in zip(lines[::2], lines[1::2], strict=True)}


def run_all(executor: warm_executor.WarmExecutor) -> None:
    """What the serve loop does until the queue is empty: each task, then the between-tasks care."""
    while executor.step():
        executor.tend()


def live_workers(executor: warm_executor.WarmExecutor) -> set[int]:
    return {worker.process.pid for worker in executor.workers.values() if worker.process.is_alive()}


@pytest.mark.e2e  # spawns worker processes
def test_tasks_of_one_run_share_its_worker_and_a_new_run_of_the_same_app_gets_a_new_process(
    executors, task_log
):
    executor, runtime = executors(idle_timeout=0)
    standby = executor.standby.process.pid
    first = [runtime.add(1, "fab-a"), runtime.add(1, "fab-a")]
    run_all(executor)
    pids = served_by(task_log)
    assert pids[first[0]] == pids[first[1]] == standby  # run 1 took the standby and kept it
    assert executor.standby is None  # nothing was stopped: no standby is due yet
    run_one = executor.workers[RunKey(1, "fab-a")]

    second = runtime.add(2, "fab-a")  # the same app version, another run
    assert executor.step()
    assert served_by(task_log)[second] not in (standby, run_one.process.pid)
    assert not run_one.process.is_alive() and run_one.process.exitcode == 0  # stopped, not killed
    assert list(executor.workers) == [RunKey(2, "fab-a")]
    # the standby that run 1's end made due starts after the task, not alongside it
    assert executor.standby is None
    executor.tend()
    assert executor.standby is not None and executor.standby.run_key is None
    assert executor.standby.process.pid not in {standby, run_one.process.pid, served_by(task_log)[second]}


@pytest.mark.e2e  # spawns worker processes
def test_an_idle_run_s_worker_stops_and_a_standby_serves_the_next_run(executors, task_log):
    executor, runtime = executors(idle_timeout=0.5)
    first = runtime.add(7, "fab-a")
    run_all(executor)
    worker = executor.workers[RunKey(7, "fab-a")]
    assert served_by(task_log)[first] == worker.process.pid and executor.standby is None
    executor.tend()  # a run that had a task just now keeps its worker
    assert worker.process.is_alive() and RunKey(7, "fab-a") in executor.workers

    time.sleep(0.6)
    executor.tend()
    assert not executor.workers and not worker.process.is_alive()
    standby = executor.standby
    assert standby is not None and standby.process.is_alive()
    executor.tend()
    assert executor.standby is standby  # never a second standby

    second = runtime.add(8, "fab-b")
    run_all(executor)
    assert served_by(task_log)[second] == standby.process.pid  # the new run did not pay the start


@pytest.mark.e2e  # spawns worker processes
def test_no_idle_timeout_keeps_a_run_s_worker(executors):
    executor, runtime = executors(idle_timeout=0)
    runtime.add(1, "fab-a")
    run_all(executor)
    worker = executor.workers[RunKey(1, "fab-a")]
    worker.last_task -= 3600  # an hour without a task
    executor.tend()
    assert executor.workers == {RunKey(1, "fab-a"): worker} and worker.process.is_alive()


@pytest.mark.e2e  # spawns worker processes
def test_interleaved_runs_never_hold_more_than_one_worker_and_one_standby(executors, task_log):
    executor, runtime = executors(idle_timeout=0)
    tokens = [runtime.add(run_id, "fab-a") for run_id in (1, 2, 1, 1)]
    pids = []
    while executor.step():
        assert len(executor.workers) == 1 and len(live_workers(executor)) == 1
        executor.tend()
        # the run's worker and at most one standby are all the executor's children
        assert len(multiprocessing.active_children()) <= 2
        pids.append(served_by(task_log)[tokens[len(pids)]])
    # each switch of run is a new process; tasks of one run in a row share one
    assert len({pids[0], pids[1], pids[2]}) == 3 and pids[3] == pids[2]


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf"])
def test_a_bad_idle_timeout_is_refused_naming_the_option_and_its_variable(value, monkeypatch):
    with pytest.raises(SystemExit, match=r"--run-idle-timeout \(env FEDPAC_WORKER_IDLE_TIMEOUT\) must be 0 "
                                         r"\(never\) or a number of seconds, got '" + value):
        warm_executor.main(["--run-idle-timeout", value])
    monkeypatch.setenv("FEDPAC_WORKER_IDLE_TIMEOUT", value)
    with pytest.raises(SystemExit, match="FEDPAC_WORKER_IDLE_TIMEOUT"):
        warm_executor.main([])
    assert warm_executor.idle_timeout_of("0") == 0 and warm_executor.idle_timeout_of("2.5") == 2.5


@pytest.mark.e2e  # spawns worker processes
def test_a_run_s_worker_that_died_is_replaced_for_the_run_s_next_task(executors, task_log):
    executor, runtime = executors(idle_timeout=0)
    first = runtime.add(3, "fab-a")
    run_all(executor)
    worker = executor.workers[RunKey(3, "fab-a")]
    worker.process.kill()  # out of memory, say
    worker.process.join()
    second = runtime.add(3, "fab-a")
    run_all(executor)
    pids = served_by(task_log)
    assert pids[second] != pids[first] and list(live_workers(executor)) == [pids[second]]
    assert executor.standby is None  # the run did not end: no standby is due


def warmed_up(executor: warm_executor.WarmExecutor, runtime: FakeRuntime, run_id: int) -> int:
    """The pid of the run's worker after a first task of the run: a worker in its loop, which
    takes the next task the moment it is handed over. A deadline counts from the hand-over, so
    a hung task handed to a worker still starting on a loaded machine could be ended before it
    began (seen beside a CPU-bound process: the deadline's 3 s passed while the worker imported).
    The first task itself runs without a deadline, however long the worker takes to start."""
    deadline, executor.deadline = executor.deadline, TaskDeadline(seconds=0)
    try:
        runtime.add(run_id, "fab-a")
        run_all(executor)
    finally:
        executor.deadline = deadline
    return executor.workers[RunKey(run_id, "fab-a")].process.pid


def _hung_task_is_gone(task_log: Path, token: str) -> tuple[int, int]:
    """(worker pid, its child's pid) of the hanging task ``token``, after checking that both are
    gone; a child left over is killed, so that a failing test leaves nothing behind."""
    pids = served_by(task_log)
    # the deadlines here are 3 s: a worker that a loaded machine starts late has still begun the task
    worker, child = pids[token], pids[f"{token}/child"]
    try:
        assert process_gone(worker), "the hung worker still runs"
        assert process_gone(child), "the process the hung task started still runs"
    finally:
        if not process_gone(child):
            os.kill(child, signal.SIGKILL)
    return worker, child


@pytest.mark.e2e  # spawns worker processes
def test_a_task_past_its_run_s_round_timeout_is_ended_with_what_it_started_answered_and_the_next_task_runs(
    executors, task_log, answered
):
    executor, runtime = executors(idle_timeout=0)  # the default deadline: each run's round-timeout
    warm = warmed_up(executor, runtime, 5)
    hung = runtime.add(5, "fab-a", kind="hang@3")  # its run config: round-timeout = 3 s
    after = runtime.add(5, "fab-a")
    started = time.monotonic()
    assert executor.step()
    assert time.monotonic() - started < HANG_SECONDS / 2  # not held up by the hanging task
    worker, _ = _hung_task_is_gone(task_log, hung)
    assert worker == warm
    assert RunKey(5, "fab-a") not in executor.workers

    # answered in the worker's place, as flwr-clientapp answers a ClientApp that raised
    (client,) = answered
    assert client.token == hung and client.closed
    (reply,) = client.messages
    assert reply.metadata.reply_to_message_id == f"message-of-{hung}" and reply.metadata.run_id == 5
    assert reply.metadata.dst_node_id == 1 and reply.metadata.src_node_id == 77  # back to the server
    assert reply.error.code == ErrorCode.CLIENT_APP_CRASHED
    assert "deadline of 3 s" in reply.error.reason and "round-timeout" in reply.error.reason
    assert client.objects  # the reply's objects went with it
    assert client.output.sub_status == SubStatus.FAILED and client.output.details == reply.error.reason
    assert not client.output.HasField("context")  # the run's context stays as it was

    executor.tend()  # the standby the ended worker made due
    assert executor.standby is not None
    assert executor.step()
    assert served_by(task_log)[after] not in (0, worker)
    assert list(live_workers(executor)) == [served_by(task_log)[after]]


@pytest.mark.e2e  # spawns worker processes
@pytest.mark.parametrize("kind, deadline, source", [
    ("hang@3600", TaskDeadline(seconds=3), "--task-timeout"),  # the site's deadline wins over the run's
    ("hang", TaskDeadline(fallback=3), None),  # never reported: the executor's default, no answer
])
def test_the_site_s_deadline_and_the_default_one_end_a_hung_task_too(executors, task_log, answered, kind,
                                                                      deadline, source):
    executor, runtime = executors(idle_timeout=0, deadline=deadline)
    warmed_up(executor, runtime, 9)
    hung = runtime.add(9, "fab-a", kind=kind)
    started = time.monotonic()
    assert executor.step()
    assert time.monotonic() - started < HANG_SECONDS / 2
    _hung_task_is_gone(task_log, hung)
    if source is None:  # the message's metadata never came: the SuperNode answers when the token expires
        assert answered == []
    else:
        ((reply,),) = [client.messages for client in answered]
        assert source in reply.error.reason and "deadline of 3 s" in reply.error.reason


@pytest.mark.e2e  # spawns worker processes
def test_a_task_timeout_of_0_lets_a_task_run_past_its_run_s_round_timeout(executors, task_log, answered):
    executor, runtime = executors(idle_timeout=0, deadline=TaskDeadline(seconds=0))
    slow = runtime.add(4, "fab-a", kind="slow@0.2")  # 1.5 s, with a round-timeout of 0.2 s
    run_all(executor)
    worker = executor.workers[RunKey(4, "fab-a")]
    assert served_by(task_log)[slow] == worker.process.pid and worker.process.is_alive()
    assert answered == []


@pytest.mark.parametrize("value", ["-1", "soon", "nan", "inf", "round_timeout"])
def test_a_bad_task_timeout_is_refused_naming_the_option_and_its_variable(value, monkeypatch):
    with pytest.raises(SystemExit, match=r"--task-timeout \(env FEDPAC_TASK_TIMEOUT\) must be 'round-timeout' "
                                         r"\(each run's\), 0 \(none\) or a number of seconds, got '" + value):
        warm_executor.main(["--task-timeout", value])
    monkeypatch.setenv("FEDPAC_TASK_TIMEOUT", value)
    with pytest.raises(SystemExit, match="FEDPAC_TASK_TIMEOUT"):
        warm_executor.main([])
    assert warm_executor.task_deadline_of("round-timeout") == TaskDeadline()
    assert warm_executor.task_deadline_of("0") == TaskDeadline(0.0)
    assert warm_executor.task_deadline_of("90") == TaskDeadline(90.0)
    assert warm_executor.parser().parse_args([]).task_timeout == value  # the variable is the default


def test_a_worker_reports_each_task_s_message_and_round_timeout_before_the_app_runs(monkeypatch):
    """What the executor's deadline and its answer rest on: ``TaskRunner`` reports the pulled
    message's metadata and the run config's round-timeout before it loads or calls the app."""

    class Quiet:  # no heartbeats to a Runtime API that is not there
        def __init__(self, beat) -> None:  # noqa: ANN001
            del beat

        def start(self) -> None: ...

        def stop(self) -> None: ...

    metadata = task_metadata("t", 3)
    message = Message(RecordDict(), metadata=metadata)
    context = warm_executor.Context(run_id=3, node_id=77, node_config={}, state=RecordDict(),
                                    run_config={"round-timeout": 45.0})
    events: list[object] = []
    monkeypatch.setattr(warm_executor, "HeartbeatSender", Quiet)
    run, fab = SimpleNamespace(fab_id="", fab_version="", run_id=3), SimpleNamespace(hash_str="", content=b"")
    monkeypatch.setattr(warm_executor, "pull_task_input", lambda client: (message, context, run, fab))
    monkeypatch.setattr(warm_executor, "push_message", lambda client, reply, ctx: events.append("pushed"))
    monkeypatch.setattr(warm_executor, "push_task_output", lambda client, ctx, status, details: events.append(status))
    runner = warm_executor.TaskRunner(warm_executor.RuntimeEndpoint("127.0.0.1:1", True, None), report=events.append)

    def app(message: Message, context: warm_executor.Context) -> Message:
        events.append("app")
        return Message(RecordDict(), reply_to=message)

    monkeypatch.setattr(runner, "app_for", lambda *fab: app)
    assert runner.run("token") == SubStatus.COMPLETED
    assert events == [warm_executor.TaskStarted(metadata, 45.0), "app", "pushed", SubStatus.COMPLETED]
    assert events[0].reply_to.message_id == metadata.message_id


@pytest.mark.parametrize("value, seconds", [(45.0, 45.0), (30, 30.0), ("12.5", 12.5), (0, None), (-3, None),
                                            ("soon", None), (True, None), (float("inf"), None), (None, None)])
def test_the_round_timeout_a_worker_reports_is_a_positive_number_or_none(value, seconds):
    assert warm_executor.round_timeout_of({} if value is None else {"round-timeout": value}) == seconds
    started = warm_executor.TaskStarted(task_metadata("t", 1), seconds)
    assert TaskDeadline(fallback=7).limit(started) == (seconds or 7)  # the default when the run has none
    assert TaskDeadline(seconds=2).limit(started) == 2 and TaskDeadline(seconds=0).limit(started) == 0


# ---------------------------------------------------------------------------- approved app versions

APP_A, APP_B = b"the FAB of app version A", b"the FAB of app version B"
DIGEST_A, DIGEST_B = (hashlib.sha256(content).hexdigest() for content in (APP_A, APP_B))


class SiteTask:
    """One task run by a real ``TaskRunner`` against fakes of the Runtime API: the pulled input
    (its node config and FAB given), what was installed and loaded, whether the app ran, what
    was pushed back and what the site logged."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, node_config: dict, content: bytes,
                 hash_str: str | None = None) -> None:
        self.installed: list[bytes] = []
        self.loaded: list[str] = []  # the FAB hash each app was loaded under
        self.ran = False
        self.replies: list[Message] = []
        self.output: tuple | None = None  # (sub-status, details)
        self.logged: list[tuple[int, str]] = []
        message = Message(RecordDict(), metadata=task_metadata("t", 3))
        context = warm_executor.Context(run_id=3, node_id=77, node_config=node_config, state=RecordDict(),
                                        run_config={})
        run = SimpleNamespace(fab_id="fedpac/fedpac", fab_version="1.0.0", run_id=3)
        fab = SimpleNamespace(hash_str=hashlib.sha256(content).hexdigest() if hash_str is None else hash_str,
                              content=content)
        monkeypatch.setattr(warm_executor, "HeartbeatSender", _NoHeartbeats)
        monkeypatch.setattr(warm_executor, "pull_task_input", lambda client: (message, context, run, fab))
        monkeypatch.setattr(warm_executor, "push_message", lambda client, reply, ctx: self.replies.append(reply))
        monkeypatch.setattr(warm_executor, "push_task_output",
                            lambda client, ctx, status, details: setattr(self, "output", (status, details)))
        monkeypatch.setattr(warm_executor, "install_from_fab",
                            lambda content, skip_prompt: self.installed.append(content))
        monkeypatch.setattr(warm_executor, "log", lambda level, text, *args, **kwargs:
                            self.logged.append((level, text % args)))
        self.runner = warm_executor.TaskRunner(warm_executor.RuntimeEndpoint("127.0.0.1:1", True, None))
        monkeypatch.setattr(self.runner, "_load", self._load)

    def _load(self, fab_id: str, fab_version: str, fab_hash: str):  # noqa: ANN202
        self.loaded.append(fab_hash)

        def app(message: Message, context: warm_executor.Context) -> Message:
            self.ran = True
            return Message(RecordDict(), reply_to=message)

        return app

    def run(self) -> str:
        return self.runner.run("token")

    def assert_refused(self, *words: str) -> str:
        """The app was neither installed nor run; the task got an error reply naming
        approved-apps and ``words``, its status failed, and the site logged why. The reason."""
        assert self.installed == [] and self.loaded == [] and not self.ran
        (reply,) = self.replies
        assert reply.has_error() and reply.error.code == ErrorCode.INVALID_FAB
        reason = reply.error.reason
        assert reason.startswith("site policy: ") and "approved-apps" in reason
        assert all(word in reason for word in words), reason
        assert self.output == (SubStatus.FAILED, reason)
        assert any(level == warm_executor.ERROR and reason in text for level, text in self.logged), self.logged
        return reason

    def assert_ran(self, content: bytes) -> None:
        assert self.installed == [content] and self.loaded == [hashlib.sha256(content).hexdigest()] and self.ran
        (reply,) = self.replies
        assert not reply.has_error()
        assert self.output == (SubStatus.COMPLETED, "")


class _NoHeartbeats:  # no heartbeats to a Runtime API that is not there
    def __init__(self, beat) -> None:  # noqa: ANN001
        del beat

    def start(self) -> None: ...

    def stop(self) -> None: ...


def test_an_unapproved_app_is_never_installed_or_run_and_its_task_gets_an_error_naming_approved_apps(monkeypatch):
    task = SiteTask(monkeypatch, {"approved-apps": DIGEST_A}, APP_B)
    assert task.run() == SubStatus.FAILED
    reason = task.assert_refused(f"FAB {DIGEST_B} is not one of them")
    assert reason == ("site policy: this site runs only the app versions in its node config's approved-apps; "
                      f"FAB {DIGEST_B} is not one of them")


@pytest.mark.parametrize("listed", [DIGEST_A, f"{DIGEST_B},{DIGEST_A}", f" {DIGEST_B}  {DIGEST_A.upper()} ",
                                    f"{DIGEST_B}, {DIGEST_A},"])
def test_an_approved_app_runs_and_an_app_the_list_leaves_out_does_not(monkeypatch, listed):
    """Commas, spaces or both between the digests, either case."""
    approved = SiteTask(monkeypatch, {"approved-apps": listed}, APP_A)
    assert approved.run() == SubStatus.COMPLETED
    approved.assert_ran(APP_A)
    other = SiteTask(monkeypatch, {"approved-apps": listed.replace(DIGEST_B, "0" * 64)}, APP_B)
    assert other.run() == SubStatus.FAILED
    other.assert_refused(DIGEST_B)


def test_a_fab_whose_content_is_not_a_listed_digest_is_refused_whatever_its_hash_str_says(monkeypatch):
    """The server (or anything between it and the worker) names an approved version and sends
    other bytes: the worker checks the bytes it would install."""
    task = SiteTask(monkeypatch, {"approved-apps": DIGEST_A}, APP_B, hash_str=DIGEST_A)
    assert task.run() == SubStatus.FAILED
    task.assert_refused(f"FAB {DIGEST_B}")


def test_without_approved_apps_every_app_runs_and_with_it_the_same_app_does_not(monkeypatch):
    for content in (APP_A, APP_B):
        task = SiteTask(monkeypatch, {"partition-id": 0, "dp-required": True}, content)
        assert task.run() == SubStatus.COMPLETED
        task.assert_ran(content)
    task = SiteTask(monkeypatch, {"partition-id": 0, "approved-apps": DIGEST_A}, APP_B)
    assert task.run() == SubStatus.FAILED
    task.assert_refused()


@pytest.mark.parametrize("value, named", [
    ("", "lists no app version"),
    (" , ", "lists no app version"),
    (DIGEST_A[:63], f"'{DIGEST_A[:63]}' is not a SHA-256 digest"),
    (f"sha256:{DIGEST_A}", "is not a SHA-256 digest"),
    (f"{DIGEST_A};{DIGEST_B}", "is not a SHA-256 digest"),
    (f"{DIGEST_A},{DIGEST_B[:-1]}g", "is not a SHA-256 digest"),
    (123, "is not a list of SHA-256 digests"),
    (True, "is not a list of SHA-256 digests"),
])
def test_a_malformed_approved_apps_refuses_every_app_even_a_listed_one(monkeypatch, value, named):
    """A typo in the list must not read as "no list": every task is refused, naming the key."""
    task = SiteTask(monkeypatch, {"approved-apps": value}, APP_A)
    assert task.run() == SubStatus.FAILED
    reason = task.assert_refused(named, "node config approved-apps", "runs no app until")
    with pytest.raises(ValueError, match="node config approved-apps"):
        warm_executor.approved_apps_of({"approved-apps": value})
    assert warm_executor.app_refusal({"approved-apps": value}, DIGEST_A) == reason


def test_the_approved_apps_list_is_parsed_to_lower_case_digests():
    assert warm_executor.approved_apps_of({}) is None
    assert warm_executor.approved_apps_of({"approved-apps": f"{DIGEST_A.upper()},{DIGEST_B} {DIGEST_A}"}) == \
        frozenset({DIGEST_A, DIGEST_B})
    assert warm_executor.app_refusal({}, DIGEST_B) is None
    assert warm_executor.app_refusal({"approved-apps": DIGEST_B}, DIGEST_B) is None
    assert "approved-apps" in (warm_executor.app_refusal({"approved-apps": DIGEST_B}, DIGEST_A) or "")


def test_fab_digest_prints_what_approved_apps_lists(tmp_path, monkeypatch, capsys):
    """Of a FAB file: its SHA-256, as sha256sum prints it; of an app's folder: that of the FAB
    `flwr run` would build from it."""
    fab = tmp_path / "fedpac.fedpac.0-1-0.d2422b3e.fab"
    fab.write_bytes(APP_A)
    warm_executor.main(["--fab-digest", str(fab)])
    assert capsys.readouterr().out == f"{DIGEST_A}\n"
    import flwr.cli.build  # pylint: disable=import-outside-toplevel

    monkeypatch.setattr(flwr.cli.build, "build_fab_from_disk", lambda app: APP_B if app == tmp_path else b"")
    warm_executor.main(["--fab-digest", str(tmp_path)])
    assert capsys.readouterr().out == f"{DIGEST_B}\n"
    with pytest.raises(SystemExit, match="--fab-digest .*: no such file or folder"):
        warm_executor.main(["--fab-digest", str(tmp_path / "none.fab")])
