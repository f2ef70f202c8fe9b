"""FedProx and Ditto: the proximal term's value and gradient, FedProx's local update as FedAvg's
plus that pull, Ditto's personal model trained towards the received global model and kept at the
site (never in the reply), evaluated in the global model's place; and their settings."""

from __future__ import annotations

import copy
import dataclasses
import os
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
from flwr.app import MessageType
from flwr.serverapp import Grid

from client_app.app import _generator, client_tensors, current_concept
from common import protocol as p
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, SiteState, client_routine
from common.methods.ditto import Ditto
from common.methods.ditto.client import PERSONAL_MODEL
from common.methods.fedprox import FedProx
from common.model import FedPACNet
from common.site_state import SiteStore
from common.training import parameters_of, proximal_term
from federation import InProcessGrid
from reference_sgd import Params, batches, loss_and_gradient, params_of, sgd_step
from server_app.app import run_fedpac

CFG = FedPACConfig(local_epochs=2, batch_size=8, extractor_lr=0.05)


def _setup(seed: int = 0) -> tuple[FedPACNet, LocalData]:
    torch.manual_seed(seed)
    model = FedPACNet(1, 28, 10)
    x = torch.randn(32, 1, 28, 28)
    y = torch.arange(32) % 4
    return model, LocalData(x, y, x[:8], y[:8])


def _update(method, model: FedPACNet, data: LocalData, seed: int = 0):
    return client_routine(method).local_update(model, data, Received(), CFG, torch.Generator().manual_seed(seed))


def _distance(model: FedPACNet, anchor: dict[str, torch.Tensor]) -> float:
    return float(sum((q.detach() - anchor[name]).square().sum() for name, q in model.named_parameters()))


def test_the_proximal_term_is_half_mu_times_the_squared_distance_and_pulls_towards_the_anchor():
    model, _ = _setup()
    anchor = {name: q.detach() + 0.5 for name, q in model.named_parameters()}
    count = sum(q.numel() for q in model.parameters())
    term = proximal_term(model, anchor, weight=0.2)
    assert float(term.detach()) == pytest.approx(0.5 * 0.2 * 0.25 * count, rel=1e-5)
    term.backward()
    for name, q in model.named_parameters():  # d/dw (mu/2)||w - a||^2 = mu (w - a)
        torch.testing.assert_close(q.grad, 0.2 * (q.detach() - anchor[name]))
    frozen = parameters_of(model)
    with torch.no_grad():
        next(model.parameters()).add_(1.0)
    assert not torch.equal(frozen[next(iter(frozen))], next(model.parameters()))  # a copy, not a view


def test_fedprox_with_mu_0_is_fedavg_and_a_larger_mu_keeps_the_update_nearer_the_global_model():
    received, data = _setup()
    anchor = parameters_of(received)
    fedavg = copy.deepcopy(received)
    _update(METHODS["fedavg"], fedavg, data)
    distances = {}
    for mu in (0.0, 0.5, 5.0):
        model = copy.deepcopy(received)
        result = _update(FedProx("fedprox", mu=mu), model, data)
        assert result.num_examples == 32 and not result.statistics and not result.metrics
        distances[mu] = _distance(model, anchor)
        if mu == 0.0:
            for a, b in zip(model.parameters(), fedavg.parameters()):
                assert torch.equal(a, b)
    assert distances[0.0] > distances[0.5] > distances[5.0] > 0


def test_ditto_trains_a_personal_model_towards_the_received_global_one_and_keeps_it_at_the_site():
    received, data = _setup()
    anchor = parameters_of(received)
    global_model = copy.deepcopy(received)
    result = _update(Ditto("ditto", lam=1.0), global_model, data)
    kept = data.state.get(PERSONAL_MODEL)
    assert kept is not None and set(kept) == set(received.state_dict())
    # the model that goes back is the global model trained as FedAvg's (plain CE), not the personal one
    personal = copy.deepcopy(received)
    personal.load_state_dict({k: torch.as_tensor(v) for k, v in kept.items()})
    assert any(not torch.equal(a, b) for a, b in zip(personal.parameters(), global_model.parameters()))
    assert set(result.metrics) == {"personal-loss"} and not result.statistics
    # lambda pulls the personal model towards w^t: the larger, the nearer
    distances = []
    for lam in (0.0, 1.0, 10.0):
        _, fresh = _setup()
        _update(Ditto("ditto", lam=lam), copy.deepcopy(received), fresh)
        kept = fresh.state.get(PERSONAL_MODEL)
        model = copy.deepcopy(received)
        model.load_state_dict({k: torch.as_tensor(v) for k, v in kept.items()})
        distances.append(_distance(model, anchor))
    assert distances[0] > distances[1] > distances[2] > 0


