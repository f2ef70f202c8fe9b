"""Every check the server makes on a client's reply, one table row each.

The replies are real: the strategy configures each message and the real ClientApp answers it
(``federation.InProcessGrid``), once per reply shape: one method of each distinct set of
statistics and extra metrics in ``common.methods.METHODS``. Each row then tampers with a copy of
one reply in one way and expects ``InvalidReply`` with a fragment of the reason. ``ACCEPTED``
holds what the checks must let through: unusual replies that are valid anyway. The last test
takes a bad FedCCFA reply through a whole round of the real strategy; test_bad_replies.py and
test_pfedvem.py do that for FedPAC's and pFedVEM's replies, no test did for FedCCFA's.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import io
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from flwr.app import Array, ArrayRecord, ConfigRecord, Error, Message, MessageType, MetricRecord

from common import protocol as p
from common.config import parse_run_config
from common.files import npz_bytes
from common.methods import METHODS, Method
from common.methods.fedccfa.server import ANCHORS
from common.methods.fedfomo.client import WEIGHTS as FEDFOMO_WEIGHTS
from common.methods.server import HEAD, ServerPart, server_part
from common.model import HEAD_PREFIX, split_state
from common.validation import MAX_SAMPLE_COUNT, V_ROUNDING, InvalidReply
from federation import InProcessGrid, drop_section, nan, set_array, set_metric, set_section
from server_app.app import initial_model
from server_app.replies import (
    MAX_METRICS,
    MAX_PARTITIONS,
    parse_evaluate_reply,
    parse_query_reply,
    parse_train_reply,
)
from server_app.strategy import PersonalizedStrategy
from method_traits import traits

# Small enough that a method's exchange takes a second or two on a CPU. The generalized accuracy
# (a pass over the whole test set) is left out: its rows add it to the evaluation themselves.
RUN_CONFIG = {"samples-per-client": 10, "test-samples-per-client": 10, "local-epochs": 1, "batch-size": 10,
              "balanced-epochs": 1, "vem-head-steps": 1, "vem-mc-samples": 1, "vem-batch-size": 10}
TRAIN_SAMPLES = RUN_CONFIG["samples-per-client"]

# The kinds of reply: a pre-flight answer, a training reply, a training reply that carries the
# fused evaluation of the previous round, an evaluate reply.
QUERY, TRAIN, FUSED, EVALUATE = "query", "train", "fused", "evaluate"


@functools.cache
def statistics_sent(method: Method) -> tuple[str, ...]:
    """The statistics arrays a method's training reply carries: its server part's
    ``statistics_shapes`` (on a 1 x 1 head: only the keys matter here)."""
    head = {p.HEAD_WEIGHT: np.zeros((1, 1), np.float32), p.HEAD_BIAS: np.zeros(1, np.float32)}
    return tuple(server_part(method, parse_run_config({}), {}, head).statistics_shapes())


def reply_shape(method: Method) -> tuple:
    """What a method's training reply carries besides the model: statistics and extra metrics."""
    return (statistics_sent(method), traits(method).statistics, traits(method).posteriors,
            traits(method).local_evaluation, traits(method).kept_at_site)


# The method whose exchange also has the pre-flight, fused evaluation and evaluate replies: those
# are the same for every method.
FULL = "fedavg" if "fedavg" in METHODS else next(iter(METHODS))
# One method of each reply shape: FULL for its own, else the first in METHODS' order.
SHAPES: dict[tuple, str] = {}
for _name in (FULL, *METHODS):
    SHAPES.setdefault(reply_shape(METHODS[_name]), _name)


@dataclass
class Exchange:
    """One method's real replies (each partition 0's) and what the server checks them against."""

    method: Method
    server: ServerPart
    num_partitions: int
    replies: dict[str, Message]


