"""A site's partition follows from who the node is (its registered name or key), never from its
own claim: the pure rules of ``common.sites`` and the strategy that applies them."""

import logging
import subprocess

import pytest
from cryptography.hazmat.primitives import serialization
from flwr.app import ConfigRecord
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

from common import protocol as p
from common.config import ConfigError, parse_run_config
from common.methods import METHODS
from common.methods.server import server_part
from common.model import split_state
from common.sites import Identity, PartitionMap, SiteRegistry, fingerprint
from federation import InProcessGrid
from server_app.app import initial_model
from server_app.strategy import PersonalizedStrategy

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20}


def _key_pair(directory, name):
    """An ECDSA key pair as ``deploy/certs.sh`` makes it; returns (PEM public key, as the
    SuperLink stores it, and what ``ssh-keygen -lf`` prints as its fingerprint)."""
    path = directory / name
    subprocess.run(["ssh-keygen", "-q", "-t", "ecdsa", "-b", "256", "-N", "", "-f", str(path)], check=True)
    public = serialization.load_ssh_public_key(path.with_suffix(".pub").read_bytes())
    pem = public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)
    printed = subprocess.run(["ssh-keygen", "-lf", str(path.with_suffix(".pub"))], check=True,
                             capture_output=True, text=True).stdout.split()[1]
    return pem, printed


def test_a_keys_fingerprint_is_what_ssh_keygen_prints(tmp_path):
    pem, printed = _key_pair(tmp_path, "site")
    assert printed.startswith("SHA256:") and fingerprint(pem) == printed
    assert fingerprint(b"\x01" * 32) == ""  # the simulation's random bytes: no key at all


def test_the_default_map_reads_the_partition_from_the_registered_name():
    default = PartitionMap.parse("")
    assert default.partition_of(Identity("supernode-0")) == 0
    assert default.partition_of(Identity("supernode-17")) == 17
    for name in ("", "supernode-", "supernode-01", "supernode-1x", "hospital-a", "xsupernode-1"):
        assert default.partition_of(Identity(name)) is None, name


def test_an_operators_map_binds_names_and_keys_and_a_key_wins_over_a_name():
    key = "SHA256:" + "A" * 43
    site_map = PartitionMap.parse(f"hospital-a=0, {key}=1\n clinic-b=2")
    assert site_map.partition_of(Identity("hospital-a")) == 0
    assert site_map.partition_of(Identity("clinic-b", "SHA256:" + "B" * 43)) == 2
    assert site_map.partition_of(Identity("hospital-a", key)) == 1
    assert site_map.partition_of(Identity("supernode-0")) is None  # the default rule is off
    # a name spelled as the fingerprint of another site's key is no key: anyone who registers a
    # node chooses its name
    assert site_map.partition_of(Identity(key)) is None
    assert PartitionMap.parse(" claims ").trust_claims


@pytest.mark.parametrize("text, problem", [
    ("hospital-a", "is not NAME=PARTITION"),
    ("hospital-a=x", "is not NAME=PARTITION"),
    ("=3", "is not NAME=PARTITION"),
    ("hospital-a=-1", "is not NAME=PARTITION"),
    ("SHA256:short=1", "is not a SHA256 key fingerprint"),
    ("a=0,a=1", "'a' is mapped twice"),
    ("a=0,b=0", "partition 0 is mapped to both 'a' and 'b'"),
    ("a=b=0", "is not a registered name"),
])
def test_a_bad_map_is_a_config_error_naming_what_is_wrong(text, problem):
    with pytest.raises(ValueError, match=problem):
        PartitionMap.parse(text)
    with pytest.raises(ConfigError, match=f"'partition-map' = .*{problem}"):
        parse_run_config({"partition-map": text})


def test_the_registry_refuses_unknown_identities_and_denied_claims_and_keeps_a_connected_nodes_partition():
    sites = SiteRegistry()
    assert "serves no partition" in sites.screen(1, Identity(""), 3).reason
    assert "serves partition 5, not one of the federation's 3" in sites.screen(2, Identity("supernode-5"), 3).reason
    assert sorted(sites.refused) == [1, 2]  # each refused node is remembered under its own id
    assert sites.screen(3, Identity("supernode-0"), 3) is None
    denied = sites.bind(3, 1, Identity("supernode-0"), connected={3})
    assert denied.final and "claims partition 1" in denied.reason and 3 not in sites.node_partition
    assert sites.bind(3, 0, Identity("supernode-0"), connected={3}) is None
    assert sites.node_partition == {3: 0} and 3 not in sites.refused
    # a second registration under the same name: refused while the first is connected ...
    twin = sites.bind(4, 0, Identity("supernode-0"), connected={3, 4})
    assert twin.final and "served by connected node 3" in twin.reason and sites.node_partition == {3: 0}
    # ... a node that is gone hands its partition on (a restart without authentication)
    assert sites.bind(5, 0, Identity("supernode-0"), connected={5}) is None
    assert sites.node_partition == {5: 0}


