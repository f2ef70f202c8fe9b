"""Every kind of bad reply is rejected with a logged reason; the rest of the round proceeds
and nothing from the bad reply reaches the global state."""

import io
import re
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord

from common import protocol as p
from common.config import parse_run_config
from common.files import npz_bytes
from common.methods import METHODS
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import HEAD, server_part
from common.sites import SiteRegistry
from federation import InProcessGrid, drop_section, nan, set_array, set_metric, set_section
from server_app.app import initial_model
from server_app.strategy import PersonalizedStrategy
from common.model import split_state

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20}
BAD = 1  # the partition whose reply is tampered with


def _inf(a):
    a.flat[-1] = np.inf
    return a


def _add_record(reply):
    reply.content["extra"] = p.to_record({"blob": np.zeros(10**6)})


def _add_small_record(reply):
    reply.content["extra"] = p.to_record({"blob": np.zeros(10)})


def _replace_packed(record_key, buffer):
    def tamper(reply):
        reply.content[record_key] = ArrayRecord(array_dict={p.PACKED: Array(buffer)})
    return tamper


def _zip(member: str, data: bytes, encrypted: bool = False):
    """A packed buffer with one member as given: raw bytes, flagged (not really) encrypted if
    asked: bit 0 of the flags of its local header (offset 6) and its central directory entry
    (offset 8), which zipfile itself never writes for us."""
    import zipfile

    stream = io.BytesIO()
    with zipfile.ZipFile(stream, "w") as archive:
        archive.writestr(member, data)
    buffer = bytearray(stream.getvalue())
    if encrypted:
        buffer[6] |= 1
        buffer[buffer.index(b"PK\x01\x02") + 8] |= 1
    return np.frombuffer(bytes(buffer), dtype=np.uint8)


def _drop_metric(key):
    def tamper(reply):
        del reply.content[p.METRICS][key]
    return tamper


def _metrics_as_config(reply):
    reply.content[p.METRICS] = ConfigRecord(dict(reply.content[p.METRICS]))


def _compressed(arrays):
    stream = io.BytesIO()
    np.savez_compressed(stream, **arrays)
    return np.frombuffer(stream.getvalue(), dtype=np.uint8)


