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
* FedCCFA (:func:`clustered_update`): a balanced-batch head from the fixed initial head (the
  server clusters these), the personal head, then the extractor with features pulled towards
  the client's cluster anchors by a contrastive loss weighted by the label entropy.
* pFedVEM (:func:`variational_update`): the confidence rho_j, the variational E-step on the
  client's Gaussian head, then the extractor against samples of that head.

A method computes only what its server step uses: statistics only when heads are mixed,
class means only with feature alignment, the balanced head only when heads are clustered.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from common import protocol as p
from common.config import FedPACConfig
from common.clustering import entropy_weight
from common.methods import METHODS, Alignment, Method, Routine
from common.model import FedPACNet
from common.statistics import FeatureStatistics, class_feature_sums, feature_statistics
from common.variational import GaussianHead, confidence_rho, e_step, sampled_mean_nll


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
    head_loss: float | None = None  # head-only epochs (FedPAC, FedRep, FedCCFA's personal head)
    align_loss: float | None = None  # the alignment term, with feature alignment
    balanced_head: dict[str, torch.Tensor] | None = None  # FedCCFA: the clustering input
    align_weight: float | None = None  # FedCCFA: H(P(Y)) / gamma
    # pFedVEM: the posterior scales s in nn.Linear's layout ("weight" (K, d), "bias"), the mean
    # being the model's head; rho_j taken before the E-step; whether the NaN guard restored it
    posterior_scale: dict[str, torch.Tensor] | None = None
    rho: float | None = None
    posterior_restored: bool | None = None


@dataclass(frozen=True)
class Received:
    """What the server sent for this round besides the model.

    ``targets``/``target_mask``: the alignment targets (FedPAC's global centroids, FedCCFA's
    anchors of this client), absent for methods without alignment. ``initial_head``: FedCCFA's
    fixed phi^0; ``has_personal_head``: whether the head in the model is the client's own
    (False for a first participation, when it only holds phi^0).
    """

    server_round: int = 1
    targets: torch.Tensor | None = None
    target_mask: torch.Tensor | None = None
    initial_head: dict[str, torch.Tensor] = field(default_factory=dict)
    has_personal_head: bool = False
    # pFedVEM: the prior mean w ("prior.weight" (K, d), "prior.bias") and this client's posterior
    # scales ("scale.weight" (K, d), "scale.bias"), all in nn.Linear's layout (common.protocol)
    posterior: dict[str, torch.Tensor] = field(default_factory=dict)


# An alignment term: (features, labels) -> a scalar loss; its weight is applied by the caller.
AlignmentTerm = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _batches(num_samples: int, batch_size: int, generator: torch.Generator, device: torch.device):
    order = torch.randperm(num_samples, generator=generator).to(device)
    return order.split(batch_size)


def _autocast(x: torch.Tensor, cfg: FedPACConfig):
    """bfloat16 autocast when ``mixed-precision`` is on: no loss scaling needed, and the
    statistics and centroid passes stay in float32/float64 (they run outside it)."""
    return torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision)


