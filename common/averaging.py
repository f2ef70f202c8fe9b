"""Sample-weighted averaging (FedAvg's rule, FedPAC eq. 18) and the cap on the sample counts a
client claims: the building blocks every method's server step averages with. Pure numpy."""

from __future__ import annotations

import numpy as np


def weighted_average(
    arrays: list[dict[str, np.ndarray]], weights: list[float] | np.ndarray
) -> dict[str, np.ndarray]:
    """sum_i w_i theta_i / sum_i w_i, key by key (eq. 18 with w_i = n_i, in samples)."""
    w = np.asarray(weights, dtype=np.float64)
    if len(arrays) == 0 or len(arrays) != len(w):
        raise ValueError(f"{len(arrays)} models but {len(w)} weights")
    if not np.isfinite(w).all() or (w < 0).any() or w.max() <= 0:
        raise ValueError("aggregation weights must be finite and non-negative with a positive sum")
    # divide by the largest weight first: each weight is finite, but their sum can overflow (two
    # of 1e308), and dividing by an infinite sum would make every weight 0
    w = w / w.max()
    w = w / w.sum()
    averaged = {}
    for key, first in arrays[0].items():
        # accumulate client by client: no (m x size) stack, which is GBs at m = 1000
        total = np.zeros(first.shape, dtype=np.float64)
        for weight, array in zip(w, arrays):
            total += weight * array[key]
        averaged[key] = total.astype(first.dtype)
    return averaged


def capped_sample_weights(num_examples: np.ndarray, max_ratio: float) -> np.ndarray:
    """Each client's aggregation weight n_i, at most ``max_ratio`` times the median of the
    *other* clients' n.

    n_i is what a client says it has: one client claiming far more samples than the others
    would otherwise own the averages (eq. 18, 19). Its own claim must not raise its own cap: with
    the median over all claims, one of two clients (or half of an even round) could claim any n
    and move the median with it. A client alone in its round keeps its n (there is nothing to
    compare it with, and its weight is 1 either way). ``max_ratio`` = 0 keeps every n_i.
    """
    n = np.asarray(num_examples, dtype=np.float64)
    if max_ratio <= 0 or len(n) < 2:
        return n.copy()
    # m medians of m - 1 claims, m the replies of one round: milliseconds even at m = 1000
    others = np.array([np.median(np.delete(n, i)) for i in range(len(n))])
    return np.minimum(n, max_ratio * others)
