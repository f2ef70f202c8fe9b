"""pFedMe: one round's local update (K inner steps of theta_i per minibatch, then w_i's step towards
it) against a from-scratch implementation of the paper's rule, in a round where the site keeps a
personalized model that differs from the received global one; theta_i kept at the site and
evaluated, w_i sent back; the server's beta step; the settings and the refusal of DP; and a short
federation that learns."""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.serverapp import Grid
from torch.func import functional_call

from client_app.app import client_tensors
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, SiteState, client_routine
from common.methods.pfedme import PFedMe
from common.methods.pfedme.client import PERSONAL_MODEL
from common.methods.server import EXTRACTOR, HEAD, Update, server_part
from common.model import FedPACNet, split_state
from federation import InProcessGrid
from server_app.app import run_fedpac

CFG = FedPACConfig(strategy="pfedme", local_epochs=2, batch_size=8, extractor_lr=0.05, weight_decay=5e-4)
METHOD = PFedMe("pfedme", lam=2.0, k=3, personal_lr=0.05)

Params = dict[str, torch.Tensor]


def _model(seed: int) -> FedPACNet:
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10)


def _data(kept: SiteState | None = None) -> LocalData:
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(16, 1, 28, 28, generator=generator)
    y = torch.arange(16) % 4
    return LocalData(x, y, x[:8], y[:8], kept if kept is not None else SiteState())


def _params(model: FedPACNet) -> Params:
    return {name: q.detach().clone() for name, q in model.named_parameters()}


def reference_round(model: FedPACNet, w: Params, x: torch.Tensor, y: torch.Tensor, seed: int, cfg: FedPACConfig
                    ) -> tuple[Params, Params, float]:
    """Algorithm 1 of the paper from scratch: theta and w_i start at the received w; per
    minibatch, K steps theta <- theta - lr_p (grad f(theta) + lambda (theta - w_i) + mu theta)
    (mu: the weight decay), then w_i <- w_i - eta lambda (w_i - theta), through a momentum
    buffer b <- m b + lambda (w_i - theta) when the config has momentum m (m = 0: the paper's
    rule). Returns (w_i, theta, the mean minibatch loss over the inner steps)."""
    lam, steps, lr_p, eta, mu = METHOD.lam, METHOD.k, METHOD.personal_lr, cfg.extractor_lr, cfg.weight_decay
    local = {k: v.clone() for k, v in w.items()}
    buffer = {k: torch.zeros_like(v) for k, v in w.items()}
    theta = {k: v.clone() for k, v in w.items()}
    generator = torch.Generator().manual_seed(seed)
    losses = []
    for _ in range(cfg.local_epochs):
        for idx in torch.randperm(len(x), generator=generator).split(cfg.batch_size):
            for _ in range(steps):
                leaves = {k: v.clone().requires_grad_(True) for k, v in theta.items()}
                loss = F.cross_entropy(functional_call(model, leaves, (x[idx],)), y[idx])
                grads = torch.autograd.grad(loss, list(leaves.values()))
                theta = {k: theta[k] - lr_p * (g + lam * (theta[k] - local[k]) + mu * theta[k])
                         for k, g in zip(leaves, grads)}
                losses.append(float(loss.detach()))
            buffer = {k: cfg.momentum * buffer[k] + lam * (local[k] - theta[k]) for k in local}
            local = {k: local[k] - eta * buffer[k] for k in local}
    return local, theta, float(np.mean(losses))


def _close(a: Params, b: dict, what: str) -> None:
    for key, value in a.items():
        torch.testing.assert_close(torch.as_tensor(b[key]), value, atol=1e-6, rtol=1e-5, msg=f"{what} {key}")


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_a_second_round_starts_from_the_received_model_and_follows_the_paper_s_rule(momentum):
    """Round 2: the site kept theta_i from round 1 (another model than the received w). Both
    theta_i and w_i start at w; what goes back is w_i, what the site keeps and evaluates is
    theta_i, each as the from-scratch rule computes them (momentum 0: the paper's rule exactly;
    0.5: the baselines' momentum on w_i's step)."""
    cfg = dataclasses.replace(CFG, momentum=momentum)
    received = _model(0)
    kept_theta = {k: v.numpy() for k, v in _model(1).state_dict().items()}
    data = _data(SiteState({PERSONAL_MODEL: kept_theta}))
    model = copy.deepcopy(received)
    result = client_routine(METHOD).local_update(model, data, Received(server_round=2), cfg,
                                                 torch.Generator().manual_seed(3))
    local, theta, loss = reference_round(received, _params(received), data.x, data.y, 3, cfg)
    _close(local, dict(model.named_parameters()), "w_i")
    kept = data.state.get(PERSONAL_MODEL)
    assert kept is not None and set(kept) == set(received.state_dict())
    _close(theta, kept, "theta_i")
    assert result.train_loss == pytest.approx(loss, rel=1e-5)
    assert result.num_examples == 16 and not result.statistics and not result.metrics
    # theta_i and w_i differ (w_i took eta * lambda = 0.1 of each step towards theta_i)
    assert all(not torch.allclose(local[k], theta[k]) for k in local)
    # the personalized model evaluated is theta_i; before the site ever trained, the received model
    routine = client_routine(METHOD)
    evaluated = routine.before_evaluation(received, data, CFG, torch.Generator())
    _close(theta, dict(evaluated.named_parameters()), "evaluated")
    fresh = routine.before_evaluation(received, _data(), CFG, torch.Generator())
    assert fresh is not received and all(torch.equal(a, b) for a, b in zip(fresh.parameters(), received.parameters()))


