"""Bounded influence of one reply on what the server aggregates. Pure numpy, no Flower.

Reply validation checks shapes and finiteness, not magnitude: one site that multiplies its
update by 1e30 passes it, and a sample-weighted mean then hands every site a model of ~1e29 whose
next training is NaN everywhere. Two rules bound what one reply can do:

* **A norm bound** (:func:`bound_updates`, :func:`bound_rows`): a reply's update of a model part
  (the arrays it sends back minus those the server sent it that round), or one of its class
  means, is scaled down to at most ``ratio`` times the median norm of the *other* replies' (as
  ``common.averaging.capped_sample_weights`` caps sample counts: a reply's own norm must not raise
  its own bound, or with two replies the larger one would always pass). Its direction is kept:
  an honest site whose update is merely large still moves the model its way.
* **Robust aggregators** (:func:`coordinate_median`, :func:`trimmed_mean`): the rules Flower
  ships as FedMedian and FedTrimmedAvg, coordinate by coordinate and unweighted, as there. A
  bounded update still moves a mean by up to ``ratio / m`` of a typical one in any direction it
  likes; the median and the trimmed mean ignore a minority of outliers altogether, at the price
  of the sample weights (eq. 18) and of some accuracy on skewed data.

* **Agreeing mixes** (:func:`agreeing_mix`): an update of honest size that points the wrong
  way (a sign flip) passes both rules above. Where the server mixes each client its own
  combination of the others' heads (FedPAC's collaboration), the mix is made of what the
  client's statistics resemble, so the client nearest to a flipping site takes the flipped head
  at the largest weight. A head whose update points away from the client's own update (negative
  inner product) is left out of that client's mix; the weights left are rescaled.

None of them helps against a majority of hostile replies, whose norms are the median.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from common.averaging import median_of_others, weighted_average

NDArrays = dict[str, np.ndarray]

# How the server combines the replies' parts that it averages (run config ``shared-aggregation``).
MEAN, MEDIAN, TRIMMED_MEAN = "mean", "median", "trimmed-mean"
AGGREGATIONS = (MEAN, MEDIAN, TRIMMED_MEAN)
# Elements of one (replies x coordinates) block the median and the trimmed mean sort at once: the
# whole stack of m models would be GBs at m = 1000 (weighted_average avoids it for the same reason).
BLOCK_ELEMENTS = 1 << 22


# ---------------------------------------------------------------------- the norm bound


def norm_bounds(norms: np.ndarray, ratio: float) -> np.ndarray:
    """Each reply's bound: ``ratio`` x the median of the *other* replies' norms; infinite for
    every reply when ``ratio`` is 0 (no bound) or there is a single reply (nothing to compare it
    with)."""
    norms = np.asarray(norms, dtype=np.float64)
    if ratio <= 0 or len(norms) < 2:
        return np.full(len(norms), np.inf)
    return ratio * median_of_others(norms)


def bound_factors(norms: np.ndarray, ratio: float) -> np.ndarray:
    """Each reply's scale factor: min(1, its bound (:func:`norm_bounds`) / its norm).

    A reply whose others mostly left the part unchanged (their median is 0) may not change it
    either (factor 0), and a reply that changed nothing keeps factor 1.
    """
    norms = np.asarray(norms, dtype=np.float64)
    return _factors(norms, norm_bounds(norms, ratio))


def _factors(norms: np.ndarray, bounds: np.ndarray) -> np.ndarray:
    factors = np.ones(len(norms))
    over = norms > bounds
    factors[over] = bounds[over] / norms[over]
    return factors


def update_norms(received: list[NDArrays], sent: list[NDArrays]) -> np.ndarray:
    """The L2 norm of each reply's update ``received[i] - sent[i]`` over all its arrays, in
    float64: a float32 update of 1e30 has squares far past float32's range."""
    norms = np.zeros(len(received))
    for i, (mine, base) in enumerate(zip(received, sent)):
        total = 0.0
        for key, array in mine.items():
            delta = np.subtract(array, base[key], dtype=np.float64).ravel()
            # einsum's own loop, not BLAS's dot: a BLAS thread pool on a busy machine made this
            # small sum take 100 times longer, now and then
            total += float(np.einsum("i,i->", delta, delta))
        norms[i] = np.sqrt(total)
    return norms


