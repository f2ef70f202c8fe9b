"""pFedHN: the server's step against a from-scratch reference (a hypernetwork written here, the
chain rule by torch.autograd, the authors' optimizer by torch.optim.SGD) over two rounds; the
client's local update against plain SGD written here; the seeded embeddings of clients not seen
yet; the settings; the state through a checkpoint; and a short federation that learns."""

from __future__ import annotations

import csv
import dataclasses
import json
import math
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.serverapp import Grid
from torch import nn

from common.config import ConfigError, FedPACConfig, configured_method, parse_run_config
from common.methods import METHODS, Rule
from common.methods.client import LocalData, Received, client_routine
from common.methods.pfedhn import PFedHN
from common.methods.pfedhn.hypernetwork import Architecture, HyperNetwork, size
from common.methods.pfedhn.server import (
    EMBEDDING_MOMENTUM,
    EMBEDDINGS,
    HYPERNETWORK,
    HYPERNETWORK_MOMENTUM,
    Server,
)
from common.methods.server import EXTRACTOR, HEAD, Update, server_part
from common.model import FedPACNet, split_state
from common.validation import InvalidReply
from benches import load_bench
from federation import InProcessGrid
from server_app.app import initial_model, run_fedpac
from server_app.checkpoint import load_checkpoint
from server_app.strategy import PersonalizedStrategy

CFG = FedPACConfig(strategy="pfedhn", seed=3)
# A tiny hypernetwork for the reference: 3-dimensional embeddings, 8 hidden units.
TINY = PFedHN("pfedhn", embedding_dim=3, hidden=8)


def _templates(seed: int = 0) -> tuple[dict[str, np.ndarray], dict[str, np.ndarray]]:
    torch.manual_seed(seed)
    return split_state({k: v.numpy() for k, v in FedPACNet(1, 28, 10).state_dict().items()})


def _server(method: PFedHN = TINY, cfg: FedPACConfig = CFG) -> Server:
    extractor, head = _templates()
    server = server_part(method, cfg, extractor, head)
    assert isinstance(server, Server)
    return server


# ---------------------------------------------------------------------------- the reference


class ReferenceHypernetwork(nn.Module):
    """The authors' CNNHyper, written out: embedding -> Linear -> 3 x (ReLU, Linear) -> one Linear
    per weight array of the model, reshaped."""

    def __init__(self, shapes: dict[str, tuple[int, ...]], embedding_dim: int, hidden: int) -> None:
        super().__init__()
        self.shapes = shapes
        self.first = nn.Linear(embedding_dim, hidden)
        self.hidden = nn.ModuleList([nn.Linear(hidden, hidden) for _ in range(3)])
        self.out = nn.ModuleDict({name.replace(".", "_"): nn.Linear(hidden, math.prod(shape))
                                  for name, shape in shapes.items()})

    def forward(self, v: torch.Tensor) -> dict[str, torch.Tensor]:
        f = self.first(v)
        for layer in self.hidden:
            f = layer(torch.relu(f))
        return {name: self.out[name.replace(".", "_")](f).view(shape) for name, shape in self.shapes.items()}

    def load_phi(self, phi: dict[str, np.ndarray]) -> None:
        """phi as the product keeps it: mlp.0 is the first layer, mlp.2, .4, .6 the hidden ones."""
        layers = {"mlp.0": self.first, **{f"mlp.{2 * i + 2}": layer for i, layer in enumerate(self.hidden)},
                  **{f"generators.{name.replace('.', '-')}": self.out[name.replace(".", "_")] for name in self.shapes}}
        with torch.no_grad():
            for prefix, layer in layers.items():
                layer.weight.copy_(torch.from_numpy(phi[f"{prefix}.weight"]))
                layer.bias.copy_(torch.from_numpy(phi[f"{prefix}.bias"]))


