"""Checking and decoding client replies: nothing malformed reaches the global state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from common import protocol as p
from common.methods import FEDPAC, Method


class InvalidReply(ValueError):
    """A reply that must be rejected; the message names the reason."""


def destinations(messages: Iterable[Message]) -> dict[str, int]:
    """Message id -> destination node of pushed messages (the grid gives ids as it pushes)."""
    return {m.metadata.message_id: m.metadata.dst_node_id for m in messages if m.metadata.message_id}


def reply_source(msg: Message, sent: Mapping[str, int]) -> int:
    """The node a reply speaks for. When a node went offline the SuperLink answers in its
    place (an error whose sender is the SuperLink itself): that is the node's failure, found
    through the message it answers (``sent``: :func:`destinations` of the pushed messages)."""
    if msg.metadata.src_node_id == SUPERLINK_NODE_ID:
        return sent.get(msg.metadata.reply_to_message_id, SUPERLINK_NODE_ID)
    return msg.metadata.src_node_id


def node_unavailable(msg: Message) -> bool:
    """The SuperLink's answer for a node that stopped reporting its heartbeat: the node is not
    there now (killed, restarting), which says nothing about its client."""
    return msg.has_error() and msg.error.code == ErrorCode.NODE_UNAVAILABLE


@dataclass(frozen=True)
class ClientUpdate:  # pylint: disable=too-many-instance-attributes
    """One client's decoded training reply."""

    partition_id: int
    node_id: int
    extractor: p.NDArrays
    head: p.NDArrays
    num_examples: int
    metrics: dict[str, float]
    # Only for methods whose server step uses them (``None`` otherwise):
    centroids: np.ndarray | None = None  # (K, d), with feature alignment
    class_counts: np.ndarray | None = None  # (K,), with any statistics
    h: np.ndarray | None = None  # (K, d), with classifier collaboration
    v: float | None = None  # with classifier collaboration
    balanced_head: p.NDArrays | None = None  # with clustered heads: the clustering input
    # With posteriors (pFedVEM): the scales s under the head's keys, and rho_j (eq. 7); the
    # posterior mean is ``head``
    scale: p.NDArrays | None = None
    rho: float | None = None
    # Fused evaluation: the evaluation of the model this round's train message carried.
    evaluation: ClientEvaluation | None = None


@dataclass(frozen=True)
class ClientEvaluation:
    partition_id: int
    node_id: int
    num_examples: int
    accuracy: float
    loss: float
    seconds: float  # client-side compute of the evaluation
    generalized_accuracy: float | None = None  # the whole test set in the client's concept


MAX_METRICS = 32
# The server keeps a head (and a posterior) for every partition, and pFedVEM draws a number per
# partition every round: a federation this size is far beyond what that state is made for.
MAX_PARTITIONS = 1_000_000
# The largest count of samples a float64 metric carries exactly.
MAX_SAMPLE_COUNT = 2**53
V_ROUNDING = 1e-6  # relative: a V this far below 0 is rounding, not a malformed reply
TRAIN_RECORDS = frozenset({p.ARRAYS, p.METRICS, p.EVALUATION})
EVALUATE_RECORDS = frozenset({p.METRICS})


def expected_statistics(method: Method, num_classes: int, dim: int) -> dict[str, tuple[int, ...]]:
    """The arrays a method's training reply carries in its ``statistics`` record, with shapes."""
    expected: dict[str, tuple[int, ...]] = {}
    if method.needs_centroids:
        expected[p.CENTROID_VALUES] = (num_classes, dim)
    if method.sends_class_counts:
        expected[p.CLASS_COUNTS] = (num_classes,)
    if method.needs_statistics:
        expected[p.H] = (num_classes, dim)
    if method.sends_balanced_head:
        expected[p.BALANCED_WEIGHT] = (num_classes, dim)
        expected[p.BALANCED_BIAS] = (num_classes,)
    if method.keeps_posteriors:
        expected[p.SCALE_WEIGHT] = (num_classes, dim)
        expected[p.SCALE_BIAS] = (num_classes,)
    return expected


def _check_shape_of_reply(msg: Message, allowed: frozenset[str]) -> None:
    """Only the records the protocol defines, and scalar metrics: this bounds a reply's size,
    since every array is also checked against its expected shape."""
    unexpected = sorted(set(msg.content) - allowed)
    if unexpected:
        raise InvalidReply(f"unexpected record(s) {unexpected}")
    for key in (p.METRICS, p.EVALUATION):
        metrics = msg.content.get(key)
        if metrics is None:
            continue
        if key not in msg.content.metric_records:
            raise InvalidReply(f"record '{key}' is not a MetricRecord")
        if len(metrics) > MAX_METRICS:
            raise InvalidReply(f"{len(metrics)} metrics in '{key}' (at most {MAX_METRICS})")
        lists = sorted(k for k, v in metrics.items() if isinstance(v, list))
        if lists:
            raise InvalidReply(f"metrics {lists} in '{key}' are lists, expected scalars")