def _sgd(params, lr: float, cfg: FedPACConfig) -> torch.optim.SGD:
    return torch.optim.SGD(params, lr=lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def sgd_epochs(  # pylint: disable=too-many-arguments
    optimizer: torch.optim.Optimizer,
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    epochs: int,
    num_samples: int,
    batch_size: int,
    generator: torch.Generator,
    device: torch.device,
) -> float:
    """The epoch loop every routine trains with: ``epochs`` passes over a fresh shuffle of the
    ``num_samples`` samples, one ``optimizer`` step per minibatch on ``batch_loss(indices)``.

    Returns the mean loss over every sample seen (0 when no epoch ran). The running sum stays on
    the device: reading a loss back every step would wait for the GPU each time.
    """
    total, seen = torch.zeros((), device=device), 0
    for _ in range(epochs):
        for idx in _batches(num_samples, batch_size, generator, device):
            loss = batch_loss(idx)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
            seen += len(idx)
    return float(total / seen) if seen else 0.0


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


def contrastive_alignment_loss(
    features: torch.Tensor, labels: torch.Tensor, anchors: torch.Tensor, mask: torch.Tensor, temperature: float
) -> torch.Tensor:
    """FedCCFA's alignment: mean_b CE([cos(f(x_b), A_c) / tau]_c, y_b), as the authors' code.

    The anchors are constants. Classes without an anchor take no part in the softmax; samples
    of such a class contribute zero but count in the batch size, like FedPAC's alignment.
    """
    logits = F.cosine_similarity(features.unsqueeze(1), anchors.unsqueeze(0), dim=2) / temperature
    logits = logits.masked_fill(~mask.unsqueeze(0), float("-inf"))
    aligned = mask[labels]
    if not aligned.any():
        return features.sum() * 0.0
    per_sample = F.cross_entropy(logits[aligned], labels[aligned], reduction="sum")
    return per_sample / len(labels)


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
    with torch.no_grad(), _autocast(x, cfg):  # the extractor is frozen: no graph through it at all
        features = torch.cat([model.extractor(chunk) for chunk in x.split(cfg.batch_size)])
    optimizer = _sgd(model.head.parameters(), cfg.head_lr if lr is None else lr, cfg)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        with _autocast(x, cfg):
            return F.cross_entropy(model.head(features[idx]).float(), y[idx])

    return sgd_epochs(optimizer, batch_loss, epochs, len(x), cfg.batch_size, generator, x.device)


def train_extractor(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
    alignment: AlignmentTerm | None = None,
    weight: float = 0.0,
    epochs: int | None = None,
) -> tuple[float, float]:
    """``epochs`` (default ``local-epochs``) epochs of the extractor with the head frozen:
    CE + ``weight`` * ``alignment`` (FedPAC eq. 3, FedCCFA's contrastive term), or plain CE.

    Returns the mean total loss and the mean (unweighted) alignment term over all batches.
    """
    model.train()
    model.head.requires_grad_(False)
    optimizer = _sgd(model.extractor.parameters(), cfg.extractor_lr, cfg)
    align_with = alignment if weight > 0 else None
    total_align = torch.zeros((), device=x.device)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        nonlocal total_align
        with _autocast(x, cfg):
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
        mean_loss = sgd_epochs(optimizer, batch_loss, epochs, len(x), cfg.batch_size, generator, x.device)
    finally:
        model.head.requires_grad_(True)
    seen = epochs * len(x)  # every epoch is one pass over all samples (sgd_epochs)
    return mean_loss, float(total_align / seen) if seen else 0.0


def train_joint(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> float:
    """``local-epochs`` epochs of the whole model, plain CE, at the baselines' step size eta
    (``extractor-lr``): FedAvg, FedPer and Local-only (the authors' ``local_training``)."""
    model.train()
    optimizer = _sgd(model.parameters(), cfg.extractor_lr, cfg)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        with _autocast(x, cfg):
            logits = model(x[idx])
        return F.cross_entropy(logits.float(), y[idx])

    return sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(x), cfg.batch_size, generator, x.device)


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
    alignment: AlignmentTerm | None = None
    if method.alignment is Alignment.CENTROIDS and centroids is not None and mask is not None and bool(mask.any()):
        alignment = partial(alignment_loss, centroids=centroids, mask=mask)
    train_loss, align = train_extractor(model, x, y, cfg, generator, alignment, cfg.lambda_align)
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
        align_loss=align if method.needs_centroids else None,
    )


