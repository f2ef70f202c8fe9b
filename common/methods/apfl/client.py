"""APFL's local update (Algorithm 1 of the paper): ``local-epochs`` epochs in which every
minibatch steps the global model w on its own loss and the local model v on the loss of the
mixed model v_bar = alpha v + (1 - alpha) w, both from their values before the step (and alpha
by its gradient, when it adapts). Only w goes back to the server; v (and an adapted alpha) stay
at the site, and the site evaluates v_bar.

One backward pass gives both gradients: the loss of a step is f(w) + f(v_bar), with v_bar held in
a stand-in network (``mixed``) whose parameters are set to alpha v + (1 - alpha) w before the step.
Its gradient, grad f(v_bar), gives v's (alpha times it, the chain rule through v_bar) and alpha's
(<v - w, grad f(v_bar)>); w's gradient is that of f(w) alone, since the stand-in is a copy, not a
function of w. With differential privacy on, DP-SGD clips and noises each record's gradient of
that loss over w and the stand-in together (``common.training.sgd_epochs``): one release a step,
from which v's and alpha's steps follow without reading a record again.

With outputs mixed (``apfl-mixing = "outputs"``) the step's loss is f(w(x)) + f(alpha v(x) +
(1 - alpha) w(x)) with w's outputs detached in the second term, so that w's gradient is again that
of its own loss and v's that of the mixed outputs; DP-SGD clips each record's gradient over w and
v together. With ``apfl-mixing = "rounds"`` (PFLlib's APFL) it is f(w(x)) + f(v(x)), each model on
its own loss, and after the epochs v := (1 - alpha) w + alpha v; the site keeps and evaluates
that v.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from common.config import FedPACConfig
from common.methods.apfl import APFL, OUTPUTS, PARAMETERS, ROUNDS
from common.methods.client import (ClientResult, ClientRoutine, LocalData, Received, SiteState, keep_model, kept_model,
                                   with_arrays)
from common.model import FedPACNet, output_mixture
from common.training import autocast, sgd_epochs

LOCAL_MODEL = "apfl-local-model"  # v_i
MIXING_WEIGHT = "apfl-mixing-weight"  # alpha_i, kept only when it adapts
ALPHA = "alpha"


def mix(local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor], alpha: float
        ) -> dict[str, torch.Tensor]:
    """The personalized model v_bar = alpha v + (1 - alpha) w, array by array."""
    return {key: alpha * local[key] + (1.0 - alpha) * value for key, value in global_.items()}


def alpha_gradient(local: Mapping[str, torch.Tensor], global_: Mapping[str, torch.Tensor],
                   mixed_gradient: Mapping[str, torch.Tensor]) -> float:
    """d f(v_bar) / d alpha = <v - w, grad f(v_bar)>: v_bar moves by v - w as alpha grows."""
    return float(sum(((local[key] - global_[key]) * grad).sum() for key, grad in mixed_gradient.items()))


def alpha_step(alpha: float, gradient: float, lr: float) -> float:
    """One projected gradient step of alpha, kept in [0, 1] (a convex combination)."""
    return min(1.0, max(0.0, alpha - lr * gradient))


class APFLStep(torch.optim.SGD):
    """SGD (the harness's momentum and weight decay) on w and v, stepped from one backward pass
    through w and the stand-in ``mixed`` for v_bar: before each SGD step v's gradient is set to
    alpha grad f(v_bar) (and alpha steps, when it adapts); after it, the stand-in is set to the
    new v_bar."""

    def __init__(self, global_model: nn.Module, local_model: nn.Module, mixed: nn.Module, alpha: float,
                 adapt_alpha: bool, lr: float, cfg: FedPACConfig) -> None:
        super().__init__([*global_model.parameters(), *local_model.parameters()], lr=lr, momentum=cfg.momentum,
                         weight_decay=cfg.weight_decay)
        self.models = (global_model, local_model, mixed)
        self.alpha = alpha
        self.adapt_alpha = adapt_alpha
        self.alpha_lr = lr
        self.remix()

    @torch.no_grad()
    def remix(self) -> None:
        """The stand-in's parameters := alpha v + (1 - alpha) w."""
        global_model, local_model, mixed = (dict(m.named_parameters()) for m in self.models)
        for key, value in mix(local_model, global_model, self.alpha).items():
            mixed[key].copy_(value)

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        self.models[2].zero_grad(set_to_none)

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        global_model, local_model, mixed = (dict(m.named_parameters()) for m in self.models)
        gradient = {key: q.grad if q.grad is not None else torch.zeros_like(q) for key, q in mixed.items()}
        alpha = self.alpha
        if self.adapt_alpha:  # from this step's v and w, as v's step
            self.alpha = alpha_step(alpha, alpha_gradient(local_model, global_model, gradient), self.alpha_lr)
        for key, q in local_model.items():
            q.grad = alpha * gradient[key]
        loss = super().step(closure)
        self.remix()
        return loss


@dataclass(frozen=True)
class APFLRound:
    """What a round of APFL's local epochs measured and left: the global model's mean loss, the
    personalized model's, and alpha after the last step."""

    global_loss: float
    personal_loss: float
    alpha: float


def apfl_epochs(  # pylint: disable=too-many-arguments
    global_model: FedPACNet, local_model: FedPACNet, alpha: float, adapt_alpha: bool, x: torch.Tensor,
    y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator, mixing: str = PARAMETERS,
) -> APFLRound:
    """``local-epochs`` epochs of APFL's steps on w (``global_model``) and v (``local_model``),
    both trained in place, at the baselines' step size eta (``extractor-lr``), which alpha's
    step takes too (the paper's one step size). ``mixing``: the personalized model's outputs are
    those of v_bar (``parameters``), alpha v(x) + (1 - alpha) w(x) (``outputs``) or v's own
    (``rounds``, after which v := (1 - alpha) w + alpha v); alpha adapts only with ``parameters``."""
    optimizer: APFLStep | torch.optim.SGD
    if mixing in (OUTPUTS, ROUNDS):
        optimizer = torch.optim.SGD([*global_model.parameters(), *local_model.parameters()], lr=cfg.extractor_lr,
                                    momentum=cfg.momentum, weight_decay=cfg.weight_decay)
        trained = nn.ModuleList([global_model, local_model])

        def personal_logits(inputs: torch.Tensor, global_logits: torch.Tensor) -> torch.Tensor:
            if mixing == ROUNDS:
                return local_model(inputs)
            return alpha * local_model(inputs) + (1.0 - alpha) * global_logits.detach()
    else:
        mixed = copy.deepcopy(global_model)
        optimizer = APFLStep(global_model, local_model, mixed, alpha, adapt_alpha, cfg.extractor_lr, cfg)
        trained = nn.ModuleList([global_model, mixed])

        def personal_logits(inputs: torch.Tensor, global_logits: torch.Tensor) -> torch.Tensor:
            del global_logits
            return mixed(inputs)
    trained.train()
    local_model.train()
    personal_total = torch.zeros((), device=x.device)
    seen = 0

    def batch_loss(idx: torch.Tensor) -> torch.Tensor:
        nonlocal personal_total, seen
        with autocast(x, cfg):
            global_logits = global_model(x[idx])
            mixed_logits = personal_logits(x[idx], global_logits)
        personal = F.cross_entropy(mixed_logits.float(), y[idx])
        personal_total += personal.detach() * len(idx)
        seen += len(idx)
        return F.cross_entropy(global_logits.float(), y[idx]) + personal

    total = sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(x), cfg.batch_size, generator, x.device, trained)
    if mixing == ROUNDS:
        local_model.load_state_dict(mix(local_model.state_dict(), global_model.state_dict(), alpha))
    personal_loss = float(personal_total / seen) if seen else 0.0
    final_alpha = optimizer.alpha if isinstance(optimizer, APFLStep) else alpha
    return APFLRound(global_loss=total - personal_loss, personal_loss=personal_loss, alpha=final_alpha)


