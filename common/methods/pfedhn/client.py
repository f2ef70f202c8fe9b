"""pFedHN's local update: the generated model theta_i trained as FedAvg's clients train theirs
(the whole model, or pFedHN-PC's generated extractor with the head kept at the site); the trained
model goes back, and the server turns theta~_i - theta_i into the hypernetwork's step. The
trained model's accuracy on the site's test split goes back too: the run reports the generated
models' (what pFedHN's authors evaluate) and these beside them (the "local models" a benchmark
may mean instead)."""

from __future__ import annotations

import torch

from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.pfedhn import PFedHN
from common.model import FedPACNet
from common import protocol as p
from common.training import evaluate, train_joint


class Routine(ClientRoutine):
    """``local-epochs`` epochs of the whole model on CE at the baselines' step size (the FedPAC
    paper's client step 0.01): the model, n_i and the trained model's test accuracy travel back."""

    method: PFedHN

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        train_loss = train_joint(model, data.x, data.y, cfg, generator)
        local_loss, local_accuracy = evaluate(model, data.x_test, data.y_test)
        # the accuracy is made of the test split, not of the training records: under DP it is sent
        # too, the loss (a diagnostic) is not
        return ClientResult(num_examples=len(data.y), train_loss=train_loss,
                            metrics={p.LOCAL_LOSS: local_loss, p.LOCAL_ACCURACY: local_accuracy},
                            for_server=(p.LOCAL_ACCURACY,))
