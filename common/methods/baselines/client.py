"""The baselines' local update: the whole model for ``local-epochs`` epochs (FedAvg, FedAvg-FT,
FedPer, Local-only; the authors' ``local_training``), or FedRep's head-then-body epochs; and
FedAvg-FT's fine-tuning of the received head before each evaluation."""

from __future__ import annotations

import copy

import torch

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.baselines import Baseline
from common.model import FedPACNet
from common.training import train_extractor, train_head, train_joint


def representation_update(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> tuple[float, float]:
    """FedRep's round: ``fedrep-head-epochs`` epochs of the head on frozen features, then
    ``fedrep-body-epochs`` epochs of the body with the head frozen, both at the baselines' step
    size unless ``fedrep-head-lr`` sets the head's. Returns (body loss, head loss)."""
    head_lr = cfg.fedrep_head_lr or cfg.extractor_lr
    head_loss = train_head(model, x, y, cfg, generator, epochs=cfg.fedrep_head_epochs, lr=head_lr)
    train_loss, _ = train_extractor(model, x, y, cfg, generator, epochs=cfg.fedrep_body_epochs,
                                    with_head=cfg.head_with_extractor)
    return train_loss, head_loss


def finetune_head(
    model: FedPACNet, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig, generator: torch.Generator
) -> float:
    """FedAvg-FT's local fine-tuning before evaluation: ``finetune-epochs`` epochs of the head
    on the local training data, extractor frozen, at the baselines' step size."""
    return train_head(model, x, y, cfg, generator, epochs=cfg.finetune_epochs, lr=cfg.extractor_lr)


class Routine(ClientRoutine):
    """A baseline's round; nothing but the model and n_i travels back."""

    method: Baseline

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        if self.method.representation:
            train_loss, head_loss = representation_update(model, data.x, data.y, cfg, generator)
            return ClientResult(num_examples=len(data.y), train_loss=train_loss, metrics={"head-loss": head_loss})
        return ClientResult(num_examples=len(data.y), train_loss=train_joint(model, data.x, data.y, cfg, generator))

    def before_evaluation(self, model: FedPACNet, data: LocalData, cfg: FedPACConfig,
                          generator: torch.Generator) -> FedPACNet:
        """FedAvg-FT evaluates a copy of the received model with its head fine-tuned on the local
        training data; nothing of that goes back (a train message goes on to train the model as
        received)."""
        if not self.method.finetune_before_evaluation:
            return model
        model = copy.deepcopy(model)
        finetune_head(model, data.x, data.y, cfg, generator)
        return model
