"""Centralized references for a federated setting: what the model reaches with the data pooled.

A federated method trains on data it never sees in one place; these references pool it, to
bound what a personalized method can reach on the same clients, model, optimizer and test
splits (the clients' own, as the paper measures):

* ``group pooled``: one model per label group, trained on the pooled training data of the
  group's clients: what perfect collaboration inside a group gives, with nothing shared
  across groups;
* ``all pooled + group head``: one model trained on every client's data (the centrally trained
  shared extractor), then per group its head fine-tuned on the group's pooled data: what
  FedPAC's two parts (one feature space for all, heads mixed within a group) would give with
  the data in one place.

Each is trained with the run config's SGD (``extractor-lr``, momentum, weight decay, batch
size) for ``--epochs`` epochs, evaluated on every client's test split every ``--eval-every``
epochs; the mean over clients is reported at the last epoch and at its best epoch (the best
looks at the test data, so it is an optimistic bound).

    python -m experiments.reference --clients 20 --epochs 100 --set dataset=fashion-mnist --set seed=0 \\
        --out docs/results/fmnist-paper/reference-20-clients.json
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from client_app.app import client_tensors, select_device
from common.training import evaluate, train_head, train_joint
from common.config import ConfigError, FedPACConfig, parse_run_config
from common.files import atomic_write
from common.model import FedPACNet
from common.partition import group_of
from experiments.grid import GridError, parse_assignment

Tensors = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class ClientData:
    """One client's training and test split, on the training device."""

    partition_id: int
    group: int
    train: Tensors
    test: Tensors


def pooled(clients: Sequence[ClientData]) -> Tensors:
    """The clients' training data in one set."""
    return torch.cat([c.train[0] for c in clients]), torch.cat([c.train[1] for c in clients])


def groups(clients: Sequence[ClientData]) -> dict[int, list[ClientData]]:
    """The clients of each label group, by group."""
    out: dict[int, list[ClientData]] = {}
    for client in clients:
        out.setdefault(client.group, []).append(client)
    return dict(sorted(out.items()))


def mean_accuracy(models: Callable[[ClientData], FedPACNet], clients: Sequence[ClientData]) -> float:
    """The paper's metric: each client's accuracy on its own test split, unweighted mean."""
    return statistics.fmean(evaluate(models(c), *c.test)[1] for c in clients)


def train_curve(
    model: FedPACNet,
    data: Tensors,
    cfg: FedPACConfig,
    epochs: int,
    eval_every: int,
    measure: Callable[[], float],
    generator: torch.Generator,
    label: str = "",
) -> list[tuple[int, float]]:
    """Train ``model`` on ``data`` for ``epochs`` epochs (the run's SGD), measuring every
    ``eval_every`` epochs and after the last: [(epoch, measure())], each logged with ``label``."""
    curve, done = [], 0
    while done < epochs:
        step = min(eval_every, epochs - done)
        train_joint(model, *data, dataclasses.replace(cfg, local_epochs=step), generator)
        done += step
        curve.append((done, measure()))
        if label:
            print(f"{label}: epoch {done}/{epochs}, mean client accuracy {100 * curve[-1][1]:.2f} %", flush=True)
    return curve


def _fresh_model(cfg: FedPACConfig, device: torch.device) -> FedPACNet:
    """A model of the run's architecture, initialized from torch's global random state."""
    return FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes, cfg.extractor_front_end).to(device)


def group_pooled(clients: Sequence[ClientData], cfg: FedPACConfig, epochs: int, eval_every: int,
                 seed: int) -> list[tuple[int, float]]:
    """Mean client accuracy by epoch of one model per group trained on the group's pooled data."""
    members = groups(clients)
    torch.manual_seed(seed)
    models = {g: _fresh_model(cfg, clients[0].train[0].device) for g in members}
    curves = {}
    for g, group in members.items():
        def measure(model: FedPACNet = models[g], group: list[ClientData] = group) -> float:
            return mean_accuracy(lambda c: model, group)

        curves[g] = train_curve(models[g], pooled(group), cfg, epochs, eval_every, measure,
                                torch.Generator().manual_seed(seed * 1000 + g), label=f"group {g} pooled")
    # the per-group curves share their epochs: weight each group's mean by its clients
    return [
        (epoch, sum(curves[g][i][1] * len(group) for g, group in members.items()) / len(clients))
        for i, (epoch, _) in enumerate(next(iter(curves.values())))
    ]


