"""FedCCFA in the harness: its client routine, its alignment loss, and whole runs under drift.

The server's clustering and merging are tested on their own in ``test_clustering``; the drift
maps and the partition in ``test_drift`` and ``test_partition``. Here: the pieces the client
adds (balanced sample, balanced head from phi^0, contrastive alignment from its round on), and
runs through the real ServerApp and ClientApp in process: a sudden drift seen in the labels the
clients train on, generalized accuracy in the rounds it is due, clusters and anchors in the
outputs and the checkpoint, and an exact resume.
"""

import json
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.app import MessageType

from common import protocol as p
from common.config import ConfigError, FedPACConfig, parse_run_config
from common.methods import METHODS
from common.methods.client import ClientResult, LocalData, Received, client_routine
from common.methods.fedccfa.client import balanced_sample, contrastive_alignment_loss, released_balanced_sample
from common.methods.fedccfa.server import ANCHORS, GLOBAL_ANCHORS
from common.methods.server import HEAD
from common.model import HEAD_PREFIX, FedPACNet
from federation import InProcessGrid
from server_app.app import run_fedpac
from server_app.checkpoint import load_checkpoint

RUN_CONFIG = {
    "strategy": "fedccfa",
    "samples-per-client": 60,
    "test-samples-per-client": 30,
    "local-epochs": 1,
    "batch-size": 20,
    "balanced-epochs": 2,
    "momentum": 0.9,
    "weight-decay": 1e-5,
    "align-from-round": 2,
}


# ---------------------------------------------------------------------------- client pieces


def test_contrastive_alignment_matches_its_definition():
    generator = torch.Generator().manual_seed(0)
    features = torch.randn(12, 8, generator=generator)
    anchors = torch.randn(5, 8, generator=generator)
    labels = torch.tensor([0, 1, 2, 3, 4, 0, 1, 2, 3, 4, 1, 3])
    mask = torch.tensor([True, True, False, True, True])
    tau = 0.1
    expected = 0.0
    for f, y in zip(features, labels):
        if not mask[y]:
            continue  # no anchor for this class: contributes zero, still counts in the batch
        logits = torch.stack([F.cosine_similarity(f, a, dim=0) / tau for a, m in zip(anchors, mask) if m])
        target = int(mask[:y].sum())  # the label's position among the anchored classes
        expected += float(-torch.log_softmax(logits, dim=0)[target])
    expected /= len(labels)
    got = contrastive_alignment_loss(features, labels, anchors, mask, tau)
    assert math.isclose(float(got), expected, rel_tol=1e-5)


def test_contrastive_alignment_pulls_features_towards_their_anchor_and_only_features():
    anchors = torch.eye(3, 4)
    features = torch.tensor([[0.2, 1.0, 0.0, 0.0]], requires_grad=True)
    loss = contrastive_alignment_loss(features, torch.tensor([0]), anchors, torch.ones(3, dtype=torch.bool), 0.1)
    loss.backward()
    assert features.grad[0, 0] < 0 < features.grad[0, 1]  # towards anchor 0, away from anchor 1
    assert not anchors.requires_grad


def test_balanced_sample_takes_m_of_every_present_class_without_replacement():
    y = torch.tensor([0] * 9 + [2] * 3 + [5] * 20)
    idx = balanced_sample(y, 5, torch.Generator().manual_seed(0))
    assert len(set(idx.tolist())) == len(idx)
    counts = torch.bincount(y[idx], minlength=6)
    assert counts.tolist() == [3, 0, 3, 0, 0, 3]  # m = min(5, smallest present count 3)
    other = balanced_sample(y, 5, torch.Generator().manual_seed(1))
    assert sorted(idx.tolist()) != sorted(other.tolist())  # a fresh draw per round


def test_a_private_balanced_sample_moves_by_the_added_record_only():
    """Under DP a record's draw depends only on released counts: one record more changes the
    sample by that record at most (the exact-count sample moved dozens of records)."""
    generator = torch.Generator().manual_seed(3)
    y = torch.randint(0, 10, (600,), generator=generator)
    released = torch.bincount(y, minlength=10).to(torch.float64) + torch.randn(10, generator=generator) * 3
    for added in range(10):
        grown = torch.cat([y, torch.tensor([added])])
        before, size = released_balanced_sample(y, 5, released, torch.Generator().manual_seed(7))
        after, grown_size = released_balanced_sample(grown, 5, released, torch.Generator().manual_seed(7))
        assert set(after.tolist()) - {len(y)} == set(before.tolist())
        assert size == grown_size  # DP-SGD's rate on it: released values only