def _get(msg: Message, key: str):
    if key not in msg.content:
        raise InvalidReply(f"missing record '{key}'")
    return msg.content[key]


def _sections(msg: Message, allowed: frozenset[str]) -> p.Sections:
    """The sections of the reply's ``arrays`` record: only those in ``allowed``."""
    if p.ARRAYS not in msg.content.array_records:
        raise InvalidReply(f"missing record '{p.ARRAYS}'" if p.ARRAYS not in msg.content
                           else f"record '{p.ARRAYS}' is not an ArrayRecord")
    try:
        sections = p.unpack(msg.content.array_records[p.ARRAYS])
    except ValueError as err:
        raise InvalidReply(f"record '{p.ARRAYS}': {err}") from err
    unexpected = sorted(set(sections) - allowed)
    if unexpected:
        raise InvalidReply(f"unexpected section(s) {unexpected} in record '{p.ARRAYS}'")
    return sections


def _section(sections: p.Sections, name: str) -> p.NDArrays:
    if name not in sections:
        raise InvalidReply(f"missing section '{name}' in record '{p.ARRAYS}'")
    return sections[name]


def _metric(metrics, key: str) -> float:
    if key not in metrics:
        raise InvalidReply(f"missing metric '{key}'")
    value = metrics[key]
    if not isinstance(value, (int, float)) or not np.isfinite(value):
        raise InvalidReply(f"metric '{key}' = {value!r} is not a finite number")
    return float(value)


def _optional_metric(metrics, key: str, default: float) -> float:
    return _metric(metrics, key) if key in metrics else default


def _partition_id(metrics, num_partitions: int | None) -> int:
    value = _metric(metrics, p.PARTITION_ID)
    if not value.is_integer() or value < 0 or (num_partitions is not None and value >= num_partitions):
        raise InvalidReply(f"partition-id {value!r} is not a valid partition")
    return int(value)


