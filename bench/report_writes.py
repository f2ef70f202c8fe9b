"""What a finished round's outputs cost the server, late in a long run.

After every round the server rewrites metrics.json, rounds.csv, clients.csv and the charts
(`server_app/report.py`). This bench builds a history of ``--rounds`` rounds of ``--clients``
clients (FedPAC-shaped records: per-client train metrics, accuracies, the alpha matrix) and
times, in the same run, adding its last round two ways:

* **history rewritten** (how every round's outputs were written before): every round's tables
  serialized again, then every chart drawn, before the next round may start;
* **as the server does now**: only the new round serialized (the tables of finished rounds are
  kept), and the charts drawn by the background painter while the next round trains; the time
  until the charts are on disk is reported too.

    python bench/report_writes.py --rounds 200 --clients 20 --clients 100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from server_app.report import RoundRecord, RunReport  # noqa: E402


def history(rounds: int, clients: int, seed: int = 0) -> list[RoundRecord]:
    rng = np.random.default_rng(seed)
    records = []
    for t in range(1, rounds + 1):
        alpha = rng.dirichlet(np.ones(clients), size=clients)
        records.append(RoundRecord(
            round=t, started=0.0, seconds=float(rng.uniform(5, 10)),
            train={pid: {"num-examples": 600.0, "train-loss": float(rng.random()), "head-loss": float(rng.random()),
                         "v": float(rng.random()), "train-seconds": 0.8} for pid in range(clients)},
            accuracy={pid: float(rng.random()) for pid in range(clients)},
            test_loss={pid: float(rng.random()) for pid in range(clients)},
            eval_seconds={pid: 0.05 for pid in range(clients)},
            bytes_sent={pid: 944_259 for pid in range(clients)},
            bytes_received={pid: 480_347 for pid in range(clients)},
            method={"alpha_partitions": list(range(clients)), "alpha": alpha.tolist(),
                    "solver_status": ["ok"] * clients, "centroid_classes": 10},
        ))
    return records


def measure(rounds: int, clients: int, repeats: int) -> dict[str, float]:
    records = history(rounds, clients)
    rewritten, now, charts = [], [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as directory:
            report = RunReport(Path(directory), rounds, lambda pid: pid % 5, {"strategy": "fedpac"})
            report.rounds = records[:-1]
            report.write()
            report.close()

            started = time.perf_counter()
            report.add(records[-1])
            now.append(time.perf_counter() - started)
            report.close()
            charts.append(time.perf_counter() - started)

            started = time.perf_counter()
            report._tables = []  # pylint: disable=protected-access  # every round's tables again
            report.write()
            report.close()
            rewritten.append(time.perf_counter() - started)
    result = {"rounds": rounds, "clients": clients, "history_rewritten_s": statistics.median(rewritten),
              "now_critical_path_s": statistics.median(now), "now_until_charts_s": statistics.median(charts)}
    result["speed-up"] = result["history_rewritten_s"] / result["now_critical_path_s"]
    return result


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--rounds", type=int, default=200)
    cli.add_argument("--clients", type=int, action="append", help="repeatable; default 20 and 100")
    cli.add_argument("--repeats", type=int, default=3)
    cli.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "report_writes.json")
    args = cli.parse_args()
    results = [measure(args.rounds, clients, args.repeats) for clients in args.clients or [20, 100]]
    for r in results:
        print(f"{r['clients']:4d} clients, round {r['rounds']}: history rewritten {r['history_rewritten_s']:.3f} s; "
              f"now {r['now_critical_path_s']:.3f} s before the next round may start "
              f"({r['speed-up']:.0f}x less), charts on disk after {r['now_until_charts_s']:.3f} s")
    args.out.write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
