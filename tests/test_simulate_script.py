"""deploy/simulate.sh, what `make run` runs: its exit status is the run's, since `flwr run` itself
exits 0 even when the run fails (README, "Quick start"). A caller (make, CI, a shell script)
sees 0 only for a finished run, and the run's status on the script's last line either way. And
the local SuperLink it started is gone when it returns: two runs in a row each stop their own.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.deployment import LOCAL_SUPERLINK

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = [pytest.mark.e2e, LOCAL_SUPERLINK]

# One round on two clients of a few embedded images: the script's behaviour, not learning.
TINY = ("num-server-rounds=1 samples-per-client=20 test-samples-per-client=10 min-train-per-class=1 "
        "min-test-per-class=1 local-epochs=1 batch-size=10")


@pytest.fixture(scope="module")
def script_env(tmp_path_factory):
    """Its own FLWR_HOME, this environment's `flwr` first on PATH (as `make run` sets it), and no
    local SuperLink already on Flower's machine-wide ports: the script would hand its run to it."""
    deadline = time.monotonic() + 20  # one that an earlier test stopped may still be shutting down
    while running := subprocess.run(["pgrep", "-af", "flower-superlink.*--simulation"], capture_output=True,
                                    text=True).stdout.splitlines():
        if time.monotonic() > deadline:
            break
        time.sleep(0.5)
    if running:
        pytest.fail("a local SuperLink is running (another test or `make run`?); stop it and run again:\n"
                    + "\n".join(running), pytrace=False)
    return {
        **os.environ,
        "FLWR_HOME": str(tmp_path_factory.mktemp("flwr-home")),
        "FLWR_TELEMETRY_ENABLED": "0",
        "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        # a narrow terminal: the script finds the SuperLink it started by its whole command line,
        # which ps cuts at the terminal's width unless told not to
        "COLUMNS": "80",
    }


def local_superlinks(env: dict) -> list[str]:
    """The local SuperLinks keeping their state in this test's FLWR_HOME."""
    return subprocess.run(["pgrep", "-af", f"flower-superlink.*{env['FLWR_HOME']}"], capture_output=True,
                          text=True).stdout.splitlines()


def simulate(env: dict, run_config: str) -> subprocess.CompletedProcess:
    result = subprocess.run(["bash", str(ROOT / "deploy" / "simulate.sh"), "--clients", "2", "--run-config",
                             run_config], env=env, capture_output=True, text=True, timeout=600)
    # Gone, not only told to stop: a SuperLink still shutting down when the next `make run` looks
    # passes for one already running, which that run then does not stop.
    assert not local_superlinks(env), "simulate.sh returned with its SuperLink still running"
    return result


def last_line(result: subprocess.CompletedProcess) -> str:
    lines = result.stdout.strip().splitlines()
    return lines[-1] if lines else ""


def test_a_finished_run_exits_0(script_env, tmp_path):
    result = simulate(script_env, f"{TINY} output-dir='{tmp_path}'")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert last_line(result).endswith(": finished:completed")
    (run_dir,) = list(tmp_path.iterdir())
    assert json.loads((run_dir / "status.json").read_text())["state"] == "finished"


def test_a_failed_run_exits_non_zero_and_says_so(script_env, tmp_path):
    """A run config the ServerApp refuses: `flwr run` submits the run and returns 0, the run ends
    failed before training, and the script's exit status says so."""
    result = simulate(script_env, f"{TINY} uniform-share=150.0 output-dir='{tmp_path}'")
    assert result.returncode != 0, result.stdout[-3000:]
    assert last_line(result).endswith(": finished:failed"), result.stdout[-3000:] + result.stderr[-3000:]
    assert not any(tmp_path.iterdir())  # refused before any round


def test_a_local_superlink_on_another_ray_is_refused(script_env, tmp_path):
    """The local SuperLink passes its environment to the simulation, which starts Ray: one started
    for another cluster (or for a Ray of its own) would run this run's ClientApps there."""
    superlink = BIN / "flower-superlink"
    env = {**script_env, "RAY_ADDRESS": "10.0.0.1:6390"}
    stand_in = subprocess.Popen(["bash", "-c", f'exec -a "{superlink} --simulation" sleep 60'], env=env)
    try:
        while not subprocess.run(["pgrep", "-f", f"^{superlink} --simulation"], capture_output=True).stdout:
            time.sleep(0.1)
        result = subprocess.run(["bash", str(ROOT / "deploy" / "simulate.sh"), "--clients", "2", "--run-config",
                                 f"{TINY} output-dir='{tmp_path}'"], env=script_env, capture_output=True, text=True,
                                timeout=60)
    finally:
        stand_in.kill()
        stand_in.wait()
    assert result.returncode == 1
    assert f"PID {stand_in.pid}) runs its simulations on Ray at '10.0.0.1:6390', not at 'local'" in result.stderr
    assert not any(tmp_path.iterdir())
