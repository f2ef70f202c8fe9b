"""A warm SuperExec for a SuperNode's ClientApp tasks: the app is loaded once per run, not once
per message.

Flower 1.39's ``flower-superexec`` starts a fresh ``flwr-clientapp`` process for every message a
SuperNode receives; each one imports torch and Flower again and loads the node's data again
(about 5 s on a 2-core CPU, before any training; on a GPU it would also initialise CUDA again).
This executor takes the SuperExec's place (``flower-supernode --isolation process``) and hands
every task of a run to that run's own long-lived worker process, which keeps the ClientApp,
torch, the CUDA context and the node's decoded data resident for the run, the way the
simulation's Ray actors do.

What stays as in Flower:

* the tasks come from the SuperNode's Runtime API, acquired with the node's SuperExec secret
  (HMAC), and each task runs with its own one-time token: pull the message, context, run and FAB,
  call the ClientApp, push the reply and the task's status, heartbeats while it runs;
* the ClientApp code is the run's FAB, installed under ``$FLWR_HOME`` like ``flwr-clientapp``
  does;
* the worker is this executor's child, reached only through an inherited pipe (no socket);
* a ClientApp that raises becomes an error reply, exactly as in ``flwr-clientapp``; a worker
  that dies (killed, out of memory) is replaced for the run's next task.

What a task may not do is run forever: tasks run one at a time, so a task that hangs (a deadlock,
a stuck device or network file system) would hold up every later task of the site. Each task has
a deadline, by default its run's ``round-timeout`` (the run config's, which the worker reports as
soon as it has pulled the task's input; until then, or when the run config has none, 3600 s, the
app's default ``round-timeout``): the server stops waiting for a reply ``round-timeout`` seconds
after it sent the message, which was before the task began here, so a task that runs longer is
wasted work. ``--task-timeout SECONDS`` (env ``FEDPAC_TASK_TIMEOUT``) sets the site's own deadline
for every task instead, 0 none. A task past its deadline has its worker killed with its whole
process group (each worker leads one, so whatever its task started goes too), and the executor
answers the task in the worker's place, as ``flwr-clientapp`` answers a ClientApp that raises: an
error reply to the task's message (``CLIENT_APP_CRASHED``, the reason naming the deadline) and the
task's status ``failed``, with the run's context left as it was. A worker killed before it
reported the task's message leaves the task to Flower: the SuperNode answers it with
``CLIENT_APP_CRASHED`` when the task's token expires (60 s without a heartbeat). The run's next
task gets a new worker (the standby, started again at once). Since the workers lead their own
process groups, a signal to the SuperNode's group (Ctrl-C in its terminal, ``kill -- -PGID``)
reaches the executor and not them: they end with the executor, within a second
(``_exit_with_parent``).

What is per run: a worker serves exactly one run (run id and FAB hash) and never another, so two
runs never share module globals, cached data tensors (a site that replaced its data files
between two runs with the same run config trains the second on the new files) or a CUDA
context. A worker ends with its run. The SuperNode is never told that a run ended (Flower's
SuperNode learns that a run is no longer running only when it sends a reply of it to the
SuperLink, and tells its executor nothing), so "ended" is what this executor sees: a task of
another run arrives (the idle workers of other runs are stopped then), or the run has had no task
for ``--run-idle-timeout`` seconds (default 300; its worker is stopped from the serve loop, so
that a finished run does not hold the site's memory, data and GPU). A run whose messages come
further apart than that gets a new worker for the next one: correct, since a worker only caches
what the run's messages and the node's files give it, but it pays the app and data loading again.

``flwr stop`` does not reach a task that is running: Flower's SuperNode goes on acknowledging the
task's heartbeats (nothing in its Runtime API knows the run's status), so the ClientApp call runs
to its end; the SuperNode drops the reply when it sends it to the SuperLink ("not in `RUNNING`
status. Ignoring reply message"), and the worker goes with the idle timeout or another run's
task. Whether the worker's push of that reply fails depends on a race (it fails when the
SuperNode dropped the reply's header while the worker still pushed its arrays, and a push also
fails for other reasons), so neither a heartbeat nor a push gives a clean signal that the run
was stopped: the idle timeout covers a stopped run like a finished one.

What a site runs is its own choice: with the node config key ``approved-apps`` (a comma- or
space-separated list of SHA-256 digests of FAB files, ``sha256sum app.fab`` after ``flwr
build``) a worker installs and loads a run's app only when the digest of the FAB's content it
pulled is one of them, and answers any other task with an error reply (``INVALID_FAB``, the
reason naming the key and the FAB's digest) and the task's status ``failed``: the app never runs.
The check is here, in the site's own code, because the app is the server operator's code and
cannot be trusted to check itself; Flower's ``flwr-clientapp`` (``supernode.sh --executor
cold``) has no such check. Without the key every app runs; a value that is not a list of digests
refuses every task (never read as "no list").

One standby worker (torch imported, no app, no data) is started ahead, so that a run's first
message does not pay the imports; it is started again after a run's worker was stopped, and
there is never more than one.

Run it next to a SuperNode started with ``--isolation process`` (``deploy/supernode.sh`` does)::

    python deploy/warm_executor.py --runtime-api-address 127.0.0.1:9094 --insecure \
        --superexec-auth-secret-file supernode-0.secret

Several SuperNodes on one host (a compose cluster, a test bed) can share ``--host-slots N``
training slots (``--slots-dir``, file locks): at most N ClientApp calls of the host's workers run
at once, like the simulation gives each client one of the host's CPUs. Twenty processes that
train at once on 2 cores did the same 20 local updates 2.4 times slower than two at a time.

This file imports only Flower, httpx (which Flower brings), the standard library and
``flower_pin.py`` (its guard: Flower 1.39.0 exactly), so it runs in any environment that can run
the app, and the container images carry it with ``flower_pin.py``.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import hashlib
import importlib
import math
import multiprocessing
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from multiprocessing.connection import Connection
from pathlib import Path

from flower_pin import require_flower

# Before Flower's internals are imported: on another Flower release, a clear refusal.
require_flower("deploy/warm_executor.py")

import httpx  # noqa: E402
from flwr.app import Context, Message, Metadata, RecordDict  # noqa: E402
from flwr.app.error import Error  # noqa: E402
from flwr.cli.install import install_from_fab  # noqa: E402
from flwr.clientapp.client_app import ClientApp, LoadClientAppError  # noqa: E402
from flwr.clientapp.utils import get_load_client_app_fn  # noqa: E402
from flwr.common.constant import ErrorCode, SubStatus  # noqa: E402
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # noqa: E402  # pylint: disable=E0611
from flwr.supercore import log  # noqa: E402
from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret  # noqa: E402
from flwr.supercore.constant import TaskType  # noqa: E402
from flwr.supercore.heartbeat import HeartbeatSender  # noqa: E402
from flwr.supercore.interceptors import (  # noqa: E402
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import RetryInvoker, exponential, make_simple_http_retry_invoker  # noqa: E402
from flwr.supercore.runtime import RuntimeHttpClient  # noqa: E402
from flwr.supercore.tls import validate_and_resolve_root_certificates  # noqa: E402
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output  # noqa: E402

# Methods of the Runtime API that the SuperNode guards with the SuperExec secret (as Flower's own).
_SUPEREXEC_AUTH_METHODS = frozenset(
    {"/flwr.proto.Runtime/AcquireTask", "/flwr.proto.Runtime/PullPendingTasks", "/flwr.proto.Runtime/ClaimTask"}
)


@dataclass(frozen=True)
class RuntimeEndpoint:
    """Where and how to reach the SuperNode's Runtime API (picklable: it goes to the workers)."""

    address: str
    insecure: bool
    root_certificates: bytes | None

    def client(self, *interceptors, retry_invoker: RetryInvoker | None = None) -> RuntimeHttpClient:  # noqa: ANN002
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=list(interceptors),
            retry_invoker=retry_invoker or make_simple_http_retry_invoker(),
        )

    def task_client(self, token: str) -> RuntimeHttpClient:
        """The client with which the executor answers a task in its ended worker's place: a few
        quick tries (a SuperNode that is gone must not hold up the site's next task), and no
        signal on a refused token (Flower's own retry sends the process SIGINT on a 401, which
        would end the executor)."""
        retry = RetryInvoker(lambda: exponential(base_delay=0.2, max_delay=2), httpx.TransportError,
                             max_tries=3, max_time=10)
        return self.client(RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"),
                           RuntimeTokenHttpInterceptor(token), retry_invoker=retry)


