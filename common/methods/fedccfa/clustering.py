"""Server side of FedCCFA (Chen et al., NeurIPS 2024): class-level classifier clustering and merging.

For every class c the server clusters the clients' *balanced* class-c classifier rows with
DBSCAN on the MADD distance, then averages the *trained* rows and the local anchors (class
feature means) inside each cluster. A client's class-c row is phi_{k,c} = [W_k[c, :], b_k[c]].
DBSCAN with min_samples = 1 has no noise points, so it is single linkage and needs no sklearn.
Pure numpy; nothing here knows about Flower or torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

WEIGHTS = ("uniform", "label")


def head_rows(weight: np.ndarray, bias: np.ndarray) -> np.ndarray:
    """Class rows [W[c, :], b[c]] of a linear head: (..., K, d), (..., K) -> (..., K, d + 1)."""
    weight, bias = np.asarray(weight), np.asarray(bias)
    if weight.ndim < 2 or bias.shape != weight.shape[:-1]:
        raise ValueError(f"head weight {weight.shape} and bias {bias.shape} do not match")
    return np.concatenate([weight, bias[..., None].astype(weight.dtype)], axis=-1)


def rows_to_head(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Inverse of ``head_rows``: (..., K, d + 1) -> (weight (..., K, d), bias (..., K))."""
    rows = np.asarray(rows)
    if rows.ndim < 2 or rows.shape[-1] < 2:
        raise ValueError(f"head rows need shape (..., K, d + 1) with d >= 1, got {rows.shape}")
    # copies, not views: the caller serializes or stores them independently of ``rows``
    return rows[..., :-1].copy(), rows[..., -1].copy()


def cosine_matrix(vectors: np.ndarray) -> np.ndarray:
    """(m, p) -> (m, m) pairwise cosines; a zero-norm vector has cosine 0 with everything."""
    v = np.asarray(vectors, dtype=np.float64)
    norms = np.linalg.norm(v, axis=1)
    # the official code divides by the norm unguarded, so one all-zero row makes every
    # distance NaN and DBSCAN raises
    unit = np.divide(v, norms[:, None], out=np.zeros_like(v), where=norms[:, None] > 0)
    c = unit @ unit.T
    # BLAS need not return an exactly symmetric product; D must be exactly symmetric
    return (c + c.T) / 2


def madd_distances(vectors: np.ndarray) -> np.ndarray:
    """MADD: D(i, j) = 1/(m-2) sum_{q != i, j} |cos(v_i, v_q) - cos(v_j, v_q)|.

    ``vectors``: (m, p) with m >= 3 (for m < 3 no third point exists and the official code
    divides by zero). Returns (m, m), symmetric, zero diagonal, values in [0, 2].
    """
    v = np.asarray(vectors)
    if v.ndim != 2:
        raise ValueError(f"MADD needs an (m, p) array, got shape {v.shape}")
    m = len(v)
    if m < 3:
        raise ValueError(f"MADD needs at least 3 vectors, got {m}")
    c = cosine_matrix(v)
    distances = np.empty((m, m))
    diagonal = np.arange(m)
    # one row i at a time: O(m^2) memory instead of the (m, m, m) difference tensor
    for i in range(m):
        diff = np.abs(c[i][None, :] - c)  # diff[j, q] = |C[i, q] - C[j, q]|
        diff[:, i] = 0.0  # q != i
        diff[diagonal, diagonal] = 0.0  # q != j
        distances[i] = diff.sum(axis=1)
    distances /= m - 2
    # rows i and j sum the same terms in the same order, so this only removes the last ulp
    distances = np.minimum(distances, distances.T)
    np.fill_diagonal(distances, 0.0)
    return distances


def connected_components(distances: np.ndarray, eps: float) -> np.ndarray:
    """Labels of DBSCAN(eps, min_samples=1, metric="precomputed"), i.e. single linkage.

    Components of the graph with an edge wherever D(i, j) <= eps (either direction); labels
    0, 1, 2, ... numbered in order of each component's smallest member. Returns (m,) int64.
    """
    d = np.asarray(distances, dtype=np.float64)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"distances must be a square matrix, got shape {d.shape}")
    if np.isnan(d).any():
        raise ValueError("distances contain NaN")
    if not eps >= 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    adjacent = (d <= eps) | (d <= eps).T
    m = len(d)
    labels = np.full(m, -1, dtype=np.int64)
    next_label = 0
    # seeds in increasing order give the smallest-member numbering for free
    for seed in range(m):
        if labels[seed] >= 0:
            continue
        reached = np.zeros(m, dtype=bool)
        reached[seed] = True
        frontier = reached.copy()
        while frontier.any():
            neighbours = adjacent[frontier].any(axis=0)
            frontier = neighbours & ~reached
            reached |= neighbours
        labels[reached] = next_label
        next_label += 1
    return labels


