"""FedPAC's chart: the clients' combination weights alpha (``alpha.png``, the paper's Figures
2-3). Server-side, like matplotlib (``experiments.summary`` draws the published runs' too)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from common import figures
from common.methods.outputs import ChartContext, RoundData


def has_alpha(rounds: Sequence[RoundData]) -> bool:
    return any(r.method.get("alpha") for r in rounds)


def alpha_chart(rounds: Sequence[RoundData], context: ChartContext, path: Path) -> None:
    """The latest round's combination weights."""
    latest = next(r for r in reversed(rounds) if r.method.get("alpha"))
    plot_alpha(latest.method["alpha"], latest.method["alpha_partitions"], latest.round, context.group_of, path)


def plot_alpha(  # pylint: disable=too-many-arguments
    alpha: list[list[float]],
    pids: list[int],
    round_number: int,
    group_of: Callable[[int], int],
    path: Path,
    title: str | None = None,
) -> None:
    """Heatmap of combination weights (row i: alpha_i over the heads of clients j), clients
    ordered by group so that the groups show as blocks (paper Fig. 2-3)."""
    order = sorted(range(len(pids)), key=lambda i: (group_of(pids[i]), pids[i]))
    matrix = np.asarray(alpha)[np.ix_(order, order)]
    labels = [f"{pids[i]} (g{group_of(pids[i])})" for i in order]
    size = max(4.0, 0.3 * len(pids) + 2)
    fig, ax = figures.new_figure(size + 1, size)
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(matrix.max(), 1e-9))
    fig.colorbar(image, ax=ax, label="alpha_ij")
    if len(pids) <= 40:
        ax.set_xticks(range(len(pids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(pids)), labels, fontsize=7)
    ax.set_xlabel("head of client j")
    ax.set_ylabel("client i")
    ax.set_title(title or f"combination weights, round {round_number}")
    figures.save_figure(fig, path)
