"""Client data folders for the GPU kit: the Fashion-MNIST paper protocol's partitions, compressed.

The GPU machine has no Fashion-MNIST and no network, and the four IDX files (31 MB) would take
half of what may travel to it. A deployed SuperNode trains on its own data folder anyway
(``deploy/supernode.sh --data-path``, as ``bench/deployment.py`` runs it): this writes those
folders here, exactly the samples each partition gets in a simulation with the same run config
(``deploy/export_partitions.py``), as compressed ``train.npz``/``test.npz`` (about 7 MB for
20 clients x (600 + 200) images), with a ``manifest.json`` naming the run config and clients.

    python deploy/gpu/kit_data.py --clients 20 --out deploy/gpu/data/fashion-mnist-20
    python deploy/gpu/kit_data.py --clients 3 --out /tmp/d --run-config "samples-per-client=100"
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "deploy"))

# The paper protocol (Fashion-MNIST, 600 training and 200 test samples per client, 20 % of
# them uniform over the classes, the rest from the client group's dominant classes).
PAPER = {"dataset": "fashion-mnist", "seed": 0}


def export_compressed(run_config: dict, clients: int, out: Path) -> dict:
    """Write ``out/client-<i>/{train,test}.npz`` (compressed) and ``out/manifest.json``."""
    from export_partitions import export  # pylint: disable=import-outside-toplevel  # needs flwr, datasets

    config = {**PAPER, **run_config}
    out.mkdir(parents=True, exist_ok=True)
    samples = {}
    for directory in export(config, clients, out):
        for split in ("train", "test"):
            path = directory / f"{split}.npz"
            with np.load(path) as arrays:
                x, y = arrays["x"], arrays["y"]
            np.savez_compressed(path, x=x, y=y)
            samples.setdefault(split, []).append(int(len(y)))
    manifest = {"clients": clients, "run_config": config, "samples": samples}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest


def read_manifest(directory: Path) -> dict | None:
    path = directory / "manifest.json"
    return json.loads(path.read_text()) if path.is_file() else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--run-config", default="", help="overrides of the paper protocol, as for `flwr run`")
    args = parser.parse_args(argv)
    from flwr.common.config import parse_config_args  # pylint: disable=import-outside-toplevel

    overrides = parse_config_args([args.run_config]) if args.run_config else {}
    manifest = export_compressed(overrides, args.clients, args.out)
    size = sum(f.stat().st_size for f in args.out.rglob("*") if f.is_file())
    print(f"{args.out}: {manifest['clients']} clients, {sum(manifest['samples']['train'])} train / "
          f"{sum(manifest['samples']['test'])} test images, {size / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
