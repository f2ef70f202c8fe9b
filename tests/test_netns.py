"""The TLS + node-auth federation across hosts: a SuperLink, three SuperNodes and a workstation,
each in its own network namespace on a virtual bridge, reaching each other by host name
(``superlink``), so the gRPC traffic crosses a real (virtual) network and the SuperLink's
certificate is checked against the name the nodes dial."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from tests.deployment import SMALL, Federation, create_certificates, rounds_of
from tests.prerequisites import require_root_networking

pytestmark = pytest.mark.e2e

HOSTS = ("superlink", "node-0", "node-1", "node-2", "workstation")
SUBNET = "10.213.77"


def _ip(*args: str, ns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", ns] if ns else []
    subprocess.run([*prefix, "ip", *args], check=True, capture_output=True)


class VirtualNetwork:
    """One namespace per host on a bridge, with /etc/netns/<ns>/hosts naming every host."""

    def __init__(self, tag: str) -> None:
        self.bridge = f"fpbr{tag}"
        self.namespaces = {host: f"fp{tag}-{host}" for host in HOSTS}
        self.hosts_file = "".join(f"{SUBNET}.{10 + i} {host}\n" for i, host in enumerate(HOSTS))
        self.forward_rule = ["FORWARD", "-i", self.bridge, "-o", self.bridge, "-j", "ACCEPT"]
        _ip("link", "add", self.bridge, "type", "bridge")
        _ip("link", "set", self.bridge, "up")
        for i, ns in enumerate(self.namespaces.values()):
            _ip("netns", "add", ns)
            outside, inside = f"fp{tag}h{i}", f"fp{tag}n{i}"
            _ip("link", "add", outside, "type", "veth", "peer", "name", inside)
            _ip("link", "set", outside, "master", self.bridge, "up")
            _ip("link", "set", inside, "netns", ns)
            _ip("addr", "add", f"{SUBNET}.{10 + i}/24", "dev", inside, ns=ns)
            _ip("link", "set", inside, "up", ns=ns)
            _ip("link", "set", "lo", "up", ns=ns)
            Path(f"/etc/netns/{ns}").mkdir(parents=True, exist_ok=True)
            Path(f"/etc/netns/{ns}/hosts").write_text(f"127.0.0.1 localhost\n{self.hosts_file}")
        # a Docker engine that ran on this machine leaves FORWARD's policy at DROP, which also
        # drops bridged traffic between the namespaces
        if shutil.which("iptables"):
            subprocess.run(["iptables", "-I", *self.forward_rule], check=True, capture_output=True)

    def prefix(self, host: str) -> list[str]:
        return ["ip", "netns", "exec", self.namespaces[host]]

    def close(self) -> None:
        if shutil.which("iptables"):
            subprocess.run(["iptables", "-D", *self.forward_rule], capture_output=True)
        for ns in self.namespaces.values():
            subprocess.run(["ip", "netns", "delete", ns], capture_output=True)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)
        subprocess.run(["ip", "link", "delete", self.bridge], capture_output=True)


@pytest.fixture
def network():
    require_root_networking()
    net = VirtualNetwork(str(os.getpid() % 10000))
    yield net
    net.close()


def test_federation_across_network_namespaces_by_host_name(network, tmp_path):
    certs = create_certificates(tmp_path / "certs", 3)  # SANs include "superlink"
    federation = Federation(tmp_path / "run", certs, 3, prefix=network.prefix, superlink_name="superlink",
                            bind="0.0.0.0", ports=(9092, 9093))
    try:
        federation.register(0, 1, 2)
        for pid in range(3):
            federation.start_node(pid)
        out = tmp_path / "out"
        run_id = federation.submit(f"{SMALL} num-server-rounds=2 min-available-clients=3 output-dir='{out}'")
        status = federation.wait(run_id)
        assert status == "finished:completed", federation.log(run_id)[-3000:]
        rounds = rounds_of(out)
        assert [int(r["num_trained"]) for r in rounds] == [3, 3]
    finally:
        federation.close()
