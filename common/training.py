"""The building blocks every method's local update trains with, in plain PyTorch: one epoch
loop (:func:`sgd_epochs`), head epochs on frozen features, extractor epochs with an optional
alignment term, the whole model's epochs, and evaluation. The methods' own routines are in their
packages (``common/methods/<family>/client.py``)."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common import privacy
from common import protocol as p
from common.config import FedPACConfig
from common.model import FedPACNet

# An alignment term: (features, labels) -> a scalar loss; its weight is applied by the caller.
AlignmentTerm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def shuffled_batches(num_samples: int, batch_size: int, generator: torch.Generator, device: torch.device):
    """One epoch's minibatches: the indices of a fresh shuffle, ``batch_size`` at a time."""
    order = torch.randperm(num_samples, generator=generator).to(device)
    return order.split(batch_size)


def autocast(x: torch.Tensor, cfg: FedPACConfig):
    """bfloat16 autocast when ``mixed-precision`` is on: no loss scaling needed, and the
    statistics and centroid passes stay in float32/float64 (they run outside it)."""
    return torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision)


def sgd(params, lr: float, cfg: FedPACConfig) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def sgd_epochs(  # pylint: disable=too-many-arguments
    optimizer: torch.optim.Optimizer,
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    num_samples: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
    module: nn.Module,
    penalty: Callable[[], torch.Tensor] | None = None,
    public_size: float | None = None,
) -> float:
    """The epoch loop every routine trains with: ``epochs`` passes over a fresh shuffle of the
    ``num_samples`` samples, one ``optimizer`` step per minibatch on ``batch_loss(indices)`` (a
    mean over the minibatch's samples) plus ``penalty()`` (a term of the parameters alone).
    ``module`` holds every parameter the optimizer trains.

    With differential privacy on at this site (``common.privacy.active``) each step is DP-SGD's
    instead: a Poisson sample of the records, each record's gradient clipped, Gaussian noise on
    their sum, the penalty's gradient added after the noise, the steps recorded in the site's
    ledger. The sampling rate and the number of steps are made of the number of records, which
    is public (the site announces n); ``public_size`` replaces it when the trained set is a
    random subset of the site's records whose size is not public (FedCCFA's balanced sample):
    its expected size, computed from what the site released.

    A private site's recipe (``dp-batch-size``, ``dp-step-size``) replaces the routine's batch
    size and its optimizer's step size, momentum and weight decay for these steps.

    Returns the mean loss over every sample seen (0 when no epoch ran). The running sum stays on
    the device: reading a loss back every step would wait for the GPU each time.
    """
    site = privacy.active()
    if site is None:
        batches = (idx for _ in range(epochs) for idx in shuffled_batches(num_samples, batch_size, generator, device))
    else:
        batch_size = site.settings.batch_size or batch_size
        if site.settings.step_size:
            _take_step_size(optimizer, site.settings.step_size, site.settings.momentum)
        size = num_samples if public_size is None else public_size
        rate = privacy.sample_rate(size, batch_size)
        steps = epochs * privacy.steps_per_epoch(size, batch_size)
        batches = (privacy.poisson_batch(num_samples, rate, generator, device) for _ in range(steps))
    total, seen = torch.zeros((), device=device), 0
    with privacy.ClippedGradients(module) if site is not None else nullcontext() as clipped:
        for idx in batches:
            optimizer.zero_grad(set_to_none=True)
            if len(idx):  # a Poisson sample may be empty: DP-SGD's step is then its noise alone
                loss = batch_loss(idx)
                if penalty is not None and site is None:
                    loss = loss + penalty()
                loss.backward()
                total += loss.detach() * len(idx)
                seen += len(idx)
            if site is not None and clipped is not None:  # both, or neither
                _privatize(clipped, site, rate * size, len(idx), penalty)
            optimizer.step()
    if site is not None:
        site.ledger.record(site.settings.noise_multiplier, rate, steps)
    return float(total / seen) if seen else 0.0


