"""How tight the sites' privacy accountant is: the epsilon a site's ledger gives under Rényi DP
(what the product reports and budgets, ``common.privacy.Ledger``) and under the privacy random
variable accountant (PRV, Gopi et al. 2021, Opacus's ``PRVAccountant``) for the same releases,
and the noise each needs for the same target.

The releases are those of the privacy protocol (docs/RESULTS.md, "The price of differential
privacy"): a site of 6,000 records, batches of 64, FedPAC's round of one head epoch and one
extractor epoch of DP-SGD and four statistics releases (class counts, sums, squared norms, the
centroids' sums) at ten times the gradients' noise multiplier, for 10 rounds.

    python bench/accounting.py --out bench/results/accounting
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.publish import command_line, publish  # noqa: E402
from common.privacy import Ledger, calibrate  # noqa: E402

DELTA = 1e-5


def fedpac_round(noise: float, records: int = 6000, batch: int = 64, statistics_ratio: float = 10.0) -> Ledger:
    """One FedPAC round's releases at a site, as ``client_app`` records them."""
    steps = math.ceil(records / batch)
    return Ledger([(noise, batch / records, 2 * steps), (noise * statistics_ratio, 1.0, 4)])


def prv_epsilon(ledger: Ledger, delta: float = DELTA) -> float:
    """Epsilon of ``ledger`` under Opacus's PRV accountant (its default error bound)."""
    from opacus.accountants import PRVAccountant  # pylint: disable=import-outside-toplevel

    accountant = PRVAccountant()
    accountant.history = list(ledger.history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # log(0) at q = 1, handled by Opacus
        return float(accountant.get_epsilon(delta))


def prv_factor(round_ledger: Ledger, rounds: int, target: float) -> float:
    """The smallest factor (to 1 %) on the noise with which ``rounds`` rounds reach ``target``
    under PRV: a bisection like ``common.privacy.calibrate``'s."""
    run = round_ledger.repeated(rounds)
    low, high = 0.05, 1.0
    while prv_epsilon(run.scaled(high)) > target:
        low, high = high, high * 2
    while high - low > 0.01 * high:
        middle = (low + high) / 2
        low, high = (low, middle) if prv_epsilon(run.scaled(middle)) <= target else (middle, high)
    return high


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=Path("bench/results/accounting"))
    args = parser.parse_args(argv)
    rows = []
    for target in (1.0, 3.0, 8.0):
        started = time.perf_counter()
        one = fedpac_round(1.0)
        rdp_noise = calibrate(one, args.rounds, target, DELTA)
        run = one.repeated(args.rounds).scaled(rdp_noise)
        prv_noise = prv_factor(one, args.rounds, target)
        rows.append({"target_epsilon": target, "rounds": args.rounds,
                     "rdp_noise_multiplier": round(rdp_noise, 4),
                     "rdp_epsilon": round(run.epsilon(DELTA), 4),
                     "prv_epsilon_same_noise": round(prv_epsilon(run), 4),
                     "prv_noise_multiplier": round(prv_noise, 4),
                     "noise_saved_percent": round(100 * (1 - prv_noise / rdp_noise), 1),
                     "seconds": round(time.perf_counter() - started, 1)})
        print(rows[-1], flush=True)
    publish(args.out, "accounting", rows, {"command": command_line("accounting.py", argv), "delta": DELTA,
                                            "rows": rows})


if __name__ == "__main__":
    main()
