"""The TLS + node-auth federation across hosts: a SuperLink, three SuperNodes and a workstation,
each in its own network namespace on a virtual bridge, reaching each other by host name
(``superlink``), so the gRPC traffic crosses a real (virtual) network and the SuperLink's
certificate is checked against the name the nodes dial."""

from __future__ import annotations

import os

import pytest

from tests.deployment import SMALL, Federation, create_certificates, rounds_of
from tests.netns import VirtualNetwork
from tests.prerequisites import require_root_networking

pytestmark = pytest.mark.e2e

HOSTS = ("superlink", "node-0", "node-1", "node-2", "workstation")


@pytest.fixture
def network():
    require_root_networking()
    net = VirtualNetwork(str(os.getpid() % 10000), HOSTS, subnet="10.213.77")
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
