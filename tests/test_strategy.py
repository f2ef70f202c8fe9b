"""The Strategy (PersonalizedStrategy, with FedPAC's server part unless a test names another method)
driven through an in-process federation of real ClientApps."""

import logging
import time

import numpy as np
import pytest
from flwr.app import ConfigRecord

from common import protocol as p
from common.averaging import weighted_average
from common.methods.fedpac.collaboration import collaboration_weights, mix_heads
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import HEAD, server_part
from common.robust import agreeing_mix
from federation import InProcessGrid, set_section
from server_app.app import initial_model
from server_app.replies import parse_train_reply
from server_app.strategy import PersonalizedStrategy
from common.model import split_state

RUN_CONFIG = {
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
}


def _strategy(cfg, **kwargs):
    """The strategy of the method ``cfg`` names (FedPAC by default) on its initial model."""
    model = initial_model(cfg)
    extractor, head = split_state({k: v.numpy() for k, v in model.state_dict().items()})
    server = server_part(METHODS[cfg.strategy], cfg, extractor, head)
    strategy = PersonalizedStrategy(server=server, num_rounds=cfg.num_server_rounds, seed=cfg.seed, **kwargs)
    return strategy, p.to_record(extractor)


def _train_round(strategy, grid, arrays, server_round=1):
    messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
    replies = grid.send_and_receive(messages)
    return messages, replies, strategy.aggregate_train(server_round, replies)


def _run_round(shuffle, num_partitions=5, run_config=RUN_CONFIG):
    cfg = parse_run_config(run_config)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(run_config, num_partitions, shuffle_replies=shuffle, seed=3)
    _, replies, (new_arrays, metrics) = _train_round(strategy, grid, arrays)
    return strategy, replies, new_arrays, metrics


def test_each_head_is_mixed_with_its_own_alpha_row_under_shuffled_replies():
    strategy, replies, new_arrays, _ = _run_round(shuffle=True)
    template_extractor = p.from_record(new_arrays)
    updates = sorted(
        (parse_train_reply(r, strategy.server).update for r in replies),
        key=lambda u: u.partition_id,
    )
    assert [u.partition_id for u in updates] == [0, 1, 2, 3, 4]
    expected = collaboration_weights(
        np.stack([u.parsed["h"] for u in updates]), np.array([u.parsed["v"] for u in updates]),
        np.array([u.num_examples for u in updates], dtype=float),
    )
    # each client's mix leaves out the heads whose move from the head every client was sent in
    # round 1 (the initial model's) points away from its own (agreeing-heads)
    model = initial_model(parse_run_config(RUN_CONFIG))
    _, initial = split_state({k: v.numpy() for k, v in model.state_dict().items()})
    moves = np.stack([np.concatenate([(u.head[k].astype(np.float64) - initial[k]).ravel() for k in sorted(u.head)])
                      for u in updates])
    alpha, _ = agreeing_mix(expected.alpha, moves)
    mixed = mix_heads([u.head for u in updates], alpha)
    for update, head in zip(updates, mixed):
        for key in head:
            np.testing.assert_allclose(strategy.state.personal[HEAD][update.partition_id][key], head[key], rtol=1e-6)
    # the extractor is the sample-weighted mean of the replies' extractors
    average = weighted_average([u.extractor for u in updates], [u.num_examples for u in updates])
    for key, value in average.items():
        np.testing.assert_allclose(template_extractor[key], value, rtol=1e-6)


def test_reply_order_does_not_change_the_result():
    ordered, _, arrays_a, _ = _run_round(shuffle=False)
    shuffled, _, arrays_b, _ = _run_round(shuffle=True)
    for pid in range(5):
        for key in ordered.state.personal[HEAD][pid]:
            np.testing.assert_allclose(ordered.state.personal[HEAD][pid][key], shuffled.state.personal[HEAD][pid][key],
                                       rtol=1e-6)
    for key, value in p.from_record(arrays_a).items():
        np.testing.assert_allclose(value, p.from_record(arrays_b)[key], rtol=1e-6)


