"""FedCCFA's chart: the clusters of clients per class over the rounds (``clusters.png``)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
from matplotlib import colormaps

from common import figures
from common.methods.outputs import ChartContext, RoundData


def clusters_per_class(clusters: list[list[int]]) -> list[int]:
    """How many clusters each class has (absent clients, label -1, not counted)."""
    return [len({label for label in labels if label >= 0}) for labels in clusters]


def has_clusters(rounds: Sequence[RoundData]) -> bool:
    return any(r.method.get("clusters") for r in rounds)


def clusters_chart(records: Sequence[RoundData], context: ChartContext, path: Path) -> None:
    """Clusters per class over the rounds, one row per class and one column per round (a
    line per class over hundreds of rounds is unreadable): how the clients' concepts of
    each class split at a drift and merge again."""
    measured = [r for r in records if r.method.get("clusters")]
    num_classes, last = len(measured[-1].method["clusters"]), records[-1].round
    counts = np.full((num_classes, last), np.nan)
    for r in measured:
        counts[: len(r.method["clusters"]), r.round - 1] = clusters_per_class(r.method["clusters"])
    most = max(2, int(np.nanmax(counts)))
    fig, ax = figures.new_figure(6, 4)
    image = ax.imshow(counts, aspect="auto", interpolation="nearest", origin="lower",
                      extent=(0.5, last + 0.5, -0.5, num_classes - 0.5),
                      cmap=colormaps["viridis"].resampled(most), vmin=0.5, vmax=most + 0.5)
    fig.colorbar(image, ax=ax, ticks=range(1, most + 1), label="clusters")
    for change in context.drift_rounds:
        ax.axvline(change - 0.5, color="red", linestyle=":", alpha=0.9)
    ax.set_yticks(range(num_classes))
    ax.set_xlabel("round (red: concept drift)" if context.drift_rounds else "round")
    ax.set_ylabel("class")
    ax.set_title(f"{context.config.get('strategy', '')}: clusters of clients per class")
    figures.save_figure(fig, path)
