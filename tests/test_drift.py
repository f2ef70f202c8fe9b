"""Distributed concept drift: label maps by (partition-id, server round, pattern), stateless."""

import numpy as np
import pytest

from common.config import parse_run_config
from common.drift import (
    DEFAULT_DRIFT_ROUNDS,
    Drift,
    concept,
    concept_map,
    label_map,
)

K = 10
IDENTITY = np.arange(K)
# the swap each group takes: ids mod 10 in {0,1,2} -> 1<->2, {3,4,5} -> 3<->4, {6..9} -> 5<->6
GROUP_OF = {0: 1, 1: 1, 2: 1, 3: 2, 4: 2, 5: 2, 6: 3, 7: 3, 8: 3, 9: 3}
SWAP = {1: (1, 2), 2: (3, 4), 3: (5, 6)}


def _swapped(a, b):
    mapping = IDENTITY.copy()
    mapping[a], mapping[b] = b, a
    return mapping


def _expect(pid, drifted):
    return _swapped(*SWAP[GROUP_OF[pid % 10]]) if drifted else IDENTITY


def test_concept_maps_are_the_papers_swaps_and_involutions():
    np.testing.assert_array_equal(concept_map(0, K), IDENTITY)
    for cid, (a, b) in SWAP.items():
        mapping = concept_map(cid, K)
        assert mapping.dtype == np.int64
        np.testing.assert_array_equal(mapping, _swapped(a, b))
        np.testing.assert_array_equal(mapping[mapping], IDENTITY)  # a swap undoes itself
        # classes 0, 7, 8, 9 never change
        assert all(mapping[k] == k for k in (0, 7, 8, 9))
    # a map is applied as new = map[old]
    labels = np.array([0, 1, 2, 3, 4, 5, 6, 7])
    np.testing.assert_array_equal(concept_map(3, K)[labels], [0, 1, 2, 3, 4, 6, 5, 7])


@pytest.mark.parametrize("pid", range(20))
def test_no_drift_is_always_the_original_labels(pid):
    drift = Drift()
    for rnd in (0, 1, 100, 101, 500):
        assert concept(pid, rnd, drift) == 0
        np.testing.assert_array_equal(label_map(pid, rnd, drift, K), IDENTITY)
    # without drift any number of classes is fine
    np.testing.assert_array_equal(label_map(pid, 3, drift, 2), [0, 1])


@pytest.mark.parametrize("pid", range(20))
def test_sudden_drift_swaps_every_group_after_its_round(pid):
    drift = Drift("sudden")  # the paper's t = 100 (0-based): server rounds 101 on
    for rnd in (0, 1, 99, 100):
        np.testing.assert_array_equal(label_map(pid, rnd, drift, K), IDENTITY)
    for rnd in (101, 102, 150, 200):
        np.testing.assert_array_equal(label_map(pid, rnd, drift, K), _expect(pid, True))
        assert concept(pid, rnd, drift) == GROUP_OF[pid % 10]
    assert drift.change_rounds == (101,)


@pytest.mark.parametrize("pid", range(20))
def test_recurrent_drift_returns_to_the_original_concept(pid):
    drift = Drift("recurrent", (10, 15))
    expected = {0: False, 9: False, 10: False, 11: True, 12: True, 15: True, 16: False, 40: False}
    for rnd, drifted in expected.items():
        np.testing.assert_array_equal(label_map(pid, rnd, drift, K), _expect(pid, drifted))
        assert concept(pid, rnd, drift) == (GROUP_OF[pid % 10] if drifted else 0)
    assert drift.change_rounds == (11, 16)


def test_incremental_drift_moves_the_groups_in_order():
    drift = Drift("incremental")  # (100, 110, 120)
    # server round -> which groups have drifted
    stages = {
        0: set(), 100: set(), 101: {1}, 110: {1}, 111: {1, 2}, 120: {1, 2}, 121: {1, 2, 3},
        200: {1, 2, 3},
    }
    for rnd, drifted_groups in stages.items():
        for pid in range(30):
            group = GROUP_OF[pid % 10]
            drifted = group in drifted_groups
            np.testing.assert_array_equal(label_map(pid, rnd, drift, K), _expect(pid, drifted))
            assert concept(pid, rnd, drift) == (group if drifted else 0)
    assert drift.change_rounds == (101, 111, 121)
    # equal rounds are allowed (several groups at once); change rounds are deduplicated
    assert Drift("incremental", (5, 5, 7)).change_rounds == (6, 8)


@pytest.mark.parametrize("pattern", ["sudden", "recurrent", "incremental"])
def test_concept_agrees_with_label_map(pattern):
    drift = Drift(pattern, ())
    for pid in range(10):
        for rnd in range(0, 200, 3):
            np.testing.assert_array_equal(
                label_map(pid, rnd, drift, K), concept_map(concept(pid, rnd, drift), K)
            )
            assert label_map(pid, rnd, drift, 12).shape == (12,)


def test_defaults_and_effective_rounds():
    assert DEFAULT_DRIFT_ROUNDS == {
        "none": (), "sudden": (100,), "recurrent": (100, 150), "incremental": (100, 110, 120),
    }
    assert Drift("recurrent").effective_rounds == (100, 150)
    assert Drift("recurrent", (3, 8)).effective_rounds == (3, 8)
    assert Drift().change_rounds == ()


