"""Writing an experiment's report from its finished cells (read by ``experiments.runs``).

Per experiment: ``summary.csv`` (method, setting, clients, rounds, seeds, mean, std of the final
accuracy over seeds, in %), ``curves.csv`` (the personalized accuracy at every round),
``table.md`` (methods x settings, with the paper's numbers where the grid gives them),
``accuracy.png`` (mean personalized accuracy per round, one panel per setting, every method in
it, mean over seeds with a +-1 std band), with more than one setting ``by-setting.png`` (the
final accuracy against the setting, a line per method: Figure 1a's form) and
``alpha/<setting>-<method>-seed<s>-round<r>.png`` (combination weights at the grid's chosen
rounds, for the methods that have them).

The final accuracy is the experiment's ``metric``: the last round's mean personalized accuracy
(the default), or its mean generalized accuracy (FedCCFA's metric: the full test set relabelled
with each client's current concept; blank when the last round did not measure it). A
generalized experiment's summary.csv adds the final personalized accuracy
(``personalized_mean``, ``personalized_std``), its table.md a second table with it,
``curves-generalized.csv`` the generalized accuracy in the rounds that measured it, and its
accuracy.png marks those rounds' generalized accuracy on the personalized lines. Rounds where a
concept drift starts (``drift`` in the setting's run config) are dotted vertical lines.
"""

from __future__ import annotations

import csv
import io
import math
import textwrap
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from matplotlib import colormaps
from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from common.config import ConfigError, parse_run_config
from common.drift import Drift
from common.figures import save_figure
from common.methods import METHODS
from common.methods.fedpac.charts import plot_alpha
from experiments.grid import Experiment, Setting
from experiments.runs import Results
from common.files import atomic_write

SUMMARY_COLUMNS = ("method", "setting", "clients", "rounds", "seeds", "mean", "std")
# A generalized experiment's summary.csv: the final personalized accuracy next to it.
GENERALIZED_COLUMNS = (*SUMMARY_COLUMNS, "personalized_mean", "personalized_std")
CURVE_COLUMNS = ("method", "setting", "round", "seeds", "mean", "std")


def _mean_std(values: list[float]) -> tuple[float, float]:
    """Mean and sample standard deviation over seeds (std undefined for one seed)."""
    array = np.asarray(values, dtype=np.float64)
    return float(array.mean()), float(array.std(ddof=1)) if len(array) > 1 else math.nan


def _rounded(value: float) -> float | str:
    """A csv value: rounded to 4 decimals, blank when undefined (NaN)."""
    return "" if math.isnan(value) else round(value, 4)


def summary_rows(experiment: Experiment, results: Results) -> list[dict[str, Any]]:
    """One row per (method, setting) with at least one finished seed: the final accuracy of the
    experiment's metric (NaN when a seed's last round did not measure it), and for a
    generalized experiment the final personalized accuracy too. Unrounded: the table rounds the
    mean itself, not the csv's 4 decimals (83.26499 is 83.26, not 83.265 and then 83.27)."""
    rows = []
    for setting in experiment.settings:
        for method in experiment.methods:
            runs = [results[(setting.name, method, s)]
                    for s in setting.seeds if (setting.name, method, s) in results]
            if not runs:
                continue
            mean, std = _mean_std([run.final(experiment.metric) for run in runs])
            row = {"method": method, "setting": setting.name, "clients": setting.clients,
                   "rounds": setting.rounds, "seeds": len(runs), "mean": mean, "std": std}
            if experiment.metric == "generalized":
                personalized, spread = _mean_std([run.final_accuracy for run in runs])
                row.update(personalized_mean=personalized, personalized_std=spread)
            rows.append(row)
    return rows


def summary_columns(experiment: Experiment) -> tuple[str, ...]:
    return GENERALIZED_COLUMNS if experiment.metric == "generalized" else SUMMARY_COLUMNS


def summary_csv(rows: list[dict[str, Any]], columns: tuple[str, ...] = SUMMARY_COLUMNS) -> bytes:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=columns)
    writer.writeheader()
    writer.writerows({k: _rounded(v) if isinstance(v, float) else v for k, v in row.items()} for row in rows)
    return buffer.getvalue().encode()


