"""FedBABU: the local update trains the body through the fixed head (sent back bit for bit); the
server's FedAvg keeps the initial head exactly; before each evaluation a copy of the received
model, body and head, is fine-tuned on the local training data, and nothing of that travels;
its setting; and a short federation that learns."""

from __future__ import annotations

import dataclasses
import json
from typing import cast

import numpy as np
import pytest
import torch
from flwr.serverapp import Grid

from client_app.app import _generator, client_tensors
from common.averaging import capped_sample_weights
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
from common.methods.fedbabu import FedBABU
from common.methods.fedbabu.client import finetune
from common.methods.server import EXTRACTOR, HEAD, ServerPart, Update, server_part
from common.model import FedPACNet, split_state
from common.training import evaluate, train_extractor
from federation import InProcessGrid, shared_model
from server_app.app import initial_model, run_fedpac

CFG = FedPACConfig(strategy="fedbabu", local_epochs=2, batch_size=8, extractor_lr=0.05)


def _setup(seed: int = 0) -> tuple[FedPACNet, LocalData]:
    """A model and a small learnable task: each of 4 classes a bright square in its own place."""
    torch.manual_seed(seed)
    model = FedPACNet(1, 28, 10)
    y = torch.arange(48) % 4
    x = 0.5 * torch.randn(48, 1, 28, 28)
    for k in range(4):
        row, col = divmod(k, 2)
        x[y == k, :, 14 * row + 3 : 14 * row + 11, 14 * col + 3 : 14 * col + 11] += 2.0
    return model, LocalData(x[:32], y[:32], x[32:], y[32:])


def _state(model: FedPACNet) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


def _moved(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor], prefix: str) -> bool:
    return all(not torch.equal(a[k], b[k]) for k in a if k.startswith(prefix))


def test_the_registered_method_is_fedbabu_with_the_authors_five_fine_tuning_epochs():
    method = METHODS["fedbabu"]
    assert isinstance(method, FedBABU) and method.finetune_epochs == 5
    assert not method.keeps_site_state  # the fine-tuned copy is thrown away after the evaluation
    assert isinstance(server_part(method, CFG, {}, {}), ServerPart)  # FedAvg's server, head pinned


def test_the_local_update_trains_the_body_through_the_fixed_head_and_lowers_the_loss():
    model, data = _setup()
    before = _state(model)
    loss_before, _ = evaluate(model, data.x, data.y)
    result = client_routine(METHODS["fedbabu"]).local_update(model, data, Received(), CFG,
                                                             torch.Generator().manual_seed(0))
    after = _state(model)
    assert _equal(before, after, "head.")  # bit for bit: the head never trains
    assert _moved(before, after, "extractor.")  # every tensor of the body does
    assert all(q.requires_grad for q in model.parameters())  # the head is frozen only while training
    loss_after, _ = evaluate(model, data.x, data.y)
    assert loss_after < 0.75 * loss_before
    assert result.num_examples == 32 and not result.statistics and not result.metrics
    assert loss_after * 0.9 <= result.train_loss <= loss_before
    # exactly the product's body epochs (FedRep's and FedPAC's block) at the baselines' step size
    reference, _ = _setup()
    train_extractor(reference, data.x, data.y, CFG, torch.Generator().manual_seed(0))
    assert _equal(_state(reference), after, "")


def test_fine_tuning_before_evaluation_changes_a_copy_and_leaves_the_model_that_trains():
    model, data = _setup()
    received = _state(model)
    routine = client_routine(METHODS["fedbabu"])
    evaluated = routine.before_evaluation(model, data, CFG, torch.Generator().manual_seed(1))
    assert evaluated is not model and _equal(received, _state(model), "")  # the received model is untouched
    tuned = _state(evaluated)
    assert _moved(received, tuned, "head.") and _moved(received, tuned, "extractor.")  # the whole model
    assert evaluate(evaluated, data.x, data.y)[0] < 0.75 * evaluate(model, data.x, data.y)[0]
    # babu-finetune-epochs epochs of the whole model at the baselines' step size, with the generator given
    reference, _ = _setup()
    finetune(reference, data, CFG, torch.Generator().manual_seed(1), epochs=5)
    assert _equal(_state(reference), tuned, "")
    # fused evaluation: the train step after it trains, and sends back, what the round's model alone gives
    result = routine.local_update(model, data, Received(), CFG, torch.Generator().manual_seed(0))
    alone, _ = _setup()
    alone_result = routine.local_update(alone, data, Received(), CFG, torch.Generator().manual_seed(0))
    assert _equal(_state(alone), _state(model), "") and result.train_loss == alone_result.train_loss
    assert _equal(received, _state(model), "head.")


def test_the_fine_tuning_epochs_are_the_setting_and_zero_evaluates_the_received_model():
    model, data = _setup()
    one = client_routine(FedBABU("fedbabu", finetune_epochs=1)).before_evaluation(
        model, data, CFG, torch.Generator().manual_seed(1))
    reference, _ = _setup()
    finetune(reference, data, CFG, torch.Generator().manual_seed(1), epochs=1)
    assert _equal(_state(reference), _state(one), "")
    assert client_routine(FedBABU("fedbabu", finetune_epochs=0)).before_evaluation(
        model, data, CFG, torch.Generator()) is model