@dataclass(frozen=True)
class HostSlots:
    """At most ``count`` holders at once among the processes that share ``directory`` (one
    host): each slot is a file, held by an exclusive ``flock`` that the kernel releases when its
    holder dies. ``count`` 0: no limit."""

    directory: Path = Path()
    count: int = 0
    retry_interval: float = 0.02

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        if self.count <= 0:
            yield
            return
        self.directory.mkdir(parents=True, exist_ok=True)
        descriptor = self._take_one()
        if descriptor is None:
            # Wait in line: only the first in line looks for a free slot every retry_interval,
            # the others sleep in the kernel on the line's lock (18 nodes looking 50 times a
            # second took 6 % of a 2-core host from the 2 that train).
            with self._first_in_line():
                while (descriptor := self._take_one()) is None:
                    time.sleep(self.retry_interval)
        try:
            yield
        finally:
            fcntl.flock(descriptor, fcntl.LOCK_UN)
            os.close(descriptor)

    @contextlib.contextmanager
    def _first_in_line(self) -> Iterator[None]:
        line = os.open(self.directory / "line.lock", os.O_CREAT | os.O_RDONLY, 0o666)
        try:
            fcntl.flock(line, fcntl.LOCK_EX)  # blocks until the one before has its slot
            yield
        finally:
            os.close(line)  # releases the line

    def _take_one(self) -> int | None:
        for slot in range(self.count):
            descriptor = os.open(self.directory / f"slot-{slot}.lock", os.O_CREAT | os.O_RDONLY, 0o666)
            try:
                fcntl.flock(descriptor, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return descriptor
            except BlockingIOError:
                os.close(descriptor)
        return None


@dataclass(frozen=True)
class WorkerOptions:
    """How workers start and run (picklable: it goes to the workers).

    ``preload`` modules are imported before the first task (torch takes seconds: better while
    the node waits for a run than inside the run's first message); ``niceness`` lowers the
    workers' CPU priority below the node's, so that on a shared host the SuperNode's and
    SuperLink's network work is not starved by training; ``slots`` are the host's training
    slots, held for each ClientApp call.
    """

    preload: tuple[str, ...] = ()
    niceness: int = 0
    slots: HostSlots = HostSlots()


ROUND_TIMEOUT_KEY = "round-timeout"  # the run-config key whose value is a task's deadline by default
FALLBACK_TASK_TIMEOUT = 3600.0  # the app's default round-timeout: before the worker has read the run's


@dataclass(frozen=True)
class TaskStarted:
    """What a worker tells the executor once it has pulled a task's input (picklable: it crosses
    the pipe): the task message's metadata, with which the executor can answer the task if it
    must end the worker, and the run's ``round-timeout`` (None when the run config has none)."""

    reply_to: Metadata
    round_timeout: float | None


@dataclass(frozen=True)
class TaskDeadline:
    """How long a task may run. ``seconds``: the site's own deadline for every task (0: none),
    or None (default) for each run's ``round-timeout``, with ``fallback`` seconds until the
    worker has reported it or when the run config has none."""

    seconds: float | None = None
    fallback: float = FALLBACK_TASK_TIMEOUT

    def limit(self, started: TaskStarted | None) -> float:
        """Seconds the task may run, given what its worker reported so far; 0: no limit."""
        if self.seconds is not None:
            return self.seconds
        return started.round_timeout if started is not None and started.round_timeout else self.fallback

    def source(self, started: TaskStarted | None) -> str:
        """Where :meth:`limit` took its seconds from, for the error a task ended at it gets."""
        if self.seconds is not None:
            return "the site's --task-timeout"
        if started is not None and started.round_timeout:
            return f"the run's {ROUND_TIMEOUT_KEY}"
        return "the executor's default, the run's round-timeout not known"


def round_timeout_of(run_config: Mapping[str, object]) -> float | None:
    """The run config's ``round-timeout`` in seconds, None when it has none that is a positive
    finite number (the app refuses such a run anyway; the deadline then falls back)."""
    value = run_config.get(ROUND_TIMEOUT_KEY)
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        return None
    seconds = _seconds(str(value))
    return seconds if seconds else None


def _seconds(value: str) -> float | None:
    """``value`` as a finite number of seconds >= 0, or None when it is not one."""
    try:
        seconds = float(value)
    except ValueError:
        return None
    return seconds if math.isfinite(seconds) and seconds >= 0 else None


APPROVED_APPS_KEY = "approved-apps"  # the node-config key of the app versions (FAB digests) a site runs
_SHA256_HEX = re.compile(r"[0-9a-fA-F]{64}")


def approved_apps_of(node_config: Mapping[str, object]) -> frozenset[str] | None:
    """The FAB digests (lower-case SHA-256 hex) the site's node config ``approved-apps`` lists,
    or None when the key is unset (every app runs). A value that is not a non-empty list of
    64-hex-digit digests, separated by commas or white space, is a ValueError naming the key:
    a typo must refuse every app, not let every app through."""
    value = node_config.get(APPROVED_APPS_KEY)
    if value is None:
        return None
    if not isinstance(value, str):
        raise ValueError(f"node config {APPROVED_APPS_KEY} = {value!r} is not a list of SHA-256 digests "
                         "(a string of 64-hex-digit entries separated by commas or spaces)")
    entries = [entry for entry in re.split(r"[\s,]+", value) if entry]
    if not entries:
        raise ValueError(f"node config {APPROVED_APPS_KEY} = {value!r} lists no app version")
    for entry in entries:
        if not _SHA256_HEX.fullmatch(entry):
            raise ValueError(f"node config {APPROVED_APPS_KEY}: {entry!r} is not a SHA-256 digest (64 hex digits, "
                             "as `sha256sum app.fab` prints)")
    return frozenset(entry.lower() for entry in entries)  # hexdigest()'s case


def app_refusal(node_config: Mapping[str, object], fab_digest: str) -> str | None:
    """Why the site does not run the FAB whose content has SHA-256 ``fab_digest``, or None when
    it does (its node config has no ``approved-apps``, or lists the digest). A malformed list
    refuses every FAB."""
    try:
        approved = approved_apps_of(node_config)
    except ValueError as err:
        return f"site policy: {err}; this site runs no app until its node config is fixed"
    if approved is None or fab_digest in approved:
        return None
    return (f"site policy: this site runs only the app versions in its node config's {APPROVED_APPS_KEY}; "
            f"FAB {fab_digest} is not one of them")


def fab_digest_of(path: Path) -> str:
    """The digest ``approved-apps`` lists for ``path``: a FAB file's SHA-256 (``sha256sum``'s), or,
    for an app's folder, that of the FAB ``flwr run`` builds from it (Flower writes the archive
    with fixed dates, so the same files give the same digest; ``flwr build`` also demands that
    the folder's name be an app name, and prints only a prefix of the digest)."""
    if path.is_dir():
        from flwr.cli.build import build_fab_from_disk  # pylint: disable=import-outside-toplevel  # only here

        return hashlib.sha256(build_fab_from_disk(path)).hexdigest()
    return hashlib.sha256(path.read_bytes()).hexdigest()


class AppRefused(Exception):
    """The site's policy does not let this task's app run (the reason is the message)."""


# ---------------------------------------------------------------------------- worker side


def _heartbeat_fn(client: RuntimeHttpClient):  # noqa: ANN202
    """Flower's task heartbeat, except that a refused one raises no SIGINT (``flwr-clientapp``
    does, which here would end the worker and every later task of its run): it is retried like a
    failed one until the task ends. A refusal says that the SuperNode no longer holds the task
    (finished, or its token expired), not that its run was stopped: the SuperNode goes on
    acknowledging the tasks of a run stopped with ``flwr stop``."""
    request = SendTaskHeartbeatRequest()

    def send() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(request).success)
        except httpx.HTTPError:
            return False

    return send


