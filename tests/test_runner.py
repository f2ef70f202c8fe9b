"""The experiment runner: grid files, resumable execution, and the per-experiment report.

Most tests drive the runner with a stand-in executor that writes run folders the way a
simulation does (fast, and able to simulate crashes); one test runs a tiny grid through real
Flower simulations (Ray) twice and checks that the second invocation redoes nothing finished.
"""

import contextlib
import csv
import json
import math
import os
import signal
import subprocess
import sys
import tarfile
import time
from dataclasses import asdict
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from common.config import parse_run_config
from experiments.archive import archive_grid
from experiments.grid import Cell, GridError, Overrides, load_grid, parse_assignment
from experiments.runner import cell_directory, main, plan, results_of
from experiments.runs import finished_run, resumable_run

from conftest import PNG_SIGNATURE

TINY = """
rounds = 2
seeds = [0]
clients = 3
alpha-rounds = [1, 5]

[run-config]
samples-per-client = 60
test-samples-per-client = 30
local-epochs = 1
batch-size = 20

[experiments.tiny]
title = "Tiny grid"
methods = ["fedavg", "fedpac"]

[experiments.tiny.settings.s-20]
paper = { fedpac = 91.83 }
"""


def _grid(tmp_path: Path, text: str = TINY) -> Path:
    path = tmp_path / "grid.toml"
    path.write_text(text)
    return path


# ---------------------------------------------------------------------------- grid files


def test_grid_levels_merge_cli_overrides_win_and_identical_cells_run_once(tmp_path):
    text = TINY + """
[experiments.other]
methods = ["fedpac", "local"]
seeds = [0, 1]
run-config = { uniform-share = 50.0 }
[experiments.other.settings.same-as-tiny]
run-config = { uniform-share = 20.0 }   # the setting's value wins: FedPAC seed 0 = tiny's cell
[experiments.other.settings.bigger]
clients = 4
"""
    experiments = load_grid(_grid(tmp_path, text), Overrides(rounds=3, run_config={"local-epochs": 2}))
    tiny, other = experiments
    assert {s.rounds for e in experiments for s in e.settings} == {3}
    assert tiny.settings[0].alpha_rounds == [1, 3]  # 5 clipped to the last
    settings = {s.name: s for s in other.settings}
    assert settings["same-as-tiny"].run_config["uniform-share"] == 20.0
    assert settings["bigger"].run_config["uniform-share"] == 50.0 and settings["bigger"].clients == 4
    assert all(s.run_config["local-epochs"] == 2 for s in settings.values())  # --set wins
    cells = plan(experiments)
    # tiny: 2 cells; other: 2 settings x 2 methods x 2 seeds = 8, one of them tiny's FedPAC
    assert len(cells) == 2 + 8 - 1
    shared = next(c for c in cells if len(c.uses) == 2)
    assert shared.cell.method == "fedpac" and shared.cell.seed == 0
    assert [e.name for e, _ in shared.uses] == ["tiny", "other"]
    only = load_grid(_grid(tmp_path, text), Overrides(experiments=["other"], methods=["local"], seeds=[7]))
    assert [(c.method, c.seed) for _, c in only[0].cells()] == [("local", 7), ("local", 7)]


def test_a_setting_may_run_its_own_rounds_and_seeds_and_the_table_says_so(tmp_path):
    from experiments.summary import markdown_table, summary_rows

    text = TINY + """
[experiments.tiny.settings.longer]
rounds = 4
seeds = [1, 2]
alpha-rounds = [4]
"""
    (experiment,) = load_grid(_grid(tmp_path, text))
    cells = [(setting.name, cell.method, cell.seed, cell.rounds, cell.run_config["num-server-rounds"])
             for setting, cell in experiment.cells()]
    assert cells == [("s-20", "fedavg", 0, 2, 2), ("s-20", "fedpac", 0, 2, 2),
                     ("longer", "fedavg", 1, 4, 4), ("longer", "fedavg", 2, 4, 4),
                     ("longer", "fedpac", 1, 4, 4), ("longer", "fedpac", 2, 4, 4)]
    assert [s.alpha_rounds for s in experiment.settings] == [[1, 2], [4]]  # the top's 5 clipped to 2
    assert not experiment.uniform
    table = markdown_table(experiment, summary_rows(experiment, {}))
    assert "after each column's rounds, mean ± std over its seeds" in table
    assert "| s-20 (3 clients, 2 rounds, seed 0) | longer (3 clients, 4 rounds, seeds 1, 2) |" in table
    (shortened,) = load_grid(_grid(tmp_path, text), Overrides(rounds=3, seeds=[5]))  # the command line wins
    assert {(c.rounds, c.seed) for _, c in shortened.cells()} == {(3, 5)} and shortened.uniform
    assert "after 3 rounds, mean ± std over the seeds 5" in markdown_table(shortened, [])


@pytest.mark.parametrize("change,fragment", [
    (('methods = ["fedavg", "fedpac"]', 'methods = ["fedavg", "fedbn"]'), "unknown method(s) fedbn; one of fedpac"),
    (("batch-size = 20", "batch-size = 20\nuniform-share = 120.0"), "'uniform-share' = 120.0 is invalid"),
    (("batch-size = 20", "batch-size = 20\nlamda-align = 1.0"), "unknown run config key(s): lamda-align"),
    (("batch-size = 20", "batch-size = 20\nseed = 3"), "seed are set by the grid itself"),
    (("rounds = 2", "rounds = 0"), "grid.rounds must be a positive integer"),
    (("clients = 3", ""), "no 'clients'"),
    (("paper = { fedpac = 91.83 }", "paper = { fedpac-colab = 89.92 }"),
     "experiments.tiny.settings.s-20.paper: fedpac-colab not among the experiment's methods"),
    (("rounds = 2", 'rounds = 2\nmetric = "global"'),
     "grid.metric must be one of 'personalized', 'generalized', got 'global'"),
    (('title = "Tiny grid"', 'title = "Tiny grid"\nmetric = 1'),
     "experiments.tiny.metric must be one of 'personalized', 'generalized', got 1"),
    (("paper = { fedpac = 91.83 }", 'metric = "generalized"'),
     "experiments.tiny.settings.s-20: unknown key(s) metric"),  # one metric per table
])
def test_bad_grids_fail_before_anything_runs_and_say_why(tmp_path, change, fragment):
    with pytest.raises(GridError) as err:
        load_grid(_grid(tmp_path, TINY.replace(*change)))
    assert fragment in str(err.value)