def _take_step_size(optimizer: torch.optim.Optimizer, step_size: float, momentum: float) -> None:
    """Steps of ``step_size`` with ``momentum``, as DP-SGD's recipe takes them, and no weight decay
    (a decay would pull every weight by an amount no record's clipping bounds; momentum only
    averages released gradients, at no cost in privacy)."""
    for group in optimizer.param_groups:
        group["lr"] = step_size
        if "momentum" in group:
            group["momentum"] = momentum
        if "weight_decay" in group:
            group["weight_decay"] = 0.0


def _privatize(clipped: privacy.ClippedGradients, site: privacy.PrivateSite, expected_batch: float,
               batch: int, penalty: Callable[[], torch.Tensor] | None) -> None:
    """Replace the gradients of the step's backward pass by DP-SGD's (``common.privacy``), and
    add the penalty's gradient after the noise: it reads no record."""
    sums = clipped.clipped_sums(site.settings.max_grad_norm, batch)
    clipped.clear()
    noisy = privacy.noisy_mean(sums, site.settings, expected_batch, site.noise)
    if penalty is not None:
        noisy = [g + d for g, d in zip(noisy, torch.autograd.grad(penalty(), clipped.params))]
    for param, grad in zip(clipped.params, noisy):
        param.grad = grad


def train_head(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
    epochs: int | None = None,
    lr: float | None = None,
    public_size: float | None = None,
) -> float:
    """Epochs of the head alone on frozen features; returns the mean CE (``public_size``:
    :func:`sgd_epochs`).

    Defaults to FedPAC's ``head-epochs`` at ``head-lr`` (also FedCCFA's personal head); FedRep,
    FedAvg-FT and FedCCFA's balanced head pass their own.

    The features are extracted once, not once an epoch: the extractor is frozen and has neither
    dropout nor batch norm (``common.model``), so every epoch would compute the same f(x). With
    FedRep's 10 head epochs or FedAvg-FT's 5 fine-tuning epochs, that repeated forward pass was
    most of the head's cost. They are extracted in chunks of the training batch size because a
    CPU convolution's last bits depend on the batch's size (not on which samples are in it):
    a full batch then trains on the very features a forward pass of that batch would give.
    """
    epochs = cfg.head_epochs if epochs is None else epochs
    if epochs == 0:
        return 0.0
    model.train()
    with torch.no_grad(), autocast(x, cfg):  # the extractor is frozen: no graph through it at all
        features = torch.cat([model.extractor(chunk) for chunk in x.split(cfg.batch_size)])
    optimizer = sgd(model.head.parameters(), cfg.head_lr if lr is None else lr, cfg)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        with autocast(x, cfg):
            return F.cross_entropy(model.head(features[idx]).float(), y[idx])

    return sgd_epochs(optimizer, batch_loss, epochs, len(x), cfg.batch_size, generator, x.device, model.head,
                      public_size=public_size)


def train_extractor(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
    alignment: AlignmentTerm | None = None,
    weight: float = 0.0,
    epochs: int | None = None,
    with_head: bool = False,
) -> tuple[float, float]:
    """``epochs`` (default ``local-epochs``) epochs of the extractor with the head frozen, or
    trained in the same steps (``with_head``: ``head-with-extractor``): CE + ``weight`` *
    ``alignment`` (FedPAC eq. 3, FedCCFA's contrastive term), or plain CE.

    Returns the mean total loss and the mean (unweighted) alignment term over all batches.
    """
    model.train()
    model.head.requires_grad_(with_head)
    trained: nn.Module = model if with_head else model.extractor
    optimizer = sgd(trained.parameters(), cfg.extractor_lr, cfg)
    align_with = alignment if weight > 0 else None
    total_align = torch.zeros((), device=x.device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        nonlocal total_align
        with autocast(x, cfg):
            features = model.extractor(x[idx])
            logits = model.head(features)
        loss = F.cross_entropy(logits.float(), y[idx])
        if align_with is not None:
            align = align_with(features.float(), y[idx])
            loss = loss + weight * align
            total_align += align.detach() * len(idx)
        return loss

    epochs = cfg.local_epochs if epochs is None else epochs
    try:
        mean_loss = sgd_epochs(optimizer, batch_loss, epochs, len(x), cfg.batch_size, generator, x.device, trained)
    finally:
        model.head.requires_grad_(True)
    seen = epochs * len(x)  # every epoch is one pass over all samples (sgd_epochs)
    return mean_loss, float(total_align / seen) if seen else 0.0


def train_joint(  # pylint: disable=too-many-arguments
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator,
    penalty: Callable[[], torch.Tensor] | None = None,
) -> float:
    """``local-epochs`` epochs of the whole model, plain CE (plus ``penalty()``, a term of the
    parameters alone, such as FedProx's proximal term), at the baselines' step size eta
    (``extractor-lr``): FedAvg, FedPer and Local-only (the authors' ``local_training``)."""
    model.train()
    optimizer = sgd(model.parameters(), cfg.extractor_lr, cfg)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        with autocast(x, cfg):
            logits = model(x[idx])
        return F.cross_entropy(logits.float(), y[idx])

    return sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(x), cfg.batch_size, generator, x.device, model,
                      penalty)