class TaskRunner:
    """Runs ClientApp tasks one after another in this process (the tasks of one run), the app
    loaded at the first. ``report`` hears of each task once its input is pulled (the worker
    sends it to the executor, which keeps the task's deadline)."""

    def __init__(self, endpoint: RuntimeEndpoint, slots: HostSlots = HostSlots(),
                 report: Callable[[TaskStarted], None] | None = None) -> None:
        self.endpoint = endpoint
        self.slots = slots
        self.report = report
        self.apps: dict[str, ClientApp] = {}
        self._load = get_load_client_app_fn(default_app_ref="", app_path=None, multi_app=True)

    def app_for(self, fab_id: str, fab_version: str, fab_hash: str, fab_content: bytes) -> ClientApp:
        if fab_hash not in self.apps:
            install_from_fab(fab_content, skip_prompt=True)
            self.apps[fab_hash] = self._load(fab_id, fab_version, fab_hash)
        return self.apps[fab_hash]

    def run(self, token: str) -> str:
        """One task, as ``flwr-clientapp --token`` runs it; returns its final sub-status."""
        client = self.endpoint.client(
            RuntimeVersionHttpInterceptor(component_name="flwr-clientapp"), RuntimeTokenHttpInterceptor(token)
        )
        heartbeat = HeartbeatSender(_heartbeat_fn(client))
        heartbeat.start()
        message = reply = context = None
        sub_status, details = SubStatus.FAILED, "ClientApp task failed due to unknown reason"
        try:
            message, context, run, fab = pull_task_input(client)
            if self.report is not None:
                self.report(TaskStarted(message.metadata, round_timeout_of(context.run_config)))
            # The digest of the bytes that would be installed, computed here, so that the site's
            # check rests on nothing the server or the Runtime API claims. Flower 1.39's SuperNode
            # does compare a FAB's content with its hash_str, but only once, when it stores the
            # FAB it fetched from the SuperLink, and only when hash_str is not empty
            # (flwr/supercore/corestate: store_fab); it does not recompute it when it hands the
            # FAB out here (get_fab), and it has no list of the versions a site approves.
            digest = hashlib.sha256(fab.content).hexdigest()
            if (refusal := app_refusal(context.node_config, digest)) is not None:
                log(ERROR, "The app of run %d was not run: %s", run.run_id, refusal)
                raise AppRefused(refusal)
            # Installed and loaded under the checked digest, so that what runs is what was checked
            # (install_from_fab installs under the content's digest whatever hash_str says).
            app = self.app_for(run.fab_id, run.fab_version, digest, fab.content)
            with self.slots.held():  # the heartbeats go on while the task waits for a slot
                reply = app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # pylint: disable=broad-exception-caught  # as flwr-clientapp
            code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(ex)}:<'{ex}'>"
            if isinstance(ex, AppRefused):  # Flower's code for a FAB a SuperNode does not trust
                code, reason = ErrorCode.INVALID_FAB, str(ex)
            else:
                if isinstance(ex, LoadClientAppError):
                    code = ErrorCode.LOAD_CLIENT_APP_EXCEPTION
                    reason = "An exception was raised when attempting to load `ClientApp`"
                log(ERROR, "ClientApp raised an exception", exc_info=ex)
            details = reason
            if message is not None:
                reply = Message(Error(code=code, reason=reason), reply_to=message)
        finally:
            if reply is not None and context is not None:
                try:
                    push_message(client, reply, context)
                except Exception as ex:  # pylint: disable=broad-exception-caught
                    log(ERROR, "Failed to push reply message", exc_info=ex)
                    sub_status = SubStatus.FAILED
            push_task_output(client, context, sub_status, details)
            heartbeat.stop()
            client.close()
        return sub_status


