"""What crosses the network each round: record keys and (de)serialization, shared by both sides.

A message carries at most one ArrayRecord, ``arrays``, and beside it a ``config`` (server ->
client) or ``metrics`` record (client -> server). All of a message's arrays travel in ``arrays``,
grouped in *sections*:

Server -> client (train and evaluate): section ``model`` (global extractor + the client's
personalized head); in train messages also ``centroids`` (the alignment targets and their mask:
global class centroids, or FedCCFA's anchors of this client), ``initial-head`` (FedCCFA: the
fixed phi^0 its balanced head starts from) and ``posterior`` (pFedVEM: the prior mean w and this
client's posterior scales s; its posterior mean is the head in ``model``). The ``config`` record
holds the server round; FedCCFA: whether the server holds a personal head for this client; with
fused evaluation, the earlier round whose model this is and that the client evaluates before
training.
Client -> server (train): sections ``model`` (trained extractor + head) and ``statistics`` (local
centroids, class counts, h; FedCCFA's balanced head; pFedVEM's posterior scales); ``metrics``
(partition-id, num-examples, v, losses; pFedVEM's rho and the local model's accuracy) and, when
the server asked for it, ``evaluation`` (the evaluate reply's metrics for that round).
Client -> server (evaluate): ``metrics`` (partition-id, num-examples, accuracy, loss, and the
generalized accuracy in the rounds it is measured).

Baselines (``common.methods``) send only what their server step uses: ``centroids`` down and
local centroids up only with feature alignment, h and v only with classifier collaboration,
no ``statistics`` section at all for FedAvg, FedAvg-FT, FedPer, FedRep and Local-only.

Every head on the wire is in ``nn.Linear``'s layout, weight (K, d): pFedVEM's posterior mean
and scales and its prior mean too (its paper and code write W as (d, K); the client transposes,
in ``common.methods.pfedvem.variational.GaussianHead.from_linear`` and back).

Why one packed record: Flower moves every record, Array and Array chunk of a message as an
object of its own, one authenticated request per object on every hop (ServerApp -> SuperLink ->
SuperNode -> ClientApp, and back). ``arrays`` is one uncompressed .npz buffer, one Array, whose
members are named ``<section>/<array>``. Unpacked, a FedPAC round moved 75 objects per client and
hop; one packed record per section, 27 (19 with fused evaluation); one record per message, 13.

Why sealed messages: even packed, a message is 6 or 7 objects (the message, its RecordDict, the
ArrayRecord, its Array and the Array's chunk, the config or metrics records), each its own
authenticated request on every hop of a deployment. :func:`seal` serializes a message's records
into one ConfigRecord, ``envelope``: 3 objects (message, RecordDict, envelope). A content larger
than one of Flower's array chunks stays as it is, so Flower's chunking still bounds every request.
A deployed ServerApp seals what it sends (``server_app.responsive_grid``), the ClientApp opens it and seals
its reply (``client_app.app``); both sides see the records above. The simulation moves messages
in one process and does not seal.
"""

from __future__ import annotations

import io
import zipfile
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, RecordDict
from flwr.common.constant import FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE
from flwr.common.serde import recorddict_from_proto, recorddict_to_proto
from flwr.proto.recorddict_pb2 import RecordDict as ProtoRecordDict  # pylint: disable=no-name-in-module
from google.protobuf.message import DecodeError

from common.files import npz_bytes

# Records of a message.
ARRAYS = "arrays"  # all of its arrays, by section (pack / unpack)
METRICS = "metrics"
CONFIG = "config"
EVALUATION = "evaluation"
PACKED = "npz"  # the one Array of a packed record
ENVELOPE = "envelope"  # the one record of a sealed message, and its one entry (seal / unseal)

# Sections of the ``arrays`` record.
MODEL = "model"
CENTROIDS = "centroids"
STATISTICS = "statistics"
INITIAL_HEAD = "initial-head"
POSTERIOR = "posterior"
SECTION_SEPARATOR = "/"

