"""FedCCFA's server math: MADD, DBSCAN (single linkage), class-level merging, alignment weight."""

from __future__ import annotations

import math

import numpy as np
import pytest

from common.methods.fedccfa.clustering import (
    cluster_and_merge,
    connected_components,
    entropy_weight,
    head_rows,
    madd_distances,
    rows_to_head,
)

# ---------------------------------------------------------------- references, straight from the definitions


def cos_ref(a: np.ndarray, b: np.ndarray) -> float:
    na, nb = np.linalg.norm(a), np.linalg.norm(b)
    return 0.0 if na == 0 or nb == 0 else float(a @ b / (na * nb))


def madd_ref(v: np.ndarray) -> np.ndarray:
    m = len(v)
    d = np.zeros((m, m))
    for i in range(m):
        for j in range(m):
            if i != j:
                terms = [abs(cos_ref(v[i], v[q]) - cos_ref(v[j], v[q])) for q in range(m) if q not in (i, j)]
                d[i, j] = sum(terms) / (m - 2)
    return d


def dbscan_ref(d: np.ndarray, eps: float) -> list[frozenset[int]]:
    """Textbook DBSCAN with min_samples = 1: every point is a core point, none is noise."""
    m = len(d)
    assigned: set[int] = set()
    clusters = []
    for p in range(m):
        if p in assigned:
            continue
        cluster, queue = {p}, [p]
        while queue:
            q = queue.pop()
            for r in range(m):
                if d[q, r] <= eps and r not in cluster:
                    cluster.add(r)
                    queue.append(r)
        assigned |= cluster
        clusters.append(frozenset(cluster))
    return clusters


def partition(labels: np.ndarray) -> set[frozenset[int]]:
    return {frozenset(np.flatnonzero(labels == label).tolist()) for label in np.unique(labels)}


def merge_ref(balanced, trained, anchors, counts, eps, weights="uniform", clustered_anchors=True):
    """cluster_and_merge, one client and one class at a time with the reference MADD and DBSCAN."""
    m, num_classes, _ = trained.shape
    heads = trained.astype(np.float64).copy()
    merged = np.zeros(anchors.shape)
    mask = np.zeros((m, num_classes), dtype=bool)
    groups = np.full((num_classes, m), -1)
    for c in range(num_classes):
        members = [k for k in range(m) if counts[k, c] > 0]
        if len(members) >= 3:
            clusters = dbscan_ref(madd_ref(balanced[members, c]), eps)
            clusters = [[members[i] for i in sorted(cl)] for cl in clusters]
        else:
            clusters = [[k] for k in members]
        for label, cluster in enumerate(clusters):
            w = [counts[j, c] if weights == "label" else 1.0 for j in cluster]
            for k in cluster:
                groups[c, k] = label
                mask[k, c] = True
                heads[k, c] = sum(wj * trained[j, c] for wj, j in zip(w, cluster)) / sum(w)
                merged[k, c] = sum(wj * anchors[j, c] for wj, j in zip(w, cluster)) / sum(w)
        if not clustered_anchors and members:
            merged[:, c] = sum(anchors[j, c] for j in members) / len(members)
            mask[:, c] = True
    return heads, merged, mask, groups


# ---------------------------------------------------------------- MADD


@pytest.mark.parametrize("m", [3, 4, 7, 15])
def test_madd_matches_the_definition(m):
    rng = np.random.default_rng(m)
    v = rng.normal(size=(m, 6))
    d = madd_distances(v)
    np.testing.assert_allclose(d, madd_ref(v), atol=1e-12)
    assert d.shape == (m, m)
    np.testing.assert_array_equal(d, d.T)
    np.testing.assert_array_equal(np.diag(d), 0.0)
    assert (d >= 0).all() and (d <= 2 + 1e-12).all()


def test_madd_is_scale_invariant():
    rng = np.random.default_rng(1)
    v = rng.normal(size=(6, 5))
    scaled = v * rng.uniform(0.01, 100.0, size=(6, 1))
    np.testing.assert_allclose(madd_distances(scaled), madd_distances(v), atol=1e-12)


def test_madd_with_a_zero_vector_is_finite_and_uses_cosine_zero():
    rng = np.random.default_rng(2)
    v = rng.normal(size=(5, 4))
    v[1] = 0.0
    d = madd_distances(v)
    assert np.isfinite(d).all()
    np.testing.assert_allclose(d, madd_ref(v), atol=1e-12)


def test_madd_needs_three_vectors():
    for m in (0, 1, 2):
        with pytest.raises(ValueError):
            madd_distances(np.ones((m, 3)))
    with pytest.raises(ValueError):
        madd_distances(np.ones(5))


# ---------------------------------------------------------------- DBSCAN = connected components


