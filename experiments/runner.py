"""``fedpac-experiments``: run a grid of methods x settings x seeds and report every experiment.

Each cell is one simulation of the project's real ServerApp and ClientApps on Flower's
Simulation Runtime, in a fresh process (``experiments.simulation``), writing its usual run
folder under ``<out>/cells/<cell>/``. A cell counts as finished only when a run folder holds
*all* its rounds and the final state (a simulation's exit status alone is not trusted), so:

* re-running the same command skips finished cells (the grid resumes where it stopped);
* a cell whose run stopped half-way continues from its checkpoint (``resume-from``) instead of
  starting over;
* a failed cell is reported (with its log) and the grid goes on with the next one.

After every cell the affected experiments' reports are rewritten (``experiments.summary``), so
partial results of a long grid are readable while it runs. Example::

    fedpac-experiments experiments/grids/fmnist-paper.toml --rounds 50 --seeds 0
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import json
import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from common.drift import drift_fields_free
from common.files import atomic_write
from common.methods import METHODS
from experiments.grid import (
    Cell, Experiment, GridError, Overrides, load_grid, parse_assignment, parse_seeds, same_computation
)
from experiments.runs import Results, RunOutputs, finished_run, read_run, resumable_run, resume_point
from experiments.summary import seconds_left, write_report

ROOT = Path(__file__).resolve().parents[1]

# (cell, its folder, run folder to resume from or None, log file) -> exit status
Executor = Callable[[Cell, Path, "Path | None", Path], int]


@dataclass(frozen=True)
class SimulationOptions:
    """How cells are simulated: resources per simulated client and a wall-clock limit."""

    cpus_per_client: float = 1.0
    gpus_per_client: float = 0.0
    timeout: float | None = None  # seconds per cell; None: no limit


def _stop(process: subprocess.Popen) -> None:
    """Stop a cell's process group: SIGINT first so that Ray shuts down cleanly, then harder.

    A stop asked for meanwhile (an impatient second Ctrl-C or SIGTERM) moves on to the next
    signal at once instead of abandoning the cell half-stopped; it is raised as a
    KeyboardInterrupt once the cell has ended, so the grid stops as asked."""
    previous, _HeldInterrupts.signals = _HeldInterrupts.signals, []
    try:
        for sig, grace in ((signal.SIGINT, 20.0), (signal.SIGTERM, 10.0), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(process.pid, sig)
            except ProcessLookupError:
                break
            if _ended_within(process, grace):
                break
    finally:
        held, _HeldInterrupts.signals = _HeldInterrupts.signals, previous
    if held:
        raise KeyboardInterrupt


def _ended_within(process: subprocess.Popen, grace: float) -> bool:
    """Whether ``process`` ends within ``grace`` seconds; False as soon as a stop is held."""
    deadline, held = time.monotonic() + grace, len(_HeldInterrupts.signals or [])
    while time.monotonic() < deadline and len(_HeldInterrupts.signals or []) == held:
        try:
            process.wait(timeout=0.1)
            return True
        except subprocess.TimeoutExpired:
            continue
    return False


class _HeldInterrupts:
    """SIGINT and SIGTERM, held while a cell's process starts (:func:`_starting`)."""

    signals: list[int] | None = None


def _interrupt(signum: int, _frame: object) -> None:
    """The runner's SIGINT and SIGTERM handler: a KeyboardInterrupt, or held while a cell starts."""
    if _HeldInterrupts.signals is not None:
        _HeldInterrupts.signals.append(signum)
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def _starting() -> Iterator[None]:
    """Hold a stop while a cell's process is being started, and raise it once it has started: an
    interrupt raised between the fork and ``Popen``'s return would leave a running process that
    nothing knows to stop."""
    _HeldInterrupts.signals = []
    try:
        yield
    finally:
        held, _HeldInterrupts.signals = _HeldInterrupts.signals, None
    if held:
        raise KeyboardInterrupt


