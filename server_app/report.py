"""Run outputs: per-round records, metrics as JSON and CSV, accuracy, alpha and cluster plots.

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
import io
import json
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, fields
from logging import INFO, WARNING
from pathlib import Path

import numpy as np
from flwr.supercore import log
from matplotlib import colormaps
from matplotlib.figure import Figure

from common.drift import Drift
from common.files import atomic_write
from common.protocol import RHO, TRAIN_LOSS

CLIENT_COLUMNS = (
    "round", "partition_id", "group", "trained", "accuracy", "generalized_accuracy", "test_loss",
    "num_examples", "v", "head_loss", "train_loss", "align_loss", "align_weight", "train_seconds",
    "eval_seconds", "bytes_sent", "bytes_received", "solver_status", "local_accuracy", "rho", "aggregated",
)
ROUND_COLUMNS = (
    "round", "mean_accuracy", "min_accuracy", "max_accuracy", "mean_generalized_accuracy", "num_evaluated",
    "num_trained", "mean_train_loss", "qp_fallbacks", "centroid_classes", "mean_clusters_per_class",
    "bytes_sent", "bytes_received", "seconds", "mean_local_accuracy", "num_aggregated", "num_rejected",
)
CLUSTER_COLUMNS = ("round", "class", "partition_id", "cluster")


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
    """Everything measured in one round, per client keyed by partition-id."""

    round: int
    started: float
    seconds: float = 0.0
    train: dict[int, dict[str, float]] = field(default_factory=dict)
    alpha_partitions: list[int] = field(default_factory=list)
    alpha: list[list[float]] = field(default_factory=list)
    solver_status: list[str] = field(default_factory=list)
    accuracy: dict[int, float] = field(default_factory=dict)
    test_loss: dict[int, float] = field(default_factory=dict)
    eval_seconds: dict[int, float] = field(default_factory=dict)
    bytes_sent: dict[int, int] = field(default_factory=dict)
    bytes_received: dict[int, int] = field(default_factory=dict)
    centroid_classes: int = 0
    # The whole test set in each client's current concept, in the rounds it is measured.
    generalized: dict[int, float] = field(default_factory=dict)
    # Clustered heads (FedCCFA): clusters[c][i] is the cluster of client cluster_partitions[i]
    # for class c (-1: the class is absent on that client).
    cluster_partitions: list[int] = field(default_factory=list)
    clusters: list[list[int]] = field(default_factory=list)
    # Methods that aggregate a sample (pFedVEM): the round's S_t, and the partitions of S_t whose
    # replies entered the base and the global head
    sampled: list[int] = field(default_factory=list)
    aggregated: list[int] = field(default_factory=list)
    # training replies that came back but were not used: invalid, a client's error, or a
    # partition-id claimed twice (each is logged with its reason)
    rejected: int = 0

    @property
    def mean_accuracy(self) -> float:
        """Unweighted mean of the clients' personalized accuracies (the paper's metric)."""
        return float(np.mean(list(self.accuracy.values()))) if self.accuracy else float("nan")

    @property
    def mean_generalized_accuracy(self) -> float:
        """Unweighted mean of the clients' generalized accuracies (FedCCFA's metric)."""
        return float(np.mean(list(self.generalized.values()))) if self.generalized else float("nan")

    @property
    def mean_local_accuracy(self) -> float:
        """Unweighted mean of the locally trained models' accuracies, measured in the train step
        before aggregation (pFedVEM's own evaluation); NaN for methods that do not measure it."""
        local = [m["local-accuracy"] for m in self.train.values() if "local-accuracy" in m]
        return float(np.mean(local)) if local else float("nan")

    @property
    def clusters_per_class(self) -> list[int]:
        """How many clusters each class has this round (absent clients not counted)."""
        return [len({label for label in labels if label >= 0}) for labels in self.clusters]

    @property
    def mean_train_loss(self) -> float:
        losses = [m[TRAIN_LOSS] for m in self.train.values()]
        return float(np.mean(losses)) if losses else float("nan")

    @property
    def qp_fallbacks(self) -> int:
        """Clients whose QP no solver could do (they kept their own head)."""
        return sum(status.startswith("fallback") for status in self.solver_status)


@dataclass
class FinalDelivery:
    """Which sites hold the run's final personalized model at its end, by partition-id.

    A deployed site saves the model it evaluates in the last round (``client_app.app``); the
    sites that no evaluation of the last round reached get it in an evaluate message of their
    own after the loop (``PersonalizedStrategy.deliver``). ``accuracy`` is each delivered site's accuracy on its
    own test split (what its ``model.json`` says); ``undelivered`` are the sites that never got
    the model (their heads are in final_state.npz)."""

    round: int
    accuracy: dict[int, float] = field(default_factory=dict)
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
    cluster_rows: str  # its lines of clusters.csv


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


class RunReport:
    """Collects :class:`RoundRecord` s and keeps the output directory up to date."""

    def __init__(self, directory: Path, num_rounds: int, group_of: Callable[[int], int], config: dict) -> None:
        self.directory = directory
        self.num_rounds = num_rounds
        self.group_of = group_of
        self.config = config
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
        local = (f" | local models before aggregation {100 * record.mean_local_accuracy:.2f}%"
                 if np.isfinite(record.mean_local_accuracy) else "")
        sample = f" | aggregated {record.aggregated} of S_t {record.sampled}" if record.sampled else ""
        clusters = (f" | clusters per class {record.clusters_per_class}" if record.clusters else "")
        rejected = f" ({record.rejected} replies rejected)" if record.rejected else ""
        return (
            f"[round {record.round}/{self.num_rounds}] personalized accuracy "
            f"{100 * record.mean_accuracy:.2f}% (min {100 * min(acc, default=float('nan')):.1f}, "
            f"max {100 * max(acc, default=float('nan')):.1f}, {len(acc)} clients){generalized}{local} | "
            f"{len(record.train)} trained{rejected}, loss {record.mean_train_loss:.4f} | "
            f"QP fallbacks {record.qp_fallbacks}{clusters}{sample} | {record.seconds:.1f}s"
        )

    # ------------------------------------------------------------------ tables

    def metrics_entry(self, r: RoundRecord) -> dict:
        return {
            **record_fields(r), "mean_accuracy": r.mean_accuracy,
            **({"mean_generalized_accuracy": r.mean_generalized_accuracy} if r.generalized else {}),
            **({"mean_local_accuracy": r.mean_local_accuracy} if np.isfinite(r.mean_local_accuracy) else {}),
            "group": {pid: self.group_of(pid) for pid in sorted(set(r.accuracy) | set(r.train))},
        }

    def client_rows(self, r: RoundRecord) -> list[dict]:
        status = dict(zip(r.alpha_partitions, r.solver_status))
        rows = []
        for pid in sorted(set(r.accuracy) | set(r.train)):
            train = r.train.get(pid, {})
            rows.append({
                "round": r.round, "partition_id": pid, "group": self.group_of(pid),
                "trained": int(pid in r.train), "accuracy": r.accuracy.get(pid, ""),
                "generalized_accuracy": r.generalized.get(pid, ""),
                "test_loss": r.test_loss.get(pid, ""),
                "num_examples": int(train["num-examples"]) if train else "",
                "v": train.get("v", ""), "head_loss": train.get("head-loss", ""),
                "train_loss": train.get(TRAIN_LOSS, ""), "align_loss": train.get("align-loss", ""),
                "align_weight": train.get("align-weight", ""),
                "train_seconds": train.get("train-seconds", ""),
                "eval_seconds": r.eval_seconds.get(pid, ""),
                "bytes_sent": r.bytes_sent.get(pid, ""), "bytes_received": r.bytes_received.get(pid, ""),
                "solver_status": status.get(pid, ""),
                "local_accuracy": train.get("local-accuracy", ""), "rho": train.get("rho", ""),
                "aggregated": int(pid in r.aggregated) if r.sampled and train else "",
            })
        return rows

    @staticmethod
    def round_row(r: RoundRecord) -> dict:
        acc = list(r.accuracy.values())
        return {
            "round": r.round, "mean_accuracy": r.mean_accuracy,
            "min_accuracy": min(acc, default=""), "max_accuracy": max(acc, default=""),
            "mean_generalized_accuracy": r.mean_generalized_accuracy if r.generalized else "",
            "num_evaluated": len(acc), "num_trained": len(r.train),
            "mean_train_loss": r.mean_train_loss if r.train else "",
            "qp_fallbacks": r.qp_fallbacks,
            "centroid_classes": r.centroid_classes,
            "mean_clusters_per_class": float(np.mean(r.clusters_per_class)) if r.clusters else "",
            "bytes_sent": sum(r.bytes_sent.values()), "bytes_received": sum(r.bytes_received.values()),
            "seconds": r.seconds,
            "mean_local_accuracy": r.mean_local_accuracy if np.isfinite(r.mean_local_accuracy) else "",
            "num_aggregated": len(r.aggregated) if r.sampled else "",
            "num_rejected": r.rejected,
        }

    @staticmethod
    def cluster_rows(r: RoundRecord) -> list[dict]:
        return [
            {"round": r.round, "class": c, "partition_id": pid, "cluster": label}
            for c, labels in enumerate(r.clusters)
            for pid, label in zip(r.cluster_partitions, labels)
        ]

    @staticmethod
    def _csv(rows: list[dict], columns: tuple[str, ...], header: bool = False) -> str:
        buffer = io.StringIO()
        writer = csv.DictWriter(buffer, fieldnames=columns)
        if header:
            writer.writeheader()
        writer.writerows(rows)
        return buffer.getvalue()

    def tables_of(self, r: RoundRecord) -> RoundTables:
        return RoundTables(
            record=r,
            metrics=json.dumps(finite_json(self.metrics_entry(r)), separators=(",", ":"), allow_nan=False),
            round_row=self._csv([self.round_row(r)], ROUND_COLUMNS),
            client_rows=self._csv(self.client_rows(r), CLIENT_COLUMNS),
            cluster_rows=self._csv(self.cluster_rows(r), CLUSTER_COLUMNS),
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
        """Rewrite metrics.json, rounds.csv, clients.csv (and clusters.csv for clustered heads),
        then have the charts redrawn in the background (:meth:`paint`)."""
        tables = self._round_tables()
        metrics = (f'{{"config":{self._config_json},"rounds":[{",".join(t.metrics for t in tables)}],'
                   f'"written":{json.dumps(time.time())}}}')
        atomic_write(self.directory / "metrics.json", metrics.encode())
        atomic_write(self.directory / "rounds.csv", self._table(ROUND_COLUMNS, (t.round_row for t in tables)))
        atomic_write(self.directory / "clients.csv", self._table(CLIENT_COLUMNS, (t.client_rows for t in tables)))
        if any(r.clusters for r in self.rounds):
            atomic_write(self.directory / "clusters.csv",
                         self._table(CLUSTER_COLUMNS, (t.cluster_rows for t in tables)))
        self._painter.submit(list(self.rounds))

    def _table(self, columns: tuple[str, ...], rows: Iterable[str]) -> bytes:
        return (self._csv([], columns, header=True) + "".join(rows)).encode()

    def paint(self, rounds: Sequence[RoundRecord]) -> None:
        """Draw accuracy.png, and alpha.png (mixed heads), clusters.png (clustered heads) or
        confidence.png (pFedVEM's confidences) for ``rounds``."""
        self._chart(lambda path: self.plot_accuracy(rounds, path), self.directory / "accuracy.png")
        latest = next((r for r in reversed(rounds) if r.alpha), None)
        if latest is not None:
            self._chart(lambda path: self.plot_alpha(latest, path), self.directory / "alpha.png")
        if any(r.clusters for r in rounds):
            self._chart(lambda path: self.plot_clusters(rounds, path), self.directory / "clusters.png")
        if any(RHO in m for r in rounds for m in r.train.values()):
            self._chart(lambda path: self.plot_confidence(rounds, path), self.directory / "confidence.png")

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
        fig, ax = _figure(6, 4)
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

    def plot_clusters(self, records: Sequence[RoundRecord], path: Path) -> None:
        """Clusters per class over the rounds, one row per class and one column per round (a
        line per class over hundreds of rounds is unreadable): how the clients' concepts of
        each class split at a drift and merge again."""
        measured = [r for r in records if r.clusters]
        num_classes, last = len(measured[-1].clusters), records[-1].round
        counts = np.full((num_classes, last), np.nan)
        for r in measured:
            counts[: len(r.clusters), r.round - 1] = r.clusters_per_class
        most = max(2, int(np.nanmax(counts)))
        fig, ax = _figure(6, 4)
        image = ax.imshow(counts, aspect="auto", interpolation="nearest", origin="lower",
                          extent=(0.5, last + 0.5, -0.5, num_classes - 0.5),
                          cmap=colormaps["viridis"].resampled(most), vmin=0.5, vmax=most + 0.5)
        fig.colorbar(image, ax=ax, ticks=range(1, most + 1), label="clusters")
        for change in self.drift_rounds():
            ax.axvline(change - 0.5, color="red", linestyle=":", alpha=0.9)
        ax.set_yticks(range(num_classes))
        ax.set_xlabel("round (red: concept drift)" if self.drift_rounds() else "round")
        ax.set_ylabel("class")
        ax.set_title(f"{self.config.get('strategy', '')}: clusters of clients per class")
        self._save(fig, path)

    def plot_confidence(self, records: Sequence[RoundRecord], path: Path) -> None:
        """Each client's confidence 1/rho^2 over the rounds (pFedVEM: its weight in the prior
        mean), with the median over the clients; log scale when they span more than a decade."""
        per_round = [(r.round, {pid: 1.0 / m[RHO] ** 2 for pid, m in r.train.items() if RHO in m and m[RHO] > 0})
                     for r in records]
        per_round = [(t, confidences) for t, confidences in per_round if confidences]
        series: dict[int, list[tuple[int, float]]] = {}
        for t, confidences in per_round:
            for pid, confidence in confidences.items():
                series.setdefault(pid, []).append((t, confidence))
        fig, ax = _figure(6, 4)
        for points in series.values():
            ax.plot(*zip(*points), linewidth=0.8, alpha=0.5)
        ax.plot([t for t, _ in per_round], [float(np.median(list(c.values()))) for _, c in per_round],
                color="black", linewidth=2, label=f"median of {len(series)} clients")
        values = [v for _, confidences in per_round for v in confidences.values()]
        if values and max(values) > 10 * min(values):  # a log scale only where it spans decades
            ax.set_yscale("log")
        ax.set_xlabel("round")
        ax.set_ylabel("confidence 1 / rho^2")
        ax.set_title(f"{self.config.get('strategy', '')}: client confidences")
        ax.grid(alpha=0.3, which="both")
        ax.legend(loc="best")
        self._save(fig, path)

    def plot_alpha(self, record: RoundRecord, path: Path) -> None:
        """The client-to-client combination weights, clients ordered by group (paper Fig. 2-3)."""
        plot_alpha(record.alpha, record.alpha_partitions, record.round, self.group_of, path)

    @staticmethod
    def _save(fig: Figure, path: Path) -> None:
        save_figure(fig, path)


def _figure(width: float, height: float):  # noqa: ANN202
    """A figure and its axes outside pyplot's global registry, so that the chart thread can
    draw while the server goes on."""
    fig = Figure(figsize=(width, height))
    return fig, fig.subplots()


def save_figure(fig: Figure, path: Path) -> None:
    """Render ``fig`` to PNG and write it atomically."""
    buffer = io.BytesIO()
    fig.tight_layout()
    fig.savefig(buffer, format="png", dpi=110)
    atomic_write(path, buffer.getvalue())


def plot_alpha(  # pylint: disable=too-many-arguments
    alpha: list[list[float]],
    pids: list[int],
    round_number: int,
    group_of: Callable[[int], int],
    path: Path,
    title: str | None = None,
) -> None:
    """Heatmap of combination weights (row i: alpha_i over the heads of clients j), clients
    ordered by group so that the groups show as blocks (paper Fig. 2-3)."""
    order = sorted(range(len(pids)), key=lambda i: (group_of(pids[i]), pids[i]))
    matrix = np.asarray(alpha)[np.ix_(order, order)]
    labels = [f"{pids[i]} (g{group_of(pids[i])})" for i in order]
    size = max(4.0, 0.3 * len(pids) + 2)
    fig, ax = _figure(size + 1, size)
    image = ax.imshow(matrix, cmap="viridis", vmin=0.0, vmax=max(matrix.max(), 1e-9))
    fig.colorbar(image, ax=ax, label="alpha_ij")
    if len(pids) <= 40:
        ax.set_xticks(range(len(pids)), labels, rotation=90, fontsize=7)
        ax.set_yticks(range(len(pids)), labels, fontsize=7)
    ax.set_xlabel("head of client j")
    ax.set_ylabel("client i")
    ax.set_title(title or f"combination weights, round {round_number}")
    save_figure(fig, path)
