"""Extractor averaging by samples (eq. 18), centroids by class counts (eq. 19), and every head rule
of a round (the methods' server steps): clustered (FedCCFA), confidence-weighted (pFedVEM)."""

import numpy as np
import pytest

from common import protocol as p
from common.methods.fedccfa.clustering import Clustering, _head_keys, clustered_heads
from common.methods.fedpac.centroids import aggregate_centroids
from common.averaging import weighted_average
from common.config import FedPACConfig
from common.methods import METHODS
from common.methods.fedccfa.server import ANCHORS
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import EXTRACTOR, HEAD, Update, server_part
from common.validation import InvalidReply
from server_app.replies import _parse_statistics


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


def _server(name, extractor, head, **settings):
    """The server part of method ``name``, its knobs from a run config with ``settings``."""
    return server_part(METHODS[name], FedPACConfig(strategy=name, **settings), extractor, head)


def _checked(server, partition_id, extractor, head, num_examples, statistics, metrics=None):
    """A client's update as the strategy hands it to the step: checked by the method's part."""
    return server.check(Update(partition_id=partition_id, extractor=extractor, head=head,
                               num_examples=num_examples, metrics=metrics or {}, statistics=statistics))


def test_a_fedccfa_round_returns_the_clusters_with_the_merged_heads():
    """The clusters (labels, merged anchors) go back to the clients as their anchors: a round
    that loses them would leave feature alignment without targets."""
    heads, balanced, anchors, counts = _two_concepts()
    rng = np.random.default_rng(1)
    extractors = [{"w": rng.normal(size=(2, 2))} for _ in heads]
    server = _server("fedccfa", extractors[0], heads[0], cluster_eps=0.1)
    n = counts.sum(axis=1)  # the class counts sum to the reply's num-examples
    updates = [
        _checked(server, i, extractors[i], heads[i], int(n[i]), {
            p.CENTROID_VALUES: anchors[i], p.CLASS_COUNTS: counts[i],
            p.BALANCED_WEIGHT: balanced[i]["head.weight"], p.BALANCED_BIAS: balanced[i]["head.bias"]})
        for i in range(len(heads))
    ]
    weights = np.array([1.0, 2.0, 3.0, 4.0])
    state = server.initial_state()
    step = server.step(state, updates, weights, 1)
    # the step scales each client's class counts by its weight over its n_i (a capped client's shrink)
    merged, clusters = clustered_heads(heads, balanced, anchors, counts * (weights / n)[:, None],
                                       Clustering(eps=0.1))
    assert step.record["cluster_partitions"] == [0, 1, 2, 3]
    np.testing.assert_array_equal(step.record["clusters"], clusters.labels)
    for i in range(len(heads)):
        np.testing.assert_allclose(state.personal[ANCHORS][i][p.CENTROID_VALUES], clusters.anchors[i])
        np.testing.assert_array_equal(state.personal[ANCHORS][i][p.CENTROID_MASK], clusters.anchor_mask[i])
    assert sorted(state.personal[HEAD]) == [0, 1, 2, 3]
    for i, expected in enumerate(merged):
        np.testing.assert_allclose(state.personal[HEAD][i]["head.weight"], expected["head.weight"])
    np.testing.assert_allclose(state.shared[EXTRACTOR]["w"], weighted_average(extractors, weights)["w"])


def _pfedvem_updates(server, extractors, heads, rhos, num_examples):
    """pFedVEM replies: each client's posterior mean (as its head; its scales stay at the site) and its rho."""
    return [
        _checked(server, i, extractors[i], heads[i], int(num_examples[i]), {},
                 {p.RHO: rhos[i], p.LOCAL_ACCURACY: 0.5})
        for i in range(len(heads))
    ]


def _pfedvem_round(extractors, heads, rhos, num_examples, sample, previous_extractor, previous_head):
    """One pFedVEM server step over the replies (partition-ids 0, 1, ...) with S_t = ``sample``,
    from the base ``previous_extractor`` and the prior mean ``previous_head``."""
    server = _server("pfedvem", previous_extractor, previous_head)
    server.sample = sample
    state = server.initial_state()
    state.shared[EXTRACTOR], state.shared[HEAD] = previous_extractor, previous_head
    updates = _pfedvem_updates(server, extractors, heads, rhos, num_examples)
    step = server.step(state, updates, np.asarray(num_examples, dtype=np.float64), 1)
    return state, step


