"""What the product computes, as one digest per method: a refactoring that must not change any
number compares the fingerprints of the code before and after.

Every method of the registry (and FedCCFA under concept drift) runs a few rounds in-process on
the embedded MNIST with a handful of clients, through the real ServerApp strategy and ClientApp
(no Flower processes). Its fingerprint is the SHA-256 of the run's ``rounds.csv`` (every column
but ``seconds``, which is timing) and of every array of its ``final_state.npz``.

    python bench/fingerprint.py --out before.json               # on the old code
    python bench/fingerprint.py --compare before.json           # on the new code: exit 1 on a change
    python bench/fingerprint.py --out before.json --keep runs   # and keep each run's folder, runs/<name>

Seconds per method on a laptop core; the runs of the experiment grids (``fedpac-experiments``)
are the full-length check.
"""

from __future__ import annotations

import argparse
import csv
import hashlib
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import cast

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from flwr.serverapp import Grid  # noqa: E402

from common.config import parse_run_config  # noqa: E402
from common.methods import METHODS  # noqa: E402
from federation import InProcessGrid, set_task_identity  # noqa: E402
from server_app.app import run_fedpac  # noqa: E402
from server_app.report import RunReport  # noqa: E402

CLIENTS = 4
BASE = {"num-server-rounds": 3, "samples-per-client": 120, "test-samples-per-client": 40, "local-epochs": 1,
        "batch-size": 20, "seed": 3}
# The run configs fingerprinted: every method as configured by default, and the settings whose
# code paths the defaults leave out.
RUNS: dict[str, dict[str, object]] = {
    **{name: {"strategy": name} for name in METHODS},
    "fedccfa-drift": {"strategy": "fedccfa", "drift": "sudden", "drift-rounds": "2", "num-server-rounds": 4},
    "pfedvem-sampled": {"strategy": "pfedvem", "vem-protocol": "sampled-train", "vem-sampling-rate": 0.5},
    "fedpac-partial": {"strategy": "fedpac", "fraction-train": 0.5, "num-server-rounds": 4},
}


def rounds_digest(text: str) -> str:
    rows = list(csv.DictReader(io.StringIO(text)))
    kept = [{k: v for k, v in row.items() if k != "seconds"} for row in rows]
    return hashlib.sha256(json.dumps(kept, sort_keys=True).encode()).hexdigest()


def state_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with np.load(path) as state:
        for key in sorted(state.files):
            digest.update(key.encode())
            digest.update(np.ascontiguousarray(state[key]).tobytes())
    return digest.hexdigest()


def fingerprint(name: str, extra: dict[str, object], keep: Path | None = None) -> dict[str, str]:
    """``name``'s digests; its run folder (outputs, checkpoint) goes under ``keep``/``name``
    when given (replacing one there), for a comparison file by file, or is deleted."""
    with tempfile.TemporaryDirectory() as scratch:
        out = Path(scratch) if keep is None else keep / name
        if keep is not None:
            shutil.rmtree(out, ignore_errors=True)
            out.mkdir(parents=True)
        config = {**BASE, **extra, "output-dir": str(out)}
        cfg = parse_run_config(config)
        set_task_identity()
        run_fedpac(cast(Grid, InProcessGrid(config, CLIENTS)), cfg, 1)
        run = next(out.rglob("rounds.csv")).parent
        return {"rounds.csv": rounds_digest((run / "rounds.csv").read_text()),
                "final_state.npz": state_digest(run / "final_state.npz")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, help="write the fingerprints here (JSON)")
    parser.add_argument("--compare", type=Path, help="fingerprints to compare with (JSON): exit 1 on a difference")
    parser.add_argument("--keep", type=Path, help="keep each run's folder here, as KEEP/<name>")
    parser.add_argument("--runs", nargs="+", choices=sorted(RUNS), default=list(RUNS))
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    RunReport.paint = lambda self, rounds: None  # type: ignore[method-assign]  # charts: not numbers
    prints = {}
    for name in args.runs:
        prints[name] = fingerprint(name, RUNS[name], args.keep)
        print(f"{name}: {prints[name]['rounds.csv'][:12]} {prints[name]['final_state.npz'][:12]}", flush=True)
    if args.out:
        args.out.write_text(json.dumps(prints, indent=1) + "\n")
    if args.compare:
        before = json.loads(args.compare.read_text())
        changed = sorted(name for name in prints if name in before and before[name] != prints[name])
        new = sorted(set(prints) - set(before))
        print(("same as before" if not changed else f"changed: {', '.join(changed)}")
              + (f" (new, nothing to compare with: {', '.join(new)})" if new else ""))
        return 1 if changed else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())