def worker_main(connection: Connection, endpoint: RuntimeEndpoint, options: WorkerOptions,
                executor_pid: int) -> None:
    """A worker: receive tokens over the pipe, run each task, answer with its sub-status; gone
    with the executor ``executor_pid`` that started it."""
    _exit_with_parent(executor_pid, direct=True)
    if options.niceness:
        os.nice(options.niceness)
    for module in options.preload:
        try:
            importlib.import_module(module)
        except ImportError as err:
            log(WARNING, "Could not preload %s: %s", module, err)
    runner = TaskRunner(endpoint, options.slots, report=connection.send)
    while True:
        try:
            token = connection.recv()
        except EOFError:  # the executor is gone
            return
        connection.send(runner.run(token))


# ---------------------------------------------------------------------------- executor side


@dataclass(frozen=True)
class RunKey:
    """What a worker serves: one run, with its app version; never another."""

    run_id: int
    fab_hash: str

    def __str__(self) -> str:
        return f"run {self.run_id} (FAB {self.fab_hash[:8]})"


# A worker process's body: (pipe, endpoint, options, executor pid), as ``worker_main``.
WorkerMain = Callable[[Connection, RuntimeEndpoint, WorkerOptions, int], None]


def _worker_process(main: WorkerMain, connection: Connection, endpoint: RuntimeEndpoint, options: WorkerOptions,
                    executor_pid: int) -> None:
    """A worker process: it leads a process group of its own before anything else, so that a
    task ended at its deadline goes with whatever it started (data loaders, subprocesses)."""
    os.setpgid(0, 0)
    main(connection, endpoint, options, executor_pid)