@pytest.mark.parametrize("seed", range(20))
def test_components_match_brute_force_dbscan(seed):
    rng = np.random.default_rng(seed)
    m = int(rng.integers(1, 16))
    d = rng.uniform(0, 1, size=(m, m))
    d = (d + d.T) / 2
    np.fill_diagonal(d, 0.0)
    eps = float(rng.choice([0.0, 0.05, 0.1, 0.2, 1.0]))
    labels = connected_components(d, eps)
    assert labels.dtype == np.int64 and labels.shape == (m,)
    assert partition(labels) == set(dbscan_ref(d, eps))
    # labels 0, 1, 2, ... in order of each component's smallest member
    first_seen = [int(labels[i]) for i in range(m) if labels[i] not in labels[:i]]
    assert first_seen == list(range(len(first_seen)))
    assert set(labels.tolist()) == set(range(len(first_seen)))


def test_components_are_single_linkage_chains_and_eps_is_inclusive():
    # 0 - 1 - 2 is a chain: 0 and 2 are far apart but in one component; 3 is alone
    d = np.array(
        [
            [0.0, 0.1, 0.9, 0.9],
            [0.1, 0.0, 0.1, 0.9],
            [0.9, 0.1, 0.0, 0.9],
            [0.9, 0.9, 0.9, 0.0],
        ]
    )
    assert connected_components(d, 0.1).tolist() == [0, 0, 0, 1]
    assert connected_components(d, 0.0999).tolist() == [0, 1, 2, 3]
    # a later-indexed component containing a small index is still numbered by its smallest member
    d2 = np.full((4, 4), 1.0)
    np.fill_diagonal(d2, 0.0)
    d2[1, 3] = d2[3, 1] = 0.0
    assert connected_components(d2, 0.5).tolist() == [0, 1, 2, 1]


def test_components_reject_bad_input():
    with pytest.raises(ValueError):
        connected_components(np.zeros((2, 3)), 0.1)
    with pytest.raises(ValueError):
        connected_components(np.array([[0.0, np.nan], [np.nan, 0.0]]), 0.1)
    with pytest.raises(ValueError):
        connected_components(np.zeros((2, 2)), -0.1)


# ---------------------------------------------------------------- cluster_and_merge


def near(direction: np.ndarray, n: int, rng: np.random.Generator, noise: float = 1e-3) -> np.ndarray:
    return direction + noise * rng.normal(size=(n, len(direction)))


@pytest.fixture
def round_data():
    """6 clients, 3 classes, rows of p = 5, anchors of d = 4.

    class 0: balanced rows of clients 0-2 near e0, of 3-5 near e1 (two concepts);
    class 1: clients 0-4 near e0, client 5 near e1 (a singleton);
    class 2: absent on client 2, all others near e0 (one cluster of 5).
    Trained rows and anchors are random: clustering them would give other groups.
    """
    rng = np.random.default_rng(0)
    e = np.eye(5)
    balanced = np.zeros((6, 3, 5))
    balanced[:3, 0], balanced[3:, 0] = near(e[0], 3, rng), near(e[1], 3, rng)
    balanced[:5, 1], balanced[5:, 1] = near(e[0], 5, rng), near(e[1], 1, rng)
    balanced[:, 2] = near(e[0], 6, rng)
    trained = rng.normal(size=(6, 3, 5)).astype(np.float32)
    anchors = rng.normal(size=(6, 3, 4)).astype(np.float32)
    counts = rng.integers(1, 50, size=(6, 3))
    counts[2, 2] = 0
    # an absent class's values must not reach anyone: make them impossible to miss
    trained[2, 2] = 1000.0
    anchors[2, 2] = 1000.0
    return balanced, trained, anchors, counts


def test_two_concepts_give_two_clusters_merging_trained_rows(round_data):
    balanced, trained, anchors, counts = round_data
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert out.labels.tolist()[0] == [0, 0, 0, 1, 1, 1]
    for group in ([0, 1, 2], [3, 4, 5]):
        for k in group:
            # the trained rows are merged, not the balanced ones that were clustered
            np.testing.assert_allclose(out.heads[k, 0], trained[group, 0].mean(axis=0), rtol=1e-6)
            np.testing.assert_allclose(out.anchors[k, 0], anchors[group, 0].mean(axis=0), rtol=1e-6)
    assert out.anchor_mask[:, 0].all()
    assert out.heads.dtype == np.float32 and out.anchors.dtype == np.float32
    assert out.labels.dtype == np.int64 and out.anchor_mask.dtype == bool