def simulate(cell: Cell, directory: Path, resume_from: Path | None, log_path: Path,
             options: SimulationOptions = SimulationOptions()) -> int:
    """Run one cell in a fresh Python process (own Ray instance); returns its exit status."""
    run_config = {**cell.run_config, "output-dir": str(directory.resolve())}
    if resume_from is not None:
        run_config["resume-from"] = str(resume_from.resolve())
    command = [
        sys.executable, "-m", "experiments.simulation",
        "--run-config", json.dumps(run_config),
        "--clients", str(cell.clients),
        "--cpus-per-client", str(options.cpus_per_client),
        "--gpus-per-client", str(options.gpus_per_client),
        # a cell's sites are its own: their state and privacy ledgers live with the cell (a
        # resumed cell continues them), not with every other cell's under the user's Flower home
        "--node-config", f"state-dir='{(directory / 'site-state').resolve()}'",
    ]
    env = dict(os.environ)
    # Ray's workers import the apps: make the project importable even when it is not installed.
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("FLWR_TELEMETRY_ENABLED", "0")
    with open(log_path, "ab") as log:
        log.write(f"\n===== {time.strftime('%Y-%m-%d %H:%M:%S')} {' '.join(command[:3])} "
                  f"{json.dumps(run_config)}\n".encode())
        log.flush()
        process: subprocess.Popen | None = None
        try:
            with _starting():
                process = subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                           start_new_session=True)  # its own group: stoppable as a whole
            return process.wait(timeout=options.timeout)
        except subprocess.TimeoutExpired:
            assert process is not None  # only its wait times out
            _stop(process)
            log.write(f"\n===== stopped after the {options.timeout:.0f}s limit\n".encode())
            return 124
        except KeyboardInterrupt:
            if process is not None:
                _stop(process)
            raise


# ---------------------------------------------------------------------------- the grid


@dataclass
class PlannedCell:
    """A unique cell and every (experiment, setting) that reports it."""

    cell: Cell
    uses: list[tuple[Experiment, str]] = field(default_factory=list)

    @property
    def label(self) -> str:
        experiment, setting = self.uses[0]
        more = f" (+{len(self.uses) - 1} more)" if len(self.uses) > 1 else ""
        return f"{experiment.name}/{self.cell.label(setting)}{more}"


def plan(experiments: list[Experiment]) -> list[PlannedCell]:
    """Unique cells in grid order; identical cells of different experiments run once."""
    planned: dict[str, PlannedCell] = {}
    for experiment in experiments:
        for setting, cell in experiment.cells():
            planned.setdefault(cell.key, PlannedCell(cell)).uses.append((experiment, setting.name))
    return list(planned.values())


def cell_directory(out: Path, cell: Cell) -> Path:
    return out / "cells" / cell.key


def _stored_cells(out: Path, cell: Cell) -> list[tuple[Path, dict]]:
    """Other cell folders of the same method, client count and seed, with their cell.json."""
    found = []
    for path in sorted((out / "cells").glob(f"{cell.method}-{cell.clients}c-seed{cell.seed}-*/cell.json")):
        try:
            found.append((path.parent, json.loads(path.read_text())))
        except (OSError, ValueError):
            continue
    return found


def stored_directory(out: Path, cell: Cell) -> Path:
    """The folder that holds the cell's runs: its own, or one an earlier version wrote for the
    same computation (its key hashed a config with fewer fields); its own when neither exists."""
    directory = cell_directory(out, cell)
    if directory.exists():
        return directory
    for folder, stored in _stored_cells(out, cell):
        identity = stored.get("identity", {})
        if (folder != directory and identity.get("clients") == cell.clients
                and same_computation(identity.get("config", {}), cell.identity["config"])):
            return folder
    return directory


def adopt_directory(out: Path, cell: Cell, log: Callable[[str], None] = print) -> Path:
    """The cell's folder, an earlier version's folder for the same computation renamed to it
    (:func:`stored_directory`), so its runs count."""
    directory, folder = cell_directory(out, cell), stored_directory(out, cell)
    if folder != directory:
        folder.rename(directory)
        log(f"{folder.name}: renamed to {directory.name} (same computation, written by an earlier version)")
    return directory


def last_round_differs(config: dict[str, Any]) -> bool:
    """Whether a run's last round trains other clients than the same round of a longer run: a
    sampled federation (``fraction-train`` < 1, or a server-drawn S_t that only trains) with
    every client in its last round (``full-last-round``). Such a run cannot be extended exactly."""
    if not config["full_last_round"]:
        return False
    samples_trainers = (METHODS[config["strategy"]].draws_its_own_sample and config["vem_protocol"] != "all-train"
                        and config["vem_sampling_rate"] < 1.0)
    return config["fraction_train"] < 1.0 or samples_trainers


