"""Extractor averaging by samples (eq. 18), centroids by class counts (eq. 19), and every head rule
of a round: clustered (FedCCFA), confidence-weighted (pFedVEM)."""

import numpy as np
import pytest

from common.aggregation import Clustering, _head_keys, aggregate_centroids, aggregate_round, clustered_heads
from common.averaging import weighted_average
from common.methods import METHODS


def test_weighted_average_uses_sample_counts():
    models = [{"w": np.array([1.0, 2.0], dtype=np.float32)}, {"w": np.array([4.0, 8.0], dtype=np.float32)}]
    result = weighted_average(models, [100, 300])
    np.testing.assert_allclose(result["w"], [0.25 * 1 + 0.75 * 4, 0.25 * 2 + 0.75 * 8])
    assert result["w"].dtype == np.float32


def test_weighted_average_rejects_bad_weights():
    with pytest.raises(ValueError):
        weighted_average([{"w": np.ones(2)}], [0])
    with pytest.raises(ValueError):
        weighted_average([{"w": np.ones(2)}], [1, 2])


def test_centroids_weighted_by_class_counts_not_by_clients():
    local = np.array([[[0.0, 0.0], [1.0, 1.0]], [[3.0, 3.0], [9.0, 9.0]]])  # (m=2, K=2, d=2)
    counts = np.array([[1, 10], [3, 0]])
    centroids, mask = aggregate_centroids(local, counts)
    np.testing.assert_allclose(centroids[0], [(0 * 1 + 3 * 3) / 4] * 2)
    np.testing.assert_allclose(centroids[1], [1.0, 1.0])  # client 2 has no class-1 sample
    assert mask.tolist() == [True, True]


def test_absent_class_keeps_previous_centroid_or_stays_absent():
    local = np.array([[[2.0], [5.0], [7.0]]])
    counts = np.array([[4, 0, 0]])
    previous = np.array([[0.0], [-1.0], [0.0]])
    centroids, mask = aggregate_centroids(local, counts, previous, np.array([False, True, False]))
    np.testing.assert_allclose(centroids[:, 0], [2.0, -1.0, 0.0])
    assert mask.tolist() == [True, True, False]


def test_weights_whose_sum_overflows_still_average():
    # two weights of 1e308 sum to Inf: divided by that sum, every weight was 0 and the mean 0
    models = [{"w": np.array([1.0], dtype=np.float32)}, {"w": np.array([3.0], dtype=np.float32)},
              {"w": np.array([100.0], dtype=np.float32)}]
    result = weighted_average(models, [1e308, 1e308, 20])
    np.testing.assert_allclose(result["w"], [2.0])


@pytest.mark.parametrize("bad", [np.inf, np.nan])
def test_weighted_average_rejects_weights_that_are_not_finite(bad):
    with pytest.raises(ValueError, match="finite"):
        weighted_average([{"w": np.ones(2)}, {"w": np.zeros(2)}], [bad, 1.0])


# ---------------------------------------------------------------- heads by rule (pure unit tests)


def _linear_head(rng, num_classes=2, dim=3):
    # the bias first: the keys are told apart by rank, never by their order or names
    return {"head.bias": rng.normal(size=num_classes), "head.weight": rng.normal(size=(num_classes, dim))}


def test_head_keys_are_the_weight_and_the_bias_by_rank():
    head = {"b": np.zeros(2), "W": np.zeros((2, 3))}
    assert _head_keys(head) == ("W", "b")


@pytest.mark.parametrize("head", [
    # a third array: which 1-D one is the bias is ambiguous, so no silent guess
    {"head.weight": np.zeros((2, 3)), "head.bias": np.zeros(2), "head.bias_scale": np.zeros(2)},
    # two arrays, but no bias among them
    {"head.weight": np.zeros((2, 3)), "head.other": np.zeros((2, 3))},
])
def test_head_keys_reject_anything_but_one_weight_and_one_bias(head):
    with pytest.raises(ValueError, match="linear head"):
        _head_keys(head)