def test_lambda_pulls_the_local_model_and_k_steps_move_theta():
    """A larger lambda keeps theta_i nearer w_i; with lambda small, w_i barely moves (its step is
    eta * lambda of the way)."""
    received = _model(0)
    start = _params(received)

    def run(lam: float) -> tuple[float, float]:
        data = _data()
        model = copy.deepcopy(received)
        client_routine(dataclasses.replace(METHOD, lam=lam)).local_update(model, data, Received(), CFG,
                                                                          torch.Generator().manual_seed(0))
        theta = data.state.get(PERSONAL_MODEL)
        assert theta is not None
        gap = sum(float((torch.as_tensor(theta[k]) - q.detach()).square().sum()) for k, q in model.named_parameters())
        moved = sum(float((q.detach() - start[k]).square().sum()) for k, q in model.named_parameters())
        return gap, moved

    (gap_small, moved_small), (gap_large, moved_large) = run(0.1), run(5.0)
    assert gap_large < gap_small
    assert moved_small < moved_large


def _server_updates(extractor, head, values: list[float]) -> list[Update]:
    return [Update(partition_id=i, num_examples=10, metrics={},
                   extractor={k: np.full_like(v, value) for k, v in extractor.items()},
                   head={k: np.full_like(v, value) for k, v in head.items()})
            for i, value in enumerate(values)]


@pytest.mark.parametrize("beta", [1.0, 0.5, 2.0])
def test_the_server_moves_the_global_model_beta_of_the_way_to_the_clients_mean(beta):
    extractor, head = split_state({k: v.numpy() for k, v in _model(0).state_dict().items()})
    server = server_part(PFedMe("pfedme", beta=beta), CFG, extractor, head)
    state = server.initial_state()
    state.shared[EXTRACTOR] = {k: np.full_like(v, 1.0) for k, v in extractor.items()}
    state.shared[HEAD] = {k: np.full_like(v, 1.0) for k, v in head.items()}
    updates = _server_updates(extractor, head, [2.0, 4.0, 8.0])
    weights = np.array([1.0, 1.0, 2.0])  # the mean: (2 + 4 + 16) / 4 = 5.5
    server.step(state, updates, weights, server_round=2)
    expected = (1 - beta) * 1.0 + beta * 5.5  # by hand
    for section, template in ((EXTRACTOR, extractor), (HEAD, head)):
        for key, value in template.items():
            got = state.shared[section][key]
            assert got.dtype == value.dtype and got.shape == value.shape
            np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_the_settings_come_from_the_run_config_and_are_checked():
    assert METHODS["pfedme"] == PFedMe("pfedme", lam=10.0, k=5, personal_lr=0.09, beta=1.0)
    assert METHODS["pfedme"].keeps_site_state
    cfg = parse_run_config({"strategy": "pfedme", "pfedme-lambda": 15.0, "pfedme-k": 3, "pfedme-beta": 2.0,
                            "pfedme-personal-lr": 0.01})
    assert configured_method(cfg) == PFedMe("pfedme", lam=15.0, k=3, personal_lr=0.01, beta=2.0)
    assert parse_run_config({"pfedme-k": 5}).method_settings == ()  # the default is not recorded
    for key, bad, reason in (("pfedme-lambda", 0.0, "must be > 0"), ("pfedme-k", 0, "must be >= 1"),
                             ("pfedme-personal-lr", -0.1, "must be > 0"), ("pfedme-beta", 0.0, "must be > 0")):
        with pytest.raises(ConfigError, match=f"run config '{key}' = .* is invalid: {reason}"):
            parse_run_config({"strategy": "fedavg", key: bad})
    with pytest.raises(ConfigError, match="wrong type"):
        parse_run_config({"pfedme-k": 2.5})
    with pytest.raises(ValueError, match="whole number"):
        PFedMe("pfedme", k=2.0)


def test_differential_privacy_is_refused_with_the_reason():
    with pytest.raises(ConfigError, match="run config 'dp' = True is invalid: must be false with strategy 'pfedme': "
                                          "pFedMe's K inner steps all read the same minibatch"):
        parse_run_config({"strategy": "pfedme", "dp": True})


def test_a_short_federation_learns_and_the_sites_evaluate_their_personalized_models(tmp_path):
    """Three clients of the embedded MNIST-5k (FedPAC's label-skewed partition), three rounds:
    the global model moves from the initial one, and every client's personalized model is far
    above guessing and its majority label."""
    config = {"strategy": "pfedme", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    strategy, report = run_fedpac(cast(Grid, InProcessGrid(config, 3)), cfg, 1)
    accuracy = [float(np.mean(list(r.accuracy.values()))) for r in report.rounds]
    last = report.rounds[-1].accuracy
    assert sorted(last) == [0, 1, 2]
    majority = [float(torch.bincount(client_tensors(cfg, pid, 3, torch.device("cpu"))[3]).max()) / 50
                for pid in range(3)]
    # w_i moves by eta * lambda (w_i - theta_i), about eta * grad f(theta_i) (the inner solution's
    # reach is ~1 / lambda): FedAvg's pace, and three rounds take it well past the label skew
    assert accuracy[-1] >= float(np.mean(majority)) + 0.15 and accuracy[-1] >= accuracy[0] + 0.05, (accuracy, majority)
    assert not strategy.state.personal  # nothing per client on the server: theta_i stays at the site
