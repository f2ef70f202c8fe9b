"""Extractor averaging by samples (eq. 18) and centroids by class counts (eq. 19)."""

import numpy as np
import pytest

from common.aggregation import aggregate_centroids
from common.averaging import weighted_average


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