def test_a_pfedvem_round_averages_the_sampled_extractors_by_samples_and_heads_by_confidence():
    """theta^{t+1}: the sample-weighted mean of the extractors in S_t; w^{t+1}: their heads
    weighted by 1 / rho^2; a reply outside S_t enters neither mean but keeps its own head."""
    rng = np.random.default_rng(2)
    heads = [_linear_head(rng) for _ in range(3)]
    extractors = [{"w": rng.normal(size=(2, 2)).astype(np.float32)} for _ in range(3)]
    previous_extractor = {"w": np.zeros((2, 2), np.float32)}
    previous_head = {key: np.zeros_like(value) for key, value in heads[0].items()}
    state, step = _pfedvem_round(extractors, heads, [0.5, 2.0, 1.0], [10.0, 30.0, 60.0], [0, 1],
                                 previous_extractor, previous_head)
    assert step.record["aggregated"] == [0, 1] and step.record["sampled"] == [0, 1]
    np.testing.assert_allclose(state.shared[EXTRACTOR]["w"], (10 * extractors[0]["w"] + 30 * extractors[1]["w"]) / 40,
                               rtol=1e-6)
    tau = np.array([1 / 0.5**2, 1 / 2.0**2])
    for key in ("head.weight", "head.bias"):
        expected = (tau[0] * heads[0][key] + tau[1] * heads[1][key]) / tau.sum()
        np.testing.assert_allclose(state.shared[HEAD][key], expected, rtol=1e-6)
    assert sorted(state.personal[HEAD]) == [0, 1, 2]
    for pid, sent in enumerate(heads):
        np.testing.assert_array_equal(state.personal[HEAD][pid]["head.weight"], sent["head.weight"])
    # no centroids and no collaboration: neither a centroid section nor alpha in the record
    assert CENTROIDS not in state.shared and "alpha" not in step.record


def test_a_fedpac_round_keeps_the_centroid_of_a_class_no_reply_has():
    """A class absent from this round's replies keeps its previous global centroid, and stays
    marked as having one: the clients go on aligning to it."""
    rng = np.random.default_rng(3)
    heads = [_linear_head(rng, num_classes=3) for _ in range(2)]
    extractors = [{"w": rng.normal(size=(2, 2))} for _ in heads]
    local = rng.normal(size=(2, 3, 4))
    counts = np.array([[5.0, 2.0, 0.0], [1.0, 3.0, 0.0]])  # nobody has class 2 this round
    previous = rng.normal(size=(3, 4)).astype(np.float32)
    server = _server("fedpac-align", extractors[0], heads[0])
    n = np.array([7.0, 4.0])
    updates = [_checked(server, i, extractors[i], heads[i], int(n[i]),
                        {p.CENTROID_VALUES: local[i], p.CLASS_COUNTS: counts[i]}) for i in range(2)]
    state = server.initial_state()
    state.shared[CENTROIDS] = {p.CENTROID_VALUES: previous, p.CENTROID_MASK: np.array([False, False, True])}
    server.step(state, updates, n, 1)
    np.testing.assert_array_equal(state.shared[CENTROIDS][p.CENTROID_MASK], [True, True, True])
    np.testing.assert_array_equal(state.shared[CENTROIDS][p.CENTROID_VALUES][2], previous[2])


def test_mixing_heads_without_the_statistics_says_what_is_missing():
    rng = np.random.default_rng(4)
    heads = [_linear_head(rng) for _ in range(2)]
    server = _server("fedpac", {"w": np.ones(2)}, heads[0])
    statistics = {p.CENTROID_VALUES: np.zeros((2, 3)), p.CLASS_COUNTS: np.ones(2)}
    # h: a reply without it is refused before it reaches the step
    with pytest.raises(InvalidReply, match="lack 'h'"):
        _parse_statistics({p.STATISTICS: statistics}, server.statistics_shapes())
    # V: the method's check of the reply asks for it
    with pytest.raises(ValueError, match="'v'"):
        _checked(server, 0, {"w": np.ones(2)}, heads[0], 2, {**statistics, p.H: np.zeros((2, 3))})


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
    state, step = _pfedvem_round(extractors, heads, [0.5, 2.0], [10.0, 30.0], [],
                                 previous_extractor, previous_head)
    assert step.record["aggregated"] == []
    np.testing.assert_array_equal(state.shared[EXTRACTOR]["w"], previous_extractor["w"])
    for key, value in previous_head.items():
        np.testing.assert_array_equal(state.shared[HEAD][key], value)
    assert sorted(state.personal[HEAD]) == [0, 1]
    for pid, sent in enumerate(heads):
        np.testing.assert_array_equal(state.personal[HEAD][pid]["head.weight"], sent["head.weight"])


def test_the_global_centroids_come_back_in_the_models_float32_whatever_their_inputs():
    """The class-count-weighted mean is taken in float64 and handed out in float32, the dtype the
    clients align their features to, with or without previous centroids."""
    local = np.arange(12, dtype=np.float64).reshape(2, 3, 2) / 7
    counts = np.array([[1, 0, 2], [3, 0, 1]])
    for previous in (None, np.ones((3, 2), np.float32)):
        centroids, mask = aggregate_centroids(local, counts, previous, None if previous is None else np.ones(3, bool))
        assert centroids.dtype == np.float32 and mask.tolist() == [True, previous is not None, True]
        np.testing.assert_allclose(centroids[0], (local[0, 0] * 1 + local[1, 0] * 3) / 4, rtol=1e-6)