_CAPTIONS = {
    "personalized": "Final mean personalized test accuracy (%)",
    "generalized": "Final mean generalized test accuracy (%) (each client's model on the full test set "
                   "relabelled with its current concept, FedCCFA's metric)",
}


def _column_header(experiment: Experiment, setting: Setting) -> str:
    """A setting's column: its name and clients, and its rounds and seeds where columns differ."""
    if experiment.uniform:
        return f"{setting.name} ({setting.clients} clients)"
    seeds = "seed" if len(setting.seeds) == 1 else "seeds"
    return (f"{setting.name} ({setting.clients} clients, {setting.rounds} rounds, "
            f"{seeds} {', '.join(map(str, setting.seeds))})")


def _table_lines(experiment: Experiment, rows: list[dict[str, Any]], mean: str, std: str,
                 paper: bool) -> list[str]:
    """Methods x settings of ``row[mean] ± row[std] (n=seeds)``, the paper's value in parentheses."""
    by_cell = {(r["method"], r["setting"]): r for r in rows}
    lines = [
        "| method | " + " | ".join(_column_header(experiment, s) for s in experiment.settings) + " |",
        "|---" * (len(experiment.settings) + 1) + "|",
    ]
    for method in experiment.methods:
        cells = []
        for setting in experiment.settings:
            row = by_cell.get((method, setting.name))
            text = "–"
            if row is not None:
                text = "n/a" if math.isnan(row[mean]) else f"{row[mean]:.2f}"
                text += "" if math.isnan(row[std]) else f" ± {row[std]:.2f}"
                text += f" (n={row['seeds']})"
            if paper and method in setting.paper:
                text += f" ({setting.paper[method]:.2f})"
            cells.append(text)
        lines.append(f"| {method} | " + " | ".join(cells) + " |")
    return lines


def markdown_table(experiment: Experiment, rows: list[dict[str, Any]]) -> str:
    """Methods x settings, "mean ± std" over seeds, the paper's value in parentheses; a
    generalized experiment adds the final personalized accuracy as a second table."""
    if experiment.uniform:
        first = experiment.settings[0]
        rounds, seeds = f"{first.rounds} rounds", f"the seeds {', '.join(map(str, first.seeds))}"
    else:
        rounds, seeds = "each column's rounds", "its seeds"
    lines = [
        f"# {experiment.title}",
        "",
        f"{_CAPTIONS[experiment.metric]} after {rounds}, mean ± std over "
        f"{seeds} (n = seeds finished); paper's value in parentheses.",
        "",
        *_table_lines(experiment, rows, "mean", "std", paper=True),
    ]
    if experiment.metric == "generalized":
        lines += [
            "",
            f"For reference, the final mean personalized test accuracy (%) (each client's model on its "
            f"own test split) of the same runs, mean ± std over {seeds}:",
            "",
            *_table_lines(experiment, rows, "personalized_mean", "personalized_std", paper=False),
        ]
    return "\n".join(lines) + "\n"


def _by_common_round(curves: list[tuple[list[int], list[float]]]) -> tuple[list[int], np.ndarray] | None:
    """(the rounds that every curve has, values per curve x round); None without such a round.
    Curves are matched by round number: a round that one seed did not measure (no evaluation
    replies, say) is left out rather than the curves shifted against each other."""
    points = [dict(zip(*curve)) for curve in curves]
    rounds = sorted(set.intersection(*(set(p) for p in points))) if points else []
    if not rounds:
        return None
    return rounds, np.array([[p[r] for r in rounds] for p in points])


def seed_curves(results: Results, setting: Setting,
                method: str) -> tuple[list[int], np.ndarray] | None:
    """(rounds evaluated by every finished seed, personalized accuracy in % per seed x round)."""
    return _by_common_round([results[(setting.name, method, s)].accuracy_curve()
                             for s in setting.seeds if (setting.name, method, s) in results])


