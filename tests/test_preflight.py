"""The pre-flight with node identities (a deployment): one faulty or hostile site does not stop
everyone's run, and no answer moves the federation's size away from the operator's.

Each test attacks through ``PersonalizedStrategy`` on an in-process federation whose nodes are
known, as Flower's Grid knows them, by the name the operator registered (``supernode-<i>``); a
node the test adds has a node config of its own (its claim, its num-partitions)."""

import logging

import pytest
from flwr.app import ConfigRecord, Context, Message, MessageType, RecordDict
from flwr.proto.node_pb2 import NodeInfo  # pylint: disable=no-name-in-module

from common import protocol as p
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.server import server_part
from common.model import split_state
from common.sites import PartitionMap, SiteRegistry
from federation import InProcessGrid
from server_app.app import initial_model
from server_app.strategy import PersonalizedStrategy

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20}


class NamedGrid(InProcessGrid):
    """Nodes registered as ``supernode-<i>`` of the partition they hold, unless ``names`` says
    otherwise."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.names: dict[int, str] = {}

    def get_nodes(self):
        return [NodeInfo(node_id=n, name=self.names.get(n, f"supernode-{self.partition_of_node[n]}"))
                for n in self.get_node_ids()]


def _grid(num_partitions: int, **kwargs) -> tuple[NamedGrid, dict[int, int]]:
    grid = NamedGrid(RUN_CONFIG, num_partitions, **kwargs)
    return grid, {pid: node for node, pid in grid.partition_of_node.items()}


def _configure(grid: NamedGrid, node: int, partition: int, num_partitions: int) -> None:
    """Node ``node`` (added, or replaced) claims ``partition`` of ``num_partitions``."""
    grid.contexts[node] = Context(run_id=7, node_id=node, state=RecordDict(), run_config=dict(RUN_CONFIG),
                                  node_config={"partition-id": partition, "num-partitions": num_partitions})
    grid.partition_of_node[node] = partition


def _strategy(min_available_nodes: int, partition_map: str = "") -> PersonalizedStrategy:
    cfg = parse_run_config(RUN_CONFIG)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    return PersonalizedStrategy(server=server_part(METHODS["fedpac"], cfg, extractor, head), num_rounds=2,
                                sites=SiteRegistry(PartitionMap.parse(partition_map)),
                                min_available_nodes=min_available_nodes)


def _train_one_round(strategy: PersonalizedStrategy, grid: NamedGrid) -> tuple[set[int], int]:
    """Round 1: the nodes sent a model, and how many valid replies were aggregated."""
    messages = list(strategy.configure_train(1, p.to_record(strategy.extractor), ConfigRecord(), grid))
    _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    return {m.metadata.dst_node_id for m in messages}, int(metrics["num-replies"])


def test_rogues_as_many_as_the_sites_claiming_a_larger_federation_do_not_move_its_size(caplog):
    """Two sites (num-partitions 2) and two enrolled rogues registered as supernode-2 and
    supernode-3, each backing its own claim of a federation of 4: as many claims of 4 as of 2.
    The size stays 2, the rogues are refused, the sites train (the larger claim used to win the
    tie: the sites were named misconfigured and the run did not start)."""
    grid, site = _grid(2)
    for node, pid in ((2**62, 2), (2**62 + 1, 3)):
        _configure(grid, node, pid, 4)
    strategy = _strategy(min_available_nodes=2)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    assert strategy.num_partitions == 2 and bound == {site[0]: 0, site[1]: 1}
    for node, pid in ((2**62, 2), (2**62 + 1, 3)):
        assert f"Refused node {node}: its identity (name 'supernode-{pid}') serves partition {pid}, not one of " \
               "the federation's 2" in caplog.text
    assert _train_one_round(strategy, grid) == ({site[0], site[1]}, 2)


def test_a_node_named_for_the_partition_at_the_federations_size_is_refused(caplog):
    """The boundary: a one-site federation (site 0, num-partitions 1) and a node registered as
    supernode-1 backing a claim of partition 1 of 2. Partition 1 is one past the federation: the
    node is refused, the site trains."""
    grid, site = _grid(1)
    _configure(grid, 2**62, 1, 2)
    strategy = _strategy(min_available_nodes=1)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    assert strategy.num_partitions == 1 and bound == {site[0]: 0}
    assert f"Refused node {2**62}: its identity (name 'supernode-1') serves partition 1, not one of the " \
           "federation's 1" in caplog.text
    assert _train_one_round(strategy, grid) == ({site[0]}, 1)


def _malformed(reply: Message) -> Message:
    del reply.content[p.METRICS]["num-partitions"]
    return reply


FAULTS = {  # what partition 1's pre-flight answer becomes (an error: see below), and the reason given
    "malformed": (_malformed, "its pre-flight answer is invalid: missing metric 'num-partitions'"),
    "an error": (lambda reply: reply, "its pre-flight answer is invalid: DataError: client data directory"),
    "silent": (lambda reply: None, "it did not answer the pre-flight within 1s"),
}


def _faulty_query(fault: str, partitions: tuple[int, ...] = (1,)):
    def tamper(reply, pid):
        if reply.metadata.message_type == MessageType.QUERY and pid in partitions:
            return FAULTS[fault][0](reply)
        return reply
    return tamper


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_a_site_whose_preflight_answer_is_faulty_is_excluded_and_the_run_starts(fault, caplog):
    """Three sites, min-available-clients 2; site 1's answer is malformed, an error, or never
    comes: site 1 is excluded from the run (logged, sent nothing more) and the others train (the
    pre-flight used to stop the whole run, and every resume of it)."""
    grid, site = _grid(3, tamper=_faulty_query(fault), tamper_queries=True)
    if fault == "an error":  # the site's data folder is not there: its ClientApp raises
        grid.contexts[site[1]].node_config["data-path"] = "/nonexistent/site-1"
    strategy = _strategy(min_available_nodes=2)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=1)
    assert bound == {site[0]: 0, site[2]: 2}
    assert f"Excluded node {site[1]} from this run: {FAULTS[fault][1]}" in caplog.text
    assert _train_one_round(strategy, grid) == ({site[0], site[2]}, 2)
    assert {m.metadata.message_type for m in grid.sent if m.metadata.dst_node_id == site[1]} == {MessageType.QUERY}


@pytest.mark.parametrize("partition_map, misconfigured", [("", 1), ("supernode-0=0, supernode-1=1", 0)],
                         ids=["default-map", "partition-map"])
def test_a_two_site_tie_on_the_size_does_not_go_to_the_larger_claim(partition_map, misconfigured, caplog):
    """Two sites, one of them configured with num-partitions 3. With partition-map the operator
    said the size (2); with the default map the smaller claim wins the tie (a site registered as
    supernode-1 backs any claim above 1). Either way the site that says 2 trains, the other is
    excluded (the larger claim used to win: the right site was named misconfigured)."""
    grid, site = _grid(2)
    _configure(grid, site[misconfigured], misconfigured, 3)
    strategy = _strategy(min_available_nodes=1, partition_map=partition_map)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    right = 1 - misconfigured
    assert strategy.num_partitions == 2 and bound == {site[right]: right}
    assert f"Excluded node {site[misconfigured]} from this run: num-partitions 3, the federation's is 2" in caplog.text
    assert _train_one_round(strategy, grid) == ({site[right]}, 1)


def test_too_few_sites_left_stops_the_run_naming_every_node_left_out_and_why():
    """Four sites, min-available-clients 3: site 1 answers malformed, site 2 never answers, and a
    stranger (registered under a name that serves no partition) is refused. Two sites remain:
    the run does not start, and the error names all three nodes and why."""
    grid, site = _grid(4, tamper=_faulty_query("malformed", (1,)), tamper_queries=True)
    silent = _faulty_query("silent", (2,))
    malformed = grid.tamper
    grid.tamper = lambda reply, pid: silent(malformed(reply, pid), pid)
    _configure(grid, 2**62, 0, 4)
    grid.names[2**62] = "stranger"
    strategy = _strategy(min_available_nodes=3)
    with pytest.raises(RuntimeError) as raised:
        strategy.discover(grid, timeout=1)
    message = str(raised.value)
    assert "2 node(s) left to serve a partition, min-available-clients is 3" in message, message
    assert f"node {site[1]}: its pre-flight answer is invalid: missing metric 'num-partitions'" in message
    assert f"node {site[2]}: it did not answer the pre-flight within 1s" in message
    assert f"node {2**62}: its identity (name 'stranger') serves no partition" in message
    assert not any(m.metadata.message_type == MessageType.TRAIN for m in grid.sent)


def test_a_node_silent_at_discovery_during_the_run_is_not_waited_for_every_round(caplog, monkeypatch):
    """Site 1's SuperNode restarts under a new node id after the pre-flight, and its ClientApp
    never answers the query that binds it. Discovery during the run asks it once, then backs off
    (it used to ask, and wait for it, at every round); once the back-off has passed it is asked
    again, and bound when it answers."""
    grid, site = _grid(3, tamper=_faulty_query("silent"), tamper_queries=True)
    grid.tamper = None  # the pre-flight goes well
    strategy = _strategy(min_available_nodes=2)
    strategy.discover(grid, timeout=1)
    del grid.contexts[site[1]], grid.partition_of_node[site[1]]
    restarted = 2**62
    _configure(grid, restarted, 1, 3)
    grid.tamper = _faulty_query("silent")
    def queries() -> int:
        return sum(m.metadata.dst_node_id == restarted and m.metadata.message_type == "query" for m in grid.sent)

    asked = []
    with caplog.at_level(logging.WARNING):
        for server_round in (1, 2, 3):
            list(strategy.configure_train(server_round, p.to_record(strategy.extractor), ConfigRecord(), grid))
            asked.append(queries())
    assert asked[0] >= 1 and asked[2] == asked[0]  # asked in round 1 only
    assert f"node {restarted} did not answer within" in caplog.text and "not asked again for 120s" in caplog.text
    strategy._silent[restarted] = (0.0, 120.0)  # pylint: disable=protected-access  # the back-off has passed
    grid.tamper = None
    sent = list(strategy.configure_train(4, p.to_record(strategy.extractor), ConfigRecord(), grid))
    assert strategy.node_partition[restarted] == 1 and restarted in {m.metadata.dst_node_id for m in sent}