class Routine(ClientRoutine):
    """One round at a site: :func:`apfl_epochs` on the received global model and the site's local
    model; the global model goes back, the local model (and an adapted alpha) stay."""

    method: APFL

    def local_model(self, received: FedPACNet, state: SiteState) -> FedPACNet:
        """The site's local model v_i: the one it kept, or (before it first trained) a copy of
        the received global model."""
        return kept_model(received, state, LOCAL_MODEL)

    def mixing_weight(self, state: SiteState) -> float:
        """alpha_i: the site's own when it adapts (from its first round on), else the setting's."""
        kept = state.get(MIXING_WEIGHT) if self.method.adapt_alpha else None
        return self.method.alpha if kept is None else float(kept[ALPHA][0])

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        local = self.local_model(model, data.state)
        trained = apfl_epochs(model, local, self.mixing_weight(data.state), self.method.adapt_alpha, data.x, data.y,
                              cfg, generator, self.method.mixing)
        keep_model(data.state, LOCAL_MODEL, local)
        if self.method.adapt_alpha:
            data.state.put(MIXING_WEIGHT, {ALPHA: np.array([trained.alpha])})
        return ClientResult(num_examples=len(data.y), train_loss=trained.global_loss,
                            metrics={"personal-loss": trained.personal_loss})

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """APFL's personalized model: the kept local model mixed with the received global model,
        in parameter space (v_bar) or as one network computing the mix of their outputs, or the
        kept local model itself when it was mixed at the end of its round (the global model
        itself until the site first trained: v = w)."""
        del cfg, generator
        kept = data.state.get(LOCAL_MODEL)
        if kept is None:
            return copy.deepcopy(model)
        if self.method.mixing == ROUNDS:
            return with_arrays(model, kept)
        alpha = self.mixing_weight(data.state)
        if self.method.mixing == OUTPUTS:
            return output_mixture([with_arrays(model, kept), model], [alpha, 1.0 - alpha])
        device = next(model.parameters()).device
        local = {key: torch.as_tensor(value, device=device) for key, value in kept.items()}
        received = {key: value.detach() for key, value in model.state_dict().items()}
        return with_arrays(model, mix(local, received, alpha))
