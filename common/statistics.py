"""Per-class sums of a client's features, private when the site runs differential privacy.

Plain torch over an extractor and a client's tensors: no Flower. Several methods build on the
same batched pass: FedPAC's statistics for the collaboration QP (h_i, V_i, computed *before*
local training, ``common.methods.fedpac.statistics``) and its local class centroids (eq. 17,
computed *after*), FedCCFA's local anchors.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from common import privacy


@dataclass(frozen=True)
class ClassFeatureSums:
    """Sufficient statistics of the embeddings, per class, from one pass over the data."""

    counts: torch.Tensor  # (K,) float64, n_ik
    sums: torch.Tensor  # (K, d) float64, sum of z over class-k samples
    sq_norm_sums: torch.Tensor  # (K,) float64, sum of ||z||^2 over class-k samples
    # the standard deviation of the Gaussian noise on every entry of ``sums`` (0 without DP):
    # public, the statistics' noise multiplier times the feature clip
    sums_noise_std: float = 0.0

    @property
    def num_samples(self) -> int:
        return int(self.counts.sum().item())

    def class_means(self) -> torch.Tensor:
        """mu_ik: the mean embedding of each class, zero for an absent class."""
        return self.sums / self.counts.clamp(min=1.0).unsqueeze(1)


@torch.no_grad()
def class_feature_sums(
    extractor: nn.Module,
    images: torch.Tensor,
    labels: torch.Tensor,
    num_classes: int,
    batch_size: int = 1024,
    squares: bool = True,
) -> ClassFeatureSums:
    """One no-grad pass over (images, labels) in eval mode, accumulating per-class sums.

    Sums are accumulated in float64 on the data's device so that V (a difference of two
    similar magnitudes) keeps its precision.

    With differential privacy on at this site (``common.privacy``) each feature vector is first
    clipped to ``dp-feature-clip``, and the sums, the sums of squared norms and the counts are
    released through the Gaussian mechanism: everything computed from them is then private.
    ``squares = False`` leaves out the sums of squared norms (NaN), which only V needs: with DP
    they are then neither noised nor charged to the site's budget.
    """
    site = privacy.active()
    clip = site.settings.feature_clip if site is not None else None
    was_training = extractor.training
    extractor.eval()
    device = images.device
    counts = torch.zeros(num_classes, dtype=torch.float64, device=device)
    sq_norm_sums = torch.zeros(num_classes, dtype=torch.float64, device=device)
    sums: torch.Tensor | None = None
    for start in range(0, len(images), batch_size):
        z = extractor(images[start : start + batch_size]).to(torch.float64)
        if clip is not None:
            z = privacy.clip_features(z, clip)
        y = labels[start : start + batch_size]
        if sums is None:
            sums = torch.zeros(num_classes, z.shape[1], dtype=torch.float64, device=device)
        sums.index_add_(0, y, z)
        sq_norm_sums.index_add_(0, y, (z * z).sum(dim=1))
        counts.index_add_(0, y, torch.ones_like(y, dtype=torch.float64))
    extractor.train(was_training)
    if sums is None:
        raise ValueError("cannot compute feature statistics of an empty dataset")
    if not squares:
        sq_norm_sums = torch.full_like(sq_norm_sums, math.nan)
    if site is not None and clip is not None:
        return ClassFeatureSums(counts=privacy.private_counts(labels, num_classes, site),
                                sums=privacy.gaussian(sums, clip, site),
                                sq_norm_sums=privacy.gaussian(sq_norm_sums, clip * clip, site) if squares
                                else sq_norm_sums,
                                sums_noise_std=site.settings.statistics_noise_multiplier * clip)
    return ClassFeatureSums(counts=counts, sums=sums, sq_norm_sums=sq_norm_sums)


def class_means(extractor: nn.Module, images: torch.Tensor, labels: torch.Tensor, num_classes: int) -> torch.Tensor:
    """mu_ik for every class k (zero for an absent one), float32: FedPAC's local centroids
    (eq. 17) and FedCCFA's local anchors. With DP only the sums and the counts are released."""
    return class_feature_sums(extractor, images, labels, num_classes, squares=False).class_means().float()