def proximal_term(model: nn.Module, anchor: dict[str, torch.Tensor], weight: float) -> torch.Tensor:
    """(weight / 2) ||w - w_anchor||^2 over every parameter of ``model``: FedProx's proximal term
    (anchor: the received global model) and Ditto's pull of the personal model towards it."""
    squares = [(param - anchor[name]).square().sum() for name, param in model.named_parameters()]
    return 0.5 * weight * torch.stack(squares).sum()


def parameters_of(model: nn.Module) -> dict[str, torch.Tensor]:
    """A detached copy of ``model``'s parameters: a fixed anchor for :func:`proximal_term`."""
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def class_counts(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """How many samples of each class ``y`` has, as the site releases them: exact, or with
    differential privacy on, noised (``common.privacy.private_counts``)."""
    site = privacy.active()
    if site is not None:
        return privacy.private_counts(y, num_classes, site)
    return torch.bincount(y, minlength=num_classes).to(torch.float64)


def head_state(model: FedPACNet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.head.state_dict().items()}


EVALUATION_BATCH = 1024


@torch.no_grad()
def extract_features(extractor: nn.Module, x: torch.Tensor, batch_size: int = EVALUATION_BATCH) -> torch.Tensor:
    """f_theta(x) for a whole set, without gradients, in float32, batch by batch (the batches
    :func:`evaluate` uses, so what a head makes of them is the same bits as a full forward pass)."""
    return torch.cat([extractor(x[start : start + batch_size]).float() for start in range(0, len(x), batch_size)])


@torch.no_grad()
def evaluate_head(head: nn.Module, features: torch.Tensor, y: torch.Tensor,
                  batch_size: int = EVALUATION_BATCH) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``head`` on features already extracted."""
    loss = torch.zeros((), device=features.device)
    correct = torch.zeros((), device=features.device)
    for start in range(0, len(features), batch_size):
        logits = head(features[start : start + batch_size])
        target = y[start : start + batch_size]
        loss += F.cross_entropy(logits, target, reduction="sum")
        correct += (logits.argmax(dim=1) == target).sum()
    return float(loss / len(features)), float(correct / len(features))


def evaluate(model: FedPACNet, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float]:
    """Mean cross-entropy and accuracy of ``model`` on (x, y)."""
    model.eval()
    return evaluate_head(model.head, extract_features(model.extractor, x), y)


def alignment_targets(received_sections: p.Sections, device: torch.device
                      ) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The alignment targets the server sent (section ``centroids``: FedPAC's global class
    centroids, FedCCFA's anchors of this client) and their mask, on ``device``; ``(None, None)``
    when the message has none."""
    if p.CENTROIDS not in received_sections:
        return None, None
    arrays = received_sections[p.CENTROIDS]
    return (torch.as_tensor(arrays[p.CENTROID_VALUES], dtype=torch.float32, device=device),
            torch.as_tensor(arrays[p.CENTROID_MASK], dtype=torch.bool, device=device))


def to_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor as the numpy array a reply carries."""
    return tensor.detach().cpu().numpy()