def test_believed_claims_need_no_identity_but_still_keep_a_connected_nodes_partition():
    sites = SiteRegistry(trusted_claims=True)
    assert sites.screen(1, Identity(), 3) is None
    assert sites.bind(1, 2, Identity(), connected={1}) is None
    squatter = sites.bind(2, 2, Identity(), connected={1, 2})
    assert squatter is not None and not squatter.final  # asked again once partition 2's node left
    assert sites.bind(2, 2, Identity(), connected={2}) is None and sites.node_partition == {2: 2}


class KeyedGrid(InProcessGrid):
    """Nodes that authenticate with keys: ``keys`` maps partition -> PEM public key; a node
    added by a test (a rogue) has its own key and name."""

    def __init__(self, *args, keys, names=None, **kwargs):
        super().__init__(*args, **kwargs)
        self.keys = keys
        self.names = names or {}

    def get_nodes(self):
        return [NodeInfo(node_id=node, name=self.names.get(node, f"supernode-{self.partition_of_node[node]}"),
                         public_key=self.keys.get(node, self.keys.get(self.partition_of_node[node], b"")))
                for node in self.get_node_ids()]


def test_a_rogue_node_with_an_unmapped_key_is_sent_nothing_at_all_and_the_round_is_unchanged(tmp_path, caplog):
    """partition-map by key fingerprint: a rogue node, enrolled with its own key and claiming
    partition 0, gets no message (not even the pre-flight's query) and the round computes
    exactly what it computes without it."""
    pems = {}
    for pid in range(3):
        pems[pid], printed = _key_pair(tmp_path, f"site-{pid}")
        pems[f"printed-{pid}"] = printed
    rogue_pem, _ = _key_pair(tmp_path, "rogue")
    site_map = PartitionMap.parse(",".join(f"{pems[f'printed-{pid}']}={pid}" for pid in range(3)))
    cfg = parse_run_config(RUN_CONFIG)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})

    def one_round(with_rogue):
        strategy = PersonalizedStrategy(server=server_part(METHODS["fedpac"], cfg, extractor, head), num_rounds=2,
                                        sites=SiteRegistry(site_map))
        grid = KeyedGrid(RUN_CONFIG, 3, keys={pid: pems[pid] for pid in range(3)})
        if with_rogue:
            first = next(n for n, pid in grid.partition_of_node.items() if pid == 0)
            grid.contexts[999] = grid.contexts[first]  # claims partition 0, loads its data
            grid.partition_of_node[999] = 0
            grid.keys[999] = rogue_pem
            grid.names[999] = ""
        strategy.discover(grid, timeout=60)
        messages = list(strategy.configure_train(1, p.to_record(extractor), ConfigRecord(), grid))
        arrays, _ = strategy.aggregate_train(1, grid.send_and_receive(messages))
        return strategy, grid, p.from_record(arrays)

    with caplog.at_level(logging.WARNING):
        strategy, grid, with_rogue = one_round(True)
    assert 999 not in {m.metadata.dst_node_id for m in grid.sent}
    assert "Refused node 999: its identity (no registered name, key SHA256:" in caplog.text
    assert sorted(strategy.node_partition.values()) == [0, 1, 2]
    _, _, without = one_round(False)
    for key, value in without.items():
        assert (with_rogue[key] == value).all(), key


def _strategy(min_available_nodes=2):
    cfg = parse_run_config(RUN_CONFIG)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    return PersonalizedStrategy(server=server_part(METHODS["fedpac"], cfg, extractor, head), num_rounds=2,
                                sites=SiteRegistry(), min_available_nodes=min_available_nodes)


def _with_rogue(grid, claims, name):
    """Node 999: the data of partition ``claims``, registered under ``name``."""
    honest = next(n for n, pid in grid.partition_of_node.items() if pid == claims)
    grid.contexts[999] = grid.contexts[honest]
    grid.partition_of_node[999] = claims
    grid.names[999] = name
    return grid


def test_a_rogues_answer_neither_sizes_the_federation_nor_stops_the_preflight(caplog):
    """An enrolled node whose identity serves another partition than it claims answers the
    pre-flight with a bogus federation size: it is refused, and the honest nodes' answers alone
    decide the size (a refused node's answer must not make the honest ones look misconfigured)."""
    def bogus_size(reply, pid):
        if reply.metadata.src_node_id == 999:
            reply.content[p.METRICS]["num-partitions"] = 7
        return reply

    grid = _with_rogue(KeyedGrid(RUN_CONFIG, 3, keys={}, tamper=bogus_size, tamper_queries=True), 0, "supernode-2")
    strategy = _strategy()
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    assert strategy.num_partitions == 3 and sorted(bound.values()) == [0, 1, 2] and 999 not in bound
    refusal = "Refused node 999: it claims partition 0, its identity (name 'supernode-2') serves partition 2"
    assert refusal in caplog.text


def test_the_preflight_waits_for_enough_nodes_that_are_not_refused(caplog):
    """min-available-clients counts nodes that may serve a partition: with 2 honest nodes and a
    refused one connected, the pre-flight waits for a third (here until its patience runs out)."""
    grid = _with_rogue(KeyedGrid(RUN_CONFIG, 2, keys={}), 0, "rogue")
    strategy = _strategy(min_available_nodes=3)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=1)
    assert "Refused node 999" in caplog.text
    assert "only 2 of the 3 required nodes connected" in caplog.text
    assert sorted(bound.values()) == [0, 1]
