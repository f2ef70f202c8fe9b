"""The SuperLink's SuperExec is started again when it exits (``deploy/supervised_superexec.py``).

Without it, Flower's SuperLink (subprocess isolation) runs with a dead SuperExec after the first
Runtime API answer the SuperExec does not retry, and every run submitted stays ``pending``. These
tests drive Flower's own ``SuperLinkLifespan`` with a stand-in SuperExec command that exits at
once; the real one is killed in a deployment by
``test_deployment.py::test_tls_federation_with_node_auth_trains_on_local_data_and_refuses_an_unregistered_node``.
"""

from __future__ import annotations

import importlib
import logging
import sys
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from flwr.common.constant import ISOLATION_MODE_SUBPROCESS
from flwr.superlink.cli.flower_superlink import SuperLinkLifespan

from tests.deployment import ROOT

# the module, which its package's ``flower_superlink`` (the command's function) shadows
flower_superlink = importlib.import_module("flwr.superlink.cli.flower_superlink")

sys.path.insert(0, str(ROOT / "deploy"))
import supervised_superexec  # noqa: E402  pylint: disable=wrong-import-position
from supervised_superexec import LONGEST_PAUSE, restart_pause  # noqa: E402  pylint: disable=wrong-import-position

# a stand-in SuperExec: it notes each start in a file; the first ``exits`` starts exit with code 3,
# the later ones wait to be terminated
STAND_IN = """
import sys, time
from pathlib import Path
starts = Path(sys.argv[1])
starts.write_text(starts.read_text() + "x" if starts.exists() else "x")
if len(starts.read_text()) <= int(sys.argv[2]):
    sys.exit(3)
time.sleep(60)
"""


def test_the_pause_doubles_while_superexecs_exit_at_once_and_resets_after_a_steady_one():
    pauses, pause = [], 0.0
    for _ in range(9):
        pause = restart_pause(pause, lifetime=0.5)
        pauses.append(pause)
    assert pauses == [1, 2, 4, 8, 16, 32, LONGEST_PAUSE, LONGEST_PAUSE, LONGEST_PAUSE]
    assert restart_pause(LONGEST_PAUSE, lifetime=120) == 1


@pytest.fixture
def lifespan(monkeypatch, tmp_path) -> SuperLinkLifespan:
    """Flower's SuperLink lifespan with subprocess isolation, its SuperExec the stand-in (exits
    once at start), supervised as ``patient_superlink.main`` installs it; restored after."""
    for name in ("_start_superexec_if_needed", "shutdown"):
        monkeypatch.setattr(SuperLinkLifespan, name, getattr(SuperLinkLifespan, name))
    starts = tmp_path / "starts"
    config = SimpleNamespace(isolation=ISOLATION_MODE_SUBPROCESS, host="127.0.0.1", port=1, certificates=None,
                             ssl_ca_certfile=None, runtime_dependency_install=False)
    link = SuperLinkLifespan(config, SimpleNamespace(objectstore_factory=None))  # type: ignore[arg-type]
    link.starts, link.exits = starts, 1  # type: ignore[attr-defined]
    monkeypatch.setattr(flower_superlink, "_get_superexec_command",
                        lambda **_: [sys.executable, "-c", STAND_IN, str(starts), str(link.exits)])  # type: ignore[attr-defined]
    supervised_superexec.install(interval=0.05)
    yield link
    link.shutdown()


def wait_for(condition, timeout: float = 10.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_superexec_that_exits_is_started_again_and_the_exit_is_logged(lifespan, caplog):
    starts: Path = lifespan.starts  # type: ignore[attr-defined]
    with caplog.at_level(logging.WARNING, logger="flwr"):
        lifespan._start_superexec_if_needed()  # noqa: SLF001  # what the SuperLink does at start-up
        assert wait_for(lambda: starts.exists() and len(starts.read_text()) == 2), "no second SuperExec"
        assert wait_for(lambda: lifespan.superexec_process is not None and lifespan.superexec_process.poll() is None)
    assert any("SuperExec exited with code 3" in record.getMessage() for record in caplog.records), caplog.text


def test_a_superexec_the_superlink_stops_stays_stopped(lifespan):
    starts: Path = lifespan.starts  # type: ignore[attr-defined]
    lifespan.exits = 0  # type: ignore[attr-defined]  # a steady SuperExec: the first pause after its exit is 1 s
    lifespan._start_superexec_if_needed()  # noqa: SLF001
    process = lifespan.superexec_process
    # its start noted (write_text makes the file before it writes to it)
    assert process is not None and wait_for(lambda: starts.exists() and starts.read_text() == "x")
    lifespan.shutdown()
    assert process.poll() is not None
    # the watcher has ended: it can neither undo this stop nor outlive the SuperLink
    assert wait_for(lambda: not any(t.name == "superexec-watch" and t.is_alive() for t in threading.enumerate()))
    time.sleep(1.2)  # longer than the pause after a steady SuperExec's exit
    assert starts.read_text() == "x" and lifespan.superexec_process is None


def test_a_superlink_without_subprocess_isolation_starts_no_superexec(lifespan):
    lifespan.config.isolation = "process"
    lifespan._start_superexec_if_needed()  # noqa: SLF001
    time.sleep(0.2)
    assert lifespan.superexec_process is None and not lifespan.starts.exists()  # type: ignore[attr-defined]
