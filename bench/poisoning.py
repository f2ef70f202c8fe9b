"""Benchmark: one hostile site among ten, with and without the bound on a reply's influence.

Ten sites train FedPAC in-process (the real ServerApp strategy and ClientApp behind
``tests/federation.py``'s grid, no Flower processes) on the embedded MNIST that ``make run``
uses. One site (partition ``--attacker``) answers every round with its update of the shared
parts, the model it sends back minus the one it was sent, changed: ``x1e30`` (which, unbounded,
stalls the run: every site's next training is NaN), ``x10``, ``sign-flip``, or not at all
(``clean``). Each attack runs under each
setting: ``on`` (the defaults: ``max-norm-ratio`` 3, the weighted mean, agreeing head mixes),
``off`` (``max-norm-ratio = 0``: what the product did before the bound), ``median``,
``trimmed-mean`` (the bound on, and the robust aggregator for the averaged parts),
``mixes-unguarded`` (the bound on, FedPAC's head mixes as the QP gives them: ``agreeing-heads =
false``).

Per run: whether it completed (else the round it stopped after, and why), the other sites' mean
final personalized accuracy and its difference from the clean run of the same setting, the
replies scaled down, the seconds the bound took per round, and the run's time. Over the clean
runs: each honest update's norm over the median of the others' (part by part), the margin the
default ratio leaves.

    python bench/poisoning.py                                          # 4 attacks x bound on / off
    python bench/poisoning.py --settings on off median --rounds 10
    python bench/poisoning.py --attacks clean x1e30 --rounds 3 --set local-epochs=1   # a quick look
    python bench/poisoning.py --cost-only          # the bound's time on one honest round of 10 and 100 replies
"""

from __future__ import annotations

import argparse
import csv
import json
import logging
import re
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import cast

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from flwr.app import Message, MessageType  # noqa: E402
from flwr.serverapp import Grid  # noqa: E402

from bench.publish import command_line, publish  # noqa: E402
from common import protocol as p  # noqa: E402
from common.averaging import median_of_others  # noqa: E402
from common.config import parse_run_config  # noqa: E402
from common.methods.server import ServerPart  # noqa: E402
from federation import InProcessGrid, set_task_identity  # noqa: E402
from server_app.app import run_fedpac  # noqa: E402
from server_app.report import RunReport  # noqa: E402

# What the hostile site does to its update u = (model it sends back) - (model it was sent), and
# to which parts of it (the arrays whose names start with one of them).
Change = Callable[[np.ndarray], np.ndarray]
ATTACKS: dict[str, tuple[Change, tuple[str, ...]] | None] = {
    "clean": None,
    "x1e30": (lambda update: 1e30 * update, ("extractor", "head")),
    "x10": (lambda update: 10.0 * update, ("extractor", "head")),
    "sign-flip": (lambda update: -update, ("extractor", "head")),
    # where a sign flip does its harm: its extractor (averaged) or its head (mixed by FedPAC)
    "sign-flip-extractor": (lambda update: -update, ("extractor",)),
    "sign-flip-head": (lambda update: -update, ("head",)),
}
SETTINGS: dict[str, dict[str, object]] = {
    "on": {},
    "off": {"max-norm-ratio": 0.0},
    "median": {"shared-aggregation": "median"},
    "trimmed-mean": {"shared-aggregation": "trimmed-mean"},
    "mixes-unguarded": {"agreeing-heads": False},  # the bound on, FedPAC's mixes as the QP gives them
}
CLIENTS = 10
PARTS = ("extractor", "head")


