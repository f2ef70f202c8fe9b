"""Differential privacy that holds against the server (``common.site_privacy``): the server knows
the run config, the rounds, the partitions and everything it sent, and writes every message. With
that alone it can neither regenerate a site's noise nor start the site's ledger over, nor make a
site drop the state it trained. Each test is the attack, run through the real ClientApp."""

from __future__ import annotations

import copy
import csv
import dataclasses
import json
import logging
import stat
from pathlib import Path
from typing import cast

import numpy as np
import pytest
from flwr.app import Context, Error, Message, MessageType, RecordDict
from flwr.serverapp import Grid

from client_app.app import app as client_app
from common import privacy
from common import protocol as p
from common.config import parse_run_config
from common.methods import METHODS
from common.privacy import Ledger
from common.site_privacy import Entry, SiteLedger, SitePolicy, noise_seed, parse_secret, privacy_folder, site_secret
from federation import InProcessGrid
from server_app.app import run_fedpac

# DP-SGD's Poisson batches of 20 of a site's 60 records (the recipe's 1,024 would take them all)
SMALL = {"samples-per-client": 60, "test-samples-per-client": 20, "local-epochs": 1, "batch-size": 20,
         "dp-batch-size": 20}


class RecordingGrid(InProcessGrid):
    """An in-process federation that keeps each train message with the reply it got."""

    def __init__(self, *args, **kwargs) -> None:  # noqa: ANN002, ANN003  # InProcessGrid's
        super().__init__(*args, **kwargs)
        self.recorded: list[tuple[Message, Message]] = []

    def _deliver(self, msg: Message) -> Message:
        reply = super()._deliver(msg)
        if msg.metadata.message_type == MessageType.TRAIN:
            self.recorded.append((msg, reply))
        return reply


def _arrays(reply: Message) -> dict[str, np.ndarray]:
    return {f"{section}/{key}": value for section, arrays in p.sections_of(reply.content).items()
            for key, value in arrays.items()}


def _replay(msg: Message, pid: int, num_partitions: int, run_config: dict, node_config: dict) -> Message:
    """The server's replay: the very message it sent, delivered to a copy of the site with the
    same data and everything else the server knows, in a folder of its own."""
    context = Context(run_id=7, node_id=msg.metadata.dst_node_id, state=RecordDict(), run_config=dict(run_config),
                      node_config={**node_config, "partition-id": pid, "num-partitions": num_partitions})
    return client_app(copy.deepcopy(msg), context)


