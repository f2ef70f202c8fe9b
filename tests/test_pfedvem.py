"""pFedVEM in the harness: the same ServerApp, ClientApp, validation, checkpoints and outputs.

Whole runs go through the real ServerApp and ClientApp in process (``federation.InProcessGrid``).
They show that every client's posterior persists on the server and changes per client, that
only the round's sample S_t is aggregated (checked against means computed by hand from the
recorded replies), that ``sampled-train`` trains only S_t, that S_t depends on (seed, round)
alone, that both accuracies reach the outputs, that a resumed run and a run whose SuperNode
restarted equal an uninterrupted one, and that malformed pFedVEM replies are rejected.
"""

from __future__ import annotations

import csv
import json
import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, MessageType, RecordDict

from common import protocol as p
from common.config import ConfigError, FedPACConfig, parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, SiteState, client_routine
from common.methods.pfedvem.client import POSTERIOR_SCALES
from common.methods.pfedvem.server import SCALE, initial_prior_head, mean_local_accuracy
from common.methods.server import EXTRACTOR, HEAD, Update, server_part
from common.model import FedPACNet, split_state
from common.site_state import SiteStore
from common.training import evaluate
from common.methods.pfedvem.variational import (
    GaussianHead,
    aggregate_sample,
    confidence_rho,
    draw_sample,
    posterior_mean_logits,
    softplus_inverse,
)
from federation import InProcessGrid, nan, set_array, set_metric, set_section
from server_app.app import initial_model, run_fedpac
from server_app.checkpoint import load_checkpoint
from server_app.strategy import PersonalizedStrategy

PFEDVEM = METHODS["pfedvem"]
BASE = {
    "strategy": "pfedvem",
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "num-server-rounds": 3,
    "vem-sampling-rate": 0.5,  # with 5 clients: S_t of 2 to 4, strict subsets (seed 0)
}
CLIENTS = 5
TIMES = {"train-seconds"}


class Recorder:
    """A tamper hook that keeps every training reply's records by (round, partition-id)."""

    def __init__(self):
        self.grid: InProcessGrid | None = None
        self.train: dict[tuple[int, int], RecordDict] = {}

    def __call__(self, reply, pid):
        if reply.metadata.message_type == MessageType.TRAIN and reply.has_content():
            self.train[(self.grid.train_rounds, pid)] = reply.content
        return reply


def _run(config, tmp_path, name, clients=CLIENTS, grid_seed=1, grid_class=InProcessGrid, **options):
    config = {**BASE, **config, "output-dir": str(tmp_path / name)}
    recorder = Recorder()
    grid = grid_class(config, clients, seed=grid_seed, tamper=recorder, **options)
    recorder.grid = grid
    strategy, report = run_fedpac(grid, parse_run_config(config), 1)
    return strategy, report, grid, recorder


def _train_messages(grid, server_round):
    return [m for m in grid.sent
            if m.metadata.message_type == MessageType.TRAIN and m.content[p.CONFIG][p.SERVER_ROUND] == server_round]


def _pid_of(grid, node_id):
    return grid.partition_of_node[node_id]


def _reply_parts(content):
    arrays = p.sections_of(content)[p.MODEL]
    extractor, head = split_state(arrays)
    return extractor, head, float(content[p.METRICS][p.RHO]), int(content[p.METRICS][p.NUM_EXAMPLES])


def _expected_aggregate(recorder, server_round, sample):
    """theta^{t+1} and w^{t+1} by hand: sample-weighted and confidence-weighted means over S_t."""
    parts = [_reply_parts(recorder.train[(server_round, pid)]) for pid in sample]
    n = np.array([part[3] for part in parts], dtype=np.float64)
    tau = np.array([1.0 / part[2] ** 2 for part in parts])
    extractor = {key: sum(w * part[0][key].astype(np.float64) for w, part in zip(n / n.sum(), parts))
                 for key in parts[0][0]}
    head = {key: sum(w * part[1][key].astype(np.float64) for w, part in zip(tau / tau.sum(), parts))
            for key in parts[0][1]}
    return extractor, head


