"""Server checkpoints: everything needed to continue a run after a stop or a crash.

``checkpoint.npz`` in the run folder, rewritten atomically (write, then rename) after every
round, and beside it ``checkpoint-round-<t>.npz``, the same file for each of the latest
``checkpoints-kept`` rounds (a hard link: no byte written twice), so that a run can resume from
an earlier round than the last (one whose state a hostile or broken site had not yet spoiled,
say). Each holds the method's server state (``common.methods.server.ServerState``: for FedPAC
the global extractor and centroids and every client's personalized head by partition-id; for
pFedVEM the base, the prior mean and every client's posterior; ...), as
``shared/<section>/<array>`` and ``personal/<section>/<partition-id>/<array>``, the number of
finished rounds, and the per-round records so far. The method's name is stored so that a run
resumes only as the method it was. Node sampling, pFedVEM's sample S_t and local shuffling are
seeded by (seed, round, partition-id), so no random generator state needs saving: a resumed run
continues exactly where the stopped one would have.

Checkpoints of format 1 (before the methods kept their state by section) are read too: their
fields map onto the sections the methods keep now (:func:`_format_1_state`). So are records
written before a record kept its method's values in ``method`` (alpha, clusters, ... beside the
generic fields): a field a record no longer has moves into its ``method`` (:func:`_record`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import zipfile
from dataclasses import dataclass, field, fields
from pathlib import Path

import numpy as np

from common import protocol as p
from common.files import atomic_write, npz_bytes, temporary_path
from common.methods.server import ServerState
from common.site_state import Lineage, check_lineage
from server_app.report import RoundRecord, record_fields

FILE_NAME = "checkpoint.npz"
# The checkpoint of one round, kept for the latest ``checkpoints-kept`` rounds.
ROUND_FILE = "checkpoint-round-{round}.npz"
_ROUND_FILE = re.compile(r"checkpoint-round-(\d+)\.npz")
DEFAULT_KEPT = 3
FORMAT_VERSION = 2
READABLE_FORMATS = (1, 2)
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
    state: ServerState
    rounds: list[RoundRecord]
    model_shape: tuple[int, int, int]  # (num_classes, image_size, image_channels)
    seed: int
    strategy: str = "fedpac"  # the method (run config `strategy`)
    config: dict = field(default_factory=dict)  # the validated run config (empty: older checkpoints)
    # the run and the runs it continued, each with its first round (``common.site_state``;
    # empty: older checkpoints, or a method that keeps nothing at the site)
    lineage: Lineage = ()


def save_checkpoint(checkpoint: Checkpoint, directory: Path, kept: int = DEFAULT_KEPT) -> Path:
    """Write ``directory/checkpoint.npz`` atomically, keep it as the round's
    ``checkpoint-round-<t>.npz`` too, and remove the round files older than the latest ``kept``;
    returns the path of ``checkpoint.npz``."""
    arrays = {f"shared/{section}/{key}": value
              for section, part in checkpoint.state.shared.items() for key, value in part.items()}
    for section, by_partition in checkpoint.state.personal.items():
        for pid, part in by_partition.items():
            arrays.update({f"personal/{section}/{pid}/{key}": value for key, value in part.items()})
    meta = {
        "format": FORMAT_VERSION,
        "completed_rounds": checkpoint.completed_rounds,
        "model_shape": list(checkpoint.model_shape),
        "seed": checkpoint.seed,
        "strategy": checkpoint.strategy,
        "config": checkpoint.config,
        "rounds": [record_fields(r) for r in checkpoint.rounds],
        "lineage": [list(entry) for entry in checkpoint.lineage],
    }
    arrays["meta"] = np.array(json.dumps(meta))
    path = directory / FILE_NAME
    data = npz_bytes(arrays)
    atomic_write(path, data)  # first: the file every reader and status.json names
    _keep_round(path, directory / ROUND_FILE.format(round=checkpoint.completed_rounds), data)
    rounds = kept_rounds(directory)
    for number in rounds[:max(0, len(rounds) - max(1, kept))]:
        with contextlib.suppress(FileNotFoundError):
            (directory / ROUND_FILE.format(round=number)).unlink()
    return path


def _keep_round(latest: Path, path: Path, data: bytes) -> None:
    """``path``: the round's checkpoint, as ``latest`` holds it. A hard link, made under a
    temporary name and renamed, costs no second write; the next round's ``checkpoint.npz``
    replaces that name's file, not this one. Where the file system has no hard links, the bytes
    are written again. The link's directory entry is flushed to disk with the next file written
    there (the next round's checkpoint, or the run's final state)."""
    tmp = temporary_path(path)
    try:
        tmp.unlink(missing_ok=True)
        os.link(latest, tmp)
        os.replace(tmp, path)
    except OSError:
        with contextlib.suppress(OSError):
            tmp.unlink(missing_ok=True)
        atomic_write(path, data)


def kept_rounds(directory: str | Path) -> list[int]:
    """The rounds whose checkpoint ``directory`` keeps (``checkpoint-round-<t>.npz``), oldest first."""
    folder = Path(directory).expanduser()
    if not folder.is_dir():
        return []
    found = (_ROUND_FILE.fullmatch(entry.name) for entry in folder.iterdir())
    return sorted(int(match.group(1)) for match in found if match)


def _record(data: dict) -> RoundRecord:
    """A record as the checkpoint holds it; the keys that are no field of a record (a method's
    values at the top level, as records held them before ``method``) go into ``method``."""
    for name in _KEYED_BY_PARTITION:
        data[name] = {int(k): v for k, v in data.get(name, {}).items()}
    generic = {f.name for f in fields(RoundRecord)}
    method = dict(data.pop("method", None) or {})
    for name in [key for key in data if key not in generic]:
        method[name] = data.pop(name)
    return RoundRecord(**data, method=method)


def checkpoint_file(location: str | Path) -> Path:
    """The checkpoint file ``location`` names: itself (``checkpoint.npz``, a round's
    ``checkpoint-round-<t>.npz``), or the latest, ``checkpoint.npz``, of the run folder it names."""
    path = Path(location).expanduser()
    return path / FILE_NAME if path.is_dir() else path


def load_checkpoint(location: str | Path) -> Checkpoint:
    """Read a checkpoint from its file or from the run folder that holds it (its latest)."""
    path = checkpoint_file(location)
    if not path.is_file():
        rounds = kept_rounds(path.parent)
        kept = f" (that folder keeps rounds {', '.join(map(str, rounds))})" if rounds else ""
        raise CheckpointError(f"no checkpoint at {path}{kept}")
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
        meta = json.loads(str(arrays.pop("meta")))
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as err:
        raise CheckpointError(f"cannot read checkpoint {path} (truncated or not a checkpoint?): {err}") from err
    if not isinstance(meta, dict) or meta.get("format") not in READABLE_FORMATS:
        found = meta.get("format") if isinstance(meta, dict) else None
        raise CheckpointError(f"checkpoint {path} has format {found}, expected one of "
                              f"{', '.join(map(str, READABLE_FORMATS))}")
    try:
        return _unpacked(arrays, meta)
    except (KeyError, TypeError, ValueError, AttributeError) as err:
        # a readable file of the right format with parts missing or of the wrong kind: edited by
        # hand, or written by other software; name the problem instead of a bare KeyError
        raise CheckpointError(f"checkpoint {path} is malformed ({type(err).__name__}: {err})") from err


def _unpacked(arrays: dict[str, np.ndarray], meta: dict) -> Checkpoint:
    """The checkpoint held by an archive's arrays and its ``meta`` record."""
    state = _format_1_state(arrays) if meta["format"] == 1 else _state(arrays)
    return Checkpoint(
        completed_rounds=int(meta["completed_rounds"]),
        state=state,
        rounds=[_record(r) for r in meta["rounds"]],
        model_shape=tuple(meta["model_shape"]),
        seed=int(meta["seed"]),
        strategy=str(meta.get("strategy", "fedpac")),  # checkpoints from before the baselines
        config=dict(meta.get("config", {})),
        lineage=_lineage(meta.get("lineage", [])),
    )


