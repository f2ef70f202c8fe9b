"""Benchmark: a whole simulated federation, and where its round time goes.

Runs FedPAC through `flwr run` (deploy/simulate.sh) and reads the run's own outputs:
round wall time (server side, train + evaluate phases) against the client-side compute it
contains (train-seconds + eval-seconds, measured inside each ClientApp call). Also reports
payload bytes per client and round.

    python bench/federation.py --clients 20 --rounds 10 --dataset fashion-mnist [--cpus-per-client 1]
    python bench/federation.py --run-dir outputs/<run>      # analyse an existing run
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import tempfile
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(args) -> Path:
    out = Path(tempfile.mkdtemp(prefix="fedpac-bench-"))
    config = (f"dataset='{args.dataset}' num-server-rounds={args.rounds} output-dir='{out}' "
              f"seed={args.seed}")
    env = {**os.environ, "FLWR_DISABLE_RUNTIME_DEPENDENCY_INSTALLATION": "1"}
    subprocess.run(
        ["flwr", "run", str(ROOT), "--stream", "--run-config", config, "--federation-config",
         f"num-supernodes={args.clients} client-resources-num-cpus={args.cpus_per_client}"],
        check=True, env=env, stdout=subprocess.DEVNULL,
    )
    (run_dir,) = list(out.iterdir())
    return run_dir


def analyse(run_dir: Path, concurrency: float) -> dict:
    rounds = list(csv.DictReader((run_dir / "rounds.csv").open()))
    clients = list(csv.DictReader((run_dir / "clients.csv").open()))
    compute: dict[int, float] = defaultdict(float)
    sent: dict[int, list[int]] = defaultdict(list)
    received: dict[int, list[int]] = defaultdict(list)
    for row in clients:
        r = int(row["round"])
        compute[r] += float(row["train_seconds"] or 0) + float(row["eval_seconds"] or 0)
        if row["bytes_sent"]:
            sent[r].append(int(row["bytes_sent"]))
            received[r].append(int(row["bytes_received"]))
    steady = [r for r in rounds if int(r["round"]) > 1]  # round 1 includes start-up
    wall = statistics.median(float(r["seconds"]) for r in steady)
    work = statistics.median(compute[int(r["round"])] for r in steady)
    return {
        "run_dir": str(run_dir),
        "rounds": len(rounds),
        "first_round_s": float(rounds[0]["seconds"]),
        "median_round_s": wall,
        "median_client_compute_s": work,
        "wall_over_compute": wall / work,
        "concurrency": concurrency,
        "wall_over_compute_per_worker": wall / (work / concurrency),
        "final_mean_accuracy": float(rounds[-1]["mean_accuracy"]),
        "bytes_sent_per_client_round": statistics.median(b for r in sent.values() for b in r),
        "bytes_received_per_client_round": statistics.median(b for r in received.values() for b in r),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--run-dir")
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--dataset", default="fashion-mnist")
    parser.add_argument("--cpus-per-client", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="bench/results/federation.json")
    args = parser.parse_args()
    run_dir = Path(args.run_dir) if args.run_dir else run(args)
    concurrency = max(1.0, (os.cpu_count() or 1) / args.cpus_per_client)
    result = analyse(run_dir, min(concurrency, args.clients))
    print(json.dumps(result, indent=1))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