def test_a_methods_recipe_applies_to_its_cells_over_the_settings_and_under_the_command_line(tmp_path):
    text = TINY.replace('methods = ["fedavg", "fedpac"]', 'methods = ["fedavg-ft", "fedrep", "fedpac"]') + """
[experiments.tiny.settings.longer]
run-config = { local-epochs = 3, finetune-epochs = 2 }
[method-config]
fedrep = { fedrep-body-epochs = 5 }
fedavg-ft = { finetune-epochs = 4 }
"""
    (experiment,) = load_grid(_grid(tmp_path, text))
    cells = {(setting.name, cell.method): cell.run_config for setting, cell in experiment.cells()}
    assert cells[("longer", "fedrep")]["fedrep-body-epochs"] == 5
    assert cells[("longer", "fedrep")]["local-epochs"] == 3  # the setting's other keys stay
    assert cells[("longer", "fedavg-ft")]["finetune-epochs"] == 4  # the recipe over the setting
    assert "fedrep-body-epochs" not in cells[("s-20", "fedpac")]  # only the method's own cells
    (experiment,) = load_grid(_grid(tmp_path, text), Overrides(run_config={"finetune-epochs": 1}))
    assert all(cell.run_config["finetune-epochs"] == 1 for _, cell in experiment.cells())  # --set wins
    for bad, fragment in (("fedrepp = { fedrep-body-epochs = 5 }", "method-config: unknown method(s) fedrepp"),
                          ("fedrep = { seed = 3 }", "method-config.fedrep: seed are set by the grid"),
                          ("fedrep = { fedrep-body-epochs = 0 }", "'fedrep-body-epochs'")):
        with pytest.raises(GridError) as err:
            load_grid(_grid(tmp_path, text.replace("fedrep = { fedrep-body-epochs = 5 }", bad)))
        assert fragment in str(err.value)


def test_the_metric_is_personalized_by_default_inherited_from_the_top_and_set_per_experiment(tmp_path):
    (tiny,) = load_grid(_grid(tmp_path))
    assert tiny.metric == "personalized"
    text = 'metric = "generalized"\n' + TINY + """
[experiments.local]
metric = "personalized"
methods = ["local"]
[experiments.local.settings.s-20]
"""
    tiny, local = load_grid(_grid(tmp_path, text))
    assert (tiny.metric, local.metric) == ("generalized", "personalized")
    # the metric is what the table reports, not what a cell computes: the cells are the same
    assert [c.key for _, c in tiny.cells()] == [c.key for _, c in load_grid(_grid(tmp_path))[0].cells()]


GRIDS = sorted((Path(__file__).resolve().parents[1] / "experiments" / "grids").glob("*.toml"))


@pytest.mark.parametrize("path", GRIDS, ids=[g.stem for g in GRIDS])
def test_shipped_grids_are_valid_and_name_the_papers_numbers_only_for_their_own_methods(path):
    experiments = load_grid(path)
    assert experiments and all(e.methods and e.settings for e in experiments)
    for experiment in experiments:
        for setting in experiment.settings:
            assert set(setting.paper) <= set(experiment.methods), (experiment.name, setting.name)


def test_the_fedccfa_drift_grid_has_the_papers_protocol_and_cells():
    path = Path(__file__).resolve().parents[1] / "experiments" / "grids" / "fmnist-drift.toml"
    experiments = load_grid(path)
    assert [e.name for e in experiments] == ["sudden", "recurrent", "incremental"]
    assert all(e.metric == "generalized" for e in experiments)
    assert all(s.rounds == 200 and s.seeds == [0, 1, 2] for e in experiments for s in e.settings)
    # sudden: 2 settings x 5 methods x 3 seeds; recurrent, incremental: 1 x 2 x 3; none shared
    assert [len(e.cells()) for e in experiments] == [30, 6, 6] and len(plan(experiments)) == 42
    sudden = {s.name: s for s in experiments[0].settings}
    assert (sudden["100-clients"].clients, sudden["20-clients"].clients) == (100, 20)
    assert sudden["100-clients"].run_config["fraction-train"] == 0.2
    assert sudden["100-clients"].run_config["full-last-round"] is False
    assert "fraction-train" not in sudden["20-clients"].run_config  # full participation
    assert sudden["20-clients"].paper == {"fedccfa": 89.50, "fedpac": 84.00, "fedrep": 81.99, "fedavg": 67.81}
    assert sudden["100-clients"].paper["fedccfa"] == 89.39 and "local" not in sudden["100-clients"].paper
    for experiment in experiments:
        for setting, cell in experiment.cells():
            config = cell.identity["config"]
            assert config["drift"] == experiment.name and config["partition"] == "dirichlet-min"
            assert (config["dataset"], config["batch_size"], config["generalized_every"]) == ("fashion-mnist", 64, 20)
            assert (config["normalize_mean"], config["normalize_std"]) == ("0.1307", "0.3081")
            assert not setting.paper or experiment.name == "sudden"
            if cell.method == "fedrep":  # the FedCCFA repository's configs/FedRep.yaml
                assert (config["fedrep_head_epochs"], config["fedrep_head_lr"]) == (1, 0.1)
                assert (config["fedrep_body_epochs"], config["extractor_lr"]) == (5, 0.01)


def test_command_line_assignments_are_read_as_toml_or_plain_text():
    assert parse_assignment("fraction-train=0.3") == ("fraction-train", 0.3)
    assert parse_assignment("dataset='fashion-mnist'") == ("dataset", "fashion-mnist")
    assert parse_assignment("data-dir=/data/fmnist") == ("data-dir", "/data/fmnist")
    with pytest.raises(GridError):
        parse_assignment("no-value")


# ---------------------------------------------------------------------------- a stand-in simulation


def _fake_run(cell, directory, accuracies, finished=True, name="20260101-000000-run1", generalized=None):
    """A run folder as the ServerApp writes it: metrics.json, checkpoint, final state when done;
    ``generalized`` maps the rounds that measured the generalized accuracy to its value."""
    run = directory / name
    run.mkdir(parents=True)
    config = {**asdict(parse_run_config(cell.run_config)), "output_dir": str(directory), "resume_from": ""}
    rounds = []
    for number, accuracy in enumerate(accuracies, start=1):
        record = {"round": number, "mean_accuracy": accuracy, "seconds": 30.0,
                  "accuracy": {str(p): accuracy for p in range(cell.clients)},
                  "alpha": [], "alpha_partitions": [], "group": {str(p): p % 5 for p in range(cell.clients)},
                  "generalized": {}}
        if generalized and number in generalized:
            record["generalized"] = {str(p): generalized[number] for p in range(cell.clients)}
            record["mean_generalized_accuracy"] = generalized[number]
        if cell.method == "fedpac":
            record["alpha"] = np.eye(cell.clients).tolist()
            record["alpha_partitions"] = list(range(cell.clients))
        rounds.append(record)
    (run / "metrics.json").write_text(json.dumps({"config": config, "rounds": rounds}))
    (run / "checkpoint.npz").write_bytes(b"checkpoint")
    (run / "status.json").write_text(json.dumps({
        "state": "finished" if finished else "running", "completed_rounds": len(rounds), "num_rounds": cell.rounds}))
    if finished:
        (run / "final_state.npz").write_bytes(b"final")
    return run


class FakeSimulation:
    """Records every call; finishes cells with fixed accuracies, or crashes one half-way."""

    def __init__(self, crash=()):
        self.calls = []
        self.crash = set(crash)

    def __call__(self, cell, directory, resume_from, log_path):
        self.calls.append((cell.method, cell.seed, resume_from))
        log_path.write_text("simulated\n")
        accuracy = {"fedavg": 0.80, "fedpac": 0.90, "ditto": 0.85}[cell.method] + 0.02 * cell.seed
        name = f"run-{len(self.calls)}"
        if cell.method in self.crash:
            _fake_run(cell, directory, [accuracy] * (cell.rounds - 1), finished=False, name=name)
            return 1
        _fake_run(cell, directory, [accuracy] * cell.rounds, name=name)
        return 0


