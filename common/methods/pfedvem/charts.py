"""pFedVEM's chart: every client's confidence 1/rho^2 over the rounds (``confidence.png``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np

from common import figures
from common.methods.outputs import ChartContext, RoundData
from common.protocol import RHO


def has_confidences(rounds: Sequence[RoundData]) -> bool:
    return any(RHO in m for r in rounds for m in r.train.values())


def confidence_chart(records: Sequence[RoundData], context: ChartContext, path: Path) -> None:
    """Each client's confidence 1/rho^2 over the rounds (its weight in the prior mean), with the
    median over the clients; log scale when they span more than a decade."""
    per_round = [(r.round, {pid: 1.0 / m[RHO] ** 2 for pid, m in r.train.items() if RHO in m and m[RHO] > 0})
                 for r in records]
    per_round = [(t, confidences) for t, confidences in per_round if confidences]
    series: dict[int, list[tuple[int, float]]] = {}
    for t, confidences in per_round:
        for pid, confidence in confidences.items():
            series.setdefault(pid, []).append((t, confidence))
    fig, ax = figures.new_figure(6, 4)
    for points in series.values():
        ax.plot(*zip(*points), linewidth=0.8, alpha=0.5)
    ax.plot([t for t, _ in per_round], [float(np.median(list(c.values()))) for _, c in per_round],
            color="black", linewidth=2, label=f"median of {len(series)} clients")
    values = [v for _, confidences in per_round for v in confidences.values()]
    if values and max(values) > 10 * min(values):  # a log scale only where it spans decades
        ax.set_yscale("log")
    ax.set_xlabel("round")
    ax.set_ylabel("confidence 1 / rho^2")
    ax.set_title(f"{context.config.get('strategy', '')}: client confidences")
    ax.grid(alpha=0.3, which="both")
    ax.legend(loc="best")
    figures.save_figure(fig, path)
