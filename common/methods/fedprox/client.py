"""FedProx's local update: FedAvg's epochs of the whole model, plus the proximal term
(mu / 2) ||w - w^t||^2 towards the received global model w^t in every step's loss."""

from __future__ import annotations

from functools import partial

import torch

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.fedprox import FedProx
from common.model import FedPACNet
from common.training import parameters_of, proximal_term, train_joint


class Routine(ClientRoutine):
    """``local-epochs`` epochs of CE + (mu / 2) ||w - w^t||^2 at the baselines' step size."""

    method: FedProx

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        penalty = partial(proximal_term, model, parameters_of(model), self.method.mu)
        train_loss = train_joint(model, data.x, data.y, cfg, generator, penalty=penalty)
        return ClientResult(num_examples=len(data.y), train_loss=train_loss)
