"""Distributed concept drift (FedCCFA's ``utils/drift.py``), stateless: label swaps by client.

Clients are grouped by ``partition_id mod 10``: ids {0,1,2} swap labels 1<->2 (concept 1), ids
{3,4,5} swap 3<->4 (concept 2), ids {6,7,8,9} swap 5<->6 (concept 3); concept 0 is the original
labelling. Classes 0, 7, 8, 9 never change.

Rounds: the paper's code counts rounds from 0 and a drift "at t" relabels the data from its
0-based round t on. Flower's server rounds are 1-based (r = t + 1), so a drift round t changes
the labels seen from server round ``t + 1`` on; server round 0 (before the first round) always
sees the original concept.

- ``sudden`` (t1): every client takes its group's swap for r > t1.
- ``recurrent`` (t1, t2): swapped for t1 < r <= t2, the original labels again for r > t2 (a swap
  is its own inverse: the official code simply applies it twice).
- ``incremental`` (t1, t2, t3): group {0,1,2} from r > t1, {3,4,5} from r > t2, {6..9} from
  r > t3.

The official code mutates the datasets in place; here the label map is a pure function of
(partition-id, server round, drift), so a stateless ClientApp and the server (for the
generalized test set) derive the same concept independently. Nothing here touches data.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

DEFAULT_DRIFT_ROUNDS: dict[str, tuple[int, ...]] = {
    "none": (),
    "sudden": (100,),
    "recurrent": (100, 150),
    "incremental": (100, 110, 120),
}
DRIFT_PATTERNS = tuple(DEFAULT_DRIFT_ROUNDS)
# concept id -> the two labels it swaps (concept 0 swaps nothing)
SWAPS: dict[int, tuple[int, int]] = {1: (1, 2), 2: (3, 4), 3: (5, 6)}
NUM_CONCEPTS = 1 + len(SWAPS)
# The swaps touch labels up to 6, so a drifting run needs at least 7 classes.
MIN_CLASSES = 1 + max(max(pair) for pair in SWAPS.values())


def parse_drift_rounds(text: str) -> tuple[int, ...] | None:
    """``drift-rounds``: ``()`` for an empty string, the rounds in order, or None when malformed."""
    if not text.strip():
        return ()
    try:
        rounds = tuple(int(part) for part in text.split(","))
    except ValueError:
        return None
    return rounds if all(r >= 0 for r in rounds) else None


@dataclass(frozen=True)
class Drift:
    """A drift pattern and its 0-based drift rounds (empty: the pattern's defaults)."""

    pattern: str = "none"
    rounds: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.pattern not in DEFAULT_DRIFT_ROUNDS:
            raise ValueError(
                f"unknown drift pattern {self.pattern!r}: must be one of "
                f"{', '.join(DRIFT_PATTERNS)}"
            )
        rounds = tuple(self.rounds)
        if not all(isinstance(r, (int, np.integer)) and not isinstance(r, bool) for r in rounds):
            raise ValueError(f"drift rounds must be integers, got {self.rounds!r}")
        object.__setattr__(self, "rounds", tuple(int(r) for r in rounds))
        if self.pattern == "none":
            if self.rounds:
                raise ValueError(
                    f"drift 'none' takes no drift rounds, got {self.rounds}: set drift to "
                    "sudden, recurrent or incremental, or leave drift-rounds empty"
                )
            return
        rounds = self.effective_rounds
        if any(r < 0 for r in rounds):
            raise ValueError(f"drift rounds must be >= 0, got {rounds}")
        expected = len(DEFAULT_DRIFT_ROUNDS[self.pattern])
        if len(rounds) != expected:
            raise ValueError(
                f"drift {self.pattern!r} needs exactly {expected} drift round(s), got "
                f"{len(rounds)}: {rounds}"
            )
        if self.pattern == "recurrent" and not rounds[0] < rounds[1]:
            raise ValueError(
                f"drift 'recurrent' needs two increasing rounds (drift, then return), got {rounds}"
            )
        if self.pattern == "incremental" and any(a > b for a, b in zip(rounds, rounds[1:])):
            raise ValueError(
                f"drift 'incremental' needs three non-decreasing rounds (ids 0-2, 3-5, 6-9), "
                f"got {rounds}"
            )

    @classmethod
    def from_config(cls, cfg: Any) -> "Drift":
        """The drift of a run config (``drift`` and ``drift-rounds``)."""
        rounds = parse_drift_rounds(cfg.drift_rounds)
        if rounds is None:
            raise ValueError(f"run config 'drift-rounds' = {cfg.drift_rounds!r} is invalid")
        return cls(cfg.drift, rounds)

    @classmethod
    def from_fields(cls, config: Mapping[str, Any]) -> "Drift":
        """The drift of a validated run config given as its fields (a checkpoint's or a run
        folder's config; absent fields at their defaults: no drift)."""
        return cls(str(config.get("drift", "none")), parse_drift_rounds(str(config.get("drift_rounds", ""))) or ())

    @property
    def effective_rounds(self) -> tuple[int, ...]:
        """The 0-based drift rounds in force: the given ones, or the pattern's defaults."""
        return self.rounds or DEFAULT_DRIFT_ROUNDS[self.pattern]

    @property
    def change_rounds(self) -> tuple[int, ...]:
        """The 1-based server rounds from which some client's concept changes (t + 1 each)."""
        return tuple(sorted({t + 1 for t in self.effective_rounds}))

    @property
    def active(self) -> bool:
        """Whether any label ever changes."""
        return self.pattern != "none"


# The run-config fields (validated, as a dict) that describe the drift.
DRIFT_FIELDS = ("drift", "drift_rounds")


def first_change(drift: Drift) -> int | None:
    """The first 1-based server round in which some client's labels differ from the original
    (None: they never do)."""
    return drift.change_rounds[0] if drift.active else None


def concepts_agree(a: Drift, b: Drift, server_rounds: int) -> bool:
    """Whether every client sees the same concept under ``a`` and ``b`` in server rounds
    1..``server_rounds``: the same drift, or two that change no label before then. A run under
    one can then continue the other's first ``server_rounds`` rounds exactly (the recurrent and
    incremental drifts of the paper share their first 100 rounds with the sudden one)."""
    if a.pattern == b.pattern and a.effective_rounds == b.effective_rounds:
        return True
    return all(change is None or server_rounds < change for change in (first_change(a), first_change(b)))


def drift_fields_free(saved: Mapping[str, Any], current: Mapping[str, Any], server_rounds: int) -> tuple[str, ...]:
    """The drift fields in which a run config ``current`` may differ from ``saved`` and still
    continue ``saved``'s first ``server_rounds`` rounds: all of them while the two drifts agree
    (:func:`concepts_agree`), none otherwise."""
    agree = concepts_agree(Drift.from_fields(saved), Drift.from_fields(current), server_rounds)
    return DRIFT_FIELDS if agree else ()


def group_concept(partition_id: int) -> int:
    """The swap (concept id 1, 2 or 3) of a client's group: ids mod 10 in {0-2}, {3-5}, {6-9}."""
    if partition_id < 0:
        raise ValueError(f"partition-id must be >= 0, got {partition_id}")
    member = partition_id % 10
    return 1 if member < 3 else 2 if member < 6 else 3


def concept(partition_id: int, server_round: int, drift: Drift) -> int:
    """0 = the original labels, otherwise the swap group g in {1,2,3} in force for this client in
    this (1-based) server round."""
    group = group_concept(partition_id)
    if server_round < 0:
        raise ValueError(f"server round must be >= 0, got {server_round}")
    rounds = drift.effective_rounds
    if drift.pattern == "sudden":
        drifted = server_round > rounds[0]
    elif drift.pattern == "recurrent":
        drifted = rounds[0] < server_round <= rounds[1]
    elif drift.pattern == "incremental":
        drifted = server_round > rounds[group - 1]
    else:
        drifted = False
    return group if drifted else 0


def concept_map(concept_id: int, num_classes: int) -> np.ndarray:
    """(num_classes,) int64 permutation of a concept: new_label = map[old_label]."""
    if not 0 <= concept_id < NUM_CONCEPTS:
        raise ValueError(f"concept id must be in [0, {NUM_CONCEPTS}), got {concept_id}")
    if num_classes < 1:
        raise ValueError(f"num_classes must be >= 1, got {num_classes}")
    mapping = np.arange(num_classes, dtype=np.int64)
    if concept_id == 0:
        return mapping
    _require_classes(num_classes)
    a, b = SWAPS[concept_id]
    mapping[[a, b]] = mapping[[b, a]]
    return mapping


def label_map(partition_id: int, server_round: int, drift: Drift, num_classes: int) -> np.ndarray:
    """(num_classes,) int64 permutation in force for a client in a server round:
    new_label = map[old_label]."""
    if drift.active:
        _require_classes(num_classes)
    return concept_map(concept(partition_id, server_round, drift), num_classes)


def _require_classes(num_classes: int) -> None:
    if num_classes < MIN_CLASSES:
        raise ValueError(
            f"concept drift swaps labels 1<->2, 3<->4 and 5<->6, so it needs num-classes >= "
            f"{MIN_CLASSES}, got {num_classes}"
        )
