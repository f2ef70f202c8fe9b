"""What a FedPAC client uploads for the collaboration QP (Section 4.2 and Appendix A.3 of the
paper): n_i, h_i and V_i, from the per-class feature sums of ``common.statistics``. Plain torch;
nothing here knows about Flower."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common.statistics import ClassFeatureSums


@dataclass(frozen=True)
class FeatureStatistics:
    """What a client uploads for the collaboration QP: n_i, h_i (K x d), V_i, and the expected
    squared norm of the noise in h_i (0 without DP)."""

    num_samples: int
    h: torch.Tensor  # (K, d): [p_ik * mu_ik]_k
    v: float  # eq. 44 with Lambda = I
    h_noise: float = 0.0  # E||h_i - noiseless h_i||^2


def feature_statistics(sums: ClassFeatureSums) -> FeatureStatistics:
    """h_i and V_i from the per-class sums.

    h_i = [p_ik mu_ik]_k and
    V_i = sum_k p_ik E[||z||^2 | y=k] - sum_k p_ik^2 ||mu_ik||^2 (eq. 44, Lambda = I).

    With DP, h_ik = p_ik mu_ik is the noisy class sum over n (zero for a class whose noisy count
    is 0), so every entry of h_i carries noise of variance (sigma / n)^2, sigma the sums' noise
    std: ``h_noise`` = (classes present) * d * (sigma / n)^2. The same noise inflates
    sum_k p_ik^2 ||mu_ik||^2 = ||h_i||^2 by h_noise on average, which V_i gets back (and V, a
    variance, is kept >= 0 where the noise of the sums of squares pushes it below).
    """
    n = sums.counts.sum()
    p = sums.counts / n
    mu = sums.class_means()
    h = p.unsqueeze(1) * mu
    present = int((sums.counts > 0).sum().item())
    h_noise = present * h.shape[1] * (sums.sums_noise_std / float(n.item())) ** 2
    # sum_k p_k E[||z||^2 | k] is simply the mean of ||z||^2 over all samples.
    v = sums.sq_norm_sums.sum() / n - (p.square() * mu.square().sum(dim=1)).sum()
    if sums.sums_noise_std > 0:
        v = (v + h_noise).clamp(min=0.0)
    return FeatureStatistics(num_samples=int(n.item()), h=h, v=float(v.item()), h_noise=h_noise)