def _reference_round(net: ReferenceHypernetwork, embeddings: dict[int, nn.Parameter], optimizer: torch.optim.SGD,
                     trained: dict[int, dict[str, np.ndarray]]) -> None:
    """The paper's server step for each reply, in partition order: grad of (phi, v_i) =
    (d theta_i / d (phi, v_i))^T (theta_i - theta~_i), the gradient of (1/2) ||h(v_i; phi) -
    theta~_i||^2 at the phi of that step (the first step's phi generated theta_i, later ones see
    the round's earlier steps), clipped to norm 50, one torch.optim.SGD step (only phi and this
    v_i have a gradient)."""
    for pid in sorted(trained):
        theta = net(embeddings[pid])
        names = list(theta)
        delta = [theta[k].detach() - torch.from_numpy(trained[pid][k]) for k in names]
        grads = torch.autograd.grad([theta[k] for k in names], [*net.parameters(), embeddings[pid]],
                                    grad_outputs=delta)
        optimizer.zero_grad(set_to_none=True)
        for param, grad in zip([*net.parameters(), embeddings[pid]], grads):
            param.grad = grad.clone()
        torch.nn.utils.clip_grad_norm_([*net.parameters(), embeddings[pid]], 50.0)
        optimizer.step()


def _replies(server: Server, state, pids: list[int], rng: np.random.Generator, scale: dict[int, float]
             ) -> tuple[list[Update], dict[int, dict[str, np.ndarray]]]:
    """Each client's trained model: the one it was sent plus noise of its own scale."""
    updates, trained = [], {}
    for pid in pids:
        sent = server.model_for(state, pid)
        model = {k: (v + scale[pid] * rng.standard_normal(v.shape)).astype(np.float32) for k, v in sent.items()}
        trained[pid] = model
        extractor, head = split_state(model)
        updates.append(Update(partition_id=pid, extractor=extractor, head=head, num_examples=10 * (pid + 1),
                              metrics={}))
    return updates, trained


def _close(a: np.ndarray, b: np.ndarray | torch.Tensor) -> None:
    # rtol 1e-4: two float32 implementations (functional_call against nn.Linear layers, on any
    # thread count) differ in the last bits of theta_i, and a round's later steps take their
    # gradient from theta_i - theta~_i, a difference of nearby numbers (1.1e-6 apart at most here)
    np.testing.assert_allclose(a, np.asarray(b.detach() if isinstance(b, torch.Tensor) else b), rtol=1e-4, atol=1e-5)


def test_two_rounds_of_the_server_step_are_the_chain_rule_through_the_hypernetwork_with_the_authors_sgd():
    """Round 1: clients 0, 1, 2 reply; round 2: clients 0 and 2, client 2's update large enough
    that the gradient is clipped. phi, the momentum buffers, the embeddings and the generated
    models all follow the reference; client 1, absent in round 2, keeps its embedding."""
    server = _server()
    state = server.initial_state()
    shapes = {k: tuple(v.shape) for k, v in server.reply_template().items()}
    net = ReferenceHypernetwork(shapes, TINY.embedding_dim, TINY.hidden)
    net.load_phi(state.shared[HYPERNETWORK])
    embeddings = {pid: nn.Parameter(torch.from_numpy(server.embedding(state, pid).copy())) for pid in range(3)}
    optimizer = torch.optim.SGD([*net.parameters(), *embeddings.values()], lr=TINY.server_lr, momentum=0.9,
                                weight_decay=1e-3)
    rng = np.random.default_rng(0)
    for server_round, (pids, scale) in enumerate([([0, 1, 2], {0: 0.05, 1: 0.06, 2: 0.07}),
                                                  ([0, 2], {0: 0.01, 2: 5.0})], start=1):
        updates, trained = _replies(server, state, pids, rng, scale)
        for pid in pids:  # what the clients were sent is what the reference generates
            for key, value in net(embeddings[pid]).items():
                _close(server.model_for(state, pid)[key], value)
        weights = np.array([u.num_examples for u in updates], dtype=np.float64)
        server.step(state, updates, weights / weights.sum(), server_round)
        _reference_round(net, embeddings, optimizer, trained)

        phi = state.shared[HYPERNETWORK]
        reference = ReferenceHypernetwork(shapes, TINY.embedding_dim, TINY.hidden)
        reference.load_phi(phi)
        for mine, theirs in zip(reference.parameters(), net.parameters()):
            _close(mine.detach().numpy(), theirs)
        mine_buffers = ReferenceHypernetwork(shapes, TINY.embedding_dim, TINY.hidden)
        mine_buffers.load_phi(state.shared[HYPERNETWORK_MOMENTUM])
        for mine, param in zip(mine_buffers.parameters(), net.parameters()):
            _close(mine.detach().numpy(), optimizer.state[param]["momentum_buffer"])
        for pid in range(3):
            _close(server.embedding(state, pid), embeddings[pid])
            _close(state.personal[EMBEDDING_MOMENTUM][pid]["embedding"],
                   optimizer.state[embeddings[pid]]["momentum_buffer"])
            for key, value in net(embeddings[pid]).items():
                _close(server.model_for(state, pid)[key], value)
    assert sorted(state.personal[EMBEDDINGS]) == [0, 1, 2]


