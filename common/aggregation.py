"""Server-side aggregation of FedPAC (eq. 18 and 19): pure numpy, no Flower."""

from __future__ import annotations

import numpy as np


def weighted_average(
    arrays: list[dict[str, np.ndarray]], weights: list[float] | np.ndarray
) -> dict[str, np.ndarray]:
    """sum_i w_i theta_i / sum_i w_i, key by key (eq. 18 with w_i = n_i, in samples)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(arrays) == 0 or len(arrays) != len(w):
        raise ValueError(f"{len(arrays)} models but {len(w)} weights")
    if (w < 0).any() or w.sum() <= 0:
        raise ValueError("aggregation weights must be non-negative with a positive sum")
    w = w / w.sum()
    return {
        key: np.tensordot(w, np.stack([a[key] for a in arrays]).astype(np.float64), axes=1).astype(
            arrays[0][key].dtype
        )
        for key in arrays[0]
    }


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
