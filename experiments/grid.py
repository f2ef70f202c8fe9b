"""Experiment grids: a TOML file of methods x settings x seeds, expanded into cells.

A grid file holds defaults at the top level and one table per experiment (one paper table or
figure). Every level may set ``rounds``, ``seeds``, ``clients``, ``alpha-rounds`` and a
``run-config`` table of run-config overrides; the innermost wins, then the command line. The
top level and the experiments may also set ``metric``, the accuracy an experiment's table
reports: ``personalized`` (the default: each client's model on its own test split, FedPAC's
metric) or ``generalized`` (the full test set relabelled with each client's current concept,
FedCCFA's metric, measured every ``generalized-every`` rounds and at the last)::

    rounds = 200                    # federated rounds of every cell
    metric = "personalized"         # or "generalized"
    seeds = [0, 1, 2]
    clients = 20                    # simulated SuperNodes (num-partitions)
    alpha-rounds = [1, 50, 200]     # rounds whose combination weights are plotted
    [run-config]                    # overrides for every cell (keys of [tool.flwr.app.config])
    dataset = "fashion-mnist"
    [method-config]                 # a method's own recipe, in every experiment that lists it
    fedrep = { fedrep-body-epochs = 5 }

    [experiments.table1]
    title = "Table 1"
    methods = ["local", "fedavg", "fedpac"]
    [experiments.table1.settings.100-clients]
    clients = 100
    run-config = { fraction-train = 0.3 }
    paper = { fedpac = 92.72 }      # optional: the paper's number, shown next to ours
    rounds = 300                    # optional: this column runs longer than the others

A method's ``method-config`` applies over the levels' ``run-config`` (a baseline's recipe is its
own, whatever the setting), and the command line's ``--set`` over both.

A cell is one (method, setting, seed): one simulation. Cells with identical run configs and
client counts (FedPAC with 20 clients appears in several of the paper's tables) are one cell,
run once and reported in every experiment that lists it.
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from dataclasses import asdict, dataclass, field
from collections.abc import Callable
from pathlib import Path
from typing import Any

from common.config import ConfigError, FedPACConfig, dp_only_fields, parse_run_config
from common.methods import METHODS
from common.methods.base import Alignment

# Run-config keys that are the grid's own axes (or the runner's business), not overrides.
RESERVED_KEYS = ("strategy", "seed", "num-server-rounds", "output-dir", "resume-from")
# Config fields that differ between runs of one cell without changing what it computes: where
# its files go, how long a round may wait.
NOT_IDENTITY = ("output_dir", "resume_from", "save_model_every", "round_timeout")
# The methods whose extractor steps align features to centroids with lambda-align.
ALIGNING: tuple[str, ...] = tuple(name for name, method in METHODS.items() if method.alignment is Alignment.CENTROIDS)
# Config fields added after cells were run, whose default does not compute what a run without
# the field computed: that run's value, from its stored config (FedRep trained its body for
# `local-epochs` epochs before `fedrep-body-epochs` existed).
_ADDED_WITH_OTHER_DEFAULT: dict[str, Callable[[dict[str, Any]], Any]] = {
    "fedrep_body_epochs": lambda c: c.get("local_epochs") if c.get("strategy") == "fedrep" else 1,
    # DP-SGD took each routine's batch and step sizes before the DP recipe had keys, and FedPAC
    # aligned with lambda-align under DP before dp-lambda-align existed
    "dp_batch_size": lambda c: 0,
    "dp_step_size": lambda c: 0.0,
    "dp_momentum": lambda c: 0.0,
    "dp_lambda_align": lambda c: (c.get("lambda_align", 1.0) if c.get("dp") and c.get("strategy") in ALIGNING
                                  else 0.0),
}


def not_identity(config: dict[str, Any]) -> tuple[str, ...]:
    """:data:`NOT_IDENTITY`, and ``data-dir`` where it only says where the dataset lies: a grid
    moved to a machine that keeps its data in another folder still finds its cells. A Hugging
    Face dataset read from disk without a repository name is named by its folder alone, so
    there ``data-dir`` says what is computed."""
    named_by_folder = config.get("dataset") == "hf" and not config.get("hf_repo")
    return NOT_IDENTITY if named_by_folder else (*NOT_IDENTITY, "data_dir")


def same_computation(stored: dict[str, Any], current: dict[str, Any], ignore: tuple[str, ...] = ()) -> bool:
    """Whether a run whose validated config is ``stored`` computed what ``current`` describes.

    ``stored`` may come from an earlier version with fewer fields: a field added since then
    counts at the value the old code used (its default, or ``_ADDED_WITH_OTHER_DEFAULT``), so
    finished cells stay usable when the config grows. ``ignore`` leaves further fields out
    (``--extend`` compares cells of different lengths).
    """
    # as JSON holds them (a stored config was read from it): the method settings' pairs are lists;
    # none at all is what a config from before the methods had settings says too (Cell.identity)
    defaults, current = json.loads(json.dumps(asdict(FedPACConfig()))), json.loads(json.dumps(current))
    stored, current = ({k: v for k, v in config.items() if not (k == "method_settings" and not v)}
                       for config in (stored, current))
    skip = {*not_identity(current), *dp_only_fields(current), *ignore}
    for key, value in current.items():
        if key in skip:
            continue
        if key in stored:
            old = stored[key]
        elif key in _ADDED_WITH_OTHER_DEFAULT:
            old = _ADDED_WITH_OTHER_DEFAULT[key](stored)
        else:
            old = defaults.get(key)
        if old != value:
            return False
    return all(key in current or key in skip for key in stored)


METRICS = ("personalized", "generalized")


class GridError(ValueError):
    """A grid file (or a command-line override) that cannot be run."""


@dataclass(frozen=True)
class Cell:
    """One simulation: a method on a setting with a seed."""

    method: str
    clients: int
    seed: int
    rounds: int
    run_config: dict[str, Any]  # complete overrides, incl. strategy, seed and num-server-rounds

    @property
    def identity(self) -> dict[str, Any]:
        """What the cell computes: the validated config (defaults filled in) and client count."""
        config = asdict(parse_run_config(self.run_config))
        for name in not_identity(config):
            config.pop(name)
        if not config["method_settings"]:  # as before methods had settings: the same cell keys
            config.pop("method_settings")
        return {"clients": self.clients, "config": config}

    @property
    def key(self) -> str:
        """A stable folder name: readable prefix + hash of the identity."""
        digest = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.method}-{self.clients}c-seed{self.seed}-{digest}"

    def label(self, setting: str) -> str:
        return f"{setting} | {self.method} | seed {self.seed}"


@dataclass(frozen=True)
class Setting:  # pylint: disable=too-many-instance-attributes
    """One column of an experiment's table: a client count, run-config overrides, and the
    rounds and seeds its cells run (a column may run longer than its neighbours)."""

    name: str
    clients: int
    rounds: int
    seeds: list[int]
    run_config: dict[str, Any]
    alpha_rounds: list[int] = field(default_factory=list)  # rounds whose combination weights are plotted
    paper: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Experiment:
    """One paper table or figure: methods x settings x seeds, reported together."""

    name: str
    title: str
    methods: list[str]
    settings: list[Setting]
    metric: str = "personalized"  # one of METRICS: what the table reports
    method_config: dict[str, dict[str, Any]] = field(default_factory=dict)  # per method, over the setting's
    command_line: dict[str, Any] = field(default_factory=dict)  # --set, over everything

    def cell(self, setting: Setting, method: str, seed: int) -> Cell:
        run_config = {
            **setting.run_config,
            **self.method_config.get(method, {}),
            **self.command_line,
            "strategy": method,
            "seed": seed,
            "num-server-rounds": setting.rounds,
        }
        return Cell(method=method, clients=setting.clients, seed=seed, rounds=setting.rounds, run_config=run_config)

    def cells(self) -> list[tuple[Setting, Cell]]:
        """Every (setting, cell), settings outermost, then methods, then seeds."""
        return [
            (setting, self.cell(setting, method, seed))
            for setting in self.settings
            for method in self.methods
            for seed in setting.seeds
        ]

    @property
    def uniform(self) -> bool:
        """Whether every setting runs the same rounds over the same seeds (one caption says both)."""
        return len({(s.rounds, tuple(s.seeds)) for s in self.settings}) <= 1


@dataclass(frozen=True)
class Overrides:  # pylint: disable=too-many-instance-attributes
    """Command-line choices that take precedence over the grid file."""

    rounds: int | None = None
    seeds: list[int] | None = None
    experiments: list[str] | None = None
    methods: list[str] | None = None
    settings: list[str] | None = None
    run_config: dict[str, Any] = field(default_factory=dict)


def _positive_int(value: Any, where: str) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise GridError(f"{where} must be a positive integer, got {value!r}")
    return value


def _int_list(value: Any, where: str, minimum: int) -> list[int]:
    # a repeated seed would count one run twice in a mean and a standard deviation
    if not isinstance(value, list) or not value or len(set(value)) != len(value) or not all(
        isinstance(v, int) and not isinstance(v, bool) and v >= minimum for v in value
    ):
        raise GridError(f"{where} must be a non-empty list of distinct integers >= {minimum}, got {value!r}")
    return list(value)


def _table(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise GridError(f"{where} must be a table, got {value!r}")
    return dict(value)


def _check_run_config(overrides: dict[str, Any], where: str) -> None:
    reserved = sorted(set(overrides) & set(RESERVED_KEYS))
    if reserved:
        raise GridError(f"{where}: {', '.join(reserved)} are set by the grid itself "
                        "(methods, seeds, rounds) or by the runner (output folders)")


_LEVEL_KEYS = {"rounds", "seeds", "clients", "alpha-rounds", "run-config"}


def _level(table: dict[str, Any], inherited: dict[str, Any], where: str, extra: set[str]) -> dict[str, Any]:
    """Merge one level of the grid file into the inherited defaults."""
    unknown = sorted(set(table) - _LEVEL_KEYS - extra)
    if unknown:
        raise GridError(f"{where}: unknown key(s) {', '.join(unknown)}")
    merged = dict(inherited)
    if "rounds" in table:
        merged["rounds"] = _positive_int(table["rounds"], f"{where}.rounds")
    if "seeds" in table:
        merged["seeds"] = _int_list(table["seeds"], f"{where}.seeds", 0)
    if "clients" in table:
        merged["clients"] = _positive_int(table["clients"], f"{where}.clients")
    if "alpha-rounds" in table:
        merged["alpha-rounds"] = _int_list(table["alpha-rounds"], f"{where}.alpha-rounds", 1)
    if "run-config" in table:
        overrides = _table(table["run-config"], f"{where}.run-config")
        _check_run_config(overrides, f"{where}.run-config")
        merged["run-config"] = {**merged.get("run-config", {}), **overrides}
    return merged


def _metric(table: dict[str, Any], inherited: str, where: str) -> str:
    """The level's ``metric``, or the inherited one."""
    if "metric" not in table:
        return inherited
    value = table["metric"]
    if value not in METRICS:
        raise GridError(f"{where}.metric must be one of {', '.join(repr(m) for m in METRICS)}, got {value!r}")
    return value


