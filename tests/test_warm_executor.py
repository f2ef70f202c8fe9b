"""deploy/warm_executor.py's executor: which worker process serves which task, and when workers
end. A fake Runtime API hands out tasks of given runs (run id, FAB hash) the way the SuperNode's
``AcquireTask`` does; the workers are real spawned processes, whose body answers each task's token
instead of calling a ClientApp (the ClientApp path runs in tests/test_warm_deployment.py)."""

from __future__ import annotations

import multiprocessing
import os
import sys
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest
from flwr.proto.runtime_pb2 import AcquireTaskResponse  # pylint: disable=E0611
from flwr.proto.task_pb2 import Task  # pylint: disable=E0611
from flwr.supercore.constant import TaskType

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "deploy"))
import warm_executor  # noqa: E402  pylint: disable=wrong-import-position
from warm_executor import RunKey  # noqa: E402  pylint: disable=wrong-import-position

TASK_LOG = "FEDPAC_TEST_TASK_LOG"  # where the workers write "<token> <pid>" per task


def answering_worker(connection: Connection, endpoint: warm_executor.RuntimeEndpoint,
                     options: warm_executor.WorkerOptions, executor_pid: int) -> None:
    """A worker's loop with the ClientApp call left out: each token is written to the task log
    with this process's pid and answered as completed; the loop ends when the executor closes
    the pipe, as ``worker_main``'s does."""
    del endpoint, options, executor_pid
    while True:
        try:
            token = connection.recv()
        except EOFError:
            return
        with open(os.environ[TASK_LOG], "a", encoding="ascii") as log:
            log.write(f"{token} {os.getpid()}\n")
        connection.send("completed")


class FakeRuntime:
    """The executor's side of the SuperNode's Runtime API: ``AcquireTask`` hands out the queued
    tasks in order, then answers that there is none."""

    def __init__(self) -> None:
        self.queue: list[AcquireTaskResponse] = []
        self.added = 0
        self.closed = False

    def add(self, run_id: int, fab_hash: str) -> str:
        self.added += 1
        token = f"token-{self.added}-run-{run_id}"
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


@pytest.fixture
def executors(task_log):
    """Makes executors with a fake Runtime API and answering workers; stops them all after."""
    made: list[warm_executor.WarmExecutor] = []

    def make(idle_timeout: float) -> tuple[warm_executor.WarmExecutor, FakeRuntime]:
        runtime = FakeRuntime()
        made.append(warm_executor.WarmExecutor(
            runtime, warm_executor.RuntimeEndpoint("127.0.0.1:1", True, None), poll_interval=0.01,  # type: ignore[arg-type]
            idle_timeout=idle_timeout, main=answering_worker))
        return made[-1], runtime

    yield make
    for executor in made:
        executor.close()
        assert executor.client.closed
    assert not multiprocessing.active_children()  # every worker, standby included, was stopped


def served_by(task_log: Path) -> dict[str, int]:
    """The pid that ran each task, by token."""
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
