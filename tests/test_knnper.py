"""kNN-Per: the Gaussian-kernel kNN probabilities and their interpolation with the global model
against hand-computed values; the model a site evaluates against a from-scratch computation of
the paper's prediction (datastore of the received extractor's training features); FedAvg's local
update; the site's tuning of lambda; what it sends and keeps; its settings, the refusal of DP; and
a short federation whose recorded accuracy is the interpolated prediction's."""

from __future__ import annotations

import copy
import math
import re
from typing import cast

import numpy as np
import pytest
import torch
from flwr.serverapp import Grid
from torch import nn

from client_app.app import _generator, client_tensors
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
from common.methods.knnper import INTERPOLATION_GRID, KNNPer
from common.methods.knnper.client import KNNHead, interpolate, knn_probabilities, tuned_interpolation
from common.methods.server import ServerPart, server_part
from common.model import FedPACNet
from common.training import evaluate, train_joint
from federation import InProcessGrid, shared_model
from server_app.app import run_fedpac

CFG = FedPACConfig(strategy="knn-per", local_epochs=2, batch_size=8, extractor_lr=0.05)


def _setup(seed: int = 0) -> tuple[FedPACNet, LocalData]:
    """A model and a small task: each of 4 classes a bright square in its own place, 3:1 skewed."""
    torch.manual_seed(seed)
    model = FedPACNet(1, 28, 10)
    y = torch.tensor([0, 0, 0, 1, 2, 3] * 8)
    x = 0.5 * torch.randn(len(y), 1, 28, 28)
    for k in range(4):
        row, col = divmod(k, 2)
        x[y == k, :, 14 * row + 3 : 14 * row + 11, 14 * col + 3 : 14 * col + 11] += 2.0
    return model, LocalData(x[:32], y[:32], x[32:], y[32:])


def _linear(weight: list[list[float]], bias: list[float]) -> nn.Linear:
    head = nn.Linear(len(weight[0]), len(weight))
    with torch.no_grad():
        head.weight.copy_(torch.tensor(weight))
        head.bias.copy_(torch.tensor(bias))
    return head


# --------------------------------------------------------------------------- the prediction


def test_the_knn_probabilities_and_the_interpolation_match_a_hand_computed_example():
    keys = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 2.0], [3.0, 3.0]])
    labels = torch.tensor([0, 1, 1, 2])
    query = torch.tensor([[0.0, 0.5]])
    # squared distances 0.25, 1.25, 2.25, 15.25; k = 3 keeps the first three; the kernel is
    # exp(-d^2 / (dim * sigma)) with dim = 2, sigma = 1
    w = [math.exp(-0.25 / 2), math.exp(-1.25 / 2), math.exp(-2.25 / 2)]
    expected_knn = [w[0] / sum(w), (w[1] + w[2]) / sum(w), 0.0]
    p_knn = knn_probabilities(query, keys, labels, k=3, num_classes=3)
    np.testing.assert_allclose(p_knn.numpy()[0], expected_knn, rtol=1e-6, atol=1e-7)
    # k = 1: the nearest key's label alone; k past the datastore: every key
    np.testing.assert_allclose(knn_probabilities(query, keys, labels, k=1, num_classes=3).numpy()[0], [1, 0, 0])
    w4 = w + [math.exp(-15.25 / 2)]
    np.testing.assert_allclose(knn_probabilities(query, keys, labels, k=9, num_classes=3).numpy()[0],
                               [w4[0] / sum(w4), (w4[1] + w4[2]) / sum(w4), w4[3] / sum(w4)], rtol=1e-6)
    # a kernel scale sigma = 4 flattens the weights
    w_flat = [math.exp(-d / 8) for d in (0.25, 1.25, 2.25)]
    np.testing.assert_allclose(knn_probabilities(query, keys, labels, k=3, num_classes=3, scale=4.0).numpy()[0],
                               [w_flat[0] / sum(w_flat), (w_flat[1] + w_flat[2]) / sum(w_flat), 0.0], rtol=1e-6)

    # the head: a global model that says (0.2, 0.3, 0.5) whatever the features, lambda = 0.7
    head = KNNHead(_linear([[0.0, 0.0]] * 3, [math.log(0.2), math.log(0.3), math.log(0.5)]), keys, labels,
                   neighbours=3, weight=0.7)
    expected = [0.7 * p + 0.3 * g for p, g in zip(expected_knn, (0.2, 0.3, 0.5))]
    with torch.no_grad():
        np.testing.assert_allclose(head(query).exp().numpy()[0], expected, rtol=1e-6)
    np.testing.assert_allclose(interpolate(p_knn, torch.tensor([[0.2, 0.3, 0.5]]), 0.7).numpy()[0], expected,
                               rtol=1e-6)
    assert sum(expected) == pytest.approx(1.0)


