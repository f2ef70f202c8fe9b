"""Run outputs: per-round records, metrics as JSON and CSV, the accuracy chart, and the tables and
charts the run's method declares (``common.methods.outputs``: FedPAC's alpha.png, FedCCFA's
clusters.csv and clusters.png, ...). Nothing here names a method: a record keeps what the
method's server part recorded in ``method``, and the method's declarations turn it into columns.

Everything is rewritten atomically (temp file, then rename) after every round, so a run that
stops early still leaves complete, readable files for the rounds it finished. Tables come
before charts, and a chart that cannot be written (a full disk, say) is a logged warning: a
plot is never worth a run.

Both stay off the rounds' critical path as runs grow: a round's share of each table is
serialized once, when the round is added (a finished round never changes), so rewriting the
tables costs a join over the history, not a re-serialization of it; and the charts are drawn by
a background thread (:class:`ChartPainter`) while the next round trains, at most every
``CHART_INTERVAL`` seconds, the newest history replacing one not yet drawn.
:meth:`RunReport.close` waits for the last charts.
"""

from __future__ import annotations

import csv
import functools
import io
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

import numpy as np
from flwr.supercore import log
from matplotlib.figure import Figure

from common import figures
from common.drift import Drift
from common.files import atomic_write
from common.methods import METHODS
from common.methods.outputs import ChartContext, Outputs, schema
from common.methods.server import registered_outputs, server_class
from common.protocol import DP_EPSILON, TRAIN_LOSS

# The generic columns, every method's; the columns the registered methods declare follow them
# (:func:`round_columns`, :func:`client_columns`).
GENERIC_CLIENT_COLUMNS = (
    "round", "partition_id", "group", "trained", "accuracy", "generalized_accuracy", "test_loss",
    "num_examples", "train_loss", "train_seconds", "eval_seconds", "bytes_sent", "bytes_received", "dp_epsilon",
)
GENERIC_ROUND_COLUMNS = (
    "round", "mean_accuracy", "min_accuracy", "max_accuracy", "mean_generalized_accuracy", "num_evaluated",
    "num_trained", "mean_train_loss", "bytes_sent", "bytes_received", "seconds", "num_rejected", "max_dp_epsilon",
)


def max_epsilon(r: RoundRecord) -> float | str:
    """The largest epsilon a site reported this round (differential privacy on), else ``""``."""
    spent = [m[DP_EPSILON] for m in r.train.values() if DP_EPSILON in m]
    return max(spent) if spent else ""


def round_columns(*extra: Outputs) -> tuple[str, ...]:
    """rounds.csv's columns: the generic ones, then those every registered method declares (in
    the registry's order) and those of ``extra`` (a method not registered), each name once."""
    return schema(GENERIC_ROUND_COLUMNS,
                  [[c.name for c in o.round_columns] for o in [*registered_outputs(), *extra]])


def client_columns(*extra: Outputs) -> tuple[str, ...]:
    """clients.csv's columns, as :func:`round_columns`."""
    return schema(GENERIC_CLIENT_COLUMNS,
                  [[c.name for c in o.client_columns] for o in [*registered_outputs(), *extra]])


