"""What a per-round benchmark leaves in its results folder: ``<name>.csv`` (one row per round),
``<name>.json`` (the summary, headed by the command that reproduces it), echoed on stdout."""

from __future__ import annotations

import csv
import json
import sys
from pathlib import Path


def command_line(script: str, argv: list[str] | None) -> str:
    """How the benchmark was run: ``python bench/<script>`` and its arguments."""
    return f"python bench/{script} " + " ".join(argv if argv is not None else sys.argv[1:])


def publish(results: Path, name: str, rows: list[dict], summary: dict) -> None:
    results.mkdir(parents=True, exist_ok=True)
    with (results / f"{name}.csv").open("w", newline="") as stream:
        writer = csv.DictWriter(stream, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)
    (results / f"{name}.json").write_text(json.dumps(summary, indent=2) + "\n")
    print(json.dumps(summary, indent=2))
