"""The docker compose cluster of docker-compose.yml (3 clients, CPU override): images built on a
local base, TLS and SuperNode authentication on, FedPAC run to completion with `flwr run` from
the host, results read from the outputs volume, everything torn down.

The Docker engine is the one on this machine; when none is running the test starts its own
(and stops it). Docker Hub is unreachable in CI, so the base image is made with debootstrap and
the Python wheels come from the host (deploy/build-images.sh --wheelhouse).
"""

from __future__ import annotations

import csv
import hashlib
import ipaddress
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from deploy import compose
from tests.deployment import ROOT, SMALL, Workstation, create_certificates
from tests.prerequisites import docker_engine_running, require_docker

LOCAL_BASE = "local/pybase:bookworm"
# The CPU app image (what docker-compose.cpu.yml runs): 1 GB instead of the CUDA image's 7 GB, whose
# build needs about 20 GB of disk. PyTorch's CPU index is unreachable on the machines this runs
# on; their pip find-links hold this CPU build of torch.
CPU_TORCH = os.environ.get("FEDPAC_TEST_CPU_TORCH", "2.13.0+cpu")
CPU_TORCH_INDEX = os.environ.get("FEDPAC_TEST_CPU_TORCH_INDEX", "none")
PROJECT = "fedpac-test"


def test_docker_compose_yml_is_the_generators_output_for_3_clients(tmp_path):
    compose.write(3, 1, tmp_path)
    for name in ("docker-compose.yml", "docker-compose.cpu.yml"):
        assert (tmp_path / name).read_text() == (ROOT / name).read_text(), f"regenerate {name}"