def _lineage(entries: list) -> Lineage:
    """The stored lineage, checked as a site checks it (``ValueError`` when malformed)."""
    if not entries:
        return ()
    return check_lineage([run for run, _ in entries], [start for _, start in entries])


def _state(arrays: dict[str, np.ndarray]) -> ServerState:
    state = ServerState()
    for name, value in arrays.items():
        kind, _, rest = name.partition("/")
        if kind == "shared":
            section, key = rest.split("/", 1)
            state.shared.setdefault(section, {})[key] = value
        elif kind == "personal":
            section, pid, key = rest.split("/", 2)
            state.personal.setdefault(section, {}).setdefault(int(pid), {})[key] = value
        else:
            raise ValueError(f"array '{name}' is neither shared/... nor personal/...")
    return state


# Format 1's per-partition groups, and the sections the methods keep them in now.
_FORMAT_1_PERSONAL = {"head": "head", "client-extractor": "extractor", "anchors": "anchors",
                      "posterior-scale": "scale"}


def _format_1_state(arrays: dict[str, np.ndarray]) -> ServerState:
    """A format-1 checkpoint's fields as the sections the methods keep: the extractor and the
    global head (FedAvg's, pFedVEM's prior mean) shared, the centroids shared as ``centroids``
    (values and mask; a method that keeps none drops them on restore), heads, Local-only's
    extractors, FedCCFA's anchors and pFedVEM's scales per partition."""
    state = ServerState()
    state.shared["extractor"] = {k.removeprefix("extractor/"): v for k, v in arrays.items()
                                 if k.startswith("extractor/")}
    head = {k.removeprefix("global-head/"): v for k, v in arrays.items() if k.startswith("global-head/")}
    if head:
        state.shared["head"] = head
    state.shared["centroids"] = {p.CENTROID_VALUES: arrays["centroids"].astype(np.float32),
                                 p.CENTROID_MASK: arrays["centroid_mask"].astype(bool)}
    for name, value in arrays.items():
        group, _, rest = name.partition("/")
        if group in _FORMAT_1_PERSONAL:
            pid, key = rest.split("/", 1)
            if group == "anchors":  # values, mask
                key = p.CENTROID_VALUES if key == "values" else p.CENTROID_MASK
                value = value.astype(np.float32) if key == p.CENTROID_VALUES else value.astype(bool)
            state.personal.setdefault(_FORMAT_1_PERSONAL[group], {}).setdefault(int(pid), {})[key] = value
    return state
