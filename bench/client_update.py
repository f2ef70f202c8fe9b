"""Benchmark: FedPAC's local update against a plain PyTorch loop over the same epochs and data.

FedPAC's update (common/methods/fedpac/client.py: statistics pass, 1 head epoch, E extractor epochs with
the alignment loss, centroid pass) versus the loop most people would write: a DataLoader over
a TensorDataset and (1 + E) epochs of ordinary SGD on the whole model. Throughput counts the
(1 + E) x n training samples for both, so FedPAC's two extra statistics passes count against it.
Both run alternately, several times, in one process; the ratio of medians is reported.

    python bench/client_update.py [--device cpu|cuda] [--repeats 5] [--mixed-precision]
    python bench/client_update.py --busy      # FedPAC's update, idle vs one core taken
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import protocol as p  # noqa: E402
from common.config import parse_run_config  # noqa: E402
from common.methods import METHODS  # noqa: E402
from common.methods.client import LocalData, Received, client_routine  # noqa: E402
from common.data import load_dataset, run_normalization, to_tensors  # noqa: E402
from load import one_core_taken  # noqa: E402
from common.model import FedPACNet  # noqa: E402
from common.partition import client_split  # noqa: E402


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def fedpac_update(model, x, y, centroids, mask, cfg, generator) -> None:  # noqa: ANN001
    """FedPAC's local update, the global centroids (numpy, as the message carries them) received."""
    received = Received(sections={p.CENTROIDS: {p.CENTROID_VALUES: centroids, p.CENTROID_MASK: mask}})
    client_routine(METHODS[cfg.strategy]).local_update(model, LocalData(x, y, x, y), received, cfg, generator)


def plain_loop(model, x, y, cfg, device) -> None:
    loader = DataLoader(TensorDataset(x, y), batch_size=cfg.batch_size, shuffle=True)
    optimizer = torch.optim.SGD(model.parameters(), lr=cfg.extractor_lr, momentum=cfg.momentum,
                                weight_decay=cfg.weight_decay)
    model.train()
    for _ in range(cfg.head_epochs + cfg.local_epochs):
        for xb, yb in loader:
            loss = F.cross_entropy(model(xb), yb)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    _sync(device)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dataset", default="mnist-5k")
    parser.add_argument("--mixed-precision", action="store_true", help="bfloat16 autocast (GPU)")
    parser.add_argument("--busy", action="store_true", help="FedPAC's update idle vs one core taken")
    parser.add_argument("--out")
    args = parser.parse_args()
    device = torch.device(args.device)
    cfg = parse_run_config({"dataset": args.dataset, "mixed-precision": args.mixed_precision})
    data = load_dataset(cfg)
    split = client_split(cfg, 0, 10)
    x, y = to_tensors(data.train_images[split.train_indices], split.train_labels,
                      *run_normalization(cfg, data), device)
    centroids = torch.randn(cfg.num_classes, 128).numpy()
    mask = torch.ones(cfg.num_classes, dtype=torch.bool).numpy()
    samples = (cfg.head_epochs + cfg.local_epochs) * len(x)
    if args.busy:
        busy(args, cfg, x, y, centroids, mask, samples, device)
        return
    timings: dict[str, list[float]] = {"fedpac": [], "plain": []}
    for repeat in range(args.repeats + 1):  # the first round warms up caches and kernels
        for name in ("fedpac", "plain"):
            torch.manual_seed(repeat)
            model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes).to(device)
            _sync(device)
            started = time.perf_counter()
            if name == "fedpac":
                fedpac_update(model, x, y, centroids, mask, cfg, torch.Generator().manual_seed(repeat))
                _sync(device)
            else:
                plain_loop(model, x, y, cfg, device)
            if repeat > 0:
                timings[name].append(time.perf_counter() - started)
    fedpac, plain = (statistics.median(timings[k]) for k in ("fedpac", "plain"))
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "mixed_precision": cfg.mixed_precision,
        "torch_threads": torch.get_num_threads(),
        "samples_per_client": len(x),
        "epochs": cfg.head_epochs + cfg.local_epochs,
        "fedpac_samples_per_s": samples / fedpac,
        "plain_samples_per_s": samples / plain,
        "ratio": plain / fedpac,
        "fedpac_s": timings["fedpac"],
        "plain_s": timings["plain"],
    }
    print(json.dumps(result, indent=1))
    out = Path(args.out or f"bench/results/client_update{'_amp' if cfg.mixed_precision else ''}"
                          f"{'_' + device.type if device.type != 'cpu' else ''}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


def busy(args, cfg, x, y, centroids, mask, samples, device) -> None:  # noqa: ANN001
    """FedPAC's local update with torch's default threads and with one thread, idle and with one
    core taken by another process, alternating: samples/s (median) of each."""
    default_threads = torch.get_num_threads()
    rows = []
    for threads in sorted({default_threads, 1}, reverse=True):
        for condition in ("idle", "one core taken"):
            times = []
            with one_core_taken() if condition != "idle" else contextlib.nullcontext():
                for repeat in range(args.repeats + 1):
                    torch.manual_seed(repeat)
                    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes).to(device)
                    started = time.perf_counter()
                    torch.set_num_threads(threads)
                    fedpac_update(model, x, y, centroids, mask, cfg, torch.Generator().manual_seed(repeat))
                    _sync(device)
                    if repeat:
                        times.append(time.perf_counter() - started)
            rows.append({"torch_threads": threads, "condition": condition,
                         "samples_per_s": samples / statistics.median(times)})
            print(f"{threads} torch thread(s), {condition}: {rows[-1]['samples_per_s']:,.0f} samples/s", flush=True)
    torch.set_num_threads(default_threads)
    out = Path(args.out or "bench/results/client_update_busy.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