def _two_concepts(m=4, num_classes=2, dim=3, seed=0):
    """Class 0: balanced rows of clients 0-1 along e0 and of 2-3 along e1 (two concepts); class 1:
    everyone along e0 (one cluster). Trained heads are random, so clustering them would differ."""
    rng = np.random.default_rng(seed)
    balanced = []
    for k in range(m):
        weight = 1e-3 * rng.normal(size=(num_classes, dim))
        weight[0, 0 if k < 2 else 1] += 1.0
        weight[1, 0] += 1.0
        balanced.append({"head.bias": 1e-3 * rng.normal(size=num_classes), "head.weight": weight})
    heads = [_linear_head(rng, num_classes, dim) for _ in range(m)]
    anchors = rng.normal(size=(m, num_classes, 5))
    counts = rng.integers(1, 20, size=(m, num_classes)).astype(float)
    return heads, balanced, anchors, counts


def test_clustered_heads_merge_trained_heads_within_each_class_cluster():
    heads, balanced, anchors, counts = _two_concepts()
    merged, clusters = clustered_heads(heads, balanced, anchors, counts, Clustering(eps=0.1))
    np.testing.assert_array_equal(clusters.labels, [[0, 0, 1, 1], [0, 0, 0, 0]])
    weights = np.stack([head["head.weight"] for head in heads])
    biases = np.stack([head["head.bias"] for head in heads])
    for k, head in enumerate(merged):
        assert sorted(head) == ["head.bias", "head.weight"]
        group = [0, 1] if k < 2 else [2, 3]
        # class 0: the mean of the client's concept; class 1: the mean of everyone
        np.testing.assert_allclose(head["head.weight"][0], weights[group, 0].mean(axis=0))
        np.testing.assert_allclose(head["head.bias"][0], biases[group, 0].mean())
        np.testing.assert_allclose(head["head.weight"][1], weights[:, 1].mean(axis=0))
        np.testing.assert_allclose(head["head.bias"][1], biases[:, 1].mean())


def test_a_fedccfa_round_returns_the_clusters_with_the_merged_heads():
    """The clusters (labels, merged anchors) go back to the clients as their anchors: a round
    that loses them would leave feature alignment without targets."""
    heads, balanced, anchors, counts = _two_concepts()
    rng = np.random.default_rng(1)
    extractors = [{"w": rng.normal(size=(2, 2))} for _ in heads]
    result = aggregate_round(
        extractors=extractors, heads=heads, local_centroids=anchors, class_counts=counts, h=None, v=None,
        num_examples=np.array([1.0, 2.0, 3.0, 4.0]), method=METHODS["fedccfa"], balanced_heads=balanced,
        clustering=Clustering(eps=0.1),
    )
    merged, clusters = clustered_heads(heads, balanced, anchors, counts, Clustering(eps=0.1))
    assert result.clusters is not None
    np.testing.assert_array_equal(result.clusters.labels, clusters.labels)
    np.testing.assert_allclose(result.clusters.anchors, clusters.anchors)
    for got, expected in zip(result.heads, merged):
        np.testing.assert_allclose(got["head.weight"], expected["head.weight"])
    np.testing.assert_allclose(result.extractor["w"], weighted_average(extractors, [1.0, 2.0, 3.0, 4.0])["w"])


def test_a_pfedvem_round_averages_the_sampled_extractors_by_samples_and_heads_by_confidence():
    """theta^{t+1}: the sample-weighted mean of the extractors in S_t; w^{t+1}: their heads
    weighted by 1 / rho^2; a reply outside S_t enters neither mean but keeps its own head."""
    rng = np.random.default_rng(2)
    heads = [_linear_head(rng) for _ in range(3)]
    extractors = [{"w": rng.normal(size=(2, 2)).astype(np.float32)} for _ in range(3)]
    previous_extractor = {"w": np.zeros((2, 2), np.float32)}
    previous_head = {key: np.zeros_like(value) for key, value in heads[0].items()}
    result = aggregate_round(
        extractors=extractors, heads=heads, local_centroids=None, class_counts=None, h=None, v=None,
        num_examples=np.array([10.0, 30.0, 60.0]), method=METHODS["pfedvem"], rhos=[0.5, 2.0, 1.0],
        in_sample=[True, True, False], previous_extractor=previous_extractor, previous_head=previous_head,
    )
    assert result.aggregated == [0, 1]
    assert result.extractor is not None
    np.testing.assert_allclose(result.extractor["w"], (10 * extractors[0]["w"] + 30 * extractors[1]["w"]) / 40,
                               rtol=1e-6)
    tau = np.array([1 / 0.5**2, 1 / 2.0**2])
    for key in ("head.weight", "head.bias"):
        expected = (tau[0] * heads[0][key] + tau[1] * heads[1][key]) / tau.sum()
        np.testing.assert_allclose(result.global_head[key], expected, rtol=1e-6)
    for kept, sent in zip(result.heads, heads):
        np.testing.assert_array_equal(kept["head.weight"], sent["head.weight"])
    assert result.centroids is None and result.collaboration is None


