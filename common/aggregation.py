"""Server-side aggregation of FedPAC (eq. 18 and 19) and of its baselines: pure numpy, no Flower."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.collaboration import CollaborationResult, collaboration_weights, mix_heads
from common.methods import FEDPAC, Method, Rule


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
    averaged = {}
    for key, first in arrays[0].items():
        # accumulate client by client: no (m x size) stack, which is GBs at m = 1000
        total = np.zeros(first.shape, dtype=np.float64)
        for weight, array in zip(w, arrays):
            total += weight * array[key]
        averaged[key] = total.astype(first.dtype)
    return averaged


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
class RoundAggregate:
    """The server's new state after one round (rows/lists in the order of the inputs)."""

    extractor: dict[str, np.ndarray] | None  # the new global extractor; None: extractors stay local
    centroids: np.ndarray | None  # unchanged (the previous ones) without feature alignment
    centroid_mask: np.ndarray | None
    heads: list[dict[str, np.ndarray]]  # the head each input client gets (phi^_i for FedPAC)
    collaboration: CollaborationResult | None  # only when heads are mixed


def combine(
    rule: Rule,
    parts: list[dict[str, np.ndarray]],
    num_examples: np.ndarray,
    alpha: np.ndarray | None = None,
) -> list[dict[str, np.ndarray]]:
    """What each client gets back of one model part under ``rule``, in input order.

    AVERAGE: everyone the sample-weighted mean (eq. 18); MIX: row i of ``alpha`` applied to the
    parts (sum_j alpha_ij phi_j); LOCAL: its own part, untouched.
    """
    if rule is Rule.AVERAGE:
        average = weighted_average(parts, num_examples)
        return [average] * len(parts)
    if rule is Rule.MIX:
        if alpha is None:
            raise ValueError("mixing needs combination weights alpha")
        return mix_heads(parts, alpha)
    return [dict(part) for part in parts]


def aggregate_round(  # pylint: disable=too-many-arguments
    extractors: list[dict[str, np.ndarray]],
    heads: list[dict[str, np.ndarray]],
    local_centroids: np.ndarray | None,
    class_counts: np.ndarray | None,
    h: np.ndarray | None,
    v: np.ndarray | None,
    num_examples: np.ndarray,
    previous_centroids: np.ndarray | None = None,
    previous_mask: np.ndarray | None = None,
    alpha_threshold: float = 1e-3,
    solver: str = "vectorized",
    method: Method = FEDPAC,
) -> RoundAggregate:
    """One server step of ``method``; for FedPAC: eq. 18, eq. 19, and every client's
    collaboration QP + head mix. Inputs a method does not use may be ``None``."""
    centroids, mask = previous_centroids, previous_mask
    if method.needs_centroids:
        centroids, mask = aggregate_centroids(local_centroids, class_counts, previous_centroids, previous_mask)
    collaboration = None
    if method.head is Rule.MIX:
        collaboration = collaboration_weights(h, v, num_examples, alpha_threshold, solver)
    extractor = None
    if method.extractor is Rule.AVERAGE:
        extractor = weighted_average(extractors, num_examples)
    return RoundAggregate(
        extractor=extractor,
        centroids=centroids,
        centroid_mask=mask,
        heads=combine(method.head, heads, num_examples, None if collaboration is None else collaboration.alpha),
        collaboration=collaboration,
    )
