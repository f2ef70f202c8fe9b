"""Scale benchmark: FedPAC with a thousand simulated clients, and where a round's time goes.

1,000 simulated clients of 60 Fashion-MNIST images each (the whole training set), 10 % of them
sampled per round for training and for evaluation, the paper's model and local update, on
Flower's simulation (Ray). Each round's wall time is split into

- client work: every ClientApp call's own time (unpacking, training or evaluating, packing),
  timed inside the Ray workers, spread over the clients that run at once;
- server step: the strategy's own time (configure_train, aggregate_train with FedPAC's QP
  and aggregation, configure_evaluate, aggregate_evaluate), timed in this process;
- framework overhead: the rest (Flower's simulation engine and Ray moving the messages).

A sampler records the peak memory of this process (the ServerApp and the simulation engine,
which hold the state of all clients) and of each Ray worker running ClientApps (RSS, and PSS,
which counts the pages that the workers share, the torch libraries, once).

    python bench/scale.py [--clients 1000] [--fraction 0.1] [--rounds 10] [--samples 60]

Writes bench/results/scale.csv (one row per round), scale.json (summary) and scale.png
(``--results DIR`` elsewhere). Exits non-zero unless every round completed.
"""

from __future__ import annotations

import argparse
import csv
import os
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

from flwr.app import Context, Message
from flwr.clientapp import ClientApp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.memory import descendants, pss_mb, rss_mb  # noqa: E402
from bench.publish import command_line, publish  # noqa: E402
from common import protocol as p  # noqa: E402
from experiments.simulation import make_apps  # noqa: E402
from server_app import simulation_engine  # noqa: E402
from server_app.strategy import PersonalizedStrategy  # noqa: E402

RESULTS = ROOT / "bench" / "results"
SERVER_STEPS = ("configure_train", "aggregate_train", "configure_evaluate", "aggregate_evaluate")


def timed_client(app: ClientApp, log_dir: Path) -> ClientApp:
    """``app`` with each call's wall time appended to a file per worker process in ``log_dir``
    (round, message type, seconds): the workers are Ray's processes, not this one."""
    wrapped = ClientApp()

    def handler(msg: Message, context: Context) -> Message:
        started = time.perf_counter()
        reply = app(msg, context)
        seconds = time.perf_counter() - started
        server_round = int(msg.content[p.CONFIG][p.SERVER_ROUND])
        with (log_dir / f"{os.getpid()}.tsv").open("a") as stream:
            stream.write(f"{server_round}\t{msg.metadata.message_type}\t{seconds:.6f}\n")
        return reply

    wrapped.train()(handler)
    wrapped.evaluate()(handler)
    wrapped.query()(handler)
    return wrapped


def time_server_steps() -> dict[int, float]:
    """Seconds the strategy spends per round, summed over :data:`SERVER_STEPS` (patched here)."""
    spent: dict[int, float] = defaultdict(float)

    def timer(step: Callable[..., Any]) -> Callable[..., Any]:
        def timed(self: PersonalizedStrategy, server_round: int, *args: Any, **kwargs: Any) -> Any:
            started = time.perf_counter()
            try:
                return step(self, server_round, *args, **kwargs)
            finally:
                spent[server_round] += time.perf_counter() - started
        return timed

    for name in SERVER_STEPS:
        setattr(PersonalizedStrategy, name, timer(getattr(PersonalizedStrategy, name)))
    return spent


def clientapp_workers(pid: int) -> list[int]:
    """The Ray workers below ``pid`` that run a ClientApp actor."""
    found = []
    for child in descendants(pid):
        try:
            if Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"ray::ClientAppActor"):
                found.append(child)
        except OSError:
            continue
    return found


class MemorySampler(threading.Thread):
    """Peak memory of this process and of each ClientApp worker, over the whole run. Every 5 s:
    reading the workers' PSS walks their page tables, CPU the rounds would miss (sampled every
    second, it took a tenth of this process's CPU time, counted as framework overhead)."""

    def __init__(self, interval: float = 5.0) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.stop = threading.Event()
        self.server_rss = 0.0
        self.worker_rss = 0.0
        self.worker_pss = 0.0
        self.workers = 0

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            self.server_rss = max(self.server_rss, rss_mb(me))
            workers = clientapp_workers(me)
            self.workers = max(self.workers, len(workers))
            for worker in workers:
                self.worker_rss = max(self.worker_rss, rss_mb(worker))
                self.worker_pss = max(self.worker_pss, pss_mb(worker))
            time.sleep(self.interval)