def test_runner_skips_finished_cells_and_resumes_a_half_finished_one_from_its_checkpoint(tmp_path, capsys):
    grid, out = _grid(tmp_path), tmp_path / "out"
    args = [str(grid), "--out", str(out), "--seeds", "0,1"]
    crashing = FakeSimulation(crash={"fedpac"})
    assert main(args, execute=crashing) == 1  # the FedPAC cells stopped half-way: reported
    assert [c[:2] for c in crashing.calls] == [("fedavg", 0), ("fedavg", 1), ("fedpac", 0), ("fedpac", 1)]
    first = capsys.readouterr().out
    assert "[3/4] tiny/s-20 | fedpac | seed 0: FAILED (exit status 1)" in first
    assert "2 of 4 cells failed" in first
    # each stopped cell has 1 of its 2 rounds left, at the 30 s a round of the setting so far
    assert "the 2 cells left need about 1.0 min" in (out / "tiny" / "table.md").read_text()

    again = FakeSimulation()
    assert main(args, execute=again) == 0
    # finished cells were not run again; the stopped ones continued from their own run folders
    assert [c[:2] for c in again.calls] == [("fedpac", 0), ("fedpac", 1)]
    experiments = load_grid(grid, Overrides(seeds=[0, 1]))
    for method, seed, resume_from in again.calls:
        cell = next(c for _, c in experiments[0].cells() if (c.method, c.seed) == (method, seed))
        assert resume_from is not None and resume_from.parent == cell_directory(out, cell)
        resumed = finished_run(cell_directory(out, cell), cell)
        assert resumed is not None and resumed.directory != resume_from
    second = capsys.readouterr().out
    assert "[1/4] tiny/s-20 | fedavg | seed 0: finished before, skipped (final accuracy 80.00%)" in second
    assert "[3/4] tiny/s-20 | fedpac | seed 0: resuming after round 1/2 from run-3" in second
    assert "[4/4] tiny/s-20 | fedpac | seed 1: done in" in second

    nothing = FakeSimulation()
    assert main(args, execute=nothing) == 0 and nothing.calls == []

    # a longer run is another cell: nothing finished is mistaken for it
    longer = FakeSimulation()
    assert main(args + ["--rounds", "3", "--methods", "fedavg"], execute=longer) == 0
    assert [c[:2] for c in longer.calls] == [("fedavg", 0), ("fedavg", 1)]


def test_a_stopped_cell_of_a_method_whose_sites_keep_state_resumes_like_any_other(tmp_path, capsys):
    """Ditto's personal models live at the sites, on their disk, found again through the run's
    lineage (``common.site_state``): a stopped Ditto cell resumes, and a longer one extends."""
    grid, out = _grid(tmp_path, TINY.replace("fedpac", "ditto")), tmp_path / "out"
    assert main([str(grid), "--out", str(out)], execute=FakeSimulation(crash={"ditto"})) == 1
    capsys.readouterr()
    again = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--dry-run"], execute=again) == 0
    assert "tiny/s-20 | ditto | seed 0: 3 clients, 2 rounds: resumable after round 1" in capsys.readouterr().out
    assert main([str(grid), "--out", str(out)], execute=again) == 0
    assert [(m, seed) for m, seed, _ in again.calls] == [("ditto", 0)] and again.calls[0][2] is not None
    assert "ditto | seed 0: resuming after round 1/2" in capsys.readouterr().out
    longer = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--rounds", "3", "--extend"], execute=longer) == 0
    assert [m for m, _, _ in longer.calls] == ["fedavg", "ditto"] and all(r is not None for _, _, r in longer.calls)


def test_a_run_whose_status_says_finished_counts_as_finished_without_its_final_state(tmp_path, capsys):
    """An archived grid leaves out the final states (tens of MB each) of runs nothing continues:
    the run's status.json still marks it finished, so the cell is skipped, not trained again."""
    grid, out = _grid(tmp_path), tmp_path / "out"
    (_, cell), *_ = load_grid(grid, Overrides(seeds=[0]))[0].cells()
    run = _fake_run(cell, cell_directory(out, cell), [0.5] * cell.rounds, finished=False)
    (run / "checkpoint.npz").unlink()
    assert finished_run(cell_directory(out, cell), cell) is None  # no final state, no status: not done
    (run / "status.json").write_text(json.dumps({"state": "finished", "completed_rounds": cell.rounds}))
    assert finished_run(cell_directory(out, cell), cell) is not None
    calls = FakeSimulation()
    main([str(grid), "--out", str(out), "--seeds", "0"], execute=calls)
    assert (cell.method, cell.seed) not in [c[:2] for c in calls.calls]
    assert f"{cell.method} | seed 0: finished before, skipped (final accuracy 50.00%)" in capsys.readouterr().out


def test_extend_continues_the_longest_finished_shorter_run_of_the_same_configuration(tmp_path, capsys):
    grid, out = _grid(tmp_path), tmp_path / "out"
    for rounds in ("2", "3"):
        assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", rounds],
                    execute=FakeSimulation()) == 0
    capsys.readouterr()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg,fedpac", "--rounds", "6", "--extend",
                 "--dry-run"]) == 0
    planned = capsys.readouterr().out.splitlines()
    assert "fedavg | seed 0: 3 clients, 6 rounds: to run, extending the finished 3-round run fedavg-3c-" in planned[0]
    assert planned[1].endswith("fedpac | seed 0: 3 clients, 6 rounds: to run")
    extending = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg,fedpac", "--rounds", "6", "--extend"],
                execute=extending) == 0
    (fedavg, fedpac) = extending.calls
    assert fedavg[2] is not None
    assert json.loads((fedavg[2] / "metrics.json").read_text())["config"]["num_server_rounds"] == 3
    assert fedpac[2] is None  # nothing shorter to continue: from round 1
    log = capsys.readouterr().out
    assert "extending the finished 3-round run" in log and "left" in log
    # another configuration is never continued, nor is a sampled run with a full last round
    other = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "7", "--extend",
                 "--set", "local-epochs=2"], execute=other) == 0
    assert other.calls[0][2] is None
    sampled = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "8", "--extend",
                 "--set", "fraction-train=0.5"], execute=sampled) == 0
    assert sampled.calls[0][2] is None


def test_extend_continues_a_shorter_run_under_another_drift_only_before_any_label_changed(tmp_path):
    grid, out = _grid(tmp_path), tmp_path / "out"
    sudden = ["--set", "drift=sudden", "--set", "drift-rounds='3'"]  # labels change from round 4
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "3", *sudden],
                execute=FakeSimulation()) == 0
    recurrent = ["--set", "drift=recurrent", "--set", "drift-rounds='3,5'"]
    extending = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "8", "--extend", *recurrent],
                execute=extending) == 0
    (call,) = extending.calls
    assert call[2] is not None and json.loads((call[2] / "metrics.json").read_text())["config"]["drift"] == "sudden"
    # a sudden run past its drift is another computation than a recurrent drift's
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "4", *sudden],
                execute=FakeSimulation()) == 0
    later = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "9", "--extend",
                 "--set", "drift=incremental", "--set", "drift-rounds='2,3,4'"], execute=later) == 0
    assert later.calls[0][2] is None  # its labels change from round 3: neither sudden run is its own


