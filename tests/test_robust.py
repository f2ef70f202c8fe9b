"""One reply's influence is bounded: the norm bound and the robust aggregators against plain
references (``common.robust``), and in-process federations in which one site sends a poisoned
update every round (the attacking site is ``bench/poisoning.py``'s, the benchmark's own)."""

from __future__ import annotations

import logging

import numpy as np
import pytest
from benches import load_bench
from flwr.app import MessageType
from flwr.serverapp.strategy.fedtrimmedavg import trim_mean as flower_trim_mean
from scipy import stats

from common import protocol as p
from common import robust
from common.averaging import median_of_others, weighted_average
from common.config import ConfigError, parse_run_config
from common.methods.fedpac.server import CENTROIDS
from common.methods.server import EXTRACTOR, HEAD
from common.model import split_state
from federation import InProcessGrid, set_task_identity
from server_app.app import initial_model, run_fedpac

poisoning = load_bench("poisoning")

# ---------------------------------------------------------------------- the math, against references


@pytest.mark.parametrize("count", [2, 3, 4, 5, 10, 11])
def test_the_median_of_the_others_is_the_median_without_each_value(count):
    rng = np.random.default_rng(count)
    for values in (rng.normal(size=count), rng.integers(0, 3, size=count).astype(float), np.full(count, 7.0)):
        expected = [np.median(np.delete(values, i)) for i in range(count)]
        np.testing.assert_array_equal(median_of_others(values), expected)


def _models(rng, count, shapes=((3, 4), (5,))):
    return [{f"a{i}": rng.normal(size=shape).astype(np.float32) for i, shape in enumerate(shapes)}
            for _ in range(count)]


def _reference_bound(received, sent, ratio):
    """The rule written out: each update's norm against ratio x the median of the others'."""
    deltas = [np.concatenate([(r[k].astype(np.float64) - s[k]).ravel() for k in sorted(r)])
              for r, s in zip(received, sent)]
    norms = np.array([np.linalg.norm(d) for d in deltas])
    result = []
    for i, (r, s) in enumerate(zip(received, sent)):
        bound = ratio * np.median(np.delete(norms, i))
        factor = min(1.0, bound / norms[i]) if norms[i] > 0 else 1.0
        result.append({k: (s[k] + factor * (r[k].astype(np.float64) - s[k])).astype(r[k].dtype) for k in r})
    return result, norms


def test_the_norm_bound_scales_each_update_to_ratio_times_the_others_median():
    rng = np.random.default_rng(0)
    sent = _models(rng, 1)[0]
    received = [{k: v + 0.1 * rng.normal(size=v.shape).astype(np.float32) for k, v in sent.items()} for _ in range(6)]
    received[2] = {k: sent[k] + 1e30 * (v - sent[k]) for k, v in received[2].items()}  # the poisoned one
    received[4] = {k: sent[k] - 4.0 * (v - sent[k]) for k, v in received[4].items()}  # flipped and enlarged
    result = robust.bound_updates(received, [sent] * 6, 3.0)
    expected, norms = _reference_bound(received, [sent] * 6, 3.0)
    np.testing.assert_allclose(result.norms, norms, rtol=1e-12)
    assert result.scaled == [2, 4]
    for got, want in zip(result.arrays, expected):
        for key in want:
            np.testing.assert_allclose(got[key], want[key], rtol=1e-6, atol=1e-7)
            assert got[key].dtype == want[key].dtype
    # the scaled updates now have exactly their bound, and keep their direction
    after = robust.update_norms(result.arrays, [sent] * 6)
    np.testing.assert_allclose(after[[2, 4]], result.bounds[[2, 4]], rtol=1e-5)
    flipped = np.concatenate([(result.arrays[4][k] - sent[k]).ravel() for k in sorted(sent)])
    original = np.concatenate([(received[4][k] - sent[k]).ravel() for k in sorted(sent)])
    assert np.dot(flipped, original) / (np.linalg.norm(flipped) * np.linalg.norm(original)) > 1 - 1e-5
    # a reply within its bound is handed on as it came: a round without outliers is unchanged
    assert all(result.arrays[i] is received[i] for i in (0, 1, 3, 5))


