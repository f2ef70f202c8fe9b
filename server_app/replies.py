"""Checking and decoding client replies: nothing malformed reaches the global state."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
from flwr.app import Message
from flwr.common.constant import SUPERLINK_NODE_ID, ErrorCode

from common import protocol as p
from common.methods.server import EXTRACTOR, HEAD, ServerPart, Update
from common.model import part_of
from common.validation import InvalidReply, finite_as, metric, optional_metric, sample_count


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
    """One client's decoded training reply: the method's part of it (``update``, which its server
    part has checked) and, with fused evaluation, the evaluation of the model this round's train
    message carried."""

    update: Update
    node_id: int
    evaluation: ClientEvaluation | None = None

    @property
    def partition_id(self) -> int:
        return self.update.partition_id


@dataclass(frozen=True)
class ClientEvaluation:
    partition_id: int
    node_id: int
    num_examples: int
    accuracy: float | None  # None: the site withheld its metrics (node config withhold-metrics)
    loss: float | None
    seconds: float  # client-side compute of the evaluation
    generalized_accuracy: float | None = None  # the whole test set in the client's concept


MAX_METRICS = 32
# The server keeps a head (and a posterior) for every partition, and pFedVEM draws a number per
# partition every round: a federation this size is far beyond what that state is made for.
MAX_PARTITIONS = 1_000_000
TRAIN_RECORDS = frozenset({p.ARRAYS, p.METRICS, p.EVALUATION})
EVALUATE_RECORDS = frozenset({p.METRICS})


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


def _partition_id(metrics, num_partitions: int | None) -> int:
    value = metric(metrics, p.PARTITION_ID)
    if not value.is_integer() or value < 0 or (num_partitions is not None and value >= num_partitions):
        raise InvalidReply(f"partition-id {value!r} is not a valid partition")
    return int(value)


def _check_arrays(arrays: p.NDArrays, template: p.NDArrays, what: str) -> p.NDArrays:
    if set(arrays) != set(template):
        extra, missing = sorted(set(arrays) - set(template)), sorted(set(template) - set(arrays))
        raise InvalidReply(f"{what} keys differ from the model's: {len(extra)} extra {extra[:3]}, "
                           f"{len(missing)} missing {missing[:3]}")
    for key, value in arrays.items():
        if value.shape != template[key].shape:
            raise InvalidReply(f"{what} '{key}' has shape {value.shape}, expected {template[key].shape}")
    return {key: finite_as(arrays[key], template[key].dtype, f"{what} '{key}'") for key in template}


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


def _check_sample_bound(num_examples: float, max_samples: int) -> None:
    if max_samples and num_examples > max_samples:
        raise InvalidReply(f"num-examples {num_examples:.0f} is above max-samples-per-client = {max_samples}")


def parse_train_reply(
    msg: Message,
    server: ServerPart,
    num_partitions: int | None = None,
    max_samples: int = 0,
) -> ClientUpdate:
    """Decode a training reply, checking shapes, finiteness and counts: the model and the metrics
    every method sends here, the method's statistics and metrics by its server part
    (``ServerPart.statistics_shapes``, ``ServerPart.check``). A reply carries nothing its
    method's server step does not use: no statistics for a method that needs none (FedAvg, FedPer,
    FedRep, Local-only), no model part its method keeps at the site (``Method.site_parts``)."""
    if msg.has_error():
        raise InvalidReply(f"client error: {msg.error.reason}")
    expected = server.statistics_shapes()
    _check_shape_of_reply(msg, TRAIN_RECORDS)
    metrics = _get(msg, p.METRICS)
    partition_id = _partition_id(metrics, num_partitions)
    shared = server.method.shared_parts
    sections = _sections(msg, frozenset({p.MODEL, p.STATISTICS}) if expected else frozenset({p.MODEL}))
    arrays = _section(sections, p.MODEL) if shared else sections.get(p.MODEL, {})
    kept_at_site = sorted({part_of(key) for key in arrays} & set(server.method.site_parts))
    if kept_at_site:
        raise InvalidReply(f"the reply carries the {' and '.join(kept_at_site)}, which "
                           f"{server.method.name} keeps at the site")
    unexpected = sorted(key for key in arrays if part_of(key) not in shared)
    if unexpected:
        raise InvalidReply(f"unexpected model array(s) {unexpected[:3]}")
    model = {part: _check_arrays({k: v for k, v in arrays.items() if part_of(k) == part},
                                 server.part_template(part), part)
             for part in shared}
    extractor, head = model.get(EXTRACTOR, {}), model.get(HEAD, {})
    stats = _parse_statistics(sections, expected)
    num_examples = sample_count(metric(metrics, p.NUM_EXAMPLES), p.NUM_EXAMPLES)
    _check_sample_bound(num_examples, max_samples)
    if p.TRAIN_LOSS in metrics or not server.cfg.dp:  # the report averages it; a private site withholds it
        metric(metrics, p.TRAIN_LOSS)
    update = server.check(Update(
        partition_id=partition_id,
        extractor=extractor,
        head=head,
        num_examples=int(num_examples),
        metrics={k: float(val) for k, val in metrics.items() if isinstance(val, (int, float))},
        statistics=stats,
    ))
    evaluation = None
    if p.EVALUATION in msg.content:
        if p.EVALUATION not in msg.content.metric_records:
            raise InvalidReply(f"record '{p.EVALUATION}' is not a MetricRecord")
        evaluation = parse_evaluation(msg.content[p.EVALUATION], msg.metadata.src_node_id, num_partitions)
        if evaluation.partition_id != partition_id:
            raise InvalidReply(f"its evaluation is of partition {evaluation.partition_id}, its update of "
                               f"partition {partition_id}")
    return ClientUpdate(update=update, node_id=msg.metadata.src_node_id, evaluation=evaluation)


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
    num_partitions = metric(metrics, "num-partitions")
    if not num_partitions.is_integer() or not 1 <= num_partitions <= MAX_PARTITIONS:
        raise InvalidReply(f"num-partitions {num_partitions!r} is not an integer in [1, {MAX_PARTITIONS:,}]")
    counts = [sample_count(metric(metrics, key), key) for key in (p.NUM_EXAMPLES, "test-examples")]
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
    seconds = optional_metric(metrics, p.EVAL_SECONDS, 0.0)
    if seconds < 0:
        raise InvalidReply(f"{p.EVAL_SECONDS} = {seconds} is negative")
    return seconds


def parse_evaluation(metrics, node_id: int, num_partitions: int | None = None) -> ClientEvaluation:
    """Decode an evaluation's metrics: an evaluate reply's, or the ``evaluation`` record of a
    train reply (fused evaluation). A site that withheld its metrics evaluated all the same (a
    deployed site saved the model): its evaluation counts as done, with no accuracy or loss."""
    if p.METRICS_WITHHELD in metrics:
        if metric(metrics, p.METRICS_WITHHELD) != 1.0:
            raise InvalidReply(f"{p.METRICS_WITHHELD} = {metrics[p.METRICS_WITHHELD]!r}, expected 1")
        return ClientEvaluation(partition_id=_partition_id(metrics, num_partitions), node_id=node_id,
                                num_examples=int(sample_count(metric(metrics, p.NUM_EXAMPLES), p.NUM_EXAMPLES)),
                                accuracy=None, loss=None, seconds=0.0)
    accuracy = metric(metrics, "accuracy")
    if not 0.0 <= accuracy <= 1.0:
        raise InvalidReply(f"accuracy {accuracy} outside [0, 1]")
    num_examples = sample_count(metric(metrics, p.NUM_EXAMPLES), p.NUM_EXAMPLES)
    generalized = None
    if p.GENERALIZED_ACCURACY in metrics:
        generalized = metric(metrics, p.GENERALIZED_ACCURACY)
        if not 0.0 <= generalized <= 1.0:
            raise InvalidReply(f"generalized accuracy {generalized} outside [0, 1]")
    return ClientEvaluation(
        partition_id=_partition_id(metrics, num_partitions),
        node_id=node_id,
        num_examples=int(num_examples),
        accuracy=accuracy,
        loss=metric(metrics, "loss"),
        seconds=_seconds(metrics),
        generalized_accuracy=generalized,
    )
