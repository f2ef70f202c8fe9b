"""Checks of what a client sends, shared by the reply parsing (``server_app.replies``) and the
methods' own checks of their statistics (``common/methods/<family>/server.py``). Pure numpy: a
failed check is an :class:`InvalidReply` naming the reason."""

from __future__ import annotations

import numpy as np

# The largest count of samples a float64 metric carries exactly.
MAX_SAMPLE_COUNT = 2**53
V_ROUNDING = 1e-6  # relative: a V this far below 0 is rounding, not a malformed reply


class InvalidReply(ValueError):
    """A reply that must be rejected; the message names the reason."""


def metric(metrics, key: str) -> float:
    if key not in metrics:
        raise InvalidReply(f"missing metric '{key}'")
    value = metrics[key]
    if not isinstance(value, (int, float)) or not np.isfinite(value):
        raise InvalidReply(f"metric '{key}' = {value!r} is not a finite number")
    return float(value)


def optional_metric(metrics, key: str, default: float) -> float:
    """A finite number where the client sent ``key``, ``default`` where it did not."""
    return metric(metrics, key) if key in metrics else default


def fraction_metric(metrics, key: str, what: str) -> float:
    """A reported fraction (an accuracy): finite and in [0, 1]."""
    value = metric(metrics, key)
    if not 0.0 <= value <= 1.0:
        raise InvalidReply(f"{what} {value} outside [0, 1]")
    return value


def metric_at_least(metrics, key: str, minimum: float, default: float) -> float:
    """An optional reported number: finite and >= ``minimum``, ``default`` where none is
    reported (FedPAC's noise in h, at least 0, and its heads' variance inflation, at least 1)."""
    value = optional_metric(metrics, key, default)
    if value < minimum:
        raise InvalidReply(f"metric '{key}' = {value} is below {minimum:g}")
    return value


def finite_as(value: np.ndarray, dtype: np.dtype, what: str) -> np.ndarray:
    """``value`` in the model's ``dtype``, all finite there: checked after the cast, since a
    finite float64 (1e300) may overflow to Inf in float32."""
    with np.errstate(over="ignore"):
        cast = value.astype(dtype)
    if not np.isfinite(cast).all():
        raise InvalidReply(f"{what} holds NaN or Inf (as {dtype})")
    return cast


def sample_count(value: float, what: str) -> float:
    """A count of samples: positive, whole, and at most 2**53, above which a float64 holds no odd
    whole numbers (the whole-number check means nothing) and a few counts overflow the sums and
    caps of the sample weights."""
    if value <= 0 or not value.is_integer():
        raise InvalidReply(f"{what} {value} must be positive and a whole number")
    if value > MAX_SAMPLE_COUNT:
        raise InvalidReply(f"{what} {value:.6g} is above 2**53, past any data set")
    return value


def variance_metric(v: float, h: np.ndarray) -> float:
    """V, checked against the client's h. V is a difference of sums of squares: when all of a
    client's features of its only class coincide it is 0 up to rounding, which may leave it a
    hair below 0; rounding relative to the sum of squares of h, taken in float64: the squares
    of a float32-finite h can overflow float32, and an infinite scale would pass any negative
    V as rounding (in float64 they cannot: at most ~1e77 each)."""
    scale = max(1.0, float(np.sum(np.square(h, dtype=np.float64))))
    if v < -V_ROUNDING * scale:
        raise InvalidReply(f"V = {v} is negative")
    return max(v, 0.0)


def class_counts(stats: dict[str, np.ndarray], key: str, num_examples: float) -> np.ndarray:
    """A reply's class counts n_ik (``stats[key]``, shape checked before): non-negative whole
    numbers that sum to its num-examples; as float64."""
    counts = stats[key].astype(np.float64)
    if (counts < 0).any() or not np.allclose(counts, np.round(counts)):
        raise InvalidReply("class counts must be non-negative integers")
    if counts.sum() != num_examples:
        raise InvalidReply(
            f"num-examples {num_examples} must be positive and equal the class counts' sum {counts.sum()}")
    return counts
