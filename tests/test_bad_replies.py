"""Every kind of bad reply is rejected with a logged reason; the rest of the round proceeds
and nothing from the bad reply reaches the global state."""

import io
import logging

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord

from common import protocol as p
from common.config import parse_run_config
from common.files import npz_bytes
from federation import InProcessGrid, drop_section, nan, set_array, set_metric, set_section
from server_app.app import initial_model
from server_app.strategy import FedPAC
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
}


def _setup():
    cfg = parse_run_config(RUN_CONFIG)
    model = initial_model(cfg)
    extractor, head = split_state({k: v.numpy() for k, v in model.state_dict().items()})
    return FedPAC(initial_head=head, num_rounds=3), p.to_record(extractor)


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
    assert set(strategy.heads) == survivors  # the rest of the round went on
    assert metrics["num-replies"] == len(survivors) and metrics["num-rejected"] == 1
    extractor = p.from_record(new_arrays)
    assert all(np.isfinite(v).all() for v in extractor.values())
    assert np.isfinite(strategy.centroids).all()


def test_an_evaluation_reply_with_impossible_accuracy_is_rejected(caplog):
    strategy, arrays = _setup()

    def tampering(reply, pid):
        if pid == BAD and reply.content[p.METRICS].get("accuracy") is not None:
            reply.content[p.METRICS]["accuracy"] = 3.0
        return reply

    grid = InProcessGrid(RUN_CONFIG, 3, tamper=tampering)
    strategy.discover(grid, timeout=60)
    strategy.configure_train(1, arrays, ConfigRecord(), grid)
    messages = list(strategy.configure_evaluate(1, arrays, ConfigRecord(), grid))
    with caplog.at_level(logging.WARNING):
        metrics = strategy.aggregate_evaluate(1, grid.send_and_receive(messages))
    assert "outside [0, 1]" in caplog.text
    assert metrics["num-clients"] == 2


def test_two_unregistered_nodes_claiming_one_partition_in_a_round_are_both_rejected(caplog):
    strategy, arrays = _setup()

    def tampering(reply, pid):
        if pid == BAD and reply.metadata.message_type == MessageType.TRAIN:
            reply.content[p.METRICS][p.PARTITION_ID] = 0
        return reply

    grid = InProcessGrid(RUN_CONFIG, 4, tamper=tampering)  # no discovery: nodes are unknown
    messages = list(strategy.configure_train(1, arrays, ConfigRecord(), grid))
    with caplog.at_level(logging.WARNING):
        _, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert "claiming partition-id 0: claimed twice" in caplog.text
    assert set(strategy.heads) == {2, 3} and metrics["num-replies"] == 2


@pytest.mark.parametrize("problem", ["missing partition-id", "client error", "duplicate partition"])
def test_bad_preflight_answers_stop_the_run_with_a_message_not_a_crash(problem):
    def tampering(reply, pid):
        if reply.metadata.message_type == MessageType.QUERY and pid == BAD:
            if problem == "missing partition-id":
                reply.content[p.METRICS] = MetricRecord({"num-partitions": 4, "num-examples": 60, "test-examples": 30})
            elif problem == "duplicate partition":
                reply.content[p.METRICS][p.PARTITION_ID] = 0
            else:
                return Message(Error(code=0, reason="DataError: disk on fire"), reply_to=reply)
        return reply

    strategy, _ = _setup()
    grid = InProcessGrid(RUN_CONFIG, 3, tamper=tampering)
    expected = {"missing partition-id": "missing metric 'partition-id'", "client error": "disk on fire",
                "duplicate partition": "already taken"}[problem]
    with pytest.raises(RuntimeError, match=f"not ready to train(.|\\n)*{expected}"):
        strategy.discover(grid, timeout=60)


def test_a_v_below_zero_by_rounding_only_is_accepted_as_zero(caplog):
    # a sum of squares minus its mean's, rounded
    strategy, _, _, metrics = _round_with_bad_training_reply(set_metric(p.V, -1e-12), caplog)
    assert "Rejected" not in caplog.text and metrics["num-replies"] == 4
    assert set(strategy.heads) == {0, 1, 2, 3}