CASES = {
    "nan in extractor weights": (set_array(p.MODEL, "extractor.0.weight", nan), "NaN or Inf"),
    "inf in head bias": (set_array(p.MODEL, "head.bias", _inf), "NaN or Inf"),
    "nan in h": (set_array(p.STATISTICS, p.H, nan), "NaN or Inf"),
    "inf in centroids": (set_array(p.STATISTICS, p.CENTROID_VALUES, _inf), "NaN or Inf"),
    "nan V": (set_metric(p.V, float("nan")), "not a finite number"),
    "wrong extractor shape": (set_array(p.MODEL, "extractor.0.weight", lambda a: a[:8]), "shape"),
    "wrong number of classes in the head": (set_array(p.MODEL, "head.weight", lambda a: a[:7]), "shape"),
    "wrong number of classes in h": (set_array(p.STATISTICS, p.H, lambda a: a[:7]), "shape"),
    "wrong number of classes in the counts": (set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a[:7]), "shape"),
    "negative counts": (set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a - a.max()), "non-negative"),
    "counts inconsistent with n": (set_metric(p.NUM_EXAMPLES, 7), "equal the class counts"),
    "n = 0": (lambda r: (set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a * 0)(r),
                         set_metric(p.NUM_EXAMPLES, 0)(r)), "must be positive"),
    "negative V": (set_metric(p.V, -1.0), "negative"),
    "partition-id out of range": (set_metric(p.PARTITION_ID, 7), "not a valid partition"),
    "partition-id of another client": (set_metric(p.PARTITION_ID, 0), "it claims partition 0"),
    "oversized: an extra record": (_add_record, "a reply of this model can need"),
    "oversized: a huge metric list": (set_metric("padding", [0.0] * 100_000), "a reply of this model can need"),
    "an extra record": (_add_small_record, "unexpected record"),
    "a metric list": (set_metric("padding", [0.0] * 10), "lists"),
    "missing statistics": (drop_section(p.STATISTICS), "missing section 'statistics'"),
    "packed arrays not an archive": (_replace_packed(p.ARRAYS, np.arange(100, dtype=np.uint8)), "not a packed"),
    "packed arrays as floats": (_replace_packed(p.ARRAYS, np.zeros(10)), "holds bytes"),
    "packed arrays compressed (a zip bomb)": (
        _replace_packed(p.ARRAYS, _compressed({f"{p.STATISTICS}/{p.H}": np.zeros((10, 128))})),
        "must not be compressed"),
    "an extra section": (lambda r: set_section(r, "extra", {"blob": np.zeros(10)}), "unexpected section"),
    "an array in no section": (_replace_packed(p.ARRAYS, np.frombuffer(npz_bytes({"h": np.zeros(10)}), np.uint8)),
                               "not named <section>/<array>"),
    "arrays as a metric record": (lambda r: r.content.__setitem__(p.ARRAYS, MetricRecord({"x": 1.0})),
                                  "not an ArrayRecord"),
    # finite as float64, Inf once cast to the model's float32
    "extractor weights that overflow float32": (set_array(p.MODEL, "extractor.0.weight",
                                                          lambda a: np.full(a.shape, 1e300)), "NaN or Inf"),
    # the same for the statistics: as float64 they pass, the server's float32 means of them are Inf
    "centroids that overflow float32": (set_array(p.STATISTICS, p.CENTROID_VALUES,
                                                  lambda a: np.full(a.shape, 1e300)), "'centroids' holds NaN or Inf"),
    "h that overflows float32": (set_array(p.STATISTICS, p.H, lambda a: np.full(a.shape, 1e300)),
                                 "'h' holds NaN or Inf"),
    # h finite in float32, its squares are not: V's rounding scale must not become Inf
    "negative V with an h whose squares overflow float32": (
        lambda r: (set_array(p.STATISTICS, p.H, lambda a: np.full(a.shape, 1e30, np.float32))(r),
                   set_metric(p.V, -1e300)(r)), "V = -1e+300 is negative"),
    # past 2**53 a float64 holds no odd whole numbers; two such counts overflow the weights' sum
    "num-examples above 2**53": (set_metric(p.NUM_EXAMPLES, 2.0**60), "is above 2**53"),
    "a head of strings": (set_array(p.MODEL, "head.bias", lambda a: a.astype(str)), "not an array of numbers"),
    "a head of float128": (set_array(p.MODEL, "head.bias", lambda a: a.astype(np.longdouble)),
                           "not an array of numbers"),
    "a packed member that is no .npy file": (_replace_packed(p.ARRAYS, _zip(f"{p.MODEL}/head.bias", b"\0" * 40)),
                                             "not an array of numbers (bytes)"),
    "a packed member flagged encrypted": (
        _replace_packed(p.ARRAYS, _zip(f"{p.MODEL}/head.bias.npy", b"x", encrypted=True)), "not a packed array record"),
    "no train-loss": (_drop_metric(p.TRAIN_LOSS), "missing metric 'train-loss'"),
    "metrics as a config record": (_metrics_as_config, "record 'metrics' is not a MetricRecord"),
}


def _strategy(num_rounds, **kwargs):
    """FedPAC's strategy on RUN_CONFIG's initial model; also that model's extractor."""
    cfg = parse_run_config(RUN_CONFIG)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    server = server_part(METHODS["fedpac"], cfg, extractor, head)
    return PersonalizedStrategy(server=server, num_rounds=num_rounds, **kwargs), extractor


def _setup():
    strategy, extractor = _strategy(3)
    return strategy, p.to_record(extractor)


def _round_with_bad_training_reply(tamper, caplog):
    """One training round of 4 clients in which partition BAD's reply goes through ``tamper``."""
    def tampering(reply, pid):
        if pid == BAD and reply.metadata.message_type == MessageType.TRAIN:
            tamper(reply)
        return reply

    strategy, arrays = _setup()
    grid = InProcessGrid(RUN_CONFIG, 4, tamper=tampering)
    strategy.discover(grid, timeout=60)
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    with caplog.at_level(logging.WARNING):
        new_arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    return strategy, grid, new_arrays, metrics


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_reply_is_rejected_and_logged(case, caplog):
    tamper, reason = CASES[case]
    strategy, grid, new_arrays, metrics = _round_with_bad_training_reply(tamper, caplog)
    assert reason in caplog.text
    bad_node = next(n for n, pid in grid.partition_of_node.items() if pid == BAD)
    assert f"Rejected reply from node {bad_node}" in caplog.text
    survivors = {0, 2, 3}
    assert set(strategy.state.personal[HEAD]) == survivors  # the rest of the round went on
    assert metrics["num-replies"] == len(survivors) and metrics["num-rejected"] == 1
    extractor = p.from_record(new_arrays)
    assert all(np.isfinite(v).all() for v in extractor.values())
    assert np.isfinite(strategy.state.shared[CENTROIDS][p.CENTROID_VALUES]).all()


