"""LG-FedAvg and APFL (two of the FedPAC paper's Table 1 baselines).

LG-FedAvg: each site's feature extractor stays at home and the head is averaged; a second round
trains the site's kept extractor with the received global head exactly as a from-scratch SGD
does, and the server's head is the sample-weighted mean of the replies'.

APFL: per minibatch, w steps on its own loss and the local model v on the loss of the mixed
model v_bar = alpha v + (1 - alpha) w (alpha by its gradient when it adapts); compared, in a
second round where the kept v differs from the received w, with a from-scratch implementation of
the paper's Algorithm 1, with the mixed outputs of its authors' code (``apfl-mixing =
"outputs"``) and with PFLlib's once-a-round mixture (``apfl-mixing = "rounds"``); what it keeps
and sends; its settings; differential privacy; and short federations
that learn, one of whose sites save their output mixture as a model they can load.
"""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import MessageType
from flwr.serverapp import Grid
from torch.func import functional_call

from client_app.app import client_tensors
from client_app.site_model import SiteModel, load_site_model, predict, save_site_model
from common import privacy
from common import protocol as p
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.data import to_tensors
from common.methods import METHODS, Rule
from common.methods.apfl import APFL, MIXINGS, OUTPUTS, PARAMETERS, ROUNDS
from common.methods.apfl.client import ALPHA, LOCAL_MODEL, MIXING_WEIGHT, alpha_gradient, mix
from common.methods.client import SITE_PARTS, LocalData, Received, SiteState, client_routine, site_model_state
from common.methods.server import EXTRACTOR, HEAD, Update, server_part
from common.model import FedPACNet, output_mixture, split_state
from common.site_state import SiteStore
from federation import InProcessGrid
from reference_sgd import Params, batches, loss_and_gradient, params_of, sgd_step
from server_app.app import run_fedpac

CFG = FedPACConfig(local_epochs=2, batch_size=8, extractor_lr=0.05)  # momentum 0.5, weight decay 5e-4


def _data(seed: int = 0) -> LocalData:
    torch.manual_seed(seed)
    x = torch.randn(32, 1, 28, 28)
    y = torch.arange(32) % 4
    return LocalData(x, y, x[:8], y[:8])


def _net(seed: int) -> FedPACNet:
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10)


def _arrays(params: Params) -> dict[str, np.ndarray]:
    return {k: v.numpy() for k, v in params.items()}