@pytest.mark.parametrize("weights", [[60, 60, 60], [1, 1000, 37], [0.3, 7.1, 2.9, 1e-3, 5.5]])
def test_fedavg_of_the_unchanged_heads_is_the_initial_head_bit_for_bit(weights):
    """Every client sends back the head it received; the sample-weighted average (float64 sums of
    weights that add up to 1 within a few ulps, rounded back to float32) is that head exactly,
    while the bodies are averaged."""
    torch.manual_seed(3)
    extractor, head = split_state({k: v.numpy() for k, v in FedPACNet(1, 28, 10).state_dict().items()})
    cfg = dataclasses.replace(CFG, max_weight_ratio=2.0)
    server = server_part(METHODS["fedbabu"], cfg, extractor, head)
    state = server.initial_state()
    rng = np.random.default_rng(0)
    updates = [Update(partition_id=i, num_examples=int(max(w, 1)), metrics={},
                      extractor={k: (v + rng.normal(size=v.shape)).astype(v.dtype) for k, v in extractor.items()},
                      head={k: v.copy() for k, v in head.items()})
               for i, w in enumerate(weights)]
    for w in (np.asarray(weights, dtype=np.float64), capped_sample_weights(np.asarray(weights, float), 2.0)):
        server.step(state, updates, w, server_round=1)
        for key, value in head.items():
            assert state.shared[HEAD][key].dtype == value.dtype and np.array_equal(state.shared[HEAD][key], value)
        assert not np.array_equal(state.shared[EXTRACTOR]["extractor.0.weight"], extractor["extractor.0.weight"])
    assert {**extractor, **head}.keys() == server.model_for(state, 0).keys()


def test_a_reply_with_another_head_does_not_move_the_global_head():
    """A site that sends back a head of its own (faulty or hostile) changes nothing of it: the
    bodies are averaged, the head stays the initial one."""
    torch.manual_seed(4)
    extractor, head = split_state({k: v.numpy() for k, v in FedPACNet(1, 28, 10).state_dict().items()})
    server = server_part(METHODS["fedbabu"], CFG, extractor, head)
    state = server.initial_state()
    updates = [Update(partition_id=i, num_examples=60, metrics={},
                      extractor={k: v + 1.0 for k, v in extractor.items()},
                      head={k: v + (10.0 if i == 1 else 0.0) for k, v in head.items()})
               for i in range(3)]
    server.step(state, updates, np.full(3, 1 / 3), server_round=1)
    for key, value in head.items():
        assert np.array_equal(state.shared[HEAD][key], value)
    np.testing.assert_allclose(state.shared[EXTRACTOR]["extractor.0.weight"], extractor["extractor.0.weight"] + 1.0,
                               rtol=1e-6)


def test_the_setting_comes_from_the_run_config_and_is_checked():
    cfg = parse_run_config({"strategy": "fedbabu", "babu-finetune-epochs": 2})
    assert configured_method(cfg) == FedBABU("fedbabu", finetune_epochs=2)
    assert parse_run_config({"babu-finetune-epochs": 5}).method_settings == ()  # the default is not recorded
    assert configured_method(parse_run_config({"strategy": "fedbabu", "babu-finetune-epochs": 0})) == FedBABU(
        "fedbabu", finetune_epochs=0)
    with pytest.raises(ConfigError, match="run config 'babu-finetune-epochs' = -1 is invalid: must be >= 0"):
        parse_run_config({"strategy": "fedavg", "babu-finetune-epochs": -1})
    for bad in (1.5, "5", True):
        with pytest.raises(ConfigError, match="wrong type"):
            parse_run_config({"babu-finetune-epochs": bad})
    with pytest.raises(ValueError, match="whole number"):
        FedBABU("fedbabu", finetune_epochs=2.0)  # type: ignore[arg-type]


def test_a_short_federation_learns_with_the_initial_head_and_fine_tuning_personalizes(tmp_path):
    """Three clients of the embedded MNIST-5k (FedPAC's label-skewed partition), three rounds:
    the server ends with the initial head, bit for bit, and a trained body; every client's
    fine-tuned model is far above guessing and above the global model with its untrained head."""
    config = {"strategy": "fedbabu", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    strategy, report = run_fedpac(cast(Grid, InProcessGrid(config, 3)), cfg, 1)
    initial_extractor, initial_head = split_state(
        {k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    state = strategy.state
    for key, value in initial_head.items():
        assert np.array_equal(state.shared[HEAD][key], value)
    assert not np.array_equal(state.shared[EXTRACTOR]["extractor.0.weight"], initial_extractor["extractor.0.weight"])
    (run_dir,) = tmp_path.iterdir()
    with np.load(run_dir / "final_state.npz") as final:
        assert all(np.array_equal(final[f"head/{key}"], value) for key, value in initial_head.items())
    assert json.loads((run_dir / "config.json").read_text())["strategy"] == "fedbabu"

    last = report.rounds[-1].accuracy
    assert sorted(last) == [0, 1, 2]
    model = shared_model(state, cfg)
    routine = client_routine(configured_method(cfg))
    untuned = {}
    for pid in range(3):
        x, y, x_test, y_test = client_tensors(cfg, pid, 3, torch.device("cpu"))
        majority = float(torch.bincount(y_test).max()) / len(y_test)
        assert last[pid] >= majority + 0.2, (pid, last[pid], majority)
        tuned = routine.before_evaluation(model, LocalData(x, y, x_test, y_test), cfg,
                                          _generator(cfg, cfg.num_server_rounds, pid, purpose=1))
        assert evaluate(tuned, x_test, y_test)[1] == pytest.approx(last[pid], abs=1e-6)  # what the server recorded
        untuned[pid] = evaluate(model, x_test, y_test)[1]
    assert np.mean(list(last.values())) > np.mean(list(untuned.values())), (last, untuned)
    assert float(np.mean(list(last.values()))) >= 0.7, [r.accuracy for r in report.rounds]
