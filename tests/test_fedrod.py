"""Fed-RoD: the balanced softmax loss; a second round's local update (the received generic model
and the kept personal head differ) against a from-scratch implementation of the paper's rule;
the personalized prediction (generic + personal logits) the site evaluates; what it sends and
keeps; its settings and DP; and a short federation that learns."""

from __future__ import annotations

import copy
import math
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.serverapp import Grid
from torch.func import functional_call

from client_app.app import client_tensors
from common import privacy
from common.config import FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.base import settings_of
from common.methods.client import LocalData, Received, client_routine
from common.methods.fedrod import FedRoD
from common.methods.fedrod.client import PERSONAL_HEAD, balanced_softmax_loss
from common.methods.server import ServerPart, server_part
from common.model import FedPACNet
from common.training import evaluate, extract_features
from federation import InProcessGrid, shared_model
from server_app.app import run_fedpac

# momentum and weight decay at the product's defaults (0.5, 5e-4): the reference applies them too
CFG = FedPACConfig(strategy="fedrod", local_epochs=2, batch_size=8, extractor_lr=0.05)
K = 10


def _data() -> LocalData:
    """A label-skewed site: classes 0-3 in proportions 12:8:8:4, the other six absent; each class
    a bright square in its own place."""
    torch.manual_seed(0)
    y = torch.tensor([0] * 12 + [1] * 8 + [2] * 8 + [3] * 4)
    x = 0.5 * torch.randn(len(y), 1, 28, 28)
    for k in range(4):
        row, col = divmod(k, 2)
        x[y == k, :, 14 * row + 3 : 14 * row + 11, 14 * col + 3 : 14 * col + 11] += 2.0
    return LocalData(x, y, x[::2], y[::2])


def _model(seed: int) -> FedPACNet:
    torch.manual_seed(seed)
    return FedPACNet(1, 28, K)


def _update(model: FedPACNet, data: LocalData, seed: int):
    return client_routine(METHODS["fedrod"]).local_update(model, data, Received(), CFG,
                                                          torch.Generator().manual_seed(seed))


# ------------------------------------------------------------------------- the reference rule