def representation_update(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> LocalUpdate:
    """FedRep's round: ``fedrep-head-epochs`` epochs of the head on frozen features, then
    ``fedrep-body-epochs`` epochs of the body with the head frozen, both at the baselines' step
    size unless ``fedrep-head-lr`` sets the head's."""
    head_lr = cfg.fedrep_head_lr or cfg.extractor_lr
    head_loss = train_head(model, x, y, cfg, generator, epochs=cfg.fedrep_head_epochs, lr=head_lr)
    train_loss, _ = train_extractor(model, x, y, cfg, generator, epochs=cfg.fedrep_body_epochs)
    return LocalUpdate(num_examples=len(y), train_loss=train_loss, head_loss=head_loss)


def balanced_sample(y: torch.Tensor, per_class: int, generator: torch.Generator) -> torch.Tensor:
    """Indices of m samples of every class present, m = min(``per_class``, the smallest count
    of a present class), drawn without replacement (FedCCFA's ``class_balance_sample``, over
    the classes actually present rather than assuming 0..C'-1)."""
    labels = y.cpu()
    counts = torch.bincount(labels)
    present = torch.nonzero(counts).flatten()
    m = min(per_class, int(counts[present].min()))
    chosen = []
    for c in present.tolist():
        members = torch.nonzero(labels == c).flatten()
        chosen.append(members[torch.randperm(len(members), generator=generator)[:m]])
    return torch.cat(chosen).to(y.device)


def _head_state(model: FedPACNet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.head.state_dict().items()}


def clustered_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    received: Received,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> LocalUpdate:
    """FedCCFA's round, in the authors' order.

    1. The balanced head: from the fixed initial head phi^0, ``balanced-epochs`` epochs on a
       class-balanced sample (frozen extractor). Only the server's clustering uses it: starting
       every client from the same phi^0 is what makes their heads comparable.
    2. The personal head: the server's merged head phi^_k (a first participant starts from its
       balanced head), ``head-epochs`` epochs on all local data.
    3. The extractor, head frozen: CE + H(P_k(Y))/gamma * the contrastive alignment to the
       client's anchors, from round ``align-from-round`` on and once the client has anchors.
    4. The local anchors: class means of the trained extractor's features.
    """
    num_classes = model.num_classes
    counts = _class_counts(y, num_classes)
    personal = _head_state(model)
    model.head.load_state_dict(received.initial_head)
    sample = balanced_sample(y, cfg.balanced_samples_per_class, generator)
    train_head(model, x[sample], y[sample], cfg, generator, epochs=cfg.balanced_epochs, lr=cfg.balanced_lr)
    balanced = _head_state(model)
    if received.has_personal_head:
        model.head.load_state_dict(personal)
    head_loss = train_head(model, x, y, cfg, generator)

    weight = entropy_weight(counts.cpu().numpy(), cfg.align_gamma, cfg.align_lambda)
    anchors, mask = received.targets, received.target_mask
    alignment: AlignmentTerm | None = None
    aligning = received.server_round >= cfg.align_from_round
    if aligning and anchors is not None and mask is not None and bool(mask.any()):
        alignment = partial(contrastive_alignment_loss, anchors=anchors, mask=mask, temperature=cfg.align_temperature)
    train_loss, align = train_extractor(model, x, y, cfg, generator, alignment, weight)
    local_anchors = class_feature_sums(model.extractor, x, y, num_classes).class_means().float()
    return LocalUpdate(
        num_examples=len(y),
        train_loss=train_loss,
        centroids=local_anchors,
        class_counts=counts,
        head_loss=head_loss,
        align_loss=align,
        balanced_head=balanced,
        align_weight=weight,
    )


def variational_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    received: Received,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> LocalUpdate:
    """pFedVEM's round (Algorithm 1; the authors' ``vem/vem_client.py``), in the code's order.

    ``model`` holds the global base theta^t and, as its head, the client's posterior mean mu_j;
    ``received.posterior`` the prior mean w^t and the posterior scales s_j. All three arrive in
    ``nn.Linear``'s layout and are transposed once, into :class:`GaussianHead`'s (d, K).

    1. rho_j (eq. 7) from the posterior as it came out of the client's last round, against the
       new w^t: the prior's scale in this round's E-step and the client's weight on the server.
    2. E-step: ``vem-head-steps`` full-batch SGD steps on (mu, s) against the negative ELBO
       (summed NLL over ``vem-mc-samples`` reparameterized heads + closed-form KL), the features
       computed once with the frozen base; a NaN loss restores the posterior.
    3. The base, head fixed: ``local-epochs`` epochs of minibatches of ``vem-batch-size``, the
       loss averaged over ``vem-mc-samples`` fresh head samples per minibatch.

    The model leaves holding theta_j and mu_j; the scales travel in ``posterior_scale``. Like the
    code, no weight decay.
    """
    posterior = received.posterior
    head = GaussianHead.from_linear(model.head.weight, model.head.bias,
                                    posterior[p.SCALE_WEIGHT], posterior[p.SCALE_BIAS])
    prior_weight, prior_bias = posterior[p.PRIOR_WEIGHT].T, posterior[p.PRIOR_BIAS]  # (K, d) -> (d, K)
    rho = confidence_rho(head, prior_weight, prior_bias)
    model.train()
    features = extract_features(model.extractor, x)
    estep = e_step(head, features, y, prior_weight, prior_bias, rho, steps=cfg.vem_head_steps,
                   lr=cfg.vem_head_lr, momentum=cfg.vem_momentum, n_mc=cfg.vem_mc_samples, generator=generator)

    optimizer = torch.optim.SGD(model.extractor.parameters(), lr=cfg.vem_base_lr, momentum=cfg.vem_momentum)

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        with _autocast(x, cfg):
            features = model.extractor(x[idx])
        return sampled_mean_nll(head, features.float(), y[idx], cfg.vem_mc_samples, generator)

    train_loss = sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(x), cfg.vem_batch_size, generator, x.device)

    weight_mu, bias_mu = head.linear_mean()  # (d, K) -> nn.Linear's (K, d)
    with torch.no_grad():
        model.head.weight.copy_(weight_mu)
        model.head.bias.copy_(bias_mu)
    weight_s, bias_s = head.linear_scale()
    return LocalUpdate(
        num_examples=len(y),
        train_loss=train_loss,
        head_loss=estep.train_loss,
        posterior_scale={"weight": weight_s, "bias": bias_s},
        rho=rho,
        posterior_restored=estep.restored,
    )


def local_update(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    received: Received,
    cfg: FedPACConfig,
    generator: torch.Generator,
) -> LocalUpdate:
    """One round of local training for the run's method (``strategy`` in the run config).

    ``model`` arrives holding what the server sent (the global extractor and the client's head,
    or for Local-only the client's own model) and leaves holding the trained one. ``x``/``y``
    are on the training device, without augmentation, labels in the client's current concept.
    ``received`` holds the rest of the server's message (alignment targets, phi^0, the round).
    """
    method = METHODS[cfg.strategy]
    centroids, mask = received.targets, received.target_mask
    if method.routine is Routine.CLUSTERED:
        return clustered_update(model, x, y, received, cfg, generator)
    if method.routine is Routine.VARIATIONAL:
        return variational_update(model, x, y, received, cfg, generator)
    if method.routine is Routine.ALTERNATING:
        return alternating_update(model, x, y, centroids, mask, cfg, generator, method)
    if method.routine is Routine.REPRESENTATION:
        return representation_update(model, x, y, cfg, generator)
    return LocalUpdate(num_examples=len(y), train_loss=train_joint(model, x, y, cfg, generator))


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
