"""Deployment mode on localhost: a SuperLink and SuperNodes as separate processes, talking
Flower's gRPC Fleet API (no simulation, no Ray), driven by `flwr run . <connection>`."""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
pytestmark = pytest.mark.e2e


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalFederation:
    """A SuperLink and N SuperNodes on 127.0.0.1, each its own process."""

    def __init__(self, workdir: Path, num_nodes: int) -> None:
        self.workdir = workdir
        self.num_nodes = num_nodes
        self.control_port, self.fleet_port = _free_port(), _free_port()
        self.env = {
            **os.environ,
            "FLWR_HOME": str(workdir / "flwr-home"),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        (workdir / "flwr-home").mkdir(parents=True)
        (workdir / "flwr-home" / "config.toml").write_text(
            '[superlink]\ndefault = "local-deployment"\n\n[superlink.local-deployment]\n'
            f'address = "127.0.0.1:{self.control_port}"\ninsecure = true\n'
        )
        self.superlink = self._spawn(
            "superlink", [str(BIN / "flower-superlink"), "--insecure", "--database", str(workdir / "state.db"),
                          "--port", str(self.control_port), "--fleet-api-address", f"127.0.0.1:{self.fleet_port}"])
        self.supernodes: dict[int, subprocess.Popen] = {}
        self.node_ports = {pid: _free_port() for pid in range(num_nodes)}
        time.sleep(2)
        for pid in range(num_nodes):
            self.start_node(pid)

    def _spawn(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115  # closed with the process
        return subprocess.Popen(command, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)

    def start_node(self, pid: int) -> None:
        self.supernodes[pid] = self._spawn(
            f"supernode-{pid}",
            [str(BIN / "flower-supernode"), "--insecure", "--superlink", f"127.0.0.1:{self.fleet_port}",
             "--node-config", f"partition-id={pid} num-partitions={self.num_nodes}",
             "--port", str(self.node_ports[pid])],
        )

    def kill_node(self, pid: int) -> None:
        os.killpg(self.supernodes[pid].pid, signal.SIGKILL)
        self.supernodes[pid].wait()

    def flwr(self, *args: str, timeout: float = 120) -> str:
        return subprocess.run([str(BIN / "flwr"), *args], env=self.env, capture_output=True, text=True,
                              timeout=timeout, check=True).stdout

    def submit(self, run_config: str) -> str:
        out = self.flwr("run", str(ROOT), "local-deployment", "--format", "json", "--run-config", run_config)
        return str(json.loads(out[out.index("{"):])["run-id"])

    def status(self, run_id: str) -> str:
        out = self.flwr("ls", "local-deployment", "--run-id", run_id, "--format", "json")
        return json.loads(out[out.index("{"):])["runs"][0]["status"]

    def wait(self, run_id: str, timeout: float = 600) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if status.startswith("finished"):
                return status
            time.sleep(2)
        raise AssertionError(f"run {run_id} still {status} after {timeout}s")

    def log(self, run_id: str) -> str:
        return subprocess.run([str(BIN / "flwr"), "log", run_id, "local-deployment", "--show"], env=self.env,
                              capture_output=True, text=True).stdout

    def close(self) -> None:
        for process in [*self.supernodes.values(), self.superlink]:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in [*self.supernodes.values(), self.superlink]:
            try:
                process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)


@pytest.fixture
def federation(tmp_path):
    fed = LocalFederation(tmp_path, num_nodes=3)
    yield fed
    fed.close()


SMALL = "samples-per-client=100 test-samples-per-client=50 local-epochs=1"


def _rounds(out: Path) -> list[dict]:
    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    path = run_dir / "rounds.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def test_a_supernode_killed_mid_run_rejoins_and_keeps_its_partition(federation, tmp_path):
    out = tmp_path / "out"
    run_id = federation.submit(
        f"{SMALL} num-server-rounds=4 min-train-replies=2 min-available-clients=3 round-timeout=90 "
        f"output-dir='{out}'"
    )
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and not (out.exists() and any(out.iterdir()) and _rounds(out)):
        time.sleep(1)
    assert _rounds(out), federation.log(run_id)[-3000:]
    federation.kill_node(2)  # mid-run: after round 1, while round 2 is starting
    time.sleep(3)
    federation.start_node(2)
    status = federation.wait(run_id)
    log = federation.log(run_id)
    assert status == "finished:completed", log[-3000:]
    rounds = _rounds(out)
    assert [int(r["round"]) for r in rounds] == [1, 2, 3, 4]
    assert int(rounds[-1]["num_trained"]) == 3  # the restarted node trains again, as partition 2
    assert "partition-id 2 moved from node" in log
    assert float(rounds[-1]["mean_accuracy"]) > float(rounds[0]["mean_accuracy"])
