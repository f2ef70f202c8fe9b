"""What crosses the network each round: record keys and (de)serialization, shared by both sides.

Server -> client (train and evaluate): ``arrays`` (global extractor + the client's personalized
head), ``centroids`` (train only: global class centroids and their mask), ``config``.
Client -> server (train): ``arrays`` (trained extractor + head), ``statistics`` (local centroids,
class counts, h) and ``metrics`` (partition-id, num-examples, v, losses).
Client -> server (evaluate): ``metrics`` (partition-id, num-examples, accuracy, loss).

Baselines (``common.methods``) send only what their server step uses: ``centroids`` down and
local centroids up only with feature alignment, h and v only with classifier collaboration,
no ``statistics`` record at all for FedAvg, FedAvg-FT, FedPer, FedRep and Local-only.
"""

from __future__ import annotations

import numpy as np
from flwr.app import Array, ArrayRecord, RecordDict

ARRAYS = "arrays"
CENTROIDS = "centroids"
STATISTICS = "statistics"
METRICS = "metrics"
CONFIG = "config"

# Keys inside the records.
CENTROID_VALUES = "centroids"
CENTROID_MASK = "mask"
CLASS_COUNTS = "class-counts"
H = "h"
PARTITION_ID = "partition-id"
NUM_EXAMPLES = "num-examples"
V = "v"
SERVER_ROUND = "server-round"

NDArrays = dict[str, np.ndarray]


def to_record(arrays: NDArrays) -> ArrayRecord:
    """An ArrayRecord holding numpy arrays under their names (order preserved)."""
    return ArrayRecord(array_dict={key: Array(np.ascontiguousarray(value)) for key, value in arrays.items()})


def from_record(record: ArrayRecord) -> NDArrays:
    """The numpy arrays of an ArrayRecord, by name."""
    return {key: array.numpy() for key, array in record.items()}


def payload_bytes(content: RecordDict) -> int:
    """Bytes of tensor data and scalars in a message's records (without gRPC framing)."""
    return sum(record.count_bytes() for record in content.values())