def _assert_close(actual, expected):
    for key, value in expected.items():
        np.testing.assert_allclose(actual[key], value, rtol=1e-5, atol=1e-6, err_msg=key)


def _rows(path):
    return list(csv.DictReader(path.open()))


# ---------------------------------------------------------------------------- pure functions


def test_the_sample_depends_on_seed_and_round_only_and_has_at_least_two_clients():
    for server_round in range(1, 40):
        sample = draw_sample(10, 0.1, seed=3, server_round=server_round)
        assert len(sample) >= 2 and sample == sorted(set(sample)) and all(0 <= j < 10 for j in sample)
        assert sample == draw_sample(10, 0.1, seed=3, server_round=server_round)
    assert len({tuple(draw_sample(10, 0.3, 3, r)) for r in range(1, 40)}) > 10  # new draws per round
    assert draw_sample(10, 0.3, 3, 1) != draw_sample(10, 0.3, 4, 1) or draw_sample(10, 0.3, 3, 2) != draw_sample(
        10, 0.3, 4, 2)
    assert draw_sample(7, 1.0, 0, 1) == list(range(7))
    assert draw_sample(2, 0.01, 0, 1) == [0, 1]  # no more than the minimum: all of them
    # each client is in with probability r (on top of the >= 2 redraws, rare at J = 1000)
    sizes = [len(draw_sample(1000, 0.1, 0, r)) for r in range(1, 51)]
    assert 90 < np.mean(sizes) < 110


def test_sample_aggregate_uses_only_the_sample_and_keeps_the_previous_state_without_one():
    rng = np.random.default_rng(0)
    extractors = [{"w": rng.normal(size=(3, 2)).astype(np.float32)} for _ in range(4)]
    weights = [rng.normal(size=(5, 3)).astype(np.float32) for _ in range(4)]  # nn.Linear's (K, d)
    biases = [rng.normal(size=5).astype(np.float32) for _ in range(4)]
    rhos, n = [0.5, 1.0, 2.0, 0.25], [10, 20, 30, 40]
    previous = ({"w": np.zeros((3, 2), np.float32)}, (np.zeros((5, 3), np.float32), np.zeros(5, np.float32)))
    in_sample = [True, False, True, False]
    result = aggregate_sample(extractors, weights, biases, rhos, n, in_sample, *previous)
    assert result.used == [0, 2]
    np.testing.assert_allclose(result.extractor["w"], (10 * extractors[0]["w"] + 30 * extractors[2]["w"]) / 40,
                               rtol=1e-6)
    tau = np.array([1 / 0.5**2, 1 / 2.0**2])
    np.testing.assert_allclose(result.weight, (tau[0] * weights[0] + tau[1] * weights[2]) / tau.sum(), rtol=1e-6)
    np.testing.assert_allclose(result.bias, (tau[0] * biases[0] + tau[1] * biases[2]) / tau.sum(), rtol=1e-6)
    # a sampled client with a non-finite base enters neither mean
    broken = [dict(e) for e in extractors]
    broken[2] = {"w": np.full((3, 2), np.nan, np.float32)}
    result = aggregate_sample(broken, weights, biases, rhos, n, in_sample, *previous)
    assert result.used == [0] and 2 in result.excluded
    np.testing.assert_allclose(result.weight, weights[0], rtol=1e-6)
    # nobody of S_t replied: theta and w stay
    result = aggregate_sample(extractors, weights, biases, rhos, n, [False] * 4, *previous)
    assert result.used == []
    np.testing.assert_array_equal(result.extractor["w"], previous[0]["w"])
    np.testing.assert_array_equal(result.weight, previous[1][0])