def test_the_step_moves_each_generated_model_towards_the_one_its_client_trained():
    """The sign: a client's step moves its generated model along its update Delta theta_i (a
    positive inner product; the whole distance need not shrink, phi being one for all)."""
    for pid in (0, 1):
        server = _server()
        state = server.initial_state()
        updates, trained = _replies(server, state, [pid], np.random.default_rng(pid), {pid: 1e-3})
        before = server.model_for(state, pid)
        server.step(state, updates, np.ones(1), 1)
        after, target = server.model_for(state, pid), trained[pid]
        moved = sum(float(np.sum((after[k] - before[k]) * (target[k] - before[k]))) for k in target)
        assert moved > 0, pid


def test_a_client_not_seen_yet_gets_an_embedding_drawn_from_the_run_seed():
    """Deterministic per (seed, partition-id), whatever the server saw before; N(0, I) like
    nn.Embedding's; a node bound to no partition gets the shared model, generated for its own."""
    one, two = _server(), _server()
    state_one, state_two = one.initial_state(), two.initial_state()
    updates, _ = _replies(one, state_one, [0, 1], np.random.default_rng(2), {0: 0.1, 1: 0.1})
    one.step(state_one, updates, np.full(2, 0.5), 1)
    assert 7 not in state_one.personal[EMBEDDINGS]
    np.testing.assert_array_equal(one.embedding(state_one, 7), two.embedding(state_two, 7))
    assert not np.array_equal(one.embedding(state_one, 7), one.embedding(state_one, 8))
    other_seed = _server(cfg=dataclasses.replace(CFG, seed=4))
    assert not np.array_equal(other_seed.embedding(other_seed.initial_state(), 7), one.embedding(state_one, 7))
    draws = np.stack([one.embedding(state_two, pid) for pid in range(400)])
    assert abs(draws.mean()) < 0.1 and abs(draws.std() - 1.0) < 0.1
    assert not np.array_equal(one.embedding(state_one, 0), two.embedding(state_two, 0))  # 0 has learned
    unbound = one.model_for(state_one, None)
    for key, value in {**state_one.shared[EXTRACTOR], **state_one.shared[HEAD]}.items():
        np.testing.assert_array_equal(unbound[key], value)


def test_the_hypernetwork_generates_every_weight_of_the_model_and_pc_the_extractor_only():
    server = _server(METHODS["pfedhn"])
    state = server.initial_state()
    extractor, head = _templates()
    model = server.model_for(state, 0)
    assert {k: v.shape for k, v in model.items()} == {k: v.shape for k, v in {**extractor, **head}.items()}
    assert all(v.dtype == np.float32 for v in model.values())
    phi = state.shared[HYPERNETWORK]
    assert sum(v.size for v in phi.values()) == size(server.targets, Architecture(6, 100)) == 11_854_666
    # phi^0 is the same for a seed and leaves torch's global random state alone
    fresh = server_part(METHODS["pfedhn"], CFG, extractor, head)
    torch.manual_seed(11)
    expected = torch.rand(1)
    torch.manual_seed(11)
    again = fresh.initial_state().shared[HYPERNETWORK]
    assert torch.equal(torch.rand(1), expected)
    assert all(np.array_equal(phi[k], again[k]) for k in phi)
    pc = _server(METHODS["pfedhn-pc"])
    assert set(pc.model_for(pc.initial_state(), 0)) == set(extractor)
    assert HEAD not in pc.initial_state().shared
    assert isinstance(HyperNetwork(server.targets, Architecture(6, 100)), nn.Module)


# ---------------------------------------------------------------------------- the client


def _data(seed: int = 0) -> LocalData:
    generator = torch.Generator().manual_seed(seed)
    y = torch.arange(40) % 4
    x = 0.5 * torch.randn(40, 1, 28, 28, generator=generator)
    for k in range(4):
        x[y == k, :, 4 * k : 4 * k + 8, 4 * k : 4 * k + 8] += 2.0
    return LocalData(x[:30], y[:30], x[30:], y[30:])