def extension_source(out: Path, cell: Cell) -> RunOutputs | None:
    """``--extend``: the longest finished shorter run of the same configuration, which this
    cell can continue exactly (a resume repeats every round bit for bit). None when there is
    none, or when the shorter run's last round differs from the same round of a longer run
    (sampled rounds with every client in the last round). A shorter run under another drift
    counts as the same configuration while neither drift has changed a label yet (the
    recurrent and incremental cells continue a 100-round sudden-drift run)."""
    config = cell.identity["config"]
    if last_round_differs(config):
        return None
    best = None
    for folder, stored in _stored_cells(out, cell):
        if stored.get("identity", {}).get("clients") != cell.clients or folder == cell_directory(out, cell):
            continue
        runs = (read_run(d) for d in folder.iterdir() if d.is_dir())
        for run in runs:
            if (run is not None and run.finished and run.resumable and run.completed_rounds < cell.rounds
                    and run.completed_rounds == run.config.get("num_server_rounds")
                    and same_computation(run.config, config, ignore=(
                        "num_server_rounds", *drift_fields_free(run.config, config, run.completed_rounds)))
                    and (best is None or run.completed_rounds > best.completed_rounds)):
                best = run
    return best


def results_of(experiment: Experiment, out: Path) -> Results:
    """The experiment's finished cells, by (setting, method, seed)."""
    results: Results = {}
    for setting, cell in experiment.cells():
        run = finished_run(stored_directory(out, cell), cell)
        if run is not None:
            results[(setting.name, cell.method, cell.seed)] = run
    return results


def report(experiment: Experiment, out: Path) -> Path:
    """Rewrite one experiment's report from its finished cells; returns its folder."""
    directory = out / experiment.name
    results = results_of(experiment, out)
    unfinished = ((setting.name, cell) for setting, cell in experiment.cells()
                  if (setting.name, cell.method, cell.seed) not in results)
    trained = {(setting, cell.method, cell.seed): run.completed_rounds for setting, cell in unfinished
               if (run := resumable_run(stored_directory(out, cell), cell)) is not None}
    write_report(experiment, results, directory, trained)
    return directory


def _duration(seconds: float) -> str:
    if math.isnan(seconds):
        return "an unknown time"
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}h{minutes:02d}m{secs:02d}s" if hours else f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


def _log_tail(path: Path, lines: int = 3) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return "\n".join("      " + line for line in text[-lines:])


def _final(run: RunOutputs, planned: PlannedCell) -> str:
    """The log's final accuracy: personalized, or generalized (with the personalized one) when
    an experiment that reports the cell measures generalized accuracy."""
    if any(experiment.metric == "generalized" for experiment, _ in planned.uses):
        return (f"final accuracy {run.final_generalized_accuracy:.2f}% generalized, "
                f"{run.final_accuracy:.2f}% personalized")
    return f"final accuracy {run.final_accuracy:.2f}%"


def _write_cell_file(directory: Path, cell: Cell) -> None:
    """``cell.json``: what the folder computes; later runs find their sources by it."""
    directory.mkdir(parents=True, exist_ok=True)
    document = {"method": cell.method, "clients": cell.clients, "seed": cell.seed, "rounds": cell.rounds,
                "run-config": cell.run_config, "identity": cell.identity}
    atomic_write(directory / "cell.json", json.dumps(document, indent=2).encode())