@dataclass(frozen=True)
class TaskOutcome:
    """How a task handed to a worker ended: its sub-status (None when the worker died on it or
    was ended), what the worker reported of it, and, when it ran past its deadline, that
    deadline in seconds."""

    status: str | None
    started: TaskStarted | None = None
    expired_after: float | None = None


class Worker:
    """A worker process and the pipe to it. ``run_key``: the run it serves, None while it is the
    standby (preloaded, no app, no data); ``last_task``: when its last task ended, or when it got
    its run."""

    def __init__(self, endpoint: RuntimeEndpoint, options: WorkerOptions, main: WorkerMain = worker_main) -> None:
        context = multiprocessing.get_context("spawn")  # no inherited threads or locks
        self.run_key: RunKey | None = None
        self.last_task = time.monotonic()
        self.connection, child = context.Pipe()
        self.process = context.Process(target=_worker_process, args=(main, child, endpoint, options, os.getpid()),
                                       daemon=True, name="clientapp-worker")
        self.process.start()
        child.close()

    def serve(self, run_key: RunKey) -> None:
        self.run_key, self.last_task = run_key, time.monotonic()

    def run(self, token: str, deadline: TaskDeadline = TaskDeadline()) -> TaskOutcome:
        """Hand a task over and wait for it until its deadline (which the worker's report of the
        run's round-timeout may set); the worker is left as it is when the deadline passes."""
        handed_over = time.monotonic()
        started: TaskStarted | None = None
        try:
            self.connection.send(token)
            while True:
                limit = deadline.limit(started)
                left = handed_over + limit - time.monotonic() if limit > 0 else math.inf
                if not self.connection.poll(max(0.0, min(1.0, left))):  # past the deadline: one last look
                    if left <= 0:
                        return TaskOutcome(None, started, expired_after=limit)
                    if not self.process.is_alive():
                        return TaskOutcome(None, started)
                    continue
                answer = self.connection.recv()
                if isinstance(answer, TaskStarted):
                    started = answer
                    continue
                return TaskOutcome(str(answer), started)
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return TaskOutcome(None, started)
        finally:
            self.last_task = time.monotonic()

    def stop(self) -> None:
        self.connection.close()  # the worker's loop ends at its next read
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.end()

    def end(self) -> None:
        """Kill the worker now, with every process of its group (what its task started)."""
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)  # the group it leads (_worker_process)
        self.process.kill()  # in case it was killed before it made its group
        self.process.join()
        self.connection.close()