def test_a_site_whose_replies_never_get_through_is_named_once_and_again_when_it_returns(caplog):
    """Each refusal is logged on its own; a partition refused in SILENT_ROUNDS rounds in a row
    gets one warning of its own (its model stops learning, the mean accuracy leaves it out)."""
    from server_app.strategy import SILENT_ROUNDS

    refusing = {"on": True}

    def tampering(reply, pid):
        if refusing["on"] and pid == BAD and reply.metadata.message_type == MessageType.TRAIN:
            set_array(p.MODEL, "head.bias", nan)(reply)
        return reply

    strategy, extractor = _strategy(SILENT_ROUNDS + 1)
    arrays = p.to_record(extractor)
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=tampering)
    strategy.discover(grid, timeout=60)
    warned_after, logs = [], []
    for server_round in range(1, SILENT_ROUNDS + 2):
        refusing["on"] = server_round <= SILENT_ROUNDS
        caplog.clear()
        with caplog.at_level(logging.INFO):
            messages = list(strategy.configure_train(server_round, arrays, ConfigRecord(), grid))
            arrays, _ = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        assert "Rejected reply from node" in caplog.text if refusing["on"] else "Rejected" not in caplog.text
        logs.append(caplog.text)
        if f"Partition {BAD} has sent no valid training reply" in caplog.text:
            warned_after.append(server_round)
            assert f"in the {SILENT_ROUNDS} rounds that asked it since round 1" in caplog.text
    assert warned_after == [SILENT_ROUNDS]  # once, when the streak reaches it
    assert f"Partition {BAD} sent a valid training reply again in round {SILENT_ROUNDS + 1}" in caplog.text
    assert not any(f"Partition {pid} has sent" in text for text in logs for pid in (0, 2))
    assert set(strategy.state.personal[HEAD]) == {0, 1, 2}  # its head, once it got through


def _set_evaluation_metric(key, value):
    def tamper(reply):
        reply.content[p.METRICS][key] = value
    return tamper


def _evaluation_metrics_as_config(reply):
    metrics = dict(reply.content[p.METRICS])
    reply.content[p.METRICS] = ConfigRecord({**metrics, p.EVAL_SECONDS: "x"})


EVALUATION_CASES = {
    "accuracy 3": (_set_evaluation_metric("accuracy", 3.0), "outside [0, 1]"),
    "negative eval-seconds": (_set_evaluation_metric(p.EVAL_SECONDS, -1.0), "is negative"),
    "fractional num-examples": (_set_evaluation_metric(p.NUM_EXAMPLES, 10.5), "must be positive and a whole number"),
    "num-examples above 2**53": (_set_evaluation_metric(p.NUM_EXAMPLES, 1e300), "is above 2**53"),
    "NaN eval-seconds": (_set_evaluation_metric(p.EVAL_SECONDS, float("nan")), "not a finite number"),
    "metrics as a config record, with a string": (_evaluation_metrics_as_config, "not a MetricRecord"),
}


@pytest.mark.parametrize("case", sorted(EVALUATION_CASES))
def test_a_bad_evaluation_reply_is_rejected(case, caplog):
    tamper, reason = EVALUATION_CASES[case]
    strategy, arrays = _setup()

    def tampering(reply, pid):
        if pid == BAD and reply.content[p.METRICS].get("accuracy") is not None:
            tamper(reply)
        return reply

    grid = InProcessGrid(RUN_CONFIG, 3, tamper=tampering)
    strategy.discover(grid, timeout=60)
    strategy.configure_train(1, arrays, ConfigRecord(), grid)
    messages = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    with caplog.at_level(logging.WARNING):
        metrics = strategy.aggregate_evaluate(1, grid.send_and_receive(messages))
    assert reason in caplog.text and "Rejected reply from node" in caplog.text
    assert metrics["num-clients"] == 2


def test_a_training_reply_claiming_another_partition_is_rejected_and_moves_nothing(caplog):
    strategy, arrays = _setup()

    def tampering(reply, pid):
        if pid == BAD:
            reply.content[p.METRICS][p.PARTITION_ID] = 0
        return reply

    grid = InProcessGrid(RUN_CONFIG, 4, tamper=tampering)  # no pre-flight: the round binds the nodes
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    bound = dict(strategy.node_partition)
    assert sorted(bound.values()) == [0, 1, 2, 3]
    with caplog.at_level(logging.WARNING):
        _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert f"(partition {BAD}): it claims partition 0" in caplog.text
    assert set(strategy.state.personal[HEAD]) == {0, 2, 3} and metrics["num-replies"] == 3
    assert strategy.node_partition == bound