def _reference_round(received: FedPACNet, phi: dict[str, torch.Tensor], data: LocalData, cfg: FedPACConfig,
                     seed: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Fed-RoD's local update written from the paper: for each minibatch B (the product's
    shuffles: one permutation per epoch from the round's generator),

    * theta, psi <- SGD step on L_BR = mean_B -log softmax(psi(f(x)) + log n)_y (balanced risk);
    * phi <- SGD step on L_P = mean_B -log softmax(psi(f(x)) + phi(f(x)))_y, with f(x) and
      psi(f(x)) held constant (its gradient reaches phi alone);

    each SGD step g + wd * w into a momentum buffer (b <- m b + g), w <- w - lr b."""
    params = {name: p.detach().clone() for name, p in received.named_parameters()}
    personal = {name: t.detach().clone() for name, t in phi.items()}
    log_prior = torch.bincount(data.y, minlength=K).double().log().float()  # -inf for the absent classes
    buffers: dict[str, torch.Tensor] = {}

    def step(name: str, value: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
        grad = grad + cfg.weight_decay * value
        buffers[name] = grad if name not in buffers else cfg.momentum * buffers[name] + grad
        return value - cfg.extractor_lr * buffers[name]

    def nll(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return -torch.log_softmax(logits, dim=1)[torch.arange(len(y)), y].mean()

    generator = torch.Generator().manual_seed(seed)
    for _ in range(cfg.local_epochs):
        for idx in torch.randperm(len(data.x), generator=generator).split(cfg.batch_size):
            x, y = data.x[idx], data.y[idx]
            theta = {name: value.clone().requires_grad_() for name, value in params.items()}
            extractor = {name.removeprefix("extractor."): value for name, value in theta.items()
                         if name.startswith("extractor.")}
            z = functional_call(received.extractor, extractor, (x,))
            generic = z @ theta["head.weight"].T + theta["head.bias"]
            grads = torch.autograd.grad(nll(generic + log_prior, y), list(theta.values()))
            phi_now = {name: value.clone().requires_grad_() for name, value in personal.items()}
            combined = generic.detach() + z.detach() @ phi_now["weight"].T + phi_now["bias"]
            phi_grads = torch.autograd.grad(nll(combined, y), list(phi_now.values()))
            params = {name: step(name, params[name], g) for name, g in zip(theta, grads)}
            personal = {name: step("phi." + name, personal[name], g) for name, g in zip(phi_now, phi_grads)}
    return params, personal


def test_the_balanced_softmax_loss_is_the_cross_entropy_of_the_prior_shifted_logits():
    logits = torch.tensor([[1.0, 2.0, 0.5], [0.0, -1.0, 3.0]])
    y = torch.tensor([0, 2])
    log_prior = torch.tensor([math.log(3.0), 0.0, math.log(2.0)])
    expected = []
    for row, label in zip(logits.tolist(), y.tolist()):
        shifted = [v + p for v, p in zip(row, log_prior.tolist())]
        expected.append(-(shifted[label] - math.log(sum(math.exp(s) for s in shifted))))
    assert float(balanced_softmax_loss(logits, y, log_prior)) == pytest.approx(np.mean(expected), rel=1e-6)
    # a class the site lacks (log 0 = -inf) has probability 0 and gets no gradient
    shifted = logits[:1].clone().requires_grad_()
    loss = balanced_softmax_loss(shifted, y[:1], torch.tensor([3.0, 1.0, 0.0]).log())
    loss.backward()
    assert torch.isfinite(loss) and shifted.grad is not None and shifted.grad[0, 2] == 0.0
    # plain CE is the balanced loss of a uniform prior
    assert float(balanced_softmax_loss(logits, y, torch.zeros(3))) == pytest.approx(float(F.cross_entropy(logits, y)))


def test_a_second_round_is_the_papers_update_from_the_received_model_and_the_kept_personal_head():
    """Round 1 at a site leaves it a personal head; round 2 receives a different generic model
    (another seed's) and must train it, and the kept head, exactly as the reference does."""
    data = _data()
    _update(_model(0), data, seed=0)
    kept = data.state.get(PERSONAL_HEAD)
    assert kept is not None and set(kept) == {"weight", "bias"}
    assert np.abs(kept["weight"]).sum() > 0  # it trained (from zero)

    received = _model(1)
    model = copy.deepcopy(received)
    result = _update(model, data, seed=3)
    params, personal = _reference_round(received, {k: torch.as_tensor(v) for k, v in kept.items()}, data, CFG, seed=3)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), params[name], atol=1e-6, rtol=1e-5, msg=name)
    after = data.state.get(PERSONAL_HEAD)
    assert after is not None
    for name, value in personal.items():
        torch.testing.assert_close(torch.as_tensor(after[name]), value, atol=1e-6, rtol=1e-5, msg=name)
    assert result.num_examples == len(data.y) and set(result.metrics) == {"personal-loss"}
    assert not result.statistics and result.train_loss > 0 and result.metrics["personal-loss"] > 0


def test_the_first_round_starts_the_personal_head_at_zero():
    data = _data()
    received = _model(0)
    model = copy.deepcopy(received)
    _update(model, data, seed=0)
    zero = {"weight": torch.zeros(K, received.embedding_dim), "bias": torch.zeros(K)}
    params, personal = _reference_round(received, zero, data, CFG, seed=0)
    for name, value in model.named_parameters():
        torch.testing.assert_close(value.detach(), params[name], atol=1e-6, rtol=1e-5, msg=name)
    kept = data.state.get(PERSONAL_HEAD)
    assert kept is not None
    for name, value in personal.items():
        torch.testing.assert_close(torch.as_tensor(kept[name]), value, atol=1e-6, rtol=1e-5, msg=name)


# ------------------------------------------------------------------------ evaluation, traffic


