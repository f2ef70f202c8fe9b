"""FedFomo: the weights of the downloaded models and the combined model against a hand computation
(in a round where the client's own model differs from every model it downloads), the local
training after it, which models the server sends to whom and what it keeps from a reply, the
settings and the refusal of DP, and a short federation that learns."""

from __future__ import annotations

import copy
import dataclasses
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.serverapp import Grid

from common import protocol as p
from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
from common.methods.fedfomo import FedFomo
from common.methods.fedfomo.client import PEERS, WEIGHTS
from common.methods.fedfomo.server import AFFINITY, MODELS, SCORES, exploration
from common.methods.server import Update, server_part
from common.model import FedPACNet, split_state
from common.training import train_joint
from common.validation import InvalidReply
from federation import InProcessGrid
from server_app.app import run_fedpac

CFG = FedPACConfig(strategy="fedfomo", local_epochs=1, batch_size=8, extractor_lr=0.05, seed=11)
METHOD = FedFomo("fedfomo", models=5, val_fraction=0.25)

State = dict[str, torch.Tensor]


def _data() -> LocalData:
    """A learnable task: each of 4 classes a bright square in its own place."""
    generator = torch.Generator().manual_seed(2)
    y = torch.arange(40) % 4
    x = 0.5 * torch.randn(40, 1, 28, 28, generator=generator)
    for k in range(4):
        row, col = divmod(k, 2)
        x[y == k, :, 14 * row + 3: 14 * row + 11, 14 * col + 3: 14 * col + 11] += 2.0
    return LocalData(x, y, x, y)


def _state(model: FedPACNet) -> State:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _peers(own: FedPACNet, data: LocalData) -> list[State]:
    """Four other clients' models: two trained from the client's own (better on its data), one
    far off (worse), and a copy of the client's own (distance 0)."""
    better = []
    for seed, lr in ((0, 0.05), (1, 0.02)):
        model = copy.deepcopy(own)
        cfg = dataclasses.replace(CFG, extractor_lr=lr)
        train_joint(model, data.x, data.y, cfg, torch.Generator().manual_seed(seed))
        better.append(_state(model))
    generator = torch.Generator().manual_seed(9)
    worse = {k: v + 0.5 * torch.randn(v.shape, generator=generator) for k, v in _state(own).items()}
    return [better[0], worse, _state(own), better[1]]


def _section(peers: list[State]) -> p.Sections:
    return {PEERS: {f"{slot}/{key}": value.numpy() for slot, state in enumerate(peers) for key, value in state.items()}}


def hand_computation(own: State, peers: list[State], model: FedPACNet, data: LocalData) -> tuple[np.ndarray, State]:
    """The paper's eq. 5-6 written out: validation = the first fedfomo-val-fraction of a
    permutation drawn from the seed; w_n = (L(own) - L(n)) / ||theta_n - theta_own|| (0 at
    distance 0); the positive ones normalized; theta_own + sum_n w_n (theta_n - theta_own)."""
    order = torch.randperm(40, generator=torch.Generator().manual_seed(CFG.seed))
    val = order[:10]  # 0.25 of 40

    def loss(state: State) -> float:
        scratch = copy.deepcopy(model)
        scratch.load_state_dict(state)
        with torch.no_grad():
            return float(F.cross_entropy(scratch(data.x[val]), data.y[val]))

    raw = []
    for peer in peers:
        dist = float(np.sqrt(sum(float(((peer[k].double() - own[k].double()) ** 2).sum()) for k in own)))
        raw.append((loss(own) - loss(peer)) / dist if dist > 0 else 0.0)
    w = np.array(raw)
    mix = np.maximum(w, 0) / np.maximum(w, 0).sum()
    combined = {k: (own[k].double() + sum(m * (peer[k].double() - own[k].double()) for m, peer in zip(mix, peers))
                    ).float() for k in own}
    return w, combined


def test_the_weights_and_the_combined_model_are_the_paper_s():
    """Local epochs 0: what the client trains from is the first-order step over the downloaded
    models, and the weights it reports are the raw w_n, by slot, padded to M."""
    torch.manual_seed(0)
    own_model, data = FedPACNet(1, 28, 10), _data()
    own = _state(own_model)
    peers = _peers(own_model, data)
    model = copy.deepcopy(own_model)
    result = client_routine(METHOD).local_update(model, data, Received(2, _section(peers)),
                                                 dataclasses.replace(CFG, local_epochs=0), torch.Generator())
    w, combined = hand_computation(own, peers, own_model, data)
    assert w[0] > 0 and w[3] > 0 and w[1] < 0 and w[2] == 0  # two better, one worse, one the same
    reported = result.statistics[WEIGHTS]
    assert reported.shape == (5,) and reported[4] == 0
    np.testing.assert_allclose(reported[:4], w, rtol=1e-5)
    for key, value in combined.items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=1e-5, msg=key)
    assert result.num_examples == 40


