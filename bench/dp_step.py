"""Benchmark: one DP-SGD step of the product's CNN, clipped by ``common.privacy.ClippedGradients``,
against Opacus's per-sample-gradient hooks (how the product clipped before) and a plain step.

Opacus's hooks form every record's gradient of every layer, then clip and sum them: at the DP
recipe's batch of 1,024 that is a (1024, 128, 800) tensor for the extractor's last layer alone.
``ClippedGradients`` reads each linear layer's clipped sum off its input and output gradient
without forming it (ghost clipping), and forms a convolution's per-record gradients as one
grouped convolution. All three variants take the same steps on the same batches (the first two
give the same clipped sums to float32 rounding); each runs alternately, several times, in one
process; the ratios of medians are reported.

    python bench/dp_step.py [--batch 1024] [--repeats 5] [--part model|extractor|head] [--device cpu|cuda]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common import privacy  # noqa: E402
from common.model import FedPACNet  # noqa: E402

MAX_NORM = 1.0


def opacus_clipped_sums(module: nn.Module, loss: Callable[[], torch.Tensor], batch: int) -> list[torch.Tensor]:
    """The clipped sums as the product computed them before: Opacus's hooks, every record's
    gradient formed, then clipped and summed."""
    from opacus.grad_sample import GradSampleHooks  # pylint: disable=import-outside-toplevel

    hooks = GradSampleHooks(module, loss_reduction="mean")
    hooks.enable_hooks()
    try:
        loss().backward()
        per_sample = [p.grad_sample for p in module.parameters() if p.requires_grad]  # type: ignore[attr-defined]
    finally:
        hooks.remove_hooks()
    factors = privacy.clip_factors(privacy.per_sample_norms(per_sample), MAX_NORM)
    sums = [privacy.clipped_sum(factors, g) for g in per_sample]
    for param in module.parameters():
        param.grad_sample = None  # type: ignore[attr-defined]
    return sums


def clipped_sums(module: nn.Module, loss: Callable[[], torch.Tensor], batch: int) -> list[torch.Tensor]:
    with privacy.ClippedGradients(module) as clipped:
        loss().backward()
        return clipped.clipped_sums(MAX_NORM, batch)


def plain_gradients(module: nn.Module, loss: Callable[[], torch.Tensor], batch: int) -> list[torch.Tensor]:
    loss().backward()
    return [p.grad for p in module.parameters() if p.requires_grad]  # type: ignore[misc]


def workload(part: str, batch: int, device: torch.device) -> tuple[nn.Module, Callable[[], torch.Tensor]]:
    """The trained module and the minibatch's mean loss: the whole model (FedAvg, FedPer, Local),
    the extractor under a frozen head (FedPAC, FedRep), or the head on frozen features."""
    torch.manual_seed(0)
    model = FedPACNet(1, 28, 10).to(device)
    x = torch.randn(batch, 1, 28, 28, device=device)
    y = torch.randint(0, 10, (batch,), device=device)
    if part == "head":
        with torch.no_grad():
            features = model.extractor(x)
        return model.head, lambda: F.cross_entropy(model.head(features), y)
    if part == "extractor":
        model.head.requires_grad_(False)
        return model.extractor, lambda: F.cross_entropy(model(x), y)
    return model, lambda: F.cross_entropy(model(x), y)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--part", choices=("model", "extractor", "head"), default="model")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    device = torch.device(args.device)
    module, loss = workload(args.part, args.batch, device)
    variants = {"opacus hooks": opacus_clipped_sums, "clipped gradients": clipped_sums, "plain step": plain_gradients}
    reference = clipped_sums(module, loss, args.batch)
    before = opacus_clipped_sums(module, loss, args.batch)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(reference, before))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(args.repeats):
        for name, step in variants.items():
            module.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.synchronize()
            started = time.perf_counter()
            step(module, loss, args.batch)
            if device.type == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - started)
    medians = {name: statistics.median(t) for name, t in times.items()}
    print(json.dumps({
        "part": args.part, "batch": args.batch, "device": args.device, "repeats": args.repeats,
        "median_seconds": {name: round(t, 4) for name, t in medians.items()},
        "opacus_over_clipped": round(medians["opacus hooks"] / medians["clipped gradients"], 2),
        "clipped_over_plain": round(medians["clipped gradients"] / medians["plain step"], 2),
        "largest_relative_difference_of_the_sums": worst,
    }, indent=1))


if __name__ == "__main__":
    main()