def all_pooled_group_head(clients: Sequence[ClientData], cfg: FedPACConfig, epochs: int, eval_every: int,
                          head_epochs: int, seed: int) -> list[tuple[int, float]]:
    """Mean client accuracy by epoch of one model trained on all the data, each group's head then
    fine-tuned for ``head_epochs`` epochs on the group's pooled data (the extractor frozen)."""
    members = groups(clients)
    torch.manual_seed(seed)
    shared = _fresh_model(cfg, clients[0].train[0].device)

    group_data = {g: pooled(group) for g, group in members.items()}

    def measure() -> float:
        heads = {}
        for g, data in group_data.items():
            heads[g] = copy.deepcopy(shared)
            train_head(heads[g], *data, cfg, torch.Generator().manual_seed(seed * 1000 + g),
                       epochs=head_epochs, lr=cfg.extractor_lr)
        return mean_accuracy(lambda c: heads[c.group], clients)

    return train_curve(shared, pooled(clients), cfg, epochs, eval_every, measure, torch.Generator().manual_seed(seed),
                       label="all pooled + group head")


def summary(curve: list[tuple[int, float]]) -> dict[str, float]:
    """A curve's last point and its best (the best looks at the test data: an optimistic bound)."""
    best_epoch, best = max(curve, key=lambda point: point[1])
    return {"last_epoch": curve[-1][0], "last": curve[-1][1], "best_epoch": best_epoch, "best": best}


DEFAULT_RUN_CONFIG = {"dataset": "fashion-mnist"}


def reference_run_config(assignments: Sequence[str]) -> dict[str, Any]:
    """The run config of ``--set KEY=VALUE`` items over :data:`DEFAULT_RUN_CONFIG` (the paper's
    dataset, whatever pyproject's default is): ``--set seed=1`` alone keeps Fashion-MNIST."""
    return {**DEFAULT_RUN_CONFIG, **dict(parse_assignment(item) for item in assignments)}


def load_clients(cfg: FedPACConfig, num_clients: int, device: torch.device) -> list[ClientData]:
    """Every client's split as the simulation gives it (same partition, normalization, seed)."""
    out = []
    for pid in range(num_clients):
        x, y, x_test, y_test = client_tensors(cfg, pid, num_clients, device)
        out.append(ClientData(pid, group_of(cfg, pid), (x, y), (x_test, y_test)))
    return out


def main(argv: list[str] | None = None) -> None:
    cli = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    cli.add_argument("--clients", type=int, default=20)
    cli.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                     help="run config (repeatable), as the runner's --set, over dataset=fashion-mnist")
    cli.add_argument("--epochs", type=int, default=100)
    cli.add_argument("--eval-every", type=int, default=5)
    cli.add_argument("--head-epochs", type=int, default=5, help="the group heads' fine-tuning epochs")
    cli.add_argument("--seed", type=int, default=0, help="model initialisation and batch order")
    cli.add_argument("--out", type=Path, help="write reference.json here")
    args = cli.parse_args(argv)
    for flag, value in (("--clients", args.clients), ("--epochs", args.epochs), ("--eval-every", args.eval_every)):
        if value < 1:
            raise SystemExit(f"experiments.reference: {flag} must be >= 1, got {value}")
    try:
        run_config = reference_run_config(args.set)
        cfg = parse_run_config(run_config)
    except (GridError, ConfigError) as err:
        raise SystemExit(f"experiments.reference: {err}") from err
    clients = load_clients(cfg, args.clients, select_device(cfg.device))
    curves = {
        "group pooled": group_pooled(clients, cfg, args.epochs, args.eval_every, args.seed),
        "all pooled + group head": all_pooled_group_head(clients, cfg, args.epochs, args.eval_every,
                                                         args.head_epochs, args.seed),
    }
    result = {
        "clients": args.clients, "run_config": run_config, "epochs": args.epochs,
        "head_epochs": args.head_epochs, "seed": args.seed,
        "references": {name: {**summary(curve), "curve": curve} for name, curve in curves.items()},
    }
    for name, ref in result["references"].items():
        print(f"{name}: {100 * ref['last']:.2f} % after {ref['last_epoch']} epochs "
              f"(best {100 * ref['best']:.2f} % at epoch {ref['best_epoch']})")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(args.out, (json.dumps(result, indent=1) + "\n").encode())


if __name__ == "__main__":
    main()