def test_the_client_trains_the_combined_model_on_the_data_less_its_validation_split():
    torch.manual_seed(0)
    own_model, data = FedPACNet(1, 28, 10), _data()
    peers = _peers(own_model, data)
    model = copy.deepcopy(own_model)
    client_routine(METHOD).local_update(model, data, Received(2, _section(peers)), CFG,
                                        torch.Generator().manual_seed(4))
    _, combined = hand_computation(_state(own_model), peers, own_model, data)
    reference = copy.deepcopy(own_model)
    reference.load_state_dict(combined)
    train = torch.randperm(40, generator=torch.Generator().manual_seed(CFG.seed))[10:]
    train_joint(reference, data.x[train], data.y[train], CFG, torch.Generator().manual_seed(4))
    for key, value in _state(reference).items():
        torch.testing.assert_close(model.state_dict()[key], value, atol=1e-6, rtol=1e-5, msg=key)


def test_with_no_better_model_or_none_sent_the_client_keeps_its_own():
    torch.manual_seed(0)
    own_model, data = FedPACNet(1, 28, 10), _data()
    worse = _peers(own_model, data)[1:3]  # the far-off model and the copy
    cfg = dataclasses.replace(CFG, local_epochs=0)
    for sections in (_section(worse), {}):
        model = copy.deepcopy(own_model)
        result = client_routine(METHOD).local_update(model, data, Received(2, sections), cfg, torch.Generator())
        assert all(torch.equal(a, b) for a, b in zip(model.parameters(), own_model.parameters()))
        assert (result.statistics[WEIGHTS][:2] <= 0).all()
    with pytest.raises(ValueError, match="more than fedfomo-models = 1"):
        client_routine(FedFomo("fedfomo", models=1)).local_update(copy.deepcopy(own_model), data,
                                                                  Received(2, _section(worse)), cfg, torch.Generator())


def _server(method: FedFomo = METHOD):
    torch.manual_seed(0)
    extractor, head = split_state({k: v.numpy() for k, v in FedPACNet(1, 28, 10).state_dict().items()})
    return server_part(method, CFG, extractor, head), extractor, head


def _model_of(extractor, head, value: float) -> dict:
    return {k: np.full_like(v, value) for k, v in {**extractor, **head}.items()}


def test_the_server_sends_each_client_its_own_model_and_the_others_by_affinity():
    server, extractor, head = _server(FedFomo("fedfomo", models=2, epsilon=0.0))
    state = server.initial_state()
    assert server.select([0, 1, 2, 3], 4, 1, False) is None
    assert server.train_sections(state, 0) == ({}, {}) and server.sent[0] == []  # round 1: no model to send
    for pid in range(4):  # round 1: the initial model, nothing else
        assert all(np.array_equal(server.model_for(state, pid)[k], v) for k, v in {**extractor, **head}.items())
    for pid in range(4):
        state.keep(MODELS, pid, _model_of(extractor, head, float(pid)))
    state.keep(AFFINITY, 0, {SCORES: np.array([9.0, 0.5, -1.0, 2.0])})  # its own score is never used
    server.select([0, 1, 2, 3], 4, 2, False)
    sections, _ = server.train_sections(state, 0)
    sent = sections[PEERS]
    assert {name.split("/")[0] for name in sent} == {"0", "1"}  # M = 2 slots
    assert all(np.all(sent[f"0/{k}"] == 3.0) and np.all(sent[f"1/{k}"] == 1.0) for k in extractor)  # by affinity
    assert all(np.all(v == 0.0) for v in server.model_for(state, 0).values())  # its own model
    assert server.sent[0] == [3, 1]
    # with M above the others' count: all of them, never the client itself
    wide = server_part(FedFomo("fedfomo", models=5, epsilon=0.0), CFG, extractor, head)
    wide.select([0, 1, 2, 3], 4, 2, False)
    wide.train_sections(state, 2)
    assert sorted(wide.sent[2]) == [0, 1, 3]