def test_the_server_step_keeps_every_posterior_mean_and_returns_the_prior_mean():
    rng = np.random.default_rng(1)
    heads = [{p.HEAD_WEIGHT: rng.normal(size=(4, 3)), p.HEAD_BIAS: rng.normal(size=4)} for _ in range(3)]
    extractors = [{"w": rng.normal(size=2)} for _ in range(3)]
    server = server_part(PFEDVEM, FedPACConfig(strategy="pfedvem"), extractors[0], heads[0])
    server.sample = [0, 1]  # S_t: the third reply is not in it
    state = server.initial_state()
    state.shared[EXTRACTOR], state.shared[HEAD] = extractors[0], heads[0]

    def update(pid, metrics):
        return Update(partition_id=pid, extractor=extractors[pid], head=heads[pid], num_examples=1, metrics=metrics)

    updates = [server.check(update(pid, {p.RHO: 1.0, p.LOCAL_ACCURACY: 0.5})) for pid in range(3)]
    step = server.step(state, updates, np.array([1.0, 1.0, 1.0]), 1)
    assert step.record["aggregated"] == [0, 1]
    assert sorted(state.personal[HEAD]) == [0, 1, 2] and SCALE not in state.personal  # the scales stay at the sites
    for pid, sent in enumerate(heads):  # never reset to w
        np.testing.assert_array_equal(state.personal[HEAD][pid][p.HEAD_WEIGHT], sent[p.HEAD_WEIGHT])
    expected = (heads[0][p.HEAD_WEIGHT] + heads[1][p.HEAD_WEIGHT]) / 2
    np.testing.assert_allclose(state.shared[HEAD][p.HEAD_WEIGHT], expected)
    with pytest.raises(ValueError, match="rho"):  # a reply without its rho never reaches the step
        server.check(update(0, {p.LOCAL_ACCURACY: 0.5}))


def test_the_linear_layout_is_transposed_once_into_the_papers():
    torch.manual_seed(0)
    linear = torch.nn.Linear(6, 4)
    scale = {"weight": torch.full((4, 6), 0.3), "bias": torch.full((4,), 0.3)}
    head = GaussianHead.from_linear(linear.weight, linear.bias, scale["weight"], scale["bias"])
    assert head.weight_mu.shape == (6, 4) and head.weight_s.shape == (6, 4)
    z = torch.randn(5, 6)
    torch.testing.assert_close(posterior_mean_logits(z, head.weight_mu, head.bias_mu), linear(z).detach())
    weight, bias = head.linear_mean()
    torch.testing.assert_close(weight, linear.weight.detach())
    torch.testing.assert_close(head.linear_scale()[0], scale["weight"])


# ---------------------------------------------------------------------------- the client routine


def _posterior(model, seed=0, sigma=0.7):
    """The prior mean the server sends, and the scales the site kept (nn.Linear's layout)."""
    g = torch.Generator().manual_seed(seed)
    prior_weight = torch.randn(model.head.weight.shape, generator=g)  # nn.Linear's (K, d)
    prior_bias = torch.randn(model.head.bias.shape, generator=g)
    s = softplus_inverse(sigma)
    return ({p.PRIOR_WEIGHT: prior_weight, p.PRIOR_BIAS: prior_bias},
            {p.HEAD_WEIGHT: torch.full_like(prior_weight, s), p.HEAD_BIAS: torch.full_like(prior_bias, s)})


def _site(scales: dict) -> SiteState:
    return SiteState({POSTERIOR_SCALES: {k: v.numpy() for k, v in scales.items()}})


def _site_scales(strategy, pid: int, up_to: int) -> dict:
    """The posterior scales site ``pid`` kept after round ``up_to`` (``common.site_state``)."""
    store = SiteStore(Path(os.environ["FLWR_HOME"]) / "fedpac-site-state", pid, strategy.lineage)
    return store.load(up_to)[POSTERIOR_SCALES]


