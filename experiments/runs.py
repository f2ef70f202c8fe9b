"""Reading run folders: what a cell's runs computed, which one finished and which one a cell
resumes from.

The runner's resume and the reports both read run folders (``<timestamp>-run<id>``, as the
ServerApp writes them: metrics.json, status.json, checkpoint.npz, final_state.npz); this module is
the one place that knows their layout.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from experiments.grid import Cell, same_computation

@dataclass(frozen=True)
class RunOutputs:
    """What one run folder (``<timestamp>-run<id>``) holds, as far as the runner cares."""

    directory: Path
    config: dict[str, Any]
    rounds: list[dict[str, Any]]  # metrics.json's per-round records
    written: float  # when metrics.json was last rewritten
    status: dict[str, Any] = field(default_factory=dict)  # status.json, when there is one

    @property
    def completed_rounds(self) -> int:
        return len(self.rounds)

    @property
    def finished(self) -> bool:
        """The run ended normally: its final state is written (only after the last round), or its
        status says so (an archived grid may leave out the final state of a run nothing continues)."""
        return (self.directory / "final_state.npz").is_file() or self.status.get("state") == "finished"

    @property
    def resumable(self) -> bool:
        return (self.directory / "checkpoint.npz").is_file()

    @property
    def continuable(self) -> bool:
        """A run the runner may continue: stopped (not finished) with a checkpoint, not stalled."""
        return self.resumable and not self.finished and not self.stalled

    @property
    def stalled(self) -> bool:
        """The run stopped because its federation stalled: its last rounds had too few training
        replies (in a simulation, workers killed for memory, say), and its checkpoint counts
        them as rounds, so an experiment must not continue from it."""
        return self.status.get("state") == "failed" and str(self.status.get("error", "")).startswith(
            "FederationStalled")

    @property
    def compute_seconds(self) -> float:
        """The run's rounds' wall time, summed (across resumes; start-up not included)."""
        return float(sum(float(r.get("seconds") or 0.0) for r in self.rounds))

    @property
    def final_accuracy(self) -> float:
        """The last round's mean personalized accuracy, in %."""
        return 100.0 * float(self.rounds[-1]["mean_accuracy"]) if self.rounds else math.nan

    @property
    def final_generalized_accuracy(self) -> float:
        """The last round's mean generalized accuracy, in %; NaN when that round did not measure it."""
        value = self.rounds[-1].get("mean_generalized_accuracy") if self.rounds else None
        return math.nan if value is None else 100.0 * float(value)

    def final(self, metric: str) -> float:
        """The last round's mean accuracy of ``metric`` (``experiments.grid.METRICS``), in %."""
        return self.final_generalized_accuracy if metric == "generalized" else self.final_accuracy

    def accuracy_curve(self) -> tuple[list[int], list[float]]:
        """(round, mean personalized accuracy in %) for every evaluated round."""
        points = [(r["round"], 100.0 * r["mean_accuracy"]) for r in self.rounds if _measured(r, "mean_accuracy")]
        return [p[0] for p in points], [p[1] for p in points]

    def generalized_curve(self) -> tuple[list[int], list[float]]:
        """(round, mean generalized accuracy in %) for the rounds that measured it."""
        points = [(r["round"], 100.0 * r["mean_generalized_accuracy"]) for r in self.rounds
                  if _measured(r, "mean_generalized_accuracy")]
        return [p[0] for p in points], [p[1] for p in points]


def _measured(record: dict[str, Any], mean: str) -> bool:
    """Whether a round record measured ``mean``: a round without replies has NaN there (a
    published rounds.csv writes nan, or leaves the generalized accuracy blank: None)."""
    value = record.get(mean)
    return value is not None and math.isfinite(value)


def read_run(directory: Path) -> RunOutputs | None:
    """A run folder's outputs, or None when it has no readable metrics.json (a run that died
    before its first round, or a foreign folder)."""
    path = directory / "metrics.json"
    try:
        document = json.loads(path.read_text())
        config, rounds, written = document["config"], document["rounds"], path.stat().st_mtime
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        status = json.loads((directory / "status.json").read_text())
    except (OSError, ValueError):
        status = {}
    return RunOutputs(directory, config, rounds, written, status if isinstance(status, dict) else {})


def _same_cell(config: dict[str, Any], cell: Cell) -> bool:
    return same_computation(config, cell.identity["config"])


def cell_runs(directory: Path, cell: Cell) -> list[RunOutputs]:
    """The runs in a cell's folder that computed exactly this cell, oldest first."""
    if not directory.is_dir():
        return []
    runs = (read_run(d) for d in directory.iterdir() if d.is_dir())
    return sorted((r for r in runs if r is not None and _same_cell(r.config, cell)), key=lambda r: r.written)


def finished_run(directory: Path, cell: Cell) -> RunOutputs | None:
    """The latest run of the cell with all its rounds and its final state, if any."""
    done = [r for r in cell_runs(directory, cell) if r.finished and r.completed_rounds >= cell.rounds]
    return done[-1] if done else None


def resume_point(directory: Path, cell: Cell) -> tuple[RunOutputs | None, list[RunOutputs]]:
    """The latest unfinished run of the cell that left a checkpoint (a stopped or crashed run),
    stalled runs excepted (:attr:`RunOutputs.stalled`): the run before them, if any, is
    resumed; and the stalled runs passed over for it (newer than it), oldest first."""
    runs = cell_runs(directory, cell)
    # a run with every round but no final state (stopped while writing it) resumes too: the
    # ServerApp then only writes the final state
    partial = [r for r in runs if r.continuable and 0 < r.completed_rounds <= cell.rounds]
    start = partial[-1] if partial else None
    return start, [r for r in runs if r.stalled and (start is None or r.written > start.written)]


def resumable_run(directory: Path, cell: Cell) -> RunOutputs | None:
    """The run a cell continues from (:func:`resume_point`), if any."""
    return resume_point(directory, cell)[0]


Results = dict[tuple[str, str, int], RunOutputs]  # (setting, method, seed) -> finished run