def test_the_local_update_is_plain_sgd_on_the_received_model_at_the_client_step():
    """Round 2 at a site: the model received is the one the hypernetwork generated for it (not
    FedPACNet's initialization); with momentum and weight decay 0 the update is plain SGD at
    extractor-lr over local-epochs shuffles of batch-size, written here from scratch."""
    server = _server()
    state = server.initial_state()
    updates, _ = _replies(server, state, [0], np.random.default_rng(3), {0: 0.01})
    server.step(state, updates, np.ones(1), 1)
    received = {k: torch.from_numpy(v.copy()) for k, v in server.model_for(state, 0).items()}
    cfg = dataclasses.replace(CFG, local_epochs=2, batch_size=8, extractor_lr=0.01, momentum=0.0, weight_decay=0.0)
    model = FedPACNet(1, 28, 10)
    model.load_state_dict(received)
    data = _data()
    result = client_routine(METHODS["pfedhn"]).local_update(model, data, Received(server_round=2), cfg,
                                                            torch.Generator().manual_seed(5))
    # from scratch: the same shuffles, w <- w - lr * grad CE
    reference = FedPACNet(1, 28, 10)
    reference.load_state_dict(received)
    params = dict(reference.named_parameters())
    generator = torch.Generator().manual_seed(5)
    losses = []
    for _ in range(cfg.local_epochs):
        for idx in torch.randperm(len(data.y), generator=generator).split(cfg.batch_size):
            loss = F.cross_entropy(reference(data.x[idx]), data.y[idx])
            grads = torch.autograd.grad(loss, list(params.values()))
            with torch.no_grad():
                for param, grad in zip(params.values(), grads):
                    param -= cfg.extractor_lr * grad
            losses.append(float(loss) * len(idx))
    for key, value in reference.state_dict().items():
        torch.testing.assert_close(model.state_dict()[key], value, rtol=1e-5, atol=1e-6)
    assert not torch.equal(model.state_dict()["head.weight"], received["head.weight"])
    assert result.num_examples == 30 and not result.statistics
    # and the trained model's accuracy on the site's test split (under DP the one metric sent)
    reference.eval()
    with torch.no_grad():
        accuracy = float((reference(data.x_test).argmax(1) == data.y_test).float().mean())
    assert result.metrics["local-accuracy"] == pytest.approx(accuracy) and result.for_server == ("local-accuracy",)
    assert result.train_loss == pytest.approx(sum(losses) / (cfg.local_epochs * len(data.y)), rel=1e-5)


# ---------------------------------------------------------------------------- settings


def test_a_reply_must_carry_its_trained_models_accuracy_in_0_1():
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(CFG).state_dict().items()})
    server = server_part(configured_method(CFG), CFG, extractor, head)
    reply = Update(0, extractor, head, 10, {"local-accuracy": 0.75})
    assert server.check(reply) == reply
    for metrics, message in [({}, "missing metric 'local-accuracy'"), ({"local-accuracy": 1.5}, r"outside \[0, 1\]"),
                             ({"local-accuracy": float("nan")}, "not a finite number")]:
        with pytest.raises(InvalidReply, match=message):
            server.check(dataclasses.replace(reply, metrics=metrics))


def test_the_registered_methods_and_their_settings():
    plain, pc = METHODS["pfedhn"], METHODS["pfedhn-pc"]
    assert plain == PFedHN("pfedhn") and (plain.server_lr, plain.embedding_dim, plain.hidden) == (0.01, 6, 100)
    assert (plain.extractor, plain.head) == (Rule.AVERAGE, Rule.AVERAGE) and plain.site_parts == ()
    assert pc.head is Rule.LOCAL and pc.site_parts == ("head",)
    cfg = parse_run_config({"strategy": "pfedhn-pc", "pfedhn-server-lr": 0.05, "pfedhn-embedding-dim": 4,
                            "pfedhn-hidden": 32})
    assert configured_method(cfg) == PFedHN("pfedhn-pc", head=Rule.LOCAL, server_lr=0.05, embedding_dim=4,
                                            hidden=32)
    assert parse_run_config({"pfedhn-hidden": 100}).method_settings == ()  # the default is not recorded
    for key, bad, message in [("pfedhn-server-lr", 0.0, "a step size > 0"),
                              ("pfedhn-server-lr", -0.01, "a step size"),
                              ("pfedhn-server-lr", float("inf"), "a finite number"),
                              ("pfedhn-embedding-dim", 0, "a whole number >= 1"),
                              ("pfedhn-hidden", -5, "a whole number")]:
        with pytest.raises(ConfigError, match=f"run config '{key}' = .* is invalid: must be {message}"):
            parse_run_config({"strategy": "pfedhn", key: bad})
    for key, bad in [("pfedhn-embedding-dim", 2.5), ("pfedhn-hidden", True), ("pfedhn-server-lr", "0.01")]:
        with pytest.raises(ConfigError, match="wrong type"):
            parse_run_config({key: bad})
    with pytest.raises(ValueError, match="generates the extractor"):
        PFedHN("pfedhn-x", extractor=Rule.LOCAL)


