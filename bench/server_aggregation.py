"""Benchmark: the whole FedPAC server aggregation against a naive reference.

The reference does what the authors' public code does: every P_i built from d x d outer
products (O(m^3 K d^2) per round), one cvxpy solve per client, plus per-client loops for the
extractor average and the centroids. Ours: FedPAC's server part's step
(`common.methods.fedpac.server.Server.step`, what the Strategy calls each round) with the
vectorized QP solver, on replies already checked (the statistics as its check derives them).
Both run in the same process on the same synthetic statistics, so the speed-up is a ratio
measured in one run.

    python bench/server_aggregation.py                # the full grid (naive only where feasible)
    python bench/server_aggregation.py --quick        # m = 20, 100 only
    python bench/server_aggregation.py --busy         # m = 100, 1000: idle vs one core taken
Writes a markdown table to stdout and JSON to --out.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import common.methods.fedpac.collaboration  # noqa: E402
from load import one_core_taken  # noqa: E402
from common.config import FedPACConfig  # noqa: E402
from common.methods import FEDPAC  # noqa: E402
from common.methods.server import ServerPart, ServerState, StepResult, Update, server_part  # noqa: E402
from common.methods.fedpac.collaboration import (  # noqa: E402
    collaboration_matrix,
    gram_matrix,
    qp_objective,
    solve_simplex_qp,
    sparsify,
    variance_terms,
)
from common.model import FedPACNet, split_state  # noqa: E402

D = 128


def synthetic_round(m: int, num_classes: int, kind: str, seed: int = 0):
    """Statistics shaped like real FedPAC replies: 5 groups of similar clients, or random ones."""
    rng = np.random.default_rng(seed)
    model = FedPACNet(1, 28, num_classes)
    extractor, head = split_state({k: v.detach().numpy() for k, v in model.state_dict().items()})
    if kind == "clustered":
        centers = rng.normal(size=(5, num_classes, D))
        h = centers[np.arange(m) % 5] + 0.05 * rng.normal(size=(m, num_classes, D))
    else:
        h = rng.normal(size=(m, num_classes, D))
    extractors = [{k: v + rng.normal(scale=1e-3, size=v.shape).astype(v.dtype) for k, v in extractor.items()}
                  for _ in range(m)]
    heads = [{k: v + rng.normal(scale=1e-2, size=v.shape).astype(v.dtype) for k, v in head.items()} for _ in range(m)]
    counts = rng.integers(0, 100, size=(m, num_classes)).astype(np.float64)
    return dict(
        extractors=extractors, heads=heads, local_centroids=rng.normal(size=(m, num_classes, D)),
        class_counts=counts, h=h, v=rng.uniform(20, 40, m), num_examples=counts.sum(axis=1),
    )


def fedpac_round(data: dict, threshold: float = 0.0) -> tuple[ServerPart, list[Update], np.ndarray]:
    """FedPAC's server part (QP weights below ``threshold`` dropped), the round's replies as its
    step gets them (partition-ids 0..m-1, checked: ``parsed`` holds the float64 statistics), and
    their sample weights (n_i: none is capped)."""
    cfg = FedPACConfig(strategy=FEDPAC.name, alpha_threshold=threshold)
    server = server_part(FEDPAC, cfg, data["extractors"][0], data["heads"][0])
    n = data["num_examples"]
    updates = [
        Update(partition_id=i, extractor=extractor, head=head, num_examples=int(n[i]), metrics={},
               parsed={"centroids": data["local_centroids"][i], "class_counts": data["class_counts"][i],
                       "h": data["h"][i], "v": float(data["v"][i]),
                       "h_noise": 0.0, "v_inflation": 1.0})  # no DP: exact statistics
        for i, (extractor, head) in enumerate(zip(data["extractors"], data["heads"]))
    ]
    return server, updates, np.asarray(n, dtype=np.float64)


def step_round(server: ServerPart, updates: list[Update], weights: np.ndarray) -> tuple[ServerState, StepResult]:
    """One server step from the initial state (no centroid yet): the new state and the record."""
    state = server.initial_state()
    return state, server.step(state, updates, weights, 1)


def naive_round(data: dict, threshold: float = 1e-3):
    """The authors' way: P_i from d x d outer products, cvxpy per client, Python loops."""
    extractors, heads, h = data["extractors"], data["heads"], data["h"]
    n, v = data["num_examples"], data["v"]
    m, num_classes, d = h.shape
    total = n.sum()
    extractor = {k: sum(e[k] * (n[i] / total) for i, e in enumerate(extractors)) for k in extractors[0]}
    centroids = np.zeros((num_classes, d))
    for k in range(num_classes):
        weight = data["class_counts"][:, k]
        if weight.sum() > 0:
            centroids[k] = sum(weight[i] * data["local_centroids"][i, k] for i in range(m)) / weight.sum()
    alpha = np.zeros((m, m))
    for i in range(m):
        dist = np.zeros((m, m))
        for j1 in range(m):
            for j2 in range(j1, m):
                outer = np.zeros((d, d))
                for k in range(num_classes):
                    outer += np.outer(h[i, k] - h[j1, k], h[i, k] - h[j2, k])
                dist[j1, j2] = dist[j2, j1] = np.trace(outer)
        alpha[i] = sparsify(solve_simplex_qp(np.diag(v / n) + dist), threshold)
    mixed = [{key: sum(alpha[i, j] * heads[j][key] for j in range(m)) for key in heads[0]} for i in range(m)]
    return extractor, centroids, alpha, mixed