@functools.cache
def exchange(name: str) -> Exchange:
    """Round 1 of ``name`` with one client; for FULL also the pre-flight, round 2 (whose training
    replies bring round 1's evaluation) and round 2's evaluate message, with two clients so that
    a partition-id can be valid and still another client's."""
    full = name == FULL
    run_config = {**RUN_CONFIG, "strategy": name}
    cfg = parse_run_config(run_config)
    method = METHODS[name]
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    replies: dict[str, Message] = {}

    def keep(reply: Message, pid: int) -> Message:
        if pid == 0:
            kind = reply.metadata.message_type
            replies[FUSED if p.EVALUATION in reply.content else kind] = copy.deepcopy(reply)
        return reply

    rounds = 2 if full else 1
    # pFedVEM: every client in the sample S_t (the server's setting only: the clients' run config is unchanged)
    server = server_part(method, dataclasses.replace(cfg, vem_sampling_rate=1.0), extractor, head)
    strategy = PersonalizedStrategy(server=server, num_rounds=rounds, fused_evaluation=True, min_available_nodes=1)
    # Any: InProcessGrid stands in for Flower's Grid without deriving from it
    grid: Any = InProcessGrid(run_config, 2 if full else 1, tamper=keep, tamper_queries=True)
    strategy.discover(grid, timeout=60)
    arrays = p.to_record(extractor)
    for server_round in range(1, rounds + 1):
        messages = strategy.configure_train(server_round, arrays, ConfigRecord(), grid)
        new_arrays, _ = strategy.aggregate_train(server_round, grid.send_and_receive(messages))
        assert new_arrays is not None, "the untampered replies were refused"
        arrays = new_arrays
        if full:
            messages = strategy.configure_evaluate(server_round, arrays, ConfigRecord(), grid)
            strategy.aggregate_evaluate(server_round, grid.send_and_receive(messages))
    assert strategy.server.extractor_template is not None and strategy.num_partitions is not None
    return Exchange(method, strategy.server, strategy.num_partitions, replies)


# ---------------------------------------------------------------------------- tampering


Tamper = Callable[[Message], "Message | None"]  # changes the reply in place, or returns a replacement


def error(reason: str) -> Tamper:
    """The client's app raised: its SuperNode answers with an error instead."""
    return lambda reply: Message(Error(code=0, reason=reason), reply_to=reply)


