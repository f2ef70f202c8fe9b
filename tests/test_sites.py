"""A site's partition follows from who the node is (its registered name or key), never from its
own claim: the pure rules of ``common.sites`` and the strategy that applies them."""

import logging
import os
import subprocess
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec
from flwr.app import ConfigRecord, Context, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

from common import protocol as p
from common.config import ConfigError, parse_run_config
from common.methods import METHODS
from common.methods.server import server_part
from common.model import split_state
from common.sites import Identity, PartitionMap, SiteRegistry, federation_size, fingerprint
from federation import InProcessGrid
from server_app.app import initial_model
from server_app.strategy import PersonalizedStrategy

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20}
CERTS = Path(__file__).resolve().parents[1] / "deploy" / "certs.sh"


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
    assert sites.refused[4] == twin  # remembered under the twin's own id, asked nothing more
    # ... a node that is gone hands its partition on (a restart without authentication)
    assert sites.bind(5, 0, Identity("supernode-0"), connected={5}) is None
    assert sites.node_partition == {5: 0}


def test_a_node_excluded_for_its_pre_flight_answer_loses_its_partition_and_keeps_the_reason():
    sites = SiteRegistry()
    assert sites.bind(3, 0, Identity("supernode-0"), connected={3}) is None
    refusal = sites.exclude(3, "its data folder is missing")
    assert refusal.final and refusal.reason == "its data folder is missing"
    assert sites.refused[3] == refusal and 3 not in sites.node_partition and sites.node_of(0) is None
    # the partition's next node takes it, as after any node that left
    assert sites.bind(4, 0, Identity("supernode-0"), connected={4}) is None and sites.node_of(0) == 4


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


# ---------------------------------------------------------------- one partition, one key


def _pem() -> bytes:
    """A fresh P-256 public key, PEM, as the SuperLink stores a registered one."""
    public = ec.generate_private_key(ec.SECP256R1()).public_key()
    return public.public_bytes(serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo)


def test_a_partition_two_keys_map_to_stays_refused_for_both_for_the_rest_of_the_run():
    """A second key registered under a site's name makes its partition contested: its node and the
    other key's are both refused, the partition's bound node too while it is offline, and so is
    every node of it afterwards, whoever leaves. The same key again is no second key."""
    site, rogue, third = (Identity("supernode-0", "SHA256:" + c * 43) for c in "ABC")
    sites = SiteRegistry()
    assert sites.note_keys({1: site}) == ([], {})
    assert sites.bind(1, 0, site, connected={1}) is None
    # the same key under a new node id, its old one gone (a restart): no second key, today's rule
    assert sites.note_keys({2: site}) == ([], {}) and sites.bind(2, 0, site, connected={2}) is None
    # the rogue connects while the site is offline: it does not inherit the partition
    contested, refused = sites.note_keys({3: rogue})
    assert contested == [0] and sorted(refused) == [2, 3] and sites.node_partition == {}
    for node in (2, 3):
        reason = sites.refused[node].reason
        assert sites.refused[node].final and site.fingerprint in reason and rogue.fingerprint in reason
    # the rogue gone, the site back: still refused; a third key too; nothing binds partition 0
    assert sites.note_keys({2: site, 4: third}) == ([], {4: sites.refused[4]})
    assert "partition 0 has seen 3 keys" in sites.refused[4].reason
    assert "partition 0 has seen 3 keys" in sites.screen(5, Identity("supernode-0", site.fingerprint), 3).reason
    assert sites.bind(6, 0, site, connected={6}) is not None and sites.node_partition == {}
    # other partitions are not touched
    assert sites.screen(7, Identity("supernode-1", "SHA256:" + "D" * 43), 3) is None


def test_the_federations_size_is_the_most_common_backed_claim_and_the_smaller_on_a_tie():
    assert federation_size([3, 3, 7]) == 3
    assert federation_size([2, 2, 4, 4]) == 2  # as many claims of 4 as of 2: not the larger
    assert federation_size([3, 2]) == 2
    assert PartitionMap.parse("a=0, b=4").size() == 5 and PartitionMap.parse("").size() is None
    assert SiteRegistry(PartitionMap.parse("a=0, b=1")).declared_size() == 2
    assert SiteRegistry(PartitionMap.parse("a=0, b=1"), trusted_claims=True).declared_size() is None


def _keyed_grid(num_partitions: int) -> tuple[KeyedGrid, dict[int, int]]:
    """``num_partitions`` sites, each with a key of its own; and each partition's node."""
    grid = KeyedGrid(RUN_CONFIG, num_partitions, keys={pid: _pem() for pid in range(num_partitions)})
    return grid, {pid: node for node, pid in grid.partition_of_node.items()}