def finite_json(value: object) -> object:
    """``value`` with every NaN or infinite float as ``None``: JSON has no NaN, and a client's
    metric (a diverged loss, say) must not make metrics.json unreadable to strict parsers."""
    if isinstance(value, float) and not np.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite_json(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [finite_json(item) for item in value]
    return value


@dataclass
class RoundRecord:  # pylint: disable=too-many-instance-attributes
    """Everything measured in one round, per client keyed by partition-id; ``method``: what the
    method's server part recorded (``StepResult.record``, ``ServerPart.closing_record``: FedPAC's
    alpha, FedCCFA's clusters, pFedVEM's sample S_t, ...), which its declared outputs read."""

    round: int
    started: float
    seconds: float = 0.0
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    accuracy: dict[int, float] = field(default_factory=dict)
    test_loss: dict[int, float] = field(default_factory=dict)
    eval_seconds: dict[int, float] = field(default_factory=dict)
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    # The whole test set in each client's current concept, in the rounds it is measured.
    generalized: dict[int, float] = field(default_factory=dict)
    # training replies that came back but were not used: invalid, a client's error, or a
    # partition-id claimed twice (each is logged with its reason)
    rejected: int = 0
    method: dict[str, Any] = field(default_factory=dict)

    @property
    def mean_accuracy(self) -> float:
        """Unweighted mean of the clients' personalized accuracies (the paper's metric)."""
        return float(np.mean(list(self.accuracy.values()))) if self.accuracy else float("nan")

    @property
    def mean_generalized_accuracy(self) -> float:
        """Unweighted mean of the clients' generalized accuracies (FedCCFA's metric)."""
        return float(np.mean(list(self.generalized.values()))) if self.generalized else float("nan")

    @property
    def mean_train_loss(self) -> float:
        """The mean of the training losses the round's sites reported (NaN for none: sites with
        differential privacy withhold theirs)."""
        losses = [m[TRAIN_LOSS] for m in self.train.values() if TRAIN_LOSS in m]
        return float(np.mean(losses)) if losses else float("nan")


@dataclass
class FinalDelivery:
    """Which sites hold the run's final personalized model at its end, by partition-id.

    A deployed site saves the model it evaluates in the last round (``client_app.app``); the
    sites that no evaluation of the last round reached get it in an evaluate message of their
    own after the loop (``PersonalizedStrategy.deliver``). ``accuracy`` is each delivered site's accuracy on its
    own test split (what its ``model.json`` says; None where the site withheld it); ``undelivered``
    are the sites that never got the model (their heads are in final_state.npz)."""

    round: int
    accuracy: dict[int, float | None] = field(default_factory=dict)
    undelivered: list[int] = field(default_factory=list)

    @property
    def delivered(self) -> list[int]:
        return sorted(self.accuracy)

    def summary(self) -> dict:
        """status.json's ``delivery`` entry."""
        return {"round": self.round, "delivered": self.delivered, "undelivered": sorted(self.undelivered),
                "accuracy": {str(pid): self.accuracy[pid] for pid in self.delivered}}


def record_fields(record: RoundRecord) -> dict:
    """``record``'s fields as a dict for JSON, sharing its values: ``dataclasses.asdict``
    deep-copies every nested dict, 400 times slower on a long run's history, for nothing."""
    return {f.name: getattr(record, f.name) for f in fields(record)}


@dataclass(frozen=True)
class RoundTables:
    """One finished round's share of each output table, serialized once."""

    record: RoundRecord
    metrics: str  # its entry in metrics.json's "rounds"
    round_row: str  # its line of rounds.csv
    client_rows: str  # its lines of clients.csv
    method_rows: tuple[str, ...]  # its lines of each of the method's tables (Outputs.tables)


CHART_INTERVAL = 10.0  # seconds between two drawings of a run's charts (the last one always drawn)


class ChartPainter:
    """Draws a run's charts in a background thread, off the rounds' critical path.

    :meth:`submit` hands over the newest history and returns at once; a history not yet drawn
    when a newer one arrives is dropped (the newer one shows all it would have). A drawing
    starts at least ``interval`` seconds after the previous one: the thread shares the
    ServerApp's interpreter lock, and drawing late in a long run takes 0.6 s (20 clients) to
    2 s (100 clients) (``bench/report_writes.py``), so with rounds of 1.5 s on a GPU a chart per
    round would keep it busy all the time. :meth:`close` draws the newest at once and ends the
    thread (a later :meth:`submit` starts another). The thread is a daemon: a server that dies
    does not wait for a chart.
    """

    def __init__(self, paint: Callable[[list[RoundRecord]], None], interval: float = CHART_INTERVAL) -> None:
        self._paint = paint
        self._interval = interval
        self._ready = threading.Condition()
        self._next: list[RoundRecord] | None = None
        self._thread: threading.Thread | None = None
        self._last_start = -float("inf")  # time.monotonic() when the last drawing started

    def submit(self, rounds: list[RoundRecord]) -> None:
        with self._ready:
            self._next = rounds
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="chart-painter", daemon=True)
                self._thread.start()
            self._ready.notify_all()

    def close(self) -> None:
        """Return once the newest submitted history is drawn, with the thread ended."""
        with self._ready:
            thread, self._thread = self._thread, None
            self._ready.notify_all()
        if thread is not None:
            thread.join()

    def _loop(self) -> None:
        while (rounds := self._take()) is not None:
            self._last_start = time.monotonic()
            try:
                self._paint(rounds)
            except Exception as err:  # pylint: disable=broad-exception-caught  # the next history may draw
                log(WARNING, "could not draw the charts, the run goes on: %s", err)

    def _take(self) -> list[RoundRecord] | None:
        """Wait for a history to draw and for its turn (``interval`` after the last drawing),
        and take it; at once when closed: the newest, or None with nothing left to draw."""
        with self._ready:
            while self._thread is threading.current_thread():
                if self._next is None:
                    self._ready.wait()
                    continue
                wait = self._last_start + self._interval - time.monotonic()
                if wait <= 0:
                    break
                self._ready.wait(wait)
            rounds, self._next = self._next, None
            return rounds


