"""The simulation on a Ray cluster of two hosts (README, "Beyond one machine").

The head host (Ray's head node and the local SuperLink, which runs the ServerApp) and a worker
host each get a network namespace of their own. The worker also gets a mount namespace that hides
this checkout, the head's home and run outputs, the machine's /tmp and the installed datasets:
all it has is the Python environment (as a worker host has its own install of
requirements.lock), at another path. Its ClientApps must then get the run's code from Ray
(``server_app/ray_cluster.py``), and its clients' training must give the same final model, bit
for bit, as the same run on one machine.

The run is differentially private: each client logs its epsilon with its partition and round
in its Ray worker's log, on the host that trained it, which shows where every client ran; and
the DP noise, drawn from each site's secret (the same on every host here), must not depend on
where a client runs. A site's privacy ledger is a file on the host that trained it: a partition
that trains on two hosts keeps two ledgers (docs/PERFORMANCE.md, "Beyond one machine"), so its
epsilon there is at most the one-host run's.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from common.site_privacy import privacy_folder
from server_app.ray_cluster import ship_app
from tests.deployment import LOCAL_SUPERLINK, SMALL, rounds_of, run_dir
from tests.netns import VirtualNetwork
from tests.prerequisites import require_root_networking, require_tools

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
RAY_PORT = 6390
CLIENTS = 4
RUN_CONFIG = f"{SMALL} num-server-rounds=2 dp=true"
TRAINED = re.compile(r"partition (\d+), round (\d+): differential privacy epsilon")


def _short_dir(prefix: str) -> Path:
    """Ray's sockets live under its temp dir, and a Unix socket path has at most 107 bytes."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))


def worker_script(environment: Path, root: Path, hidden: list[Path], head: str) -> str:
    """The worker host: its own /tmp (``root``), the Python environment at ``root/env``, every
    path in ``hidden`` empty, and a check that it can import none of the app before Ray starts."""
    python = f"/tmp/env/{Path(sys.executable).relative_to(environment)}"
    lines = ["set -euo pipefail",
             f"mkdir -p {root}/env {root}/home",
             f"mount --bind {shlex.quote(str(environment))} {root}/env"]
    lines += [f"mount -t tmpfs hidden {shlex.quote(str(path))}" for path in hidden]
    lines += [f"mount --rbind {root} /tmp", "cd /tmp/home",
              f'if {python} -c "import client_app" 2>/dev/null || [ -e {shlex.quote(str(ROOT))}/pyproject.toml ]; then',
              '  echo "the worker host sees the app" >&2; exit 97', "fi",
              f"exec env -i HOME=/tmp/home PATH=/tmp/env/bin:/usr/bin:/bin {python} -m ray.scripts.scripts start"
              f" --address {head}:{RAY_PORT} --num-cpus 1 --disable-usage-stats --block"]
    return "\n".join(lines)


