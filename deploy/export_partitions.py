"""Write each client's partition of a dataset to its own data directory.

A deployed SuperNode trains on a directory of its own (node config ``data-path``); this script
makes such directories from a dataset the run config names, for demos, tests and the compose
cluster: ``OUT/client-<i>/train.npz`` and ``test.npz`` (arrays ``x``: uint8 NHWC, ``y``: labels),
exactly the samples partition ``i`` would get in a simulation with the same run config.

    python deploy/export_partitions.py --clients 3 --out deploy/data \
        --run-config "dataset='fashion-mnist' samples-per-client=600"
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
from flwr.common.config import parse_config_args

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.config import parse_run_config  # noqa: E402
from common.data import load_dataset  # noqa: E402
from common.partition import client_split  # noqa: E402


def export(run_config: dict, num_clients: int, out: Path) -> list[Path]:
    """Write ``out/client-<i>/{train,test}.npz`` for every client; returns the directories."""
    cfg = parse_run_config(run_config)
    data = load_dataset(cfg)
    directories = []
    for partition_id in range(num_clients):
        split = client_split(cfg, partition_id, num_clients)
        directory = out / f"client-{partition_id}"
        directory.mkdir(parents=True, exist_ok=True)
        np.savez(directory / "train.npz", x=data.train_images[split.train_indices], y=split.train_labels)
        np.savez(directory / "test.npz", x=data.test_images[split.test_indices], y=split.test_labels)
        directories.append(directory)
    return directories


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, required=True, help="number of partitions (clients)")
    parser.add_argument("--out", type=Path, required=True, help="folder that receives client-<i>/")
    parser.add_argument("--run-config", default="", help="run config overrides, as for `flwr run`")
    args = parser.parse_args(argv)
    if args.clients < 1:
        parser.error("--clients must be at least 1")
    run_config = parse_config_args([args.run_config]) if args.run_config else {}
    for directory in export(run_config, args.clients, args.out):
        print(directory)


if __name__ == "__main__":
    main()