def run_grid(  # pylint: disable=too-many-locals,too-many-arguments
    experiments: list[Experiment],
    out: Path,
    execute: Executor,
    log: Callable[[str], None] = print,
    extend: bool = False,
) -> list[PlannedCell]:
    """Run every unfinished cell, reporting after each; returns the cells that failed.

    With ``extend``, a cell without a run of its own continues the longest finished shorter
    run of the same configuration instead of starting from round 1.
    """
    cells = plan(experiments)
    total, started = len(cells), time.time()
    log(f"{total} cells in {len(experiments)} experiment(s); outputs in {out}")
    # The paces of the estimate of what is left: finished runs' rounds, then this runner's cells
    # (wall time, start-up included), by (experiment/setting, method).
    finished = [finished_run(adopt_directory(out, c.cell, log), c.cell) for c in cells]
    rounds_to_run = [0 if run is not None else c.cell.rounds - _head_start(out, c.cell, extend)
                     for c, run in zip(cells, finished)]
    paced: list[tuple[str, str, float, int]] = [
        (_pace_setting(c), c.cell.method, run.compute_seconds, run.completed_rounds)
        for c, run in zip(cells, finished) if run is not None]
    failed = []
    for index, planned in enumerate(cells, start=1):
        cell = planned.cell
        directory = cell_directory(out, cell)
        prefix = f"[{index}/{total}] {planned.label}"
        done = finished_run(directory, cell)
        if done is not None:
            log(f"{prefix}: finished before, skipped ({_final(done, planned)})")
            continue
        _write_cell_file(directory, cell)
        start, passed_over = resume_point(directory, cell)
        for stalled in passed_over:
            log(f"{prefix}: not continuing the stalled run {stalled.directory.name} (its last rounds "
                f"had too few training replies: {stalled.status.get('error', '')[:160]})")
        if start is not None:
            log(f"{prefix}: resuming after round {start.completed_rounds}/{cell.rounds} from {start.directory.name}")
        elif extend and (start := extension_source(out, cell)) is not None:
            log(f"{prefix}: extending the finished {start.completed_rounds}-round run "
                f"{start.directory.parent.name}/{start.directory.name} to {cell.rounds} rounds")
        elif extend and last_round_differs(cell.identity["config"]):
            log(f"{prefix}: not extending a shorter run: its last round trained every client, the same "
                f"round of a {cell.rounds}-round run trains a sample (full-last-round); from round 1")
        first_round = start.completed_rounds if start is not None else 0
        cell_started = time.time()
        status = execute(cell, directory, None if start is None else start.directory, directory / "cell.log")
        seconds = time.time() - cell_started
        done = finished_run(directory, cell)
        if done is not None and done.completed_rounds > first_round:
            paced.append((_pace_setting(planned), cell.method, seconds, done.completed_rounds - first_round))
        elapsed = _duration(time.time() - started)
        remaining = seconds_left(paced, [(_pace_setting(c), c.cell.method, rounds)
                                         for c, rounds in zip(cells[index:], rounds_to_run[index:]) if rounds > 0])
        if done is None:
            failed.append(planned)
            log(f"{prefix}: FAILED (exit status {status}) after {_duration(seconds)} | elapsed {elapsed}; "
                f"log: {directory / 'cell.log'}\n{_log_tail(directory / 'cell.log')}")
            continue
        log(f"{prefix}: done in {_duration(seconds)}, {_final(done, planned)} | "
            f"elapsed {elapsed}, about {_duration(remaining)} left")
        for experiment in {id(e): e for e, _ in planned.uses}.values():
            report(experiment, out)
    for experiment in experiments:
        log(f"{experiment.name}: report in {report(experiment, out)}")
    if failed:
        log(f"{len(failed)} of {total} cells failed; run the same command again to retry them")
    return failed


def _head_start(out: Path, cell: Cell, extend: bool) -> int:
    """The rounds an unfinished cell will not train again: its stopped run's, or with ``extend``
    the shorter run it continues."""
    start = resumable_run(cell_directory(out, cell), cell)
    if start is None and extend:
        start = extension_source(out, cell)
    return start.completed_rounds if start is not None else 0


def _pace_setting(planned: PlannedCell) -> str:
    experiment, setting = planned.uses[0]
    return f"{experiment.name}/{setting}"


def describe(experiments: list[Experiment], out: Path, log: Callable[[str], None] = print,
             extend: bool = False) -> None:
    """List the cells and their state without running anything (--dry-run); with ``extend``, a
    cell to run names the shorter run it would continue, as the runner would."""
    cells = plan(experiments)
    for index, planned in enumerate(cells, start=1):
        directory = stored_directory(out, planned.cell)
        done = finished_run(directory, planned.cell)
        partial = resumable_run(directory, planned.cell)
        shorter = extension_source(out, planned.cell) if extend and not (done or partial) else None
        state = ("finished" if done else f"resumable after round {partial.completed_rounds}" if partial
                 else f"to run, extending the finished {shorter.completed_rounds}-round run "
                      f"{shorter.directory.parent.name}/{shorter.directory.name}" if shorter
                 else "to run")
        log(f"[{index}/{len(cells)}] {planned.label}: {planned.cell.clients} clients, "
            f"{planned.cell.rounds} rounds: {state}")


# ---------------------------------------------------------------------------- command line


def _names(text: str | None) -> list[str] | None:
    return None if text is None else [part.strip() for part in text.split(",") if part.strip()]