def test_a_reply_cannot_raise_its_own_bound_and_nothing_is_bounded_when_off_or_alone():
    rng = np.random.default_rng(1)
    sent = _models(rng, 1)[0]
    honest = {k: v + 0.01 for k, v in sent.items()}
    huge = {k: v * 1e30 for k, v in sent.items()}
    result = robust.bound_updates([honest, huge], [sent, sent], 3.0)
    # against the other's norm only: with the median of both, the larger would always pass
    assert result.scaled == [1] and result.norms[1] / result.norms[0] > 1e29
    np.testing.assert_allclose(robust.update_norms(result.arrays, [sent, sent])[1], 3.0 * result.norms[0], rtol=1e-5)
    for ratio, replies in ((0.0, [honest, huge]), (3.0, [huge])):
        off = robust.bound_updates(replies, [sent] * len(replies), ratio)
        assert off.scaled == [] and all(a is b for a, b in zip(off.arrays, replies))
    # where the others changed nothing (their median norm is 0), no reply may change it
    still = robust.bound_updates([sent, sent, honest], [sent] * 3, 3.0)
    assert still.scaled == [2] and all(np.array_equal(still.arrays[2][k], sent[k]) for k in sent)


def test_class_means_are_bounded_per_class_among_the_replies_holding_it():
    rng = np.random.default_rng(2)
    rows = rng.normal(size=(5, 3, 4))
    present = np.ones((5, 3), dtype=bool)
    present[0, 1] = False  # client 0 has no sample of class 1: its row counts for nothing
    rows[0, 1] *= 1e6
    rows[3, 2] *= 1e30
    bounded, factors = robust.bound_rows(rows, present, 3.0)
    for k in range(3):
        holders = np.flatnonzero(present[:, k])
        norms = np.linalg.norm(rows[holders, k], axis=1)
        for j, i in enumerate(holders):
            bound = 3.0 * np.median(np.delete(norms, j))
            np.testing.assert_allclose(np.linalg.norm(bounded[i, k]), min(norms[j], bound), rtol=1e-9)
    assert factors[0, 1] == 1.0 and (factors < 1).sum() <= 2 and factors[3, 2] < 1e-29


