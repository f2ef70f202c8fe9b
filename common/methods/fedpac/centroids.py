"""FedPAC's global class centroids (eq. 19 of the paper): the server's half of feature alignment.
Pure numpy; nothing here knows about Flower or torch."""

from __future__ import annotations

import numpy as np


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