def _add_rogue(grid: KeyedGrid, node_id: int, name: str, partition: int) -> None:
    """Node ``node_id``: its own key, registered under ``name``, claiming ``partition`` (whose
    data it loads), with a Context of its own."""
    grid.contexts[node_id] = Context(run_id=7, node_id=node_id, state=RecordDict(), run_config=dict(RUN_CONFIG),
                                     node_config={"partition-id": partition,
                                                  "num-partitions": len(set(grid.partition_of_node.values()))})
    grid.partition_of_node[node_id] = partition
    grid.names[node_id] = name
    grid.keys[node_id] = _pem()


def _trainers(strategy, grid, server_round=1) -> set[int]:
    messages = strategy.configure_train(server_round, p.to_record(strategy.extractor), ConfigRecord(), grid)
    return {m.metadata.dst_node_id for m in messages}


# node ids are uint64: the honest ones are above 2**63, the rogue below all of them or above
@pytest.mark.parametrize("rogue_id", [2**62, 2**64 - 1], ids=["rogue-first", "rogue-last"])
def test_a_rogue_registered_under_a_sites_name_leaves_its_partition_to_nobody_whatever_the_node_ids(
        rogue_id, caplog):
    """A rogue sent its own key as supernode-0.pub and was registered as supernode-0: at the
    pre-flight both it and site 0 are refused, loudly, with both keys' fingerprints; the smaller
    node id does not win. The other sites train."""
    grid, site = _keyed_grid(3)
    _add_rogue(grid, rogue_id, "supernode-0", 0)
    strategy = _strategy(min_available_nodes=2)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    assert bound == {site[1]: 1, site[2]: 2}
    assert "Partition 0 is registered under more than one key" in caplog.text
    for node, key in ((site[0], grid.keys[0]), (rogue_id, grid.keys[rogue_id])):
        assert f"Refused node {node}: partition 0 has seen 2 keys" in caplog.text
        assert fingerprint(key) in caplog.text
    assert _trainers(strategy, grid) == {site[1], site[2]}
    # refused by their keys alone: neither was sent anything, not even the pre-flight's query
    assert not {site[0], rogue_id} & {m.metadata.dst_node_id for m in grid.sent}


@pytest.mark.parametrize("site_online", [True, False], ids=["site-online", "site-offline"])
def test_a_rogue_under_a_sites_name_joining_mid_run_takes_nothing_even_once_the_site_is_offline(
        site_online, caplog):
    """Site 0 is bound; a rogue registered as supernode-0 connects in the middle of the run, while
    site 0 is connected or once it is offline (what a patient rogue waits for): the rogue is
    sent nothing, and partition 0 is served by nobody for the rest of the run, site 0 back or not."""
    grid, site = _keyed_grid(3)
    strategy = _strategy()
    strategy.discover(grid, timeout=60)
    assert _trainers(strategy, grid) == set(site.values())
    site_0 = grid.contexts[site[0]]
    if not site_online:
        del grid.contexts[site[0]]
    _add_rogue(grid, 2**62, "supernode-0", 0)
    with caplog.at_level(logging.WARNING):
        assert _trainers(strategy, grid, 2) == {site[1], site[2]}
    grid.contexts[site[0]] = site_0
    del grid.contexts[2**62]  # the rogue leaves: the partition stays refused
    assert _trainers(strategy, grid, 3) == {site[1], site[2]}
    assert 0 not in strategy.node_partition.values() and 2**62 not in {m.metadata.dst_node_id for m in grid.sent}
    assert fingerprint(grid.keys[0]) in caplog.text and fingerprint(grid.keys[2**62]) in caplog.text


@pytest.mark.parametrize("args, refusal", [
    (("{pub}", "fed"), "a key a site sent is registered under the name you give it, not its file's: "
                       "certs.sh register --name supernode-<i> {pub} fed"),
    (("--name", "supernode-0", "fed"), "name the key file too: certs.sh register --name supernode-0 KEY.pub fed"),
    (("--name", "site 0", "{pub}", "fed"), "--name site 0: use letters, digits, '-' and '_'"),
], ids=["no-name", "no-file", "bad-name"])
def test_registering_a_key_a_site_sent_takes_its_name_from_the_operator_not_the_file(tmp_path, args, refusal):
    """``certs.sh register`` of one .pub (a file a site sent, named by the site) needs the name
    from the operator; refused before it asks any SuperLink anything (no flwr on the PATH here).
    The refusal of a name another key holds needs a SuperLink: tests/test_site_identity.py."""
    _key_pair(tmp_path, "supernode-0")
    pub = str(tmp_path / "supernode-0.pub")
    result = subprocess.run(["bash", str(CERTS), "register", *(a.format(pub=pub) for a in args)], capture_output=True,
                            text=True, timeout=60, env={**os.environ, "PATH": "/usr/bin:/bin"})
    assert result.returncode == 1 and refusal.format(pub=pub) in result.stderr, result.stderr