@pytest.mark.parametrize("count", [1, 2, 3, 4, 7, 10])
def test_the_coordinate_median_is_numpys_and_flowers_fedmedian(count, monkeypatch):
    monkeypatch.setattr(robust, "BLOCK_ELEMENTS", 7)  # several blocks per array, and a ragged last one
    rng = np.random.default_rng(count)
    models = _models(rng, count)
    result = robust.coordinate_median(models)
    for key in models[0]:
        stack = np.stack([m[key] for m in models])
        # Flower's FedMedian: np.median of the stacked layers
        np.testing.assert_allclose(result[key], np.median(stack, axis=0), rtol=1e-6)
        assert result[key].dtype == np.float32
        for index in np.ndindex(stack.shape[1:]):  # one coordinate at a time, by hand
            values = sorted(float(v) for v in stack[(slice(None), *index)])
            middle = (values[(count - 1) // 2] + values[count // 2]) / 2
            np.testing.assert_allclose(result[key][index], middle, rtol=1e-6)


@pytest.mark.parametrize("count", [1, 3, 4, 5, 9, 10, 20])
@pytest.mark.parametrize("fraction", [0.0, 0.1, 0.2, 0.3, 0.49])
def test_the_trimmed_mean_is_scipys_and_flowers_fedtrimmedavg(count, fraction, monkeypatch):
    monkeypatch.setattr(robust, "BLOCK_ELEMENTS", 11)
    rng = np.random.default_rng(count)
    models = _models(rng, count)
    result = robust.trimmed_mean(models, fraction)
    cut = int(fraction * count)
    for key in models[0]:
        stack = np.stack([m[key] for m in models]).astype(np.float64)
        np.testing.assert_allclose(result[key], stats.trim_mean(stack, fraction, axis=0), rtol=1e-6)
        np.testing.assert_allclose(result[key], flower_trim_mean(stack, fraction), rtol=1e-6)
        by_hand = np.sort(stack, axis=0)[cut:count - cut].mean(axis=0)
        np.testing.assert_allclose(result[key], by_hand, rtol=1e-6)


def test_aggregate_takes_the_weighted_mean_or_a_robust_rule_and_refuses_others():
    rng = np.random.default_rng(3)
    models = _models(rng, 5)
    weights = np.array([1.0, 2.0, 3.0, 4.0, 50.0])
    mean = robust.aggregate(models, weights, "mean")
    for key, value in weighted_average(models, weights).items():
        np.testing.assert_array_equal(mean[key], value)
    # the robust rules ignore the sample weights, as Flower's do
    assert all(np.array_equal(robust.aggregate(models, weights, "median")[k], robust.coordinate_median(models)[k])
               for k in models[0])
    outlier = [*models[:4], {k: v + 1e30 for k, v in models[4].items()}]
    for rule in ("median", "trimmed-mean"):
        result = robust.aggregate(outlier, weights, rule, trim_fraction=0.2)
        assert all(np.abs(v).max() < 10 for v in result.values())
    with pytest.raises(ValueError, match="unknown aggregation 'krum'"):
        robust.aggregate(models, weights, "krum")
    with pytest.raises(ValueError, match=r"\[0, 0.5\)"):
        robust.trimmed_mean(models, 0.5)


def test_a_head_whose_update_points_away_from_a_client_s_own_is_left_out_of_its_mix():
    alpha = np.array([[0.5, 0.2, 0.3], [0.1, 0.6, 0.3], [0.4, 0.4, 0.2]])
    updates = np.array([[1.0, 0.0], [1.0, 0.5], [-1.0, 0.1]])  # head 2 flipped
    mixed, dropped = robust.agreeing_mix(alpha, updates)
    assert sorted(dropped) == [(0, 2), (1, 2), (2, 0), (2, 1)]
    np.testing.assert_allclose(mixed, [[0.5 / 0.7, 0.2 / 0.7, 0.0], [0.1 / 0.7, 0.6 / 0.7, 0.0], [0.0, 0.0, 1.0]])
    # a zero update (a head that did not train) agrees with every other; nothing left out: the
    # weights as they were
    same, none = robust.agreeing_mix(alpha, np.array([[1.0, 0.0], [0.0, 0.0], [0.5, 0.5]]))
    assert none == [] and np.array_equal(same, alpha)
    # a row whose weights all go keeps its own head
    lonely, _ = robust.agreeing_mix(np.array([[0.0, 1.0], [0.5, 0.5]]), np.array([[1.0], [-1.0]]))
    np.testing.assert_array_equal(lonely, [[1.0, 0.0], [0.0, 1.0]])


@pytest.mark.parametrize(("key", "value", "fragment"), [
    ("max-norm-ratio", 0.5, "0 (no bound) or >= 1"), ("max-norm-ratio", -3.0, "0 (no bound) or >= 1"),
    ("shared-aggregation", "krum", "one of mean, median, trimmed-mean"),
    ("trim-fraction", 0.5, "in [0, 0.5)"), ("trim-fraction", -0.1, "in [0, 0.5)"),
    ("checkpoints-kept", 0, ">= 1"),
])
def test_the_new_run_config_keys_refuse_bad_values(key, value, fragment):
    with pytest.raises(ConfigError) as refused:
        parse_run_config({key: value})
    assert f"run config '{key}' = {value!r} is invalid: must be {fragment}" in str(refused.value)
    cfg = parse_run_config({"max-norm-ratio": 0, "shared-aggregation": "trimmed-mean", "trim-fraction": 0.0,
                            "checkpoints-kept": 1})
    assert (cfg.max_norm_ratio, cfg.shared_aggregation, cfg.trim_fraction, cfg.checkpoints_kept) == \
        (0.0, "trimmed-mean", 0.0, 1)


# ---------------------------------------------------------------------- federations under attack

RUN_CONFIG = {"samples-per-client": 60, "test-samples-per-client": 30, "local-epochs": 1, "batch-size": 20,
              "num-server-rounds": 3}
SITES, ATTACKER = 5, 1


def _federation(tmp_path, name, change=None, tamper=None, **extra):
    """A FedPAC run of SITES in-process sites, partition ATTACKER changing its update with
    ``change`` (``bench/poisoning.py``'s attacking site) or its reply with ``tamper``."""
    config = {**RUN_CONFIG, **extra, "output-dir": str(tmp_path / name)}
    if tamper is None:
        grid = poisoning.AttackedGrid(config, SITES, ATTACKER, change)
    else:
        grid = InProcessGrid(config, SITES, tamper=tamper)
    return run_fedpac(grid, parse_run_config(config), 1)


def _flat(arrays):
    return np.concatenate([arrays[k].ravel().astype(np.float64) for k in sorted(arrays)])


@pytest.fixture(scope="module")
def clean(tmp_path_factory):
    """The same federation without an attacker, and the initial extractor: the honest outcome."""
    set_task_identity()  # conftest's autouse fixture sets it per test, after module fixtures
    strategy, report = _federation(tmp_path_factory.mktemp("clean"), "clean")
    model = initial_model(parse_run_config(RUN_CONFIG))
    extractor, _ = split_state({k: v.numpy() for k, v in model.state_dict().items()})
    return strategy, report, extractor


def _honest_accuracy(report):
    return np.mean([a for pid, a in report.rounds[-1].accuracy.items() if pid != ATTACKER])


ATTACKS = {"x1e30": lambda update: 1e30 * update, "sign-flipped x10": lambda update: -10.0 * update,
           "sign-flipped": lambda update: -update}


@pytest.mark.parametrize("attack", sorted(ATTACKS))
def test_a_site_poisoning_its_update_every_round_neither_stops_the_run_nor_owns_the_model(attack, clean, tmp_path,
                                                                                        caplog):
    """Every round every reply is valid and aggregated, and the shared extractor the honest sites
    get stays finite and within the clean run's own movement of the clean run's extractor; their
    accuracy stays near the clean run's. Without the bound (max-norm-ratio = 0) x1e30 makes every
    site's next training NaN (all replies rejected, as in issue 54) and x-10 drives the extractor
    15 clean movements away. A plain sign flip has an honest norm: the bound leaves it as it is,
    and its weight (one site's n_i) is what limits it."""
    clean_strategy, clean_report, initial = clean
    with caplog.at_level(logging.WARNING):
        strategy, report = _federation(tmp_path, attack, ATTACKS[attack])
    assert [r.round for r in report.rounds] == [1, 2, 3]
    assert all(r.rejected == 0 and len(r.train) == SITES for r in report.rounds)
    extractor = _flat(strategy.extractor)
    assert np.isfinite(extractor).all()
    movement = np.linalg.norm(_flat(clean_strategy.extractor) - _flat(initial))
    assert np.linalg.norm(extractor - _flat(clean_strategy.extractor)) < movement
    for pid, head in strategy.state.personal[HEAD].items():
        assert all(np.isfinite(v).all() and np.abs(v).max() < 100 for v in head.values()), pid
    assert abs(_honest_accuracy(report) - _honest_accuracy(clean_report)) < 0.15
    if attack != "sign-flipped":  # and the operator is told
        assert f"partition {ATTACKER}'s extractor update has norm" in caplog.text


def test_a_sign_flipped_head_reaches_no_honest_client_s_mix(tmp_path, caplog):
    """A plain sign flip passes the norm bound; under FedPAC it harms the sites whose statistics
    resemble the flipping site's, which the QP gives its head. With agreeing-heads (the default)
    the flipped head keeps a tenth of the weight the honest clients' mixes gave it without, in
    the rounds after the first (only a client whose own update happens to point the flipped
    head's way still mixes it)."""
    def weights_on_attacker(report):
        rounds = [r.method for r in report.rounds[1:]]
        return [row[r["alpha_partitions"].index(ATTACKER)] for r in rounds
                for pid, row in zip(r["alpha_partitions"], r["alpha"]) if pid != ATTACKER]

    with caplog.at_level(logging.WARNING):
        _, report = _federation(tmp_path, "agreeing", ATTACKS["sign-flipped"])
    _, unguarded = _federation(tmp_path, "unguarded", ATTACKS["sign-flipped"], **{"agreeing-heads": False})
    guarded, given = sum(weights_on_attacker(report)), sum(weights_on_attacker(unguarded))
    assert given > 0.05 and guarded < 0.1 * given, (guarded, given)
    assert f"<- {ATTACKER}: " in caplog.text


def test_without_the_bound_the_x1e30_site_makes_every_reply_invalid(tmp_path):
    """The attack itself, as issue 54 saw it (the reason for the bound): the round after it, every
    site's training diverges and is rejected."""
    _, report = _federation(tmp_path, "unbounded", ATTACKS["x1e30"], **{"max-norm-ratio": 0.0, "num-server-rounds": 2})
    assert len(report.rounds[0].train) == SITES
    assert not report.rounds[1].train and report.rounds[1].rejected == SITES


def test_a_site_sending_class_means_of_1e30_does_not_spoil_the_alignment_targets(clean, tmp_path, caplog):
    """FedPAC's local centroids are averaged into every client's alignment targets: bounded per
    class, a site's 1e30 leaves them at the clean run's scale and every later round trains.
    Without the bound every reply of round 2 is NaN and rejected."""
    clean_strategy, _, _ = clean

    def tamper(reply, pid):
        if pid == ATTACKER and reply.metadata.message_type == MessageType.TRAIN and reply.has_content():
            sections = p.sections_of(reply.content)
            sections[p.STATISTICS][p.CENTROID_VALUES] = sections[p.STATISTICS][p.CENTROID_VALUES] * np.float32(1e30)
            reply.content[p.ARRAYS] = p.pack(sections)
        return reply

    with caplog.at_level(logging.WARNING):
        strategy, report = _federation(tmp_path, "centroids", tamper=tamper)
    assert all(r.rejected == 0 and len(r.train) == SITES for r in report.rounds)
    centroids = strategy.state.shared[CENTROIDS][p.CENTROID_VALUES]
    clean_centroids = clean_strategy.state.shared[CENTROIDS][p.CENTROID_VALUES]
    assert np.abs(centroids).max() < 3 * np.abs(clean_centroids).max()
    assert np.isfinite(_flat(strategy.state.shared[EXTRACTOR])).all()
    assert f"partitions [{ATTACKER}] report class means over max-norm-ratio" in caplog.text


@pytest.mark.parametrize("rule", ["median", "trimmed-mean"])
def test_a_robust_aggregator_alone_leaves_the_outlier_out(rule, tmp_path):
    """shared-aggregation = median / trimmed-mean with the bound off, under FedAvg (both parts
    averaged): the x1e30 site's model is an outlier in every coordinate, which the coordinate-wise
    rule leaves out; every round trains and the model stays at an honest scale. With the mean it
    is the stalled run of issue 54."""
    strategy, report = _federation(tmp_path, rule, ATTACKS["x1e30"], strategy="fedavg",
                                   **{"max-norm-ratio": 0.0, "shared-aggregation": rule, "trim-fraction": 0.2})
    assert all(r.rejected == 0 and len(r.train) == SITES for r in report.rounds)
    for section in (EXTRACTOR, HEAD):  # the initial model's weights are below 1
        assert all(np.abs(v).max() < 10 for v in strategy.state.shared[section].values())