def test_a_run_with_every_round_but_no_final_state_is_resumed_not_redone(tmp_path):
    # stopped while it wrote its final state: the ServerApp, resumed, only writes that state
    grid, out = _grid(tmp_path), tmp_path / "out"
    (_, cell), *_ = load_grid(grid, Overrides(seeds=[0]))[0].cells()
    run = _fake_run(cell, cell_directory(out, cell), [0.5] * cell.rounds, finished=False)
    resuming = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--seeds", "0", "--methods", cell.method], execute=resuming) == 0
    assert resuming.calls == [(cell.method, 0, run)]


def test_extend_passes_over_a_shorter_run_without_its_checkpoint(tmp_path):
    # an archive leaves out the checkpoint of a finished run: it cannot be continued, the one
    # with its checkpoint can
    grid, out = _grid(tmp_path), tmp_path / "out"
    for rounds in ("2", "3"):
        assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", rounds],
                    execute=FakeSimulation()) == 0
    (_, three), = load_grid(grid, Overrides(methods=["fedavg"], rounds=3))[0].cells()
    longest = finished_run(cell_directory(out, three), three)
    (longest.directory / "checkpoint.npz").unlink()
    extending = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "6", "--extend"],
                execute=extending) == 0
    (call,) = extending.calls
    assert json.loads((call[2] / "metrics.json").read_text())["config"]["num_server_rounds"] == 2


@pytest.mark.parametrize(("run_config", "differs"), [
    ({}, False),
    ({"fraction-train": 0.5}, True),
    ({"fraction-train": 0.5, "full-last-round": False}, False),
    ({"strategy": "pfedvem"}, False),  # every client trains every round (all-train)
    ({"strategy": "pfedvem", "vem-protocol": "sampled-train", "vem-sampling-rate": 0.5}, True),
    ({"strategy": "pfedvem", "vem-protocol": "sampled-train", "vem-sampling-rate": 1.0}, False),
])
def test_a_run_whose_last_round_trains_more_clients_than_a_longer_runs_is_not_extended(run_config, differs):
    from dataclasses import asdict

    from common.config import parse_run_config
    from experiments.runner import last_round_differs

    assert last_round_differs(asdict(parse_run_config(run_config))) is differs


def test_extend_says_why_it_starts_a_sampled_cell_from_round_1(tmp_path, capsys):
    grid, out = _grid(tmp_path), tmp_path / "out"
    sampled = ["--methods", "fedavg", "--set", "fraction-train=0.5"]
    assert main([str(grid), "--out", str(out), *sampled], execute=FakeSimulation()) == 0
    capsys.readouterr()
    longer = FakeSimulation()
    assert main([str(grid), "--out", str(out), *sampled, "--rounds", "4", "--extend"], execute=longer) == 0
    assert longer.calls[0][2] is None
    assert "not extending a shorter run: its last round trained every client" in capsys.readouterr().out


def test_the_time_left_counts_only_the_rounds_a_cell_will_train(tmp_path):
    from experiments.runner import _head_start

    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--methods", "fedavg", "--rounds", "3"], execute=FakeSimulation()) == 0
    (_, cell), = load_grid(grid, Overrides(methods=["fedavg"], rounds=8))[0].cells()
    assert _head_start(out, cell, extend=True) == 3  # continues the 3-round run
    assert _head_start(out, cell, extend=False) == 0
    _fake_run(cell, cell_directory(out, cell), [0.5] * 5, finished=False)
    assert _head_start(out, cell, extend=True) == 5  # its own stopped run first


def test_a_second_runner_in_the_same_output_folder_is_refused(tmp_path, capsys):
    import fcntl

    grid, out = _grid(tmp_path), tmp_path / "out"
    out.mkdir()
    with open(out / ".runner.lock", "a+b") as held:
        fcntl.flock(held, fcntl.LOCK_EX)  # as the first runner holds it
        second = FakeSimulation()
        assert main([str(grid), "--out", str(out)], execute=second) == 2
        assert second.calls == []
        assert f"another fedpac-experiments runs in {out.resolve()}" in capsys.readouterr().err
    assert main([str(grid), "--out", str(out)], execute=FakeSimulation()) == 0  # once it has ended


@pytest.mark.parametrize(("argv", "fragment"), [
    (["--seeds", "0,0"], "--seeds must be a non-empty list of distinct integers"),
    (["--seeds", ""], "--seeds must be a non-empty list of distinct integers"),
    (["--settings", "s20"], "--settings: s20 in none of the selected experiments"),
    (["--methods", "local"], "--methods: local in none of the selected experiments"),
    (["--rounds", "0"], "--rounds must be >= 1, got 0"),
])
def test_a_selection_that_would_miscount_or_select_nothing_fails_and_leaves_the_reports(tmp_path, capsys, argv,
                                                                                         fragment):
    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--seeds", "0,1"], execute=FakeSimulation()) == 0
    report = (out / "tiny" / "summary.csv").read_bytes()
    capsys.readouterr()
    nothing = FakeSimulation()
    assert main([str(grid), "--out", str(out), *argv], execute=nothing) == 2
    assert fragment in capsys.readouterr().err and nothing.calls == []
    assert main([str(grid), "--out", str(out), "--report-only", *argv]) == 2
    assert (out / "tiny" / "summary.csv").read_bytes() == report


def test_seeds_are_averaged_round_by_round_when_one_missed_an_evaluation(tmp_path):
    from experiments.runs import RunOutputs
    from experiments.summary import seed_curves

    grid = _grid(tmp_path)
    (experiment,) = load_grid(grid, Overrides(seeds=[0, 1], rounds=3))
    setting = experiment.settings[0]

    def run(accuracies):
        rounds = [{"round": n, "mean_accuracy": a, "accuracy": {"0": a} if a is not None else {}}
                  for n, a in enumerate(accuracies, start=1)]
        return RunOutputs(tmp_path, {}, rounds, 0.0)

    results = {(setting.name, "fedavg", 0): run([0.5, 0.6, 0.7]), (setting.name, "fedavg", 1): run([None, 0.6, 0.7])}
    rounds, values = seed_curves(results, setting, "fedavg")
    assert rounds == [2, 3]  # round 1 has one seed's value only: left out, nothing shifted
    np.testing.assert_allclose(values, [[60.0, 70.0], [60.0, 70.0]])
    assert seed_curves({}, setting, "fedavg") is None


def test_cells_written_before_the_config_grew_are_still_found(tmp_path, capsys):
    """A run config stored without fields added since (at their defaults) is the same cell."""
    grid, out = _grid(tmp_path), tmp_path / "out"
    (experiment,) = load_grid(grid, Overrides())
    cell = next(c for _, c in experiment.cells() if c.method == "fedpac")
    legacy = out / "cells" / f"{cell.method}-{cell.clients}c-seed{cell.seed}-0123456789"
    run = _fake_run(cell, legacy, [0.9, 0.9])
    document = json.loads((run / "metrics.json").read_text())
    for added in ("normalize_mean", "normalize_std", "save_model_every", "fedrep_body_epochs"):
        document["config"].pop(added, None)
    (run / "metrics.json").write_text(json.dumps(document))
    old_identity = {**cell.identity, "config": dict(document["config"])}
    (legacy / "cell.json").write_text(json.dumps({"method": cell.method, "clients": cell.clients,
                                                  "identity": old_identity}))
    # found before the runner renames it: by --dry-run and --report-only too
    assert main([str(grid), "--out", str(out), "--methods", "fedpac", "--dry-run"]) == 0
    assert capsys.readouterr().out.rstrip().endswith("fedpac | seed 0: 3 clients, 2 rounds: finished")
    assert main([str(grid), "--out", str(out), "--methods", "fedpac", "--report-only"]) == 0
    assert "fedpac" in (out / experiment.name / "summary.csv").read_text()
    assert legacy.exists()
    nothing = FakeSimulation()
    assert main([str(grid), "--out", str(out), "--methods", "fedpac"], execute=nothing) == 0
    assert nothing.calls == [] and not legacy.exists() and cell_directory(out, cell).is_dir()


