"""Sample-weighted averaging (FedAvg's rule, FedPAC eq. 18), the cap on the sample counts a
client claims, and the medians (of the other clients' values; the lower one of all) that the
caps and bounds on one client's influence are relative to: the building blocks every method's server step averages
with. Pure numpy."""

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
    return np.minimum(n, max_ratio * median_of_others(n))


def median_of_others(values: np.ndarray) -> np.ndarray:
    """For each i, the median of every value but the i-th (``np.median(np.delete(values, i))``),
    from one sort: O(m log m) rather than m medians. At least two values.

    The reference every bound on one client's influence is relative to (its sample count here,
    its update's norm in ``common.robust``): the others' median, so that one client cannot raise
    its own bound however large its own value.
    """
    values = np.asarray(values, dtype=np.float64)
    count = len(values)
    if count < 2:
        raise ValueError("the median of the others needs at least two values")
    order = np.argsort(values, kind="stable")
    ordered = values[order]
    rank = np.empty(count, dtype=np.int64)
    rank[order] = np.arange(count)

    def others_at(position: int) -> np.ndarray:
        """The ``position``-th smallest of the others, for every i: the sorted values with the
        i-th one's slot left out."""
        return np.where(position < rank, ordered[position], ordered[min(position + 1, count - 1)])

    # the others are count - 1 values: their middle one, or the mean of their two middle ones
    # (halved before the sum, which is exact and cannot overflow as a sum of two 1e308 can)
    low, high = (count - 2) // 2, (count - 1) // 2
    if low == high:
        return others_at(low)
    return others_at(low) / 2 + others_at(high) / 2


def lower_median(values: np.ndarray) -> float:
    """The middle value, the lower of the two middle ones for an even count: with two clients
    the smaller, which neither can raise on its own (the mean of the two, any one can)."""
    ordered = np.sort(np.asarray(values, dtype=np.float64))
    return float(ordered[(len(ordered) - 1) // 2])