# Keys inside the records.
CENTROID_VALUES = "centroids"
CENTROID_MASK = "mask"
CLASS_COUNTS = "class-counts"
H = "h"
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
TRAIN_LOSS = "train-loss"
EVAL_SECONDS = "eval-seconds"  # client-side compute of an evaluation
# 1: the site evaluated and kept its metrics to itself (node config withhold-metrics)
METRICS_WITHHELD = "metrics-withheld"
V = "v"
# FedPAC: E||noise of h||^2, which a site running DP adds to its h (0 without DP)
H_NOISE = "h-noise"
# FedPAC: how many times DP-SGD's noise inflates the variance of a site's head (1 without DP)
V_INFLATION = "v-inflation"
SERVER_ROUND = "server-round"
EVALUATE_ROUND = "evaluate-round"  # fused evaluation: the round whose model a train message carries
HAS_PERSONAL_HEAD = "has-personal-head"
# The run's lineage (``common.site_state.Lineage``) in every train and evaluate message: where a
# site finds what it kept in this run and in the runs it continues.
LINEAGE_RUNS = "lineage-runs"
LINEAGE_STARTS = "lineage-starts"
HEAD_WEIGHT = "head.weight"  # the head's keys in ``arrays`` (common.model's head.*)
HEAD_BIAS = "head.bias"
BALANCED_WEIGHT = "balanced-head.weight"
BALANCED_BIAS = "balanced-head.bias"
GENERALIZED_ACCURACY = "generalized-accuracy"
# pFedVEM: the prior mean w the server sends (its posterior scales stay at the site),
# (K, d) and (K,) like the head
PRIOR_WEIGHT = "prior.weight"
PRIOR_BIAS = "prior.bias"
RHO = "rho"  # the client's prior scale rho_j (eq. 7), taken before its E-step; tau_j = 1 / rho_j^2
# A site's epsilon at the run's delta after the round (differential privacy on: common.privacy)
DP_EPSILON = "dp-epsilon"
LOCAL_ACCURACY = "local-accuracy"  # the locally trained model before aggregation (pFedVEM's own)
LOCAL_LOSS = "local-loss"

NDArrays = dict[str, np.ndarray]
Sections = dict[str, NDArrays]


def to_record(arrays: NDArrays) -> ArrayRecord:
    """An ArrayRecord carrying numpy arrays under their names (order, dtypes and shapes kept),
    packed into one Array."""
    packed = np.frombuffer(npz_bytes({key: np.asarray(value) for key, value in arrays.items()}), dtype=np.uint8)
    return ArrayRecord(array_dict={PACKED: Array(packed)})


def from_record(record: ArrayRecord) -> NDArrays:
    """The numpy arrays of a record, by name: unpacked from :func:`to_record`'s buffer, or
    those of a plain ArrayRecord (one Array per name, as Flower's own helpers make).

    Raises ``ValueError`` when the packed buffer is not an uncompressed .npz archive (so a
    client cannot make the server inflate a small reply into a huge one), or when any array is
    not an array of plain numbers (:data:`NUMERIC_DTYPES`).
    """
    if list(record.keys()) != [PACKED]:
        return {key: _numeric(key, _decoded(array.numpy)) for key, array in record.items()}
    buffer = _decoded(record[PACKED].numpy)
    if buffer.dtype != np.uint8 or buffer.ndim != 1:
        raise ValueError(f"a packed record holds bytes, not a {buffer.dtype} array of shape {buffer.shape}")
    stream = io.BytesIO(buffer.tobytes())

    def read() -> NDArrays:
        with zipfile.ZipFile(stream) as archive:
            if any(member.compress_type != zipfile.ZIP_STORED for member in archive.infolist()):
                raise ValueError("a packed record must not be compressed")
        stream.seek(0)
        with np.load(stream, allow_pickle=False) as archive:
            return {key: archive[key] for key in archive.files}

    return {key: _numeric(key, value) for key, value in _decoded(read).items()}


# Plain numbers only: a float128 can hold values no float64 can, a string or object array is no
# number at all, and either would get past the finiteness checks of a reply.
NUMERIC_DTYPES = frozenset(np.dtype(t) for t in (
    np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
    np.float16, np.float32, np.float64))