def test_the_variational_routine_takes_rho_first_then_trains_the_posterior_and_the_base():
    torch.manual_seed(0)
    model, x, y = FedPACNet(1, 28, 10), torch.randn(40, 1, 28, 28), torch.arange(40) % 5
    x_test, y_test = torch.randn(20, 1, 28, 28), torch.arange(20) % 5
    posterior, scales = _posterior(model)
    data = LocalData(x, y, x_test, y_test, _site(scales))
    received = Received(sections={p.POSTERIOR: {k: v.numpy() for k, v in posterior.items()}})
    cfg = FedPACConfig(strategy="pfedvem", local_epochs=1)
    routine = client_routine(METHODS[cfg.strategy])
    mean_before = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
    extractor_before = [q.detach().clone() for q in model.extractor.parameters()]
    received_head = GaussianHead.from_linear(model.head.weight, model.head.bias, scales[p.HEAD_WEIGHT],
                                             scales[p.HEAD_BIAS])
    expected_rho = confidence_rho(received_head, posterior[p.PRIOR_WEIGHT].T, posterior[p.PRIOR_BIAS])

    update = routine.local_update(model, data, received, cfg, torch.Generator().manual_seed(0))

    assert update.metrics[p.RHO] == pytest.approx(expected_rho)  # the posterior as received, against w^t
    assert bool(update.metrics["posterior-restored"]) is False and np.isfinite(update.metrics["head-loss"])
    assert not torch.equal(model.head.weight, mean_before["weight"])  # the E-step moved mu ...
    kept = data.state.get(POSTERIOR_SCALES)  # ... and s, which the site keeps and never sends
    assert not np.array_equal(kept[p.HEAD_WEIGHT], scales[p.HEAD_WEIGHT].numpy()) and not update.statistics
    assert kept[p.HEAD_WEIGHT].shape == model.head.weight.shape  # back in (K, d)
    assert all(not torch.equal(b, a) for b, a in zip(extractor_before, model.extractor.parameters()))
    # pFedVEM's own evaluation: the locally trained model (local base, posterior mean) on the test split
    local_loss, local_accuracy = evaluate(model, x_test, y_test)
    assert update.metrics[p.LOCAL_ACCURACY] == local_accuracy
    assert update.metrics[p.LOCAL_LOSS] == local_loss
    # the same round, seed and inputs train the same posterior (a resumed run depends on it)
    torch.manual_seed(0)
    again = FedPACNet(1, 28, 10)
    data_again = LocalData(x, y, x_test, y_test, _site(scales))
    routine.local_update(again, data_again, received, cfg, torch.Generator().manual_seed(0))
    torch.testing.assert_close(again.head.weight, model.head.weight, rtol=0, atol=0)
    np.testing.assert_array_equal(data_again.state.get(POSTERIOR_SCALES)[p.HEAD_BIAS], kept[p.HEAD_BIAS])


# ---------------------------------------------------------------------------- whole runs


