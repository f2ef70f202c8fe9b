"""pFedHN's local update: the generated model theta_i trained as FedAvg's clients train theirs
(the whole model, or pFedHN-PC's generated extractor with the head kept at the site); the trained
model goes back, and the server turns theta~_i - theta_i into the hypernetwork's step."""

from __future__ import annotations

import torch

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.pfedhn import PFedHN
from common.model import FedPACNet
from common.training import train_joint


class Routine(ClientRoutine):
    """``local-epochs`` epochs of the whole model on CE at the baselines' step size (the FedPAC
    paper's client step 0.01): nothing but the model and n_i travels back."""

    method: PFedHN

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        return ClientResult(num_examples=len(data.y), train_loss=train_joint(model, data.x, data.y, cfg, generator))