def test_singleton_keeps_its_own_row_and_anchor(round_data):
    balanced, trained, anchors, counts = round_data
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert out.labels.tolist()[1] == [0, 0, 0, 0, 0, 1]
    np.testing.assert_array_equal(out.heads[5, 1], trained[5, 1])
    np.testing.assert_array_equal(out.anchors[5, 1], anchors[5, 1])
    np.testing.assert_allclose(out.heads[0, 1], trained[:5, 1].mean(axis=0), rtol=1e-6)


def test_absent_class_is_left_out_of_clustering_and_means(round_data):
    balanced, trained, anchors, counts = round_data
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert out.labels.tolist()[2] == [0, 0, -1, 0, 0, 0]
    others = [0, 1, 3, 4, 5]
    for k in others:
        np.testing.assert_allclose(out.heads[k, 2], trained[others, 2].mean(axis=0), rtol=1e-6)
        np.testing.assert_allclose(out.anchors[k, 2], anchors[others, 2].mean(axis=0), rtol=1e-6)
    np.testing.assert_array_equal(out.heads[2, 2], trained[2, 2])  # its own row, unmerged
    assert not out.anchor_mask[2, 2] and out.anchor_mask[others, 2].all()
    np.testing.assert_array_equal(out.anchors[2, 2], 0.0)


def test_fewer_than_three_participants_merge_nothing():
    rng = np.random.default_rng(3)
    balanced = np.ones((4, 1, 3))  # identical: they would be one cluster if MADD applied
    trained = rng.normal(size=(4, 1, 3))
    anchors = rng.normal(size=(4, 1, 2))
    counts = np.array([[5], [0], [7], [0]])
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert out.labels.tolist() == [[0, -1, 1, -1]]
    np.testing.assert_array_equal(out.heads, trained)
    np.testing.assert_allclose(out.anchors[[0, 2]], anchors[[0, 2]].astype(np.float32))
    assert out.anchor_mask[:, 0].tolist() == [True, False, True, False]


def test_label_weights_give_the_count_weighted_mean(round_data):
    balanced, trained, anchors, counts = round_data
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1, weights="label")
    group, w = [3, 4, 5], counts[[3, 4, 5], 0].astype(np.float64)
    expected_head = (w[:, None] * trained[group, 0]).sum(axis=0) / w.sum()
    expected_anchor = (w[:, None] * anchors[group, 0]).sum(axis=0) / w.sum()
    for k in group:
        np.testing.assert_allclose(out.heads[k, 0], expected_head, rtol=1e-5)
        np.testing.assert_allclose(out.anchors[k, 0], expected_anchor, rtol=1e-5)
    uniform = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert not np.allclose(out.heads[3, 0], uniform.heads[3, 0])


def test_global_anchors_ablation_uses_the_round_mean(round_data):
    balanced, trained, anchors, counts = round_data
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1, clustered_anchors=False)
    clustered = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    np.testing.assert_array_equal(out.heads, clustered.heads)  # heads are still merged by cluster
    np.testing.assert_array_equal(out.labels, clustered.labels)
    for c, participants in ((0, range(6)), (1, range(6)), (2, [0, 1, 3, 4, 5])):
        mean = anchors[list(participants), c].mean(axis=0)
        for k in range(6):  # the absent client 2 gets the class-2 mean too
            np.testing.assert_allclose(out.anchors[k, c], mean, rtol=1e-6)
    assert out.anchor_mask.all()


def test_global_anchors_ablation_class_nobody_has():
    counts = np.array([[3, 0], [4, 0], [5, 0]])
    anchors = np.ones((3, 2, 2))
    out = cluster_and_merge(np.ones((3, 2, 3)), np.ones((3, 2, 3)), anchors, counts, 0.1, clustered_anchors=False)
    assert out.anchor_mask[:, 0].all() and not out.anchor_mask[:, 1].any()
    assert (out.labels[1] == -1).all()


def test_inputs_are_not_modified(round_data):
    copies = [a.copy() for a in round_data]
    for weights in ("uniform", "label"):
        for clustered in (True, False):
            out = cluster_and_merge(*round_data, eps=0.1, weights=weights, clustered_anchors=clustered)
            for array in round_data:
                for result in (out.heads, out.anchors):
                    assert not np.shares_memory(array, result)
    for before, after in zip(copies, round_data):
        np.testing.assert_array_equal(before, after)


def test_zero_balanced_row_gives_no_nan(round_data):
    balanced, trained, anchors, counts = round_data
    balanced = balanced.copy()
    balanced[0, 0] = 0.0
    out = cluster_and_merge(balanced, trained, anchors, counts, eps=0.1)
    assert np.isfinite(out.heads).all() and np.isfinite(out.anchors).all()
    assert out.labels[0, 0] >= 0