@pytest.mark.parametrize(
    "pattern, rounds, message",
    [
        ("gradual", (), "unknown drift pattern"),
        ("sudden", (10, 20), "exactly 1"),
        ("recurrent", (10,), "exactly 2"),
        ("recurrent", (20, 10), "increasing"),
        ("recurrent", (10, 10), "increasing"),
        ("incremental", (10, 20), "exactly 3"),
        ("incremental", (10, 30, 20), "non-decreasing"),
        ("sudden", (-1,), ">= 0"),
        ("none", (5,), "no drift rounds"),
    ],
)
def test_bad_drift_settings_are_clear_errors(pattern, rounds, message):
    with pytest.raises(ValueError, match=message):
        Drift(pattern, rounds)


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="num-classes >= 7"):
        label_map(0, 0, Drift("sudden"), 6)  # fails even before the drift
    with pytest.raises(ValueError, match="num-classes >= 7"):
        concept_map(1, 5)
    with pytest.raises(ValueError, match="concept id"):
        concept_map(4, K)
    with pytest.raises(ValueError, match="server round"):
        concept(0, -1, Drift("sudden"))
    with pytest.raises(ValueError, match="partition-id"):
        concept(-1, 0, Drift("sudden"))


def test_from_config_with_default_and_explicit_rounds():
    assert Drift.from_config(parse_run_config({})) == Drift("none", ())
    cfg = parse_run_config({"drift": "incremental"})
    assert Drift.from_config(cfg).effective_rounds == (100, 110, 120)
    cfg = parse_run_config({"drift": "recurrent", "drift-rounds": "30,60"})
    drift = Drift.from_config(cfg)
    assert drift == Drift("recurrent", (30, 60))
    assert drift.change_rounds == (31, 61)
    with pytest.raises(ValueError, match="exactly 1"):
        Drift.from_config(parse_run_config({"drift": "sudden", "drift-rounds": "30,60"}))


def test_label_map_is_stateless():
    drift = Drift("recurrent", (2, 4))
    first = [label_map(3, r, drift, K).tolist() for r in range(8)]
    again = [label_map(3, r, drift, K).tolist() for r in reversed(range(8))][::-1]
    assert first == again
    mapping = label_map(3, 3, drift, K)
    mapping[:] = 0  # a caller mutating its copy changes nothing for the next call
    np.testing.assert_array_equal(label_map(3, 3, drift, K), _swapped(3, 4))


def test_the_generalized_accuracy_is_measured_when_asked_for_or_under_drift():
    from client_app.app import generalized_due  # pylint: disable=import-outside-toplevel

    def due(config: dict) -> list[bool]:
        cfg = parse_run_config({"num-server-rounds": 5, **config})
        return [generalized_due(cfg, r) for r in range(1, 6)]

    assert due({}) == [False] * 5  # no drift, not asked: the whole test set is never evaluated
    assert due({"drift": "sudden", "drift-rounds": "2"}) == [False, False, False, False, True]
    assert due({"generalized-every": 2}) == [False, True, False, True, True]


def test_heads_on_one_extractor_share_one_pass_over_the_whole_test_set(monkeypatch):
    """The generalized accuracy from the cached features is the full forward pass's, bit for bit,
    and the whole test set goes through an extractor once, however many heads are measured."""
    import copy  # pylint: disable=import-outside-toplevel

    import torch  # pylint: disable=import-outside-toplevel

    from client_app import app as client  # pylint: disable=import-outside-toplevel
    from common.training import evaluate, evaluate_head  # pylint: disable=import-outside-toplevel
    from common.model import FedPACNet  # pylint: disable=import-outside-toplevel

    passes = []
    extract = client.extract_features
    monkeypatch.setattr(client, "extract_features", lambda *args: passes.append(1) or extract(*args))
    cfg, device = parse_run_config({}), torch.device("cpu")
    x_all, y_all = client.full_test_tensors(cfg, device)
    torch.manual_seed(0)
    received = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)

    def measured(extractor_shift: float) -> None:
        for _ in range(3):  # three clients: the same extractor, each its own head
            model = copy.deepcopy(received)
            with torch.no_grad():
                model.extractor[0].bias.add_(extractor_shift)
            torch.nn.init.normal_(model.head.weight)
            cached = evaluate_head(model.head, client.full_test_features(model, cfg, device), y_all)
            assert cached == evaluate(model, x_all, y_all)

    measured(0.0)
    assert len(passes) == 1
    measured(1e-3)  # the next round's extractor: extracted again, never served stale features
    assert len(passes) == 2


def test_drifts_agree_until_either_changes_a_label():
    from common.drift import Drift, concepts_agree, first_change

    sudden, recurrent, incremental = Drift("sudden"), Drift("recurrent"), Drift("incremental")
    assert first_change(sudden) == first_change(recurrent) == first_change(incremental) == 101
    assert first_change(Drift("none")) is None
    for other in (recurrent, incremental, Drift("none")):
        assert concepts_agree(sudden, other, 100) and not concepts_agree(sudden, other, 101)
    assert concepts_agree(Drift("sudden", (100,)), sudden, 200)  # the same drift, its defaults spelled out
    assert concepts_agree(Drift("none"), Drift("none"), 10**6)
    assert not concepts_agree(Drift("sudden", (5,)), Drift("sudden", (6,)), 6)
    assert concepts_agree(Drift("sudden", (5,)), Drift("sudden", (6,)), 5)
    assert Drift.from_fields({}) == Drift("none")  # a checkpoint from before drift existed
    assert Drift.from_fields({"drift": "recurrent", "drift_rounds": "3,4"}) == Drift("recurrent", (3, 4))