def test_a_second_node_claiming_a_connected_nodes_partition_is_refused_and_sent_nothing(caplog):
    """A second live node claims partition 0 after the pre-flight (a SuperNode started twice, or
    one that lies): it is refused while partition 0's node is connected, is sent nothing, and
    partition 0's node trains as before."""
    strategy, arrays = _setup()
    grid = InProcessGrid(RUN_CONFIG, 3)
    strategy.discover(grid, timeout=60)
    first = next(n for n, pid in grid.partition_of_node.items() if pid == 0)
    grid.contexts[999] = grid.contexts[first]
    grid.partition_of_node[999] = 0
    with caplog.at_level(logging.WARNING):
        messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    assert "Refused node 999: partition 0 is served by connected node" in caplog.text
    assert 999 not in {m.metadata.dst_node_id for m in messages} and len(messages) == 3
    assert strategy.node_partition[first] == 0 and 999 not in strategy.node_partition
    _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert metrics["num-replies"] == 3 and set(strategy.state.personal[HEAD]) == {0, 1, 2}


PREFLIGHT_PROBLEMS = {
    "missing partition-id": "missing metric 'partition-id'",
    "client error": "disk on fire",
    "a num-partitions the others do not share": "num-partitions 7, the federation's is 3",
    "a num-partitions past any federation": "is not an integer in [1, 1,000,000]",
}


@pytest.mark.parametrize("problem", sorted(PREFLIGHT_PROBLEMS))
def test_bad_preflight_answers_stop_the_run_with_a_message_not_a_crash(problem):
    def tampering(reply, pid):
        if reply.metadata.message_type == MessageType.QUERY and pid == BAD:
            if problem == "missing partition-id":
                reply.content[p.METRICS] = MetricRecord({"num-partitions": 4, "num-examples": 60, "test-examples": 30})
            elif problem == "a num-partitions the others do not share":
                reply.content[p.METRICS]["num-partitions"] = 7
            elif problem == "a num-partitions past any federation":
                reply.content[p.METRICS]["num-partitions"] = 10**13
            else:
                return Message(Error(code=0, reason="DataError: disk on fire"), reply_to=reply)
        return reply

    strategy, _ = _setup()
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=tampering, tamper_queries=True)
    expected = PREFLIGHT_PROBLEMS[problem]
    with pytest.raises(RuntimeError, match=f"not ready to train(.|\\n)*{re.escape(expected)}"):
        strategy.discover(grid, timeout=2)  # a client error is retried until the timeout


def _claiming_partition_0(reply, pid):
    if reply.metadata.message_type == MessageType.QUERY and pid == BAD:
        reply.content[p.METRICS][p.PARTITION_ID] = 0
    return reply


def test_a_preflight_claim_its_identity_denies_is_refused_and_the_others_start(caplog):
    """With node identities (a deployment), the node registered as supernode-1 that claims
    partition 0 is refused and sent nothing more; the run starts with the others."""
    strategy, _ = _strategy(2, sites=SiteRegistry())
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=_claiming_partition_0, tamper_queries=True)
    with caplog.at_level(logging.WARNING):
        bound = strategy.discover(grid, timeout=60)
    assert sorted(bound.values()) == [0, 2]
    assert "it claims partition 0, its identity (name 'supernode-1') serves partition 1" in caplog.text


def test_a_duplicate_preflight_claim_without_identities_stops_the_run():
    """Where claims are all there is (the simulation, partition-map = 'claims'), two nodes
    claiming one partition is a misconfiguration nobody can settle: the run does not start."""
    strategy, _ = _strategy(2)  # claims believed: the default
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=_claiming_partition_0, tamper_queries=True)
    with pytest.raises(RuntimeError, match="not ready to train(.|\n)*partition 0 is served by connected node"):
        strategy.discover(grid, timeout=60)


def test_a_v_below_zero_by_rounding_only_is_accepted_as_zero(caplog):
    # a sum of squares minus its mean's, rounded
    strategy, _, _, metrics = _round_with_bad_training_reply(set_metric(p.V, -1e-12), caplog)
    assert "Rejected" not in caplog.text and metrics["num-replies"] == 4
    assert set(strategy.state.personal[HEAD]) == {0, 1, 2, 3}