def test_all_train_trains_everyone_aggregates_only_the_sample_and_keeps_every_posterior(tmp_path):
    strategy, report, grid, recorder = _run({}, tmp_path, "all-train")
    rounds = BASE["num-server-rounds"]
    strict_subset_seen = False
    for server_round in range(1, rounds + 1):
        record = report.rounds[server_round - 1]
        sample = draw_sample(CLIENTS, 0.5, seed=0, server_round=server_round)
        assert record.method["sampled"] == sample and record.method["aggregated"] == sample and len(sample) >= 2
        messages = _train_messages(grid, server_round)
        assert sorted(_pid_of(grid, m.metadata.dst_node_id) for m in messages) == list(range(CLIENTS))
        assert sorted(record.train) == list(range(CLIENTS))  # everyone trained and replied
        extractor, head = _expected_aggregate(recorder, server_round, sample)
        if server_round < rounds:
            # the next round's messages carry theta^{t+1}, w^{t+1} and every client's own posterior
            # mean (its scales stay at the site: neither this round's reply nor the next message has them)
            for message in _train_messages(grid, server_round + 1):
                pid = _pid_of(grid, message.metadata.dst_node_id)
                arrays = p.sections_of(message.content)[p.MODEL]
                posterior = p.sections_of(message.content)[p.POSTERIOR]
                assert sorted(posterior) == sorted([p.PRIOR_WEIGHT, p.PRIOR_BIAS])
                _assert_close(arrays, extractor)
                _assert_close({p.HEAD_WEIGHT: posterior[p.PRIOR_WEIGHT], p.HEAD_BIAS: posterior[p.PRIOR_BIAS]}, head)
                sent_back = recorder.train[(server_round, pid)]
                _, own_mean, _, _ = _reply_parts(sent_back)
                assert p.STATISTICS not in p.sections_of(sent_back)
                np.testing.assert_array_equal(arrays[p.HEAD_WEIGHT], own_mean[p.HEAD_WEIGHT])
        else:
            _assert_close(strategy.extractor, extractor)
            _assert_close(strategy.state.shared[HEAD], head)
        if len(sample) < CLIENTS:
            everyone, _ = _expected_aggregate(recorder, server_round, list(range(CLIENTS)))
            assert not np.allclose(everyone["extractor.0.weight"], extractor["extractor.0.weight"])
            strict_subset_seen = True
    assert strict_subset_seen

    # posteriors: one per client, different between clients, moved from w^0 and from round to round
    initial = initial_prior_head(parse_run_config(BASE))
    heads = strategy.state.personal[HEAD]
    scales = {pid: _site_scales(strategy, pid, rounds) for pid in range(CLIENTS)}
    assert sorted(heads) == list(range(CLIENTS)) and SCALE not in strategy.state.personal
    means = [heads[pid][p.HEAD_WEIGHT] for pid in range(CLIENTS)]
    assert all(not np.array_equal(a, b) for i, a in enumerate(means) for b in means[i + 1:])
    assert all(not np.array_equal(m, initial[p.HEAD_WEIGHT]) for m in means)
    s0 = softplus_inverse(1.0)
    assert all(not np.allclose(scales[pid][p.HEAD_WEIGHT], s0) for pid in range(CLIENTS))
    first_round = [_reply_parts(recorder.train[(1, pid)])[1][p.HEAD_WEIGHT] for pid in range(CLIENTS)]
    assert all(not np.array_equal(a, b) for a, b in zip(first_round, means))
    # round 1's messages carried w^0 as every client's mean (its site starts at sigma = 1, the code's
    # initialization: rho = 1 below)
    for message in _train_messages(grid, 1):
        np.testing.assert_array_equal(p.sections_of(message.content)[p.MODEL][p.HEAD_WEIGHT], initial[p.HEAD_WEIGHT])
    # rho: 1 in round 1 (mu = w^0, sigma = 1), then each client's own
    assert all(m["rho"] == pytest.approx(1.0) for m in report.rounds[0].train.values())
    assert len({round(m["rho"], 9) for m in report.rounds[-1].train.values()}) == CLIENTS

    # the harness's evaluation: the aggregated base with the posterior mean (the last round's own
    # evaluate message; earlier rounds rode in the next train message, fused)
    evaluations = [m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]
    assert len(evaluations) == CLIENTS
    for message in evaluations:
        arrays = p.sections_of(message.content)[p.MODEL]
        pid = _pid_of(grid, message.metadata.dst_node_id)
        np.testing.assert_array_equal(arrays[p.HEAD_WEIGHT], heads[pid][p.HEAD_WEIGHT])
        np.testing.assert_array_equal(arrays["extractor.0.weight"], strategy.extractor["extractor.0.weight"])

    # both accuracies in the outputs, the protocol in the config
    (run_dir,) = (tmp_path / "all-train").iterdir()
    clients = _rows(run_dir / "clients.csv")
    assert len(clients) == rounds * CLIENTS
    assert all(0 <= float(r["accuracy"]) <= 1 and 0 <= float(r["local_accuracy"]) <= 1 for r in clients)
    assert all(float(r["rho"]) > 0 for r in clients)
    assert {int(r["partition_id"]) for r in clients if r["round"] == "1" and r["aggregated"] == "1"} == set(
        draw_sample(CLIENTS, 0.5, 0, 1))
    rounds_csv = _rows(run_dir / "rounds.csv")
    assert [int(r["num_aggregated"]) for r in rounds_csv] == [len(r.method["aggregated"]) for r in report.rounds]
    for row, record in zip(rounds_csv, report.rounds):
        assert float(row["mean_local_accuracy"]) == pytest.approx(mean_local_accuracy(record))
        assert float(row["mean_accuracy"]) == pytest.approx(record.mean_accuracy)
    config = json.loads((run_dir / "config.json").read_text())
    assert config["vem_protocol"] == "all-train" and config["vem_sampling_rate"] == 0.5
    final = np.load(run_dir / "final_state.npz")
    np.testing.assert_array_equal(final["head/head.weight"], strategy.state.shared[HEAD][p.HEAD_WEIGHT])
    assert not [key for key in final.files if "/scale/" in key]