class WarmExecutor:
    """Acquires the SuperNode's ClientApp tasks and runs each in its run's warm worker.

    Tasks run one at a time: ``step`` hands a task to its worker and waits for its status before
    it asks for the next. Every worker but the current task's is therefore idle, and stopping the
    workers of other runs when a task arrives never cuts a task short. The cost is with two runs
    that interleave at one site (two runs at once on the SuperLink, both sending messages to this
    node): each switch of run stops the other run's worker and gives this run a new one, so every
    message after a switch loads the app and the data again (the standby has done the imports,
    and the next standby's imports run beside it), as with Flower's own process per message,
    instead of once per run.
    """

    def __init__(self, client: RuntimeHttpClient, endpoint: RuntimeEndpoint, poll_interval: float,
                 options: WorkerOptions = WorkerOptions(), idle_timeout: float = 300,
                 main: WorkerMain = worker_main, deadline: TaskDeadline = TaskDeadline(),
                 task_client: Callable[[str], RuntimeHttpClient] | None = None) -> None:
        self.client = client
        self.endpoint = endpoint
        self.poll_interval = poll_interval
        self.options = options
        self.idle_timeout = idle_timeout  # seconds without a task before a run's worker stops; 0: never
        self.main = main
        self.deadline = deadline
        self.task_client = task_client or endpoint.task_client  # answers a task whose worker was ended
        self.workers: dict[RunKey, Worker] = {}
        # Started ahead, importing the preload modules while the node waits for work; the next new
        # run takes it.
        self.standby: Worker | None = None
        self.standby_due = False
        self._start_standby()

    def _start_standby(self) -> None:
        if self.standby is not None and not self.standby.process.is_alive():
            log(WARNING, "Standby ClientApp worker (pid %d) died (exit code %s)", self.standby.process.pid,
                self.standby.process.exitcode)
            self.standby.stop()
            self.standby = None
        if self.standby is None:
            self.standby = Worker(self.endpoint, self.options, self.main)
            log(INFO, "Standby ClientApp worker (pid %d) started", self.standby.process.pid)
        self.standby_due = False

    def _new_worker(self) -> Worker:
        """The standby if it is alive, else a fresh worker (which pays the imports)."""
        worker, self.standby = self.standby, None
        if worker is not None and worker.process.is_alive():
            return worker
        if worker is not None:
            worker.stop()
        return Worker(self.endpoint, self.options, self.main)

    def worker_for(self, run_key: RunKey) -> Worker:
        for other in [key for key in self.workers if key != run_key]:
            self.retire(other, f"a task of {run_key} arrived")
        worker = self.workers.get(run_key)
        if worker is not None and not worker.process.is_alive():
            log(WARNING, "ClientApp worker (pid %d) of %s died (exit code %s); starting a new one",
                worker.process.pid, run_key, worker.process.exitcode)
            self.workers.pop(run_key).stop()
            worker = None
        if worker is None:
            worker = self.workers[run_key] = self._new_worker()
            worker.serve(run_key)
            log(INFO, "ClientApp worker (pid %d) serves %s", worker.process.pid, run_key)
        return worker

    def retire(self, run_key: RunKey, reason: str) -> None:
        """Stop ``run_key``'s worker (idle: tasks run one at a time), so that the run's app, data
        and CUDA context leave the site, and have a standby ready for the next run."""
        worker = self.workers.pop(run_key)
        worker.stop()
        log(INFO, "ClientApp worker (pid %d) of %s stopped: %s", worker.process.pid, run_key, reason)
        self.standby_due = True

    def retire_idle(self) -> None:
        """Stop the workers whose run has had no task for ``idle_timeout`` seconds."""
        if self.idle_timeout <= 0:
            return
        now = time.monotonic()
        for run_key in [key for key, worker in self.workers.items() if now - worker.last_task >= self.idle_timeout]:
            self.retire(run_key, f"no task for {self.idle_timeout:g} s")

    def step(self) -> bool:
        """Acquire and run at most one task; True when one ran."""
        response = self.client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        if not (response.HasField("task") and response.token):
            return False
        run_key = RunKey(response.task.run_id, response.task.fab_hash)
        outcome = self.worker_for(run_key).run(response.token, self.deadline)
        if outcome.expired_after is not None:
            self.end_expired(run_key, response.task.task_id, response.token, outcome)
        elif outcome.status is None:
            log(ERROR, "ClientApp worker died while running task %d; the task expires, the next "
                "one gets a new worker", response.task.task_id)
        return True

    def end_expired(self, run_key: RunKey, task_id: int, token: str, outcome: TaskOutcome) -> None:
        """A task ran past its deadline: kill its worker and what it started, answer the task in
        its place, and have a standby ready to serve the run's next task."""
        worker = self.workers.pop(run_key)
        worker.end()
        self.standby_due = True
        seconds = outcome.expired_after or 0.0
        log(ERROR, "ClientApp task %d of %s ran past its deadline of %g s: its worker (pid %d) and the "
            "processes it started were killed; the run's next task gets a new worker", task_id, run_key,
            seconds, worker.process.pid)
        if outcome.started is None:
            log(WARNING, "Task %d's message was not pulled yet: the SuperNode answers it when its token "
                "expires", task_id)
            return
        reason = (f"ClientApp task ran past its deadline of {seconds:g} s at the site "
                  f"({self.deadline.source(outcome.started)}) and was ended")
        try:
            answer_task(self.task_client(token), outcome.started, reason)
        except Exception as ex:  # pylint: disable=broad-exception-caught  # the next task must run
            log(ERROR, "Could not answer task %d in its ended worker's place: %s", task_id, ex)

    def tend(self) -> None:
        """Between tasks: stop the workers of runs gone idle, and start the standby that a stopped
        worker made due. When a task of a new run stopped the old run's worker, the standby starts
        here, after that task, so that its imports do not slow the new run's first message."""
        self.retire_idle()
        if self.standby_due:
            self._start_standby()

    def serve(self) -> None:
        try:
            while True:
                ran = self.step()
                self.tend()
                if not ran:
                    time.sleep(self.poll_interval)
        finally:
            self.close()

    def close(self) -> None:
        """Stop every worker, the standby too, and close the client."""
        for worker in [*self.workers.values(), *([self.standby] if self.standby else [])]:
            worker.stop()
        self.workers, self.standby = {}, None
        self.client.close()