def test_where_the_data_lies_and_how_long_a_round_may_wait_are_not_what_a_cell_computes():
    def key(**run_config):
        return Cell("fedpac", 4, 0, 3, {"strategy": "fedpac", "seed": 0, "num-server-rounds": 3, **run_config}).key

    assert key() == key(**{"data-dir": "/data/fmnist"}) == key(**{"data-dir": "/mnt/f", "round-timeout": 60.0})
    assert key() != key(**{"local-epochs": 2})
    # a Hugging Face dataset saved to disk without a repository name is named by its folder
    by_folder = {"dataset": "hf", "num-classes": 10}
    assert key(**by_folder, **{"data-dir": "/a"}) != key(**by_folder, **{"data-dir": "/b"})
    by_repo = {**by_folder, "hf-repo": "user/set"}
    assert key(**by_repo, **{"data-dir": "/a"}) == key(**by_repo, **{"data-dir": "/b"})


def test_fedrep_runs_from_before_fedrep_body_epochs_are_not_fedreps_new_default():
    from experiments.grid import same_computation
    from common.config import FedPACConfig

    def stored(config):  # as a run's metrics.json holds it (the method settings' pairs as lists)
        return json.loads(json.dumps(config))

    current = {k: v for k, v in asdict(FedPACConfig(strategy="fedrep")).items()}
    old = stored({k: v for k, v in current.items() if k != "fedrep_body_epochs"})  # trained the body E = 5 epochs
    assert not same_computation(old, current)
    assert same_computation(old, {**current, "fedrep_body_epochs": 5})
    fedpac = {k: v for k, v in asdict(FedPACConfig()).items()}
    assert same_computation(stored({k: v for k, v in fedpac.items() if k != "fedrep_body_epochs"}), fedpac)


def test_report_has_mean_and_std_over_seeds_the_paper_value_and_plots(tmp_path, rendered_charts):
    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--seeds", "0,1"], execute=FakeSimulation()) == 0
    report = out / "tiny"
    rows = list(csv.DictReader((report / "summary.csv").open()))
    assert list(rows[0]) == ["method", "setting", "clients", "rounds", "seeds", "mean", "std"]
    by_method = {r["method"]: r for r in rows}
    # fedavg: 80 and 82 (%) -> mean 81, sample std sqrt(2) ; fedpac: 90 and 92
    assert float(by_method["fedavg"]["mean"]) == pytest.approx(81.0)
    assert float(by_method["fedavg"]["std"]) == pytest.approx(math.sqrt(2), abs=1e-4)
    assert float(by_method["fedpac"]["mean"]) == pytest.approx(91.0)
    assert by_method["fedpac"]["clients"] == "3" and by_method["fedpac"]["rounds"] == "2"
    assert by_method["fedpac"]["seeds"] == "2" and by_method["fedpac"]["setting"] == "s-20"
    table = (report / "table.md").read_text()
    assert "| fedpac | 91.00 ± 1.41 (n=2) (91.83) |" in table and "| fedavg | 81.00 ± 1.41 (n=2) |" in table
    assert "Compute: 4 of 4 cells finished, their rounds took 4.0 min." in table  # 4 cells x 2 rounds x 30 s
    curves = list(csv.DictReader((report / "curves.csv").open()))
    assert [(r["method"], r["round"], r["seeds"]) for r in curves] == [
        ("fedavg", "1", "2"), ("fedavg", "2", "2"), ("fedpac", "1", "2"), ("fedpac", "2", "2")]
    assert all(float(r["mean"]) == pytest.approx(81.0 if r["method"] == "fedavg" else 91.0) for r in curves)
    assert all(float(r["std"]) == pytest.approx(math.sqrt(2), abs=1e-4) for r in curves)
    assert (report / "accuracy.png").read_bytes().startswith(PNG_SIGNATURE)
    assert (report / "accuracy.png").stat().st_size > 2_000  # rendered, not the 8-byte stand-in
    with Image.open(report / "accuracy.png") as image:  # a report's line plot: 256 colours
        assert image.mode == "P" and len(image.getcolors(256) or []) > 4
    alphas = sorted(p.name for p in (report / "alpha").iterdir())
    assert alphas == ["s-20-fedpac-seed0-round1.png", "s-20-fedpac-seed0-round2.png"]  # FedAvg has none


def test_an_experiment_over_several_settings_plots_the_final_accuracy_against_the_setting(tmp_path, monkeypatch):
    from experiments import summary
    from experiments.summary import setting_lines, summary_rows

    text = TINY.replace('[experiments.tiny.settings.s-20]', """[experiments.tiny.settings.s-0]
run-config = { uniform-share = 0.0 }

[experiments.tiny.settings.s-80]
run-config = { uniform-share = 80.0 }

[experiments.tiny.settings.s-20]""")
    grid, out = _grid(tmp_path, text), tmp_path / "out"
    # FedPAC's s-80 cells are missing: its line has the settings it has, in the grid's order
    assert main([str(grid), "--out", str(out), "--seeds", "0,1", "--settings", "s-0,s-20"],
                execute=FakeSimulation()) == 0
    assert main([str(grid), "--out", str(out), "--seeds", "0", "--settings", "s-80", "--methods", "fedavg"],
                execute=FakeSimulation()) == 0
    (experiment,) = load_grid(grid, Overrides(seeds=[0, 1]))
    lines = setting_lines(experiment, summary_rows(experiment, results_of(experiment, out)))
    # the settings in the grid file's order: s-0, s-80, s-20
    np.testing.assert_allclose(lines["fedavg"], [[0, 81.0, math.sqrt(2)], [1, 80.0, 0.0], [2, 81.0, math.sqrt(2)]])
    np.testing.assert_allclose(lines["fedpac"], [[0, 91.0, math.sqrt(2)], [2, 91.0, math.sqrt(2)]])
    assert (out / "tiny" / "by-setting.png").stat().st_size > 0
    figures = []
    monkeypatch.setattr(summary, "save_figure", lambda fig, path, palette=False: figures.append(fig))
    summary.plot_by_setting(experiment, summary_rows(experiment, results_of(experiment, out)), tmp_path / "x.png")
    fedavg, fedpac = (line.get_ydata() for line in figures[0].axes[0].lines if line.get_marker() == "o")
    np.testing.assert_allclose(fedavg, [81.0, 80.0, 81.0])
    np.testing.assert_allclose(fedpac, [91.0, np.nan, 91.0])  # no segment through the s-80 it lacks
    # one setting: no such chart
    (tmp_path / "one").mkdir()
    assert main([str(_grid(tmp_path / "one")), "--out", str(tmp_path / "one-out")], execute=FakeSimulation()) == 0
    assert not (tmp_path / "one-out" / "tiny" / "by-setting.png").exists()


