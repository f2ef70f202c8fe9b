"""FedPAC ServerApp: validates the run config, runs the strategy, writes the outputs."""

from __future__ import annotations

import os
import time
from dataclasses import asdict
from logging import INFO
from pathlib import Path

import numpy as np
import torch
from flwr.app import ArrayRecord, Context
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from common import protocol as p
from common.config import FedPACConfig, parse_run_config
from common.model import FedPACNet, split_state
from common.partition import dominant_class_groups
from server_app.report import RunReport
from server_app.strategy import FedPAC

app = ServerApp()


def initial_model(cfg: FedPACConfig) -> FedPACNet:
    """The round-0 model, identical for a given seed."""
    torch.manual_seed(cfg.seed)
    return FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)


def run_directory(cfg: FedPACConfig, run_id: int) -> Path:
    """A fresh folder per run under output-dir (relative paths: from the ServerApp's cwd)."""
    root = Path(os.path.expanduser(cfg.output_dir)).resolve()
    return root / f"{time.strftime('%Y%m%d-%H%M%S')}-run{run_id}"


def save_final_state(strategy: FedPAC, extractor: ArrayRecord, path: Path) -> None:
    """Global extractor, centroids and every personalized head, in one .npz."""
    arrays = {f"extractor/{k}": v for k, v in p.from_record(extractor).items()}
    arrays["centroids"] = strategy.centroids
    arrays["centroid_mask"] = strategy.centroid_mask
    for pid, head in sorted(strategy.heads.items()):
        arrays.update({f"client-{pid}/{k}": v for k, v in head.items()})
    tmp = path.with_name(f".{path.name}.tmp.npz")
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run FedPAC for ``num-server-rounds`` rounds."""
    cfg = parse_run_config(context.run_config)  # fails before any training on a bad value
    model = initial_model(cfg)
    extractor, head = split_state({k: v.numpy() for k, v in model.state_dict().items()})
    groups = len(dominant_class_groups(cfg.num_classes))
    directory = run_directory(cfg, context.run_id)
    report = RunReport(directory, cfg.num_server_rounds, lambda pid: pid % groups, asdict(cfg))
    log(INFO, "FedPAC outputs: %s", directory)

    strategy = FedPAC(
        initial_head=head,
        num_rounds=cfg.num_server_rounds,
        fraction_train=cfg.fraction_train,
        fraction_evaluate=cfg.fraction_evaluate,
        full_last_round=cfg.full_last_round,
        min_available_nodes=cfg.min_available_clients,
        alpha_threshold=cfg.alpha_threshold,
        qp_solver=cfg.qp_solver,
        seed=cfg.seed,
        on_round_end=report.add,
    )
    result = strategy.start(
        grid=grid,
        initial_arrays=p.to_record(extractor),
        num_rounds=cfg.num_server_rounds,
        timeout=cfg.round_timeout,
    )
    save_final_state(strategy, result.arrays or p.to_record(extractor), directory / "final_state.npz")
    log(INFO, "FedPAC finished: final mean personalized accuracy %.2f%%; outputs in %s",
        100 * report.rounds[-1].mean_accuracy if report.rounds else float("nan"), directory)