def test_every_node_receives_its_own_head_next_round():
    cfg = parse_run_config(RUN_CONFIG)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 4, shuffle_replies=True)
    _, _, (arrays, _) = _train_round(strategy, grid, arrays, 1)
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    assert len({id(m.content) for m in messages}) == len(messages)  # no shared records
    for msg in messages:
        pid = grid.partition_of_node[msg.metadata.dst_node_id]
        sent = p.sections_of(msg.content)[p.MODEL]
        for key, value in strategy.state.personal[HEAD][pid].items():
            np.testing.assert_array_equal(sent[key], value)
        np.testing.assert_array_equal(p.sections_of(msg.content)[p.CENTROIDS][p.CENTROID_MASK],
                                      strategy.state.shared[CENTROIDS][p.CENTROID_MASK].astype(np.uint8))
    assert strategy.state.shared[CENTROIDS][p.CENTROID_MASK][:10].any()


def test_partial_participation_samples_the_fraction_and_all_in_last_round():
    cfg = parse_run_config({**RUN_CONFIG, "num-server-rounds": 3, "fraction-train": 0.4})
    strategy, arrays = _strategy(cfg, fraction_train=0.4)
    grid = InProcessGrid(RUN_CONFIG, 10)
    assert len(list(strategy.configure_train(1, arrays, ConfigRecord(), grid))) == 4
    assert len(list(strategy.configure_train(3, arrays, ConfigRecord(), grid))) == 10


def test_bad_and_failed_replies_are_rejected_and_the_round_goes_on(caplog):
    def tamper(reply, pid):
        if pid == 1:  # NaN statistics
            stats = p.sections_of(reply.content)[p.STATISTICS]
            stats[p.H][0, 0] = np.nan
            set_section(reply, p.STATISTICS, stats)
        if pid == 2:  # a client that lies about its sample count
            reply.content[p.METRICS][p.NUM_EXAMPLES] = 10**6
        return reply

    cfg = parse_run_config(RUN_CONFIG)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 5, tamper=tamper)
    strategy.discover(grid, timeout=60)
    bad_node = next(n for n, pid in grid.partition_of_node.items() if pid == 3)
    grid.contexts[bad_node].node_config["partition-id"] = 99  # from now on raises in the ClientApp
    with caplog.at_level(logging.WARNING):
        _, _, (new_arrays, metrics) = _train_round(strategy, grid, arrays)
    assert new_arrays is not None and metrics["num-replies"] == 2
    assert sorted(strategy.state.personal[HEAD]) == [0, 4]
    assert "holds NaN" in caplog.text or "hold NaN" in caplog.text
    assert "num-examples" in caplog.text
    assert "client error" in caplog.text


def test_a_client_far_off_the_others_scale_is_named_in_the_log(caplog):
    """A client whose h is 1e3 times everyone else's is valid (finite) input: the round goes on,
    nobody else mixes its head, and the log names its partition so an operator can look into it."""
    def tamper(reply, pid):
        if pid == 2:
            stats = p.sections_of(reply.content)[p.STATISTICS]
            stats[p.H] = stats[p.H] * 1e3
            set_section(reply, p.STATISTICS, stats)
        return reply

    cfg = parse_run_config(RUN_CONFIG)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 5, tamper=tamper)
    with caplog.at_level(logging.WARNING):
        _, _, (new_arrays, metrics) = _train_round(strategy, grid, arrays)
    assert new_arrays is not None and metrics["num-replies"] == 5
    assert "partitions [2] report feature statistics" in caplog.text
    record = strategy._record  # pylint: disable=protected-access  # the round's alpha, as the report gets it
    assert record is not None
    alpha = np.array(record.method["alpha"])
    far = record.method["alpha_partitions"].index(2)
    assert (np.delete(alpha[:, far], far) == 0).all()