def answer_task(client: RuntimeHttpClient, started: TaskStarted, reason: str) -> None:
    """Answer a task whose worker was ended, as ``flwr-clientapp`` answers a ClientApp that
    raised: an error reply to the task's message, then the task's status ``failed``. No context
    goes with it, so the run's context stays as the last task that finished left it. Finishing
    the task also revokes its token, so that the SuperNode does not answer the run's other
    messages with errors when the token would have expired."""
    try:
        metadata = started.reply_to
        reply = Message(Error(code=ErrorCode.CLIENT_APP_CRASHED, reason=reason),
                        reply_to=Message(RecordDict(), metadata=metadata))
        context = Context(run_id=metadata.run_id, node_id=metadata.dst_node_id, node_config={},
                          state=RecordDict(), run_config={})
        try:
            push_message(client, reply, context)
        finally:
            push_task_output(client, None, SubStatus.FAILED, reason)
    finally:
        client.close()


def runtime_client(endpoint: RuntimeEndpoint, secret: bytes | None) -> RuntimeHttpClient:
    """The executor's own client of the Runtime API: the SuperExec's, signing the methods that the
    SuperNode guards with the shared secret."""
    interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
    if secret:
        interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret,
                                                         protected_methods=_SUPEREXEC_AUTH_METHODS))
    return endpoint.client(*interceptors)


