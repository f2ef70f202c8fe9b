"""Benchmark: where DP costs FedPAC its accuracy on the DP recipe's protocol, the head or the extractor.

On one good extractor, trained without DP on the ten sites' pooled data (a stand-in for the
extractor the federation averages), each site of ``experiments/grids/fmnist-dp-recipe.toml``
gets a head in three ways, and its personalized test accuracy is measured:

* ``no DP``: 10 epochs of the head alone (one a round for 10 rounds, as FedPAC trains it),
  batches of 1,024 at step 0.5 with momentum 0.9, without DP (and a head from exact statistics);
* ``clipped, no noise``: DP-SGD's Poisson batches and per-record clipping, and the clipped
  features of the statistics, without noise: what the rows below add is the noise alone;
* ``dp-sgd``: the same steps as DP-SGD at the gradients' noise multiplier of an epsilon
  (``common.training.train_head`` inside ``common.privacy.private_site``, the product's code);
* ``statistics``: no training, a linear head made of the class statistics the site releases
  anyway (the product's ``class_feature_sums`` at the statistics' noise multiplier, 10 times the
  gradients'): the class means mu_k and a pooled variance s^2 give the Gaussian classifier
  w_k = mu_k / s^2, b_k = -||mu_k||^2 / (2 s^2) + log p_k, on features clipped as the sums were
  (s^2 with the sums' noise taken off; one release, where FedPAC releases its statistics every round).

The noise multipliers are the ones FedPAC's sites calibrated in the published grid (10 rounds):
9.664, 3.684 and 1.717 for epsilon 1, 3 and 8. If the DP-SGD head stays close to the noiseless
one, the head is not where the privacy goes.

    python bench/dp_head.py [--epochs 2] [--out bench/results/dp_head.json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client_app.app import client_tensors  # noqa: E402
from common import privacy  # noqa: E402
from common.config import parse_run_config  # noqa: E402
from common.model import initial_model  # noqa: E402
from common.statistics import class_feature_sums  # noqa: E402
from common.training import evaluate_head, train_head  # noqa: E402

SITES = 10
# the grid's run config (experiments/grids/fmnist-dp-recipe.toml)
RUN_CONFIG = {"dataset": "fashion-mnist", "partition": "fedpac", "samples-per-client": 6000,
              "test-samples-per-client": 1000, "extractor-front-end": "scatternet", "seed": 0,
              "batch-size": 1024, "head-lr": 0.5, "momentum": 0.9, "weight-decay": 0.0}
SIGMAS = {"epsilon 1": 9.664, "epsilon 3": 3.684, "epsilon 8": 1.717}
HEAD_EPOCHS = 10
FEATURE_CLIP = 5.0


def site_data(cfg, device: torch.device) -> list[tuple[torch.Tensor, ...]]:  # noqa: ANN001
    """Each site's data as its ClientApp reads it (through the ScatterNet front end)."""
    return [client_tensors(cfg, pid, SITES, device) for pid in range(SITES)]


def pooled_model(cfg, sites, epochs: int):  # noqa: ANN001, ANN201
    """The extractor (and a head) trained without DP on every site's records together."""
    model = initial_model(1, 28, 10, cfg.seed, "scatternet")
    x, y = torch.cat([s[0] for s in sites]), torch.cat([s[1] for s in sites])
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.5, weight_decay=5e-4)
    generator = torch.Generator().manual_seed(cfg.seed)
    for _ in range(epochs):
        order = torch.randperm(len(x), generator=generator)
        for start in range(0, len(x), 64):
            idx = order[start:start + 64]
            optimizer.zero_grad()
            F.cross_entropy(model(x[idx]), y[idx]).backward()
            optimizer.step()
    return model


def statistics_head(model, x: torch.Tensor, y: torch.Tensor) -> None:  # noqa: ANN001
    """Set ``model.head`` to the Gaussian classifier of the class statistics (released with noise
    when a private site is active)."""
    sums = class_feature_sums(model.extractor, x, y, model.num_classes)
    counts = sums.counts.clamp(min=1.0)
    means = sums.sums / counts[:, None]
    d = means.shape[1]
    # sum_k n_k ||mu_k||^2 = sum_k ||S_k||^2 / n_k, and each noisy ||S_k||^2 carries d s^2 of noise
    between = ((sums.sums.square().sum(1) - d * sums.sums_noise_std ** 2) / counts).sum()
    variance = ((sums.sq_norm_sums.sum() - between) / (counts.sum() * d)).clamp(min=1e-3)
    prior = (counts / counts.sum()).clamp(min=1e-4)
    with torch.no_grad():
        model.head.weight.copy_((means / variance).float())
        model.head.bias.copy_((-means.square().sum(1) / (2 * variance) + prior.log()).float())


def site_accuracy(model, head_of: str, sigma: float | None, site: tuple[torch.Tensor, ...], pid: int, cfg) -> float:  # noqa: ANN001
    x, y, x_test, y_test = site
    settings = privacy.PrivacySettings(noise_multiplier=sigma or 0.0, statistics_noise_multiplier=10 * (sigma or 0.0),
                                       feature_clip=FEATURE_CLIP, max_grad_norm=1.0, batch_size=1024,
                                       step_size=0.5, momentum=0.9)
    torch.manual_seed(pid)
    model.head.reset_parameters()
    generator = torch.Generator().manual_seed(pid)
    # sigma None: the same schedule without a private site (no clipping, no noise, shuffled
    # batches); sigma 0: DP-SGD's clipping and Poisson batches, and clipped features, without noise
    with privacy.private_site(settings, noise_seed=1000 + pid) if sigma is not None else contextlib.nullcontext():
        if head_of == "statistics":
            statistics_head(model, x, y)
        else:
            train_head(model, x, y, cfg, generator, epochs=HEAD_EPOCHS)
    with torch.no_grad():
        features = model.extractor.eval()(x_test)
    if head_of == "statistics" and sigma is not None:  # the sums it was made of were of clipped features
        features = privacy.clip_features(features, FEATURE_CLIP)
    return evaluate_head(model.head, features, y_test)[1]


def main() -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--epochs", type=int, default=2, help="epochs of the pooled extractor")
    cli.add_argument("--out", type=Path, default=Path(__file__).parent / "results" / "dp_head.json")
    cli.add_argument("--threads", type=int, default=1, help="torch threads (1: no spinning beside other work)")
    args = cli.parse_args()
    torch.set_num_threads(args.threads)
    cfg = parse_run_config(RUN_CONFIG)
    sites = site_data(cfg, torch.device("cpu"))
    model = pooled_model(cfg, sites, args.epochs)
    rows = {}
    for name, sigma in {"no DP": None, "clipped, no noise": 0.0, **SIGMAS}.items():
        row = {}
        for head_of in ("dp-sgd", "statistics"):
            accuracies = [site_accuracy(model, head_of, sigma, site, pid, cfg) for pid, site in enumerate(sites)]
            row[head_of] = round(100 * float(np.mean(accuracies)), 2)
        rows[name] = {"noise multiplier": sigma, **row}
        print(f"{name:17s} sigma {sigma or 0.0:6.3f}: head trained {row['dp-sgd']:.2f} %, "
              f"head from the statistics {row['statistics']:.2f} %", flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"pooled extractor epochs": args.epochs, "head epochs": HEAD_EPOCHS,
                                    "rows": rows}, indent=2) + "\n")
    print(f"written: {args.out}")


if __name__ == "__main__":
    main()