def _methods(value: Any, where: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(m, str) for m in value):
        raise GridError(f"{where} must be a non-empty list of method names")
    unknown = [m for m in value if m not in METHODS]
    if unknown:
        raise GridError(f"{where}: unknown method(s) {', '.join(unknown)}; one of {', '.join(METHODS)}")
    return list(value)


def _method_config(value: Any) -> dict[str, dict[str, Any]]:
    """The grid's ``[method-config]``: run-config overrides per method name."""
    recipes = _table(value, "method-config")
    unknown = sorted(set(recipes) - set(METHODS))
    if unknown:
        raise GridError(f"method-config: unknown method(s) {', '.join(unknown)}; one of {', '.join(METHODS)}")
    checked = {}
    for method, raw in recipes.items():
        checked[method] = _table(raw, f"method-config.{method}")
        _check_run_config(checked[method], f"method-config.{method}")
    return checked


def _select(names: list[str], wanted: list[str] | None) -> list[str]:
    return names if wanted is None else [n for n in names if n in wanted]


def load_grid(path: Path, overrides: Overrides = Overrides()) -> list[Experiment]:
    """Read, merge and validate a grid file; every cell's run config is checked up front, so
    a typo fails before the first simulation rather than hours into the grid."""
    try:
        document = tomllib.loads(Path(path).read_text())
    except (OSError, tomllib.TOMLDecodeError) as err:
        raise GridError(f"cannot read grid file {path}: {err}") from err
    _check_run_config(overrides.run_config, "--set")
    top = _level(document, {"seeds": [0], "alpha-rounds": [], "run-config": {}}, "grid",
                 {"experiments", "metric", "method-config"})
    method_config = _method_config(document.get("method-config", {}))
    top_metric = _metric(document, METRICS[0], "grid")
    tables = _table(document.get("experiments"), "experiments")
    if not tables:
        raise GridError(f"{path}: no [experiments.<name>] table")
    missing = sorted(set(overrides.experiments or []) - set(tables))
    if missing:
        raise GridError(f"unknown experiment(s) {', '.join(missing)}; the grid has {', '.join(tables)}")
    unknown_methods = sorted(set(overrides.methods or []) - set(METHODS))
    if unknown_methods:
        raise GridError(f"unknown method(s) {', '.join(unknown_methods)}; one of {', '.join(METHODS)}")
    if overrides.seeds is not None:
        _int_list(overrides.seeds, "--seeds", 0)
    if overrides.rounds is not None and overrides.rounds < 1:
        raise GridError(f"--rounds must be >= 1, got {overrides.rounds}")
    experiments = []
    for name in _select(list(tables), overrides.experiments):
        where = f"experiments.{name}"
        table = _table(tables[name], where)
        level = _level(table, top, where, {"title", "methods", "settings", "metric"})
        metric = _metric(table, top_metric, where)
        all_methods = _methods(table.get("methods"), f"{where}.methods")
        methods = _select(all_methods, overrides.methods)
        settings = []
        for setting_name, raw in _table(table.get("settings"), f"{where}.settings").items():
            if overrides.settings is not None and setting_name not in overrides.settings:
                continue
            setting_where = f"{where}.settings.{setting_name}"
            setting_table = _table(raw, setting_where)
            merged = _level(setting_table, level, setting_where, {"paper"})
            if "clients" not in merged:
                raise GridError(f"{setting_where}: no 'clients' here or above")
            paper = _table(setting_table.get("paper", {}), f"{setting_where}.paper")
            strays = sorted(set(paper) - set(all_methods))  # a typo would silently drop a number
            if strays:
                raise GridError(f"{setting_where}.paper: {', '.join(strays)} not among the experiment's methods")
            if "rounds" not in merged and overrides.rounds is None:
                raise GridError(f"{setting_where}: no 'rounds' here or above (or --rounds)")
            rounds = overrides.rounds or merged["rounds"]
            settings.append(Setting(
                name=setting_name,
                clients=merged["clients"],
                rounds=rounds,
                seeds=overrides.seeds or merged["seeds"],
                run_config={**merged["run-config"], **overrides.run_config},
                # plotted rounds beyond a shortened run move to its last round
                alpha_rounds=sorted({min(r, rounds) for r in merged["alpha-rounds"]}),
                paper={k: float(v) for k, v in paper.items()},
            ))
        experiment = Experiment(
            name=name,
            title=str(table.get("title", name)),
            methods=methods,
            settings=settings,
            metric=metric,
            method_config=method_config,
            command_line=dict(overrides.run_config),
        )
        for setting, cell in experiment.cells():
            try:
                parse_run_config(cell.run_config)
            except ConfigError as err:
                raise GridError(f"{where}.settings.{setting.name}: {err}") from err
        experiments.append(experiment)
    return _selected(experiments, overrides)


