"""Benchmark: head-only epochs on features extracted once, against a forward pass per batch.

``common.training.train_head`` extracts the frozen extractor's features once and runs the head's
epochs on them; before, every batch of every epoch ran the extractor again
(:func:`head_epochs_per_batch`, kept here as the baseline and as the reference of
``tests/test_train.py``). The methods that train a head alone for several epochs gain most:

* FedRep's local update: ``fedrep-head-epochs`` (10) head epochs, then 5 body epochs;
* FedAvg-FT's evaluation: ``finetune-epochs`` (5) head epochs before every evaluation;
* FedPAC's local update (1 head epoch): nothing to gain, shown so that a loss would be seen.

Both variants run alternately, several times, in one process, on one client's data (600
Fashion-MNIST-sized samples by default); the ratio of medians is reported.

    python bench/head_epochs.py [--device cpu|cuda] [--repeats 5] [--dataset mnist-5k]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import common.methods.baselines.client as baselines_client  # noqa: E402
import common.methods.fedpac.client as fedpac_client  # noqa: E402
from common import protocol as p  # noqa: E402
from common.config import FedPACConfig, parse_run_config  # noqa: E402
from common.data import load_dataset, run_normalization, to_tensors  # noqa: E402
from common.methods import METHODS  # noqa: E402
from common.methods.baselines.client import finetune_head  # noqa: E402
from common.methods.client import LocalData, Received, client_routine  # noqa: E402
from common.model import FedPACNet  # noqa: E402
from common.partition import client_split  # noqa: E402

# The client parts whose ``train_head`` (``common.training``'s, looked up there) the workloads call.
_HEAD_TRAINERS = (baselines_client, fedpac_client)


def head_epochs_per_batch(  # pylint: disable=too-many-arguments
    model: FedPACNet,
    x: torch.Tensor,
    y: torch.Tensor,
    cfg: FedPACConfig,
    generator: torch.Generator,
    epochs: int | None = None,
    lr: float | None = None,
) -> float:
    """``train_head`` as it was: the same batches, steps and loss, with the frozen extractor's
    forward pass repeated for every batch of every epoch."""
    epochs = cfg.head_epochs if epochs is None else epochs
    if epochs == 0:
        return 0.0
    model.train()
    optimizer = torch.optim.SGD(model.head.parameters(), lr=cfg.head_lr if lr is None else lr,
                                momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    total, seen = torch.zeros((), device=x.device), 0
    for _ in range(epochs):
        for idx in torch.randperm(len(x), generator=generator).to(x.device).split(cfg.batch_size):
            with torch.autocast(device_type=x.device.type, dtype=torch.bfloat16, enabled=cfg.mixed_precision):
                with torch.no_grad():
                    features = model.extractor(x[idx])
                loss = F.cross_entropy(model.head(features).float(), y[idx])
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.detach() * len(idx)
            seen += len(idx)
    return float(total / seen)


@contextlib.contextmanager
def _per_batch_heads():
    """Every workload's head epochs as :func:`head_epochs_per_batch`, while inside."""
    with contextlib.ExitStack() as stack:
        for module in _HEAD_TRAINERS:
            stack.enter_context(mock.patch.object(module, "train_head", head_epochs_per_batch))
        yield


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def _workloads(cfg_of: Callable[[str], FedPACConfig], x: torch.Tensor, y: torch.Tensor):
    """(name, head epochs per call, a callable running it on a fresh model) per workload."""
    def run_update(strategy: str) -> Callable[[FedPACNet, int], object]:
        cfg = cfg_of(strategy)
        received = Received(sections={p.CENTROIDS: {
            p.CENTROID_VALUES: torch.randn(cfg.num_classes, 128).numpy(),
            p.CENTROID_MASK: torch.ones(cfg.num_classes, dtype=torch.bool).numpy()}})
        routine, data = client_routine(METHODS[strategy]), LocalData(x, y, x, y)
        return lambda model, seed: routine.local_update(model, data, received, cfg, torch.Generator().manual_seed(seed))

    finetune_cfg = cfg_of("fedavg-ft")
    return [
        ("fedrep local update", cfg_of("fedrep").fedrep_head_epochs, run_update("fedrep")),
        ("fedavg-ft fine-tuning", finetune_cfg.finetune_epochs,
         lambda model, seed: finetune_head(model, x, y, finetune_cfg, torch.Generator().manual_seed(seed))),
        ("fedpac local update", cfg_of("fedpac").head_epochs, run_update("fedpac")),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--dataset", default="mnist-5k")
    parser.add_argument("--out", default="bench/results/head_epochs.json")
    args = parser.parse_args()
    device = torch.device(args.device)

    def cfg_of(strategy: str) -> FedPACConfig:
        # the paper grid's recipes (experiments/grids/fmnist-paper.toml)
        extra = {"fedrep": {"fedrep-head-epochs": 10, "fedrep-body-epochs": 5},
                 "fedavg-ft": {"finetune-epochs": 5}}.get(strategy, {})
        return parse_run_config({"dataset": args.dataset, "strategy": strategy, **extra})

    cfg = cfg_of("fedpac")
    data = load_dataset(cfg)
    split = client_split(cfg, 0, 10)
    x, y = to_tensors(data.train_images[split.train_indices], split.train_labels,
                      *run_normalization(cfg, data), device)
    rows = []
    for name, head_epochs, work in _workloads(cfg_of, x, y):
        timings: dict[str, list[float]] = {"extracted once": [], "per batch": []}
        for repeat in range(args.repeats + 1):  # the first repeat warms up caches and kernels
            for variant in timings:
                torch.manual_seed(repeat)
                model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes).to(device)
                patch = _per_batch_heads()
                _sync(device)
                started = time.perf_counter()
                if variant == "per batch":
                    with patch:
                        work(model, repeat)
                else:
                    work(model, repeat)
                _sync(device)
                if repeat > 0:
                    timings[variant].append(time.perf_counter() - started)
        once, per_batch = (statistics.median(timings[k]) for k in ("extracted once", "per batch"))
        rows.append({"workload": name, "head_epochs": head_epochs, "extracted_once_s": once,
                     "per_batch_s": per_batch, "speed-up": per_batch / once, "timings_s": timings})
        print(f"{name} ({head_epochs} head epochs): {per_batch * 1000:.0f} ms -> {once * 1000:.0f} ms, "
              f"{per_batch / once:.2f}x", flush=True)
    result = {
        "device": str(device) if device.type == "cpu" else torch.cuda.get_device_name(device),
        "torch_threads": torch.get_num_threads(),
        "samples_per_client": len(x),
        "repeats": args.repeats,
        "workloads": rows,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