def test_sampled_train_trains_only_the_sample_and_everyone_in_a_full_last_round(tmp_path, caplog):
    rounds = 4
    with caplog.at_level(logging.INFO):
        strategy, report, grid, _ = _run({"vem-protocol": "sampled-train", "num-server-rounds": rounds},
                                         tmp_path, "sampled")
    assert "Protocol sampled-train: only the clients in S_t train" in caplog.text
    for server_round in range(1, rounds + 1):
        sample = draw_sample(CLIENTS, 0.5, 0, server_round)
        trained = sorted(_pid_of(grid, m.metadata.dst_node_id) for m in _train_messages(grid, server_round))
        assert trained == (sample if server_round < rounds else list(range(CLIENTS)))
        record = report.rounds[server_round - 1]
        assert sorted(record.train) == trained and record.method["aggregated"] == sample
        assert sorted(record.accuracy) == list(range(CLIENTS))  # everyone is evaluated every round
    # not everyone trains: every round has its own evaluate message (no fused evaluation)
    assert len([m for m in grid.sent if m.metadata.message_type == MessageType.EVALUATE]) == CLIENTS * rounds
    assert all(_site_scales(strategy, pid, rounds) for pid in range(CLIENTS))


class RestartingGrid(InProcessGrid):
    """After the training replies of ``restart_after`` come back, the SuperNode of ``partition``
    restarts: a new node id and a new Context, nothing of the old process kept."""

    def __init__(self, *args, restart_after: int, partition: int, **kwargs):
        super().__init__(*args, **kwargs)
        self.restart_after, self.partition = restart_after, partition
        self.new_node: int | None = None

    def send_and_receive(self, messages, *, timeout=None):
        replies = super().send_and_receive(messages, timeout=timeout)
        if self.train_rounds == self.restart_after and self.new_node is None and messages and (
                messages[0].metadata.message_type == MessageType.TRAIN):
            old = next(n for n, pid in self.partition_of_node.items() if pid == self.partition)
            context = self.contexts.pop(old)
            del self.partition_of_node[old]
            self.new_node = 4242
            self.contexts[self.new_node] = Context(run_id=context.run_id, node_id=self.new_node,
                                                   node_config=dict(context.node_config), state=RecordDict(),
                                                   run_config=dict(context.run_config))
            self.partition_of_node[self.new_node] = self.partition
        return replies


@pytest.mark.slow
def test_a_restarted_supernode_gets_its_posterior_back_and_the_run_is_unchanged(tmp_path):
    full, full_report, _, _ = _run({}, tmp_path, "full")
    restarted, report, grid, recorder = _run({}, tmp_path, "restarted", grid_class=RestartingGrid,
                                             restart_after=2, partition=2)
    assert grid.new_node is not None and restarted.node_partition[grid.new_node] == 2
    (message,) = [m for m in _train_messages(grid, 3) if m.metadata.dst_node_id == grid.new_node]
    _, mean, _, _ = _reply_parts(recorder.train[(2, 2)])
    np.testing.assert_array_equal(p.sections_of(message.content)[p.MODEL][p.HEAD_WEIGHT], mean[p.HEAD_WEIGHT])
    _assert_same_run(full, full_report, restarted, report)


