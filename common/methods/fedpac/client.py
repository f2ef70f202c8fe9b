"""FedPAC's local update (Section 4, Algorithm 1), and its ablations'.

The order matters and follows the paper: the statistics for the collaboration QP are taken with
the *received* extractor, then the head is trained with the extractor frozen, then the extractor
with the head frozen and features pulled towards the global class centroids, and finally the
local centroids are taken with the *trained* extractor.
"""

from __future__ import annotations

from functools import partial

import numpy as np
import torch

from common import privacy
from common import protocol as p
from common.config import FedPACConfig, alignment_weight
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.fedpac import FedPAC
from common.methods.fedpac.statistics import feature_statistics
from common.model import FedPACNet
from common.statistics import class_feature_sums, class_means
from common.training import (AlignmentTerm, alignment_targets, class_counts, to_numpy, train_extractor,
                             train_head)


def alignment_loss(
    features: torch.Tensor, labels: torch.Tensor, centroids: torch.Tensor, mask: torch.Tensor
) -> torch.Tensor:
    """(1/B) sum_{b: class has a centroid} (1/d) ||f(x_b) - c_{y_b}||^2 (eq. 3's regularizer).

    The centroids are constants; the gradient flows into ``features`` only. Samples whose class
    has no global centroid yet contribute zero but still count in the batch size B, as in the
    authors' MSE over the batch.
    """
    targets = centroids[labels]
    aligned = mask[labels].to(features.dtype)
    per_sample = (features - targets).square().mean(dim=1)
    return (per_sample * aligned).sum() / len(labels)


def head_variance_inflation(model: FedPACNet, cfg: FedPACConfig, num_samples: int) -> float:
    """How many times this site's DP-SGD inflates the variance of its head (1 without DP): the
    collaboration QP weighs the head as if trained on that many times fewer records."""
    site = privacy.active()
    if site is None:
        return 1.0
    return privacy.variance_inflation(site.settings, cfg.batch_size, num_samples,
                                      sum(t.numel() for t in model.head.parameters()))


class Routine(ClientRoutine):
    """FedPAC's round: statistics, head epoch(s), extractor epochs, centroids. Statistics only
    when the variant mixes heads; alignment and centroids only when it aligns with a weight
    above 0 (``FedPAC.aligns_at``)."""

    method: FedPAC

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        x, y = data.x, data.y
        num_classes = model.num_classes
        aligns = self.method.aligns_at(alignment_weight(cfg))
        before = None
        if self.method.collaborate:
            before = feature_statistics(class_feature_sums(model.extractor, x, y, num_classes))
        head_loss = train_head(model, x, y, cfg, generator)
        centroids, mask = alignment_targets(received.sections, x.device)
        alignment: AlignmentTerm | None = None
        if aligns and centroids is not None and mask is not None and bool(mask.any()):
            alignment = partial(alignment_loss, centroids=centroids, mask=mask)
        train_loss, align = train_extractor(model, x, y, cfg, generator, alignment, alignment_weight(cfg),
                                            with_head=cfg.head_with_extractor)

        statistics: p.NDArrays = {}
        if aligns:
            local_centroids = class_means(model.extractor, x, y, num_classes)
            statistics[p.CENTROID_VALUES] = to_numpy(local_centroids)
        if aligns or self.method.collaborate:  # n_ik weight centroids and define h_i's p_ik
            statistics[p.CLASS_COUNTS] = to_numpy(class_counts(y, num_classes)).astype(np.int64)
        metrics: dict[str, float] = {}
        if before is not None:
            statistics[p.H] = to_numpy(before.h.float())
            metrics[p.V] = before.v
            metrics[p.H_NOISE] = before.h_noise
            metrics[p.V_INFLATION] = head_variance_inflation(model, cfg, len(y))
        metrics["head-loss"] = head_loss
        if aligns:
            metrics["align-loss"] = align
        return ClientResult(num_examples=len(y), train_loss=train_loss, statistics=statistics, metrics=metrics,
                            for_server=(p.V, p.H_NOISE, p.V_INFLATION) if before is not None else ())