def test_a_private_balanced_sample_draws_m_per_class_in_expectation():
    y = torch.tensor([0] * 400 + [2] * 100 + [5] * 8)
    released = torch.tensor([390.0, 0.0, 110.0, 0.0, 0.0, 10.0])  # m = min(50, 10)
    samples = [released_balanced_sample(y, 50, released, torch.Generator().manual_seed(s))[0] for s in range(400)]
    draws = torch.stack([torch.bincount(y[idx], minlength=6) for idx in samples]).to(torch.float64)
    expected_size = released_balanced_sample(y, 50, released, torch.Generator())[1]
    assert expected_size == 30.0
    rates = draws.mean(dim=0) / torch.tensor([400.0, 1.0, 100.0, 1.0, 1.0, 8.0])
    assert torch.allclose(rates[[0, 2, 5]], torch.tensor([10 / 390, 10 / 110, 1.0], dtype=torch.float64), atol=0.02)


def _client_data():
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(40, 1, 28, 28, generator=generator)
    y = torch.arange(40) % 4
    return x, y


def _model(seed: int) -> FedPACNet:
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10)


# The balanced head in the reply's statistics, by the head module's own keys.
BALANCED = {"weight": p.BALANCED_WEIGHT, "bias": p.BALANCED_BIAS}


def _initial_head(model: FedPACNet) -> dict[str, np.ndarray]:
    """phi^0 as section ``initial-head`` carries it: the model's head.* arrays."""
    return {HEAD_PREFIX + k: v.detach().numpy().copy() for k, v in model.head.state_dict().items()}


def _local_update(model, x, y, received: Received, cfg: FedPACConfig) -> ClientResult:
    """FedCCFA's local update (no test split: x, y stand in for it)."""
    return client_routine(METHODS[cfg.strategy]).local_update(
        model, LocalData(x, y, x, y), received, cfg, torch.Generator().manual_seed(0))


def test_balanced_head_starts_from_phi0_whatever_head_the_client_holds():
    x, y = _client_data()
    cfg = FedPACConfig(strategy="fedccfa", local_epochs=1, batch_size=8, balanced_epochs=2)
    initial = _initial_head(_model(1))
    balanced = []
    for personal_seed in (2, 3):
        model = _model(0)
        model.head.load_state_dict(_model(personal_seed).head.state_dict())
        received = Received(server_round=1, sections={p.INITIAL_HEAD: initial},
                            config={p.HAS_PERSONAL_HEAD: True})
        update = _local_update(model, x, y, received, cfg)
        balanced.append(update.statistics)
    for key in BALANCED.values():
        torch.testing.assert_close(torch.from_numpy(balanced[0][key]), torch.from_numpy(balanced[1][key]))


def test_a_first_participant_starts_its_personal_head_from_its_balanced_head():
    x, y = _client_data()
    cfg = FedPACConfig(strategy="fedccfa", local_epochs=1, batch_size=8, head_epochs=0)
    initial = _initial_head(_model(1))
    model = _model(0)
    update = _local_update(model, x, y, Received(sections={p.INITIAL_HEAD: initial},
                                                 config={p.HAS_PERSONAL_HEAD: False}), cfg)
    for key, value in model.head.state_dict().items():  # zero personal-head epochs: unchanged since
        torch.testing.assert_close(value, torch.from_numpy(update.statistics[BALANCED[key]]))


def test_a_private_balanced_head_trains_on_the_sample_of_the_released_counts(monkeypatch):
    """Under DP the balanced head's sample is drawn from the counts the reply releases, and
    DP-SGD's rate on it is made of the sample's expected size, never of the exact counts."""
    from common.methods.fedccfa import client as fedccfa_client  # pylint: disable=import-outside-toplevel
    from common.privacy import PrivacySettings, private_site  # pylint: disable=import-outside-toplevel

    drawn = []

    def spy(y, per_class, counts, generator):
        drawn.append(counts.clone())
        return released_balanced_sample(y, per_class, counts, generator)

    monkeypatch.setattr(fedccfa_client, "released_balanced_sample", spy)
    monkeypatch.setattr(fedccfa_client, "balanced_sample", None)  # the exact-count draw: never under DP
    x, y = _client_data()
    cfg = FedPACConfig(strategy="fedccfa", local_epochs=1, batch_size=8, balanced_epochs=1, head_epochs=0)
    with private_site(PrivacySettings(noise_multiplier=1.0, statistics_noise_multiplier=2.0), 5) as site:
        update = _local_update(_model(0), x, y, Received(sections={p.INITIAL_HEAD: _initial_head(_model(1))}), cfg)
    assert len(drawn) == 1 and drawn[0].tolist() == update.statistics[p.CLASS_COUNTS].tolist()
    expected = float(drawn[0].clamp(max=min(5.0, float(drawn[0][drawn[0] > 0].min())))[drawn[0] > 0].sum())
    assert min(1.0, 8 / expected) in [rate for _, rate, _ in site.ledger.history]


