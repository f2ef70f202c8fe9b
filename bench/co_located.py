"""Benchmark: N client processes training at once on a host with C < N cores, against C at a time.

Every process is a warm ClientApp's worth of state (the Fashion-MNIST paper protocol: 600
samples, E = 5, one torch thread) and does the same local updates; the processes start, load
their data, then wait for one signal so that only the training is timed. Reported: the wall
time of ``--updates`` local updates spread over ``--clients`` processes that all train at once
(what co-located SuperNodes do without host slots), and the same number of updates done by
``--slots`` processes (what ``warm_executor.py --host-slots`` lets run at once).

    python bench/co_located.py --clients 20 --slots 2
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CLIENT = r"""
import sys, time
import client_app.app as ca
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
cfg = parse_run_config({"dataset": sys.argv[2]})
data = LocalData(*ca.client_tensors(cfg, 0, 20, ca.select_device("cpu")))
model = ca.FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
routine = client_routine(METHODS[cfg.strategy])
print("ready", flush=True)
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    routine.local_update(model, data, Received(), cfg, ca._generator(cfg, 1, 0))
print("done", flush=True)
"""


def timed_wave(processes: int, updates_each: int, dataset: str) -> float:
    """Seconds from the start signal until ``processes`` processes did ``updates_each`` updates."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    clients = [subprocess.Popen([sys.executable, "-c", _CLIENT, str(updates_each), dataset], cwd=ROOT, env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(processes)]
    for client in clients:
        assert client.stdout is not None and client.stdout.readline().strip() == "ready"
    started = time.perf_counter()
    for client in clients:
        assert client.stdin is not None
        client.stdin.write("go\n")
        client.stdin.flush()
    for client in clients:
        assert client.stdout is not None and client.stdout.readline().strip() == "done"
        client.wait()
    return time.perf_counter() - started


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--clients", type=int, default=20)
    cli.add_argument("--slots", type=int, default=os.cpu_count() or 1)
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--out", type=Path, default=ROOT / "bench" / "results")
    args = cli.parse_args()
    if args.clients % args.slots:
        cli.error("--clients must be a multiple of --slots (the same updates in both settings)")
    all_at_once = timed_wave(args.clients, 1, args.dataset)
    in_slots = timed_wave(args.slots, args.clients // args.slots, args.dataset)
    result = {"clients": args.clients, "slots": args.slots, "cores": os.cpu_count(),
              "all_at_once_seconds": all_at_once, "in_slots_seconds": in_slots, "ratio": all_at_once / in_slots}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "co_located.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{args.clients} local updates: {all_at_once:.2f} s with {args.clients} processes at once, "
          f"{in_slots:.2f} s with {args.slots} at a time ({result['ratio']:.2f}x)")


if __name__ == "__main__":
    main()
