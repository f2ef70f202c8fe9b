"""Archive a grid in progress, so that it continues on another machine: ``python -m experiments.archive``.

The paper-length grids run for days on machines that do not last as long. The archive holds,
for every cell of the grid folder, its ``cell.json`` and ``cell.log``, its newest run folder (a
resumed run's folder carries the whole history) and, when that is an older one, the run the
runner would resume from; no charts (the runner redraws them), and no checkpoint or final state
of a run that reached the grid's full length (nothing continues it). Unpacked where the grid's
``--out`` points, the runner skips the finished cells and resumes the stopped one from its
checkpoint (``experiments/state/README.md``).

    python -m experiments.archive /work/grid/fmnist-paper experiments/state/fmnist-paper.tgz
"""

from __future__ import annotations

import argparse
import tarfile
from pathlib import Path

from experiments.summary import RunOutputs, read_run

# Written by the ServerApp; only a run that may still be continued needs them.
RESUME_FILES = frozenset({"checkpoint.npz", "final_state.npz"})


def runs_to_keep(cell: Path) -> list[RunOutputs]:
    """The cell's newest run (its history) and, when that one is not it, the run the runner
    would resume from (a newer run that stalled is not continued: ``summary.resume_point``);
    a stopped run older than a finished one is continued by nothing."""
    runs = sorted((r for r in map(read_run, (d for d in cell.iterdir() if d.is_dir())) if r is not None),
                  key=lambda run: run.written)
    last_finished = max((run.written for run in runs if run.finished), default=float("-inf"))
    partial = [r for r in runs if r.continuable and r.written > last_finished]
    keep = {run.directory: run for run in (runs[-1:] + partial[-1:])}
    return sorted(keep.values(), key=lambda run: run.written)


def files_to_archive(grid: Path, full_rounds: int) -> list[Path]:
    """The files of ``grid`` that the archive holds, in a stable order."""
    files: list[Path] = []
    for cell in sorted(path for path in (grid / "cells").iterdir() if path.is_dir()):
        files += sorted(path for path in cell.iterdir() if path.is_file() and path.suffix != ".png")
        for run in runs_to_keep(cell):
            done = run.finished and run.completed_rounds >= full_rounds
            files += sorted(path for path in run.directory.iterdir()
                            if path.is_file() and path.suffix != ".png" and not (done and path.name in RESUME_FILES))
    return files


def archive_grid(grid: Path, destination: Path, full_rounds: int) -> list[Path]:
    """Write ``destination`` (a .tgz whose paths start with the grid folder's name); returns its files."""
    if not (grid / "cells").is_dir():
        raise FileNotFoundError(f"{grid} is not a grid folder (no cells/ in it)")
    files = files_to_archive(grid, full_rounds)
    partial = destination.with_name(destination.name + ".partial")
    with tarfile.open(partial, "w:gz") as archive:
        for path in files:
            archive.add(path, arcname=str(path.relative_to(grid.parent)), recursive=False)
    partial.replace(destination)  # an interrupted archive never replaces a good one
    return files


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the grid's output folder (the runner's --out)")
    parser.add_argument("destination", type=Path, help="the archive to write, e.g. experiments/state/NAME.tgz")
    parser.add_argument("--full-rounds", type=int, default=200,
                        help="rounds of a run that nothing continues (default: 200, the paper's)")
    args = parser.parse_args(argv)
    try:
        files = archive_grid(args.grid, args.destination, args.full_rounds)
    except OSError as error:  # not a grid folder, an unwritable destination: one line, no traceback
        parser.exit(1, f"experiments.archive: {error}\n")
    size = args.destination.stat().st_size / 2**20
    print(f"{args.destination}: {len(files)} files of {args.grid}, {size:.1f} MiB")


if __name__ == "__main__":
    main()