@pytest.mark.parametrize("server_round, aligned", [(20, False), (21, True)])
def test_alignment_starts_at_align_from_round_and_is_weighted_by_label_entropy(server_round, aligned):
    x, y = _client_data()
    cfg = FedPACConfig(strategy="fedccfa", local_epochs=1, batch_size=8, balanced_epochs=1)
    model = _model(0)
    received = Received(server_round=server_round, sections={
        p.CENTROIDS: {p.CENTROID_VALUES: torch.randn(10, 128).numpy(), p.CENTROID_MASK: np.ones(10, dtype=bool)},
        p.INITIAL_HEAD: _initial_head(model)})
    update = _local_update(model, x, y, received, cfg)
    assert (update.metrics["align-loss"] > 0) == aligned
    assert math.isclose(update.metrics["align-weight"], math.log(4) / cfg.align_gamma)  # 4 equal classes
    assert update.statistics[p.CLASS_COUNTS].tolist() == [10] * 4 + [0] * 6


def test_drift_keys_are_checked_before_any_training():
    with pytest.raises(ConfigError, match="drift"):
        parse_run_config({"drift": "sideways"})
    with pytest.raises(ConfigError, match="drift-rounds"):
        parse_run_config({"drift": "recurrent", "drift-rounds": "150,100"})
    with pytest.raises(ConfigError, match="drift-rounds"):
        parse_run_config({"drift": "none", "drift-rounds": "100"})
    with pytest.raises(ConfigError, match="cluster-weights"):
        parse_run_config({"cluster-weights": "size"})


# ---------------------------------------------------------------------------- whole runs


class StatisticsByRound:
    """Keeps every training reply's class counts, per partition-id, in round order."""

    def __init__(self):
        self.counts: dict[int, list[np.ndarray]] = {}

    def __call__(self, reply, pid):
        if reply.metadata.message_type == MessageType.TRAIN and reply.has_content():
            stats = p.sections_of(reply.content)[p.STATISTICS]
            self.counts.setdefault(pid, []).append(stats[p.CLASS_COUNTS])
        return reply


@pytest.mark.slow
def test_fedccfa_under_a_sudden_drift_end_to_end(tmp_path):
    config = {**RUN_CONFIG, "num-server-rounds": 4, "drift": "sudden", "drift-rounds": "2",
              "generalized-every": 2, "partition": "dirichlet-min", "output-dir": str(tmp_path)}
    recorder = StatisticsByRound()
    grid = InProcessGrid(config, 6, tamper=recorder)
    strategy, report = run_fedpac(grid, parse_run_config(config), 1)

    assert [r.round for r in report.rounds] == [1, 2, 3, 4]
    for record in report.rounds:
        assert sorted(record.train) == sorted(record.accuracy) == list(range(6))
        # generalized accuracy exactly in the rounds it is due (every 2nd and the last)
        assert sorted(record.generalized) == (list(range(6)) if record.round % 2 == 0 else [])
        assert all(0.0 <= a <= 1.0 for a in record.generalized.values())
        assert record.method["cluster_partitions"] == list(range(6)) and len(record.method["clusters"]) == 10
        assert all(0 <= label < 6 for labels in record.method["clusters"] for label in labels)  # every class present
    # the drift at (0-based) round 2 swaps labels from round 3 on: partition 0 swaps 1 <-> 2,
    # partition 3 swaps 3 <-> 4; the clients' own class counts show it
    for pid, (a, b) in ((0, (1, 2)), (3, (3, 4))):
        before, after = recorder.counts[pid][1], recorder.counts[pid][2]
        swapped = before.copy()
        swapped[[a, b]] = before[[b, a]]
        np.testing.assert_array_equal(after, swapped)
        assert before[a] != before[b]  # the swap is visible
    # alignment from align-from-round on, once anchors exist
    assert all("align-loss" in m and m["align-loss"] == 0 for m in report.rounds[0].train.values())
    assert all(m["align-loss"] > 0 for m in report.rounds[2].train.values())
    # phi^0 goes to every client every round; has-personal-head only after a first reply
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    initial = strategy.server.initial_head
    for message in trains:
        sent = p.sections_of(message.content)[p.INITIAL_HEAD]
        for key, value in initial.items():
            np.testing.assert_array_equal(sent[key], value)
    flags = [bool(m.content[p.CONFIG][p.HAS_PERSONAL_HEAD]) for m in trains]
    assert flags == [False] * 6 + [True] * 18

    (run_dir,) = tmp_path.iterdir()
    for name in ("clusters.csv", "clusters.png", "accuracy.png", "rounds.csv", "clients.csv"):
        assert (run_dir / name).stat().st_size > 0
    rounds_csv = (run_dir / "rounds.csv").read_text().splitlines()
    header = rounds_csv[0].split(",")
    generalized = [row.split(",")[header.index("mean_generalized_accuracy")] for row in rounds_csv[1:]]
    assert [bool(g) for g in generalized] == [False, True, False, True]
    assert len((run_dir / "clusters.csv").read_text().splitlines()) == 1 + 4 * 10 * 6
    checkpoint = load_checkpoint(run_dir)
    assert sorted(checkpoint.state.personal[ANCHORS]) == list(range(6))
    for anchors in checkpoint.state.personal[ANCHORS].values():
        assert anchors[p.CENTROID_VALUES].shape == (10, 128) and anchors[p.CENTROID_MASK].all()
    assert json.loads((run_dir / "metrics.json").read_text())["rounds"][-1]["generalized"]


