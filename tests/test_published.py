"""experiments.published: a table's report redrawn from the runs published in the repository."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from experiments.grid import Overrides, load_grid
from experiments.published import main, published_results, read_published_run

GRID = Path("experiments/grids/fmnist-paper.toml")
# a published rounds.csv's columns (server_app.report's round table)
COLUMNS = ("round", "mean_accuracy", "min_accuracy", "max_accuracy", "num_evaluated", "num_trained",
           "mean_train_loss", "qp_fallbacks", "centroid_classes", "bytes_sent", "bytes_received", "seconds")


def _publish(folder: Path, accuracies: list[float], skip_round: int | None = None) -> Path:
    """A published run: rounds.csv (round r at accuracies[r - 1]) and config.json."""
    folder.mkdir(parents=True)
    with open(folder / "rounds.csv", "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(COLUMNS)
        for number, accuracy in enumerate(accuracies, start=1):
            # a round without evaluation replies: the report writes nan and blank fields
            mean = "nan" if number == skip_round else accuracy
            writer.writerow([number, mean, "", "", 20, 20, 0.5, 0, 10, 1000, 1000, 6.0])
    (folder / "config.json").write_text(json.dumps({"num_server_rounds": len(accuracies)}))
    return folder


def _table1(**overrides):
    return load_grid(GRID, Overrides(experiments=["table1"], **overrides))[0]


def test_a_table_is_redrawn_from_runs_published_in_several_folders(tmp_path, capsys, rendered_charts):
    twenty, hundred = tmp_path / "table1-200-rounds", tmp_path / "table1-100-clients"
    _publish(twenty / "fedpac-seed0", [0.5] * 199 + [0.92], skip_round=7)
    _publish(twenty / "fedpac-seed1", [0.5] * 199 + [0.90])
    _publish(twenty / "fedavg-seed0", [0.8] * 150)  # stopped short: another cell, left out
    (twenty / "fedper-seed0").mkdir()  # nothing in it
    _publish(hundred / "fedpac-seed0", [0.6] * 199 + [0.93])
    out = tmp_path / "report"
    code = main([str(GRID), "--experiment", "table1", "--setting", f"20-clients={twenty}",
                 "--setting", f"100-clients={hundred}", "--out", str(out)])
    assert code == 0
    table = (out / "table.md").read_text()
    assert "| fedpac | 91.00 ± 1.41 (n=2) (91.83) | 93.00 (n=1) (92.72) |" in table
    assert "| fedavg | – (85.28) | – (86.89) |" in table
    with open(out / "summary.csv", newline="") as handle:
        summary = {(r["setting"], r["method"]): r for r in csv.DictReader(handle)}
    assert set(summary) == {("20-clients", "fedpac"), ("100-clients", "fedpac")}
    assert summary[("20-clients", "fedpac")]["seeds"] == "2"
    with open(out / "curves.csv", newline="") as handle:
        curve = [r for r in csv.DictReader(handle) if r["setting"] == "20-clients"]
    # every round both seeds measured (round 7 of seed 0 did not), mean over the two
    assert [int(r["round"]) for r in curve] == [n for n in range(1, 201) if n != 7]
    assert float(curve[-1]["mean"]) == pytest.approx(91.0) and curve[-1]["seeds"] == "2"
    assert (out / "accuracy.png").stat().st_size > 2_000  # rendered, not the 8-byte stand-in
    assert (out / "by-setting.png").is_file()
    errors = capsys.readouterr().err
    assert "fedavg-seed0: ends at round 150, not 200" in errors
    assert "fedper-seed0: no readable rounds.csv" in errors


def test_only_the_seeds_asked_for_are_read(tmp_path):
    _publish(tmp_path / "fedpac-seed0", [0.9] * 200)
    _publish(tmp_path / "fedpac-seed2", [0.8] * 200)
    results, skipped = published_results(_table1(seeds=[2], settings=["20-clients"]), {"20-clients": tmp_path})
    assert list(results) == [("20-clients", "fedpac", 2)] and not skipped
    assert results[("20-clients", "fedpac", 2)].final_accuracy == pytest.approx(80.0)


def test_runs_of_another_length_are_read_with_rounds(tmp_path, capsys):
    _publish(tmp_path / "fedpac-seed0", [0.9] * 20)
    out = tmp_path / "report"
    arguments = [str(GRID), "--experiment", "table1", "--setting", f"20-clients={tmp_path}", "--out", str(out)]
    assert main(arguments) == 1  # the grid's 200 rounds: none
    assert "ends at round 20, not 200" in capsys.readouterr().err
    assert main([*arguments, "--rounds", "20"]) == 0
    assert "after 20 rounds" in (out / "table.md").read_text()
    assert main([*arguments, "--rounds", "0"]) == 2 and "--rounds must be >= 1" in capsys.readouterr().err


def test_a_folder_that_is_no_rounds_table_is_unreadable_not_a_crash(tmp_path):
    folder = tmp_path / "fedpac-seed0"
    folder.mkdir()
    (folder / "rounds.csv").write_text("round,loss\nfirst,1\n")
    assert read_published_run(folder) is None
    (folder / "rounds.csv").write_text("round,loss\n1,0.5\n")  # no accuracy column
    assert read_published_run(folder) is None


@pytest.mark.parametrize("arguments,message", [
    (["--setting", "20-clients"], "SETTING=FOLDER"),
    (["--setting", "20-clients=/does/not/exist"], "is not a folder"),
    (["--setting", "40-clients={tmp}"], "40-clients"),
    (["--setting", "20-clients={tmp}", "--seeds", "0,one"], "--seeds expects integers"),
])
def test_bad_arguments_say_what_is_wrong(tmp_path, capsys, arguments, message):
    arguments = [a.replace("{tmp}", str(tmp_path)) for a in arguments]
    assert main([str(GRID), "--experiment", "table1", *arguments, "--out", str(tmp_path / "r")]) == 2
    assert message in capsys.readouterr().err


def test_no_published_run_is_an_error_and_writes_nothing(tmp_path, capsys):
    out = tmp_path / "report"
    assert main([str(GRID), "--experiment", "table1", "--setting", f"20-clients={tmp_path}",
                 "--out", str(out)]) == 1
    assert "no run of table1 at 200 rounds" in capsys.readouterr().err
    assert not out.exists()
