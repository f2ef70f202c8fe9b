"""Client failures in a Ray simulation of the real apps: ClientApp calls that raise (the soak
benchmark's injector, at a small scale) cost the round their replies, not the run."""

from __future__ import annotations

import csv
import random
import subprocess
import sys

import pytest

from tests.deployment import ROOT

pytestmark = pytest.mark.e2e

CLIENTS, ROUNDS, RATE, SEED = 4, 3, 0.3, 0


def _fails(server_round: int, message_type: str, pid: int) -> bool:
    """The injector's draw (bench/soak.py: flaky), recomputed here."""
    return random.Random(f"{SEED}/{server_round}/{message_type}/{pid}").random() < RATE


def test_clients_that_raise_cost_their_replies_not_the_run(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "soak.py"), "--clients", str(CLIENTS), "--fraction", "1",
         "--rounds", str(ROUNDS), "--failure-rate", str(RATE), "--seed", str(SEED), "--results", str(tmp_path),
         "--outputs", str(tmp_path / "run")],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    rows = list(csv.DictReader((tmp_path / "soak.csv").open()))
    assert [int(r["round"]) for r in rows] == list(range(1, ROUNDS + 1))
    for row in rows:
        r = int(row["round"])
        assert int(row["num_trained"]) == sum(not _fails(r, "train", pid) for pid in range(CLIENTS))
        # Fused evaluation (every client trains every round): round r's evaluation comes back in
        # round r + 1's train reply, so a failed train message of round r + 1 costs it too; the
        # last round has evaluate messages of its own.
        carrier = (r + 1, "train") if r < ROUNDS else (r, "evaluate")
        assert int(row["num_evaluated"]) == sum(not _fails(*carrier, pid) for pid in range(CLIENTS))
    draws = [_fails(r, t, pid) for r in range(1, ROUNDS + 1) for t in ("train", "evaluate") for pid in range(CLIENTS)]
    assert any(draws) and not all(draws)  # the scenario really has failures, and survivors
    assert (tmp_path / "soak.png").exists()