def _finite_as(value: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``value`` in the model's ``dtype``, all finite there: checked after the cast, since a
    finite float64 (1e300) may overflow to Inf in float32."""
    with np.errstate(over="ignore"):
        cast = value.astype(dtype)
    if not np.isfinite(cast).all():
        raise InvalidReply(f"{what} holds NaN or Inf (as {dtype})")
    return cast


def _check_arrays(arrays: p.NDArrays, template: p.NDArrays, what: str) -> p.NDArrays:
    if set(arrays) != set(template):
        raise InvalidReply(f"{what} keys differ from the model's")
    for key, value in arrays.items():
        if value.shape != template[key].shape:
            raise InvalidReply(f"{what} '{key}' has shape {value.shape}, expected {template[key].shape}")
    return {key: _finite_as(arrays[key], template[key].dtype, f"{what} '{key}'") for key in template}


def _parse_statistics(sections: p.Sections, expected: dict[str, tuple[int, ...]]) -> p.NDArrays:
    """The statistics section: exactly the expected arrays, with their shapes, all finite."""
    if not expected:
        return {}  # the section itself is refused by _sections
    stats = _section(sections, p.STATISTICS)
    extra = sorted(set(stats) - set(expected))
    if extra:
        raise InvalidReply(f"statistics hold unexpected arrays {extra}")
    for key, shape in expected.items():
        if key not in stats:
            raise InvalidReply(f"statistics lack '{key}'")
        if stats[key].shape != shape:
            raise InvalidReply(f"statistics '{key}' has shape {stats[key].shape}, expected {shape}")
        if not np.isfinite(stats[key]).all():
            raise InvalidReply(f"statistics '{key}' hold NaN or Inf")
    return stats


def _sample_count(value: float, what: str) -> float:
    """A count of samples: positive, whole, and at most 2**53, above which a float64 holds no odd
    whole numbers (the whole-number check means nothing) and a few counts overflow the sums and
    caps of the sample weights."""
    if value <= 0 or not value.is_integer():
        raise InvalidReply(f"{what} {value} must be positive and a whole number")
    if value > MAX_SAMPLE_COUNT:
        raise InvalidReply(f"{what} {value:.6g} is above 2**53, past any data set")
    return value


def _variance_metric(v: float, h: np.ndarray) -> float:
    """V, checked against the client's h. V is a difference of sums of squares: when all of a
    client's features of its only class coincide it is 0 up to rounding, which may leave it a
    hair below 0; rounding relative to the sum of squares of h, taken in float64: the squares
    of a float32-finite h can overflow float32, and an infinite scale would pass any negative
    V as rounding (in float64 they cannot: at most ~1e77 each)."""
    scale = max(1.0, float(np.sum(np.square(h, dtype=np.float64))))
    if v < -V_ROUNDING * scale:
        raise InvalidReply(f"V = {v} is negative")
    return max(v, 0.0)


def _check_sample_bound(num_examples: float, max_samples: int) -> None:
    if max_samples and num_examples > max_samples:
        raise InvalidReply(f"num-examples {num_examples:.0f} is above max-samples-per-client = {max_samples}")


def parse_train_reply(  # pylint: disable=too-many-arguments
    msg: Message,
    extractor_template: p.NDArrays,
    head_template: p.NDArrays,
    num_partitions: int | None = None,
    method: Method = FEDPAC,
    max_samples: int = 0,
) -> ClientUpdate:
    """Decode a training reply of ``method``, checking shapes, finiteness and count consistency.

    A method that needs no statistics (FedAvg, FedPer, FedRep, Local-only) must not send any.
    """
    if msg.has_error():
        raise InvalidReply(f"client error: {msg.error.reason}")
    num_classes, dim = head_template["head.weight"].shape
    expected = expected_statistics(method, num_classes, dim)
    _check_shape_of_reply(msg, TRAIN_RECORDS)
    metrics = _get(msg, p.METRICS)
    partition_id = _partition_id(metrics, num_partitions)
    sections = _sections(msg, frozenset({p.MODEL, p.STATISTICS}) if expected else frozenset({p.MODEL}))
    arrays = _section(sections, p.MODEL)
    extractor = _check_arrays(
        {k: v for k, v in arrays.items() if k in extractor_template}, extractor_template, "extractor"
    )
    head = _check_arrays({k: v for k, v in arrays.items() if k not in extractor_template}, head_template, "head")
    stats = _parse_statistics(sections, expected)
    # in the model's dtype, like the model: the server's averages of them are cast to it, and a
    # float64 value that is finite but overflows it would make every client's targets Inf
    feature_dtype = head_template[p.HEAD_WEIGHT].dtype
    centroids = (_finite_as(stats[p.CENTROID_VALUES], feature_dtype, f"statistics '{p.CENTROID_VALUES}'")
                 if p.CENTROID_VALUES in stats else None)
    h = _finite_as(stats[p.H], feature_dtype, f"statistics '{p.H}'") if p.H in stats else None
    num_examples = _sample_count(_metric(metrics, p.NUM_EXAMPLES), p.NUM_EXAMPLES)
    _check_sample_bound(num_examples, max_samples)
    _metric(metrics, p.TRAIN_LOSS)  # the round's report averages it
    counts = None
    if p.CLASS_COUNTS in stats:
        counts = stats[p.CLASS_COUNTS].astype(np.float64)
        if (counts < 0).any() or not np.allclose(counts, np.round(counts)):
            raise InvalidReply("class counts must be non-negative integers")
        if counts.sum() != num_examples:
            raise InvalidReply(
                f"num-examples {num_examples} must be positive and equal the class counts' sum {counts.sum()}")
    v = None
    if method.needs_statistics:
        assert h is not None  # expected_statistics: h comes with the statistics V belongs to
        v = _variance_metric(_metric(metrics, p.V), h)
    rho = None
    if method.keeps_posteriors:
        rho = _metric(metrics, p.RHO)
        # tau = 1 / rho^2 weighs the client in the prior mean: rho = 0 would be an infinite weight,
        # a rho whose square overflows a zero one (and an all-zero sum of weights)
        squared = rho * rho
        if not (rho > 0 and squared > 0 and 0.0 < 1.0 / squared < float("inf")):
            raise InvalidReply(f"rho = {rho} must be a positive number with a finite, positive confidence "
                               "1/rho^2")
    if method.evaluates_local_model:
        local = _metric(metrics, p.LOCAL_ACCURACY)
        if not 0.0 <= local <= 1.0:
            raise InvalidReply(f"local accuracy {local} outside [0, 1]")
    evaluation = None
    if p.EVALUATION in msg.content:
        if p.EVALUATION not in msg.content.metric_records:
            raise InvalidReply(f"record '{p.EVALUATION}' is not a MetricRecord")
        evaluation = parse_evaluation(msg.content[p.EVALUATION], msg.metadata.src_node_id, num_partitions)
        if evaluation.partition_id != partition_id:
            raise InvalidReply(f"its evaluation is of partition {evaluation.partition_id}, its update of "
                               f"partition {partition_id}")
    return ClientUpdate(
        partition_id=partition_id,
        node_id=msg.metadata.src_node_id,
        extractor=extractor,
        head=head,
        num_examples=int(num_examples),
        metrics={k: float(val) for k, val in metrics.items() if isinstance(val, (int, float))},
        centroids=None if centroids is None else centroids.astype(np.float64),
        class_counts=counts,
        h=None if h is None else h.astype(np.float64),
        v=v,
        balanced_head=_balanced_head(stats, head_template) if method.sends_balanced_head else None,
        scale=_scale(stats, head_template) if method.keeps_posteriors else None,
        rho=rho,
        evaluation=evaluation,
    )


def _balanced_head(stats: p.NDArrays, head_template: p.NDArrays) -> p.NDArrays:
    """The balanced head under the model's own head keys (shapes were checked with the rest)."""
    return {p.HEAD_WEIGHT: _finite_as(stats[p.BALANCED_WEIGHT], head_template[p.HEAD_WEIGHT].dtype, "balanced head"),
            p.HEAD_BIAS: _finite_as(stats[p.BALANCED_BIAS], head_template[p.HEAD_BIAS].dtype, "balanced head")}


def _scale(stats: p.NDArrays, head_template: p.NDArrays) -> p.NDArrays:
    """A posterior's scales under the model's own head keys (shapes were checked with the rest)."""
    return {p.HEAD_WEIGHT: _finite_as(stats[p.SCALE_WEIGHT], head_template[p.HEAD_WEIGHT].dtype, "posterior scales"),
            p.HEAD_BIAS: _finite_as(stats[p.SCALE_BIAS], head_template[p.HEAD_BIAS].dtype, "posterior scales")}


@dataclass(frozen=True)
class ClientInfo:
    """A node's answer to the pre-flight query."""

    partition_id: int
    num_partitions: int
    num_examples: int
    test_examples: int


def parse_query_reply(msg: Message, max_samples: int = 0) -> ClientInfo:
    """Decode a pre-flight (query) reply."""
    if msg.has_error():
        raise InvalidReply(msg.error.reason)
    _check_shape_of_reply(msg, EVALUATE_RECORDS)
    metrics = _get(msg, p.METRICS)
    num_partitions = _metric(metrics, "num-partitions")
    if not num_partitions.is_integer() or not 1 <= num_partitions <= MAX_PARTITIONS:
        raise InvalidReply(f"num-partitions {num_partitions!r} is not an integer in [1, {MAX_PARTITIONS:,}]")
    counts = [_sample_count(_metric(metrics, key), key) for key in (p.NUM_EXAMPLES, "test-examples")]
    _check_sample_bound(counts[0], max_samples)
    return ClientInfo(
        partition_id=_partition_id(metrics, int(num_partitions)),
        num_partitions=int(num_partitions),
        num_examples=int(counts[0]),
        test_examples=int(counts[1]),
    )


def parse_evaluate_reply(msg: Message, num_partitions: int | None = None) -> ClientEvaluation:
    """Decode an evaluation reply."""
    if msg.has_error():
        raise InvalidReply(f"client error: {msg.error.reason}")
    _check_shape_of_reply(msg, EVALUATE_RECORDS)
    return parse_evaluation(_get(msg, p.METRICS), msg.metadata.src_node_id, num_partitions)


def _seconds(metrics) -> float:
    seconds = _optional_metric(metrics, p.EVAL_SECONDS, 0.0)
    if seconds < 0:
        raise InvalidReply(f"{p.EVAL_SECONDS} = {seconds} is negative")
    return seconds


def parse_evaluation(metrics, node_id: int, num_partitions: int | None = None) -> ClientEvaluation:
    """Decode an evaluation's metrics: an evaluate reply's, or the ``evaluation`` record of a
    train reply (fused evaluation)."""
    accuracy = _metric(metrics, "accuracy")
    if not 0.0 <= accuracy <= 1.0:
        raise InvalidReply(f"accuracy {accuracy} outside [0, 1]")
    num_examples = _sample_count(_metric(metrics, p.NUM_EXAMPLES), p.NUM_EXAMPLES)
    generalized = None
    if p.GENERALIZED_ACCURACY in metrics:
        generalized = _metric(metrics, p.GENERALIZED_ACCURACY)
        if not 0.0 <= generalized <= 1.0:
            raise InvalidReply(f"generalized accuracy {generalized} outside [0, 1]")
    return ClientEvaluation(
        partition_id=_partition_id(metrics, num_partitions),
        node_id=node_id,
        num_examples=int(num_examples),
        accuracy=accuracy,
        loss=_metric(metrics, "loss"),
        seconds=_seconds(metrics),
        generalized_accuracy=generalized,
    )