def test_ditto_continues_the_personal_model_it_kept_and_evaluates_it():
    received, data = _setup()
    routine = client_routine(Ditto("ditto"))
    assert routine.before_evaluation(received, data, CFG, torch.Generator()) is not received  # a copy
    first = routine.before_evaluation(received, data, CFG, torch.Generator())
    for a, b in zip(first.parameters(), received.parameters()):  # nothing kept yet: the global model
        assert torch.equal(a, b)
    routine.local_update(copy.deepcopy(received), data, Received(), CFG, torch.Generator().manual_seed(0))
    after_one = data.state.get(PERSONAL_MODEL)
    evaluated = routine.before_evaluation(received, data, CFG, torch.Generator())
    for name, value in evaluated.state_dict().items():
        np.testing.assert_array_equal(value.numpy(), after_one[name])
    # the next round starts from the kept personal model, not from the received global one
    routine.local_update(copy.deepcopy(received), data, Received(), CFG, torch.Generator().manual_seed(1))
    fresh = LocalData(data.x, data.y, data.x_test, data.y_test)
    routine.local_update(copy.deepcopy(received), fresh, Received(), CFG, torch.Generator().manual_seed(1))
    continued, restarted = data.state.get(PERSONAL_MODEL), fresh.state.get(PERSONAL_MODEL)
    assert any(not np.array_equal(continued[k], restarted[k]) for k in continued)


def test_the_site_state_holds_what_it_was_given_and_what_is_put():
    state = SiteState({"x": {"a": np.arange(3.0)}})
    np.testing.assert_array_equal(state.get("x")["a"], np.arange(3.0))
    assert state.get("y") is None
    state.put("y", {"b": np.ones(2)})
    assert sorted(state.kept) == ["x", "y"]


def test_the_settings_come_from_the_run_config_and_are_checked():
    cfg = parse_run_config({"strategy": "fedprox", "prox-mu": 0.3, "ditto-lambda": 2.0})
    assert configured_method(cfg) == FedProx("fedprox", mu=0.3)
    assert configured_method(dataclasses.replace(cfg, strategy="ditto")) == Ditto("ditto", lam=2.0)
    # a knob left at its default is not recorded: runs of other methods keep their identity
    assert parse_run_config({"prox-mu": 0.01}).method_settings == ()
    with pytest.raises(ConfigError, match="run config 'prox-mu' = -1.0 is invalid: must be >= 0"):
        parse_run_config({"strategy": "fedavg", "prox-mu": -1.0})
    with pytest.raises(ConfigError, match="wrong type"):
        parse_run_config({"ditto-lambda": "1"})



def test_two_methods_cannot_declare_the_same_knob(monkeypatch):
    import common.config  # pylint: disable=import-outside-toplevel

    @dataclasses.dataclass(frozen=True)
    class Other(Ditto):
        pass

    monkeypatch.setattr(common.config, "METHODS", {"ditto": Ditto("ditto"), "other": Other("other")})
    with pytest.raises(ValueError, match="'ditto-lambda' is declared by both Ditto and Other"):
        common.config.method_settings()


def test_ditto_s_two_updates_draw_their_batches_from_the_round_s_generator_alone():
    """Both of Ditto's updates (the personal model's and the global model's) shuffle with the
    generator the round gives them: the same seed gives the same models whatever torch's global
    random state, so a run (and its resume) is reproducible."""
    trained = []
    for global_seed in (1, 2):
        received, data = _setup()
        torch.manual_seed(global_seed)
        model = copy.deepcopy(received)
        _update(Ditto("ditto", lam=0.5), model, data, seed=7)
        trained.append((model.state_dict(), data.state.get(PERSONAL_MODEL)))
    (first, personal_first), (second, personal_second) = trained
    assert all(torch.equal(first[k], second[k]) for k in first)
    assert all(np.array_equal(personal_first[k], personal_second[k]) for k in personal_first)


# ---------------------------------------------------------------------------- Ditto, from scratch