def test_exploration_draws_at_random_and_decays():
    server, extractor, head = _server(FedFomo("fedfomo", models=1, epsilon=1.0))
    state = server.initial_state()
    for pid in range(6):
        state.keep(MODELS, pid, _model_of(extractor, head, float(pid)))
    state.keep(AFFINITY, 0, {SCORES: np.array([0.0, 5.0, 0.0, 0.0, 0.0, 0.0])})
    chosen = set()
    for server_round in range(2, 12):
        server.select(list(range(6)), 6, server_round, False)
        server.train_sections(state, 0)
        chosen.update(server.sent[0])
    assert len(chosen) > 1 and 0 not in chosen  # exploring, never its own
    greedy = _server(FedFomo("fedfomo", models=1, epsilon=0.0))[0]
    greedy.select(list(range(6)), 6, 2, False)
    greedy.train_sections(state, 0)
    assert greedy.sent[0] == [1]
    assert [exploration(0.3, r) for r in (2, 3, 8, 9)] == pytest.approx([0.3, 0.25, 0.0, 0.0])


def test_the_server_keeps_each_reply_s_model_and_adds_its_weights_to_the_affinities():
    server, extractor, head = _server(FedFomo("fedfomo", models=3, epsilon=0.0))
    state = server.initial_state()
    for pid in range(3):
        state.keep(MODELS, pid, _model_of(extractor, head, float(pid)))
    server.select([0, 1, 2], 3, 2, False)
    for pid in range(3):
        server.train_sections(state, pid)
    reply = {k: np.full_like(v, 7.0) for k, v in {**extractor, **head}.items()}
    weights = np.array([0.6, -0.2, 0.0])
    update = server.check(Update(partition_id=0, num_examples=10, metrics={}, statistics={WEIGHTS: weights},
                                 extractor={k: reply[k] for k in extractor}, head={k: reply[k] for k in head}))
    peers = server.sent[0]
    assert len(peers) == 2 and update.parsed["peers"] == peers
    with pytest.raises(InvalidReply, match="weights for 3 models, but 2 were sent"):
        server.check(dataclasses.replace(update, statistics={WEIGHTS: np.array([0.6, -0.2, 0.1])}))
    others = [server.check(Update(partition_id=pid, num_examples=10, metrics={}, statistics={WEIGHTS: np.zeros(3)},
                                  extractor={k: reply[k] for k in extractor}, head={k: reply[k] for k in head}))
              for pid in (1, 2)]
    result = server.step(state, [update, *others], np.ones(3), server_round=2)
    scores = state.personal[AFFINITY][0][SCORES]
    expected = np.zeros(3)
    expected[peers[0]], expected[peers[1]] = 0.6 / 0.4, -0.2 / 0.4  # w_n / |sum w|, by hand
    np.testing.assert_allclose(scores, expected)
    assert all(np.all(v == 7.0) for v in state.personal[MODELS][0].values())
    assert result.record["fomo_peers"][0] == peers


def test_the_settings_come_from_the_run_config_and_are_checked():
    assert METHODS["fedfomo"] == FedFomo("fedfomo", models=5, val_fraction=0.2, epsilon=0.3)
    assert not METHODS["fedfomo"].keeps_anything_at_site
    cfg = parse_run_config({"strategy": "fedfomo", "fedfomo-models": 3, "fedfomo-val-fraction": 0.1,
                            "fedfomo-epsilon": 0.0})
    assert configured_method(cfg) == FedFomo("fedfomo", models=3, val_fraction=0.1, epsilon=0.0)
    for key, bad, reason in (("fedfomo-models", 0, "must be >= 1"), ("fedfomo-val-fraction", 1.0, "must be in"),
                             ("fedfomo-epsilon", 1.5, "must be in")):
        with pytest.raises(ConfigError, match=f"run config '{key}' = .* is invalid: {reason}"):
            parse_run_config({"strategy": "fedavg", key: bad})
    with pytest.raises(ConfigError, match="run config 'dp' = True is invalid: must be false with strategy 'fedfomo': "
                                          "FedFomo weighs the other sites' models"):
        parse_run_config({"strategy": "fedfomo", "dp": True})


def test_a_short_federation_learns_and_every_client_gets_the_others_models(tmp_path):
    config = {"strategy": "fedfomo", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 3,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    grid = InProcessGrid(config, 3)
    strategy, report = run_fedpac(cast(Grid, grid), cfg, 1)
    accuracy = [float(np.mean(list(r.accuracy.values()))) for r in report.rounds]
    assert accuracy[-1] >= 0.7 and accuracy[-1] >= accuracy[0], accuracy
    assert sorted(strategy.state.personal[MODELS]) == [0, 1, 2]
    assert report.rounds[0].method["fomo_peers"] == [[], [], []]  # round 1: nothing to download
    for record in report.rounds[1:]:
        assert [sorted(peers) for peers in record.method["fomo_peers"]] == [[1, 2], [0, 2], [0, 1]]
    # what travelled: each train message of rounds 2 and 3 has the two other clients' models
    train = [m for m in grid.sent if m.metadata.message_type == "train"]
    assert sum(PEERS in p.sections_of(m.content) for m in train) == 6