def parser() -> argparse.ArgumentParser:
    cli = argparse.ArgumentParser(
        prog="fedpac-experiments",
        description="Run a grid of FedPAC experiments (methods x settings x seeds) as Flower "
                    "simulations, resumably, and write summary.csv, table.md, accuracy.png and "
                    "alpha heatmaps per experiment.",
    )
    cli.add_argument("grid", type=Path, help="grid file (TOML), e.g. experiments/grids/fmnist-paper.toml")
    cli.add_argument("--out", type=Path, help="output folder (default: outputs/experiments/<grid name>)")
    cli.add_argument("--rounds", type=int, help="rounds of every cell, instead of the grid's (e.g. 50 on a CPU)")
    cli.add_argument("--seeds", help="seeds instead of the grid's, e.g. 0,1,2")
    cli.add_argument("--experiments", help="only these experiments, e.g. table1,table3")
    cli.add_argument("--methods", help="only these methods, e.g. fedavg,fedpac")
    cli.add_argument("--settings", help="only these settings, e.g. 20-clients")
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="run-config override for every cell, e.g. --set data-dir=/data/fmnist (repeatable)")
    cli.add_argument("--cpus-per-client", type=float, default=1.0, help="Ray CPUs per simulated client")
    cli.add_argument("--gpus-per-client", type=float, default=0.0, help="Ray GPU share per simulated client")
    cli.add_argument("--timeout", type=float, help="wall-clock limit per cell, in seconds")
    cli.add_argument("--dry-run", action="store_true", help="list the cells and their state, run nothing")
    cli.add_argument("--report-only", action="store_true", help="rewrite the reports from finished cells")
    cli.add_argument("--extend", action="store_true",
                     help="a cell without a run of its own continues the longest finished shorter run of the "
                          "same configuration (e.g. --rounds 200 after --rounds 20), exactly; not a sampled "
                          "federation whose shorter run trained every client in its last round")
    return cli


@contextlib.contextmanager
def one_runner(out: Path) -> Iterator[None]:
    """Hold ``out``'s lock while a runner works in it: a second runner there (another terminal,
    a queue started twice) would resume the same checkpoints into the same folders. The lock
    goes with the process, so a killed runner leaves nothing to clean up."""
    out.mkdir(parents=True, exist_ok=True)
    with open(out / ".runner.lock", "a+b") as handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError as err:
            raise GridError(f"another fedpac-experiments runs in {out}; wait for it to end or stop it "
                            "(two runners would continue the same cells)") from err
        yield


@contextlib.contextmanager
def interruptible() -> Iterator[None]:
    """SIGTERM stops the grid as Ctrl-C does, and so does SIGINT even when it was ignored at start
    (a command that a script starts in the background inherits SIGINT ignored): the cell in
    progress is stopped with its whole process group, and the grid resumes later from its
    checkpoint. Before, a SIGTERM ended the runner and left its simulation running."""
    previous = signal.signal(signal.SIGINT, _interrupt), signal.signal(signal.SIGTERM, _interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous[0])
        signal.signal(signal.SIGTERM, previous[1])


def main(argv: list[str] | None = None, execute: Executor | None = None) -> int:
    """Console entry point; returns 0 when every cell finished, 1 when some failed, 2 on a bad grid."""
    args = parser().parse_args(argv)
    try:
        overrides = Overrides(
            rounds=args.rounds,
            seeds=parse_seeds(args.seeds),
            experiments=_names(args.experiments),
            methods=_names(args.methods),
            settings=_names(args.settings),
            run_config=dict(parse_assignment(text) for text in args.set),
        )
        experiments = load_grid(args.grid, overrides)
    except GridError as err:
        print(f"fedpac-experiments: {err}", file=sys.stderr)
        return 2
    out = (args.out or Path("outputs") / "experiments" / args.grid.stem).resolve()
    if args.dry_run:
        describe(experiments, out, extend=args.extend)
        return 0
    if args.report_only:
        for experiment in experiments:
            print(f"{experiment.name}: report in {report(experiment, out)}")
        return 0
    options = SimulationOptions(args.cpus_per_client, args.gpus_per_client, args.timeout)

    def default_execute(cell: Cell, directory: Path, resume_from: Path | None, log_path: Path) -> int:
        return simulate(cell, directory, resume_from, log_path, options)

    try:
        with one_runner(out), interruptible():
            failed = run_grid(experiments, out, execute or default_execute,
                              log=lambda line: print(line, flush=True), extend=args.extend)
    except GridError as err:
        print(f"fedpac-experiments: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedpac-experiments: interrupted; run the same command again to resume the grid", file=sys.stderr)
        return 130
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
