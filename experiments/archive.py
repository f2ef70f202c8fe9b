"""Archive a grid in progress, so that it continues on another machine: ``python -m experiments.archive``.

The paper-length grids run for days, longer than some machines last. The archive is a folder
with one ``.tgz`` per cell, each byte-for-byte the same as long as its cell has not changed
(files in a fixed order, no owner, no gzip time stamp): copying a grown grid's archive again
(``rsync``) moves only the cells that changed. Archives are not committed to git: a clone
carries every committed byte forever (``experiments/README.md``).

Each cell's archive holds its ``cell.json`` and ``cell.log``, its newest run folder (a resumed
run's folder carries the whole history) and, when that is an older one, the run the runner
would resume from; no charts (the runner redraws them), and no checkpoint or final state of a
run that reached the grid's full length (nothing continues it). Files keep their modification
times: they order a cell's runs. Unpacked where the grid's ``--out`` points, the runner skips
the finished cells and resumes the stopped one from its checkpoint.

    python -m experiments.archive grids/fmnist-paper grid-state/fmnist-paper
    for cell in grid-state/fmnist-paper/*.tgz; do tar xzf "$cell" -C grids; done
"""

from __future__ import annotations

import argparse
import gzip
import io
import tarfile
from dataclasses import dataclass
from pathlib import Path

from common.files import is_write_in_progress
from experiments.runs import RunOutputs, read_run

# Written by the ServerApp; only a run that may still be continued needs them.
RESUME_FILES = frozenset({"checkpoint.npz", "final_state.npz"})


def _for_resuming(name: str) -> bool:
    """Whether a run folder's file only serves a resume (a finished run's archive leaves it out):
    its checkpoint, the kept rounds' checkpoints, its final state."""
    return name in RESUME_FILES or (name.startswith("checkpoint-round-") and name.endswith(".npz"))


@dataclass(frozen=True)
class Archived:
    """What :func:`archive_grid` did: the cells' archives, those written anew, and archives in
    the destination whose cell the grid no longer has (left as they are)."""

    archives: list[Path]
    changed: list[Path]
    orphans: list[Path]


def runs_to_keep(cell: Path) -> list[RunOutputs]:
    """The cell's newest run (its history) and, when that one is not it, the run the runner
    would resume from (a newer run that stalled is not continued: ``runs.resume_point``);
    a stopped run older than a finished one is continued by nothing."""
    runs = sorted((r for r in map(read_run, (d for d in cell.iterdir() if d.is_dir())) if r is not None),
                  key=lambda run: run.written)
    last_finished = max((run.written for run in runs if run.finished), default=float("-inf"))
    partial = [r for r in runs if r.continuable and r.written > last_finished]
    keep = {run.directory: run for run in (runs[-1:] + partial[-1:])}
    return sorted(keep.values(), key=lambda run: run.written)


def _archived(path: Path) -> bool:
    """A file an archive holds: not a chart (redrawn from the data) nor a write in progress."""
    return path.is_file() and path.suffix != ".png" and not is_write_in_progress(path)


def cell_files(cell: Path, full_rounds: int) -> list[Path]:
    """The files of one cell folder that its archive holds, in a stable order."""
    files = sorted(path for path in cell.iterdir() if _archived(path))
    for run in runs_to_keep(cell):
        done = run.finished and run.completed_rounds >= full_rounds
        files += sorted(path for path in run.directory.iterdir()
                        if _archived(path) and not (done and _for_resuming(path.name)))
    return files


def reproducible_tgz(files: list[Path], root: Path) -> bytes:
    """``files`` as a .tgz whose names are relative to ``root``: the same files, unchanged, give
    the same bytes (no owner names or ids, gzip's time stamp 0)."""
    raw = io.BytesIO()
    with gzip.GzipFile(filename="", mode="wb", fileobj=raw, mtime=0) as compressed:
        with tarfile.open(fileobj=compressed, mode="w", format=tarfile.PAX_FORMAT) as archive:
            for path in files:
                # the size from the open file, not the path: a file the running grid replaces
                # meanwhile (atomically) is archived whole, old or new, never the new one cut short
                with path.open("rb") as content:
                    info = archive.gettarinfo(arcname=path.relative_to(root).as_posix(), fileobj=content)
                    info.uid = info.gid = 0
                    info.uname = info.gname = ""
                    info.mtime = int(info.mtime)
                    archive.addfile(info, content)
    return raw.getvalue()


def archive_grid(grid: Path, destination: Path, full_rounds: int) -> Archived:
    """Write ``destination/<cell>.tgz`` for every cell of ``grid`` (paths in them start with the
    grid folder's name); an archive whose bytes would not change is not rewritten."""
    if not (grid / "cells").is_dir():
        raise FileNotFoundError(f"{grid} is not a grid folder (no cells/ in it)")
    destination.mkdir(parents=True, exist_ok=True)
    archives, changed = [], []
    for cell in sorted(path for path in (grid / "cells").iterdir() if path.is_dir()):
        target = destination / f"{cell.name}.tgz"
        content = reproducible_tgz(cell_files(cell, full_rounds), grid.parent)
        archives.append(target)
        if target.is_file() and target.read_bytes() == content:
            continue
        partial = target.with_name(target.name + ".partial")
        partial.write_bytes(content)
        partial.replace(target)  # an interrupted archive never replaces a good one
        changed.append(target)
    orphans = sorted(set(destination.glob("*.tgz")) - set(archives))
    return Archived(archives, changed, orphans)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("grid", type=Path, help="the grid's output folder (the runner's --out)")
    parser.add_argument("destination", type=Path,
                        help="the folder of the cells' archives, e.g. grid-state/NAME")
    parser.add_argument("--full-rounds", type=int, default=200,
                        help="rounds of a run that nothing continues (default: 200, the paper's)")
    args = parser.parse_args(argv)
    try:
        done = archive_grid(args.grid, args.destination, args.full_rounds)
    except OSError as error:  # not a grid folder, an unwritable destination: one line, no traceback
        parser.exit(1, f"experiments.archive: {error}\n")
    size = sum(path.stat().st_size for path in done.archives) / 2**20
    print(f"{args.destination}: {len(done.archives)} cells of {args.grid}, {size:.1f} MiB; "
          f"{len(done.changed)} written anew, {len(done.archives) - len(done.changed)} unchanged")
    for orphan in done.orphans:
        print(f"  {orphan.name}: no such cell in {args.grid} (left as it is)")


if __name__ == "__main__":
    main()
