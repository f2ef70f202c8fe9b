"""The SuperLink's SuperExec, started again whenever it exits while the SuperLink runs.

With subprocess isolation (``deploy/superlink.sh``), Flower 1.39's SuperLink starts one
``flower-superexec`` process at start-up and never looks at it again. That process is the only
thing that turns a submitted run into a running ServerApp, and it ends on the first Runtime API
answer it does not retry (any HTTP status but 503 and 504, a transport error whose message
mentions TLS or SSL, as a handshake that times out on a loaded host does) and on any error while
launching a ServerApp. From then on every run submitted stays ``pending`` for good, with nothing
in ``flwr ls`` or the SuperLink's log that says why, until someone restarts the SuperLink.

``install`` makes the SuperLink watch its SuperExec: when it exits, the SuperLink logs its exit
code and starts a new one, after a pause that doubles (1 s up to a minute) while the new ones
keep exiting within a minute, so a SuperExec that cannot start does not spin. A run that was
pending starts as soon as the new SuperExec asks for work. The compose cluster needs none of
this: there the SuperExec is its own container, which Docker restarts.
"""

from __future__ import annotations

import subprocess
import threading
import time
from collections.abc import Callable
from logging import WARNING

from flower_pin import require_flower

# Before Flower's internals are imported: on another Flower release, a clear refusal.
require_flower("deploy/supervised_superexec.py")

from flwr.supercore import log  # noqa: E402
from flwr.superlink.cli.flower_superlink import SuperLinkLifespan  # noqa: E402

LONGEST_PAUSE = 60.0  # seconds between restarts of a SuperExec that keeps exiting at once
STEADY = 60.0  # a SuperExec that ran this long exited for a reason of its moment: restart at once


def restart_pause(previous: float, lifetime: float) -> float:
    """Seconds to wait before starting the next SuperExec, after one that ran ``lifetime``
    seconds and was started after a pause of ``previous`` (0 for the first)."""
    if lifetime >= STEADY:
        return 1.0
    return min(LONGEST_PAUSE, max(1.0, 2 * previous))


def install(interval: float = 1.0) -> None:
    """Patch ``SuperLinkLifespan`` so that its SuperExec is checked every ``interval`` seconds
    and started again when it has exited (before ``flower_superlink()`` starts the SuperLink)."""
    start: Callable[[SuperLinkLifespan], None] = SuperLinkLifespan._start_superexec_if_needed  # noqa: SLF001
    shutdown: Callable[[SuperLinkLifespan], None] = SuperLinkLifespan.shutdown

    def start_supervised(lifespan: SuperLinkLifespan) -> None:
        start(lifespan)
        if lifespan.superexec_process is not None:
            lifespan._fedpac_stopping = threading.Event()  # type: ignore[attr-defined]  # noqa: SLF001
            threading.Thread(target=_watch, args=(lifespan, start, interval), name="superexec-watch",
                             daemon=True).start()

    def shutdown_unsupervised(lifespan: SuperLinkLifespan) -> None:
        stopping = getattr(lifespan, "_fedpac_stopping", None)
        if stopping is not None:
            stopping.set()  # before Flower terminates the SuperExec: that exit is not to be undone
        shutdown(lifespan)

    SuperLinkLifespan._start_superexec_if_needed = start_supervised  # type: ignore[method-assign]  # noqa: SLF001
    SuperLinkLifespan.shutdown = shutdown_unsupervised  # type: ignore[method-assign]


def _watch(lifespan: SuperLinkLifespan, start: Callable[[SuperLinkLifespan], None], interval: float) -> None:
    stopping: threading.Event = lifespan._fedpac_stopping  # type: ignore[attr-defined]  # noqa: SLF001
    started, pause = time.monotonic(), 0.0
    while not stopping.wait(interval):
        process: subprocess.Popen[bytes] | None = lifespan.superexec_process
        if process is None or process.poll() is None:
            continue
        pause = restart_pause(pause, time.monotonic() - started)
        log(WARNING, "The SuperExec exited with code %s (a submitted run would stay pending); "
            "starting a new one in %.0f s", process.returncode, pause)
        if stopping.wait(pause):
            return
        start(lifespan)
        started = time.monotonic()