@pytest.mark.slow
def test_fedccfa_with_drift_resumes_exactly(tmp_path):
    base = {**RUN_CONFIG, "num-server-rounds": 4, "drift": "sudden", "drift-rounds": "1",
            "fraction-train": 0.5}

    def run(name, grid_seed, **extra):
        config = {**base, "output-dir": str(tmp_path / name), **extra}
        return run_fedpac(InProcessGrid(config, 6, seed=grid_seed), parse_run_config(config), 1)

    full, full_report = run("full", 1)
    config = {**base, "output-dir": str(tmp_path / "crashed")}
    with pytest.raises(RuntimeError, match="simulated server crash in round 3"):
        run_fedpac(InProcessGrid(config, 6, seed=2, crash_at_round=3), parse_run_config(config), 2)
    (crashed_dir,) = (tmp_path / "crashed").iterdir()
    resumed, report = run("resumed", 3, **{"resume-from": str(crashed_dir)})

    assert [r.accuracy for r in report.rounds] == [r.accuracy for r in full_report.rounds]
    assert [r.method["clusters"] for r in report.rounds] == [r.method["clusters"] for r in full_report.rounds]
    full_anchors, resumed_anchors = full.state.personal[ANCHORS], resumed.state.personal[ANCHORS]
    assert sorted(resumed_anchors) == sorted(full_anchors)
    for pid, anchors in full_anchors.items():
        np.testing.assert_array_equal(resumed_anchors[pid][p.CENTROID_VALUES], anchors[p.CENTROID_VALUES])
        np.testing.assert_array_equal(resumed_anchors[pid][p.CENTROID_MASK], anchors[p.CENTROID_MASK])
    for pid, head in full.state.personal[HEAD].items():
        for key, value in head.items():
            np.testing.assert_array_equal(resumed.state.personal[HEAD][pid][key], value)


def test_without_clustered_anchors_every_client_aligns_to_the_latest_round_mean(tmp_path):
    config = {**RUN_CONFIG, "num-server-rounds": 3, "fraction-train": 0.5, "full-last-round": False,
              "clustered-anchors": False, "output-dir": str(tmp_path)}
    grid = InProcessGrid(config, 6)
    strategy, _ = run_fedpac(grid, parse_run_config(config), 1)
    trains = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN]
    by_round: dict[int, list[dict]] = {}
    for message in trains:
        targets = p.sections_of(message.content)[p.CENTROIDS]
        by_round.setdefault(int(message.content[p.CONFIG][p.SERVER_ROUND]), []).append(targets)
    assert not any(t[p.CENTROID_MASK].any() for t in by_round[1])  # nothing before the first reply
    for later in (2, 3):  # first participants included: one set for all, every class anchored
        first = by_round[later][0]
        assert first[p.CENTROID_MASK].all()
        for targets in by_round[later][1:]:
            np.testing.assert_array_equal(targets[p.CENTROID_VALUES], first[p.CENTROID_VALUES])
    checkpoint = load_checkpoint(next(tmp_path.iterdir()))
    np.testing.assert_array_equal(checkpoint.state.personal[ANCHORS][GLOBAL_ANCHORS][p.CENTROID_VALUES],
                                  strategy.state.personal[ANCHORS][GLOBAL_ANCHORS][p.CENTROID_VALUES])