def _assert_close(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        np.testing.assert_allclose(np.asarray(actual[key]), np.asarray(value), rtol=1e-5, atol=1e-6, err_msg=key)


# ---------------------------------------------------------------------------- LG-FedAvg


def test_lg_fedavg_keeps_the_extractor_at_the_site_and_averages_the_head():
    method = METHODS["lg-fedavg"]
    assert (method.extractor, method.head) == (Rule.LOCAL, Rule.AVERAGE)
    assert method.site_parts == ("extractor",) and method.shared_parts == ("head",)


def test_lg_fedavg_s_second_round_trains_the_kept_extractor_with_the_received_global_head():
    """Round 2 at a site: its own extractor (kept after round 1) under the global head the server
    sent, which was trained elsewhere; E epochs of the whole model, as a from-scratch SGD does.
    Only the head goes back."""
    method = METHODS["lg-fedavg"]
    kept_net, global_net, initial_net = _net(1), _net(2), _net(3)
    kept = {k: v.detach().numpy() for k, v in kept_net.state_dict().items()}
    received = {k: v.detach().numpy() for k, v in global_net.state_dict().items()}
    initial = {k: v.detach().numpy() for k, v in initial_net.state_dict().items()}
    state = site_model_state(method, received, kept, lambda: initial)
    extractor, head = split_state(state)
    _assert_close(extractor, split_state(kept)[0])  # the site's own, not the server's
    _assert_close(head, split_state(received)[1])
    model = FedPACNet(1, 28, 10)
    model.load_state_dict({k: torch.as_tensor(v) for k, v in state.items()})
    data = _data()

    # from scratch: plain CE on the whole model, SGD with momentum and weight decay
    params = {k: torch.as_tensor(v).clone() for k, v in state.items()}
    buffers: Params = {}
    for idx in batches(32, CFG.batch_size, CFG.local_epochs, torch.Generator().manual_seed(5)):
        _, grads = loss_and_gradient(model, params, data.x[idx], data.y[idx])
        params = sgd_step(params, grads, buffers, CFG.extractor_lr, CFG.momentum, CFG.weight_decay)

    result = client_routine(method).local_update(model, data, Received(server_round=2), CFG,
                                                 torch.Generator().manual_seed(5))
    _assert_close({k: v.detach().numpy() for k, v in model.state_dict().items()}, _arrays(params))
    assert not result.statistics and not result.metrics


def test_lg_fedavg_s_server_averages_the_heads_and_sends_no_extractor():
    torch.manual_seed(4)
    extractor, head = split_state({k: v.numpy() for k, v in FedPACNet(1, 28, 10).state_dict().items()})
    server = server_part(METHODS["lg-fedavg"], CFG, extractor, head)
    state = server.initial_state()
    updates = [Update(partition_id=i, num_examples=n, metrics={}, extractor={},
                      head={k: v + float(i + 1) for k, v in head.items()}) for i, n in enumerate((10, 30, 60))]
    weights = np.array([10.0, 30.0, 60.0])
    server.step(state, updates, weights, server_round=1)
    expected = {k: v + (10 * 1 + 30 * 2 + 60 * 3) / 100 for k, v in head.items()}  # = head + 2.5, by hand
    _assert_close(state.shared[HEAD], expected)
    assert set(server.model_for(state, 0)) == set(head)  # the head alone travels
    assert not state.personal.get(EXTRACTOR)


# ---------------------------------------------------------------------------- APFL, from scratch


def reference_apfl(net: FedPACNet, w: Params, v: Params, alpha: float, adapt: bool, data: LocalData,
                   cfg: FedPACConfig, seed: int) -> tuple[Params, Params, float]:
    """Algorithm 1 of Deng et al. (2020) on one minibatch at a time, from the step's w and v:
    w <- w - eta grad f(w); v <- v - eta alpha grad f(v_bar), v_bar = alpha v + (1 - alpha) w;
    alpha <- clip(alpha - eta <v - w, grad f(v_bar)>, 0, 1). Torch's momentum and weight decay
    on w and v, as the harness's SGD has them."""
    buffers_w: Params = {}
    buffers_v: Params = {}
    for idx in batches(len(data.y), cfg.batch_size, cfg.local_epochs, torch.Generator().manual_seed(seed)):
        x, y = data.x[idx], data.y[idx]
        _, grad_w = loss_and_gradient(net, w, x, y)
        v_bar = {k: alpha * v[k] + (1 - alpha) * w[k] for k in w}
        _, grad_v_bar = loss_and_gradient(net, v_bar, x, y)
        grad_v = {k: alpha * g for k, g in grad_v_bar.items()}
        if adapt:
            d_alpha = sum(float(((v[k] - w[k]) * grad_v_bar[k]).sum()) for k in w)
            next_alpha = min(1.0, max(0.0, alpha - cfg.extractor_lr * d_alpha))
        else:
            next_alpha = alpha
        w = sgd_step(w, grad_w, buffers_w, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
        v = sgd_step(v, grad_v, buffers_v, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
        alpha = next_alpha
    return w, v, alpha


def _site_keeping(local: FedPACNet, **more: dict[str, np.ndarray]) -> LocalData:
    """The site's data, its state holding ``local`` as APFL's kept local model v (and ``more``)."""
    kept = {LOCAL_MODEL: {k: q.detach().numpy().copy() for k, q in local.state_dict().items()}, **more}
    return dataclasses.replace(_data(), state=SiteState(kept))


def _second_round(method: APFL, received: FedPACNet, data: LocalData, w: Params, v: Params, seed: int) -> None:
    """The site's round 2 on a copy of ``received``: the model it sends back is ``w`` and the
    local model it keeps ``v``, to 1e-6; it reports the personalized model's loss."""
    model = copy.deepcopy(received)
    result = client_routine(method).local_update(model, data, Received(server_round=2), CFG,
                                                 torch.Generator().manual_seed(seed))
    _assert_close({k: q.detach().numpy() for k, q in model.state_dict().items()}, _arrays(w))
    _assert_close(data.state.get(LOCAL_MODEL), _arrays(v))
    assert set(result.metrics) == {"personal-loss"} and not result.statistics


@pytest.mark.parametrize("adapt", [False, True])
def test_apfl_s_second_round_is_the_paper_s_update_of_both_models(adapt):
    """Round 2: the site kept v (and alpha = 0.4 when it adapts) from round 1, the server sent a
    w that differs from it; the global model sent back, the local model and alpha kept are
    Algorithm 1's, to 1e-6."""
    method = APFL("apfl", alpha=0.3, adapt_alpha=adapt)
    received, local = _net(1), _net(2)
    data = _site_keeping(local, **({MIXING_WEIGHT: {ALPHA: np.array([0.4])}} if adapt else {}))
    w, v, alpha = reference_apfl(FedPACNet(1, 28, 10), params_of(received), params_of(local), 0.4 if adapt else 0.3,
                                 adapt, data, CFG, seed=9)

    _second_round(method, received, data, w, v, seed=9)

    if adapt:
        assert data.state.get(MIXING_WEIGHT)[ALPHA][0] == pytest.approx(alpha, abs=1e-6)
        assert abs(alpha - 0.4) > 1e-4  # it moved
    else:
        assert data.state.get(MIXING_WEIGHT) is None


def test_apfl_s_first_round_starts_the_local_model_from_the_received_global_one():
    received = _net(1)
    data = _data()
    w, v, _ = reference_apfl(FedPACNet(1, 28, 10), params_of(received), params_of(received), 0.25, False, data, CFG,
                             seed=3)
    model = copy.deepcopy(received)
    client_routine(METHODS["apfl"]).local_update(model, data, Received(), CFG, torch.Generator().manual_seed(3))
    _assert_close({k: q.detach().numpy() for k, q in model.state_dict().items()}, _arrays(w))
    _assert_close(data.state.get(LOCAL_MODEL), _arrays(v))


def test_apfl_evaluates_the_mix_of_its_kept_local_model_and_the_received_global_one():
    routine = client_routine(APFL("apfl", alpha=0.3))
    received, local = _net(1), _net(2)
    data = _data()
    first = routine.before_evaluation(received, data, CFG, torch.Generator())
    assert first is not received  # a copy; before the site trained, v = w and v_bar = w
    _assert_close({k: q.detach().numpy() for k, q in first.state_dict().items()},
                  {k: q.detach().numpy() for k, q in received.state_dict().items()})
    data.state.put(LOCAL_MODEL, {k: q.detach().numpy().copy() for k, q in local.state_dict().items()})
    evaluated = routine.before_evaluation(received, data, CFG, torch.Generator())
    expected = {k: 0.3 * local.state_dict()[k].detach().numpy() + 0.7 * q.detach().numpy()
                for k, q in received.state_dict().items()}
    _assert_close({k: q.detach().numpy() for k, q in evaluated.state_dict().items()}, expected)
    # an adapted alpha is the site's own
    adapted = client_routine(APFL("apfl", alpha=0.3, adapt_alpha=True))
    data.state.put(MIXING_WEIGHT, {ALPHA: np.array([0.9])})
    evaluated = adapted.before_evaluation(received, data, CFG, torch.Generator())
    expected = {k: 0.9 * local.state_dict()[k].detach().numpy() + 0.1 * q.detach().numpy()
                for k, q in received.state_dict().items()}
    _assert_close({k: q.detach().numpy() for k, q in evaluated.state_dict().items()}, expected)


def test_the_mixing_math():
    local = {"a": torch.tensor([1.0, 3.0])}
    global_ = {"a": torch.tensor([5.0, -1.0])}
    torch.testing.assert_close(mix(local, global_, 0.25)["a"], torch.tensor([4.0, 0.0]))
    # d f(v_bar) / d alpha = <v - w, grad f(v_bar)> = (-4) * 0.5 + 4 * 2
    assert alpha_gradient(local, global_, {"a": torch.tensor([0.5, 2.0])}) == pytest.approx(6.0)


# ---------------------------------------------------------------------------- APFL, outputs mixed


def reference_apfl_outputs(net: FedPACNet, w: Params, v: Params, alpha: float, data: LocalData,
                           cfg: FedPACConfig, seed: int) -> tuple[Params, Params]:
    """The authors' mixed outputs, one minibatch at a time from the step's w and v:
    w <- w - eta grad f(w); v <- v - eta grad_v CE(alpha v(x) + (1 - alpha) w(x)), w(x) held
    fixed. Torch's momentum and weight decay on w and v, as the harness's SGD has them."""
    buffers_w: Params = {}
    buffers_v: Params = {}
    for idx in batches(len(data.y), cfg.batch_size, cfg.local_epochs, torch.Generator().manual_seed(seed)):
        x, y = data.x[idx], data.y[idx]
        _, grad_w = loss_and_gradient(net, w, x, y)
        leaves = {k: q.detach().clone().requires_grad_(True) for k, q in v.items()}
        mixed = alpha * functional_call(net, leaves, (x,)) + (1 - alpha) * functional_call(net, w, (x,)).detach()
        grad_v = dict(zip(leaves, torch.autograd.grad(F.cross_entropy(mixed, y), list(leaves.values()))))
        w = sgd_step(w, grad_w, buffers_w, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
        v = sgd_step(v, grad_v, buffers_v, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
    return w, v


def test_apfl_with_outputs_mixed_s_second_round_is_the_authors_update_of_both_models():
    """Round 2, the kept v differs from the received w: the global model sent back and the local
    model kept are the authors' update (mixed outputs), to 1e-6, and differ from the paper's
    parameter-space update of the same round (the setting is read)."""
    method = APFL("apfl", alpha=0.3, mixing=OUTPUTS)
    received, local = _net(1), _net(2)
    data = _site_keeping(local)
    w, v = reference_apfl_outputs(FedPACNet(1, 28, 10), params_of(received), params_of(local), 0.3, data, CFG, seed=9)

    _second_round(method, received, data, w, v, seed=9)

    assert data.state.get(MIXING_WEIGHT) is None
    _, v_parameters, _ = reference_apfl(FedPACNet(1, 28, 10), params_of(received), params_of(local), 0.3, False, data,
                                        CFG, seed=9)
    assert max(float((v[k] - v_parameters[k]).abs().max()) for k in v) > 1e-3


def test_apfl_with_outputs_mixed_evaluates_one_network_computing_the_mixed_outputs(tmp_path):
    """The evaluated model's logits are alpha v(x) + (1 - alpha) w(x); the site saves it as a
    model of two branches, which loads back and predicts the same (``fedpac-predict``)."""
    routine = client_routine(APFL("apfl", alpha=0.3, mixing=OUTPUTS))
    received, local = _net(1), _net(2)
    data = _data()
    first = routine.before_evaluation(received, data, CFG, torch.Generator())
    assert first is not received and first.branches == 1  # before the site trained: v = w, the mix is w
    data.state.put(LOCAL_MODEL, {k: q.detach().numpy().copy() for k, q in local.state_dict().items()})
    evaluated = routine.before_evaluation(received, data, CFG, torch.Generator()).eval()
    assert evaluated.branches == 2 and received.branches == 1
    with torch.no_grad():
        expected = 0.3 * local.eval()(data.x_test) + 0.7 * received.eval()(data.x_test)
        torch.testing.assert_close(evaluated(data.x_test), expected, rtol=1e-5, atol=1e-5)
    info = SiteModel(method="apfl", run_id=3, round=2, partition_id=0, accuracy=0.5, num_classes=10, image_size=28,
                     image_channels=1, mean=[0.0], std=[1.0], branches=evaluated.branches)
    save_site_model(tmp_path, evaluated, info, run_complete=True)
    loaded, loaded_info = load_site_model(tmp_path)
    assert loaded_info.branches == 2
    images = np.random.default_rng(0).integers(0, 256, (6, 28, 28, 1), dtype=np.uint8)
    x, _ = to_tensors(images, np.zeros(6, dtype=np.int64), np.array(info.mean), np.array(info.std), torch.device("cpu"))
    with torch.no_grad():
        logits = evaluated(x)
    labels, probabilities = predict(loaded, loaded_info, images)
    np.testing.assert_array_equal(labels, logits.argmax(1).numpy())
    np.testing.assert_allclose(probabilities, torch.softmax(logits, 1).numpy(), rtol=1e-5, atol=1e-6)


def test_an_output_mixture_is_the_weighted_sum_of_its_models_outputs():
    models = [_net(seed).eval() for seed in (1, 2, 3)]
    x = _data().x
    mixture = output_mixture(models, [0.5, 0.3, 0.2]).eval()
    assert mixture.branches == 3 and mixture.embedding_dim == 3 * models[0].embedding_dim
    with torch.no_grad():
        torch.testing.assert_close(mixture(x), sum(w * m(x) for m, w in zip(models, [0.5, 0.3, 0.2])),
                                   rtol=1e-5, atol=1e-5)
    # the models are copied: training the mixture leaves them as they were
    before = copy.deepcopy(models[0].state_dict())
    with torch.no_grad():
        next(mixture.parameters()).add_(1.0)
    assert all(torch.equal(before[k], q) for k, q in models[0].state_dict().items())
    with pytest.raises(ValueError, match="2 models and 1 weights"):
        output_mixture(models[:2], [1.0])
    with pytest.raises(ValueError, match="one extractor"):
        output_mixture([mixture], [1.0])


# ---------------------------------------------------------------------------- APFL, mixed once a round


def reference_apfl_rounds(net: FedPACNet, w: Params, v: Params, alpha: float, data: LocalData,
                          cfg: FedPACConfig, seed: int) -> tuple[Params, Params]:
    """PFLlib's APFL with alpha fixed: on every minibatch w and v each step on their own loss;
    after the epochs v <- (1 - alpha) w + alpha v. Torch's momentum and weight decay on w and v."""
    buffers_w: Params = {}
    buffers_v: Params = {}
    for idx in batches(len(data.y), cfg.batch_size, cfg.local_epochs, torch.Generator().manual_seed(seed)):
        x, y = data.x[idx], data.y[idx]
        _, grad_w = loss_and_gradient(net, w, x, y)
        _, grad_v = loss_and_gradient(net, v, x, y)
        w = sgd_step(w, grad_w, buffers_w, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
        v = sgd_step(v, grad_v, buffers_v, cfg.extractor_lr, cfg.momentum, cfg.weight_decay)
    return w, {k: (1 - alpha) * w[k] + alpha * v[k] for k in v}


def test_apfl_mixed_once_a_round_trains_both_models_on_their_own_loss_then_mixes_and_evaluates_v():
    """Round 2, the kept v differs from the received w: w sent back and v kept are PFLlib's
    update, to 1e-6 (v mixed with the w the epochs left, not the received one); the site then
    evaluates the kept v itself."""
    method = APFL("apfl", alpha=0.3, mixing=ROUNDS)
    received, local = _net(1), _net(2)
    data = _site_keeping(local)
    w, v = reference_apfl_rounds(FedPACNet(1, 28, 10), params_of(received), params_of(local), 0.3, data, CFG, seed=4)

    _second_round(method, received, data, w, v, seed=4)

    assert data.state.get(MIXING_WEIGHT) is None
    evaluated = client_routine(method).before_evaluation(received, data, CFG, torch.Generator())
    _assert_close({k: q.detach().numpy() for k, q in evaluated.state_dict().items()}, _arrays(v))
    assert evaluated is not received and evaluated.branches == 1


# ---------------------------------------------------------------------------- settings, privacy


def test_apfl_s_settings_come_from_the_run_config_and_are_checked():
    assert METHODS["apfl"] == APFL("apfl", alpha=0.25, adapt_alpha=False)  # the FedPAC paper's alpha, fixed
    cfg = parse_run_config({"strategy": "apfl", "apfl-alpha": 0.5, "apfl-adapt-alpha": True})
    assert configured_method(cfg) == APFL("apfl", alpha=0.5, adapt_alpha=True)
    assert parse_run_config({"apfl-alpha": 0.25}).method_settings == ()
    for bad in (-0.1, 1.5):
        with pytest.raises(ConfigError, match=r"'apfl-alpha' = .* is invalid: must be in \[0, 1\]"):
            parse_run_config({"strategy": "apfl", "apfl-alpha": bad})
    with pytest.raises(ConfigError, match="wrong type"):
        parse_run_config({"apfl-adapt-alpha": 1})
    assert METHODS["apfl"].mixing == PARAMETERS  # the paper's v_bar
    assert configured_method(parse_run_config({"strategy": "apfl", "apfl-mixing": "outputs"})).mixing == OUTPUTS
    with pytest.raises(ConfigError, match="'apfl-adapt-alpha' = True and 'apfl-mixing' = 'outputs' do not go together"):
        parse_run_config({"strategy": "apfl", "apfl-mixing": "outputs", "apfl-adapt-alpha": True})


@pytest.mark.parametrize("mixing", MIXINGS)
def test_apfl_with_differential_privacy_takes_dp_sgd_steps_and_counts_them(mixing):
    """Every step is one DP-SGD release over w and v's side (the stand-in for v_bar, or v itself
    with outputs mixed) together: the ledger counts local-epochs * n / batch-size steps at rate
    batch-size / n; both models move."""
    received, data = _net(1), _data()
    model = copy.deepcopy(received)
    settings = privacy.PrivacySettings(noise_multiplier=1.0, max_grad_norm=1.0)
    with privacy.private_site(settings, 1234) as site:
        client_routine(APFL("apfl", adapt_alpha=mixing == PARAMETERS, mixing=mixing)).local_update(
            model, data, Received(), CFG, torch.Generator().manual_seed(0))
    assert site.ledger.history == [(1.0, CFG.batch_size / 32, CFG.local_epochs * 32 // CFG.batch_size)]
    assert any(not torch.equal(a, b) for a, b in zip(model.parameters(), received.parameters()))
    local = data.state.get(LOCAL_MODEL)
    assert any(not np.array_equal(local[k], q.detach().numpy()) for k, q in received.state_dict().items())
    if mixing == PARAMETERS:
        assert np.isfinite(data.state.get(MIXING_WEIGHT)[ALPHA][0])


# ---------------------------------------------------------------------------- whole runs


def test_short_federations_learn_and_keep_what_stays_at_the_sites(tmp_path):
    """Three clients of the embedded MNIST-5k, three rounds each: APFL's personalized models (its
    parameters mixed every step or once a round, or its outputs mixed) and LG-FedAvg's end far
    above guessing; APFL's sites keep
    their local models, LG-FedAvg's their extractors, and neither ever travels. The sites of
    APFL with outputs mixed save their personalized model (``model-dir``), two branches, which
    loads and scores on the site's test split what the site reported."""
    for name, mixing in (("apfl", PARAMETERS), ("apfl", OUTPUTS), ("apfl", ROUNDS), ("lg-fedavg", PARAMETERS)):
        label = f"{name}-{mixing}"
        config = {"strategy": name, "samples-per-client": 100, "test-samples-per-client": 50, "local-epochs": 2,
                  "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3, "output-dir": str(tmp_path / label),
                  **({"apfl-mixing": mixing} if name == "apfl" else {})}
        cfg = parse_run_config(config)
        grid = InProcessGrid(config, 3)
        for context in grid.contexts.values():
            context.node_config["model-dir"] = str(tmp_path / label / f"site-{context.node_config['partition-id']}")
        strategy, report = run_fedpac(cast(Grid, grid), cfg, 1)
        accuracy = np.mean(list(report.rounds[-1].accuracy.values()))
        assert accuracy > 0.6, (label, accuracy)
        train = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
        travelled = {key.split(".")[0] for m in train for key in p.sections_of(m.content)[p.MODEL]}
        assert travelled == ({"head"} if name == "lg-fedavg" else {"extractor", "head"})
        for pid in range(3):
            model_dir = tmp_path / label / f"site-{pid}"
            kept = SiteStore(model_dir / "site-state", pid, strategy.lineage).load(3)  # a node's state: by its models
            assert set(kept) == ({SITE_PARTS} if name == "lg-fedavg" else {LOCAL_MODEL})
            saved, info = load_site_model(model_dir)
            assert saved.branches == info.branches == (2 if mixing == OUTPUTS else 1)
            _, _, x_test, y_test = client_tensors(cfg, pid, 3, torch.device("cpu"))
            with torch.no_grad():
                score = float((saved(x_test).argmax(1) == y_test).float().mean())
            assert score == pytest.approx(report.rounds[-1].accuracy[pid], abs=1e-6), (label, pid)