def test_a_setting_without_a_finished_run_says_so_in_the_accuracy_chart(tmp_path, monkeypatch):
    from experiments import summary

    text = TINY.replace('[experiments.tiny.settings.s-20]', """[experiments.tiny.settings.s-80]
run-config = { uniform-share = 80.0 }

[experiments.tiny.settings.s-20]""")
    grid, out = _grid(tmp_path, text), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--seeds", "0", "--settings", "s-20"], execute=FakeSimulation()) == 0
    (experiment,) = load_grid(grid, Overrides(seeds=[0]))
    figures = []
    monkeypatch.setattr(summary, "save_figure", lambda fig, path, palette=False: figures.append(fig))
    summary.plot_accuracy(experiment, results_of(experiment, out), tmp_path / "accuracy.png")
    (figure,) = figures
    queued, finished = figure.axes  # the grid file's order: s-80, then s-20
    assert not queued.lines and [t.get_text() for t in queued.texts] == ["no finished run yet"]
    assert len(finished.lines) == 2 and not finished.texts  # FedAvg and FedPAC, no placeholder


class GeneralizedSimulation(FakeSimulation):
    """Finishes cells with a generalized accuracy 10 points below the personalized one, measured
    in round 1 and the last round (``generalized-every`` = 1 would measure every round)."""

    def __init__(self, last_round=True):
        super().__init__()
        self.last_round = last_round

    def __call__(self, cell, directory, resume_from, log_path):
        self.calls.append((cell.method, cell.seed, resume_from))
        log_path.write_text("simulated\n")
        accuracy = {"fedavg": 0.80, "fedpac": 0.90, "ditto": 0.85}[cell.method] + 0.02 * cell.seed
        rounds = [1, cell.rounds] if self.last_round else [1]
        _fake_run(cell, directory, [accuracy] * cell.rounds, name=f"run-{len(self.calls)}",
                  generalized={r: accuracy - 0.10 - 0.01 * r for r in rounds})
        return 0


def test_a_generalized_experiment_reports_the_last_rounds_generalized_accuracy(tmp_path, capsys):
    from experiments.summary import drift_rounds

    text = TINY.replace("rounds = 2", 'rounds = 3\nmetric = "generalized"').replace(
        "batch-size = 20", "batch-size = 20\ndrift = \"sudden\"\ndrift-rounds = \"1\"\ngeneralized-every = 2")
    grid, out = _grid(tmp_path, text), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--seeds", "0,1"], execute=GeneralizedSimulation()) == 0
    log = capsys.readouterr().out
    # fedavg seed 0: personalized 80 %, generalized in the last round 80 - 10 - 3 = 67 %
    assert "tiny/s-20 | fedavg | seed 0: done in" in log
    assert "final accuracy 67.00% generalized, 80.00% personalized" in log
    report = out / "tiny"
    rows = {r["method"]: r for r in csv.DictReader((report / "summary.csv").open())}
    assert list(rows["fedavg"]) == ["method", "setting", "clients", "rounds", "seeds", "mean", "std",
                                    "personalized_mean", "personalized_std"]
    assert float(rows["fedavg"]["mean"]) == pytest.approx(68.0)  # 67 and 69
    assert float(rows["fedpac"]["mean"]) == pytest.approx(78.0)
    assert float(rows["fedpac"]["std"]) == pytest.approx(math.sqrt(2), abs=1e-4)
    assert float(rows["fedpac"]["personalized_mean"]) == pytest.approx(91.0)
    table = (report / "table.md").read_text()
    assert "Final mean generalized test accuracy (%)" in table
    assert "| fedpac | 78.00 ± 1.41 (n=2) (91.83) |" in table  # the paper's value next to ours
    assert "final mean personalized test accuracy (%)" in table and "| fedpac | 91.00 ± 1.41 (n=2) |" in table
    generalized = list(csv.DictReader((report / "curves-generalized.csv").open()))
    assert [(r["method"], r["round"]) for r in generalized] == [
        ("fedavg", "1"), ("fedavg", "3"), ("fedpac", "1"), ("fedpac", "3")]
    assert (report / "accuracy.png").stat().st_size > 0
    (experiment,) = load_grid(grid)
    assert drift_rounds(experiment.settings[0]) == (2,)  # a drift at 1 (0-based): from round 2

    # a last round without the generalized accuracy is blank, not its personalized accuracy
    again = tmp_path / "again"
    assert main([str(grid), "--out", str(again), "--methods", "fedavg"],
                execute=GeneralizedSimulation(last_round=False)) == 0
    (row,) = csv.DictReader((again / "tiny" / "summary.csv").open())
    assert (row["mean"], row["std"], row["personalized_mean"]) == ("", "", "80.0")
    assert "| fedavg | n/a (n=1) |" in (again / "tiny" / "table.md").read_text()


def test_the_table_rounds_the_mean_once_as_the_log_does(tmp_path, capsys):
    class Rounding(FakeSimulation):  # an accuracy just under a half: 83.26499...
        def __call__(self, cell, directory, resume_from, log_path):
            log_path.write_text("simulated\n")
            _fake_run(cell, directory, [0.8326499968767166] * cell.rounds)  # a real run's
            return 0

    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--methods", "fedavg"], execute=Rounding()) == 0
    assert "final accuracy 83.26%" in capsys.readouterr().out
    assert "| fedavg | 83.26 (n=1) |" in (out / "tiny" / "table.md").read_text()
    (row,) = csv.DictReader((out / "tiny" / "summary.csv").open())
    assert row["mean"] == "83.265"  # 4 decimals in the csv; the table rounds the mean, not these


def test_a_personalized_experiment_ignores_the_generalized_accuracy(tmp_path):
    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out)], execute=GeneralizedSimulation()) == 0
    rows = list(csv.DictReader((out / "tiny" / "summary.csv").open()))
    assert list(rows[0]) == ["method", "setting", "clients", "rounds", "seeds", "mean", "std"]
    assert float(rows[0]["mean"]) == pytest.approx(80.0)
    assert "Final mean personalized test accuracy (%)" in (out / "tiny" / "table.md").read_text()
    assert not (out / "tiny" / "curves-generalized.csv").exists()


# ---------------------------------------------------------------------------- real simulations


