"""FedBABU's client: the body's epochs through the fixed, never trained head; and before each
evaluation, a copy of the received model (body and head) fine-tuned on the local training data."""

from __future__ import annotations

import copy
import dataclasses

import torch

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.fedbabu import FedBABU
from common.model import FedPACNet
from common.training import train_extractor, train_joint


def finetune(model: FedPACNet, data: LocalData, cfg: FedPACConfig, generator: torch.Generator,
             epochs: int) -> float:
    """The personalization: ``epochs`` epochs of the whole model (body and head) on plain CE over
    the local training data, in place, with the local update's optimizer (the baselines' step
    size eta, batch size, momentum, weight decay). Returns the mean CE."""
    return train_joint(model, data.x, data.y, dataclasses.replace(cfg, local_epochs=epochs), generator)


class Routine(ClientRoutine):
    """One round at a site: ``local-epochs`` epochs of the body on CE at the baselines' step size,
    the head frozen (it goes back bit for bit as received)."""

    method: FedBABU

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        train_loss, _ = train_extractor(model, data.x, data.y, cfg, generator)
        return ClientResult(num_examples=len(data.y), train_loss=train_loss)

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """A copy of the received model fine-tuned ``babu-finetune-epochs`` epochs; the received
        one is left as it is (with fused evaluation, the train step then trains it)."""
        if self.method.finetune_epochs == 0:
            return model
        model = copy.deepcopy(model)
        finetune(model, data, cfg, generator, self.method.finetune_epochs)
        return model
