"""Server-side aggregation of every method: FedPAC (eq. 18 and 19), its baselines, FedCCFA's
clustered heads, pFedVEM's confidence-weighted prior mean over the round's sample. Pure numpy,
no Flower."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.clustering import ClassClusters, cluster_and_merge, head_rows, rows_to_head
from common.averaging import weighted_average
from common.collaboration import CollaborationResult, collaboration_weights, mix_heads
from common.methods import FEDPAC, Alignment, Method, Rule
from common.variational import aggregate_sample


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
    clusters: ClassClusters | None = None  # only when heads are clustered: anchors, labels
    # Confidence-weighted heads (pFedVEM): the new prior mean w, and the input indices (in S_t,
    # usable) whose extractor and head entered the means
    global_head: dict[str, np.ndarray] | None = None
    aggregated: list[int] | None = None


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
    balanced_heads: list[dict[str, np.ndarray]] | None = None,
    clustering: Clustering = Clustering(),
    rhos: list[float] | None = None,
    in_sample: list[bool] | None = None,
    previous_extractor: dict[str, np.ndarray] | None = None,
    previous_head: dict[str, np.ndarray] | None = None,
) -> RoundAggregate:
    """One server step of ``method``; for FedPAC: eq. 18, eq. 19, and every client's
    collaboration QP + head mix; for FedCCFA: eq. 18 and the clustered heads and anchors; for
    pFedVEM: eq. 18 and the confidence-weighted prior mean over the replies ``in_sample`` (S_t),
    every client keeping its own posterior mean. Inputs a method does not use may be ``None``."""
    if method.head is Rule.CONFIDENCE:
        return _confidence_round(extractors, heads, rhos, num_examples, in_sample, previous_extractor, previous_head)
    centroids, mask = previous_centroids, previous_mask
    if method.alignment is Alignment.CENTROIDS:
        if local_centroids is None or class_counts is None:
            raise ValueError("feature alignment needs the local centroids and class counts")
        centroids, mask = aggregate_centroids(local_centroids, class_counts, previous_centroids, previous_mask)
    collaboration = None
    if method.head is Rule.MIX:
        if h is None or v is None:
            raise ValueError("classifier collaboration needs every client's h and V")
        collaboration = collaboration_weights(h, v, num_examples, alpha_threshold, solver)
    extractor = None
    if method.extractor is Rule.AVERAGE:
        extractor = weighted_average(extractors, num_examples)
    clusters = None
    if method.head is Rule.CLUSTER:
        if balanced_heads is None or local_centroids is None or class_counts is None:
            raise ValueError("clustered heads need the balanced heads, local anchors and class counts")
        # the local class means are FedCCFA's local anchors a_k
        new_heads, clusters = clustered_heads(heads, balanced_heads, local_centroids, class_counts, clustering)
    else:
        new_heads = combine(method.head, heads, num_examples, None if collaboration is None else collaboration.alpha)
    return RoundAggregate(
        extractor=extractor,
        centroids=centroids,
        centroid_mask=mask,
        heads=new_heads,
        collaboration=collaboration,
        clusters=clusters,
    )


def _confidence_round(  # pylint: disable=too-many-arguments
    extractors: list[dict[str, np.ndarray]],
    heads: list[dict[str, np.ndarray]],
    rhos: list[float] | None,
    num_examples: np.ndarray,
    in_sample: list[bool] | None,
    previous_extractor: dict[str, np.ndarray] | None,
    previous_head: dict[str, np.ndarray] | None,
) -> RoundAggregate:
    """pFedVEM's server step (``common.variational.aggregate_sample``) in this module's terms."""
    if rhos is None or in_sample is None or previous_extractor is None or previous_head is None:
        raise ValueError("confidence-weighted heads need every rho, the sample S_t and the previous state")
    weight_key, bias_key = _head_keys(previous_head)
    result = aggregate_sample(
        extractors, [h[weight_key] for h in heads], [h[bias_key] for h in heads], rhos, num_examples,
        in_sample, previous_extractor, (previous_head[weight_key], previous_head[bias_key]),
    )
    return RoundAggregate(
        extractor=result.extractor,
        centroids=None,
        centroid_mask=None,
        heads=combine(Rule.LOCAL, heads, num_examples),  # the posterior persists: never reset to w
        collaboration=None,
        global_head={weight_key: result.weight, bias_key: result.bias},
        aggregated=result.used,
    )
