"""A real Flower deployment for tests: a SuperLink and SuperNodes as separate processes, started
with the user-facing scripts deploy/superlink.sh and deploy/supernode.sh (TLS and SuperNode
authentication on), driven with `flwr run . <federation>` like a user's workstation.

Each process runs on a "host": the local machine, or a network namespace (``prefix`` is the
command that enters it), so the same federation runs on localhost and across a virtual network.
"""

from __future__ import annotations

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.prerequisites import require_tools

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
FEDERATION = "fedpac-test"
# A small run: enough to show the federation trains, quick on two cores.
SMALL = "samples-per-client=100 test-samples-per-client=50 local-epochs=1"
# make test runs the e2e tier on two pytest-xdist workers (--dist loadgroup). A plain `flwr run .`
# and deploy/simulate.sh hand their run to the local SuperLink on Flower's fixed local ports
# (127.0.0.1:39091/39093), one per machine, which each such test starts and stops: the tests that
# use it carry this mark, so that one worker runs them one after the other.
LOCAL_SUPERLINK = pytest.mark.xdist_group("flower-local-superlink")


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free localhost port not handed out before by this process: the kernel may give a port
    that was bound and released again, and two SuperNodes started in a row must not share one."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port not in _HANDED_OUT:
            _HANDED_OUT.add(port)
            return port


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (reaped, or a zombie not reaped yet)."""
    if not Path("/proc/self/status").exists():  # no /proc (macOS): a zombie still counts as there
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        return False
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as status:
            return any(line.startswith("State:") and "Z" in line for line in status)
    except FileNotFoundError:
        return True


def parent_of(pid: int) -> int:
    """Process ``pid``'s parent (Linux: /proc; the name in stat may hold spaces and parentheses,
    so the fields are read after its last ')'). OSError when it has ended."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descends_from(pid: int, ancestor: int) -> bool:
    """Whether process ``pid`` is ``ancestor`` or one of its descendants (Linux: /proc)."""
    while pid > 1:
        if pid == ancestor:
            return True
        try:
            pid = parent_of(pid)
        except (OSError, IndexError, ValueError):  # ended meanwhile
            return False
    return False