def test_the_site_evaluates_generic_plus_personal_logits_and_the_generic_model_before_it_trained():
    data = _data()
    routine = client_routine(METHODS["fedrod"])
    received = _model(2)
    assert routine.before_evaluation(received, data, CFG, torch.Generator()) is received  # no personal head yet
    _update(copy.deepcopy(received), data, seed=0)
    kept = data.state.get(PERSONAL_HEAD)
    assert kept is not None
    before = {k: v.clone() for k, v in received.state_dict().items()}
    evaluated = routine.before_evaluation(received, data, CFG, torch.Generator())
    assert all(torch.equal(before[k], v) for k, v in received.state_dict().items())  # a copy: untouched
    features = extract_features(received.extractor, data.x_test)
    with torch.no_grad():
        personal = features @ torch.as_tensor(kept["weight"]).T + torch.as_tensor(kept["bias"])
        expected = received.head(features) + personal
        torch.testing.assert_close(evaluated(data.x_test), expected, atol=1e-5, rtol=1e-5)
    loss, accuracy = evaluate(evaluated, data.x_test, data.y_test)
    assert loss == pytest.approx(float(F.cross_entropy(expected, data.y_test)), rel=1e-5)
    assert accuracy == pytest.approx(float((expected.argmax(1) == data.y_test).float().mean()))
    # the evaluated model is an ordinary one (what a site saves): the generic model's keys and shapes
    assert {k: v.shape for k, v in evaluated.state_dict().items()} == {k: v.shape for k, v in before.items()}


def test_it_sends_the_generic_model_and_keeps_the_personal_head_at_the_site():
    method = METHODS["fedrod"]
    assert isinstance(method, FedRoD) and method.keeps_site_state
    assert method.shared_parts == ("extractor", "head") and method.site_parts == ()
    assert type(server_part(method, CFG, {}, {})) is ServerPart  # FedAvg's server
    data = _data()
    _update(_model(0), data, seed=0)
    assert sorted(data.state.kept) == [PERSONAL_HEAD]


def test_the_method_has_no_knob_and_runs_with_dp():
    assert settings_of(FedRoD) == {}
    assert configured_method(parse_run_config({"strategy": "fedrod"})) == FedRoD("fedrod")
    assert parse_run_config({"strategy": "fedrod", "dp": True}).dp


def test_with_dp_every_step_is_dp_sgd_and_the_class_prior_a_release():
    """The whole update (extractor, generic and personal heads) runs under DP-SGD: the ledger
    records the class counts' release and the steps; a site's personal head trains."""
    data = _data()
    model = _model(0)
    with privacy.private_site(privacy.PrivacySettings(), noise_seed=5) as site:
        _update(model, data, seed=0)
    sigmas = [sigma for sigma, _, _ in site.ledger.history]
    assert 10.0 in sigmas and 1.0 in sigmas, site.ledger.history  # the counts (statistics noise) and DP-SGD
    kept = data.state.get(PERSONAL_HEAD)
    assert kept is not None and np.isfinite(kept["weight"]).all() and np.abs(kept["weight"]).sum() > 0
    assert all(torch.isfinite(p).all() for p in model.parameters())


# -------------------------------------------------------------------------------- federation


def test_a_short_federation_learns_and_personalizes(tmp_path):
    """Three clients of the embedded MNIST-5k (FedPAC's label-skewed partition), three rounds:
    every client's personalized accuracy is far above its majority label, and on average above
    the generic model's (the personal heads add each site's label skew)."""
    config = {"strategy": "fedrod", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    strategy, report = run_fedpac(cast(Grid, InProcessGrid(config, 3)), cfg, 1)
    last = report.rounds[-1].accuracy
    assert sorted(last) == [0, 1, 2]
    model = shared_model(strategy.state, cfg)
    generic = {}
    for pid in range(3):
        _, _, x_test, y_test = client_tensors(cfg, pid, 3, torch.device("cpu"))
        majority = float(torch.bincount(y_test).max()) / len(y_test)
        assert last[pid] >= majority + 0.2, (pid, last[pid], majority)
        generic[pid] = evaluate(model, x_test, y_test)[1]
    assert float(np.mean(list(last.values()))) >= 0.7, [r.accuracy for r in report.rounds]
    assert np.mean(list(last.values())) > np.mean(list(generic.values())), (last, generic)