def _assert_same_run(a, a_report, b, b_report):
    assert [r.round for r in a_report.rounds] == [r.round for r in b_report.rounds]
    for x, y in zip(a_report.rounds, b_report.rounds):
        assert x.accuracy == y.accuracy and x.method == y.method
        assert ({pid: {k: v for k, v in m.items() if k not in TIMES} for pid, m in x.train.items()}
                == {pid: {k: v for k, v in m.items() if k not in TIMES} for pid, m in y.train.items()})
    for key, value in {**a.extractor, **a.state.shared[HEAD]}.items():
        np.testing.assert_array_equal({**b.extractor, **b.state.shared[HEAD]}[key], value)
    a_heads, b_heads = a.state.personal[HEAD], b.state.personal[HEAD]
    assert sorted(a_heads) == sorted(b_heads)
    last = a_report.rounds[-1].round
    for pid in a_heads:
        # the scales, at each site: the restarted or resumed one found its own again
        a_scales, b_scales = _site_scales(a, pid, last), _site_scales(b, pid, last)
        for key in a_heads[pid]:
            np.testing.assert_array_equal(b_heads[pid][key], a_heads[pid][key])
            np.testing.assert_array_equal(b_scales[key], a_scales[key])


@pytest.mark.slow
@pytest.mark.parametrize("protocol", ["all-train", "sampled-train"])
def test_a_resumed_run_equals_an_uninterrupted_one(protocol, tmp_path):
    config = {"vem-protocol": protocol, "num-server-rounds": 4}
    full, full_report, _, _ = _run(config, tmp_path, "full", grid_seed=1)
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run(config, tmp_path, "crashed", grid_seed=2, crash_at_round=3)  # other node ids, too
    (crashed,) = (tmp_path / "crashed").iterdir()
    checkpoint = load_checkpoint(crashed)
    # the rounds before the crash; with every client training (fused evaluation) round 2 is
    # evaluated in round 3's train replies, which the crash never collects
    assert checkpoint.completed_rounds == (1 if protocol == "all-train" else 2)
    assert HEAD in checkpoint.state.shared
    assert checkpoint.state.personal[HEAD] and SCALE not in checkpoint.state.personal
    resumed, report, _, _ = _run({**config, "resume-from": str(crashed)}, tmp_path, "resumed", grid_seed=3)
    _assert_same_run(full, full_report, resumed, report)


# ---------------------------------------------------------------------------- bad replies


def _drop_metric(key):
    def tamper(reply):
        del reply.content[p.METRICS][key]
    return tamper


def _add_statistic(reply):
    arrays = p.sections_of(reply.content).get(p.STATISTICS, {})
    arrays[p.CLASS_COUNTS] = np.zeros(10, dtype=np.int64)
    set_section(reply, p.STATISTICS, arrays)


BAD_REPLIES = {
    "nan in the posterior mean": (set_array(p.MODEL, p.HEAD_WEIGHT, nan), "NaN or Inf"),
    "negative rho": (set_metric(p.RHO, -0.5), "rho = -0.5 must be a positive number"),
    "zero rho": (set_metric(p.RHO, 0.0), "rho = 0.0 must be a positive number"),
    "rho whose confidence is zero": (set_metric(p.RHO, 1e200), "finite, positive confidence"),
    "nan rho": (set_metric(p.RHO, float("nan")), "'rho' = nan is not a finite number"),
    "missing rho": (_drop_metric(p.RHO), "missing metric 'rho'"),
    "posterior mean of the wrong shape": (set_array(p.MODEL, p.HEAD_WEIGHT, lambda a: a[:7]), "shape"),
    "statistics, which its server step does not use": (_add_statistic, "unexpected section(s) ['statistics']"),
    "local accuracy above 1": (set_metric(p.LOCAL_ACCURACY, 1.5), "local accuracy 1.5 outside [0, 1]"),
}
BAD = 1


