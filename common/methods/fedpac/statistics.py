"""What a FedPAC client uploads for the collaboration QP (Section 4.2 and Appendix A.3 of the
paper): n_i, h_i and V_i, from the per-class feature sums of ``common.statistics``. Plain torch;
nothing here knows about Flower."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from common import privacy
from common.statistics import ClassFeatureSums


@dataclass(frozen=True)
class FeatureStatistics:
    """What a client uploads for the collaboration QP: n_i, h_i (K x d) and V_i."""

    num_samples: int
    h: torch.Tensor  # (K, d): [p_ik * mu_ik]_k
    v: float  # eq. 44 with Lambda = I


def feature_statistics(sums: ClassFeatureSums) -> FeatureStatistics:
    """h_i and V_i from the per-class sums.

    h_i = [p_ik mu_ik]_k and
    V_i = sum_k p_ik E[||z||^2 | y=k] - sum_k p_ik^2 ||mu_ik||^2 (eq. 44, Lambda = I).
    """
    n = sums.counts.sum()
    p = sums.counts / n
    mu = sums.class_means()
    h = p.unsqueeze(1) * mu
    # sum_k p_k E[||z||^2 | k] is simply the mean of ||z||^2 over all samples.
    v = sums.sq_norm_sums.sum() / n - (p.square() * mu.square().sum(dim=1)).sum()
    if privacy.active() is not None:  # noisy sums may give a V below 0, which no distribution has
        v = v.clamp(min=0.0)
    return FeatureStatistics(num_samples=int(n.item()), h=h, v=float(v.item()))