def stacked_updates(received: list[NDArrays], sent: list[NDArrays]) -> np.ndarray:
    """The updates ``received[i] - sent[i]`` as the rows of one (m, d) float64 matrix, each
    reply's arrays flattened in the order of their names (for parts small enough to stack: a
    head; :func:`update_norms` streams instead)."""
    return np.stack([np.concatenate([np.subtract(mine[key], base[key], dtype=np.float64).ravel()
                                     for key in sorted(mine)]) for mine, base in zip(received, sent)])


@dataclass(frozen=True)
class Bounded:
    """:func:`bound_updates`' answer: the replies' arrays (those within the bound as they came,
    the same objects), each update's norm, its bound (``ratio`` x the others' median) and the
    factor it was scaled by (1: within the bound)."""

    arrays: list[NDArrays]
    norms: np.ndarray
    bounds: np.ndarray
    factors: np.ndarray

    @property
    def scaled(self) -> list[int]:
        """Indices of the replies that were scaled down."""
        return [int(i) for i in np.flatnonzero(self.factors < 1.0)]


def bound_updates(received: list[NDArrays], sent: list[NDArrays], ratio: float) -> Bounded:
    """Scale every update ``received[i] - sent[i]`` whose norm is over ``ratio`` times the median
    of the other updates' norms down to that bound: ``sent[i] + factor_i (received[i] - sent[i])``,
    in float64, cast back to each array's dtype. A reply within its bound is returned as it came,
    so a round where nobody is over it aggregates exactly what it did without the bound."""
    if len(received) != len(sent):
        raise ValueError(f"{len(received)} replies but {len(sent)} models sent")
    norms = update_norms(received, sent)
    bounds = norm_bounds(norms, ratio)
    factors = _factors(norms, bounds)
    arrays = []
    for mine, base, factor in zip(received, sent, factors):
        if factor >= 1.0:
            arrays.append(mine)
            continue
        arrays.append({key: (base[key] + factor * np.subtract(array, base[key], dtype=np.float64)).astype(array.dtype)
                       for key, array in mine.items()})
    return Bounded(arrays, norms, bounds, factors)


def bound_rows(rows: np.ndarray, present: np.ndarray, ratio: float) -> tuple[np.ndarray, np.ndarray]:
    """Class means (or any per-class vectors) ``rows`` (m, K, d) with each row's norm at most
    ``ratio`` times the median norm of the other replies' rows of its class; only the rows
    ``present`` (m, K) count, and only they are scaled (a class a reply has no sample of carries
    no weight in any mean). Returns the rows (float64) and the factors (m, K)."""
    rows = np.asarray(rows, dtype=np.float64)
    present = np.asarray(present, dtype=bool)
    factors = np.ones(present.shape)
    norms = np.linalg.norm(rows, axis=2)
    for k in range(present.shape[1]):
        holders = np.flatnonzero(present[:, k])
        factors[holders, k] = bound_factors(norms[holders, k], ratio)
    return rows * factors[:, :, None], factors


# ---------------------------------------------------------------------- robust aggregators


def coordinate_median(arrays: list[NDArrays]) -> NDArrays:
    """The coordinate-wise median of the replies' arrays, unweighted (Flower's FedMedian: the mean
    of the two middle values for an even count), in each array's dtype."""
    return _blockwise(arrays, lambda block: np.median(block, axis=0))