@pytest.mark.parametrize("case", sorted(BAD_REPLIES))
def test_a_bad_pfedvem_reply_is_rejected_and_the_round_goes_on(case, caplog):
    tamper, reason = BAD_REPLIES[case]

    def tampering(reply, pid):
        if pid == BAD and reply.metadata.message_type == MessageType.TRAIN:
            tamper(reply)
        return reply

    config = {**BASE, "num-server-rounds": 2}
    # every client in S_t (the server's sampling rate 1): the bad one would have entered both means
    cfg = parse_run_config({**config, "vem-sampling-rate": 1.0})
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    initial_head = initial_prior_head(cfg)
    strategy = PersonalizedStrategy(server=server_part(PFEDVEM, cfg, extractor, head), num_rounds=2)
    grid = InProcessGrid(config, 4, tamper=tampering)
    strategy.discover(grid, timeout=60)
    messages = list(strategy.configure_train(1, p.to_record(extractor), ConfigRecord(), grid))
    with caplog.at_level(logging.WARNING):
        new_arrays, metrics = strategy.aggregate_train(1, grid.send_and_receive(messages))
    assert reason in caplog.text
    bad_node = next(n for n, pid in grid.partition_of_node.items() if pid == BAD)
    assert f"Rejected reply from node {bad_node}" in caplog.text
    survivors = [0, 2, 3]
    assert metrics["num-replies"] == 3 and strategy._record.method["aggregated"] == survivors
    # no posterior of the bad one
    assert sorted(strategy.state.personal[HEAD]) == survivors
    assert all(np.isfinite(v).all() for v in p.from_record(new_arrays).values())
    assert all(np.isfinite(v).all() for v in strategy.state.shared[HEAD].values())
    assert not np.array_equal(strategy.state.shared[HEAD][p.HEAD_WEIGHT], initial_head[p.HEAD_WEIGHT])


# ---------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    "key,value,fragment",
    [
        ("vem-protocol", "some-train", "one of all-train, sampled-train"),
        ("vem-sampling-rate", 0.0, "(0, 1]"),
        ("vem-sampling-rate", 1.5, "(0, 1]"),
        ("vem-head-steps", -1, ">= 0"),
        ("vem-mc-samples", 0, ">= 1"),
        ("vem-batch-size", 0, ">= 1"),
        ("vem-head-lr", 0.0, "> 0"),
        ("vem-base-lr", -1e-3, "> 0"),
        ("vem-initial-sigma", 0.0, "> 0"),
        ("vem-momentum", 1.0, "[0, 1)"),
    ],
)
def test_invalid_pfedvem_keys_name_key_and_range(key, value, fragment):
    with pytest.raises(ConfigError) as err:
        parse_run_config({"strategy": "pfedvem", key: value})
    assert f"'{key}'" in str(err.value) and fragment in str(err.value)


def test_pfedvem_defaults_are_the_authors_cifar10_values_and_it_samples_by_itself():
    cfg = parse_run_config({"strategy": "pfedvem"})
    assert (cfg.vem_protocol, cfg.vem_sampling_rate, cfg.vem_head_steps, cfg.vem_mc_samples) == (
        "all-train", 0.1, 10, 5)
    assert (cfg.vem_head_lr, cfg.vem_base_lr, cfg.vem_momentum, cfg.vem_batch_size, cfg.vem_initial_sigma) == (
        1e-3, 1e-3, 0.9, 10, 1.0)
    assert cfg.local_epochs == 5  # base epochs
    with pytest.raises(ConfigError, match="'fraction-train' = 0.5 is invalid: must be 1 with strategy 'pfedvem'"):
        parse_run_config({"strategy": "pfedvem", "fraction-train": 0.5})
    parse_run_config({"strategy": "fedpac", "fraction-train": 0.5})  # the others sample as before


def test_sampled_train_names_the_partitions_of_s_t_that_no_node_serves(caplog):
    """With sampled-train, only S_t trains: a partition of S_t without a connected node cannot, and
    the log says which, and the round goes on with the others."""
    cfg = parse_run_config({**BASE, "vem-protocol": "sampled-train", "vem-sampling-rate": 1.0})
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    server = server_part(PFEDVEM, cfg, extractor, head)
    with caplog.at_level(logging.WARNING):
        chosen = server.select([0, 2], population=4, server_round=1, full=False)
    assert server.sample == [0, 1, 2, 3] and chosen == [0, 2]
    assert "round 1: partitions [1, 3] of S_t have no connected node" in caplog.text