def stop_groups(*processes: subprocess.Popen, grace: float = 20) -> None:
    """End the process groups ``processes`` lead, side by side: SIGTERM (after SIGCONT, for a
    stopped one), then SIGKILL for a group whose leader has not exited ``grace`` seconds later
    (a slow exit on a loaded host is not what any test here is about)."""
    for process in processes:
        if process.poll() is None:
            try:
                os.killpg(process.pid, signal.SIGCONT)
                os.killpg(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
    deadline = time.monotonic() + grace
    for process in processes:
        try:
            process.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()


def create_certificates(directory: Path, num_nodes: int, *sans: str, site_keys: bool = True) -> Path:
    """The operator's CA and SuperLink certificate, and ``num_nodes`` SuperNode key pairs in
    ``directory/keys``: made as each site makes its own (``certs.sh site-key``) unless
    ``site_keys`` is false (the compose test bed's central set, with its executors' secrets)."""
    require_tools("openssl", "ssh-keygen")
    certs = ROOT / "deploy" / "certs.sh"
    subprocess.run(
        ["bash", str(certs), "create", "--out", str(directory), "--clients", str(0 if site_keys else num_nodes),
         *[arg for san in sans for arg in ("--san", san)]],
        check=True, capture_output=True,
    )
    for pid in range(num_nodes if site_keys else 0):
        subprocess.run(["bash", str(certs), "site-key", "--out", str(directory / "keys"), "--name", f"supernode-{pid}"],
                       check=True, capture_output=True)
    return directory


class Workstation:
    """A user's `flwr` CLI with its own FLWR_HOME naming one federation (TLS, own CA)."""

    def __init__(self, home: Path, address: str, ca_cert: Path,
                 prefix: Callable[[str], list[str]] = lambda host: []) -> None:
        self.prefix = prefix
        self.env = {
            **os.environ,
            "FLWR_HOME": str(home),
            "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1",
            "FLWR_DISABLE_UPDATE_CHECK": "1",
            "FLWR_TELEMETRY_ENABLED": "0",
            "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}",
        }
        home.mkdir(parents=True, exist_ok=True)
        (home / "config.toml").write_text(
            f'[superlink]\ndefault = "{FEDERATION}"\n\n[superlink.{FEDERATION}]\n'
            f'address = "{address}"\nroot-certificates = "{ca_cert}"\n'
        )

    def flwr_result(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return subprocess.run([*self.prefix("workstation"), str(BIN / "flwr"), *args], env=self.env,
                              capture_output=True, text=True, timeout=timeout)

    def flwr(self, *args: str, timeout: float = 120) -> str:
        result = self.flwr_result(*args, timeout=timeout)
        if result.returncode:
            raise RuntimeError(f"flwr {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}")
        return result.stdout

    def wait_until_reachable(self, timeout: float = 90, alive: Callable[[], bool] = lambda: True) -> None:
        deadline, answer = time.monotonic() + timeout, ""
        while time.monotonic() < deadline and alive():
            result = self.flwr_result("supernode", "ls", FEDERATION)
            if result.returncode == 0:
                return
            answer = (result.stdout + result.stderr)[-1500:]
            time.sleep(1)
        raise RuntimeError(f"the SuperLink's Control API is not reachable; flwr's last answer:\n{answer}")

    def register(self, keys: Path, *partitions: int) -> dict[int, int]:
        """Register the nodes' public keys under their names (``supernode-<i>``, which serves
        partition i), as many ``flwr`` processes at a time as there are cores: each pays the
        CLI's start-up (2.5 s), 52 s for 20 nodes one after another. Returns each partition's
        node id."""
        def one(pid: int) -> int:
            out = self.flwr("supernode", "register", str(keys / f"supernode-{pid}.pub"), FEDERATION,
                            "--name", f"supernode-{pid}", "--format", "json")
            return int(json.loads(out[out.index("{"):])["node-id"])

        with ThreadPoolExecutor(max_workers=max(1, min(len(partitions), os.cpu_count() or 1))) as pool:
            return dict(zip(partitions, pool.map(one, partitions)))

    def submit(self, run_config: str) -> str:
        out = self.flwr("run", str(ROOT), FEDERATION, "--format", "json", "--run-config", run_config)
        return str(json.loads(out[out.index("{"):])["run-id"])

    def status(self, run_id: str) -> str:
        out = self.flwr("ls", FEDERATION, "--run-id", run_id, "--format", "json")
        return json.loads(out[out.index("{"):])["runs"][0]["status"]

    def wait(self, run_id: str, timeout: float = 600) -> str:
        deadline, status = time.monotonic() + timeout, "unknown"
        while time.monotonic() < deadline:
            status = self.status(run_id)
            if status.startswith("finished"):
                return status
            time.sleep(2)
        raise AssertionError(f"run {run_id} still {status} after {timeout}s")

    def log(self, run_id: str) -> str:
        return self.flwr_result("log", run_id, FEDERATION, "--show").stdout


class Federation(Workstation):
    """SuperLink + SuperNodes as processes, each on a host given by ``prefix``, and a workstation."""

    def __init__(  # pylint: disable=too-many-arguments
        self,
        workdir: Path,
        certs: Path,
        num_nodes: int,
        *,
        prefix: Callable[[str], list[str]] = lambda host: [],
        superlink_name: str = "127.0.0.1",
        bind: str = "127.0.0.1",
        ports: tuple[int, int] | None = None,
        database: str = "file",
    ) -> None:
        self.workdir, self.certs, self.num_nodes = workdir, certs, num_nodes
        self.fleet_port, self.control_port = ports or (free_port(), free_port())
        self.fleet_address = f"{superlink_name}:{self.fleet_port}"
        super().__init__(workdir / "flwr-home", f"{superlink_name}:{self.control_port}", certs / "ca.crt", prefix)
        self.superlink = self._spawn("superlink", "superlink", [
            str(ROOT / "deploy" / "superlink.sh"), "--certs", str(certs), "--state", str(workdir / "state"),
            "--fleet-address", f"{bind}:{self.fleet_port}", "--control-address", f"{bind}:{self.control_port}",
            "--database", database,
        ])
        self.supernodes: dict[str, subprocess.Popen] = {}
        try:
            self.wait_until_reachable(alive=lambda: self.superlink.poll() is None)
        except RuntimeError as err:
            self.close()
            raise RuntimeError(f"{err}:\n{self.read_log('superlink')[-3000:]}") from err

    def _spawn(self, host: str, name: str, command: list[str],
               environment: Mapping[str, str] | None = None) -> subprocess.Popen:
        log = open(self.workdir / f"{name}.log", "ab")  # noqa: SIM115  # closed with the process
        return subprocess.Popen([*self.prefix(host), *command], env={**self.env, **(environment or {})}, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)

    def read_log(self, name: str) -> str:
        return (self.workdir / f"{name}.log").read_text(errors="replace")

    def register(self, *partitions: int) -> dict[int, int]:  # type: ignore[override]
        return super().register(self.certs / "keys", *partitions)

    def start_node(self, pid: int, *, data_path: Path | None = None, key: int | None = None,
                   restarts: int = 18, executor: str = "warm", model_dir: Path | None = None,
                   label: str | None = None, options: Sequence[str] = (),
                   environment: Mapping[str, str] | None = None) -> subprocess.Popen:
        """SuperNode ``pid`` (authenticating with key ``key``, by default its own), its ClientApp
        run by ``executor`` (``warm`` or Flower's own ``cold``), its model kept in ``model_dir``
        (default: ``<workdir>/models/client-<pid>``); ``label`` (default ``pid``) names its
        process and its log, ``supernode-<label>.log``, for a second node claiming ``pid``;
        ``options``: more of ``supernode.sh``'s (a site's policy); ``environment``: more
        variables for its processes."""
        label = str(pid) if label is None else label
        key_file = self.certs / "keys" / f"supernode-{pid if key is None else key}"
        command = [str(ROOT / "deploy" / "supernode.sh"), "--superlink", self.fleet_address,
                   "--ca", str(self.certs / "ca.crt"), "--key", str(key_file),
                   "--partition-id", str(pid), "--num-partitions", str(self.num_nodes),
                   "--port", str(free_port()), "--restarts", str(restarts), "--executor", executor,
                   "--model-dir", str(model_dir or self.workdir / "models" / f"client-{label}")]
        if data_path is not None:
            command += ["--data-path", str(data_path)]
        command += options
        self.supernodes[label] = self._spawn(f"node-{label}", f"supernode-{label}", command, environment)
        return self.supernodes[label]

    def nodes(self) -> list[dict]:
        """``flwr supernode ls``: every registered node with its status and name."""
        out = self.flwr("supernode", "ls", FEDERATION, "--format", "json")
        return json.loads(out[out.index("{"):]).get("nodes", [])

    def wait_online(self, count: int, timeout: float = 120) -> float:
        """Seconds until ``count`` SuperNodes are online at the SuperLink; a SuperNode that
        exits meanwhile fails with its log."""
        started = time.monotonic()
        while time.monotonic() - started < timeout:
            result = self.flwr_result("supernode", "ls", FEDERATION, "--format", "json")
            if result.returncode == 0 and "{" in result.stdout:
                nodes = json.loads(result.stdout[result.stdout.index("{"):]).get("nodes", [])
                if sum(node.get("status") == "online" for node in nodes) >= count:
                    return time.monotonic() - started
            for label, node in self.supernodes.items():
                if node.poll() is not None:
                    raise RuntimeError(f"SuperNode {label} exited ({node.returncode}):\n"
                                       f"{self.read_log(f'supernode-{label}')[-3000:]}")
            time.sleep(1.0)
        raise RuntimeError(f"fewer than {count} SuperNodes online after {timeout:.0f} s")

    def signal_node(self, pid: int | str, signum: signal.Signals) -> None:
        """Signal SuperNode ``pid``'s (a label) whole process group (the node and its ClientApp)."""
        node = self.supernodes[str(pid)]
        os.killpg(node.pid, signum)
        if signum == signal.SIGKILL:
            node.wait()

    def wait(self, run_id: str, timeout: float = 600) -> str:
        try:
            return super().wait(run_id, timeout)
        except AssertionError as err:  # why a run never started or never ended is in the SuperLink's log
            raise AssertionError(f"{err}; the SuperLink's log ends:\n{self.read_log('superlink')[-3000:]}") from err

    def kill_superexec(self) -> int:
        """SIGKILL the SuperExec the SuperLink started (the process that launches each run's
        ServerApp), as a crash would end it; returns its pid."""
        for proc in Path("/proc").glob("[0-9]*"):
            try:
                parent = parent_of(int(proc.name))
                command = (proc / "cmdline").read_bytes().split(b"\0")
            except OSError:  # a process that ended meanwhile
                continue
            if parent == self.superlink.pid and any(b"flower-superexec" in part for part in command):
                os.kill(int(proc.name), signal.SIGKILL)
                return int(proc.name)
        raise RuntimeError(f"the SuperLink has no SuperExec:\n{self.read_log('superlink')[-3000:]}")

    def close(self) -> None:
        stop_groups(*self.supernodes.values(), self.superlink)


def run_dir(out: Path) -> Path:
    (directory,) = [d for d in out.iterdir() if d.is_dir()]
    return directory


def rounds_of(out: Path) -> list[dict]:
    """rounds.csv of the one run under ``out`` (empty until the first round is written)."""
    if not out.exists() or not any(d.is_dir() for d in out.iterdir()):
        return []
    path = run_dir(out) / "rounds.csv"
    return list(csv.DictReader(path.open())) if path.exists() else []


def wait_for_rounds(out: Path, count: int, timeout: float = 300) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        rounds = rounds_of(out)
        if len(rounds) >= count:
            return rounds
        # a test signals a node right after a round's row: the next round's messages are on their
        # way then, and a slow look would let a fast node answer one before the signal lands
        time.sleep(0.05)
    raise AssertionError(f"fewer than {count} rounds in {out} after {timeout}s")