def generalized_points(results: Results, setting: Setting,
                       method: str) -> tuple[list[int], np.ndarray] | None:
    """(rounds measured by every finished seed, generalized accuracy in % per seed x round)."""
    return _by_common_round([results[(setting.name, method, s)].generalized_curve()
                             for s in setting.seeds if (setting.name, method, s) in results])


def drift_rounds(setting: Setting) -> tuple[int, ...]:
    """The first rounds of a new concept in the setting's runs (none without drift), up to
    the setting's last round."""
    try:
        drift = Drift.from_config(parse_run_config(setting.run_config))
    except (ConfigError, ValueError):  # the grid validated every cell; a report never fails on it
        return ()
    return tuple(r for r in drift.change_rounds if r <= setting.rounds) if drift.active else ()


def curves_csv(experiment: Experiment, results: Results, generalized: bool = False) -> bytes:
    """Mean and std over seeds of the personalized accuracy (%) at every round, or of the
    generalized accuracy in the rounds that measured it."""
    buffer = io.StringIO()
    writer = csv.writer(buffer)
    writer.writerow(CURVE_COLUMNS)
    points = generalized_points if generalized else seed_curves
    for setting in experiment.settings:
        for method in experiment.methods:
            curve = points(results, setting, method)
            if curve is None:
                continue
            rounds, values = curve
            for index, number in enumerate(rounds):
                mean, std = _mean_std(list(values[:, index]))
                writer.writerow([method, setting.name, number, len(values), round(mean, 4),
                                 "" if math.isnan(std) else round(std, 4)])
    return buffer.getvalue().encode()


def plot_accuracy(experiment: Experiment, results: Results, path: Path) -> None:  # pylint: disable=too-many-locals
    """Mean personalized accuracy per round: a panel per setting, a line per method. A
    generalized experiment marks the generalized accuracy where it was measured (same colour
    as the method's line); drift starts are dotted vertical lines."""
    generalized = experiment.metric == "generalized"
    count = len(experiment.settings)
    columns = min(count, 3)
    rows = math.ceil(count / columns)
    crowded = len(experiment.methods) > CROWDED
    colors = method_colors(experiment.methods)
    fig = Figure(figsize=((6.9 if crowded else 5.2) * columns, 3.9 * rows))
    axes = fig.subplots(rows, columns, squeeze=False)
    for ax, setting in zip(axes.flat, experiment.settings):
        plotted = False
        for method in experiment.methods:
            curve = seed_curves(results, setting, method)
            if curve is None:
                continue
            plotted = True
            x, values = curve
            mean = values.mean(axis=0)
            points = generalized_points(results, setting, method) if generalized else None
            label = f"{method} ({mean[-1]:.1f})"
            if points is not None:
                label = f"{method} ({mean[-1]:.1f}; generalized {points[1].mean(axis=0)[-1]:.1f})"
            line, = ax.plot(x, mean, label=label, color=colors[method])
            if len(values) > 1:
                std = values.std(axis=0, ddof=1)
                ax.fill_between(x, mean - std, mean + std, color=line.get_color(), alpha=0.15)
            if points is not None:
                ax.plot(points[0], points[1].mean(axis=0), linestyle="none", marker="s", markersize=4,
                        markeredgecolor="black", markeredgewidth=0.5, color=line.get_color())
        for index, change in enumerate(drift_rounds(setting)):
            ax.axvline(change, color="gray", linestyle=":", linewidth=1.2,
                       label="concept drift" if index == 0 else None)
        title = f"{setting.name} ({setting.clients} clients)"
        if generalized:
            title += "\nlines: personalized, squares: generalized"
        ax.set_title(title)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("round")
        ax.set_ylabel("test accuracy (%)" if generalized else "personalized test accuracy (%)")
        ax.grid(alpha=0.3)
        if plotted and crowded:  # beside the panel: inside, a long legend hides the curves' ends
            ax.legend(loc="center left", bbox_to_anchor=(1.0, 0.5), fontsize=7)
        elif plotted:
            ax.legend(loc="lower right", fontsize=8)
        else:  # a setting still queued: say so rather than draw empty 0..1 axes that read as a result
            ax.text(0.5, 0.5, "no finished run yet", transform=ax.transAxes, ha="center", va="center",
                    color="gray")
            ax.set_xticks([])
            ax.set_yticks([])
    for ax in list(axes.flat)[count:]:
        ax.set_visible(False)
    fig.suptitle(textwrap.fill(experiment.title, width=55 * columns))  # long titles overflow one panel
    save_figure(fig, path, palette=True)