def test_lambda_zero_is_the_global_model_and_one_the_knn_model():
    keys, labels = torch.tensor([[0.0, 0.0], [4.0, 4.0]]), torch.tensor([1, 0])
    linear = _linear([[1.0, 0.0], [0.0, 1.0]], [0.5, -0.5])
    query = torch.tensor([[0.1, 0.2], [3.0, 5.0]])
    with torch.no_grad():
        np.testing.assert_allclose(KNNHead(linear, keys, labels, 1, 0.0)(query).numpy(),
                                   torch.log_softmax(linear(query), dim=1).numpy(), rtol=1e-6)
        knn = KNNHead(linear, keys, labels, 1, 1.0)(query)
    assert knn.argmax(dim=1).tolist() == [1, 0] and torch.isfinite(knn).all()  # log 0 floored, not -inf


def _reference_prediction(received: FedPACNet, data: LocalData, k: int, weight: float) -> tuple[float, float]:
    """kNN-Per's test loss and accuracy from scratch, in float64: the datastore is the received
    extractor's features of the training set; for each test sample its k nearest entries vote
    with weight exp(-||z - z_j||^2 / d); p = lambda p_kNN + (1 - lambda) softmax(global logits)."""
    with torch.no_grad():
        keys = received.extractor(data.x).double().numpy()
        queries = received.extractor(data.x_test).double().numpy()
        logits = received.head(received.extractor(data.x_test)).double().numpy()
    labels, num_classes, dim = data.y.numpy(), logits.shape[1], keys.shape[1]
    losses, correct = [], 0
    for z, row, label in zip(queries, logits, data.y_test.numpy()):
        squared = ((keys - z) ** 2).sum(axis=1)
        nearest = np.argsort(squared)[:k]
        kernel = np.exp(-(squared[nearest] - squared[nearest].min()) / dim)  # the common factor cancels
        p_knn = np.zeros(num_classes)
        for j, w in zip(nearest, kernel):
            p_knn[labels[j]] += w / kernel.sum()
        p_global = np.exp(row - row.max()) / np.exp(row - row.max()).sum()
        p = weight * p_knn + (1 - weight) * p_global
        losses.append(-math.log(p[label]))
        correct += int(np.argmax(p) == label)
    return float(np.mean(losses)), correct / len(queries)


@pytest.mark.parametrize("k,weight", [(7, 0.5), (3, 0.8)])
def test_the_site_evaluates_the_interpolated_prediction_over_the_received_extractors_features(k, weight):
    """Round 2 at a site: the received global model is one trained in round 1 (another model
    than the site saw before); what the site evaluates is kNN-Per's prediction made with it."""
    model, data = _setup()
    train_joint(model, data.x, data.y, CFG, torch.Generator().manual_seed(0))  # what round 1 left
    received = copy.deepcopy(model)
    evaluated = client_routine(KNNPer("knn-per", neighbours=k, interpolation=weight)).before_evaluation(
        received, data, CFG, torch.Generator())
    loss, accuracy = evaluate(evaluated, data.x_test, data.y_test)
    expected_loss, expected_accuracy = _reference_prediction(model, data, k, weight)
    assert loss == pytest.approx(expected_loss, rel=1e-5, abs=1e-6)
    assert accuracy == pytest.approx(expected_accuracy, abs=1e-9)
    # the global model alone scores otherwise here: the evaluation is not the received model's
    assert evaluate(received, data.x_test, data.y_test)[0] != pytest.approx(loss, rel=1e-3)