def test_a_fedpac_round_keeps_the_centroid_of_a_class_no_reply_has():
    """A class absent from this round's replies keeps its previous global centroid, and stays
    marked as having one: the clients go on aligning to it."""
    rng = np.random.default_rng(3)
    heads = [_linear_head(rng, num_classes=3) for _ in range(2)]
    extractors = [{"w": rng.normal(size=(2, 2))} for _ in heads]
    local = rng.normal(size=(2, 3, 4))
    counts = np.array([[5.0, 2.0, 0.0], [1.0, 3.0, 0.0]])  # nobody has class 2 this round
    previous = rng.normal(size=(3, 4)).astype(np.float32)
    result = aggregate_round(
        extractors=extractors, heads=heads, local_centroids=local, class_counts=counts, h=None, v=None,
        num_examples=np.array([7.0, 4.0]), previous_centroids=previous,
        previous_mask=np.array([False, False, True]), method=METHODS["fedpac-align"],
    )
    np.testing.assert_array_equal(result.centroid_mask, [True, True, True])
    np.testing.assert_array_equal(result.centroids[2], previous[2])


def test_mixing_heads_without_the_statistics_says_what_is_missing():
    rng = np.random.default_rng(4)
    heads = [_linear_head(rng) for _ in range(2)]
    with pytest.raises(ValueError, match="h and V"):
        aggregate_round(extractors=[{"w": np.ones(2)}] * 2, heads=heads, local_centroids=np.zeros((2, 2, 3)),
                        class_counts=np.ones((2, 2)), h=None, v=None, num_examples=np.array([1.0, 1.0]),
                        method=METHODS["fedpac"])


def test_label_weighted_members_merge_by_their_class_counts():
    """``cluster-weights = label``: a cluster's merged row weights each member by its count of
    that class, not equally (the setting must reach the merge)."""
    heads, balanced, anchors, counts = _two_concepts()
    merged, _ = clustered_heads(heads, balanced, anchors, counts, Clustering(eps=0.1, weights="label"))
    weights = np.stack([head["head.weight"] for head in heads])
    everyone = counts[:, 1] / counts[:, 1].sum()  # class 1: one cluster of all four clients
    np.testing.assert_allclose(merged[0]["head.weight"][1], (everyone[:, None] * weights[:, 1]).sum(axis=0))
    uniform, _ = clustered_heads(heads, balanced, anchors, counts, Clustering(eps=0.1))
    assert not np.allclose(merged[0]["head.weight"][1], uniform[0]["head.weight"][1])


def test_a_pfedvem_round_without_a_reply_from_the_sample_keeps_the_prior_and_the_base():
    """No valid reply from S_t: w and theta stay as they were; the replies' posteriors are kept."""
    rng = np.random.default_rng(5)
    heads = [_linear_head(rng) for _ in range(2)]
    extractors = [{"w": rng.normal(size=(2, 2)).astype(np.float32)} for _ in range(2)]
    previous_extractor = {"w": rng.normal(size=(2, 2)).astype(np.float32)}
    previous_head = _linear_head(rng)
    result = aggregate_round(
        extractors=extractors, heads=heads, local_centroids=None, class_counts=None, h=None, v=None,
        num_examples=np.array([10.0, 30.0]), method=METHODS["pfedvem"], rhos=[0.5, 2.0],
        in_sample=[False, False], previous_extractor=previous_extractor, previous_head=previous_head,
    )
    assert result.aggregated == []
    np.testing.assert_array_equal(result.extractor["w"], previous_extractor["w"])
    for key, value in previous_head.items():
        np.testing.assert_array_equal(result.global_head[key], value)
