"""Server-side aggregation math the methods' server steps share or own: FedPAC's global class
centroids (eq. 19) and FedCCFA's clustered heads. Pure numpy, no Flower; the steps themselves are
in ``common/methods/<family>/server.py``."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.clustering import ClassClusters, cluster_and_merge, head_rows, rows_to_head


def aggregate_centroids(
    local_centroids: np.ndarray,
    class_counts: np.ndarray,
    previous: np.ndarray | None = None,
    previous_mask: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Count-weighted global class centroids (eq. 19).

    ``local_centroids``: (m, K, d); ``class_counts``: (m, K). A class no reply has samples of
    keeps its previous centroid (or stays absent). Returns (centroids (K, d), mask (K,) bool).
    """
    counts = np.asarray(class_counts, dtype=np.float64)
    totals = counts.sum(axis=0)
    present = totals > 0
    summed = np.einsum("mk,mkd->kd", counts, np.asarray(local_centroids, dtype=np.float64))
    centroids = np.zeros(summed.shape) if previous is None else np.array(previous, dtype=np.float64)
    mask = np.zeros(len(totals), dtype=bool) if previous_mask is None else np.array(previous_mask)
    centroids[present] = summed[present] / totals[present, None]
    return centroids.astype(np.float32), mask | present


@dataclass(frozen=True)
class Clustering:
    """FedCCFA's server-side settings (run config ``cluster-*``, ``clustered-anchors``)."""

    eps: float = 0.1
    weights: str = "uniform"
    clustered_anchors: bool = True


def clustered_heads(
    heads: list[dict[str, np.ndarray]],
    balanced_heads: list[dict[str, np.ndarray]],
    local_anchors: np.ndarray,
    class_counts: np.ndarray,
    settings: Clustering,
) -> tuple[list[dict[str, np.ndarray]], ClassClusters]:
    """FedCCFA's head step: cluster every class's balanced rows, merge the trained rows and the
    anchors within each cluster; returns each client's merged head and the clusters."""
    weight_key, bias_key = _head_keys(heads[0])

    def rows(parts: list[dict[str, np.ndarray]]) -> np.ndarray:
        return np.stack([head_rows(part[weight_key], part[bias_key]) for part in parts])

    clusters = cluster_and_merge(
        rows(balanced_heads), rows(heads), local_anchors, class_counts, settings.eps,
        weights=settings.weights, clustered_anchors=settings.clustered_anchors,
    )
    merged = []
    for row in clusters.heads:
        weight, bias = rows_to_head(row)
        merged.append({weight_key: weight, bias_key: bias})
    return merged, clusters


def _head_keys(head: dict[str, np.ndarray]) -> tuple[str, str]:
    """(weight key, bias key) of a linear head: its (K, d) and its (K,) array."""
    by_rank = {array.ndim: key for key, array in head.items()}
    if len(head) != 2 or set(by_rank) != {1, 2}:
        raise ValueError(f"a linear head has one (K, d) weight and one (K,) bias, got {sorted(head)}")
    return by_rank[2], by_rank[1]
