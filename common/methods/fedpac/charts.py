"""FedPAC's chart: the clients' combination weights alpha (``alpha.png``, the paper's Figures
2-3). Server-side, like matplotlib (``experiments.summary`` draws the published runs' too)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from common import figures
from common.methods.outputs import ChartContext, RoundData


LABELLED_CLIENTS = 40  # beyond, one label per client is unreadable: the groups are labelled instead
MAX_INCHES = 12.0  # the largest side of the heatmap (a side grows 0.3 inch per client up to it)


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
    ordered by group so that the groups show as blocks (paper Fig. 2-3).

    Up to :data:`LABELLED_CLIENTS` clients every row and column is labelled; beyond, the figure
    stops growing and the groups are marked instead (a line between two, its name at its middle),
    so that a round of a thousand clients gives a figure of the same size as one of forty.
    """
    order = sorted(range(len(pids)), key=lambda i: (group_of(pids[i]), pids[i]))
    matrix = np.asarray(alpha)[np.ix_(order, order)]
    size = min(max(4.0, 0.3 * len(pids) + 2), MAX_INCHES)
    fig, ax = figures.new_figure(size + 1, size)
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(matrix.max(), 1e-9), interpolation="nearest")
    fig.colorbar(image, ax=ax, label="alpha_ij")
    if len(pids) <= LABELLED_CLIENTS:
        labels = [f"{pids[i]} (g{group_of(pids[i])})" for i in order]
        ax.set_xticks(range(len(pids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(pids)), labels, fontsize=7)
    else:
        _mark_groups(ax, [group_of(pids[i]) for i in order])
    ax.set_xlabel(f"head of client j ({len(pids)} clients)")
    ax.set_ylabel("client i")
    ax.set_title(title or f"combination weights, round {round_number}")
    figures.save_figure(fig, path)


def _mark_groups(ax, groups: list[int]) -> None:  # noqa: ANN001  (a matplotlib Axes)
    """Lines between the blocks of ``groups`` (sorted), and each group's name at its middle
    when there are few enough to read."""
    starts = [0, *(k for k in range(1, len(groups)) if groups[k] != groups[k - 1])]
    ends = [*starts[1:], len(groups)]
    for start in starts[1:]:
        ax.axhline(start - 0.5, color="white", linewidth=0.6)
        ax.axvline(start - 0.5, color="white", linewidth=0.6)
    if len(starts) <= LABELLED_CLIENTS:
        middles = [(start + end - 1) / 2 for start, end in zip(starts, ends)]
        names = [f"g{groups[start]}" for start in starts]
        ax.set_xticks(middles, names, rotation=90, fontsize=7)
        ax.set_yticks(middles, names, fontsize=7)
    else:
        ax.set_xticks([])
        ax.set_yticks([])