class AttackedGrid(InProcessGrid):
    """An in-process federation in which partition ``attacker`` changes its update of the shared
    parts ``parts`` with ``change`` in every training reply (``None``: an honest run). It also
    records each honest reply's update norm by part and round, measured before any change."""

    def __init__(self, run_config: dict, num_partitions: int, attacker: int, change: Change | None,
                 parts: tuple[str, ...] = PARTS) -> None:
        super().__init__(run_config, num_partitions, tamper=self._tamper)
        self.attacker = attacker
        self.change = change
        self.parts = tuple(f"{part}." for part in parts)
        self.train_round = 0
        self._sent: dict[int, p.NDArrays] = {}  # node -> the model its last train message carried
        self.norms: dict[tuple[int, str], dict[int, float]] = {}  # (round, part) -> partition -> norm

    def send_and_receive(self, messages, *, timeout=None):  # noqa: ANN001, ANN201
        messages = list(messages)
        if messages and messages[0].metadata.message_type == MessageType.TRAIN:
            self.train_round += 1
            self._sent = {m.metadata.dst_node_id: p.sections_of(m.content)[p.MODEL] for m in messages}
        return super().send_and_receive(messages, timeout=timeout)

    def _tamper(self, reply: Message, pid: int) -> Message:
        if reply.metadata.message_type != MessageType.TRAIN or not reply.has_content() or reply.has_error():
            return reply
        sections = p.sections_of(reply.content)
        sent = self._sent[reply.metadata.src_node_id]
        model = sections[p.MODEL]
        updates = {key: np.subtract(value, sent[key], dtype=np.float64) for key, value in model.items()}
        for part in PARTS:
            squares = [float(np.sum(u * u)) for key, u in updates.items() if key.startswith(f"{part}.")]
            if squares and pid != self.attacker:
                self.norms.setdefault((self.train_round, part), {})[pid] = float(np.sqrt(sum(squares)))
        if pid == self.attacker and self.change is not None:
            with np.errstate(over="ignore", invalid="ignore"):  # x1e30 of an update that is already large
                sections[p.MODEL] = {key: (sent[key] + self.change(update)).astype(model[key].dtype)
                                     if key.startswith(self.parts) else model[key] for key, update in updates.items()}
            reply.content[p.ARRAYS] = p.pack(sections)
        return reply

    def norm_ratios(self) -> dict[str, list[float]]:
        """Each honest update's norm over the median of the other honest updates' norms, by part,
        over every round (with at least two replies)."""
        ratios: dict[str, list[float]] = {part: [] for part in PARTS}
        for (_, part), by_partition in sorted(self.norms.items()):
            norms = np.array(list(by_partition.values()))
            if len(norms) >= 2:
                ratios[part] += (norms / median_of_others(norms)).tolist()
        return ratios


class ScaledReplies(logging.Handler):
    """Counts the server's log lines that say a reply was scaled down (``strategy._bounded``: one
    per partition and part; ``ServerPart.class_means``: one per round), by partition."""

    SCALED = re.compile(r"partition (\d+)'s (\w+) update has norm .* scaled down")

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.updates: dict[int, int] = {}  # partition -> part updates scaled down
        self.class_means = 0

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        scaled = self.SCALED.search(message)
        if scaled:
            pid = int(scaled.group(1))
            self.updates[pid] = self.updates.get(pid, 0) + 1
        elif "report class means over max-norm-ratio" in message:
            self.class_means += 1


class BoundTimer:
    """The CPU seconds ``ServerPart.bound`` takes, summed over a run (patched in while it runs)."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.calls = 0
        self._original = ServerPart.bound

    def __enter__(self) -> BoundTimer:
        original, timer = self._original, self

        def timed(server, state, updates):  # noqa: ANN001, ANN202
            start = time.thread_time()  # its own CPU time: other processes on the machine do not count
            try:
                return original(server, state, updates)
            finally:
                timer.seconds += time.thread_time() - start
                timer.calls += 1

        ServerPart.bound = timed  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        ServerPart.bound = self._original  # type: ignore[method-assign]


def final_accuracies(run_dir: Path) -> tuple[int, dict[int, float]]:
    """The last evaluated round of a run folder's clients.csv and its accuracy by partition."""
    rows = [r for r in csv.DictReader((run_dir / "clients.csv").open()) if r["accuracy"] not in ("", "nan")]
    if not rows:
        return 0, {}
    last = max(int(r["round"]) for r in rows)
    return last, {int(r["partition_id"]): float(r["accuracy"]) for r in rows if int(r["round"]) == last}