def trimmed_mean(arrays: list[NDArrays], fraction: float) -> NDArrays:
    """The coordinate-wise mean of the replies' arrays after cutting ``int(fraction x m)`` of the
    smallest and as many of the largest values of every coordinate, unweighted (Flower's
    FedTrimmedAvg, after ``scipy.stats.trim_mean``): with fewer than 1 / ``fraction`` replies
    nothing is cut."""
    if not 0.0 <= fraction < 0.5:
        raise ValueError(f"the trimmed fraction must be in [0, 0.5), got {fraction}")
    cut = int(fraction * len(arrays))
    if cut == 0:
        return _blockwise(arrays, lambda block: block.mean(axis=0))

    def trimmed(block: np.ndarray) -> np.ndarray:
        ordered = np.partition(block, (cut, len(block) - cut - 1), axis=0)
        return ordered[cut:len(block) - cut].mean(axis=0)

    return _blockwise(arrays, trimmed)


def aggregate(arrays: list[NDArrays], weights: np.ndarray, rule: str, trim_fraction: float = 0.2) -> NDArrays:
    """The replies' parts combined by ``rule``: ``mean`` (weighted by ``weights``, FedAvg's eq.
    18), ``median`` or ``trimmed-mean`` (both unweighted)."""
    if rule == MEAN:
        return weighted_average(arrays, weights)
    if not arrays:
        raise ValueError("nothing to aggregate")
    if rule == MEDIAN:
        return coordinate_median(arrays)
    if rule == TRIMMED_MEAN:
        return trimmed_mean(arrays, trim_fraction)
    raise ValueError(f"unknown aggregation {rule!r}: one of {', '.join(AGGREGATIONS)}")


def _blockwise(arrays: list[NDArrays], reduce) -> NDArrays:  # noqa: ANN001
    """``reduce`` (an (m, c) float64 block -> (c,)) over every coordinate of every array, a block
    of coordinates at a time, cast back to the first reply's dtype."""
    result = {}
    count = len(arrays)
    for key, first in arrays[0].items():
        flat = [a[key].reshape(-1) for a in arrays]
        out = np.empty(first.size, dtype=np.float64)
        step = max(1, BLOCK_ELEMENTS // count)
        for start in range(0, first.size, step):
            block = np.stack([f[start:start + step] for f in flat]).astype(np.float64)
            out[start:start + step] = reduce(block)
        result[key] = out.reshape(first.shape).astype(first.dtype)
    return result


__all__ = ["AGGREGATIONS", "MEAN", "MEDIAN", "TRIMMED_MEAN", "Bounded", "aggregate", "bound_factors", "bound_rows",
           "bound_updates", "coordinate_median", "norm_bounds", "trimmed_mean", "update_norms"]


# ---------------------------------------------------------------------- agreeing mixes


def agreeing_mix(alpha: np.ndarray, updates: np.ndarray) -> tuple[np.ndarray, list[tuple[int, int]]]:
    """``alpha`` (row i: client i's weights on the m heads, summing to 1) with every weight
    alpha_ij removed whose head update (row j of ``updates``, m x d: each head as sent back
    minus as the server sent it) points away from client i's own (a negative inner product), and
    each row's remaining weights rescaled to sum to 1 (a row left with nothing keeps its own head:
    alpha_ii = 1); and the (i, j) pairs removed.

    Heads of clients with the same data move the same way from where they started, so an honest
    pair whose statistics are alike agrees; a sign-flipped head disagrees with exactly the
    clients its statistics make it closest to. A zero update (a head that did not train) agrees
    with every other."""
    alpha = np.asarray(alpha, dtype=np.float64)
    updates = np.asarray(updates, dtype=np.float64)
    agree = updates @ updates.T >= 0
    np.fill_diagonal(agree, True)
    dropped = [(int(i), int(j)) for i, j in zip(*np.nonzero(~agree & (alpha > 0)))]
    if not dropped:
        return alpha, []
    kept = np.where(agree, alpha, 0.0)
    sums = kept.sum(axis=1, keepdims=True)
    lonely = sums[:, 0] <= 0
    kept[lonely] = np.eye(len(alpha))[lonely]
    sums[lonely] = 1.0
    return kept / sums, dropped
