"""An experiment's report redrawn from its published runs.

What the repository keeps of a finished run (``docs/results/...``) is its per-round table, not
its metrics.json (a round's alpha matrix makes that tens of MB at 100 clients): one folder per
method and seed, ``<method>-seed<k>/rounds.csv`` beside ``config.json``. The runs of one table
come from several grids and code versions (seed 0 first, the other seeds later, each grid frozen
at its own commit), so no single grid folder holds them all. This module reads the published
folders, one per setting, and writes the experiment's usual report from them
(:func:`experiments.summary.write_report`): ``summary.csv``, ``table.md`` next to the paper's
values, ``curves.csv`` and ``accuracy.png`` over every seed published at the grid's length (each
setting's, or ``--rounds``)::

    python -m experiments.published experiments/grids/fmnist-paper.toml --experiment table1 \\
        --setting 20-clients=docs/results/fmnist-paper/table1-200-rounds \\
        --setting 100-clients=docs/results/fmnist-paper/table1-100-clients \\
        --out docs/results/fmnist-paper/table1-200-rounds
"""

from __future__ import annotations

import argparse
import csv
import json
import math
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from experiments.grid import Experiment, GridError, Overrides, load_grid, parse_seeds
from experiments.runs import Results, RunOutputs
from experiments.summary import write_report


def _value(text: str) -> float | None:
    """A rounds.csv field: a number, or None where the round has none (an empty field)."""
    return float(text) if text.strip() else None


def read_published_run(folder: Path) -> RunOutputs | None:
    """A published run as the report reads it, or None without a readable ``rounds.csv``."""
    try:
        with open(folder / "rounds.csv", newline="") as handle:
            rows = list(csv.DictReader(handle))
        rounds: list[dict[str, Any]] = [
            {key: int(value) if key == "round" else _value(value) for key, value in row.items()} for row in rows
        ]
        written = (folder / "rounds.csv").stat().st_mtime
    except (OSError, ValueError, TypeError, AttributeError):  # missing, or not a rounds table
        return None
    if not rounds or any("mean_accuracy" not in r for r in rounds):
        return None
    try:
        config = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        config = {}
    return RunOutputs(folder, config if isinstance(config, dict) else {}, rounds, written, {"state": "finished"})


def published_results(experiment: Experiment, folders: Mapping[str, Path]) -> tuple[Results, list[str]]:
    """The runs published for ``experiment`` under ``folders`` (setting name -> folder of
    ``<method>-seed<k>``), by (setting, method, seed), and why any folder there was left out:
    unreadable, or stopped short of the experiment's rounds (a run of another length is
    another cell)."""
    results: Results = {}
    skipped = []
    for setting in experiment.settings:
        if setting.name not in folders:
            continue
        for method in experiment.methods:
            for seed in setting.seeds:
                folder = folders[setting.name] / f"{method}-seed{seed}"
                if not folder.is_dir():
                    continue
                run = read_published_run(folder)
                if run is None:
                    skipped.append(f"{folder}: no readable rounds.csv")
                elif run.rounds[-1]["round"] != setting.rounds:
                    skipped.append(f"{folder}: ends at round {run.rounds[-1]['round']}, not {setting.rounds}")
                else:
                    results[(setting.name, method, seed)] = run
    return results, skipped


def _folders(assignments: list[str]) -> dict[str, Path]:
    folders = {}
    for text in assignments:
        name, sep, path = text.partition("=")
        if not sep or not name.strip() or not path.strip():
            raise GridError(f"--setting expects SETTING=FOLDER, got {text!r}")
        if not Path(path).is_dir():
            raise GridError(f"--setting {name}: {path} is not a folder")
        folders[name.strip()] = Path(path)
    return folders


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="python -m experiments.published",
        description="Write an experiment's summary.csv, table.md, curves.csv and accuracy.png from "
                    "published runs (<method>-seed<k>/rounds.csv folders), one folder per setting.",
    )
    cli.add_argument("grid", type=Path, help="the grid file the runs come from")
    cli.add_argument("--experiment", required=True, help="the experiment, e.g. table1")
    cli.add_argument("--setting", action="append", required=True, metavar="SETTING=FOLDER",
                     help="where a setting's runs are published (repeatable)")
    cli.add_argument("--seeds", help="seeds to look for, instead of the grid's, e.g. 0,1,2")
    cli.add_argument("--rounds", type=int, help="the runs' length, instead of each setting's in the grid")
    cli.add_argument("--out", type=Path, required=True, help="folder to write the report to")
    return cli


def main(argv: list[str] | None = None) -> int:
    """Returns 0 with a report written, 1 when no published run was found, 2 on bad arguments."""
    args = parser().parse_args(argv)
    try:
        folders = _folders(args.setting)
        experiments = load_grid(args.grid, Overrides(rounds=args.rounds, seeds=parse_seeds(args.seeds),
                                                     experiments=[args.experiment], settings=sorted(folders)))
    except GridError as err:
        print(f"experiments.published: {err}", file=sys.stderr)
        return 2
    experiment = experiments[0]
    results, skipped = published_results(experiment, folders)
    for reason in skipped:
        print(f"left out {reason}", file=sys.stderr)
    if not results:
        rounds = " or ".join(str(r) for r in sorted({s.rounds for s in experiment.settings}))
        print(f"experiments.published: no run of {experiment.name} at {rounds} rounds under "
              f"{', '.join(map(str, folders.values()))}", file=sys.stderr)
        return 1
    rows = write_report(experiment, results, args.out)
    for row in rows:
        spread = "" if math.isnan(row["std"]) else f" ± {row['std']:.2f}"
        print(f"{row['setting']} {row['method']}: {row['mean']:.2f}{spread} (seeds: {row['seeds']})")
    print(f"report in {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
