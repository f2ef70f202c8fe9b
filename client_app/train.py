"""The local update of FedPAC and of its baselines on one client, in plain PyTorch.

One entry point, :func:`local_update`, dispatches on the run's method (``common.methods``) to a
small training routine:

* FedPAC and its ablations (:func:`alternating_update`, Section 4, Algorithm 1). The order
  matters and follows the paper: statistics for the collaboration QP are taken with the
  *received* extractor, then the head is trained with the extractor frozen, then the extractor
  with the head frozen and features pulled towards the global class centroids, and finally the
  local centroids are taken with the *trained* extractor.
* FedAvg, FedAvg-FT, FedPer and Local-only (:func:`train_joint`): the whole model, E epochs.
* FedRep (:func:`representation_update`): many head epochs with the body frozen, then the body.

A method computes only what its server step uses: statistics only when heads are mixed,
centroids only with feature alignment.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from common.config import FedPACConfig
from common.methods import METHODS, Method, Routine
from common.model import FedPACNet
from common.statistics import FeatureStatistics, class_feature_sums, feature_statistics


@dataclass(frozen=True)
class LocalUpdate:
    """What one round of local training produces (besides the trained model itself).

    Fields a method does not use are ``None`` and are neither computed nor sent.
    """

    num_examples: int  # n_i, in samples
    train_loss: float  # the last phase: extractor epochs (CE + lambda * alignment) or joint CE
    statistics: FeatureStatistics | None = None  # before training, for the QP
    centroids: torch.Tensor | None = None  # (K, d) float32, after training (eq. 17)
    class_counts: torch.Tensor | None = None  # (K,) n_ik
    head_loss: float | None = None  # head-only epochs (FedPAC, FedRep)
    align_loss: float | None = None  # the alignment term, with feature alignment


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


def train_head(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
    epochs: int | None = None,
    lr: float | None = None,
) -> float:
    """Epochs of the head alone on frozen features; returns the mean CE.

    Defaults to FedPAC's ``head-epochs`` at ``head-lr``; FedRep and FedAvg-FT pass their own.
    """
    epochs = cfg.head_epochs if epochs is None else epochs
    if epochs == 0:
        return 0.0
    model.train()
    optimizer = _sgd(model.head.parameters(), cfg.head_lr if lr is None else lr, cfg)
    total, seen = torch.zeros((), device=x.device), 0
    for _ in range(epochs):
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
    centroids: torch.Tensor | None,
    mask: torch.Tensor | None,
    cfg: FedPACConfig,
    generator: torch.Generator,
    epochs: int | None = None,
) -> tuple[float, float]:
    """``epochs`` (default ``local-epochs``) epochs of the extractor with the head frozen (eq. 3).

    Without ``centroids`` (methods without feature alignment) the loss is plain CE.
    Returns the mean total loss and the mean alignment term over all batches.
    """
    model.train()
    model.head.requires_grad_(False)
    optimizer = _sgd(model.extractor.parameters(), cfg.extractor_lr, cfg)
    use_alignment = centroids is not None and cfg.lambda_align > 0 and bool(mask.any())
    total = torch.zeros((), device=x.device)
    total_align = torch.zeros((), device=x.device)
    seen = 0
    try:
        for _ in range(cfg.local_epochs if epochs is None else epochs):
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


def train_joint(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> float:
    """``local-epochs`` epochs of the whole model, plain CE, at the baselines' step size eta
    (``extractor-lr``): FedAvg, FedPer and Local-only (the authors' ``local_training``)."""
    model.train()
    optimizer = _sgd(model.parameters(), cfg.extractor_lr, cfg)
    total, seen = torch.zeros((), device=x.device), 0
    for _ in range(cfg.local_epochs):
        for idx in _batches(len(x), cfg.batch_size, generator, x.device):
            with _autocast(x, cfg):
                logits = model(x[idx])
            loss = F.cross_entropy(logits.float(), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
            seen += len(idx)
    return float(total / seen)


def finetune_head(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> float:
    """FedAvg-FT's local fine-tuning before evaluation: ``finetune-epochs`` epochs of the head
    on the local training data, extractor frozen, at the baselines' step size."""
    return train_head(model, x, y, cfg, generator, epochs=cfg.finetune_epochs, lr=cfg.extractor_lr)


def _class_counts(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    return torch.bincount(y, minlength=num_classes).to(torch.float64)


def alternating_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    centroids: torch.Tensor | None,
    mask: torch.Tensor | None,
    cfg: FedPACConfig,
    generator: torch.Generator,
    method: Method,
) -> LocalUpdate:
    """FedPAC's round (and its ablations'): statistics, head epoch(s), extractor epochs, centroids.

    Statistics only when the method mixes heads; alignment and centroids only when it aligns.
    """
    num_classes = model.num_classes
    before = None
    if method.needs_statistics:
        before = feature_statistics(class_feature_sums(model.extractor, x, y, num_classes))
    head_loss = train_head(model, x, y, cfg, generator)
    aligned = centroids if method.alignment else None
    train_loss, align = train_extractor(model, x, y, aligned, mask, cfg, generator)
    local_centroids = None
    if method.needs_centroids:
        local_centroids = class_feature_sums(model.extractor, x, y, num_classes).class_means().float()
    return LocalUpdate(
        num_examples=len(y),
        train_loss=train_loss,
        statistics=before,
        centroids=local_centroids,
        class_counts=_class_counts(y, num_classes) if method.sends_class_counts else None,
        head_loss=head_loss,
        align_loss=align if method.alignment else None,
    )


def representation_update(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> LocalUpdate:
    """FedRep's round: ``fedrep-head-epochs`` epochs of the head on frozen features, then
    ``fedrep-body-epochs`` epochs of the body with the head frozen, both at the baselines' step
    size."""
    head_loss = train_head(model, x, y, cfg, generator, epochs=cfg.fedrep_head_epochs, lr=cfg.extractor_lr)
    train_loss, _ = train_extractor(model, x, y, None, None, cfg, generator, epochs=cfg.fedrep_body_epochs)
    return LocalUpdate(num_examples=len(y), train_loss=train_loss, head_loss=head_loss)


def local_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    centroids: torch.Tensor | None,
    mask: torch.Tensor | None,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> LocalUpdate:
    """One round of local training for the run's method (``strategy`` in the run config).

    ``model`` arrives holding what the server sent (the global extractor and the client's head,
    or for Local-only the client's own model) and leaves holding the trained one. ``x``/``y``
    are on the training device, without augmentation. ``centroids``/``mask`` are the global
    centroids; only methods with feature alignment receive and use them.
    """
    method = METHODS[cfg.strategy]
    if method.routine is Routine.ALTERNATING:
        return alternating_update(model, x, y, centroids, mask, cfg, generator, method)
    if method.routine is Routine.REPRESENTATION:
        return representation_update(model, x, y, cfg, generator)
    return LocalUpdate(num_examples=len(y), train_loss=train_joint(model, x, y, cfg, generator))


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