def test_aggregated_alignment_targets_that_are_not_finite_are_not_kept(monkeypatch, caplog):
    """Replies are checked in the model's dtype, so no average of them should overflow it; should
    one all the same, the clients' alignment targets (and the checkpoint) keep the last finite ones:
    FedPAC's global centroids, and FedCCFA's per-client anchors."""
    import dataclasses

    import common.methods.fedccfa.server as fedccfa_server
    import common.methods.fedpac.server as fedpac_server
    from common.methods.fedccfa.server import ANCHORS

    aggregate_centroids, clustered_heads = fedpac_server.aggregate_centroids, fedccfa_server.clustered_heads

    def overflowing_centroids(*args, **kwargs):
        centroids, mask = aggregate_centroids(*args, **kwargs)
        return np.full_like(centroids, np.inf), mask

    def overflowing_anchors(*args, **kwargs):
        heads, clusters = clustered_heads(*args, **kwargs)
        anchors = clusters.anchors.copy()
        anchors[1] = np.inf  # the second reply's (partition 1's) merged anchors
        return heads, dataclasses.replace(clusters, anchors=anchors)

    monkeypatch.setattr(fedpac_server, "aggregate_centroids", overflowing_centroids)
    monkeypatch.setattr(fedccfa_server, "clustered_heads", overflowing_anchors)
    # FedPAC: the global centroids
    strategy, arrays = _strategy(parse_run_config(RUN_CONFIG))
    centroids = {key: value.copy() for key, value in strategy.state.shared[CENTROIDS].items()}
    with caplog.at_level(logging.WARNING):
        _train_round(strategy, InProcessGrid(RUN_CONFIG, 3), arrays)
    assert "aggregated centroids are not all finite" in caplog.text
    for key, value in centroids.items():
        np.testing.assert_array_equal(strategy.state.shared[CENTROIDS][key], value)
    # FedCCFA: each client's anchors
    config = {**RUN_CONFIG, "strategy": "fedccfa"}
    strategy, arrays = _strategy(parse_run_config(config))
    num_classes, dim = strategy.server.head_template[p.HEAD_WEIGHT].shape
    previous = {p.CENTROID_VALUES: np.ones((num_classes, dim), np.float32),  # of an earlier round
                p.CENTROID_MASK: np.ones(num_classes, dtype=bool)}
    strategy.state.keep(ANCHORS, 1, previous)
    with caplog.at_level(logging.WARNING):
        _train_round(strategy, InProcessGrid(config, 3), arrays)
    assert "merged anchors of partitions [1] are not all finite" in caplog.text
    anchors = strategy.state.personal[ANCHORS]
    assert anchors[1] is previous  # partition 1 keeps its earlier anchors
    assert sorted(anchors) == [0, 1, 2]  # the others take this round's
    assert all(np.isfinite(part[p.CENTROID_VALUES]).all() for part in anchors.values())


def test_a_round_without_valid_replies_keeps_the_global_state():
    cfg = parse_run_config(RUN_CONFIG)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=lambda reply, pid: None)
    _, _, (new_arrays, metrics) = _train_round(strategy, grid, arrays)
    assert new_arrays is None and metrics is None
    assert not strategy.state.personal.get(HEAD) and not strategy.state.shared[CENTROIDS][p.CENTROID_MASK].any()


def test_too_few_replies_skip_the_round_then_stop_the_run_cleanly(tmp_path, caplog):
    from server_app.app import run_fedpac
    from server_app.strategy import FederationStalled

    def fail_two_clients(reply, pid):
        # partitions 0 and 1 fail from round 2 on: their train replies become errors
        if pid < 2 and reply.metadata.message_type == "train" and grid.train_rounds >= 2:
            return None
        return reply

    config = {**RUN_CONFIG, "num-server-rounds": 6, "min-train-replies": 3, "max-failed-rounds": 2,
              "output-dir": str(tmp_path)}
    grid = InProcessGrid(config, 4, tamper=fail_two_clients)
    with caplog.at_level(logging.WARNING), pytest.raises(FederationStalled, match="max-failed-rounds = 2"):
        run_fedpac(grid, parse_run_config(config), 1)
    assert "fewer than min-train-replies = 3" in caplog.text
    assert grid.train_rounds == 4  # round 1 fine, rounds 2-3 skipped and retried, round 4 stops
    (run_dir,) = tmp_path.iterdir()
    from server_app.checkpoint import load_checkpoint

    checkpoint = load_checkpoint(run_dir)  # the outputs of finished rounds are kept
    assert checkpoint.completed_rounds == 3
    assert len(list(csv_rows(run_dir / "rounds.csv"))) == 3