def test_the_server_cannot_regenerate_a_site_s_noise_from_what_it_knows(tmp_path, monkeypatch):
    """FedPAC with DP: the server replays a site's round on the site's own data (the best
    candidate it could have) with everything it knows, the run config's seed included. Only the
    site's secret reproduces the reply; without it every released array differs, and so do the
    Poisson batches (whose secrecy the accountant's amplification by sampling assumes)."""
    batches: list[list[int]] = []
    draw = privacy.poisson_batch

    def recorded(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202  # poisson_batch's
        batch = draw(*args, **kwargs)
        batches.append(batch.tolist())
        return batch

    monkeypatch.setattr(privacy, "poisson_batch", recorded)
    config = {**SMALL, "strategy": "fedpac", "num-server-rounds": 1, "dp": True, "output-dir": str(tmp_path / "out")}
    sites = tmp_path / "sites"
    grid = RecordingGrid(config, 2, node_config={"state-dir": str(sites)})
    run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    msg, reply = grid.recorded[0]
    pid = grid.partition_of_node[msg.metadata.dst_node_id]
    released = _arrays(reply)
    assert any(key.startswith(f"{p.STATISTICS}/") for key in released)
    site_batches = batches[:len(batches) // 2]  # the first site's round (both sites draw as many)

    batches.clear()
    guessed = _arrays(_replay(msg, pid, 2, config, {"state-dir": str(tmp_path / "server-guess")}))
    assert sorted(guessed) == sorted(released)
    for key, value in released.items():  # the model and the statistics: nothing matches
        assert not np.array_equal(guessed[key], value), key
    assert batches != site_batches

    # the replay is faithful: with the site's secret (which only the site holds) it is the reply
    secret = (privacy_folder(sites, pid) / "noise-secret").read_text().strip()
    batches.clear()
    exact = _arrays(_replay(msg, pid, 2, config, {"state-dir": str(tmp_path / "with-secret"),
                                                  "dp-noise-secret": secret}))
    for key, value in released.items():
        np.testing.assert_array_equal(exact[key], value, err_msg=key)
    assert batches == site_batches


def test_each_site_makes_its_own_secret_readable_by_it_alone(tmp_path):
    first, second = site_secret(tmp_path / "a"), site_secret(tmp_path / "b")
    assert len(first) == 32 and first != second
    assert site_secret(tmp_path / "a") == first  # kept: a resumed run draws what it drew
    assert stat.S_IMODE((tmp_path / "a" / "noise-secret").stat().st_mode) == 0o600
    (tmp_path / "a" / "noise-secret").write_text("not hex")
    with pytest.raises(ValueError, match="damaged"):
        site_secret(tmp_path / "a")
    with pytest.raises(ValueError, match=r"a noise secret is 64 hex digits \(32 bytes\)"):
        parse_secret("00" * 31)
    # one stream per release and purpose, and none a guess without the key can make
    assert len({noise_seed(first, "r1", "noise"), noise_seed(first, "r2", "noise"), noise_seed(first, "r1", "sampling"),
                noise_seed(second, "r1", "noise")}) == 4


def _epsilons(out: Path) -> list[float]:
    (run,) = [d for d in out.iterdir() if d.is_dir()]
    with open(run / "clients.csv", newline="") as f:
        return [float(r["dp_epsilon"]) for r in csv.DictReader(f) if r["dp_epsilon"]]


def test_a_new_run_key_does_not_start_a_site_s_ledger_over(tmp_path, caplog):
    """A site that spent its budget in one run is asked again by a new run (a fresh run key and
    lineage, the way a server would try to reset it), asking for another release (another step size): the
    ledger is the site's own, so the new run's first round would pass the budget, and the site
    refuses it. The same run asked again (same model, same settings) gets the same releases, bit
    for bit: nothing new, and nothing charged."""
    base = {**SMALL, "strategy": "fedavg", "dp": True, "num-server-rounds": 2}
    node_config = {"state-dir": str(tmp_path / "sites")}
    run_fedpac(cast(Grid, InProcessGrid({**base, "output-dir": str(tmp_path / "first")}, 2, node_config=node_config)),
               parse_run_config({**base, "output-dir": str(tmp_path / "first")}), 1)
    spent = max(_epsilons(tmp_path / "first"))
    # the budget the first run ended just under; the new run's first round would take it over
    same = {**base, "dp-epsilon-budget": spent * 1.01, "output-dir": str(tmp_path / "same")}
    run_fedpac(cast(Grid, InProcessGrid(same, 2, node_config=node_config)), parse_run_config(same), 2)
    assert max(_epsilons(tmp_path / "same")) == spent
    again = {**same, "extractor-lr": 0.02, "output-dir": str(tmp_path / "again")}
    with caplog.at_level(logging.INFO):
        run_fedpac(cast(Grid, InProcessGrid(again, 2, node_config=node_config)), parse_run_config(again), 2)
    assert "stops training at round 1" in caplog.text and "over its budget" in caplog.text
    assert _epsilons(tmp_path / "again") == []  # no site released anything
    # and without a budget the new run continues the site's epsilon, it does not start at zero
    more = {**base, "extractor-lr": 0.03, "num-server-rounds": 1, "output-dir": str(tmp_path / "more")}
    run_fedpac(cast(Grid, InProcessGrid(more, 2, node_config=node_config)), parse_run_config(more), 3)
    assert min(_epsilons(tmp_path / "more")) > spent


def test_rounds_outside_the_run_are_refused_and_the_site_keeps_what_it_trained(tmp_path):
    """The real run's key, rounds 1000-1002: before, the site saved them and pruned its real
    rounds (its heads, its ledger). Now a round the run config does not have is refused, and so
    is a round of the run behind the one the site last trained."""
    config = {**SMALL, "strategy": "fedper", "num-server-rounds": 2, "output-dir": str(tmp_path / "out")}
    sites = tmp_path / "sites"
    grid = InProcessGrid(config, 2, node_config={"state-dir": str(sites)})
    run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    before = {f: f.read_bytes() for f in sites.rglob("round-*.npz")}
    assert len(before) == 4  # two rounds at two sites
    last = [m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN][-1]
    for far in (1000, 1001, 1002, 0, -1):
        forged = copy.deepcopy(last)
        forged.content[p.CONFIG][p.SERVER_ROUND] = far
        reply = grid._deliver(forged)  # pylint: disable=protected-access
        assert reply.has_error() and "not a round of this run" in reply.error.reason, far
    back = copy.deepcopy(last)  # a round of the run, behind the site's: a run's rounds only go forward
    back.content[p.CONFIG][p.SERVER_ROUND] = 1
    back.content[p.CONFIG].pop(p.EVALUATE_ROUND, None)
    reply = grid._deliver(back)  # pylint: disable=protected-access
    assert reply.has_error() and "goes back" in reply.error.reason
    assert {f: f.read_bytes() for f in sites.rglob("round-*.npz")} == before


def test_another_run_cannot_write_into_an_earlier_run_s_folder(tmp_path):
    """A message of another Flower run that names an earlier run's key as its own: the site
    would overwrite (and prune) that run's rounds. The folder belongs to the run that wrote it."""
    config = {**SMALL, "strategy": "fedper", "num-server-rounds": 2, "output-dir": str(tmp_path / "out")}
    sites = tmp_path / "sites"
    grid = InProcessGrid(config, 2, node_config={"state-dir": str(sites)})
    run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    before = {f: f.read_bytes() for f in sites.rglob("round-*.npz")}
    msg = copy.deepcopy([m for m in grid.sent if m.metadata.message_type == MessageType.TRAIN][-1])
    context = copy.deepcopy(grid.contexts[msg.metadata.dst_node_id])
    context.run_id = 8
    reply = _deliver_as(msg, context)
    assert reply.has_error() and "belongs to another run" in reply.error.reason
    assert {f: f.read_bytes() for f in sites.rglob("round-*.npz")} == before


def _deliver_as(msg: Message, context: Context) -> Message:
    try:
        return client_app(msg, context)
    except Exception as err:  # pylint: disable=broad-except  # what a SuperNode reports
        return Message(Error(code=0, reason=f"{type(err).__name__}: {err}"), reply_to=msg)


def test_the_ledger_charges_a_release_once_and_refuses_damage(tmp_path):
    ledger = SiteLedger(tmp_path / "ledger.jsonl")
    one = Ledger([(1.0, 0.1, 30)])
    ledger.append(Entry("a", "run-1", 1, one))
    ledger.append(Entry("a", "run-2", 1, one))  # the same release asked again: nothing new
    ledger.append(Entry("b", "run-2", 2, one, refused=True))  # withheld: not charged
    assert ledger.spent().history == one.history
    assert ledger.find("a") == Entry("a", "run-1", 1, one)  # the first charge: what a repeat reuses
    assert ledger.find("b") is None and ledger.find("zz") is None  # withheld, or never released
    ledger.append(Entry("c", "run-2", 2, one))
    assert ledger.spent().epsilon(1e-5) == pytest.approx(one.repeated(2).epsilon(1e-5))
    # a crash while appending leaves a line without its end: ignored, then dropped by the next append
    with open(ledger.path, "ab") as f:
        f.write(b'{"release": "d", "ru')
    assert [e.release for e in ledger.entries()] == ["a", "a", "b", "c"]
    ledger.append(Entry("e", "run-2", 3, one))
    assert [e.release for e in ledger.entries()] == ["a", "a", "b", "c", "e"]
    # a damaged line in the middle: the site's spending is unknown, it releases nothing more
    lines = ledger.path.read_text().split("\n")
    lines[1] = lines[1].replace('"mechanisms": [[1.0', '"mechanisms": [[-1.0')
    ledger.path.write_text("\n".join(lines))
    with pytest.raises(ValueError, match="damaged at line 2"):
        ledger.entries()


def _with_policy(grid: InProcessGrid, partition: int, **policy: object) -> None:
    """Give one site of ``grid`` its own policy in its node config (the others have none)."""
    node = next(n for n, pid in grid.partition_of_node.items() if pid == partition)
    grid.contexts[node].node_config.update(policy)


@pytest.mark.parametrize(("run", "policy", "reason"), [
    ({"dp": False}, {"dp-required": True}, "requires differential privacy (node config dp-required = true)"),
    ({"dp": True, "dp-noise-multiplier": 0.5}, {"dp-min-noise-multiplier": 0.8},
     "dp-noise-multiplier is 0.5 (after calibration), below the site's dp-min-noise-multiplier = 0.8"),
    # a calibration whose noise comes out below the floor: the target asks for more epsilon than
    # the site will give for the noise it requires
    ({"dp": True, "dp-target-epsilon": 50.0}, {"dp-min-noise-multiplier": 0.8}, "after calibration"),
    ({"dp": True, "dp-delta": 1e-3}, {"dp-max-delta": 1e-5}, "above the site's dp-max-delta"),
])
def test_a_run_that_asks_a_site_for_less_than_its_policy_is_refused_and_goes_on(tmp_path, caplog, run, policy,
                                                                                  reason):
    """The run config is the server's; the node config is the site's. A site whose policy the
    run breaks refuses every round, with a message that names the key; the server logs it and the
    run finishes with the other sites."""
    config = {**SMALL, "strategy": "fedavg", "num-server-rounds": 2, **run, "output-dir": str(tmp_path / "out")}
    grid = InProcessGrid(config, 3, node_config={"state-dir": str(tmp_path / "sites")})
    _with_policy(grid, 1, **policy)
    with caplog.at_level(logging.WARNING):
        run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    assert reason in caplog.text
    (run_folder,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    with open(run_folder / "clients.csv", newline="") as f:
        trained = {(r["round"], r["partition_id"]) for r in csv.DictReader(f) if r["trained"] == "1"}
    assert trained == {(t, pid) for t in ("1", "2") for pid in ("0", "2")}
    assert '"finished"' in (run_folder / "status.json").read_text()


def test_a_site_s_own_budget_binds_whatever_the_run_s_says(tmp_path, caplog):
    """The run sets no budget (or a looser one); the site's own dp-epsilon-budget stops it."""
    steps = privacy.steps_per_epoch(60, 20)
    one_round = Ledger([(1.0, 20 / 60, steps)])
    budget = (one_round.epsilon(1e-5) + one_round.repeated(2).epsilon(1e-5)) / 2
    config = {**SMALL, "strategy": "fedavg", "num-server-rounds": 2, "dp": True, "dp-epsilon-budget": 100.0,
              "output-dir": str(tmp_path / "out")}
    grid = InProcessGrid(config, 2, node_config={"state-dir": str(tmp_path / "sites")})
    _with_policy(grid, 0, **{"dp-epsilon-budget": budget})
    with caplog.at_level(logging.WARNING):
        run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    assert "partition 0 stops training at round 2" in caplog.text
    assert "partition 1 stops" not in caplog.text


@pytest.mark.parametrize("fused", [False, True])
def test_a_site_that_withholds_its_metrics_evaluates_and_reports_none_of_them(tmp_path, caplog, fused):
    """Node config withhold-metrics: the site's evaluations (evaluate messages, or fused into
    the next round's training) carry neither accuracy nor loss; the server counts the site as
    evaluated (and its final model as delivered) and averages the others."""
    config = {**SMALL, "strategy": "fedper", "num-server-rounds": 2, "fused-evaluation": fused,
              "output-dir": str(tmp_path / "out")}
    grid = RecordingGrid(config, 3, node_config={"state-dir": str(tmp_path / "sites")})
    _with_policy(grid, 1, **{"withhold-metrics": True})
    with caplog.at_level(logging.INFO):
        run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    (run_folder,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    with open(run_folder / "clients.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert {r["partition_id"] for r in rows if r["accuracy"]} == {"0", "2"}
    assert all(r["accuracy"] == r["test_loss"] == "" for r in rows if r["partition_id"] == "1")
    assert "1 more evaluated and withheld their metrics" in caplog.text
    status = json.loads((run_folder / "status.json").read_text())
    assert status["delivery"]["delivered"] == [0, 1, 2] and status["delivery"]["accuracy"]["1"] is None


def test_a_policy_in_the_node_config_is_checked():
    assert SitePolicy.from_node_config({}) == SitePolicy()
    assert SitePolicy(epsilon_budget=3.0).budget(8.0) == 3.0 and SitePolicy().budget(8.0) == 8.0
    assert SitePolicy(epsilon_budget=3.0).budget(0.0) == 3.0 and SitePolicy().budget(0.0) == 0.0
    assert SitePolicy.from_node_config({"withhold-metrics": True}).withhold_metrics
    for bad in ({"dp-required": "yes"}, {"dp-epsilon-budget": -1.0}, {"dp-min-noise-multiplier": "1"},
                {"withhold-metrics": 1}):
        with pytest.raises(ValueError, match="node config"):
            SitePolicy.from_node_config(bad)


# what a private site's training reply may carry: its partition, n (public), its epsilon, and
# what the method's server step reads (FedPAC's V, pFedVEM's rho and test accuracy)
RELEASED = {p.PARTITION_ID, p.NUM_EXAMPLES, p.DP_EPSILON, p.V, p.H_NOISE, p.V_INFLATION, p.RHO, p.LOCAL_ACCURACY}


@pytest.mark.parametrize("method", sorted(name for name, m in METHODS.items() if not m.dp_refusal))
def test_a_private_reply_withholds_the_losses_and_times_of_its_training(tmp_path, method):
    """With DP on, the training losses (the joint, head, alignment and personal ones, pFedVEM's
    E-step), pFedVEM's restore flag and the training time depend on the records and are outside
    the ledger: no reply carries them, and the run's outputs are written without them."""
    config = {**SMALL, "strategy": method, "num-server-rounds": 1, "dp": True, "output-dir": str(tmp_path / "out")}
    grid = RecordingGrid(config, 2, node_config={"state-dir": str(tmp_path / "sites")})
    run_fedpac(cast(Grid, grid), parse_run_config(config), 1)
    assert len(grid.recorded) == 2
    for _, reply in grid.recorded:
        keys = set(reply.content[p.METRICS].keys())
        assert p.DP_EPSILON in keys and keys <= RELEASED, sorted(keys - RELEASED)
    (run,) = [d for d in (tmp_path / "out").iterdir() if d.is_dir()]
    with open(run / "rounds.csv", newline="") as f:
        (row,) = list(csv.DictReader(f))
    assert row["mean_train_loss"] == "" and float(row["max_dp_epsilon"]) > 0


@pytest.mark.parametrize(("method", "releases"), [("fedavg", 1), ("fedavg-ft", 2), ("fedbabu", 2)])
def test_fine_tuning_whose_accuracy_is_reported_is_private_and_charged(tmp_path, method, releases):
    """FedAvg-FT and FedBABU fine-tune a copy before each evaluation; its accuracy goes to the
    server and the copy stays as the site's model. With DP on that fine-tuning is DP-SGD from the
    site's secret and one more release in the site's ledger (FedAvg has none)."""
    config = {**SMALL, "strategy": method, "num-server-rounds": 1, "dp": True, "output-dir": str(tmp_path / "out")}
    sites = tmp_path / "sites"
    run_fedpac(cast(Grid, InProcessGrid(config, 2, node_config={"state-dir": str(sites)})), parse_run_config(config), 1)
    for pid in range(2):
        (ledger,) = privacy_folder(sites, pid).glob("ledger-*.jsonl")
        entries = SiteLedger(ledger).entries()
        assert len({e.release for e in entries if not e.refused}) == releases, [e.released for e in entries]
        # each one DP-SGD's steps at the run's noise (the fine-tuning's as the training's)
        assert all(any(sigma == 1.0 and q < 1 for sigma, q, _ in e.released.history) for e in entries)


def test_the_keys_a_release_leaves_out_are_the_run_config_s_and_only_the_server_s():
    """A release's identity leaves out only run-config keys the site's computation never reads
    (a misspelt one would leave the real key in, a site-side one left out would let two
    different computations share noise)."""
    from client_app.app import DATA_KEYS, SERVER_ONLY_KEYS  # pylint: disable=import-outside-toplevel
    from common.config import FedPACConfig  # pylint: disable=import-outside-toplevel

    fields = {f.name for f in dataclasses.fields(FedPACConfig)}
    assert SERVER_ONLY_KEYS <= fields and set(DATA_KEYS) <= fields
    site_side = {"local_epochs", "batch_size", "extractor_lr", "head_lr", "momentum", "weight_decay", "lambda_align",
                 "dp_noise_multiplier", "dp_max_grad_norm", "dp_statistics_noise_multiplier", "dp_feature_clip",
                 "seed", "device", "strategy", "method_settings"}
    assert not SERVER_ONLY_KEYS & site_side