def client_seconds(log_dir: Path) -> dict[int, float]:
    """Every round's ClientApp time, summed over its calls (queries count for round 0)."""
    spent: dict[int, float] = defaultdict(float)
    for log in log_dir.glob("*.tsv"):
        for line in log.read_text().splitlines():
            server_round, _, seconds = line.split("\t")
            spent[int(server_round)] += float(seconds)
    return spent


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=1000)
    parser.add_argument("--fraction", type=float, default=0.1)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--samples", type=int, default=60, help="training images per client")
    parser.add_argument("--test-samples", type=int, default=10, help="test images per client")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--cpus-per-client", type=float, default=1.0)
    parser.add_argument("--results", type=Path, default=RESULTS, help="folder for scale.csv/.json/.png")
    parser.add_argument("--flower-engine", action="store_true",
                        help="Flower's own message hand-over instead of server_app.simulation_engine's (the before)")
    parser.add_argument("--outputs", type=Path, default=None,
                        help="folder for the run's own outputs (default: a new temporary folder, kept and named)")
    args = parser.parse_args(argv)

    from flwr.simulation import run_simulation  # pylint: disable=import-outside-toplevel

    out = args.outputs or Path(tempfile.mkdtemp(prefix="fedpac-scale-"))
    log_dir = Path(tempfile.mkdtemp(prefix="fedpac-scale-calls-"))
    run_config = {
        "dataset": "fashion-mnist", "samples-per-client": args.samples, "test-samples-per-client": args.test_samples,
        "num-server-rounds": args.rounds, "fraction-train": args.fraction, "fraction-evaluate": args.fraction,
        "full-last-round": False, "min-available-clients": args.clients, "seed": args.seed, "output-dir": str(out),
    }
    if not args.flower_engine:
        simulation_engine.install()
    server_app, client_app = make_apps(run_config)
    server_seconds = time_server_steps()
    sampler = MemorySampler()
    sampler.start()
    started = time.monotonic()
    os.environ["RAY_ADDRESS"] = "local"  # a Ray of its own, even where `ray start` ran
    run_simulation(server_app=server_app, client_app=timed_client(client_app, log_dir), num_supernodes=args.clients,
                   backend_config={"client_resources": {"num_cpus": args.cpus_per_client, "num_gpus": 0.0}})
    wall = time.monotonic() - started
    sampler.stop.set()
    sampler.join()

    (run_dir,) = [d for d in out.iterdir() if d.is_dir()]
    rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
    if len(rounds) != args.rounds:
        raise SystemExit(f"scale: only {len(rounds)} of {args.rounds} rounds completed (outputs in {out})")
    concurrency = sampler.workers
    work = client_seconds(log_dir)
    rows = []
    for record in rounds:
        r = int(record["round"])
        round_wall = float(record["seconds"])
        clients = work[r] / concurrency
        rows.append({
            "round": r, "wall_seconds": round(round_wall, 3), "client_work_seconds": round(clients, 3),
            "server_step_seconds": round(server_seconds[r], 3),
            "overhead_seconds": round(round_wall - clients - server_seconds[r], 3),
            "num_trained": int(record["num_trained"]), "num_evaluated": int(record["num_evaluated"]),
            "mean_accuracy": float(record["mean_accuracy"]),
        })
    steady = rows[1:] or rows  # round 1 also loads the data and builds the partitions in each worker
    median = {key: round(statistics.median(r[key] for r in steady), 3)
              for key in ("wall_seconds", "client_work_seconds", "server_step_seconds", "overhead_seconds")}
    summary = {
        "command": command_line("scale.py", argv),
        "engine": "Flower's" if args.flower_engine else "server_app.simulation_engine",
        "clients": args.clients, "fraction": args.fraction, "rounds": args.rounds, "samples": args.samples,
        "clients_at_once": concurrency, "wall_seconds": round(wall, 1),
        "first_round_seconds": rows[0]["wall_seconds"], "start_up_client_seconds": round(work[0], 1),
        "median_round_after_the_first": median,
        "overhead_share": round(median["overhead_seconds"] / median["wall_seconds"], 3),
        "server_peak_rss_mb": round(sampler.server_rss, 1),
        "worker_peak_rss_mb": round(sampler.worker_rss, 1), "worker_peak_pss_mb": round(sampler.worker_pss, 1),
        "accuracy_first_round": rows[0]["mean_accuracy"], "accuracy_last_round": rows[-1]["mean_accuracy"],
        "outputs": str(run_dir),
    }
    publish(args.results, "scale", rows, summary)
    plot(rows, args.results / "scale.png")


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib  # pylint: disable=import-outside-toplevel

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # pylint: disable=import-outside-toplevel

    rounds = [r["round"] for r in rows]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = [0.0] * len(rows)
    for key, label in (("client_work_seconds", "client work (spread over the workers)"),
                       ("server_step_seconds", "server step"), ("overhead_seconds", "framework overhead")):
        values = [max(0.0, r[key]) for r in rows]
        ax.bar(rounds, values, bottom=bottom, label=label)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("round")
    ax.set_ylabel("seconds")
    ax.set_title(f"FedPAC, {rows[0]['num_trained']} of the clients per round: where a round's time goes")
    ax.legend()
    ax.grid(alpha=0.3, axis="y")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