@dataclass(frozen=True)
class ClassClusters:
    """One round's merged heads and anchors (row k = the k-th reply) and the clusters."""

    heads: np.ndarray  # (m, K, p) merged trained rows phi^_k[c], dtype of the trained rows
    anchors: np.ndarray  # (m, K, d) float32 merged anchors A_k[c]; zero where anchor_mask is False
    anchor_mask: np.ndarray  # (m, K) bool: A_k[c] exists
    labels: np.ndarray  # (K, m) int64 cluster of client k for class c; -1: class c absent on k


def _weighted_mean(values: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_j w_j values_j / sum_j w_j over axis 0, into a new array (never into ``values``)."""
    return np.tensordot(weights / weights.sum(), values, axes=1)


def cluster_and_merge(
    balanced_rows: np.ndarray,
    trained_rows: np.ndarray,
    anchors: np.ndarray,
    class_counts: np.ndarray,
    eps: float,
    weights: str = "uniform",
    clustered_anchors: bool = True,
) -> ClassClusters:
    """Class-level clustering (on ``balanced_rows``) and merging (of ``trained_rows``, anchors).

    ``balanced_rows``, ``trained_rows``: (m, K, p); ``anchors``: (m, K, d) local class feature
    means; ``class_counts``: (m, K) current label counts, 0 = class absent on that client.
    For each class, only the clients having it are clustered; with fewer than 3 of them MADD is
    undefined and each is its own singleton. A cluster of size >= 2 gets the mean (uniform, or
    weighted by the class counts with ``weights="label"``) of its members' trained rows and
    anchors; a singleton keeps its own. ``clustered_anchors=False`` gives every client the
    uniform mean of the class's anchors over all clients having it. Inputs are not modified.
    """
    if weights not in WEIGHTS:
        raise ValueError(f"weights must be one of {WEIGHTS}, got {weights!r}")
    balanced = np.asarray(balanced_rows, dtype=np.float64)
    trained_in = np.asarray(trained_rows)
    trained = trained_in.astype(np.float64)
    local = np.asarray(anchors, dtype=np.float64)
    counts = np.asarray(class_counts, dtype=np.float64)
    if balanced.ndim != 3 or balanced.shape != trained.shape:
        raise ValueError(f"balanced rows {balanced.shape} and trained rows {trained.shape} differ")
    m, num_classes, _ = balanced.shape
    if local.ndim != 3 or local.shape[:2] != (m, num_classes) or counts.shape != (m, num_classes):
        raise ValueError(
            f"anchors {local.shape} and class counts {counts.shape} do not match ({m}, {num_classes})"
        )
    for name, array in (("balanced rows", balanced), ("trained rows", trained), ("anchors", local)):
        # one NaN row would spread to every member of its cluster: refuse it here
        if not np.isfinite(array).all():
            raise ValueError(f"{name} are not all finite")
    if not (np.isfinite(counts).all() and (counts >= 0).all()):
        raise ValueError("class counts must be finite and non-negative")

    # fresh arrays: the official aggregate_protos accumulated into a client's own anchor tensor
    heads = trained.copy()
    merged_anchors = local.copy()
    present = counts > 0
    mask = present.copy()
    labels = np.full((num_classes, m), -1, dtype=np.int64)
    for c in range(num_classes):
        members = np.flatnonzero(present[:, c])
        if len(members) < 3:
            labels[c, members] = np.arange(len(members))
        else:
            labels[c, members] = connected_components(madd_distances(balanced[members, c]), eps)
        for label in np.unique(labels[c, members]):
            cluster = members[labels[c, members] == label]
            if len(cluster) < 2:
                continue  # a singleton keeps its own row and anchor
            w = counts[cluster, c] if weights == "label" else np.ones(len(cluster))
            heads[cluster, c] = _weighted_mean(trained[cluster, c], w)
            merged_anchors[cluster, c] = _weighted_mean(local[cluster, c], w)
        if not clustered_anchors and len(members) > 0:
            merged_anchors[:, c] = local[members, c].mean(axis=0)
            mask[:, c] = True
    # a reply's anchor for a class it does not have is meaningless: do not pass it on
    merged_anchors[~mask] = 0.0
    return ClassClusters(
        heads=heads.astype(trained_in.dtype),
        anchors=merged_anchors.astype(np.float32),
        anchor_mask=mask,
        labels=labels,
    )


def entropy_weight(class_counts: np.ndarray, gamma: float, fixed: float) -> float:
    """FedCCFA's alignment weight H(P_k(Y)) / gamma, or ``fixed`` (lambda) when gamma == 0.

    Natural-log entropy over the classes present: zero counts are skipped (the official code
    sums 0 * log 0 = NaN). All-zero counts give 0.0 (with gamma > 0).
    """
    if gamma == 0:
        return float(fixed)
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    counts = np.asarray(class_counts, dtype=np.float64)
    if counts.ndim != 1 or (counts < 0).any():
        raise ValueError("class counts must be a 1-D array of non-negative numbers")
    total = counts.sum()
    if total <= 0:
        return 0.0
    p = counts[counts > 0] / total
    return float(-(p * np.log(p)).sum() / gamma)


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