def add_record(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        reply.content[key] = MetricRecord({"x": 1.0})
    return tamper


def drop_record(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        del reply.content[key]
    return tamper


def as_config_record(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        reply.content[key] = ConfigRecord(dict(reply.content.metric_records[key]))
    return tamper


def padded_to(count: int, key: str = p.METRICS) -> Tamper:
    """Record ``key`` filled up with dummy metrics to ``count`` entries."""
    def tamper(reply: Message) -> None:
        record = reply.content.metric_records[key]
        for i in range(count - len(record)):
            record[f"padding-{i}"] = 0.0
    return tamper


def drop_metric(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        del reply.content[p.METRICS][key]
    return tamper


def _evaluation_record(reply: Message):
    """Where a reply keeps its evaluation: an evaluate reply in ``metrics``, a fused training
    reply in ``evaluation``."""
    return reply.content[p.EVALUATION] if p.EVALUATION in reply.content else reply.content[p.METRICS]


def set_evaluation(key: str, value: object) -> Tamper:
    def tamper(reply: Message) -> None:
        _evaluation_record(reply)[key] = value
    return tamper


def drop_evaluation(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        del _evaluation_record(reply)[key]
    return tamper


def replace_arrays(buffer: np.ndarray) -> Tamper:
    """The ``arrays`` record as one packed Array holding ``buffer``."""
    def tamper(reply: Message) -> None:
        reply.content[p.ARRAYS] = ArrayRecord(array_dict={p.PACKED: Array(buffer)})
    return tamper


def _bytes(data: bytes) -> np.ndarray:
    return np.frombuffer(data, dtype=np.uint8)


def _compressed(array: np.ndarray) -> np.ndarray:
    stream = io.BytesIO()
    np.savez_compressed(stream, array)
    return _bytes(stream.getvalue())


def change_model(change: Callable[[p.NDArrays], object]) -> Tamper:
    """``change`` applied to the reply's ``model`` section (a dict of its arrays)."""
    def tamper(reply: Message) -> None:
        model = p.sections_of(reply.content).get(p.MODEL, {})
        change(model)
        set_section(reply, p.MODEL, model)
    return tamper


def first_extractor_array(change: Callable[[np.ndarray], np.ndarray]) -> Tamper:
    def apply(model: p.NDArrays) -> None:
        key = next(k for k in model if not k.startswith(HEAD_PREFIX))
        model[key] = change(model[key].copy())
    return change_model(apply)


def add_statistic(reply: Message) -> None:
    arrays = p.sections_of(reply.content).get(p.STATISTICS, {})
    arrays["extra"] = np.zeros(3, dtype=np.float32)
    set_section(reply, p.STATISTICS, arrays)


def drop_statistic(key: str) -> Tamper:
    def tamper(reply: Message) -> None:
        arrays = p.sections_of(reply.content)[p.STATISTICS]
        del arrays[key]
        set_section(reply, p.STATISTICS, arrays)
    return tamper


def both(*tampers: Tamper) -> Tamper:
    def tamper(reply: Message) -> None:
        for one in tampers:
            one(reply)
    return tamper


def huge(a: np.ndarray) -> np.ndarray:
    """Finite as float64, Inf once cast to the model's float32."""
    return np.full(a.shape, 1e300)


def inf(a: np.ndarray) -> np.ndarray:
    a = a.astype(np.float64)
    a.flat[-1] = np.inf
    return a


def fewer_rows(a: np.ndarray) -> np.ndarray:
    return a[:-1]


def sends(key: str) -> Callable[[Method], bool]:
    """Whether a method's training reply carries statistics array ``key``."""
    return lambda method: key in statistics_sent(method)


def no_statistics(method: Method) -> bool:
    return not statistics_sent(method)


def shares(part: str) -> Callable[[Method], bool]:
    """Whether a method's replies carry ``part`` of the model (by the paper: not what it keeps at the site)."""
    return lambda method: part not in traits(method).kept_at_site


def keeps_at_site(part: str) -> Callable[[Method], bool]:
    return lambda method: part in traits(method).kept_at_site


def every(_: Method) -> bool:
    return True


# ---------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Row:
    """A reply of each of ``kinds`` that went through ``tamper`` is refused, naming ``fragment``
    (for the training replies of every method ``applies`` holds for); in ACCEPTED, accepted."""

    name: str
    kinds: tuple[str, ...]
    tamper: Tamper
    fragment: str
    applies: Callable[[Method], bool] = every
    max_samples: int = 0  # the server's max-samples-per-client


ENVELOPE = (QUERY, TRAIN, EVALUATE)  # the checks every kind of reply goes through
EVALUATIONS = (EVALUATE, FUSED)  # the replies that carry an evaluation
STATISTIC_KEYS = (p.CENTROID_VALUES, p.CLASS_COUNTS, p.H, p.BALANCED_WEIGHT, p.BALANCED_BIAS, FEDFOMO_WEIGHTS)
# The statistics the server casts to the model's float32, and the name its message gives them.
CAST_STATISTICS = {p.CENTROID_VALUES: "statistics 'centroids'", p.H: "statistics 'h'",
                   p.BALANCED_WEIGHT: "balanced head", p.BALANCED_BIAS: "balanced head"}

ROWS: list[Row] = [
    # --- the records of any reply
    Row("client error", (TRAIN, EVALUATE), error("disk on fire"), "client error: disk on fire"),
    Row("client error", (QUERY,), error("disk on fire"), "disk on fire"),
    Row("an extra record", ENVELOPE, add_record("extra"), "unexpected record(s) ['extra']"),
    Row("an arrays record", (QUERY, EVALUATE), add_record(p.ARRAYS), "unexpected record(s) ['arrays']"),
    Row("an evaluation record", (QUERY, EVALUATE), add_record(p.EVALUATION), "unexpected record(s) ['evaluation']"),
    Row("metrics as a ConfigRecord", ENVELOPE, as_config_record(p.METRICS), "record 'metrics' is not a MetricRecord"),
    Row("too many metrics", ENVELOPE, padded_to(MAX_METRICS + 1), f"{MAX_METRICS + 1} metrics in 'metrics'"),
    Row("a metric list", ENVELOPE, set_metric("padding", [0.0, 1.0]), "metrics ['padding'] in 'metrics' are lists"),
    Row("no metrics", ENVELOPE, drop_record(p.METRICS), "missing record 'metrics'"),
    # --- the arrays of a training reply
    Row("no arrays", (TRAIN,), drop_record(p.ARRAYS), "missing record 'arrays'"),
    Row("arrays as a MetricRecord", (TRAIN,), add_record(p.ARRAYS), "record 'arrays' is not an ArrayRecord"),
    Row("arrays not an archive", (TRAIN,), replace_arrays(np.arange(100, dtype=np.uint8)), "not a packed"),
    Row("arrays as floats", (TRAIN,), replace_arrays(np.zeros(10)), "holds bytes"),
    Row("arrays compressed (a zip bomb)", (TRAIN,), replace_arrays(_compressed(np.zeros(100))),
        "must not be compressed"),
    Row("an array in no section", (TRAIN,), replace_arrays(_bytes(npz_bytes({"x": np.zeros(3)}))),
        "not named <section>/<array>"),
    Row("a model of strings", (TRAIN,), first_extractor_array(lambda a: a.astype(str)), "not an array of numbers",
        applies=shares("extractor")),
    Row("a model of float128", (TRAIN,), first_extractor_array(lambda a: a.astype(np.longdouble)),
        "not an array of numbers", applies=shares("extractor")),
    Row("an extra section", (TRAIN,), lambda r: set_section(r, "extra", {"x": np.zeros(3)}),
        "unexpected section(s) ['extra']"),
    Row("statistics nobody asked for", (TRAIN,), add_statistic, "unexpected section(s) ['statistics']",
        applies=no_statistics),
    Row("no model", (TRAIN,), drop_section(p.MODEL), "missing section 'model'", applies=shares("extractor")),
    Row("an extra model array", (TRAIN,), change_model(lambda m: m.update(extra=np.zeros(3, np.float32))),
        "unexpected model array(s) ['extra']", applies=shares("extractor")),
    # a part its method keeps at the site, sent all the same: a site that leaks what it should not
    Row("a model part kept at the site", (TRAIN,),
        change_model(lambda m: m.update({p.HEAD_BIAS: np.zeros(10, np.float32)})), "keeps at the site",
        applies=keeps_at_site("head")),
    Row("a missing extractor array", (TRAIN,),
        change_model(lambda m: m.pop(next(k for k in m if not k.startswith(HEAD_PREFIX)))), "extractor keys differ",
        applies=shares("extractor")),
    Row("a missing head array", (TRAIN,), change_model(lambda m: m.pop(p.HEAD_BIAS)), "head keys differ",
        applies=shares("head")),
    Row("an extractor of the wrong shape", (TRAIN,), first_extractor_array(fewer_rows), "has shape",
        applies=shares("extractor")),
    Row("a head of the wrong shape", (TRAIN,), set_array(p.MODEL, p.HEAD_WEIGHT, fewer_rows),
        "head 'head.weight' has shape", applies=shares("head")),
    Row("a transposed head", (TRAIN,), set_array(p.MODEL, p.HEAD_WEIGHT, lambda a: a.T.copy()),
        "head 'head.weight' has shape", applies=shares("head")),
    Row("NaN in the extractor", (TRAIN,), first_extractor_array(nan), "holds NaN or Inf", applies=shares("extractor")),
    Row("Inf in the head", (TRAIN,), set_array(p.MODEL, p.HEAD_BIAS, inf), "head 'head.bias' holds NaN or Inf",
        applies=shares("head")),
    Row("a head past float32", (TRAIN,), set_array(p.MODEL, p.HEAD_WEIGHT, huge),
        "head 'head.weight' holds NaN or Inf (as float32)", applies=shares("head")),
    # --- the statistics, for each array a method sends
    Row("no statistics", (TRAIN,), drop_section(p.STATISTICS), "missing section 'statistics'",
        applies=lambda m: not no_statistics(m)),
    Row("an extra statistic", (TRAIN,), add_statistic, "statistics hold unexpected arrays ['extra']",
        applies=lambda m: not no_statistics(m)),
    # (a method that sends one statistic alone is the row "no statistics")
    *(Row(f"no {key}", (TRAIN,), drop_statistic(key), f"statistics lack '{key}'",
          applies=lambda m, key=key: key in statistics_sent(m) and len(statistics_sent(m)) > 1)
      for key in STATISTIC_KEYS),
    *(Row(f"{key} of the wrong shape", (TRAIN,), set_array(p.STATISTICS, key, fewer_rows),
          f"statistics '{key}' has shape", applies=sends(key)) for key in STATISTIC_KEYS),
    *(Row(f"NaN in {key}", (TRAIN,), set_array(p.STATISTICS, key, lambda a: nan(a.astype(np.float64))),
          f"statistics '{key}' hold NaN or Inf", applies=sends(key)) for key in STATISTIC_KEYS),
    *(Row(f"{key} past float32", (TRAIN,), set_array(p.STATISTICS, key, huge),
          f"{what} holds NaN or Inf (as float32)", applies=sends(key)) for key, what in CAST_STATISTICS.items()),
    Row("negative class counts", (TRAIN,), set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a - a.max()),
        "class counts must be non-negative integers", applies=sends(p.CLASS_COUNTS)),
    Row("fractional class counts", (TRAIN,), set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a + 0.5),
        "class counts must be non-negative integers", applies=sends(p.CLASS_COUNTS)),
    Row("class counts that do not add up to num-examples", (TRAIN,), set_metric(p.NUM_EXAMPLES, TRAIN_SAMPLES - 1),
        "equal the class counts' sum", applies=sends(p.CLASS_COUNTS)),
    # --- the metrics of a training reply
    Row("no partition-id", (TRAIN, QUERY), drop_metric(p.PARTITION_ID), "missing metric 'partition-id'"),
    Row("a NaN partition-id", (TRAIN, QUERY), set_metric(p.PARTITION_ID, float("nan")),
        "'partition-id' = nan is not a finite number"),
    Row("a fractional partition-id", (TRAIN, QUERY), set_metric(p.PARTITION_ID, 0.5),
        "partition-id 0.5 is not a valid"),
    Row("a negative partition-id", (TRAIN, QUERY), set_metric(p.PARTITION_ID, -1),
        "partition-id -1.0 is not a valid"),
    Row("a partition-id past the federation", (TRAIN,), set_metric(p.PARTITION_ID, MAX_PARTITIONS),
        f"partition-id {float(MAX_PARTITIONS)} is not a valid"),
    Row("no num-examples", (TRAIN, QUERY), drop_metric(p.NUM_EXAMPLES), "missing metric 'num-examples'"),
    Row("num-examples 0", (TRAIN, QUERY), set_metric(p.NUM_EXAMPLES, 0), "num-examples 0.0 must be positive"),
    Row("negative num-examples", (TRAIN, QUERY), set_metric(p.NUM_EXAMPLES, -TRAIN_SAMPLES), "must be positive"),
    Row("fractional num-examples", (TRAIN, QUERY), set_metric(p.NUM_EXAMPLES, TRAIN_SAMPLES - 0.5),
        "must be positive and a whole number"),
    Row("num-examples past 2**53", (TRAIN, QUERY), set_metric(p.NUM_EXAMPLES, 2.0**60), "is above 2**53"),
    Row("num-examples above max-samples-per-client", (TRAIN, QUERY), lambda r: None,
        f"num-examples {TRAIN_SAMPLES} is above max-samples-per-client = {TRAIN_SAMPLES - 1}",
        max_samples=TRAIN_SAMPLES - 1),
    # the bound is on the training samples, not the test samples the pre-flight also reports
    Row("num-examples above max-samples-per-client, few test examples", (QUERY,), set_metric("test-examples", 1),
        f"num-examples {TRAIN_SAMPLES} is above max-samples-per-client = {TRAIN_SAMPLES - 1}",
        max_samples=TRAIN_SAMPLES - 1),
    Row("no train-loss", (TRAIN,), drop_metric(p.TRAIN_LOSS), "missing metric 'train-loss'"),
    Row("an infinite train-loss", (TRAIN,), set_metric(p.TRAIN_LOSS, float("inf")),
        "'train-loss' = inf is not a finite"),
    Row("no v", (TRAIN,), drop_metric(p.V), "missing metric 'v'", applies=lambda m: traits(m).statistics),
    Row("a NaN v", (TRAIN,), set_metric(p.V, float("nan")), "'v' = nan is not a finite",
        applies=lambda m: traits(m).statistics),
    Row("a negative v", (TRAIN,), set_metric(p.V, -1.0), "V = -1.0 is negative",
        applies=lambda m: traits(m).statistics),
    # the noise the server takes off h's Gram diagonal: a lie here is capped (test_collaboration),
    # a malformed value rejected
    Row("an infinite h-noise", (TRAIN,), set_metric(p.H_NOISE, float("inf")), "'h-noise' = inf is not a finite",
        applies=lambda m: traits(m).statistics),
    Row("a negative h-noise", (TRAIN,), set_metric(p.H_NOISE, -0.5), "'h-noise' = -0.5 is below 0",
        applies=lambda m: traits(m).statistics),
    Row("a NaN v-inflation", (TRAIN,), set_metric(p.V_INFLATION, float("nan")), "'v-inflation' = nan is not a finite",
        applies=lambda m: traits(m).statistics),
    Row("a v-inflation below 1", (TRAIN,), set_metric(p.V_INFLATION, 0.5), "'v-inflation' = 0.5 is below 1",
        applies=lambda m: traits(m).statistics),
    # h finite in float32, its squares not: V's rounding scale must not become Inf
    Row("a negative v beside an h whose squares overflow float32", (TRAIN,),
        both(set_array(p.STATISTICS, p.H, lambda a: np.full(a.shape, 1e30, np.float32)), set_metric(p.V, -1e300)),
        "V = -1e+300 is negative", applies=lambda m: traits(m).statistics),
    Row("no rho", (TRAIN,), drop_metric(p.RHO), "missing metric 'rho'", applies=lambda m: traits(m).posteriors),
    Row("a NaN rho", (TRAIN,), set_metric(p.RHO, float("nan")), "'rho' = nan is not a finite",
        applies=lambda m: traits(m).posteriors),
    Row("rho 0", (TRAIN,), set_metric(p.RHO, 0.0), "rho = 0.0 must be a positive number",
        applies=lambda m: traits(m).posteriors),
    Row("a negative rho", (TRAIN,), set_metric(p.RHO, -0.5), "rho = -0.5 must be a positive number",
        applies=lambda m: traits(m).posteriors),
    # tau = 1 / rho^2 must be finite and positive: rho^2 may underflow to 0, or be so small that
    # 1 / rho^2 overflows, or so large that 1 / rho^2 is 0
    Row("a rho whose square is 0", (TRAIN,), set_metric(p.RHO, 1e-200), "finite, positive confidence",
        applies=lambda m: traits(m).posteriors),
    Row("a rho whose confidence overflows", (TRAIN,), set_metric(p.RHO, 1e-160), "finite, positive confidence",
        applies=lambda m: traits(m).posteriors),
    Row("a rho whose confidence is 0", (TRAIN,), set_metric(p.RHO, 1e200), "finite, positive confidence",
        applies=lambda m: traits(m).posteriors),
    Row("no local accuracy", (TRAIN,), drop_metric(p.LOCAL_ACCURACY), "missing metric 'local-accuracy'",
        applies=lambda m: traits(m).local_evaluation),
    Row("a local accuracy above 1", (TRAIN,), set_metric(p.LOCAL_ACCURACY, 1.5), "local accuracy 1.5 outside [0, 1]",
        applies=lambda m: traits(m).local_evaluation),
    Row("a negative local accuracy", (TRAIN,), set_metric(p.LOCAL_ACCURACY, -0.1), "local accuracy -0.1 outside",
        applies=lambda m: traits(m).local_evaluation),
    # --- the pre-flight answer
    Row("no num-partitions", (QUERY,), drop_metric("num-partitions"), "missing metric 'num-partitions'"),
    Row("num-partitions 0", (QUERY,), set_metric("num-partitions", 0), "num-partitions 0.0 is not an integer in"),
    Row("fractional num-partitions", (QUERY,), set_metric("num-partitions", 2.5), "num-partitions 2.5 is not an"),
    Row("num-partitions past any federation", (QUERY,), set_metric("num-partitions", MAX_PARTITIONS + 1),
        f"is not an integer in [1, {MAX_PARTITIONS:,}]"),
    Row("a partition-id past its own num-partitions", (QUERY,), set_metric(p.PARTITION_ID, 2),
        "partition-id 2.0 is not a valid"),
    Row("no test-examples", (QUERY,), drop_metric("test-examples"), "missing metric 'test-examples'"),
    Row("test-examples 0", (QUERY,), set_metric("test-examples", 0), "test-examples 0.0 must be positive"),
    Row("test-examples past 2**53", (QUERY,), set_metric("test-examples", 2.0**60),
        "test-examples 1.15292e+18 is above"),
    # --- an evaluation: an evaluate reply's metrics, or a fused training reply's evaluation record
    Row("evaluation as a ConfigRecord", (FUSED,), as_config_record(p.EVALUATION),
        "record 'evaluation' is not a MetricRecord"),
    Row("too many evaluation metrics", (FUSED,), padded_to(MAX_METRICS + 1, p.EVALUATION),
        f"{MAX_METRICS + 1} metrics in 'evaluation'"),
    Row("an evaluation metric list", (FUSED,), set_evaluation("padding", [0.0]),
        "in 'evaluation' are lists"),
    Row("the evaluation of another partition", (FUSED,), set_evaluation(p.PARTITION_ID, 1),
        "its evaluation is of partition 1, its update of partition 0"),
    Row("no accuracy", EVALUATIONS, drop_evaluation("accuracy"), "missing metric 'accuracy'"),
    Row("accuracy above 1", EVALUATIONS, set_evaluation("accuracy", 1.01), "accuracy 1.01 outside [0, 1]"),
    Row("a negative accuracy", EVALUATIONS, set_evaluation("accuracy", -0.1), "accuracy -0.1 outside [0, 1]"),
    Row("a NaN accuracy", EVALUATIONS, set_evaluation("accuracy", float("nan")), "'accuracy' = nan is not a finite"),
    Row("no evaluated examples", EVALUATIONS, drop_evaluation(p.NUM_EXAMPLES), "missing metric 'num-examples'"),
    Row("0 evaluated examples", EVALUATIONS, set_evaluation(p.NUM_EXAMPLES, 0), "num-examples 0.0 must be positive"),
    Row("fractional evaluated examples", EVALUATIONS, set_evaluation(p.NUM_EXAMPLES, 2.5), "a whole number"),
    Row("evaluated examples past 2**53", EVALUATIONS, set_evaluation(p.NUM_EXAMPLES, 1e300), "is above 2**53"),
    Row("a generalized accuracy above 1", EVALUATIONS, set_evaluation(p.GENERALIZED_ACCURACY, 1.5),
        "generalized accuracy 1.5 outside [0, 1]"),
    Row("a negative generalized accuracy", EVALUATIONS, set_evaluation(p.GENERALIZED_ACCURACY, -0.01),
        "generalized accuracy -0.01 outside [0, 1]"),
    Row("a NaN generalized accuracy", EVALUATIONS, set_evaluation(p.GENERALIZED_ACCURACY, float("nan")),
        "'generalized-accuracy' = nan is not a finite"),
    Row("an evaluation without partition-id", EVALUATIONS, drop_evaluation(p.PARTITION_ID),
        "missing metric 'partition-id'"),
    Row("an evaluation of a partition past the federation", EVALUATIONS, set_evaluation(p.PARTITION_ID, 2),
        "partition-id 2.0 is not a valid"),
    Row("an evaluation of a negative partition", EVALUATIONS, set_evaluation(p.PARTITION_ID, -1),
        "partition-id -1.0 is not a valid"),
    Row("no loss", EVALUATIONS, drop_evaluation("loss"), "missing metric 'loss'"),
    Row("an infinite loss", EVALUATIONS, set_evaluation("loss", float("inf")), "'loss' = inf is not a finite"),
    Row("negative eval-seconds", EVALUATIONS, set_evaluation(p.EVAL_SECONDS, -1.0), "eval-seconds = -1.0 is negative"),
    Row("NaN eval-seconds", EVALUATIONS, set_evaluation(p.EVAL_SECONDS, float("nan")),
        "'eval-seconds' = nan is not a finite"),
]

# Unusual replies that are valid: a check that refuses them is as wrong as a missing one.
ACCEPTED: list[Row] = [
    Row("the reply as the client sent it", (QUERY, TRAIN, FUSED, EVALUATE), lambda r: None, ""),
    Row("exactly MAX_METRICS metrics", ENVELOPE, padded_to(MAX_METRICS), ""),
    Row("exactly MAX_METRICS evaluation metrics", (FUSED,), padded_to(MAX_METRICS, p.EVALUATION), ""),
    Row("num-examples at max-samples-per-client", (TRAIN, QUERY), lambda r: None, "", max_samples=TRAIN_SAMPLES),
    Row("a float64 model, cast to float32", (TRAIN,), set_array(p.MODEL, p.HEAD_WEIGHT, lambda a: a.astype(np.float64)),
        "", applies=shares("head")),
    Row("class counts as floats", (TRAIN,), set_array(p.STATISTICS, p.CLASS_COUNTS, lambda a: a.astype(np.float64)),
        "", applies=sends(p.CLASS_COUNTS)),
    Row("a v below 0 by rounding only", (TRAIN,), set_metric(p.V, -1e-12), "", applies=lambda m: traits(m).statistics),
    # an h of zeros leaves the allowance at its floor: exactly -V_ROUNDING
    Row("a v at the rounding allowance", (TRAIN,),
        both(set_array(p.STATISTICS, p.H, np.zeros_like), set_metric(p.V, -V_ROUNDING)), "",
        applies=lambda m: traits(m).statistics),
    Row("v 0: all of a class's features equal", (TRAIN,), set_metric(p.V, 0.0), "",
        applies=lambda m: traits(m).statistics),
    Row("local accuracy 0", (TRAIN,), set_metric(p.LOCAL_ACCURACY, 0.0), "",
        applies=lambda m: traits(m).local_evaluation),
    Row("local accuracy 1", (TRAIN,), set_metric(p.LOCAL_ACCURACY, 1.0), "",
        applies=lambda m: traits(m).local_evaluation),
    Row("the last partition", (QUERY,), set_metric(p.PARTITION_ID, 1), ""),
    Row("a federation of one", (QUERY,), set_metric("num-partitions", 1), ""),
    Row("the largest federation", (QUERY,), set_metric("num-partitions", MAX_PARTITIONS), ""),
    Row("num-examples 2**53", (QUERY, TRAIN), set_metric(p.NUM_EXAMPLES, float(MAX_SAMPLE_COUNT)), "",
        applies=lambda m: not sends(p.CLASS_COUNTS)(m)),
    Row("2**53 evaluated examples", EVALUATIONS, set_evaluation(p.NUM_EXAMPLES, float(MAX_SAMPLE_COUNT)), ""),
    Row("a whole float for a count", (TRAIN, QUERY), set_metric(p.NUM_EXAMPLES, float(TRAIN_SAMPLES)), ""),
    Row("accuracies 0", EVALUATIONS, both(set_evaluation("accuracy", 0.0), set_evaluation(p.GENERALIZED_ACCURACY, 0.0)),
        ""),
    Row("accuracies 1", EVALUATIONS, both(set_evaluation("accuracy", 1.0), set_evaluation(p.GENERALIZED_ACCURACY, 1.0)),
        ""),
    # eval-seconds is optional: an older client sends none
    Row("no eval-seconds", EVALUATIONS, drop_evaluation(p.EVAL_SECONDS), ""),
    Row("eval-seconds 0", EVALUATIONS, set_evaluation(p.EVAL_SECONDS, 0.0), ""),
]


def _parse(kind: str, ex: Exchange, reply: Message, row: Row):
    if kind in (TRAIN, FUSED):
        return parse_train_reply(reply, ex.server, ex.num_partitions, row.max_samples)
    if kind == QUERY:
        return parse_query_reply(reply, row.max_samples)
    return parse_evaluate_reply(reply, ex.num_partitions)


def _tampered(kind: str, method: str, row: Row) -> tuple[Exchange, Message]:
    ex = exchange(method)
    reply = copy.deepcopy(ex.replies[kind])
    replaced = row.tamper(reply)
    return ex, reply if replaced is None else replaced


def _cases(rows: list[Row]) -> list:
    """(row, kind, method) for each kind of reply a row names: a training reply of each reply
    shape the row applies to, the other kinds from FULL."""
    cases = []
    for row in rows:
        for kind in row.kinds:
            methods = sorted(SHAPES.values()) if kind == TRAIN else [FULL]
            cases += [pytest.param(row, kind, m, id=f"{kind}-{m}-{row.name}")
                      for m in methods if row.applies(METHODS[m])]
    return cases


@pytest.mark.parametrize("row,kind,method", _cases(ROWS))
def test_a_bad_reply_is_refused_with_its_reason(row, kind, method):
    ex, reply = _tampered(kind, method, row)
    with pytest.raises(InvalidReply) as err:
        _parse(kind, ex, reply, row)
    assert row.fragment in str(err.value), str(err.value)


@pytest.mark.parametrize("row,kind,method", _cases(ACCEPTED))
def test_an_unusual_valid_reply_is_accepted(row, kind, method):
    ex, reply = _tampered(kind, method, row)
    parsed = _parse(kind, ex, reply, row)
    update = getattr(parsed, "update", parsed)  # a training reply's checked update; else the reply itself
    assert update.num_examples > 0
    v = getattr(update, "parsed", {}).get("v")
    assert v is None or v >= 0  # rounding below 0 is taken as 0


def test_every_reply_shape_and_kind_has_rows():
    """A method with a new reply shape gets the generic rows (and a failing exchange if its
    replies are refused); its new statistics or metrics need rows of their own."""
    covered = {(kind, m) for _, kind, m in (case.values for case in _cases(ROWS))}
    assert {(TRAIN, m) for m in SHAPES.values()} <= covered
    assert {(kind, FULL) for kind in (QUERY, FUSED, EVALUATE)} <= covered
    sent = {key for m in METHODS.values() for key in statistics_sent(m)}
    assert sent <= set(STATISTIC_KEYS), f"statistics without rows: {sorted(sent - set(STATISTIC_KEYS))}"


# ---------------------------------------------------------------------------- through a round

BAD = 1


def test_a_bad_fedccfa_reply_is_logged_and_refused_and_the_round_goes_on(caplog):
    """FedCCFA's balanced head is its clustering input: a NaN in it must not reach the clusters,
    the anchors or anybody's head, and the round aggregates the other clients' replies."""
    name = "fedccfa"
    run_config = {**RUN_CONFIG, "strategy": name}
    cfg = parse_run_config(run_config)
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    tamper = set_array(p.STATISTICS, p.BALANCED_WEIGHT, nan)

    def tampering(reply: Message, pid: int) -> Message:
        if pid == BAD and reply.metadata.message_type == MessageType.TRAIN:
            tamper(reply)
        return reply

    strategy = PersonalizedStrategy(server=server_part(METHODS[name], cfg, extractor, head), num_rounds=2)
    grid: Any = InProcessGrid(run_config, 3, tamper=tampering)
    strategy.discover(grid, timeout=60)
    messages = strategy.configure_train(1, p.to_record(extractor), ConfigRecord(), grid)
    with caplog.at_level(logging.WARNING):
        new_arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    bad_node = next(n for n, pid in grid.partition_of_node.items() if pid == BAD)
    assert f"Rejected reply from node {bad_node} (partition {BAD}): statistics 'balanced-head.weight' hold NaN" \
        in caplog.text
    assert metrics is not None and metrics["num-replies"] == 2 and metrics["num-rejected"] == 1
    assert sorted(strategy.state.personal[HEAD]) == [0, 2]
    assert strategy._record is not None and strategy._record.method["cluster_partitions"] == [0, 2]
    assert new_arrays is not None and all(np.isfinite(v).all() for v in p.from_record(new_arrays).values())
    assert all(np.isfinite(v).all() for h in strategy.state.personal[HEAD].values() for v in h.values())
    assert all(np.isfinite(part[p.CENTROID_VALUES]).all() for part in strategy.state.personal[ANCHORS].values())
