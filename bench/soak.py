"""Soak benchmark: many simulated clients, random client failures, memory per round.

100 simulated clients, 30 % sampled per round, 30 rounds, and 10 % of all train/evaluate calls
failing at random (the ClientApp raises, which reaches the server as an error reply). The run
must complete, accuracy must still rise, and memory must stay flat: a sampler thread records
the peak resident memory of this process (the ServerApp and Flower's simulation engine) and of
all its child processes (Ray's workers running the ClientApps) between two rounds.

    python bench/soak.py [--clients 100] [--fraction 0.3] [--rounds 30] [--failure-rate 0.1]

Writes bench/results/soak.csv (one row per round), soak.json (summary) and soak.png
(``--results DIR`` elsewhere). Exits non-zero unless every round completed.
"""

from __future__ import annotations

import argparse
import csv
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memory import descendants, rss_mb  # noqa: E402
from bench.publish import command_line, publish  # noqa: E402
from common import protocol as p  # noqa: E402
from experiments.simulation import make_apps  # noqa: E402

RESULTS = ROOT / "bench" / "results"


class InjectedFailure(RuntimeError):
    """The failure this benchmark injects into a ClientApp call."""


def flaky(app: ClientApp, rate: float, seed: int) -> ClientApp:
    """``app`` with a share ``rate`` of its train/evaluate calls raising, drawn per (seed,
    round, message type, partition-id) so that a run's failures are reproducible."""
    wrapped = ClientApp()

    def handler(msg: Message, context: Context) -> Message:
        server_round = int(msg.content[p.CONFIG][p.SERVER_ROUND])
        pid = int(context.node_config["partition-id"])
        draw = random.Random(f"{seed}/{server_round}/{msg.metadata.message_type}/{pid}").random()
        if draw < rate:
            raise InjectedFailure(f"injected failure: round {server_round}, partition {pid}")
        return app(msg, context)

    wrapped.train()(handler)
    wrapped.evaluate()(handler)
    wrapped.query()(app)  # the pre-flight stays reliable: it is not what this measures
    return wrapped


class MemorySampler(threading.Thread):
    """Peak RSS of this process and of all processes below it, reset at every new line of rounds.csv."""

    def __init__(self, out: Path, interval: float = 0.5) -> None:
        super().__init__(daemon=True)
        self.out, self.interval = out, interval
        self.rows: list[dict] = []
        self.stop = threading.Event()
        self._peak_self = self._peak_children = 0.0

    def _rounds_written(self) -> list[dict]:
        files = list(self.out.glob("*/rounds.csv"))
        return list(csv.DictReader(files[0].open())) if files else []

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            self._peak_self = max(self._peak_self, rss_mb(me))
            self._peak_children = max(self._peak_children, sum(rss_mb(c) for c in descendants(me)))
            rounds = self._rounds_written()
            for row in rounds[len(self.rows):]:
                self.rows.append({
                    "round": int(row["round"]),
                    "mean_accuracy": float(row["mean_accuracy"]),
                    "num_trained": int(row["num_trained"]),
                    "num_evaluated": int(row["num_evaluated"]),
                    "seconds": float(row["seconds"]),
                    "server_peak_rss_mb": round(self._peak_self, 1),
                    "workers_peak_rss_mb": round(self._peak_children, 1),
                })
                self._peak_self = self._peak_children = 0.0
            time.sleep(self.interval)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=100)
    parser.add_argument("--fraction", type=float, default=0.3)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--failure-rate", type=float, default=0.1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for soak.csv/.json/.png")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="folder for the run's own outputs (default: a new temporary folder, kept and named)")
    args = parser.parse_args(argv)

    from flwr.simulation import run_simulation  # pylint: disable=import-outside-toplevel

    out = args.outputs or Path(tempfile.mkdtemp(prefix="fedpac-soak-"))
    run_config = {
        "num-server-rounds": args.rounds, "fraction-train": args.fraction, "fraction-evaluate": args.fraction,
        "min-available-clients": args.clients, "seed": args.seed, "output-dir": str(out),
        # 100 clients x 600 samples exceed the embedded 3,500 images: smaller clients, as in
        # the paper's 100-client setting where clients overlap
        "samples-per-client": 200, "test-samples-per-client": 100,
    }
    server_app, client_app = make_apps(run_config)
    # the failures happen in Ray's worker processes: the server's counts below tell how many
    client_app = flaky(client_app, args.failure_rate, args.seed)
    sampler = MemorySampler(out)
    sampler.start()
    started = time.monotonic()
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}})
    wall = time.monotonic() - started
    time.sleep(2 * sampler.interval)
    sampler.stop.set()
    sampler.join()
    rows = sampler.rows
    if len(rows) != args.rounds:
        raise SystemExit(f"soak: only {len(rows)} of {args.rounds} rounds completed (outputs in {out})")

    sampled = max(1, round(args.fraction * args.clients))
    # every client trains in the last round (full-last-round); evaluation always samples
    expected = [args.clients if r["round"] == args.rounds else sampled for r in rows]
    missing_train = sum(e - r["num_trained"] for e, r in zip(expected, rows))
    missing_eval = sum(sampled - r["num_evaluated"] for r in rows)
    summary = {
        "command": command_line("soak.py", argv),
        "clients": args.clients, "fraction": args.fraction, "rounds": args.rounds,
        "failure_rate": args.failure_rate, "wall_seconds": round(wall, 1),
        "train_replies_missing": missing_train, "train_calls": sum(expected),
        "evaluate_replies_missing": missing_eval, "evaluate_calls": sampled * len(rows),
        "accuracy_first_round": rows[0]["mean_accuracy"], "accuracy_last_round": rows[-1]["mean_accuracy"],
        "server_peak_rss_mb": {"first_5_rounds": max(r["server_peak_rss_mb"] for r in rows[:5]),
                               "last_5_rounds": max(r["server_peak_rss_mb"] for r in rows[-5:])},
        "workers_peak_rss_mb": {"first_5_rounds": max(r["workers_peak_rss_mb"] for r in rows[:5]),
                                "last_5_rounds": max(r["workers_peak_rss_mb"] for r in rows[-5:])},
        "outputs": str(out),
    }
    publish(args.results, "soak", rows, summary)
    plot(rows, args.results / "soak.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    rounds = [r["round"] for r in rows]
    fig, (acc, mem) = plt.subplots(1, 2, figsize=(11, 4))
    acc.plot(rounds, [100 * r["mean_accuracy"] for r in rows], marker=".")
    acc.set(xlabel="round", ylabel="mean personalized accuracy (%)", title="accuracy under 10 % failures")
    mem.plot(rounds, [r["server_peak_rss_mb"] for r in rows], label="server process")
    mem.plot(rounds, [r["workers_peak_rss_mb"] for r in rows], label="Ray workers (all)")
    mem.set(xlabel="round", ylabel="peak RSS in the round (MB)", title="memory per round")
    mem.set_ylim(bottom=0)
    mem.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


if __name__ == "__main__":
    main()