def csv_rows(path):
    import csv

    return csv.DictReader(path.open())


def test_a_restarted_supernode_gets_its_own_head_back():
    cfg = parse_run_config(RUN_CONFIG)
    strategy, arrays = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 3)
    strategy.discover(grid, timeout=60)
    _, _, (arrays, _) = _train_round(strategy, grid, arrays, 1)
    # the SuperNode of partition 2 restarts: same partition, new node id
    old = next(n for n, pid in grid.partition_of_node.items() if pid == 2)
    context = grid.contexts.pop(old)
    del grid.partition_of_node[old]
    grid.contexts[12345] = context
    grid.partition_of_node[12345] = 2
    messages = list(strategy.configure_train(2, arrays, ConfigRecord(), grid))
    sent = next(p.sections_of(m.content)[p.MODEL] for m in messages if m.metadata.dst_node_id == 12345)
    np.testing.assert_array_equal(sent["head.weight"], strategy.state.personal[HEAD][2]["head.weight"])
    assert strategy.node_partition.get(12345) == 2 and old not in strategy.node_partition


def test_discovery_asks_again_a_node_whose_query_was_lost(monkeypatch, caplog):
    """An overloaded SuperLink can make a SuperNode drop a message it failed to pull; the
    pre-flight then asks that node again instead of waiting for the whole timeout."""
    import server_app.federation as federation_module

    monkeypatch.setattr(federation_module, "DISCOVERY_ATTEMPT", 0.01)
    lost = []

    def lose_partition_1_once(reply, pid):
        if pid == 1 and not lost:
            lost.append(reply)
            return None
        return reply

    cfg = parse_run_config(RUN_CONFIG)
    strategy, _ = _strategy(cfg)
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=lose_partition_1_once, tamper_queries=True)
    with caplog.at_level(logging.WARNING):
        assert sorted(strategy.discover(grid, timeout=60).values()) == [0, 1, 2]
    assert lost and "asking them again" in caplog.text
    queried = [m.metadata.dst_node_id for m in grid.sent]
    silent = next(node for node, pid in grid.partition_of_node.items() if pid == 1)
    assert len(queried) == 4 and queried[3] == silent  # only the silent node, once more


