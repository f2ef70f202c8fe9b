"""Server checkpoints: everything needed to continue a FedPAC run after a stop or a crash.

One ``checkpoint.npz`` per run folder, rewritten atomically (write, then rename) after every
round: the global extractor, the global centroids and mask, every client's personalized head
(by partition-id), the number of finished rounds, and the per-round records so far. Baselines
add what their server keeps instead: FedAvg's global head, Local-only's per-client extractors,
FedCCFA's per-client anchors, pFedVEM's prior mean (as the global head) and every client's
posterior (its mean as the client's head, its scales by partition-id);
the method's name is stored so that a run resumes only as the method it was. Node
sampling, pFedVEM's sample S_t and local shuffling are seeded by (seed, round, partition-id), so no random generator
state needs saving: a resumed run continues exactly where the stopped one would have.
"""

from __future__ import annotations

import json
import zipfile
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from common import protocol as p
from common.files import atomic_write, npz_bytes
from server_app.report import RoundRecord, record_fields

FILE_NAME = "checkpoint.npz"
FORMAT_VERSION = 1
# RoundRecord fields whose keys are partition-ids (JSON turns them into strings).
_KEYED_BY_PARTITION = (
    "train", "accuracy", "test_loss", "eval_seconds", "bytes_sent", "bytes_received", "generalized",
)


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, or belongs to an incompatible run."""


@dataclass
class Checkpoint:
    """The server's state after ``completed_rounds`` rounds."""

    completed_rounds: int
    extractor: p.NDArrays
    centroids: np.ndarray
    centroid_mask: np.ndarray
    heads: dict[int, p.NDArrays]
    rounds: list[RoundRecord]
    model_shape: tuple[int, int, int]  # (num_classes, image_size, image_channels)
    seed: int
    strategy: str = "fedpac"  # the method (run config `strategy`)
    global_head: p.NDArrays | None = None  # FedAvg's averaged head, pFedVEM's prior mean w
    client_extractors: dict[int, p.NDArrays] = field(default_factory=dict)  # Local-only
    # FedCCFA: each client's cluster anchors (K, d) and their mask (K,)
    anchors: dict[int, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)
    config: dict = field(default_factory=dict)  # the validated run config (empty: older checkpoints)
    # pFedVEM: each client's posterior scales s (its mean is in ``heads``), under the head's keys
    posterior_scales: dict[int, p.NDArrays] = field(default_factory=dict)


def save_checkpoint(checkpoint: Checkpoint, directory: Path) -> Path:
    """Write ``directory/checkpoint.npz`` atomically; returns its path."""
    arrays = {f"extractor/{k}": v for k, v in checkpoint.extractor.items()}
    arrays["centroids"] = checkpoint.centroids
    arrays["centroid_mask"] = checkpoint.centroid_mask
    for pid, head in checkpoint.heads.items():
        arrays.update({f"head/{pid}/{k}": v for k, v in head.items()})
    for key, value in (checkpoint.global_head or {}).items():
        arrays[f"global-head/{key}"] = value
    for pid, extractor in checkpoint.client_extractors.items():
        arrays.update({f"client-extractor/{pid}/{k}": v for k, v in extractor.items()})
    for pid, (values, mask) in checkpoint.anchors.items():
        arrays[f"anchors/{pid}/values"] = values
        arrays[f"anchors/{pid}/mask"] = mask
    for pid, scale in checkpoint.posterior_scales.items():
        arrays.update({f"posterior-scale/{pid}/{k}": v for k, v in scale.items()})
    meta = {
        "format": FORMAT_VERSION,
        "completed_rounds": checkpoint.completed_rounds,
        "model_shape": list(checkpoint.model_shape),
        "seed": checkpoint.seed,
        "strategy": checkpoint.strategy,
        "config": checkpoint.config,
        "rounds": [record_fields(r) for r in checkpoint.rounds],
    }
    arrays["meta"] = np.array(json.dumps(meta))
    path = directory / FILE_NAME
    atomic_write(path, npz_bytes(arrays))
    return path


def _record(data: dict) -> RoundRecord:
    for name in _KEYED_BY_PARTITION:
        data[name] = {int(k): v for k, v in data.get(name, {}).items()}
    return RoundRecord(**data)


def checkpoint_file(location: str | Path) -> Path:
    """The checkpoint file ``location`` names: itself, or the one in the run folder it names."""
    path = Path(location).expanduser()
    return path / FILE_NAME if path.is_dir() else path


def load_checkpoint(location: str | Path) -> Checkpoint:
    """Read a checkpoint from its file or from the run folder that holds it."""
    path = checkpoint_file(location)
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"cannot read checkpoint {path} (truncated or not a checkpoint?): {err}") from err
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path} has format {found}, expected {FORMAT_VERSION}")
    try:
        return _unpacked(arrays, meta)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # a readable file of the right format with parts missing or of the wrong kind: edited by
        # hand, or written by other software; name the problem instead of a bare KeyError
        raise CheckpointError(f"checkpoint {path} is malformed ({type(err).__name__}: {err})") from err


def _unpacked(arrays: dict[str, np.ndarray], meta: dict) -> Checkpoint:
    """The checkpoint held by an archive's arrays and its ``meta`` record."""
    per_partition: dict[str, dict[int, p.NDArrays]] = {
        section: {} for section in ("head", "client-extractor", "anchors", "posterior-scale")
    }
    for name, value in arrays.items():
        section, _, rest = name.partition("/")
        if section in per_partition:
            pid, key = rest.split("/", 1)
            per_partition[section].setdefault(int(pid), {})[key] = value
    global_head = {k[len("global-head/"):]: v for k, v in arrays.items() if k.startswith("global-head/")}
    return Checkpoint(
        completed_rounds=int(meta["completed_rounds"]),
        extractor={k[len("extractor/"):]: v for k, v in arrays.items() if k.startswith("extractor/")},
        centroids=arrays["centroids"],
        centroid_mask=arrays["centroid_mask"].astype(bool),
        heads=per_partition["head"],
        rounds=[_record(r) for r in meta["rounds"]],
        model_shape=tuple(meta["model_shape"]),
        seed=int(meta["seed"]),
        strategy=str(meta.get("strategy", "fedpac")),  # checkpoints from before the baselines
        global_head=global_head or None,
        client_extractors=per_partition["client-extractor"],
        anchors={
            pid: (parts["values"], parts["mask"].astype(bool)) for pid, parts in per_partition["anchors"].items()
        },
        config=dict(meta.get("config", {})),
        posterior_scales=per_partition["posterior-scale"],
    )