def objective_gap(data: dict, alpha: np.ndarray, rows: list[int]) -> float:
    """Largest (ours - cvxpy) / |cvxpy| over ``rows`` (negative: ours is lower)."""
    gram, variance = gram_matrix(data["h"]), variance_terms(data["v"], data["num_examples"])
    gaps = []
    for i in rows:
        p = collaboration_matrix(gram, variance, i)
        reference = solve_simplex_qp(p)
        ours, theirs = qp_objective(p, alpha[i]), qp_objective(p, reference)
        gaps.append((ours - theirs) / abs(theirs))
    return max(gaps)


def timed_round(data: dict, repeats: int) -> float:
    """Median seconds of FedPAC's server step on ``data``."""
    server, updates, weights = fedpac_round(data)
    times = []
    for _ in range(repeats):
        state = server.initial_state()
        started = time.perf_counter()
        server.step(state, updates, weights, 1)
        times.append(time.perf_counter() - started)
    return float(np.median(times))


def busy(args) -> None:
    """m = 100 and 1000 (K = 10, clustered) on an idle machine and with one core taken, with the
    solver's BLAS threads chosen per call (the product) and, with --compare-default, always one
    and always the library's default."""
    cores = len(os.sched_getaffinity(0))
    rows = []
    print(f"{cores} cores; median of {args.repeats} repeats per cell")
    print("| m | BLAS threads in the solver | idle (s) | one core taken (s) | loaded / idle |")
    print("|---|---|---|---|---|")
    # None: the product's choice per call (one thread, or all when large and alone); 1 and 0
    # (BLAS's default thread count, always) for reference.
    settings = [("chosen per call (product)", None)]
    if args.compare_default:
        settings += [("1 always", 1), ("default always", 0)]
    for m in (100, 1000):
        data = synthetic_round(m, 10, "clustered")
        for label, threads in settings:
            common.methods.fedpac.collaboration.SOLVER_BLAS_THREADS = threads if threads != 0 else os.cpu_count()
            idle = timed_round(data, args.repeats)
            with one_core_taken():
                loaded = timed_round(data, args.repeats)
            rows.append(dict(m=m, blas_threads=label, idle_s=idle, loaded_s=loaded, ratio=loaded / idle))
            print(f"| {m} | {label} | {idle:.3f} | {loaded:.3f} | {loaded / idle:.2f}x |", flush=True)
    common.methods.fedpac.collaboration.SOLVER_BLAS_THREADS = None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps({"cores": cores, "rows": rows}, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--busy", action="store_true", help="idle vs one core taken, m = 100 and 1000")
    parser.add_argument("--compare-default", action="store_true",
                        help="with --busy: also time the solver on BLAS's default thread count")
    parser.add_argument("--repeats", type=int, default=3, help="with --busy: repeats per cell")
    parser.add_argument("--naive-max", type=int, default=100, help="largest m the naive reference runs at")
    parser.add_argument("--out", default="bench/results/server_aggregation.json")
    args = parser.parse_args()
    if args.busy:
        if args.out == parser.get_default("out"):
            args.out = "bench/results/server_aggregation_busy.json"
        busy(args)
        return
    sizes = [20, 100] if args.quick else [20, 100, 500, 1000]
    rows = []
    print("| K | clients | m | ours (s) | naive (s) | speed-up | QP rows certified | max rel. objective gap vs cvxpy |")
    print("|---|---|---|---|---|---|---|---|")
    for num_classes in (10, 62):
        for kind in ("clustered", "random"):
            for m in sizes:
                data = synthetic_round(m, num_classes, kind)
                server, updates, weights = fedpac_round(data)
                state = server.initial_state()
                started = time.perf_counter()
                ours = server.step(state, updates, weights, 1).record
                ours_s = time.perf_counter() - started
                naive_s = None
                # the naive K = 62 reference costs about 6x the K = 10 one: 20 clients only
                if m <= args.naive_max and (num_classes == 10 or m <= 20):
                    started = time.perf_counter()
                    _, _, naive_alpha, _ = naive_round(data, threshold=0.0)
                    naive_s = time.perf_counter() - started
                certified = sum(s == "optimal" for s in ours["solver_status"])
                sample = sorted(set(np.linspace(0, m - 1, min(m, 8)).astype(int).tolist()))
                gap = objective_gap(data, np.array(ours["alpha"]), sample)
                row = dict(num_classes=num_classes, kind=kind, m=m, ours_s=ours_s, naive_s=naive_s,
                           speedup=naive_s / ours_s if naive_s else None, certified=certified,
                           max_rel_gap=gap, gap_rows=len(sample))
                rows.append(row)
                naive_txt = f"{naive_s:.2f}" if naive_s else "not run"
                speed_txt = f"{naive_s / ours_s:.0f}x" if naive_s else "-"
                print(f"| {num_classes} | {kind} | {m} | {ours_s:.3f} | {naive_txt} | {speed_txt} | "
                      f"{certified}/{m} | {gap:.1e} ({len(sample)} rows) |", flush=True)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
