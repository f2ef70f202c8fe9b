"""pFedVEM's local update (Algorithm 1; the authors' ``vem/vem_client.py``), in the code's order."""

from __future__ import annotations

import numpy as np
import torch

from common import protocol as p
from common.config import FedPACConfig
from common.methods.client import ClientResult, ClientRoutine, LocalData, Received
from common.methods.pfedvem import PFedVEM
from common.model import FedPACNet
from common.training import autocast, evaluate, extract_features, sgd_epochs, to_numpy
from common.methods.pfedvem.variational import GaussianHead, confidence_rho, e_step, sampled_mean_nll, softplus_inverse

# What the site keeps: its posterior's scales s_j, under the head's keys, in nn.Linear's layout.
POSTERIOR_SCALES = "pfedvem-posterior-scales"


class Routine(ClientRoutine):
    """pFedVEM's round.

    ``model`` holds the global base theta^t and, as its head, the client's posterior mean mu_j;
    section ``posterior`` the prior mean w^t. The posterior scales s_j never leave the site: it
    keeps them between rounds (``SiteState``; s^0 = softplus^-1(``vem-initial-sigma``) before its
    first round). All three are in ``nn.Linear``'s layout and are transposed once, into
    :class:`GaussianHead`'s (d, K).

    1. rho_j (eq. 7) from the posterior as it came out of the client's last round, against the
       new w^t: the prior's scale in this round's E-step and the client's weight on the server.
    2. E-step: ``vem-head-steps`` full-batch SGD steps on (mu, s) against the negative ELBO
       (summed NLL over ``vem-mc-samples`` reparameterized heads + closed-form KL), the features
       computed once with the frozen base; a NaN loss restores the posterior.
    3. The base, head fixed: ``local-epochs`` epochs of minibatches of ``vem-batch-size``, the
       loss averaged over ``vem-mc-samples`` fresh head samples per minibatch.
    4. pFedVEM's own evaluation: the locally trained model (the local base with the posterior
       mean), before the server aggregates anything, on the client's test split.

    The model leaves holding theta_j and mu_j (the server averages them); the scales stay. Like
    the code, no weight decay.
    """

    method: PFedVEM

    def local_update(self, model: FedPACNet, data: LocalData, received: Received, cfg: FedPACConfig,
                     generator: torch.Generator) -> ClientResult:
        x, y = data.x, data.y
        posterior = {key: torch.as_tensor(np.array(value), device=x.device)
                     for key, value in received.sections.get(p.POSTERIOR, {}).items()}
        kept = data.state.get(POSTERIOR_SCALES)
        if kept is None:
            initial = softplus_inverse(cfg.vem_initial_sigma)
            scales = [torch.full_like(model.head.weight, initial), torch.full_like(model.head.bias, initial)]
        else:
            scales = [torch.as_tensor(kept[key], device=x.device) for key in (p.HEAD_WEIGHT, p.HEAD_BIAS)]
        head = GaussianHead.from_linear(model.head.weight, model.head.bias, *scales)
        prior_weight, prior_bias = posterior[p.PRIOR_WEIGHT].T, posterior[p.PRIOR_BIAS]  # (K, d) -> (d, K)
        rho = confidence_rho(head, prior_weight, prior_bias)
        model.train()
        features = extract_features(model.extractor, x)
        estep = e_step(head, features, y, prior_weight, prior_bias, rho, steps=cfg.vem_head_steps,
                       lr=cfg.vem_head_lr, momentum=cfg.vem_momentum, n_mc=cfg.vem_mc_samples, generator=generator)

        optimizer = torch.optim.SGD(model.extractor.parameters(), lr=cfg.vem_base_lr, momentum=cfg.vem_momentum)

        def batch_loss(idx: torch.Tensor) -> torch.Tensor:
            with autocast(x, cfg):
                features = model.extractor(x[idx])
            return sampled_mean_nll(head, features.float(), y[idx], cfg.vem_mc_samples, generator)

        train_loss = sgd_epochs(optimizer, batch_loss, cfg.local_epochs, len(x), cfg.vem_batch_size, generator,
                                x.device, model.extractor)

        weight_mu, bias_mu = head.linear_mean()  # (d, K) -> nn.Linear's (K, d)
        with torch.no_grad():
            model.head.weight.copy_(weight_mu)
            model.head.bias.copy_(bias_mu)
        weight_s, bias_s = head.linear_scale()
        data.state.put(POSTERIOR_SCALES, {p.HEAD_WEIGHT: to_numpy(weight_s), p.HEAD_BIAS: to_numpy(bias_s)})
        local_loss, local_accuracy = evaluate(model, data.x_test, data.y_test)
        return ClientResult(
            num_examples=len(y),
            train_loss=train_loss,
            metrics={"head-loss": estep.train_loss, p.RHO: rho, "posterior-restored": int(estep.restored),
                     p.LOCAL_LOSS: local_loss, p.LOCAL_ACCURACY: local_accuracy},
            # rho is made of the private posterior, the accuracy of the test split
            for_server=(p.RHO, p.LOCAL_ACCURACY),
        )
