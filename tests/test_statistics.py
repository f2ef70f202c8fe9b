"""Feature statistics (h_i, V_i, centroids) against brute-force computations."""

import numpy as np
import pytest
import torch
from torch import nn

from common.methods.fedpac.statistics import feature_statistics
from common.statistics import class_feature_sums

K, D = 4, 6


def _tiny_extractor() -> nn.Module:
    torch.manual_seed(3)
    # float64 so that batching changes nothing beyond 1e-15 and the comparison can be tight
    return nn.Sequential(nn.Flatten(), nn.Linear(12, D), nn.LeakyReLU()).double()


def _data(labels: list[int]):
    torch.manual_seed(4)
    return torch.randn(len(labels), 3, 4, dtype=torch.float64), torch.tensor(labels)


def _brute_force(z: np.ndarray, y: np.ndarray):
    n = len(y)
    h = np.zeros((K, D))
    v_first, v_second = 0.0, 0.0
    for k in range(K):
        members = z[y == k]
        if len(members) == 0:
            continue
        p_k = len(members) / n
        mu_k = members.mean(axis=0)
        h[k] = p_k * mu_k
        v_first += p_k * np.mean([np.dot(row, row) for row in members])
        v_second += p_k**2 * np.dot(mu_k, mu_k)
    return h, v_first - v_second


@pytest.mark.parametrize("batch_size", [1, 3, 1024])
def test_h_and_v_match_brute_force(batch_size):
    labels = [0, 0, 1, 3, 3, 3, 1, 0, 3, 1, 1]  # class 2 absent
    x, y = _data(labels)
    extractor = _tiny_extractor()
    stats = feature_statistics(class_feature_sums(extractor, x, y, K, batch_size=batch_size))
    with torch.no_grad():
        z = extractor(x).double().numpy()
    h, v = _brute_force(z, y.numpy())
    assert stats.num_samples == len(labels)
    np.testing.assert_allclose(stats.h.numpy(), h, rtol=1e-10, atol=1e-12)
    assert stats.v == pytest.approx(v, rel=1e-10)
    assert np.all(stats.h.numpy()[2] == 0)


def test_centroids_are_class_means_with_counts():
    labels = [2, 2, 0, 2, 1]
    x, y = _data(labels)
    extractor = _tiny_extractor()
    sums = class_feature_sums(extractor, x, y, K)
    with torch.no_grad():
        z = extractor(x).double().numpy()
    np.testing.assert_array_equal(sums.counts.numpy(), [1, 1, 3, 0])
    means = sums.class_means().numpy()
    for k in (0, 1, 2):  # a class seen once is its one feature vector, one seen thrice their mean
        np.testing.assert_allclose(means[k], z[np.array(labels) == k].mean(axis=0), rtol=1e-12)
    assert np.all(means[3] == 0)


def test_statistics_use_eval_mode_and_restore_training_mode():
    extractor = nn.Sequential(nn.Flatten(), nn.Linear(12, D), nn.Dropout(0.9)).double()
    x, y = _data([0, 1, 2, 3] * 5)
    extractor.train()
    first = feature_statistics(class_feature_sums(extractor, x, y, K))
    second = feature_statistics(class_feature_sums(extractor, x, y, K))
    assert first.v == second.v  # dropout off: deterministic
    assert extractor.training


def test_v_is_non_negative_variance_like():
    x, y = _data([0, 1, 2, 3] * 10)
    stats = feature_statistics(class_feature_sums(_tiny_extractor(), x, y, K))
    assert stats.v >= 0