@pytest.mark.e2e
def test_a_real_grid_resumes_without_redoing_finished_cells(tmp_path, capsys):
    grid, out = _grid(tmp_path), tmp_path / "out"
    assert main([str(grid), "--out", str(out), "--methods", "fedavg"]) == 0  # half the grid
    experiment = load_grid(grid)[0]
    fedavg, fedpac = (c for _, c in experiment.cells())
    fedavg_dir = cell_directory(out, fedavg)
    before = {p.name: p.stat().st_mtime_ns for p in fedavg_dir.rglob("*") if p.is_file()}
    first = finished_run(fedavg_dir, fedavg)
    assert first is not None and [r["round"] for r in first.rounds] == [1, 2]
    capsys.readouterr()

    assert main([str(grid), "--out", str(out)]) == 0  # the whole grid
    log = capsys.readouterr().out
    assert "[1/2] tiny/s-20 | fedavg | seed 0: finished before, skipped" in log
    assert "[2/2] tiny/s-20 | fedpac | seed 0: done in" in log
    after = {p.name: p.stat().st_mtime_ns for p in fedavg_dir.rglob("*") if p.is_file()}
    assert after == before  # the finished cell was not touched
    run = finished_run(cell_directory(out, fedpac), fedpac)
    assert run is not None and run.config["strategy"] == "fedpac" and len(run.rounds) == 2
    rows = {r["method"]: r for r in csv.DictReader((out / "tiny" / "summary.csv").open())}
    assert sorted(rows) == ["fedavg", "fedpac"]
    for method, cell_run in (("fedavg", first), ("fedpac", run)):
        assert float(rows[method]["mean"]) == pytest.approx(cell_run.final_accuracy, abs=1e-3)
        assert 0 < cell_run.final_accuracy <= 100
    assert sorted(p.name for p in (out / "tiny" / "alpha").iterdir()) == [
        "s-20-fedpac-seed0-round1.png", "s-20-fedpac-seed0-round2.png"]


def test_the_report_says_what_the_grid_computed_and_what_is_left(tmp_path):
    from experiments.runs import RunOutputs
    from experiments.summary import compute_line

    (experiment,) = load_grid(_grid(tmp_path), Overrides(seeds=[0, 1]))  # 2 methods x 2 seeds
    run = RunOutputs(tmp_path, {}, [{"round": 1, "seconds": 20.0}, {"round": 2, "seconds": 40.0}], 0.0)
    line = compute_line(experiment, {("s-20", "fedpac", 0): run})
    # 60 s for 2 rounds; 3 cells x 2 rounds left at 30 s a round
    # fedpac seed 1 at fedpac's 30 s a round; fedavg has no pace yet, so the setting's
    assert line == ("Compute: 1 of 4 cells finished, their rounds took 1.0 min; "
                    "the 3 cells left need about 3.0 min at the pace of their methods so far.")
    # fedpac seed 1 stopped after its first round: 5 rounds left, not 6
    assert "the 3 cells left need about 2.5 min" in compute_line(experiment, {("s-20", "fedpac", 0): run},
                                                                 trained={("s-20", "fedpac", 1): 1})


def test_cells_left_go_at_their_methods_pace_then_their_settings_then_all():
    from experiments.summary import seconds_left

    done = [("20c", "fedpac", 80.0, 10), ("20c", "pfedvem", 330.0, 10), ("100c", "fedpac", 300.0, 10)]
    assert seconds_left(done, [("20c", "pfedvem", 100)]) == pytest.approx(3300.0)  # its own pace
    assert seconds_left(done, [("20c", "fedpac", 5), ("100c", "fedpac", 5)]) == pytest.approx(40.0 + 150.0)
    # pFedVEM at 100 clients: pFedVEM's pace (its setting has only FedPAC's)
    assert seconds_left(done, [("100c", "pfedvem", 10)]) == pytest.approx(330.0)
    assert seconds_left(done, [("100c", "local", 10)]) == pytest.approx(300.0)  # the setting's
    assert seconds_left(done, [("50c", "local", 3)]) == pytest.approx(3 * 710.0 / 30)  # everything's
    assert seconds_left(done, []) == 0.0
    assert math.isnan(seconds_left([], [("20c", "fedpac", 1)]))


def test_a_stalled_run_is_not_continued_the_run_before_it_is(tmp_path, capsys):
    # A run that stopped because its federation stalled (here: its rounds 2 and 3 without
    # training replies) has those rounds in its checkpoint: the cell goes on from the run before.
    grid, out = _grid(tmp_path), tmp_path / "out"
    args = [str(grid), "--out", str(out), "--seeds", "0", "--methods", "fedavg", "--rounds", "4"]
    cell = next(c for _, c in load_grid(grid, Overrides(seeds=[0], methods=["fedavg"], rounds=4))[0].cells())
    directory = cell_directory(out, cell)
    clean = _fake_run(cell, directory, [0.5], finished=False, name="run-clean")
    stalled = _fake_run(cell, directory, [0.5, 0.6, 0.6], finished=False, name="run-stalled")
    (stalled / "status.json").write_text(json.dumps({
        "state": "failed", "completed_rounds": 3,
        "error": "FederationStalled: Round 4: 0 valid training replies, fewer than min-train-replies = 1"}))
    os.utime(clean / "metrics.json", (1, 1))  # the clean run is the older one
    simulation = FakeSimulation()
    assert main(args, execute=simulation) == 0
    assert simulation.calls == [("fedavg", 0, clean)]
    log = capsys.readouterr().out
    assert "not continuing the stalled run run-stalled" in log and "resuming after round 1/4 from run-clean" in log

    # a stalled run with no clean run before it: the cell starts over
    other = tmp_path / "other"
    stalled_only = _fake_run(cell, cell_directory(other, cell), [0.5, 0.6], finished=False, name="run-stalled")
    (stalled_only / "status.json").write_text((stalled / "status.json").read_text())
    simulation = FakeSimulation()
    assert main([str(grid), "--out", str(other), *args[3:]], execute=simulation) == 0
    assert simulation.calls == [("fedavg", 0, None)]


def test_an_archived_grid_continues_on_another_machine_where_it_stopped(tmp_path, capsys):
    """``experiments.archive``: what a grid in progress needs to go on elsewhere, and no more."""
    grid, out = _grid(tmp_path), tmp_path / "machine-1" / "grid"
    here = ["--set", f"data-dir={tmp_path / 'machine-1' / 'data'}"]
    assert main([str(grid), "--out", str(out), "--seeds", "0", *here], execute=FakeSimulation(crash={"fedpac"})) == 1
    overrides = Overrides(seeds=[0], run_config=dict([parse_assignment(here[1])]))
    fedavg, fedpac = (c for _, c in load_grid(grid, overrides)[0].cells())
    finished = finished_run(cell_directory(out, fedavg), fedavg)
    stopped = resumable_run(cell_directory(out, fedpac), fedpac)
    assert finished is not None and stopped is not None
    (finished.directory / "accuracy.png").write_bytes(b"chart")
    # a newer run of the stopped cell stalled: the runner would go on from the one before it
    stalled = _fake_run(fedpac, cell_directory(out, fedpac), [0.5], finished=False, name="run-9")
    (stalled / "status.json").write_text(json.dumps({"state": "failed", "error": "FederationStalled: ..."}))
    os.utime(stopped.directory / "metrics.json", (1, 1))
    # a run of the finished cell stopped before the one that finished it: nothing continues it
    superseded = _fake_run(fedavg, cell_directory(out, fedavg), [0.5], finished=False, name="run-0")
    os.utime(superseded / "metrics.json", (1, 1))
    (stopped.directory / ".metrics.json.tmp").write_bytes(b'{"rounds": [')  # a write in progress

    archived = archive_grid(out, tmp_path / "state", full_rounds=2)
    assert [a.name for a in archived.archives] == sorted(f"{c.key}.tgz" for c in (fedavg, fedpac))
    names = set()
    for cell_archive in archived.archives:
        with tarfile.open(cell_archive) as archive:
            names |= set(archive.getnames())
            # the "data" filter (Python 3.11.4+; Debian 12's Python is 3.11.2) refuses links and
            # paths out of the folder; the archive is this test's own
            safe = {"filter": "data"} if hasattr(tarfile, "data_filter") else {}
            archive.extractall(tmp_path / "machine-2", **safe)
    in_archive = {p.relative_to(out.parent).as_posix() for p in out.rglob("*") if p.is_file()} & names
    assert not any(name.endswith((".png", ".tmp")) for name in names)
    assert {name.rsplit("/", 1)[-1] for name in in_archive if name.startswith(
        finished.directory.relative_to(out.parent).as_posix())} == {"metrics.json", "status.json"}
    for kept in (stopped.directory, stalled):  # the run to resume, with its checkpoint, and the newest
        assert (kept.relative_to(out.parent) / "checkpoint.npz").as_posix() in names
    assert not any(name.startswith(superseded.relative_to(out.parent).as_posix()) for name in names)

    capsys.readouterr()
    elsewhere = FakeSimulation()  # which keeps its data in another folder and waits longer for a round
    there = ["--set", f"data-dir={tmp_path / 'machine-2' / 'data'}", "--set", "round-timeout=7200"]
    assert main([str(grid), "--out", str(tmp_path / "machine-2" / "grid"), "--seeds", "0", *there],
                execute=elsewhere) == 0
    assert [(method, resume_from.name if resume_from else None) for method, _, resume_from in elsewhere.calls] == [
        ("fedpac", stopped.directory.name)]
    assert "fedavg | seed 0: finished before, skipped" in capsys.readouterr().out


