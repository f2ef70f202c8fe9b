"""pFedMe's local update: for every minibatch, K gradient steps of the personalized model theta_i
on f_i(theta; D) + (lambda / 2) ||theta - w_i||^2, then the local model's step
w_i <- w_i - eta * lambda * (w_i - theta_i). The local model w_i goes back to the server; theta_i
stays at the site, where it is the model the client evaluates."""

from __future__ import annotations

import copy
from functools import partial

import torch
import torch.nn.functional as F

from common.config import FedPACConfig
from common.methods.client import (ClientResult, ClientRoutine, LocalData, Received, SiteState, keep_model, kept_model)
from common.methods.pfedme import PFedMe
from common.model import FedPACNet
from common.training import autocast, parameters_of, proximal_term, shuffled_batches

PERSONAL_MODEL = "pfedme-personal-model"


def moreau_step(local: FedPACNet, personal: FedPACNet, optimizer: torch.optim.Optimizer, lam: float) -> None:
    """The local model's step on its Moreau envelope, whose gradient is lambda (w - theta) (the
    paper's w <- w - eta * lambda * (w - theta) with ``optimizer`` plain SGD at eta)."""
    optimizer.zero_grad(set_to_none=True)
    with torch.no_grad():
        for w, theta in zip(local.parameters(), personal.parameters()):
            w.grad = lam * (w - theta)
    optimizer.step()


def solve_inner(personal: FedPACNet, anchor: dict[str, torch.Tensor], x: torch.Tensor, y: torch.Tensor,
                optimizer: torch.optim.Optimizer, lam: float, steps: int, cfg: FedPACConfig) -> torch.Tensor:
    """theta ~ argmin f(theta; x, y) + (lambda / 2) ||theta - w||^2 by ``steps`` steps of
    ``optimizer`` on ``personal`` (w: ``anchor``), from where theta stands; returns the sum of
    the minibatch's mean cross-entropies over the steps (on the device)."""
    total = torch.zeros((), device=x.device)
    for _ in range(steps):
        optimizer.zero_grad(set_to_none=True)
        with autocast(x, cfg):
            loss = F.cross_entropy(personal(x).float(), y)
        (loss + proximal_term(personal, anchor, lam)).backward()
        optimizer.step()
        total += loss.detach()
    return total


def personal_model(received: FedPACNet, state: SiteState) -> FedPACNet:
    """The site's personalized model theta_i: the one it kept after its last local update, or
    (before it first trained) a copy of the received global model."""
    return kept_model(received, state, PERSONAL_MODEL)


class Routine(ClientRoutine):
    """One round at a site (Algorithm 1 of the paper): theta_i and w_i start at the received w;
    ``local-epochs`` epochs of minibatches, each K inner steps of theta_i and one step of w_i.
    The model trained in place, and sent back, is w_i."""

    method: PFedMe

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        method = self.method
        personal = copy.deepcopy(model)  # theta_i, from the received w (not from the kept one)
        personal.train()
        # the authors' optimizer: plain gradient steps, their L2 term mu as weight decay
        optimizer = torch.optim.SGD(personal.parameters(), lr=method.personal_lr, weight_decay=cfg.weight_decay)
        # the outer step at eta with the baselines' momentum (none: the paper's rule exactly)
        outer = torch.optim.SGD(model.parameters(), lr=cfg.extractor_lr, momentum=cfg.momentum)
        step = partial(moreau_step, model, personal, outer, method.lam)
        total, seen = torch.zeros((), device=data.x.device), 0
        for _ in range(cfg.local_epochs):
            for idx in shuffled_batches(len(data.x), cfg.batch_size, generator, data.x.device):
                anchor = parameters_of(model)  # w_i as it stands before this minibatch
                total += solve_inner(personal, anchor, data.x[idx], data.y[idx], optimizer, method.lam, method.k,
                                     cfg) * len(idx)
                seen += len(idx) * method.k
                step()
        keep_model(data.state, PERSONAL_MODEL, personal)
        return ClientResult(num_examples=len(data.y), train_loss=float(total / seen) if seen else 0.0)

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """pFedMe's personalized model theta_i (the received global model until the site first
        trained)."""
        del cfg, generator
        return personal_model(model, data.state)
