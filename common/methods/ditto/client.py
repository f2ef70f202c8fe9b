"""Ditto's local update (Algorithm 1 of the paper): the personal model's epochs against the
received global model, then the global model's epochs as in FedAvg. Only the global model goes
back to the server."""

from __future__ import annotations

from functools import partial

import torch

from common.config import FedPACConfig
from common.methods.client import (ClientResult, ClientRoutine, LocalData, Received, SiteState, keep_model, kept_model)
from common.methods.ditto import Ditto
from common.model import FedPACNet
from common.training import parameters_of, proximal_term, train_joint

PERSONAL_MODEL = "ditto-personal-model"


def personal_model(received: FedPACNet, state: SiteState) -> FedPACNet:
    """The site's personal model v_k: the one it kept, or (first round) a copy of the received
    global model."""
    return kept_model(received, state, PERSONAL_MODEL)


class Routine(ClientRoutine):
    """One round at a site: ``local-epochs`` epochs of the personal model on CE + (lambda / 2)
    ||v - w^t||^2 (kept at the site), then ``local-epochs`` epochs of the received global model
    on CE (sent back). Both at the baselines' step size."""

    method: Ditto

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        personal = personal_model(model, data.state)
        pull = partial(proximal_term, personal, parameters_of(model), self.method.lam)
        personal_loss = train_joint(personal, data.x, data.y, cfg, generator, penalty=pull)
        keep_model(data.state, PERSONAL_MODEL, personal)
        train_loss = train_joint(model, data.x, data.y, cfg, generator)
        return ClientResult(num_examples=len(data.y), train_loss=train_loss, metrics={"personal-loss": personal_loss})

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """Ditto's personalized model is the personal one (the global model until the site first
        trained)."""
        return personal_model(model, data.state)