def test_the_local_update_is_fedavgs():
    model, data = _setup()
    reference = copy.deepcopy(model)
    result = client_routine(METHODS["knn-per"]).local_update(model, data, Received(), CFG,
                                                             torch.Generator().manual_seed(4))
    loss = train_joint(reference, data.x, data.y, CFG, torch.Generator().manual_seed(4))
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), reference.parameters()))
    assert result.train_loss == loss and result.num_examples == 32 and not result.metrics and not result.statistics


# ------------------------------------------------------------------------------ the tuning


def test_the_site_tunes_lambda_on_held_out_training_data():
    """Two classes apart in feature space: a global head that always says class 0 loses to the
    kNN model (lambda 1 wins); features whose nearest neighbour always has the other label, and a
    head that reads the label off a small second coordinate: the global model wins (lambda 0)."""
    generator = torch.Generator().manual_seed(0)
    clustered = torch.cat([torch.randn(20, 2, generator=generator), 10 + torch.randn(20, 2, generator=generator)])
    labels = torch.tensor([0] * 20 + [1] * 20)
    says_zero = _linear([[0.0, 0.0], [0.0, 0.0]], [5.0, 0.0])
    assert tuned_interpolation(says_zero, clustered, labels, 3, 0.25, torch.Generator().manual_seed(1),
                               grid=(0.0, 1.0)) == 1.0
    line = torch.arange(40.0)
    parity = line.long() % 2
    alternating = torch.stack([line, 0.01 * parity.float()], dim=1)
    reads_parity = _linear([[0.0, -1e4], [0.0, 1e4]], [50.0, -50.0])
    assert tuned_interpolation(reads_parity, alternating, parity, 1, 0.25, torch.Generator().manual_seed(1),
                               grid=(0.0, 1.0)) == 0.0
    # too few samples to hold one out: no tuning
    assert tuned_interpolation(says_zero, clustered[:3], labels[:3], 3, 0.2, torch.Generator()) is None


def test_the_tuned_lambda_is_the_grid_s_best_on_the_held_out_share_and_then_evaluated():
    model, data = _setup()
    train_joint(model, data.x, data.y, CFG, torch.Generator().manual_seed(0))
    with torch.no_grad():
        features = model.extractor(data.x)
    chosen = tuned_interpolation(model.head, features, data.y, 7, 0.25, torch.Generator().manual_seed(2))
    # from scratch: the same held-out draw, the datastore of the rest, the first best of the grid
    order = torch.randperm(32, generator=torch.Generator().manual_seed(2))
    query, store = order[:8], order[8:]
    accuracies = []
    for weight in INTERPOLATION_GRID:
        held_out = LocalData(data.x[store], data.y[store], data.x[query], data.y[query])
        accuracies.append(_reference_prediction(model, held_out, 7, weight)[1])
    assert chosen == INTERPOLATION_GRID[int(np.argmax(accuracies))]
    # the site then evaluates with that lambda and the datastore of all of its training data
    tuned = client_routine(KNNPer("knn-per", tuning_holdout=0.25)).before_evaluation(
        model, data, CFG, torch.Generator().manual_seed(2))
    assert isinstance(tuned.head, KNNHead) and tuned.head.interpolation == chosen and len(tuned.head.keys) == 32


# ------------------------------------------------------------------------ traffic, settings


