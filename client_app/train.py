"""FedPAC's local update on one client (Section 4, Algorithm 1), in plain PyTorch.

The order matters and follows the paper: statistics for the collaboration QP are taken with the
*received* extractor, then the head is trained with the extractor frozen, then the extractor
with the head frozen and features pulled towards the global class centroids, and finally the
local centroids are taken with the *trained* extractor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.config import FedPACConfig
from common.model import FedPACNet
from common.statistics import FeatureStatistics, class_feature_sums, feature_statistics


@dataclass(frozen=True)
class LocalUpdate:
    """What one round of local training produces (besides the trained model itself)."""

    statistics: FeatureStatistics  # before training, for the QP
    centroids: torch.Tensor  # (K, d) float32, after training (eq. 17)
    class_counts: torch.Tensor  # (K,) n_ik
    head_loss: float
    train_loss: float  # extractor epochs, CE + lambda * alignment
    align_loss: float


def _batches(num_samples: int, batch_size: int, generator: torch.Generator, device: torch.device):
    order = torch.randperm(num_samples, generator=generator).to(device)
    return order.split(batch_size)


def _autocast(x: torch.Tensor, cfg: FedPACConfig):
    """bfloat16 autocast when ``mixed-precision`` is on: no loss scaling needed, and the
    statistics and centroid passes stay in float32/float64 (they run outside it)."""
    return torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision)


def _sgd(params, lr: float, cfg: FedPACConfig) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


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


def train_head(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> float:
    """``head-epochs`` epochs of the head alone on frozen features; returns the mean CE."""
    if cfg.head_epochs == 0:
        return 0.0
    model.train()
    optimizer = _sgd(model.head.parameters(), cfg.head_lr, cfg)
    total, seen = torch.zeros((), device=x.device), 0
    for _ in range(cfg.head_epochs):
        for idx in _batches(len(x), cfg.batch_size, generator, x.device):
            with _autocast(x, cfg):
                with torch.no_grad():  # the extractor is frozen: no graph through it at all
                    features = model.extractor(x[idx])
                loss = F.cross_entropy(model.head(features).float(), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
            seen += len(idx)
    return float(total / seen)


def train_extractor(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    centroids: torch.Tensor,
    mask: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> tuple[float, float]:
    """``local-epochs`` epochs of the extractor with the head frozen (eq. 3).

    Returns the mean total loss and the mean alignment term over all batches.
    """
    model.train()
    model.head.requires_grad_(False)
    optimizer = _sgd(model.extractor.parameters(), cfg.extractor_lr, cfg)
    use_alignment = cfg.lambda_align > 0 and bool(mask.any())
    total = torch.zeros((), device=x.device)
    total_align = torch.zeros((), device=x.device)
    seen = 0
    try:
        for _ in range(cfg.local_epochs):
            for idx in _batches(len(x), cfg.batch_size, generator, x.device):
                with _autocast(x, cfg):
                    features = model.extractor(x[idx])
                    logits = model.head(features)
                loss = F.cross_entropy(logits.float(), y[idx])
                if use_alignment:
                    align = alignment_loss(features.float(), y[idx], centroids, mask)
                    loss = loss + cfg.lambda_align * align
                    total_align += align.detach() * len(idx)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                optimizer.step()
                total += loss.detach() * len(idx)
                seen += len(idx)
    finally:
        model.head.requires_grad_(True)
    return float(total / seen), float(total_align / seen)


def local_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    centroids: torch.Tensor,
    mask: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> LocalUpdate:
    """One FedPAC round on a client: statistics, head epoch(s), extractor epochs, centroids.

    ``model`` arrives holding the global extractor and the client's personalized head and leaves
    holding the trained ones. ``x``/``y`` are on the training device, without augmentation.
    """
    num_classes = model.num_classes
    before = feature_statistics(class_feature_sums(model.extractor, x, y, num_classes))
    head_loss = train_head(model, x, y, cfg, generator)
    train_loss, align = train_extractor(model, x, y, centroids, mask, cfg, generator)
    after = class_feature_sums(model.extractor, x, y, num_classes)
    return LocalUpdate(
        statistics=before,
        centroids=after.class_means().float(),
        class_counts=after.counts,
        head_loss=head_loss,
        train_loss=train_loss,
        align_loss=align,
    )


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int = 1024) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.eval()
    loss = torch.zeros((), device=x.device)
    correct = torch.zeros((), device=x.device)
    for start in range(0, len(x), batch_size):
        logits = model(x[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += F.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(dim=1) == target).sum()
    return float(loss / len(x)), float(correct / len(x))