def test_a_grown_grid_rewrites_only_the_archives_of_the_cells_that_moved(tmp_path, monkeypatch):
    """Archives are committed as a grid grows: an unchanged cell's archive keeps its bytes."""
    grid, out, state = _grid(tmp_path), tmp_path / "grid", tmp_path / "state"
    assert main([str(grid), "--out", str(out), "--seeds", "0"], execute=FakeSimulation(crash={"fedpac"})) == 1
    fedavg, fedpac = (c for _, c in load_grid(grid, Overrides(seeds=[0]))[0].cells())
    first = archive_grid(out, state, full_rounds=2)
    assert first.changed == first.archives and first.orphans == []
    before = {path.name: path.read_bytes() for path in first.archives}

    with monkeypatch.context() as later:  # an archive made at another time, same bytes
        later.setattr(time, "time", lambda: 2e9)
        assert archive_grid(out, state, full_rounds=2).changed == []
    assert main([str(grid), "--out", str(out), "--seeds", "0"], execute=FakeSimulation()) == 0
    stray = state / "fedper-20c-seed0-0000000000.tgz"
    stray.write_bytes(b"a cell this grid no longer has")
    second = archive_grid(out, state, full_rounds=2)
    assert [path.name for path in second.changed] == [f"{fedpac.key}.tgz"]
    assert (state / f"{fedavg.key}.tgz").read_bytes() == before[f"{fedavg.key}.tgz"]
    assert (state / f"{fedpac.key}.tgz").read_bytes() != before[f"{fedpac.key}.tgz"]
    assert second.orphans == [stray] and stray.exists()  # reported, never deleted
    assert not list(state.glob("*.partial"))


_STOPPABLE_RUNNER = """
import os, signal, subprocess, sys
from experiments import runner

real_popen = subprocess.Popen
CELL = ("import os, signal, time\\n"
        "if os.environ['CELL_IGNORES_SIGINT'] == '1': signal.signal(signal.SIGINT, signal.SIG_IGN)\\n"
        "open(os.environ['CELL_PID_FILE'], 'w').write(str(os.getpid())); time.sleep(600)")

def popen(command, **kwargs):  # runner.simulate itself, its simulation swapped for a long sleep
    if command[1:3] != ["-m", "experiments.simulation"]:
        return real_popen(command, **kwargs)
    process = real_popen([sys.executable, "-c", CELL], **kwargs)
    if os.environ["STOP_WHILE_STARTING"] == "1":  # the stop comes before Popen has returned
        open(os.environ["CELL_PID_FILE"], "w").write(str(process.pid))
        os.kill(os.getpid(), signal.SIGTERM)
    return process

runner.subprocess.Popen = popen
sys.exit(runner.main(sys.argv[1:]))
"""


@pytest.mark.parametrize(("stop", "while_starting", "repeated"),
                         [(signal.SIGTERM, False, False), (signal.SIGINT, False, False), (signal.SIGTERM, True, False),
                          (signal.SIGTERM, False, True)])
@pytest.mark.e2e  # the runner in a process of its own
def test_a_runner_started_in_the_background_stops_its_cell_on_sigterm_and_sigint(tmp_path, stop, while_starting,
                                                                                 repeated):
    # A script's background command inherits SIGINT ignored; before, SIGINT did nothing there and
    # SIGTERM ended the runner but left its cell's simulation running. The runner runs as it is,
    # runner.simulate included, with a long sleep in place of the simulation. ``repeated``: a cell
    # slow to end on SIGINT and a second stop while the runner waits for it; before, the second
    # stop ended the runner at once and left the cell running.
    pid_file = tmp_path / "cell.pid"
    runner = subprocess.Popen(
        [sys.executable, "-c", _STOPPABLE_RUNNER, str(_grid(tmp_path)), "--out", str(tmp_path / "out"),
         "--seeds", "0", "--methods", "fedavg"],
        cwd=Path(__file__).resolve().parents[1], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "CELL_PID_FILE": str(pid_file), "STOP_WHILE_STARTING": str(int(while_starting)),
             "CELL_IGNORES_SIGINT": str(int(repeated))},
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))  # noqa: PLW1509  # single-threaded here
    cell = None
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):  # the cell runs (or is being started)
            assert runner.poll() is None or while_starting, runner.stderr.read()
            assert time.monotonic() < deadline, runner.stderr.read()
            time.sleep(0.02)
        cell = int(pid_file.read_text())
        if not while_starting:
            runner.send_signal(stop)
        if repeated:
            time.sleep(1.0)
            assert runner.poll() is None  # still waiting for its cell, which ignores SIGINT
            runner.send_signal(stop)
        assert runner.wait(timeout=60) == 130
        # the runner waits for its cell's process group to end before it exits
        with pytest.raises(ProcessLookupError):
            os.kill(cell, 0)
        assert "interrupted" in runner.stderr.read()
    finally:
        runner.kill()
        if cell is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(cell, signal.SIGKILL)


def test_every_method_of_a_crowded_table_has_its_own_colour_in_every_panel():
    from experiments.summary import method_colors

    table1 = ["local", "fedavg", "fedavg-ft", "fedper", "lg-fedavg", "fedrep", "apfl", "pfedme", "ditto",
              "fedbabu", "fedrod", "knn-per", "fedfomo", "pfedhn", "fedpac"]
    colors = method_colors(table1)
    assert len(set(colors.values())) == len(table1)  # the default cycle repeats after ten
    assert method_colors(table1) == colors  # the same colours wherever the table is drawn
    few = method_colors(["fedavg", "fedpac"])
    assert len(set(few.values())) == 2 and few != {m: colors[m] for m in few}  # few methods: tab10