def reference_ditto_personal(net: FedPACNet, v: Params, w: Params, lam: float, x: torch.Tensor, y: torch.Tensor,
                             cfg: FedPACConfig, generator: torch.Generator) -> Params:
    """Ditto's personal update (Algorithm 1 of Li et al., 2021): E epochs of SGD on
    F_k(v) + (lambda / 2) ||v - w^t||^2, whose gradient is grad F_k(v) + lambda (v - w^t), pulled
    towards the *received* global model w^t (torch's momentum and weight decay, as the harness's
    SGD)."""
    buffers: Params = {}
    for idx in batches(len(y), cfg.batch_size, cfg.local_epochs, generator):
        _, grads = loss_and_gradient(net, v, x[idx], y[idx])
        pulled = {k: g + lam * (v[k] - w[k]) for k, g in grads.items()}
        v = sgd_step(v, pulled, buffers, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
    return v


def reference_sgd(net: FedPACNet, w: Params, x: torch.Tensor, y: torch.Tensor, cfg: FedPACConfig,
                  generator: torch.Generator) -> Params:
    """FedAvg's local update of the global model: E epochs of plain SGD on F_k(w)."""
    buffers: Params = {}
    for idx in batches(len(y), cfg.batch_size, cfg.local_epochs, generator):
        _, grads = loss_and_gradient(net, w, x[idx], y[idx])
        w = sgd_step(w, grads, buffers, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
    return w


def _assert_close(actual: dict, expected: Params) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(actual[key]), value.numpy(), rtol=1e-5, atol=1e-6, err_msg=key)


def test_ditto_s_second_round_is_the_paper_s_update_of_both_models():
    """Round 2 at a site whose kept personal model v differs from the global model w^t it
    received: v trains towards w^t (not towards where v itself started), then w^t trains on plain
    CE (no pull), each as a from-scratch SGD does, to 1e-6; the generator's draws go to the
    personal model's epochs first."""
    _, data = _setup()
    torch.manual_seed(1)
    received = FedPACNet(1, 28, 10)
    torch.manual_seed(2)
    kept = FedPACNet(1, 28, 10)
    data = dataclasses.replace(data, state=SiteState({PERSONAL_MODEL: {k: v.detach().numpy().copy()
                                                                       for k, v in kept.state_dict().items()}}))
    generator = torch.Generator().manual_seed(4)
    v = reference_ditto_personal(FedPACNet(1, 28, 10), params_of(kept), params_of(received), 2.0, data.x, data.y,
                                 CFG, generator)
    w = reference_sgd(FedPACNet(1, 28, 10), params_of(received), data.x, data.y, CFG, generator)

    model = copy.deepcopy(received)
    _update(Ditto("ditto", lam=2.0), model, data, seed=4)

    _assert_close(data.state.get(PERSONAL_MODEL), v)
    _assert_close({k: q.detach().numpy() for k, q in model.state_dict().items()}, w)


def test_ditto_s_client_app_continues_in_round_2_the_personal_model_it_kept_after_round_1(tmp_path):
    """Through the ClientApp and the site's disk (``common.site_state``): a two-round federation;
    each site's personal model after round 2 is round 1's kept one trained towards the global
    model round 2's message carried, on the site's data with the round's generator, from scratch."""
    config = {"strategy": "ditto", "samples-per-client": 40, "test-samples-per-client": 20, "local-epochs": 1,
              "batch-size": 20, "num-server-rounds": 2, "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    grid = InProcessGrid(config, 2)
    strategy, _ = run_fedpac(cast(Grid, grid), cfg, 1)
    for message in grid.sent:
        if message.metadata.message_type != MessageType.TRAIN or message.content[p.CONFIG][p.SERVER_ROUND] != 2:
            continue
        pid = grid.partition_of_node[message.metadata.dst_node_id]
        store = SiteStore(Path(os.environ["FLWR_HOME"]) / "fedpac-site-state", pid, strategy.lineage)
        after_one, after_two = store.load(1)[PERSONAL_MODEL], store.load(2)[PERSONAL_MODEL]
        w = {k: torch.as_tensor(v) for k, v in p.sections_of(message.content)[p.MODEL].items()}
        assert any(not np.array_equal(after_one[k], w[k].numpy()) for k in w)  # the two differ
        x, y, _, _ = client_tensors(cfg, pid, 2, torch.device("cpu"))
        expected = reference_ditto_personal(
            FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes),
            {k: torch.as_tensor(v) for k, v in after_one.items()}, w, configured_method(cfg).lam, x,
            current_concept(y, cfg, pid, 2), cfg, _generator(cfg, 2, pid))
        _assert_close(after_two, expected)