def _exit_with_parent(parent_pid: int, direct: bool = False) -> None:
    """Stop when ``parent_pid`` is gone: the SuperNode that started the executor (like
    ``--parent-pid`` of Flower's), or the executor that started a worker. A worker left behind
    in the middle of a task would hold its memory, its host slot and its data forever (an
    executor that exits this way has no time to stop its workers). ``direct``: ``parent_pid``
    is this process's parent, so that being reparented says it is gone, even if that happened
    before this call or the parent is a zombie."""

    def gone() -> bool:
        if direct:
            return os.getppid() != parent_pid
        try:
            os.kill(parent_pid, 0)
        except ProcessLookupError:
            return True
        return False

    def watch() -> None:
        while not gone():
            time.sleep(1)
        os._exit(0)  # pylint: disable=protected-access

    threading.Thread(target=watch, daemon=True, name="exit-with-parent").start()


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n", maxsplit=1)[0])
    cli.add_argument("--runtime-api-address", default="127.0.0.1:9094",
                     help="the SuperNode's Runtime API (flower-supernode --port)")
    cli.add_argument("--insecure", action="store_true", help="reach the Runtime API without TLS")
    cli.add_argument("--root-certificates", help="CA certificate of the Runtime API's TLS")
    cli.add_argument("--superexec-auth-secret-file", help="the secret shared with the SuperNode (HMAC)")
    cli.add_argument("--poll-interval", type=float, default=0.1,
                     help="seconds between asks for a task while idle (default 0.1)")
    cli.add_argument("--parent-pid", type=int, help="exit when this process is gone")
    cli.add_argument("--preload", default=os.environ.get("FEDPAC_WORKER_PRELOAD", "torch"),
                     help="comma-separated modules a worker imports before its first task (default: torch; "
                          "env FEDPAC_WORKER_PRELOAD)")
    cli.add_argument("--worker-nice", type=int, default=int(os.environ.get("FEDPAC_WORKER_NICE", "0")),
                     help="CPU niceness added to the workers (default 0; env FEDPAC_WORKER_NICE)")
    cli.add_argument("--host-slots", type=int, default=int(os.environ.get("FEDPAC_HOST_SLOTS", "0")),
                     help="ClientApp calls that may run at once among the workers sharing --slots-dir "
                          "(default 0: no limit; env FEDPAC_HOST_SLOTS)")
    cli.add_argument("--slots-dir", type=Path,
                     default=Path(os.environ.get("FEDPAC_HOST_SLOTS_DIR", "/tmp/fedpac-host-slots")),
                     help="folder of the host's slot files, shared by its executors "
                          "(default /tmp/fedpac-host-slots; env FEDPAC_HOST_SLOTS_DIR)")
    cli.add_argument("--run-idle-timeout", default=os.environ.get("FEDPAC_WORKER_IDLE_TIMEOUT", "300"),
                     help="seconds without a task of its run after which a run's worker stops and leaves "
                          "the site's memory, data and GPU (default 300, 0: never; env FEDPAC_WORKER_IDLE_TIMEOUT)")
    cli.add_argument("--task-timeout", default=os.environ.get("FEDPAC_TASK_TIMEOUT", ROUND_TIMEOUT_KEY),
                     help="seconds a task may run before its worker is killed and the task answered with an "
                          f"error: '{ROUND_TIMEOUT_KEY}' (default) for each run's round-timeout ("
                          f"{FALLBACK_TASK_TIMEOUT:g} s until the worker has read it), a number for every task, "
                          "0 for none (env FEDPAC_TASK_TIMEOUT)")
    cli.add_argument("--fab-digest", metavar="PATH", type=Path,
                     help=f"print the digest that the node config's {APPROVED_APPS_KEY} lists for PATH (a .fab "
                          "file, or an app's folder as `flwr run` bundles it) and exit")
    return cli


def idle_timeout_of(value: str) -> float:
    """``--run-idle-timeout`` in seconds, or exit naming the option and its environment variable."""
    seconds = _seconds(value)
    if seconds is None:
        sys.exit(f"warm_executor: --run-idle-timeout (env FEDPAC_WORKER_IDLE_TIMEOUT) must be 0 (never) or a "
                 f"number of seconds, got {value!r}")
    return seconds


def task_deadline_of(value: str) -> TaskDeadline:
    """``--task-timeout``: the run's round-timeout (the word itself), or seconds for every task
    (0: none); else exit naming the option and its environment variable."""
    if value.strip() == ROUND_TIMEOUT_KEY:
        return TaskDeadline()
    seconds = _seconds(value)
    if seconds is None:
        sys.exit(f"warm_executor: --task-timeout (env FEDPAC_TASK_TIMEOUT) must be '{ROUND_TIMEOUT_KEY}' (each "
                 f"run's), 0 (none) or a number of seconds, got {value!r}")
    return TaskDeadline(seconds)


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if args.fab_digest is not None:
        if not args.fab_digest.exists():
            sys.exit(f"warm_executor: --fab-digest {args.fab_digest}: no such file or folder")
        print(fab_digest_of(args.fab_digest))
        return
    if not 0.01 <= args.poll_interval <= 60:
        sys.exit(f"warm_executor: --poll-interval must be between 0.01 and 60 s, got {args.poll_interval}")
    idle_timeout = idle_timeout_of(args.run_idle_timeout)
    deadline = task_deadline_of(args.task_timeout)
    endpoint = RuntimeEndpoint(
        args.runtime_api_address,
        args.insecure,
        validate_and_resolve_root_certificates(args.root_certificates, args.insecure),
    )
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    log(INFO, "Warm ClientApp executor on the Runtime API at %s", args.runtime_api_address)
    if args.host_slots < 0:
        sys.exit(f"warm_executor: --host-slots must be 0 (no limit) or more, got {args.host_slots}")
    options = WorkerOptions(tuple(name.strip() for name in args.preload.split(",") if name.strip()),
                            max(0, args.worker_nice), HostSlots(args.slots_dir, args.host_slots))
    client = runtime_client(endpoint, load_superexec_auth_secret(args.superexec_auth_secret_file))
    WarmExecutor(client, endpoint, args.poll_interval, options, idle_timeout, deadline=deadline).serve()


if __name__ == "__main__":
    main()