def _docker(*args: str, timeout: float = 600, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(["docker", *args], check=True, capture_output=True, text=True, timeout=timeout,
                          **kwargs)


@pytest.fixture(scope="module")
def docker_engine(tmp_path_factory):
    require_docker()
    if docker_engine_running():
        yield None  # someone else's engine: leave it running
        return
    log = tmp_path_factory.mktemp("dockerd") / "dockerd.log"
    engine = subprocess.Popen(
        ["dockerd", "--data-root", os.environ.get("FEDPAC_DOCKER_ROOT", "/var/lib/fedpac-docker"),
         "--ip-masq=false"], stdout=log.open("wb"), stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while subprocess.run(["docker", "info"], capture_output=True).returncode != 0:
        if engine.poll() is not None or time.monotonic() > deadline:
            pytest.fail(f"dockerd did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.5)
    yield engine
    engine.terminate()
    engine.wait(timeout=60)


@pytest.fixture(scope="module")
def images(docker_engine, tmp_path_factory):
    if subprocess.run(["docker", "image", "inspect", LOCAL_BASE], capture_output=True).returncode != 0:
        rootfs = tmp_path_factory.mktemp("rootfs")
        subprocess.run(["debootstrap", "--variant=minbase", "--include=python3,python3-venv", "bookworm",
                        str(rootfs)], check=True, capture_output=True, timeout=900)
        tar = subprocess.Popen(["tar", "-C", str(rootfs), "-c", "."], stdout=subprocess.PIPE)
        _docker("import", "-", LOCAL_BASE, stdin=tar.stdout)
        tar.wait()
    build = subprocess.run(["bash", str(ROOT / "deploy" / "build-images.sh"), "--base", LOCAL_BASE, "--wheelhouse",
                            "--cpu", "--torch-version", CPU_TORCH, "--torch-index", CPU_TORCH_INDEX],
                           capture_output=True, text=True, timeout=2400, env={**os.environ, "PYTHON": sys.executable})
    if build.returncode:
        # "No space left on device" is the usual cause on a shared build host: say how much is left.
        free = subprocess.run(["df", "-h", str(ROOT), os.environ.get("FEDPAC_DOCKER_ROOT", "/var/lib")],
                              capture_output=True, text=True).stdout
        pytest.fail(f"deploy/build-images.sh failed:\n{build.stdout[-2000:]}\n{build.stderr[-4000:]}\n"
                    f"disk space now:\n{free}")


TEST_OVERRIDE = """\
# No published ports and no network that leaves the machine: the host reaches the SuperLink's
# Control API at .10 of the (internal) control network instead, in a /24 the host routes nowhere else.
services:
  superlink:
    ports: !reset []
    networks:
      fleet: {{}}
      control:
        ipv4_address: {subnet}.10
networks:
  control:
    internal: true
    ipam:
      config:
        - subnet: {subnet}.0/24
"""


def unrouted_subnet() -> str:
    """A /24 for the control network that no route of this host covers yet: a bridge left behind by
    an engine that died mid-test (or anyone's network) would otherwise take the host's packets."""
    routes = subprocess.run(["ip", "-4", "route", "show"], capture_output=True, text=True, check=True).stdout
    routed = [ipaddress.ip_network(line.split()[0], strict=False) for line in routes.splitlines()
              if line[:1].isdigit()]
    for third in range(78, 255):
        if not any(ipaddress.ip_network(f"10.213.{third}.0/24").overlaps(net) for net in routed):
            return f"10.213.{third}"
    raise RuntimeError(f"every 10.213.x.0/24 from x = 78 is routed on this host:\n{routes}")


class Cluster:
    def __init__(self, workdir: Path, certs: Path, data: Path, subnet: str) -> None:
        override = workdir / "docker-compose.test.yml"
        override.write_text(TEST_OVERRIDE.format(subnet=subnet))
        self.command = ["compose", "--project-name", PROJECT, "--project-directory", str(ROOT),
                        "-f", str(ROOT / "docker-compose.yml"), "-f", str(ROOT / "docker-compose.cpu.yml"),
                        "-f", str(override)]
        self.env = {**os.environ, "FEDPAC_CERTS": str(certs), "FEDPAC_DATA": str(data), "COMPOSE_BAKE": "false"}

    def __call__(self, *args: str, timeout: float = 300) -> str:
        return _docker(*self.command, *args, timeout=timeout, env=self.env).stdout

    def logs(self) -> str:
        return subprocess.run(["docker", *self.command, "logs", "--no-color", "--tail", "60"], env=self.env,
                              capture_output=True, text=True).stdout


@pytest.mark.e2e
def test_compose_cluster_runs_fedpac_with_tls_and_node_auth(images, tmp_path):
    subnet, certs, data = unrouted_subnet(), tmp_path / "certs", tmp_path / "data"
    cluster = Cluster(tmp_path, certs, data, subnet)
    cluster("down", "--volumes", "--timeout", "5")  # what an interrupted run of this test left
    create_certificates(certs, 3, f"{subnet}.10", site_keys=False)
    subprocess.run(["chown", "49999:49999", str(certs / "superlink.key"), str(certs / "superexec.secret"),
                    *[str(certs / "keys" / f"supernode-{i}{ext}") for i in range(3) for ext in ("", ".secret")]],
                   check=True)
    subprocess.run([sys.executable, str(ROOT / "deploy" / "export_partitions.py"), "--clients", "3",
                    "--out", str(data), "--run-config", SMALL], check=True, capture_output=True)
    subprocess.run(["chmod", "-R", "a+rX", str(tmp_path)], check=True)
    workstation = Workstation(tmp_path / "flwr-home", f"{subnet}.10:9093", certs / "ca.crt")
    try:
        cluster("up", "-d", "superlink")
        try:
            workstation.wait_until_reachable()
        except RuntimeError as error:
            raise AssertionError(f"{error}\n{cluster('ps', '--all')}\n{cluster.logs()}") from error
        workstation.register(certs / "keys", 0, 1, 2)
        cluster("up", "-d")
        run_id = workstation.submit(f"{SMALL} num-server-rounds=2 min-available-clients=3")
        status = workstation.wait(run_id, timeout=900)
        assert status == "finished:completed", workstation.log(run_id)[-3000:] + cluster.logs()
        cluster("cp", "serverapp:/app/outputs", str(tmp_path / "outputs"))
        (run_dir,) = [d for d in (tmp_path / "outputs").iterdir() if d.name.endswith(f"run{run_id}")]
        rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
        assert [int(r["num_trained"]) for r in rounds] == [3, 3]
        assert all(0 < float(r["mean_accuracy"]) <= 1 for r in rounds)
        assert (run_dir / "final_state.npz").exists() and (run_dir / "accuracy.png").exists()
        # every site keeps its personalized model in its own volume
        cluster("cp", "clientapp-1:/app/models", str(tmp_path / "site-1"))
        info = json.loads((tmp_path / "site-1" / "model.json").read_text())
        assert info["round"] == 2 and info["partition_id"] == 1 and info["run_id"] == int(run_id)
        assert (tmp_path / "site-1" / "model.pt").stat().st_size > 400_000
        size = int(_docker("image", "inspect", "fedpac-app:latest-cpu", "--format", "{{.Size}}").stdout)
        assert size < 2.5e9, f"the CPU app image takes {size / 1e9:.1f} GB: is CUDA in it?"
        networks = _docker("network", "ls", "--filter", f"label=com.docker.compose.project={PROJECT}",
                           "--format", "{{.Name}} {{.Internal}}").stdout.split("\n")
        assert all(line.endswith("true") for line in networks if line), networks
        check_isolation(cluster, certs, clients=3)
    finally:
        cluster("down", "--volumes", "--timeout", "20")


# The services whose containers run the app's code (the ServerApp's and each client's executor).
EXECUTORS = ("serverapp", "clientapp-0", "clientapp-1", "clientapp-2")


def container_of(cluster: Cluster, service: str) -> str:
    container = cluster("ps", "-q", service).strip()
    assert container, f"{service} is not running"
    return container


def key_files(certs: Path) -> dict[str, Path]:
    """The federation's private keys as certs.sh made them, by the SHA-256 of their contents."""
    keys = [certs / "ca.key", certs / "superlink.key", *sorted((certs / "keys").glob("supernode-[0-9]"))]
    return {hashlib.sha256(key.read_bytes()).hexdigest(): key for key in keys if key.is_file()}


def keys_inside(container: str, keys: dict[str, Path]) -> list[str]:
    """What in the running container is or looks like a private key: a copy of one of the
    federation's keys anywhere in its file system (mounted or written), a file named *.key, or
    PEM/OpenSSH private key contents in a mounted folder or the app's."""
    mounts = json.loads(_docker("inspect", "--format", "{{json .Mounts}}", container).stdout)
    mounted = [mount["Destination"] for mount in mounts]
    folders = " ".join(sorted({*mounted, "/app", "/tmp", "/opt/fedpac", "/root", "/home"}))
    script = (
        # small files only: a key is a few hundred bytes, and the app image holds a GB of wheels
        "find / \\( -path /proc -o -path /sys -o -path /dev \\) -prune -o -type f -size -64k -print0 "
        "| xargs -0 sha256sum 2>/dev/null | sed 's/^/hash /'; "
        "find / \\( -path /proc -o -path /sys -o -path /dev -o -path /opt/venv \\) -prune -o -name '*.key' -print "
        "| sed 's/^/named /'; "
        f"grep -rlsI 'PRIVATE KEY' {folders} | sed 's/^/pem /'; true"
    )
    found = []
    for line in _docker("exec", "-u", "0", container, "sh", "-c", script, timeout=300).stdout.splitlines():
        kind, _, rest = line.partition(" ")
        if kind == "hash":
            digest, _, path = rest.partition("  ")
            if digest in keys:
                found.append(f"{path} (a copy of {keys[digest].name})")
        elif kind in ("named", "pem"):
            found.append(rest)
    return sorted(set(found))


def check_isolation(cluster: Cluster, certs: Path, clients: int) -> None:
    """docs/DEPLOYMENT.md and docs/SECURITY.md, on the running containers rather than the compose
    file: the executors that run app code hold no private key (only each SuperNode holds its
    own), each client's executor shares a network with its own SuperNode alone, and only the
    ServerApp's executor and the SuperNodes reach the SuperLink. Every breach is listed at once."""
    keys = key_files(certs)
    assert len(keys) == clients + 2, keys  # the CA's, the SuperLink's and every SuperNode's
    services = ["superlink", *EXECUTORS, *[f"supernode-{i}" for i in range(clients)]]
    containers = {service: container_of(cluster, service) for service in services}
    breaches = [f"{service} holds a private key: {found}" for service in EXECUTORS
                if (found := keys_inside(containers[service], keys))]
    # the search finds a key where there is one: a SuperNode signs with its own, and only its own
    for i in range(clients):
        found = keys_inside(containers[f"supernode-{i}"], keys)
        copies = [item for item in found if "(a copy of" in item]
        if copies != [f"/certs/supernode.key (a copy of supernode-{i})"]:
            breaches.append(f"supernode-{i} holds {copies}, not its own key alone")

    networks = {service: set(networks_of(container)) for service, container in containers.items()}
    expected = {"superlink": {"fleet", "control"}, "serverapp": {"fleet"},
                **{f"supernode-{i}": {"fleet", f"client-{i}"} for i in range(clients)},
                **{f"clientapp-{i}": {f"client-{i}"} for i in range(clients)}}
    breaches += [f"{service} is on networks {sorted(networks[service])}, expected {sorted(expected[service])}"
                 for service in services if networks[service] != expected[service]]

    def peers(service: str) -> set[str]:
        return {other for other in services if other != service and networks[other] & networks[service]}

    if peers("superlink") != {"serverapp", *[f"supernode-{i}" for i in range(clients)]}:
        breaches.append(f"the SuperLink shares a network with {sorted(peers('superlink'))}")
    # and the packets agree: from a client's executor only its own SuperNode answers, by name or
    # by address (the SuperLink's and the other SuperNodes' are on networks it has no route to)
    addresses = {service: list(networks_of(container).values()) for service, container in containers.items()}
    for i in range(clients):
        if peers(f"clientapp-{i}") != {f"supernode-{i}"}:
            breaches.append(f"clientapp-{i} shares a network with {sorted(peers(f'clientapp-{i}'))}")
        targets = [(f"supernode-{i}", 9094), ("superlink", 9092), ("superlink", 9093)]
        targets += [(address, 9092) for address in addresses["superlink"]]
        targets += [(address, 9094) for j in range(clients) if j != i for address in addresses[f"supernode-{j}"]]
        args = [str(item) for target in targets for item in target]
        answers = _docker("exec", containers[f"clientapp-{i}"], "python", "-c", PROBE, *args, timeout=120).stdout
        reached = {(host, int(port)) for host, port, state, *_ in map(str.split, answers.splitlines())
                   if state == "open"}
        if reached != {(f"supernode-{i}", 9094)}:
            breaches.append(f"clientapp-{i} reaches {sorted(reached)}:\n{answers}")
    assert not breaches, "\n".join(breaches)


# Run in a container: try each (host, port) of argv, and say which answered.
PROBE = """\
import socket, sys
for host, port in zip(sys.argv[1::2], sys.argv[2::2]):
    try:
        socket.create_connection((host, int(port)), timeout=3).close()
        print(host, port, "open")
    except OSError as err:
        print(host, port, "closed", type(err).__name__)
"""


def networks_of(container: str) -> dict[str, str]:
    """The compose networks a running container is on, and its address on each."""
    attached = json.loads(_docker("inspect", "--format", "{{json .NetworkSettings.Networks}}", container).stdout)
    return {name.removeprefix(f"{PROJECT}_"): network["IPAddress"] for name, network in attached.items()}