# ---------------------------------------------------------------------------- the federation


def test_a_short_federation_learns_and_its_state_survives_a_checkpoint(tmp_path):
    """Three clients of the embedded MNIST-5k, five rounds at the product's pFedHN settings: the
    generated models go from worse than guessing to well above it, each client's its own; the
    checkpoint restores phi, its momentum and the embeddings, and so the models sent next."""
    config = {"strategy": "pfedhn", "samples-per-client": 100, "test-samples-per-client": 50,
              "local-epochs": 2, "batch-size": 20, "extractor-lr": 0.05, "num-server-rounds": 5,
              "output-dir": str(tmp_path)}
    cfg = parse_run_config(config)
    strategy, report = run_fedpac(cast(Grid, InProcessGrid(config, 3)), cfg, 1)
    first, last = (np.mean(list(r.accuracy.values())) for r in (report.rounds[0], report.rounds[-1]))
    assert sorted(report.rounds[-1].accuracy) == [0, 1, 2]
    assert last >= 0.45 and last >= first + 0.3, [r.accuracy for r in report.rounds]
    server = strategy.server
    models = [server.model_for(strategy.state, pid)["head.weight"] for pid in range(3)]
    assert not np.allclose(models[0], models[1]) and not np.allclose(models[1], models[2])

    (run_dir,) = tmp_path.iterdir()
    checkpoint = load_checkpoint(run_dir)
    assert checkpoint.strategy == "pfedhn" and checkpoint.completed_rounds == 5
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    restored = PersonalizedStrategy(server=server_part(configured_method(cfg), cfg, extractor, head), num_rounds=6,
                                    seed=cfg.seed)
    restored.restore(checkpoint)
    for section in (HYPERNETWORK, HYPERNETWORK_MOMENTUM, EXTRACTOR, HEAD):
        for key, value in strategy.state.shared[section].items():
            np.testing.assert_array_equal(restored.state.shared[section][key], value)
    for section in (EMBEDDINGS, EMBEDDING_MOMENTUM):
        assert sorted(restored.state.personal[section]) == [0, 1, 2]
        for pid in range(3):
            np.testing.assert_array_equal(restored.state.personal[section][pid]["embedding"],
                                          strategy.state.personal[section][pid]["embedding"])
    for pid in range(3):
        for key, value in server.model_for(strategy.state, pid).items():
            np.testing.assert_array_equal(restored.server.model_for(restored.state, pid)[key], value)
    with np.load(run_dir / "final_state.npz") as final:  # phi and the embeddings, not the optimizer's state
        assert any(key.startswith(f"{HYPERNETWORK}/") for key in final.files)
        assert "client-1/embedding/embedding" in final.files
        assert not [key for key in final.files if "momentum" in key]

    # beside the generated models' accuracy, each round the models after the local update
    with (run_dir / "rounds.csv").open() as stream:
        rounds_csv = list(csv.DictReader(stream))
    local = [float(row["mean_local_accuracy"]) for row in rounds_csv]
    assert len(local) == 5 and all(0.0 <= value <= 1.0 for value in local)
    assert local == pytest.approx([np.mean([m["local-accuracy"] for m in r.train.values()]) for r in report.rounds])

    # bench/pfedhn_checkpoint.py reads the run where it stopped: its generated models are those
    # the run's last evaluation measured, and it continues the run with the server's own step
    load_bench("pfedhn_checkpoint").main([str(run_dir), "--rounds", "1", "--server-lr", "0.01",
                                          "--out", str(tmp_path / "bench")])
    rows = json.loads((tmp_path / "bench" / "pfedhn_checkpoint.json").read_text())["rows"]
    assert [(row["server_lr"], row["completed_rounds"]) for row in rows] == [("", 5), (0.01, 6)]
    assert rows[0]["generated_accuracy"] == pytest.approx(100 * last, abs=0.006)
