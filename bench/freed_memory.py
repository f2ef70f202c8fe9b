"""Benchmark: a local update with glibc's default memory policy against one that keeps freed memory.

glibc gives every block of 128 kB or more a mapping of its own and returns it to the kernel on
free, so every batch of a local update faults its activations' pages in again and the kernel
zeroes them (``common.cpu.keep_freed_memory``, which every ClientApp process calls). Each setting
runs in a fresh process (the policy is per process), alternately, several times; every process
does a few local updates on one client's data with one torch thread, as a ClientApp does, and
reports the page faults and seconds of each update after the first (which finds the heap empty).

    python bench/freed_memory.py [--dataset fashion-mnist] [--repeats 3] [--updates 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# One process: ``keep`` or not, then ``updates`` local updates of FedPAC on one client's data
# (a dataset partition, or random images when ``dataset`` is empty); prints a JSON line.
_UPDATES = """
import json, resource, sys, time, torch
sys.path.insert(0, {root!r})
from common import protocol as p
from common.config import parse_run_config
from common.methods import METHODS
from common.methods.client import LocalData, Received, client_routine
from common.cpu import keep_freed_memory
from common.model import FedPACNet
torch.set_num_threads(1)
kept = {keep} and keep_freed_memory()
cfg = parse_run_config({{"dataset": {dataset!r} or "mnist-5k", "local-epochs": {epochs}}})
if {dataset!r}:
    from common.data import load_dataset, run_normalization, to_tensors
    from common.partition import client_split
    data = load_dataset(cfg)
    split = client_split(cfg, 0, {clients})
    x, y = to_tensors(data.train_images[split.train_indices], split.train_labels,
                      *run_normalization(cfg, data), torch.device("cpu"))
else:
    x, y = torch.randn(400, 1, 28, 28), torch.arange(400) % 10
received = Received(sections={{p.CENTROIDS: {{p.CENTROID_VALUES: torch.randn(cfg.num_classes, 128).numpy(),
                                             p.CENTROID_MASK: torch.ones(cfg.num_classes, dtype=torch.bool).numpy()}}}})
routine = client_routine(METHODS[cfg.strategy])
faults, seconds = [], []
for seed in range({updates}):
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
    before, started = resource.getrusage(resource.RUSAGE_SELF).ru_minflt, time.perf_counter()
    routine.local_update(model, LocalData(x, y, x, y), received, cfg, torch.Generator().manual_seed(seed))
    seconds.append(time.perf_counter() - started)
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
print(json.dumps({{"kept": kept, "samples": len(x), "faults": faults[1:], "seconds": seconds[1:]}}))
"""


def update_costs(keep: bool, dataset: str = "", updates: int = 5, epochs: int = 5,
                 clients: int = 20) -> dict:
    """Page faults and seconds of each local update after the first, in a fresh process that
    keeps its freed memory or not (``kept`` says whether the setting took there)."""
    code = _UPDATES.format(root=str(ROOT), keep=keep, dataset=dataset, updates=updates, epochs=epochs,
                           clients=clients)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    cli.add_argument("--dataset", default="fashion-mnist")
    cli.add_argument("--repeats", type=int, default=3, help="processes per setting, alternating")
    cli.add_argument("--updates", type=int, default=5, help="local updates per process (the first is not counted)")
    cli.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "freed_memory.json")
    args = cli.parse_args()
    runs: dict[str, list[dict]] = {"default": [], "kept": []}
    for _ in range(args.repeats):
        for name in runs:
            runs[name].append(update_costs(name == "kept", args.dataset, args.updates))
    result: dict = {"dataset": args.dataset, "samples": runs["default"][0]["samples"], "repeats": args.repeats,
                    "updates_per_process": args.updates - 1}
    for name, measured in runs.items():
        result[name] = {
            "setting_took": all(run["kept"] for run in measured) if name == "kept" else None,
            "median_faults_per_update": statistics.median(f for run in measured for f in run["faults"]),
            "median_seconds_per_update": statistics.median(s for run in measured for s in run["seconds"]),
        }
    result["speed_ratio"] = (result["default"]["median_seconds_per_update"]
                             / result["kept"]["median_seconds_per_update"])
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    for name in runs:
        print(f"{name:8s} {result[name]['median_seconds_per_update']:.3f} s and "
              f"{result[name]['median_faults_per_update']:,.0f} page faults per local update")
    print(f"keeping freed memory: {result['speed_ratio']:.2f}x the default's speed ({result['samples']} samples, "
          f"one torch thread)")


if __name__ == "__main__":
    main()