def _decoded(decode: Callable[[], Any]) -> Any:
    """``decode()``, any failure a ``ValueError``: numpy and zipfile fail on crafted bytes in
    many ways (``RuntimeError`` for an "encrypted" member, ``TypeError``, ``OSError``, ...), and
    every one of them means the same: the record is malformed."""
    try:
        return decode()
    except Exception as err:  # noqa: BLE001  # pylint: disable=broad-exception-caught
        raise ValueError(f"not a packed array record: {type(err).__name__}: {err}") from err


def _numeric(name: str, value: Any) -> np.ndarray:
    if not isinstance(value, np.ndarray) or value.dtype not in NUMERIC_DTYPES:
        kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
        raise ValueError(f"array '{name}' is not an array of numbers ({kind})")
    return value


def pack(sections: Mapping[str, NDArrays]) -> ArrayRecord:
    """A message's ``arrays`` record: every section's arrays, as ``<section>/<array>``, in one
    packed Array (:func:`to_record`). An empty section is left out."""
    for name in sections:
        if not name or SECTION_SEPARATOR in name:
            raise ValueError(f"section name {name!r} must be non-empty and free of '{SECTION_SEPARATOR}'")
    return to_record({f"{name}{SECTION_SEPARATOR}{key}": value
                      for name, arrays in sections.items() for key, value in arrays.items()})


def unpack(record: ArrayRecord) -> Sections:
    """The sections of a :func:`pack`-ed record, each its arrays by name.

    Raises ``ValueError`` when the record is not packed as :func:`from_record` reads it, or an
    array belongs to no section.
    """
    sections: Sections = {}
    for name, value in from_record(record).items():
        section, separator, key = name.partition(SECTION_SEPARATOR)
        if not (section and separator and key):
            raise ValueError(f"array '{name}' is not named <section>{SECTION_SEPARATOR}<array>")
        sections.setdefault(section, {})[key] = value
    return sections


def sections_of(content: RecordDict) -> Sections:
    """The sections of a message's ``arrays`` record (none when it has no such record)."""
    if ARRAYS not in content.array_records:
        return {}
    return unpack(content.array_records[ARRAYS])


def payload_bytes(content: RecordDict) -> int:
    """Bytes of tensor data and scalars in a message's records (without gRPC framing)."""
    return sum(record.count_bytes() for record in content.values())


def seal(content: RecordDict, max_bytes: int = FLWR_PRIVATE_MAX_ARRAY_CHUNK_SIZE) -> RecordDict:
    """``content`` as one ConfigRecord holding its serialized records, or ``content`` itself
    when that is larger than ``max_bytes`` (one of Flower's array chunks, by default)."""
    serialized = recorddict_to_proto(content).SerializeToString()
    if len(serialized) > max_bytes:
        return content
    return RecordDict({ENVELOPE: ConfigRecord({ENVELOPE: serialized})})


def is_sealed(content: RecordDict) -> bool:
    """Whether ``content`` is a :func:`seal`-ed message's (its only record is the envelope)."""
    return list(content.keys()) == [ENVELOPE] and ENVELOPE in content.config_records


def unseal(content: RecordDict) -> RecordDict:
    """The records :func:`seal` put in ``content``'s envelope.

    Raises ``ValueError`` when ``content`` is not sealed or its envelope does not hold
    serialized records.
    """
    if not is_sealed(content):
        raise ValueError(f"not a sealed message: records {sorted(content.keys())}")
    envelope = content.config_records[ENVELOPE]
    serialized = envelope.get(ENVELOPE)
    if list(envelope.keys()) != [ENVELOPE] or not isinstance(serialized, bytes):
        raise ValueError("a sealed message's envelope holds exactly one bytes entry")
    proto = ProtoRecordDict()
    try:
        proto.ParseFromString(serialized)
        return recorddict_from_proto(proto)
    except (DecodeError, ValueError, TypeError) as err:
        raise ValueError(f"the envelope does not hold serialized records: {err}") from err