def run_one(attack: str, setting: str, args: argparse.Namespace, scratch: Path) -> tuple[dict, AttackedGrid]:
    """One federation under ``attack`` and ``setting``; its row of the table."""
    out = scratch / f"{attack}-{setting}"
    config: dict[str, object] = {"num-server-rounds": args.rounds, "seed": args.seed, "output-dir": str(out),
                                 **args.overrides, **SETTINGS[setting]}
    cfg = parse_run_config(config)
    change, parts = ATTACKS[attack] or (None, PARTS)
    grid = AttackedGrid(config, CLIENTS, args.attacker, change, parts)
    counter = ScaledReplies()
    logging.getLogger("flwr").addHandler(counter)
    error, alpha, order = "", [], []
    start = time.perf_counter()
    try:
        set_task_identity()
        with BoundTimer() as timer:
            _, report = run_fedpac(cast(Grid, grid), cfg, 1)
        alpha, order = report.rounds[-1].method.get("alpha", []), report.rounds[-1].method.get("alpha_partitions", [])
    except Exception as err:  # pylint: disable=broad-except  # the run's failure is the measurement
        error = f"{type(err).__name__}: {str(err).splitlines()[0][:160]}"
    finally:
        logging.getLogger("flwr").removeHandler(counter)
    seconds = time.perf_counter() - start
    (run_dir,) = list(out.iterdir())
    last, accuracy = final_accuracies(run_dir)
    honest = [a for pid, a in accuracy.items() if pid != args.attacker]
    rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
    return {
        "attack": attack,
        "setting": setting,
        "completed": not error and len(rounds) == args.rounds,
        "rounds_completed": len(rounds),
        # rounds that left the model as it was: too few valid training replies
        "rounds_without_update": sum(int(r["num_trained"] or 0) < cfg.min_train_replies for r in rounds),
        "error": error,
        "last_evaluated_round": last,
        "honest_accuracy": statistics.mean(honest) if honest else float("nan"),
        "accuracy_by_partition": " ".join(f"{pid}:{a:.3f}" for pid, a in sorted(accuracy.items())),
        # FedPAC: the weight of the hostile site's head in each other site's mix in the last round
        # (alpha's rows and columns are the round's replies, alpha_partitions their partitions)
        "attacker_head_weights": " ".join(
            f"{pid}:{row[order.index(args.attacker)]:.3f}" for pid, row in zip(order, alpha)
            if pid != args.attacker and args.attacker in order and row[order.index(args.attacker)] > 0),
        "honest_evaluated": len(honest),
        "rejected_replies": sum(int(r["num_rejected"] or 0) for r in rounds),
        # the hostile site's part updates scaled down, and the honest sites' (partition:count)
        "scaled_updates": counter.updates.get(args.attacker, 0),
        "honest_scaled_updates": " ".join(f"{pid}:{count}" for pid, count in sorted(counter.updates.items())
                                          if pid != args.attacker),
        "scaled_class_means_rounds": counter.class_means,
        "bound_ms_per_round": 1000 * timer.seconds / max(1, timer.calls),
        "seconds": seconds,
    }, grid


