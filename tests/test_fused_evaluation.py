"""Fused evaluation: a round's model is evaluated at the start of the next round's train message.

The product's promise is that this changes only how many messages a round takes, never a
number: every method, with drift and the generalized accuracy, with FedAvg-FT's fine-tuning,
gives the records and the final state of the run with an evaluate message per round. Runs go
through the real ServerApp and ClientApp in process (``federation.InProcessGrid``).
"""

import logging

import numpy as np
import pytest
from flwr.app import MessageType, MetricRecord

from common import protocol as p
from common.config import parse_run_config
from federation import InProcessGrid
from server_app.app import run_fedpac
from server_app.checkpoint import load_checkpoint

BASE = {
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
    "num-server-rounds": 3,
}
CLIENTS = 4
METHOD_CONFIGS = {
    "fedpac": {},
    "fedavg-ft": {"strategy": "fedavg-ft"},  # fine-tunes a copy before evaluating, then trains
    "local": {"strategy": "local"},
    # the default partition: dirichlet-min hands out the whole dataset, 15,000 images a client
    "fedccfa-drift": {"strategy": "fedccfa", "drift": "sudden", "drift-rounds": "1", "generalized-every": 1,
                      "balanced-epochs": 1, "align-from-round": 2},
    # every client trains (all-train), S_t alone is aggregated; each client's posterior mean is its head
    "pfedvem": {"strategy": "pfedvem", "vem-sampling-rate": 0.5},
}
# Measured on the clients' clocks, so they differ between any two runs.
TIMES = {"train-seconds", "eval_seconds"}


def _run(config: dict, tmp_path, name: str, **grid_options):
    config = {**config, "output-dir": str(tmp_path / name)}
    grid = InProcessGrid(config, CLIENTS, seed=1, **grid_options)
    strategy, report = run_fedpac(grid, parse_run_config(config), 1)
    return strategy, report, grid


def _by_type(grid: InProcessGrid, message_type: str) -> list:
    return [m for m in grid.sent if m.metadata.message_type == message_type]


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(METHOD_CONFIGS))
def test_fused_evaluation_gives_the_numbers_of_an_evaluate_message_per_round(name, tmp_path):
    config = {**BASE, **METHOD_CONFIGS[name]}
    fused, fused_report, fused_grid = _run({**config, "fused-evaluation": True}, tmp_path, "fused")
    separate, separate_report, separate_grid = _run({**config, "fused-evaluation": False}, tmp_path, "separate")

    # One message per client and round, plus the last round's evaluation.
    rounds = BASE["num-server-rounds"]
    assert len(_by_type(fused_grid, MessageType.EVALUATE)) == CLIENTS
    assert len(_by_type(separate_grid, MessageType.EVALUATE)) == CLIENTS * rounds
    evaluated = sorted(m.content[p.CONFIG].get(p.EVALUATE_ROUND, 0) for m in _by_type(fused_grid, MessageType.TRAIN))
    assert evaluated == [0] * CLIENTS + [r for r in range(1, rounds) for _ in range(CLIENTS)]

    assert [r.round for r in fused_report.rounds] == list(range(1, rounds + 1))
    for a, b in zip(fused_report.rounds, separate_report.rounds):
        assert sorted(a.accuracy) == list(range(CLIENTS))
        assert a.accuracy == b.accuracy and a.test_loss == b.test_loss and a.generalized == b.generalized
        assert a.method == b.method
        assert ({pid: {k: v for k, v in m.items() if k not in TIMES} for pid, m in a.train.items()}
                == {pid: {k: v for k, v in m.items() if k not in TIMES} for pid, m in b.train.items()})
    if name == "fedccfa-drift":
        assert all(r.generalized for r in fused_report.rounds)
    for key, value in (separate.extractor or {}).items():
        np.testing.assert_array_equal(fused.extractor[key], value)
    # the whole final state: the shared sections, and every client's own (personalized heads,
    # Local-only's extractors, FedCCFA's anchors, pFedVEM's posterior scales)
    assert sorted(fused.state.shared) == sorted(separate.state.shared)
    for section, arrays in separate.state.shared.items():
        assert sorted(fused.state.shared[section]) == sorted(arrays), section
        for key, value in arrays.items():
            np.testing.assert_array_equal(fused.state.shared[section][key], value)
    assert sorted(fused.state.personal) == sorted(separate.state.personal)
    for section, parts in separate.state.personal.items():
        assert sorted(fused.state.personal[section]) == sorted(parts), section
        for pid, arrays in parts.items():
            for key, value in arrays.items():
                np.testing.assert_array_equal(fused.state.personal[section][pid][key], value)


def test_with_sampling_every_round_keeps_its_evaluate_message(tmp_path, caplog):
    with caplog.at_level(logging.INFO):
        _, report, grid = _run({**BASE, "fraction-train": 0.5, "fused-evaluation": True}, tmp_path, "sampled")
    assert len(_by_type(grid, MessageType.EVALUATE)) == CLIENTS * BASE["num-server-rounds"]
    assert not any(p.EVALUATE_ROUND in m.content[p.CONFIG] for m in _by_type(grid, MessageType.TRAIN))
    assert "fused evaluation needs fraction-train = fraction-evaluate = 1" in caplog.text
    assert all(r.accuracy for r in report.rounds)


@pytest.mark.slow
def test_a_crash_before_a_rounds_evaluation_came_back_resumes_to_the_same_run(tmp_path):
    config = {**BASE, "num-server-rounds": 4, "fused-evaluation": True}
    _, full_report, _ = _run(config, tmp_path, "full")
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        _run(config, tmp_path, "crashed", crash_at_round=3)
    (crashed,) = (tmp_path / "crashed").iterdir()
    # Round 2 was trained, but its evaluation was to come with round 3's replies: the checkpoint
    # holds round 1, the last round whose outputs are complete.
    assert load_checkpoint(crashed).completed_rounds == 1
    _, report, _ = _run({**config, "resume-from": str(crashed)}, tmp_path, "resumed")
    assert [r.round for r in report.rounds] == [1, 2, 3, 4]
    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]


def test_a_bad_evaluation_in_a_train_reply_rejects_that_reply_only(tmp_path, caplog):
    def tampering(reply, pid):
        if pid == 1 and p.EVALUATION in reply.content:
            reply.content[p.EVALUATION] = MetricRecord({**dict(reply.content[p.EVALUATION]), "accuracy": 3.0})
        return reply

    with caplog.at_level(logging.WARNING):
        _, report, _ = _run({**BASE, "fused-evaluation": True}, tmp_path, "bad", tamper=tampering)
    assert "outside [0, 1]" in caplog.text
    first, second, last = report.rounds
    assert sorted(first.accuracy) == [0, 2, 3]  # round 1's evaluation came in round 2's replies
    assert sorted(second.train) == [0, 2, 3]  # and that reply's update was refused with it
    assert sorted(second.accuracy) == [0, 2, 3] and sorted(last.accuracy) == [0, 1, 2, 3]