@pytest.mark.parametrize("seed", range(8))
def test_cluster_and_merge_matches_reference_on_random_rounds(seed):
    rng = np.random.default_rng(100 + seed)
    m, num_classes = int(rng.integers(1, 9)), 3
    directions = np.eye(4)[rng.integers(0, 3, size=(m, num_classes))]  # up to 3 concepts per class
    balanced = directions + 0.05 * rng.normal(size=(m, num_classes, 4))
    trained = rng.normal(size=(m, num_classes, 4))
    anchors = rng.normal(size=(m, num_classes, 3))
    counts = rng.integers(0, 4, size=(m, num_classes))  # many absent classes
    for weights in ("uniform", "label"):
        for clustered in (True, False):
            out = cluster_and_merge(balanced, trained, anchors, counts, 0.1, weights, clustered)
            heads, merged, mask, labels = merge_ref(balanced, trained, anchors, counts, 0.1, weights, clustered)
            np.testing.assert_allclose(out.heads, heads, atol=1e-12)
            np.testing.assert_allclose(out.anchors, merged, rtol=1e-6, atol=1e-6)
            np.testing.assert_array_equal(out.anchor_mask, mask)
            np.testing.assert_array_equal(out.labels, labels)


def test_cluster_and_merge_rejects_bad_input(round_data):
    balanced, trained, anchors, counts = round_data
    with pytest.raises(ValueError):
        cluster_and_merge(balanced, trained, anchors, counts, 0.1, weights="clients")
    with pytest.raises(ValueError):
        cluster_and_merge(balanced[:, :2], trained, anchors, counts, 0.1)
    with pytest.raises(ValueError):
        cluster_and_merge(balanced, trained, anchors, counts[:, :2], 0.1)
    bad = trained.copy()
    bad[0, 0, 0] = np.nan
    with pytest.raises(ValueError):
        cluster_and_merge(balanced, bad, anchors, counts, 0.1)
    with pytest.raises(ValueError):
        cluster_and_merge(balanced, trained, anchors, -counts, 0.1)


def test_cluster_and_merge_rejects_anchors_without_a_feature_axis(round_data):
    """(m, K) anchors have the right leading shape but no feature axis: merged "anchors" of one
    number per class would reach the clients as their alignment targets."""
    balanced, trained, anchors, counts = round_data
    with pytest.raises(ValueError, match="anchors"):
        cluster_and_merge(balanced, trained, anchors[..., 0], counts, 0.1)
    with pytest.raises(ValueError, match="anchors"):
        cluster_and_merge(balanced, trained, anchors[:, :2], counts, 0.1)


# ---------------------------------------------------------------- head rows


def test_head_rows_round_trip():
    rng = np.random.default_rng(4)
    weight, bias = rng.normal(size=(10, 128)).astype(np.float32), rng.normal(size=10).astype(np.float32)
    rows = head_rows(weight, bias)
    assert rows.shape == (10, 129) and rows.dtype == np.float32
    np.testing.assert_array_equal(rows[3], np.append(weight[3], bias[3]))
    w2, b2 = rows_to_head(rows)
    np.testing.assert_array_equal(w2, weight)
    np.testing.assert_array_equal(b2, bias)
    assert not np.shares_memory(w2, rows) and not np.shares_memory(b2, rows)
    assert w2.flags.c_contiguous and b2.flags.c_contiguous
    # stacked over clients too
    stacked = head_rows(np.stack([weight, 2 * weight]), np.stack([bias, 2 * bias]))
    assert stacked.shape == (2, 10, 129)
    np.testing.assert_array_equal(rows_to_head(stacked)[1][1], 2 * bias)
    with pytest.raises(ValueError):
        head_rows(weight, bias[:9])


# ---------------------------------------------------------------- alignment weight


def test_entropy_weight():
    assert entropy_weight(np.full(10, 30), gamma=20, fixed=0.5) == pytest.approx(math.log(10) / 20)
    # absent classes are skipped, not 0 * log 0 = NaN
    assert entropy_weight(np.array([5, 0, 5, 0]), gamma=10, fixed=0.5) == pytest.approx(math.log(2) / 10)
    assert entropy_weight(np.array([0, 7, 0]), gamma=20, fixed=0.5) == 0.0
    assert entropy_weight(np.zeros(10), gamma=20, fixed=0.5) == 0.0
    assert entropy_weight(np.array([3, 1, 0]), gamma=0, fixed=0.1) == 0.1
    p = np.array([0.75, 0.25])
    assert entropy_weight(np.array([3, 1, 0]), gamma=2, fixed=0.1) == pytest.approx(-(p * np.log(p)).sum() / 2)
    with pytest.raises(ValueError):
        entropy_weight(np.array([1, 2]), gamma=-1, fixed=0.0)