def bound_cost(replies: int, repeats: int = 5) -> dict[str, float]:
    """The server's time for the bound on one round of ``replies`` honest FedPAC replies of the
    default model (none over the bound: what it costs when nobody is hostile), best of
    ``repeats``, beside the sample-weighted average of their extractors it precedes."""
    from common.config import configured_method
    from common.methods.server import Update, server_part
    from common.model import split_state
    from server_app.app import initial_model

    cfg = parse_run_config({})
    extractor, head = split_state({k: v.numpy() for k, v in initial_model(cfg).state_dict().items()})
    server = server_part(configured_method(cfg), cfg, extractor, head)
    state = server.initial_state()
    rng = np.random.default_rng(0)

    def trained(part: p.NDArrays) -> p.NDArrays:
        return {k: v + (0.01 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in part.items()}

    updates = [Update(partition_id=i, extractor=trained(extractor), head=trained(head), num_examples=600, metrics={})
               for i in range(replies)]
    weights = np.full(replies, 600.0)

    def best(work: Callable[[], object]) -> float:
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            work()
            times.append(time.perf_counter() - start)
        return min(times)

    bound = best(lambda: server.bound(state, updates))
    assert not server.bound(state, updates)[1], "an honest reply was scaled"
    average = best(lambda: server.average([u.extractor for u in updates], weights))
    return {"replies": replies, "bound_ms": 1000 * bound, "extractor_average_ms": 1000 * average}


def markdown(rows: list[dict]) -> str:
    """The table for docs/RELIABILITY.md."""
    lines = ["| attack | setting | completed | honest sites' final accuracy | vs clean | hostile updates scaled down "
             "| honest ones (partition:count) |",
             "|---|---|---|---|---|---|---|"]
    clean = {r["setting"]: r["honest_accuracy"] for r in rows if r["attack"] == "clean"}
    for r in rows:
        done = "yes" if r["completed"] else f"no: {r['error'].split(':')[0]} after round {r['rounds_completed']}"
        if r["rounds_without_update"]:
            done += f" ({r['rounds_without_update']} rounds without a valid reply)"
        accuracy = r["honest_accuracy"]
        shown = "none valid" if accuracy != accuracy else f"{100 * accuracy:.2f} % (round {r['last_evaluated_round']})"
        delta = "" if r["attack"] == "clean" or accuracy != accuracy or r["setting"] not in clean \
            else f"{100 * (accuracy - clean[r['setting']]):+.2f}"
        lines.append(f"| {r['attack']} | {r['setting']} | {done} | {shown} | {delta} | {r['scaled_updates']} "
                     f"| {r['honest_scaled_updates'] or 0} |")
    return "\n".join(lines)


def parse_set(items: list[str]) -> dict[str, object]:
    import tomllib

    overrides: dict[str, object] = {}
    for item in items:
        overrides.update(tomllib.loads(item))
    return overrides


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--attacks", nargs="+", choices=list(ATTACKS), default=list(ATTACKS)[:4])
    parser.add_argument("--settings", nargs="+", choices=list(SETTINGS), default=["on", "off"])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--attacker", type=int, default=3, help="the hostile site's partition-id")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--set", dest="sets", action="append", default=[],
                        help="a run-config key=value (TOML), repeatable")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--results", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--name", default="poisoning")
    parser.add_argument("--cost-only", action="store_true",
                        help="only time the bound on one honest round of 10 and of 100 replies")
    args = parser.parse_args(argv)
    args.overrides = parse_set(args.sets)
    torch.set_num_threads(args.threads)
    cost = [bound_cost(replies) for replies in (10, 100)]
    if args.cost_only:
        print(json.dumps(cost, indent=1))
        return 0
    RunReport.paint = lambda self, rounds: None  # type: ignore[method-assign]  # charts: not measured
    rows, ratios = [], {part: [] for part in PARTS}
    with tempfile.TemporaryDirectory() as scratch:
        for setting in args.settings:
            for attack in args.attacks:
                row, grid = run_one(attack, setting, args, Path(scratch))
                if attack == "clean":
                    for part, values in grid.norm_ratios().items():
                        ratios[part] += values
                rows.append(row)
                print(f"{attack:>9} {setting:>12}: completed {row['completed']}, honest accuracy "
                      f"{row['honest_accuracy']:.4f}, {row['scaled_updates']} scaled (honest: "
                      f"{row['honest_scaled_updates'] or 0}), {row['seconds']:.0f}s {row['error']}", flush=True)
    summary = {
        "command": command_line("poisoning.py", argv),
        "clients": CLIENTS, "rounds": args.rounds, "attacker": args.attacker, "run_config": args.overrides,
        "honest_norm_over_others_median": {
            part: {"max": max(values), "p99": float(np.percentile(values, 99)), "median": float(np.median(values)),
                   "count": len(values)}
            for part, values in ratios.items() if values},
        "bound_cost": cost,
        "table": markdown(rows),
        "runs": rows,
    }
    publish(args.results, args.name, rows, summary)
    print(summary["table"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