class RunReport:  # pylint: disable=too-many-instance-attributes
    """Collects :class:`RoundRecord` s and keeps the output directory up to date.

    ``outputs`` is what the run's method adds (``ServerPart.outputs``); by default that of the
    registered method the config's ``strategy`` names (none for a name not registered)."""

    def __init__(  # pylint: disable=too-many-arguments
        self, directory: Path, num_rounds: int, group_of: Callable[[int], int], config: dict,
        outputs: Outputs | None = None,
    ) -> None:
        self.directory = directory
        self.num_rounds = num_rounds
        self.group_of = group_of
        self.config = config
        if outputs is None:
            method = METHODS.get(str(config.get("strategy", "")))
            outputs = server_class(method).outputs if method is not None else Outputs()
        self.outputs = outputs
        self.round_columns = round_columns(outputs)
        self.client_columns = client_columns(outputs)
        self.rounds: list[RoundRecord] = []
        self._tables: list[RoundTables] = []
        self._config_json = json.dumps(finite_json(config), separators=(",", ":"), allow_nan=False)
        self._painter = ChartPainter(self.paint)
        directory.mkdir(parents=True, exist_ok=True)
        atomic_write(directory / "config.json", json.dumps(config, indent=2).encode())

    def write_status(  # pylint: disable=too-many-arguments
        self, state: str, completed_rounds: int, resume: str, error: str = "", checkpoint: Path | None = None,
        delivery: FinalDelivery | None = None,
    ) -> None:
        """``status.json``: where the run stands, for an operator and for scripts.

        ``state`` is ``running`` (rewritten after every round, so a ``running`` status whose
        ``updated`` time stopped moving is a ServerApp that died, with its SuperLink say),
        ``finished`` or ``failed`` (with the error); ``resume`` continues from ``checkpoint``
        (by default the run's own, in its folder). ``delivery`` says which sites got the final
        model (:class:`FinalDelivery`; ``null`` before the end, and in a simulation, whose
        clients keep no model).
        """
        if checkpoint is None:
            checkpoint = self.directory / "checkpoint.npz"
        status = {
            "state": state, "completed_rounds": completed_rounds, "num_rounds": self.num_rounds,
            "updated": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "checkpoint": str(checkpoint),
            "resume": resume, "error": error,
            "delivery": None if delivery is None else finite_json(delivery.summary()),
        }
        atomic_write(self.directory / "status.json", json.dumps(status, indent=2).encode())

    def add(self, record: RoundRecord) -> None:
        """Log the finished round's line and rewrite every output file."""
        self.rounds.append(record)
        log(INFO, "%s", self.round_line(record))
        self.write()

    def close(self) -> None:
        """Wait until the charts show every round added."""
        self._painter.close()

    def round_line(self, record: RoundRecord) -> str:
        acc = list(record.accuracy.values())
        generalized = (f" | generalized {100 * record.mean_generalized_accuracy:.2f}%"
                       if record.generalized else "")
        rejected = f" ({record.rejected} replies rejected)" if record.rejected else ""
        epsilon = max_epsilon(record)
        privacy = f" | epsilon <= {epsilon:.3g}" if epsilon != "" else ""
        return (
            f"[round {record.round}/{self.num_rounds}] personalized accuracy "
            f"{100 * record.mean_accuracy:.2f}% (min {100 * min(acc, default=float('nan')):.1f}, "
            f"max {100 * max(acc, default=float('nan')):.1f}, {len(acc)} clients){generalized} | "
            f"{len(record.train)} trained{rejected}{_loss(record.mean_train_loss)}"
            f"{self.outputs.log(record)}{privacy} | {record.seconds:.1f}s"
        )

    def privacy_spent(self) -> dict[int, float]:
        """Each site's epsilon as it last reported it: its own ledger's, after the last round it
        trained in (differential privacy on; empty otherwise)."""
        spent: dict[int, float] = {}
        for record in self.rounds:
            for pid, train in record.train.items():
                if DP_EPSILON in train:
                    spent[pid] = float(train[DP_EPSILON])
        return dict(sorted(spent.items()))

    def privacy_line(self, listed: int = 20) -> str:
        """What each site spent, for the run's log ("" without DP): every site's epsilon up to
        ``listed`` sites, the range beyond."""
        spent = self.privacy_spent()
        if not spent:
            return ""
        values = list(spent.values())
        head = (f"Privacy spent by the sites (epsilon at delta = {self.config.get('dp_delta', '?')}, each from its "
                f"own ledger): min {min(values):.3g}, max {max(values):.3g}")
        if len(spent) > listed:
            return f"{head} over {len(spent)} sites (clients.csv: dp_epsilon)"
        return f"{head}; " + ", ".join(f"partition {pid} {epsilon:.3g}" for pid, epsilon in spent.items())

    # ------------------------------------------------------------------ tables

    def metrics_entry(self, r: RoundRecord) -> dict:
        """The round's entry of metrics.json: the record's generic fields, what its method
        recorded (``method``, flattened) and the method's round values marked ``in_metrics``."""
        generic = record_fields(r)
        del generic["method"]
        declared = {c.name: value for c in self.outputs.round_columns
                    if c.in_metrics and (value := c.value(r)) != ""}
        return {
            **r.method, **generic, "mean_accuracy": r.mean_accuracy,
            **({"mean_generalized_accuracy": r.mean_generalized_accuracy} if r.generalized else {}),
            **declared,
            "group": {pid: self.group_of(pid) for pid in sorted(set(r.accuracy) | set(r.train))},
        }

    def client_rows(self, r: RoundRecord) -> list[dict]:
        rows = []
        for pid in sorted(set(r.accuracy) | set(r.train)):
            train = r.train.get(pid, {})
            rows.append({
                "round": r.round, "partition_id": pid, "group": self.group_of(pid),
                "trained": int(pid in r.train), "accuracy": r.accuracy.get(pid, ""),
                "generalized_accuracy": r.generalized.get(pid, ""),
                "test_loss": r.test_loss.get(pid, ""),
                "num_examples": int(train["num-examples"]) if train else "",
                "train_loss": train.get(TRAIN_LOSS, ""),
                "train_seconds": train.get("train-seconds", ""),
                "eval_seconds": r.eval_seconds.get(pid, ""),
                "bytes_sent": r.bytes_sent.get(pid, ""), "bytes_received": r.bytes_received.get(pid, ""),
                "dp_epsilon": train.get(DP_EPSILON, ""),
                **{c.name: c.value(r, pid) for c in self.outputs.client_columns},
            })
        return rows

    def round_row(self, r: RoundRecord) -> dict:
        acc = list(r.accuracy.values())
        return {
            "round": r.round, "mean_accuracy": r.mean_accuracy,
            "min_accuracy": min(acc, default=""), "max_accuracy": max(acc, default=""),
            "mean_generalized_accuracy": r.mean_generalized_accuracy if r.generalized else "",
            "num_evaluated": len(acc), "num_trained": len(r.train),
            "mean_train_loss": "" if np.isnan(r.mean_train_loss) else r.mean_train_loss,
            "bytes_sent": sum(r.bytes_sent.values()), "bytes_received": sum(r.bytes_received.values()),
            "seconds": r.seconds,
            "num_rejected": r.rejected,
            "max_dp_epsilon": max_epsilon(r),
            **{c.name: c.value(r) for c in self.outputs.round_columns},
        }

    @staticmethod
    def _csv(rows: list[dict], columns: tuple[str, ...], header: bool = False) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns, restval="")
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def tables_of(self, r: RoundRecord) -> RoundTables:
        return RoundTables(
            record=r,
            metrics=json.dumps(finite_json(self.metrics_entry(r)), separators=(",", ":"), allow_nan=False),
            round_row=self._csv([self.round_row(r)], self.round_columns),
            client_rows=self._csv(self.client_rows(r), self.client_columns),
            method_rows=tuple(self._csv(table.rows(r), table.columns) for table in self.outputs.tables),
        )

    def _round_tables(self) -> list[RoundTables]:
        """Every round's tables, serializing only the rounds not serialized before (``rounds``
        may also have been replaced, by a resume)."""
        fresh = [
            cached if i < len(self._tables) and (cached := self._tables[i]).record is r else self.tables_of(r)
            for i, r in enumerate(self.rounds)
        ]
        self._tables = fresh
        return fresh

    def write(self) -> None:
        """Rewrite metrics.json, rounds.csv, clients.csv and the method's tables (each once a
        round has rows), then have the charts redrawn in the background (:meth:`paint`)."""
        tables = self._round_tables()
        metrics = (f'{{"config":{self._config_json},"rounds":[{",".join(t.metrics for t in tables)}],'
                   f'"written":{json.dumps(time.time())}}}')
        atomic_write(self.directory / "metrics.json", metrics.encode())
        atomic_write(self.directory / "rounds.csv", self._table(self.round_columns, (t.round_row for t in tables)))
        atomic_write(self.directory / "clients.csv",
                     self._table(self.client_columns, (t.client_rows for t in tables)))
        for i, table in enumerate(self.outputs.tables):
            if any(t.method_rows[i] for t in tables):
                atomic_write(self.directory / table.file,
                             self._table(table.columns, (t.method_rows[i] for t in tables)))
        self._painter.submit(list(self.rounds))

    def _table(self, columns: tuple[str, ...], rows: Iterable[str]) -> bytes:
        return (self._csv([], columns, header=True) + "".join(rows)).encode()

    def paint(self, rounds: Sequence[RoundRecord]) -> None:
        """Draw accuracy.png, and each of the method's charts (``Outputs.charts``) that the rounds
        so far have something to show in, for ``rounds``."""
        self._chart(lambda path: self.plot_accuracy(rounds, path), self.directory / "accuracy.png")
        context = ChartContext(self.group_of, self.config, self.drift_rounds())
        for chart in self.outputs.charts:
            if chart.shown(rounds):
                self._chart(functools.partial(chart.draw, rounds, context), self.directory / chart.file)

    @staticmethod
    def _chart(plot: Callable[[Path], None], path: Path) -> None:
        """``plot(path)``; a failure is logged and the run goes on."""
        try:
            plot(path)
        except Exception as err:  # pylint: disable=broad-exception-caught  # a chart is optional
            log(WARNING, "could not write the chart %s, the run goes on: %s", path, err)

    # ------------------------------------------------------------------ plots

    def plot_accuracy(self, records: Sequence[RoundRecord], path: Path) -> None:
        rounds = [r.round for r in records if r.accuracy]
        fig, ax = figures.new_figure(6, 4)
        if rounds:
            per_round = [np.array(list(r.accuracy.values())) * 100 for r in records if r.accuracy]
            ax.fill_between(rounds, [a.min() for a in per_round], [a.max() for a in per_round],
                            alpha=0.2, label="client min-max")
            ax.plot(rounds, [a.mean() for a in per_round], marker="o", markersize=3, label="mean")
        measured = [r for r in records if r.generalized]
        if measured:
            ax.plot([r.round for r in measured], [100 * r.mean_generalized_accuracy for r in measured],
                    marker="s", markersize=4, linestyle="--", label="generalized (mean)")
        for i, change in enumerate(self.drift_rounds()):
            ax.axvline(change, color="red", linestyle=":", alpha=0.7, label="concept drift" if i == 0 else None)
        ax.set_xlabel("round")
        ax.set_ylabel("personalized test accuracy (%)")
        ax.set_title(str(self.config.get("strategy", "fedpac")))
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right")
        self._save(fig, path)

    def drift_rounds(self) -> tuple[int, ...]:
        """The first rounds of a new concept, for the plot's markers (none without drift)."""
        return tuple(r for r in Drift.from_fields(self.config).change_rounds if r <= self.num_rounds)

    @staticmethod
    def _save(fig: Figure, path: Path) -> None:
        figures.save_figure(fig, path)


def _loss(mean: float) -> str:
    """The round line's loss, or nothing where no site reported one."""
    return "" if np.isnan(mean) else f", loss {mean:.4f}"