# More methods than this in one panel: a palette of 20 colours and the legend beside the panel.
CROWDED = 10


def method_colors(methods: Sequence[str]) -> dict[str, tuple[float, ...]]:
    """One colour per method, the same in every panel of a report: matplotlib's ten default
    ones (``tab10``), or ``tab20``'s where more methods share a plot, since the default cycle
    starts over after ten and would give two methods of Table 1 one colour."""
    palette = colormaps["tab10" if len(methods) <= CROWDED else "tab20"]
    return {method: palette(index % palette.N) for index, method in enumerate(methods)}


def setting_lines(experiment: Experiment, rows: list[dict[str, Any]]) -> dict[str, np.ndarray]:
    """Per method, its (setting index, mean, std) points in the grid's order of settings: the
    final accuracy against the setting. A std over one seed is 0; a mean not measured is left out."""
    names = [setting.name for setting in experiment.settings]
    lines = {}
    for method in experiment.methods:
        points = sorted((names.index(r["setting"]), r["mean"], 0.0 if math.isnan(r["std"]) else r["std"])
                        for r in rows if r["method"] == method and not math.isnan(r["mean"]))
        if points:
            lines[method] = np.asarray(points, dtype=np.float64)
    return lines


def plot_by_setting(experiment: Experiment, rows: list[dict[str, Any]], path: Path) -> None:
    """The final accuracy against the setting (:func:`setting_lines`; +-1 std over seeds as
    error bars): the form of the paper's Figure 1a, the accuracy as the data grows less
    heterogeneous."""
    names = [setting.name for setting in experiment.settings]
    colors = method_colors(experiment.methods)
    fig = Figure(figsize=(max(5.2, 1.3 * len(names) + 2.6), 3.9))
    ax = fig.subplots()
    for method, points in setting_lines(experiment, rows).items():
        # a setting not measured (yet) breaks the method's line: no segment passes for its value
        mean, std = np.full(len(names), np.nan), np.zeros(len(names))
        measured = points[:, 0].astype(int)
        mean[measured], std[measured] = points[:, 1], points[:, 2]
        ax.errorbar(np.arange(len(names)), mean, yerr=std, marker="o", capsize=3, label=method,
                    color=colors[method])
    ticks = names if experiment.uniform else [f"{s.name}\n{s.rounds} rounds" for s in experiment.settings]
    ax.set_xticks(range(len(names)), ticks)
    ax.set_xlim(-0.5, len(names) - 0.5)
    ax.set_xlabel("setting")
    ax.set_ylabel(f"final {experiment.metric} test accuracy (%)")
    ax.grid(alpha=0.3)
    if ax.lines:
        ax.legend(loc="best", fontsize=8)
    ax.set_title(textwrap.fill(experiment.title, width=60), fontsize=10)
    save_figure(fig, path, palette=True)


def _group_lookup(groups: dict[int, int]) -> Callable[[int], int]:
    """A partition's label group from a round record's map (group 0 where it has none)."""
    return lambda pid: groups.get(pid, 0)


def plot_alphas(experiment: Experiment, results: Results, directory: Path) -> list[Path]:
    """Combination-weight heatmaps at the chosen rounds, first seed, methods with alpha only."""
    written = []
    for setting in experiment.settings:
        for method in (m for m in experiment.methods if METHODS[m].has_alpha):
            seed = next((s for s in setting.seeds if (setting.name, method, s) in results), None)
            if seed is None:
                continue
            run = results[(setting.name, method, seed)]
            by_round = {r["round"]: r for r in run.rounds}
            for number in setting.alpha_rounds:
                record = by_round.get(number)
                if record is None or not record.get("alpha"):
                    continue
                groups = {int(pid): int(g) for pid, g in record.get("group", {}).items()}
                path = directory / f"{setting.name}-{method}-seed{seed}-round{number}.png"
                directory.mkdir(parents=True, exist_ok=True)
                plot_alpha(record["alpha"], record["alpha_partitions"], number,
                           _group_lookup(groups), path,
                           title=f"{method}, {setting.name}: alpha at round {number}")
                written.append(path)
    return written