class OfflineGrid(InProcessGrid):
    """Message ids as a deployment's grid gives them, and SuperNodes that die. A ``dying`` node
    is still listed until the SuperLink gives up on its heartbeat; from then on the SuperLink
    answers a message to it in its place (Flower's own error message: sender the SuperLink,
    code NODE_UNAVAILABLE) and no longer lists it, unless it is ``back`` (a restarted SuperNode,
    same key, same node id), which is listed and answers again."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.dying: set[int] = set()
        self.back: set[int] = set()
        self.expired: set[int] = set()

    def get_node_ids(self):
        return [n for n in self.contexts if n not in self.expired]

    def send_and_receive(self, messages, *, timeout=None):
        from uuid import uuid4

        from flwr.server.superlink.linkstate.utils import create_message_error_unavailable_res_message

        messages = list(messages)
        for msg in messages:
            msg.metadata.__dict__["_message_id"] = uuid4().hex
        down = [m for m in messages if m.metadata.dst_node_id in self.dying | self.expired]
        replies = super().send_and_receive([m for m in messages if m not in down], timeout=timeout)
        self.sent.extend(down)
        errors = [create_message_error_unavailable_res_message(m.metadata, "node_unavail") for m in down]
        self.expired |= self.dying - self.back
        self.dying.clear()
        return [*replies, *errors]


def test_discovery_asks_a_restarted_node_again_once_it_is_back(monkeypatch, caplog):
    """A SuperNode killed just before the run starts is still listed; the SuperLink answers the
    query in its place (Node Unavailable). It restarts under its key, so it comes back with the
    same node id: the pre-flight asks it again then, instead of failing the run on that error."""
    import server_app.federation as federation_module

    monkeypatch.setattr(federation_module, "DISCOVERY_ATTEMPT", 30.0)
    strategy, _ = _strategy(parse_run_config(RUN_CONFIG))
    grid = OfflineGrid(RUN_CONFIG, 3)
    restarted = next(node for node, pid in grid.partition_of_node.items() if pid == 2)
    grid.dying, grid.back = {restarted}, {restarted}
    started = time.monotonic()
    with caplog.at_level(logging.WARNING):
        assert strategy.discover(grid, timeout=60) == grid.partition_of_node
    assert time.monotonic() - started < 30  # asked again as soon as it was back
    assert [m.metadata.dst_node_id for m in grid.sent].count(restarted) == 2
    assert "node 1" not in caplog.text  # the SuperLink's id is nobody's


def test_discovery_leaves_out_a_node_that_went_offline_and_the_run_goes_on(monkeypatch, caplog):
    import server_app.federation as federation_module

    monkeypatch.setattr(federation_module, "DISCOVERY_ATTEMPT", 0.05)
    strategy, arrays = _strategy(parse_run_config(RUN_CONFIG))
    grid = OfflineGrid(RUN_CONFIG, 3)
    dead = next(node for node, pid in grid.partition_of_node.items() if pid == 2)
    grid.dying = {dead}
    with caplog.at_level(logging.WARNING):
        found = strategy.discover(grid, timeout=60)  # strict, and still no error
    assert sorted(found.values()) == [0, 1] and dead not in found
    assert f"node {dead} went offline before it answered; left out" in caplog.text
    _, replies, (new_arrays, _) = _train_round(strategy, grid, arrays)
    assert len(replies) == 2 and new_arrays is not None


def test_a_training_error_the_superlink_writes_for_an_offline_node_names_that_node(caplog):
    strategy, arrays = _strategy(parse_run_config(RUN_CONFIG))
    grid = OfflineGrid(RUN_CONFIG, 3)
    strategy.discover(grid, timeout=60)
    dead = next(node for node, pid in grid.partition_of_node.items() if pid == 2)
    grid.dying = {dead}  # dies after the pre-flight
    with caplog.at_level(logging.WARNING):
        _, replies, (new_arrays, _) = _train_round(strategy, grid, arrays)
    assert len(replies) == 3 and new_arrays is not None  # two valid replies are enough
    assert f"Rejected reply from node {dead} (partition 2): client error: Error: Node Unavailable" in caplog.text


def test_a_round_with_every_node_gone_fails_and_the_run_stops_cleanly(caplog):
    """Every SuperNode died after the pre-flight: a sampled round has nobody to send to. It is a
    round without replies (counted against max-failed-rounds), not a crash of the server."""
    from server_app.strategy import FederationStalled

    strategy, arrays = _strategy(parse_run_config(RUN_CONFIG), fraction_train=0.5, fraction_evaluate=0.5,
                                 max_failed_rounds=1)
    grid = OfflineGrid(RUN_CONFIG, 3)
    strategy.discover(grid, timeout=60)
    grid.expired = set(grid.contexts)
    strategy.discovery_timeout = 0.01  # how long a round waits for nodes to come back
    with caplog.at_level(logging.WARNING):
        messages, replies, (new_arrays, metrics) = _train_round(strategy, grid, arrays, 1)
        assert messages == [] and replies == [] and new_arrays is None and metrics is None
        assert list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid)) == []
        with pytest.raises(FederationStalled, match="max-failed-rounds = 1"):
            _train_round(strategy, grid, arrays, 2)
    assert "only 0 of the 2 required nodes connected" in caplog.text