def _selected(experiments: list[Experiment], overrides: Overrides) -> list[Experiment]:
    """The experiments with cells under ``--methods`` and ``--settings``; a name that selects
    nothing is an error, not an empty grid (whose reports would overwrite the real ones)."""
    for flag, wanted, found in (
        ("--settings", overrides.settings, {s.name for e in experiments for s in e.settings}),
        ("--methods", overrides.methods, {m for e in experiments for m in e.methods}),
    ):
        missing = sorted(set(wanted or []) - found)
        if missing:
            raise GridError(f"{flag}: {', '.join(missing)} in none of the selected experiments")
    kept = [e for e in experiments if e.methods and e.settings]
    if not kept:
        raise GridError("the selection has no cells")
    return kept


def parse_seeds(text: str | None) -> list[int] | None:
    """``--seeds``' list (:func:`load_grid` checks it: non-empty, distinct)."""
    try:
        return None if text is None else [int(part) for part in text.split(",") if part.strip()]
    except ValueError as err:
        raise GridError(f"--seeds expects integers separated by commas, got {text!r}") from err


def parse_assignment(text: str) -> tuple[str, Any]:
    """``key=value`` from the command line; the value is read as TOML (``x=0.3``, ``d='a'``)
    and taken as a plain string when it is not valid TOML (``dataset=fashion-mnist``)."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise GridError(f"--set expects key=value, got {text!r}")
    try:
        parsed = tomllib.loads(f"v = {value.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        parsed = value.strip()
    return key.strip(), parsed