def _hours(seconds: float) -> str:
    return f"{seconds / 3600:.1f} h" if seconds >= 360 else f"{seconds / 60:.1f} min"


def seconds_left(done: Sequence[tuple[str, str, float, int]], todo: Sequence[tuple[str, str, int]]) -> float:
    """Seconds the ``todo`` cells (setting, method, rounds still to train) need at the pace of the ``done`` ones
    (setting, method, seconds, rounds).

    Methods differ by several times in the cost of a round (pFedVEM's is four FedPAC rounds at
    20 clients) and settings by their client counts, so a cell goes at the pace of its method in
    its setting, else of its method, else of its setting, else of everything done (NaN when
    nothing is).
    """
    pace: dict[tuple[str, ...], list[float]] = {}
    for setting, method, seconds, rounds in done:
        for key in ((setting, method), ("method", method), ("setting", setting), ()):
            total = pace.setdefault(key, [0.0, 0.0])
            total[0], total[1] = total[0] + seconds, total[1] + rounds
    left = 0.0
    for setting, method, rounds in todo:
        seconds, counted = next((pace[key] for key in ((setting, method), ("method", method), ("setting", setting), ())
                                 if pace.get(key, [0.0, 0.0])[1] > 0), (math.nan, 1.0))
        left += rounds * seconds / counted
    return left


def compute_line(experiment: Experiment, results: Results,
                 trained: Mapping[tuple[str, str, int], int] | None = None) -> str:
    """The experiment's computing so far and, at that pace, what its unfinished cells need:
    their rounds less those their stopped runs already trained (``trained``, by setting, method
    and seed)."""
    trained = trained or {}
    total = len(experiment.cells())
    spent = sum(run.compute_seconds for run in results.values())
    line = f"Compute: {len(results)} of {total} cells finished, their rounds took {_hours(spent)}"
    if len(results) < total:
        done = [(setting, method, run.compute_seconds, run.completed_rounds)
                for (setting, method, _), run in results.items()]
        todo = [(setting.name, cell.method, cell.rounds - trained.get((setting.name, cell.method, cell.seed), 0))
                for setting, cell in experiment.cells() if (setting.name, cell.method, cell.seed) not in results]
        line += (f"; the {len(todo)} cells left need about {_hours(seconds_left(done, todo))} at the pace "
                 "of their methods so far" if results else f"; {len(todo)} cells left")
    return line + "."


def write_report(experiment: Experiment, results: Results, directory: Path,
                 trained: Mapping[tuple[str, str, int], int] | None = None) -> list[dict[str, Any]]:
    """Rewrite the experiment's summary.csv, table.md, accuracy.png and alpha heatmaps
    (``trained``: :func:`compute_line`'s)."""
    directory.mkdir(parents=True, exist_ok=True)
    rows = summary_rows(experiment, results)
    atomic_write(directory / "summary.csv", summary_csv(rows, summary_columns(experiment)))
    table = markdown_table(experiment, rows) + "\n" + compute_line(experiment, results, trained) + "\n"
    atomic_write(directory / "table.md", table.encode())
    atomic_write(directory / "curves.csv", curves_csv(experiment, results))
    if experiment.metric == "generalized":
        atomic_write(directory / "curves-generalized.csv", curves_csv(experiment, results, generalized=True))
    plot_accuracy(experiment, results, directory / "accuracy.png")
    if len(experiment.settings) > 1:
        plot_by_setting(experiment, rows, directory / "by-setting.png")
    plot_alphas(experiment, results, directory / "alpha")
    return rows