class TwoHostCluster:
    """A Ray head node on host ``head`` and a worker node on host ``worker``, each `ray start
    --block` in a process group of its own, stopped by signal (``ray stop`` would stop every Ray
    on this machine)."""

    def __init__(self, network: VirtualNetwork, home: Path, hidden: list[Path]) -> None:
        self.network = network
        self.address = f"{network.addresses['head']}:{RAY_PORT}"
        self.head_tmp, self.worker_tmp = _short_dir("fprh"), _short_dir("fprw")
        self.env = {**os.environ, "HOME": str(home), "PATH": f"{BIN}{os.pathsep}{os.environ['PATH']}",
                    "FLWR_TELEMETRY_ENABLED": "0"}
        self.env.pop("RAY_ADDRESS", None)
        self.env.pop("FLWR_HOME", None)  # each host's is its HOME's, as the worker host's is
        self.processes: list[subprocess.Popen] = []
        try:  # a cluster that fails to come up leaves no Ray behind
            self.processes.append(self._spawn(
                "head", [str(BIN / "ray"), "start", "--head", "--block", "--port", str(RAY_PORT),
                         "--node-ip-address", network.addresses["head"], "--temp-dir", str(self.head_tmp),
                         "--num-cpus", "1", "--include-dashboard", "false", "--disable-usage-stats"]))
            self.wait_for_nodes(1)
            script = worker_script(Path(sys.prefix), self.worker_tmp, hidden, network.addresses["head"])
            self.processes.append(self._spawn("worker", ["unshare", "--mount", "--propagation", "private",
                                                         "bash", "-c", script]))
            self.wait_for_nodes(2)
        except BaseException:
            self.close()
            raise

    def _spawn(self, host: str, command: list[str]) -> subprocess.Popen:
        log = (self.head_tmp if host == "head" else self.worker_tmp).with_suffix(".log").open("w")
        return subprocess.Popen([*self.network.prefix(host), *command], env=self.env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def logs(self) -> str:
        return "\n".join(f"--- {tmp}:\n" + tmp.with_suffix(".log").read_text()[-3000:]
                         for tmp in (self.head_tmp, self.worker_tmp))

    def wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            assert all(p.poll() is None for p in self.processes), self.logs()
            status = subprocess.run([*self.network.prefix("head"), str(BIN / "ray"), "status", "--address",
                                     self.address], env=self.env, capture_output=True, text=True, check=False)
            if status.returncode == 0 and status.stdout.count(" node_") >= count:
                return
            time.sleep(2)
        pytest.fail(f"the Ray cluster has fewer than {count} nodes after {timeout:.0f} s\n{self.logs()}")

    def trained(self, tmp: Path) -> set[tuple[int, int]]:
        """(partition, round) of every client a host's Ray workers trained, from their logs."""
        # A worker node takes its temp dir's path from the head (/tmp/fprh... in its own /tmp), and
        # its session_latest links to that path as the worker sees it: the head's, seen from here.
        return {(int(p), int(r)) for log in tmp.glob("**/session_2*/logs/worker-*.err")
                for p, r in TRAINED.findall(log.read_text(errors="replace"))}

    def close(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        # Ray's own processes of this cluster (raylet, GCS, workers), should any outlive `ray start`
        for tmp in (self.head_tmp, self.worker_tmp):
            subprocess.run(["pkill", "-9", "-f", str(tmp)], check=False)
        for tmp in (self.head_tmp, self.worker_tmp):
            tmp.with_suffix(".log").unlink(missing_ok=True)
        shutil.rmtree(self.head_tmp, ignore_errors=True)
        shutil.rmtree(self.worker_tmp, ignore_errors=True)


@pytest.fixture
def network() -> Iterator[VirtualNetwork]:
    require_root_networking()
    require_tools("unshare")
    net = VirtualNetwork(f"r{os.getpid() % 1000}", ("head", "worker"), subnet="10.213.78")
    yield net
    net.close()


def simulate(env: dict, out: Path, *args: str, prefix: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    result = subprocess.run([*prefix, "bash", str(ROOT / "deploy" / "simulate.sh"), "--clients", str(CLIENTS),
                             "--run-config", f"{RUN_CONFIG} output-dir='{out}'", *args],
                            env=env, capture_output=True, text=True, timeout=600, check=False)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-3000:]
    return result


def test_ship_app_adds_the_client_packages_and_keeps_the_rest():
    """Flower sets the driver's PYTHONPATH; the hook keeps it and whatever else was there, and adds
    the packages a ClientApp imports (server_app never runs on a worker)."""
    flower = {"env_vars": {"PYTHONPATH": "/head/only"}, "py_modules": ["s3://bucket/theirs.zip"]}
    shipped = ship_app(flower)
    assert shipped["env_vars"] == {"PYTHONPATH": "/head/only"}
    assert shipped["py_modules"][0] == "s3://bucket/theirs.zip"
    assert [module.__name__ for module in shipped["py_modules"][1:]] == ["client_app", "common", "fedpac_data"]
    assert "__pycache__" in shipped["excludes"]
    assert flower == {"env_vars": {"PYTHONPATH": "/head/only"}, "py_modules": ["s3://bucket/theirs.zip"]}
    assert ship_app(None)["py_modules"] == shipped["py_modules"][1:]


@pytest.mark.e2e
@LOCAL_SUPERLINK  # the one-host run is deploy/simulate.sh's
def test_two_hosts_train_the_one_host_model_bit_for_bit(network, tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    hidden = [path for path in (ROOT, tmp_path, Path.home() / ".flwr", Path("/usr/share/datasets")) if path.is_dir()]
    cluster = TwoHostCluster(network, home, hidden)
    one_host_home = tmp_path / "one-host-home"
    # Each site draws its noise from a secret of its own (common.site_privacy): a partition's
    # secret is the same on every host that may train it, and in the one-host run, so that the
    # runs can be compared bit for bit. Each host's Flower home is its HOME's.
    for flwr_home in (home / ".flwr", cluster.worker_tmp / "home" / ".flwr", one_host_home / ".flwr"):
        for pid in range(CLIENTS):
            folder = privacy_folder(flwr_home / "fedpac-site-state", pid)
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "noise-secret").write_text(f"{pid:02d}" * 32 + "\n")
    try:
        simulate(cluster.env, tmp_path / "cluster", "--ray-address", cluster.address,
                 prefix=tuple(network.prefix("head")))
        on_head, on_worker = cluster.trained(cluster.head_tmp), cluster.trained(cluster.worker_tmp)
    finally:
        cluster.close()
    # Both hosts trained clients, and together every client of every round, each once.
    assert on_head and on_worker, (on_head, on_worker)
    assert not on_head & on_worker
    assert on_head | on_worker == {(p, r) for p in range(CLIENTS) for r in (1, 2)}

    # The same run on this machine alone, on a Ray of its own (simulate.sh's default).
    one_host_env = {**cluster.env, "HOME": str(one_host_home)}
    simulate(one_host_env, tmp_path / "one-host")
    cluster_state = np.load(run_dir(tmp_path / "cluster") / "final_state.npz")
    one_host_state = np.load(run_dir(tmp_path / "one-host") / "final_state.npz")
    assert sorted(cluster_state.files) == sorted(one_host_state.files)
    for name in one_host_state.files:
        assert np.array_equal(cluster_state[name], one_host_state[name]), name
    for two, one in zip(rounds_of(tmp_path / "cluster"), rounds_of(tmp_path / "one-host"), strict=True):
        assert two["mean_accuracy"] == one["mean_accuracy"]
        assert 0 < float(two["max_dp_epsilon"]) <= float(one["max_dp_epsilon"])