def test_it_sends_the_global_model_keeps_nothing_and_the_datastore_stays_out_of_the_model_state():
    method = METHODS["knn-per"]
    assert isinstance(method, KNNPer) and not method.keeps_site_state and not method.keeps_anything_at_site
    assert method.shared_parts == ("extractor", "head")
    assert type(server_part(method, CFG, {}, {})) is ServerPart  # FedAvg's server
    model, data = _setup()
    routine = client_routine(method)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    evaluated = routine.before_evaluation(model, data, CFG, torch.Generator())
    assert evaluated is not model and all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    # what a site saves of it (model-dir) is the global model: the training features are not in it
    assert evaluated.state_dict().keys() == before.keys()
    assert all(torch.equal(before[k], v) for k, v in evaluated.state_dict().items())
    routine.local_update(model, data, Received(), CFG, torch.Generator())
    assert not data.state.kept


def test_the_settings_come_from_the_run_config_and_dp_is_refused():
    cfg = parse_run_config({"strategy": "knn-per", "knn-neighbours": 5, "knn-interpolation": 0.8,
                            "knn-tuning-holdout": 0.2})
    assert configured_method(cfg) == KNNPer("knn-per", neighbours=5, interpolation=0.8, tuning_holdout=0.2)
    assert METHODS["knn-per"] == KNNPer("knn-per", neighbours=7, interpolation=0.5, tuning_holdout=0.0)
    assert parse_run_config({"knn-neighbours": 7, "knn-interpolation": 0.5}).method_settings == ()
    for key, bad, why in (("knn-neighbours", 0, "must be >= 1"), ("knn-interpolation", 1.1, "must be in [0, 1]"),
                          ("knn-interpolation", -0.5, "must be in [0, 1]"),
                          ("knn-tuning-holdout", 1.0, "must be in [0, 1)")):
        with pytest.raises(ConfigError, match=re.escape(f"run config '{key}' = {bad!r} is invalid: {why}")):
            parse_run_config({"strategy": "fedavg", key: bad})
    with pytest.raises(ConfigError, match="wrong type"):
        parse_run_config({"knn-neighbours": 2.5})
    with pytest.raises(ValueError, match="whole number"):
        KNNPer("knn-per", neighbours=3.0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="run config 'dp' = True is invalid: must be false with strategy 'knn-per': "
                                          "its kNN prediction reads the site's training records"):
        parse_run_config({"strategy": "knn-per", "dp": True})
    assert parse_run_config({"strategy": "fedavg", "dp": True}).dp  # the refusal is kNN-Per's alone


# -------------------------------------------------------------------------------- federation


def test_a_short_federation_records_the_interpolated_accuracy_and_it_beats_the_global_model(tmp_path):
    """Three clients of the embedded MNIST-5k (FedPAC's label-skewed partition), three rounds of
    FedAvg: the accuracy the server records is kNN-Per's prediction with the final global model,
    far above each client's majority label and above the global model alone on average."""
    config = {"strategy": "knn-per", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    strategy, report = run_fedpac(cast(Grid, InProcessGrid(config, 3)), cfg, 1)
    last = report.rounds[-1].accuracy
    assert sorted(last) == [0, 1, 2]
    model = shared_model(strategy.state, cfg)
    routine = client_routine(configured_method(cfg))
    alone = {}
    for pid in range(3):
        x, y, x_test, y_test = client_tensors(cfg, pid, 3, torch.device("cpu"))
        majority = float(torch.bincount(y_test).max()) / len(y_test)
        assert last[pid] >= majority + 0.2, (pid, last[pid], majority)
        evaluated = routine.before_evaluation(model, LocalData(x, y, x_test, y_test), cfg,
                                              _generator(cfg, cfg.num_server_rounds, pid, purpose=1))
        assert evaluate(evaluated, x_test, y_test)[1] == pytest.approx(last[pid], abs=1e-6)  # what the server recorded
        alone[pid] = evaluate(model, x_test, y_test)[1]
    assert float(np.mean(list(last.values()))) >= 0.7, [r.accuracy for r in report.rounds]
    assert np.mean(list(last.values())) > np.mean(list(alone.values())), (last, alone)
