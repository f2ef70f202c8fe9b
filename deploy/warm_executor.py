"""A warm SuperExec for a SuperNode's ClientApp tasks: the app is loaded once per run, not once
per message.

Flower 1.39's ``flower-superexec`` starts a fresh ``flwr-clientapp`` process for every message a
SuperNode receives; each one imports torch and Flower again and loads the node's data again
(about 5 s on a 2-core CPU, before any training; on a GPU it would also initialise CUDA again).
This executor takes the SuperExec's place (``flower-supernode --isolation process``) and hands
every task to a long-lived worker process that keeps the ClientApp, torch, the CUDA context and
the node's decoded data resident, the way the simulation's Ray actors do.

What stays as in Flower:

* the tasks come from the SuperNode's Runtime API, acquired with the node's SuperExec secret
  (HMAC), and each task runs with its own one-time token: pull the message, context, run and FAB,
  call the ClientApp, push the reply and the task's status, heartbeats while it runs;
* the ClientApp code is the run's FAB, installed under ``$FLWR_HOME`` like ``flwr-clientapp``
  does; a worker serves one FAB (one app version), so a new run with other code gets a new
  worker, and idle workers of older FABs are stopped;
* the worker is this executor's child, reached only through an inherited pipe (no socket);
* a ClientApp that raises becomes an error reply, exactly as in ``flwr-clientapp``; a worker
  that dies (killed, out of memory) is replaced for the next task.

Run it next to a SuperNode started with ``--isolation process`` (``deploy/supernode.sh`` does)::

    python deploy/warm_executor.py --runtime-api-address 127.0.0.1:9094 --insecure \
        --superexec-auth-secret-file supernode-0.secret

Several SuperNodes on one host (a compose cluster, a test bed) can share ``--host-slots N``
training slots (``--slots-dir``, file locks): at most N ClientApp calls of the host's workers run
at once, like the simulation gives each client one of the host's CPUs. Twenty processes that
train at once on 2 cores did the same 20 local updates 2.4 times slower than two at a time.

This file imports only Flower (and the standard library), so it runs in any environment that
can run the app, and the container images carry it as it is.
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import importlib
import multiprocessing
import os
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from logging import ERROR, INFO, WARNING
from multiprocessing.connection import Connection
from pathlib import Path

import httpx
from flwr.app import Message
from flwr.app.error import Error
from flwr.cli.install import install_from_fab
from flwr.clientapp.client_app import ClientApp, LoadClientAppError
from flwr.clientapp.utils import get_load_client_app_fn
from flwr.common.constant import ErrorCode, SubStatus
from flwr.proto.runtime_pb2 import AcquireTaskRequest, SendTaskHeartbeatRequest  # pylint: disable=E0611
from flwr.supercore import log
from flwr.supercore.auth.superexec_secret import load_superexec_auth_secret
from flwr.supercore.constant import TaskType
from flwr.supercore.heartbeat import HeartbeatSender
from flwr.supercore.interceptors import (
    RuntimeTokenHttpInterceptor,
    RuntimeVersionHttpInterceptor,
    SuperExecAuthHttpInterceptor,
)
from flwr.supercore.retry import make_simple_http_retry_invoker
from flwr.supercore.runtime import RuntimeHttpClient
from flwr.supercore.tls import validate_and_resolve_root_certificates
from flwr.supernode.runtime.run_clientapp import pull_task_input, push_message, push_task_output

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

    def client(self, *interceptors) -> RuntimeHttpClient:  # noqa: ANN002
        return RuntimeHttpClient.from_server_address(
            server_address=self.address,
            insecure=self.insecure,
            root_certificates=self.root_certificates,
            interceptors=list(interceptors),
            retry_invoker=make_simple_http_retry_invoker(),
        )


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


# ---------------------------------------------------------------------------- worker side


def _heartbeat_fn(client: RuntimeHttpClient):  # noqa: ANN202
    """Flower's task heartbeat, except that a refused heartbeat ends the task, not the worker
    (``flwr-clientapp`` raises SIGINT, which here would stop every later task too)."""
    request = SendTaskHeartbeatRequest()

    def send() -> bool:
        try:
            return bool(client.SendTaskHeartbeat(request).success)
        except httpx.HTTPError:
            return False

    return send


class TaskRunner:
    """Runs ClientApp tasks one after another in this process, the app loaded once per FAB."""

    def __init__(self, endpoint: RuntimeEndpoint, slots: HostSlots = HostSlots()) -> None:
        self.endpoint = endpoint
        self.slots = slots
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
            app = self.app_for(run.fab_id, run.fab_version, fab.hash_str, fab.content)
            with self.slots.held():  # the heartbeats go on while the task waits for a slot
                reply = app(message=message, context=context)
            sub_status, details = SubStatus.COMPLETED, ""
        except Exception as ex:  # pylint: disable=broad-exception-caught  # as flwr-clientapp
            code, reason = ErrorCode.CLIENT_APP_RAISED_EXCEPTION, f"{type(ex)}:<'{ex}'>"
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
    runner = TaskRunner(endpoint, options.slots)
    while True:
        try:
            token = connection.recv()
        except EOFError:  # the executor is gone
            return
        connection.send(runner.run(token))


# ---------------------------------------------------------------------------- executor side


class Worker:
    """A worker process for one FAB, and the pipe to it."""

    def __init__(self, fab_hash: str, endpoint: RuntimeEndpoint, options: WorkerOptions) -> None:
        context = multiprocessing.get_context("spawn")  # no inherited threads or locks
        self.fab_hash = fab_hash
        self.connection, child = context.Pipe()
        self.process = context.Process(target=worker_main, args=(child, endpoint, options, os.getpid()),
                                       daemon=True, name="clientapp-worker")
        self.process.start()
        child.close()

    def run(self, token: str) -> str | None:
        """Hand a task over and wait for it; None when the worker died on it."""
        try:
            self.connection.send(token)
            while not self.connection.poll(1.0):
                if not self.process.is_alive():
                    return None
            return str(self.connection.recv())
        except (EOFError, BrokenPipeError, ConnectionResetError):
            return None

    def stop(self) -> None:
        self.connection.close()
        self.process.join(timeout=10)
        if self.process.is_alive():
            self.process.kill()
            self.process.join()


class WarmExecutor:
    """Acquires the SuperNode's ClientApp tasks and runs them in warm workers, one per FAB."""

    def __init__(self, endpoint: RuntimeEndpoint, secret: bytes | None, poll_interval: float,
                 options: WorkerOptions = WorkerOptions()) -> None:
        self.endpoint = endpoint
        self.poll_interval = poll_interval
        self.options = options
        interceptors = [RuntimeVersionHttpInterceptor(component_name="SuperExec")]
        if secret:
            interceptors.append(SuperExecAuthHttpInterceptor(master_secret=secret,
                                                             protected_methods=_SUPEREXEC_AUTH_METHODS))
        self.client = endpoint.client(*interceptors)
        self.workers: dict[str, Worker] = {}
        # One worker started ahead, importing the preload modules while the node waits for work;
        # the first app version to arrive takes it.
        self.standby: Worker | None = self._start_worker("")

    def _start_worker(self, fab_hash: str) -> Worker:
        return Worker(fab_hash, self.endpoint, self.options)

    def worker_for(self, fab_hash: str) -> Worker:
        worker = self.workers.get(fab_hash)
        if worker is None or not worker.process.is_alive():
            if worker is not None:
                log(WARNING, "ClientApp worker for FAB %s died (exit code %s); starting a new one",
                    fab_hash[:8], worker.process.exitcode)
            if self.standby is not None and self.standby.process.is_alive():
                worker, self.standby = self.standby, None
                worker.fab_hash = fab_hash
            else:
                worker = self._start_worker(fab_hash)
            self.workers[fab_hash] = worker
            log(INFO, "ClientApp worker (pid %d) serves FAB %s", worker.process.pid, fab_hash[:8])
        self._retire_old(keep=fab_hash)
        return worker

    def _retire_old(self, keep: str) -> None:
        """Stop the workers of other FABs (idle: tasks run one at a time), so that an old run's
        app leaves memory."""
        for fab_hash in [h for h in self.workers if h != keep]:
            self.workers.pop(fab_hash).stop()

    def step(self) -> bool:
        """Acquire and run at most one task; True when one ran."""
        response = self.client.AcquireTask(AcquireTaskRequest(supported_task_types=[TaskType.CLIENT_APP]))
        if not (response.HasField("task") and response.token):
            return False
        status = self.worker_for(response.task.fab_hash).run(response.token)
        if status is None:
            log(ERROR, "ClientApp worker died while running task %d; the task expires, the next "
                "one gets a new worker", response.task.task_id)
        return True

    def serve(self) -> None:
        try:
            while True:
                if not self.step():
                    time.sleep(self.poll_interval)
        finally:
            for worker in [*self.workers.values(), *([self.standby] if self.standby else [])]:
                worker.stop()
            self.client.close()


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
    return cli


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    if not 0.01 <= args.poll_interval <= 60:
        sys.exit(f"warm_executor: --poll-interval must be between 0.01 and 60 s, got {args.poll_interval}")
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
    WarmExecutor(endpoint, load_superexec_auth_secret(args.superexec_auth_secret_file), args.poll_interval,
                 options).serve()


if __name__ == "__main__":
    main()
