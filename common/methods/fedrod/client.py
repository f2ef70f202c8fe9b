"""Fed-RoD's client: one round trains the generic model (extractor + generic head) on the balanced
softmax loss and, in the same steps, the site's personal head on the cross-entropy of the summed
logits; only the generic model goes back. Before evaluation the two heads are summed into one."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn

from common import privacy
from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received, SiteState
from common.methods.fedrod import FedRoD
from common.model import FedPACNet
from common.training import autocast, class_counts, sgd, sgd_epochs, to_numpy

PERSONAL_HEAD = "fedrod-personal-head"


def balanced_softmax_loss(logits: torch.Tensor, y: torch.Tensor, log_prior: torch.Tensor) -> torch.Tensor:
    """The balanced softmax loss: the mean cross-entropy of ``logits + log n_c``. The site's
    label skew is added to the logits, so the logits themselves learn a class-balanced
    p(y | x) (a class the site lacks, log 0 = -inf, gets no gradient at all)."""
    return F.cross_entropy(logits + log_prior, y)


def personalized_logits(generic: torch.Tensor, personal: torch.Tensor) -> torch.Tensor:
    """The personalized predictor's logits: the generic head's plus the personal head's."""
    return generic + personal


def log_class_prior(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """log n_c of the site's training labels, as float32 on their device: exact, or with DP the
    counts the site releases (``common.training.class_counts``) floored at 1, so that no record's
    class gets a prior of 0 from the noise alone."""
    counts = class_counts(y, num_classes)
    if privacy.active() is not None:
        counts = counts.clamp(min=1.0)
    return counts.log().to(device=y.device, dtype=torch.float32)


def personal_head(model: FedPACNet, state: SiteState) -> nn.Linear:
    """The site's personal head phi_m: the one it kept, or (before it first trained) zero."""
    head = copy.deepcopy(model.head)
    kept = state.get(PERSONAL_HEAD)
    with torch.no_grad():
        for name, param in head.named_parameters():
            param.copy_(torch.as_tensor(kept[name]) if kept is not None else torch.zeros_like(param))
    return head


def summed_head(generic: nn.Linear, personal: nn.Linear) -> nn.Linear:
    """One linear head whose logits are ``personalized_logits`` of the two: psi(z) + phi(z) is
    (W_psi + W_phi) z + (b_psi + b_phi)."""
    head = copy.deepcopy(generic)
    with torch.no_grad():
        for mine, theirs in zip(head.parameters(), personal.parameters()):
            mine.add_(theirs)
    return head


class Routine(ClientRoutine):
    """``local-epochs`` epochs at the baselines' step size, each step on the balanced softmax loss
    of the generic model plus the cross-entropy of the personalized logits (the personal head
    alone learning from it); the personal head is kept at the site."""

    method: FedRoD

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        personal = personal_head(model, data.state)
        log_prior = log_class_prior(data.y, model.num_classes)
        trained = nn.ModuleDict({"generic": model, "personal": personal})  # every parameter a step moves
        model.train()
        total_personal, seen = torch.zeros((), device=data.x.device), 0

        def batch_loss(idx: torch.Tensor) -> torch.Tensor:
            nonlocal total_personal, seen
            y = data.y[idx]
            with autocast(data.x, cfg):
                features = model.extractor(data.x[idx])
                generic = model.head(features).float()
                # phi_m learns on top of the generic predictor: neither theta nor psi feel its loss
                mine = personal(features.detach()).float()
            personal_loss = F.cross_entropy(personalized_logits(generic.detach(), mine), y)
            total_personal += personal_loss.detach() * len(idx)
            seen += len(idx)
            return balanced_softmax_loss(generic, y, log_prior) + personal_loss

        optimizer = sgd(trained.parameters(), cfg.extractor_lr, cfg)
        total = sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(data.x), cfg.batch_size, generator,
                           data.x.device, trained)
        data.state.put(PERSONAL_HEAD, {name: to_numpy(value) for name, value in personal.state_dict().items()})
        personal_loss = float(total_personal / seen) if seen else 0.0
        # the reply's train-loss is the generic model's (the balanced loss): the model it carries
        return ClientResult(num_examples=len(data.y), train_loss=total - personal_loss,
                            metrics={"personal-loss": personal_loss})

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """The personalized predictor: a copy of the received generic model whose head is the sum
        of the generic and the personal heads (the generic model itself before the site first
        trained: its personal head is zero)."""
        del cfg, generator
        if data.state.get(PERSONAL_HEAD) is None:
            return model
        model = copy.deepcopy(model)
        model.head = summed_head(model.head, personal_head(model, data.state))
        return model
