"""Record-level differential privacy at a site: DP-SGD for every gradient step, the Gaussian
mechanism for the feature statistics, and one Rényi-DP accountant per site over the whole run.

A site's data shapes two things: what its method sends (the model parts that travel, the
statistics) and the model it keeps. With ``dp = true`` both are (epsilon, delta)-DP with respect
to adding or removing one training record of the site:

* every gradient step of a local update (``common.training.sgd_epochs``, pFedVEM's E-step) takes
  a Poisson sample of the records (rate q = batch-size / n), clips each record's gradient to
  ``dp-max-grad-norm`` and adds Gaussian noise of ``dp-noise-multiplier`` times that norm to
  their sum (Abadi et al., CCS 2016). A term of the parameters alone (FedProx's and Ditto's
  proximal terms, pFedVEM's KL) is added after the noise: it reads no record.
* every per-class feature statistic (FedPAC's h_i and V_i, the local class centroids, FedCCFA's
  anchors) is computed from features clipped to ``dp-feature-clip`` and released with Gaussian
  noise of ``dp-statistics-noise-multiplier`` times its sensitivity: the per-class sums (L2
  sensitivity ``dp-feature-clip``), the per-class sums of squared norms (``dp-feature-clip``^2)
  and the class counts (1), each a mechanism of its own. The counts are noised, then rounded to
  non-negative integers that sum to n_i: a site's label mix is what its records say about who is
  in it. n_i itself, the number of training records, is public: the site announces it before the
  first round and DP-SGD's sampling rate is made of it.

Everything is composed by one accountant per site (:class:`Ledger`: Opacus's analysis of the
sampled Gaussian mechanism, Rényi DP by default or, with ``dp-accountant = "prv"``, the privacy
random variable accountant of Gopi et al. 2021, tighter at the same noise; a full-batch release
is the sampling rate 1). Both bound the same releases: a ledger may be read with either. The ledger is the
site's own, across runs, and the noise is drawn from a secret only the site holds
(``common.site_privacy``): nothing the server knows or sends can regenerate the noise or start
the ledger over.

The hooks that compute per-sample gradients and the RDP analysis are Opacus's (imported when
first used: a run without DP does not pay for them); the rest is plain torch and knows nothing
of Flower.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from contextvars import ContextVar
from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

# The Rényi orders the accountant tries: Opacus's RDPAccountant.DEFAULT_ALPHAS.
ORDERS: tuple[float, ...] = tuple([1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64)))
# How a site's releases are composed into one epsilon (``dp-accountant``): Rényi DP, or the
# privacy random variable accountant (PRV), which needs 4-7 % less noise for the same epsilon
# on this product's releases (bench/accounting.py) and takes seconds, not milliseconds, a call.
ACCOUNTANTS = ("rdp", "prv")


class PrivacyBudgetSpent(RuntimeError):
    """A site's next release would take its epsilon past its budget: it stops training."""


@dataclass(frozen=True)
class PrivacySettings:
    """The run config's ``dp-*`` keys (``common.config``)."""

    noise_multiplier: float = 1.0
    max_grad_norm: float = 1.0
    statistics_noise_multiplier: float = 10.0
    feature_clip: float = 10.0
    delta: float = 1e-5
    epsilon_budget: float = 0.0  # 0: no budget
    # > 0: both noise multipliers scaled by one factor so that ``rounds`` rounds reach this epsilon
    target_epsilon: float = 0.0
    rounds: int = 1
    accountant: str = "rdp"
    # DP-SGD's own recipe, in place of each training routine's (0: the routine's): the expected
    # Poisson batch of every private step, and its step size, taken without momentum or weight
    # decay. Large batches buy the same privacy for less noise per step.
    batch_size: int = 0
    step_size: float = 0.0

    def epsilon(self, ledger: Ledger) -> float:
        """Epsilon at this delta of everything ``ledger`` holds, by this accountant."""
        return ledger.epsilon(self.delta, self.accountant)

    def scaled(self, factor: float) -> PrivacySettings:
        """These settings with both noise multipliers times ``factor``."""
        return dataclasses.replace(self, noise_multiplier=self.noise_multiplier * factor,
                                   statistics_noise_multiplier=self.statistics_noise_multiplier * factor)


# One kind of release as the accountant sees it: (noise multiplier, sampling rate, times).
Mechanism = tuple[float, float, int]


@dataclass
class Ledger:
    """Everything a site has released, in the order it did: runs of one mechanism (noise
    multiplier, sampling rate, count). Equal neighbours merge, as Opacus's RDP accountant does."""

    history: list[Mechanism] = field(default_factory=list)

    def record(self, noise_multiplier: float, sample_rate: float, times: int = 1) -> None:
        if times <= 0:
            return
        if self.history and self.history[-1][:2] == (noise_multiplier, sample_rate):
            sigma, q, count = self.history[-1]
            self.history[-1] = (sigma, q, count + times)
        else:
            self.history.append((noise_multiplier, sample_rate, times))

    def then(self, other: Ledger) -> Ledger:
        """This ledger followed by ``other``'s releases."""
        merged = Ledger(list(self.history))
        for sigma, q, times in other.history:
            merged.record(sigma, q, times)
        return merged

    def epsilon(self, delta: float, accountant: str = "rdp") -> float:
        """Epsilon at ``delta`` of everything recorded (0 for nothing), by ``accountant``."""
        return epsilon_of(self.history, delta, accountant)

    def scaled(self, factor: float) -> Ledger:
        """The same releases with every noise multiplier times ``factor``."""
        return Ledger([(sigma * factor, q, times) for sigma, q, times in self.history])

    def repeated(self, times: int) -> Ledger:
        """These releases ``times`` times over, one after the other."""
        merged = Ledger()
        for _ in range(times):
            merged = merged.then(self)
        return merged

    def to_array(self) -> np.ndarray:
        return np.asarray(self.history, dtype=np.float64).reshape(-1, 3)

    @classmethod
    def from_array(cls, array: np.ndarray) -> Ledger:
        rows = np.asarray(array, dtype=np.float64).reshape(-1, 3)
        if not np.isfinite(rows).all() or (rows[:, 0] <= 0).any() or ((rows[:, 1] <= 0) | (rows[:, 1] > 1)).any() \
                or (rows[:, 2] < 1).any() or (rows[:, 2] != np.round(rows[:, 2])).any():
            raise ValueError("the site's privacy ledger is corrupt: every row must be (noise > 0, rate in (0, 1], "
                             "a whole count >= 1)")
        return cls([(float(s), float(q), int(t)) for s, q, t in rows])


def epsilon_of(history: Sequence[Mechanism], delta: float, accountant: str = "rdp") -> float:
    """(epsilon, delta)-DP of the composition of ``history``'s sampled Gaussian mechanisms: their
    Rényi DP summed order by order, converted at ``delta`` (Balle et al. 2020, as Opacus does),
    or with ``accountant = "prv"`` Opacus's PRV accountant's upper bound."""
    if accountant not in ACCOUNTANTS:
        raise ValueError(f"unknown accountant {accountant!r}: one of {', '.join(ACCOUNTANTS)}")
    if not history:
        return 0.0
    if accountant == "prv":
        return _prv_epsilon(tuple(history), delta)
    from opacus.accountants.analysis import rdp as rdp_analysis  # pylint: disable=import-outside-toplevel

    # RDP composes by addition, in any order: each distinct mechanism's RDP is computed once for
    # all its releases (a site's rounds alternate DP-SGD and statistics releases, which never merge
    # as neighbours; computed entry by entry, the cost grew with every round)
    counts: dict[tuple[float, float], int] = {}
    for sigma, q, times in history:
        counts[(sigma, q)] = counts.get((sigma, q), 0) + times
    rdp = np.zeros(len(ORDERS))
    for (sigma, q), times in counts.items():
        rdp += np.asarray(rdp_analysis.compute_rdp(q=q, noise_multiplier=sigma, steps=times, orders=list(ORDERS)))
    with warnings.catch_warnings():
        # at an epsilon far from any useful one the best order is at an end of the range: the
        # bound is then looser, never wrong
        warnings.filterwarnings("ignore", message="Optimal order is the (smallest|largest) alpha")
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(ORDERS), rdp=list(rdp), delta=delta)
    return float(epsilon)


@functools.lru_cache(maxsize=1024)
def _prv_epsilon(history: tuple[Mechanism, ...], delta: float) -> float:
    """PRV's epsilon, remembered: a site asks it of the same ledger again (the report, the budget
    check, the calibration's bisection), and each answer takes seconds."""
    from opacus.accountants import PRVAccountant  # pylint: disable=import-outside-toplevel

    accountant = PRVAccountant()
    accountant.history = list(history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # log(0) of a full-batch release, which Opacus handles
        return float(accountant.get_epsilon(delta))


def calibrate(round_ledger: Ledger, rounds: int, target: float, delta: float, spent: Ledger | None = None,
              accountant: str = "rdp") -> float:
    """The smallest factor (to 0.1 %) by which every noise multiplier of ``round_ledger``, one
    round's releases, must grow so that ``rounds`` such rounds, after what the site ``spent``
    before, stay within ``target`` at ``delta`` by ``accountant``: Opacus's
    ``get_noise_multiplier`` for a whole round's mix of mechanisms."""
    if not round_ledger.history:
        raise ValueError("a round that releases nothing needs no calibration")
    spent = spent or Ledger()
    if spent.history and spent.epsilon(delta, accountant) >= target:
        raise ValueError(f"the site has spent epsilon = {spent.epsilon(delta, accountant):.4g} at delta = {delta:g} "
                         f"already: no noise keeps it within epsilon = {target:g}")
    run = round_ledger.repeated(rounds)

    def fits_by(by: str) -> Callable[[float], bool]:
        return lambda factor: spent.then(run.scaled(factor)).epsilon(delta, by) <= target

    # Rényi DP first, from a wide bracket: it costs milliseconds an answer, and PRV's numerics
    # break down at noise far below any useful one (its domain grows without bound)
    impossible = f"no noise reaches epsilon = {target:g} at delta = {delta:g} in {rounds} rounds"
    factor = _smallest_factor(fits_by("rdp"), 1e-3, 1.0, impossible)
    if accountant == "rdp":
        return factor
    # PRV's bound is tighter: its factor lies below Rényi DP's, and not far below
    return _smallest_factor(fits_by(accountant), factor / 2, factor, impossible)


def _smallest_factor(fits: Callable[[float], bool], low: float, high: float, impossible: str) -> float:
    """The smallest factor that ``fits`` (to 0.1 %), by bisection from [low, high], each end
    moved outwards first until it brackets the answer."""
    while not fits(high):
        low, high = high, high * 2
        if high > 1e6:
            raise ValueError(impossible)
    while fits(low) and low > 1e-6:
        high, low = low, low / 2
    while high - low > 1e-3 * high:
        middle = (low + high) / 2
        if fits(middle):
            high = middle
        else:
            low = middle
    return high


@dataclass
class PrivateSite:
    """One site's local update under DP: its settings, this round's releases and the generator
    its noise is drawn from."""

    settings: PrivacySettings
    noise: torch.Generator
    ledger: Ledger = field(default_factory=Ledger)
    # the noised class counts of a label tensor, released once a round however often they are used
    _counts: dict[tuple[int, int, int], torch.Tensor] = field(default_factory=dict)


_ACTIVE: ContextVar[PrivateSite | None] = ContextVar("fedpac_private_site", default=None)


@contextmanager
def private_site(settings: PrivacySettings, noise_seed: int) -> Iterator[PrivateSite]:
    """Make every gradient step and statistic inside the block private; yields the site whose
    ledger collects the block's releases."""
    site = PrivateSite(settings, torch.Generator().manual_seed(noise_seed))
    token = _ACTIVE.set(site)
    try:
        yield site
    finally:
        _ACTIVE.reset(token)


def active() -> PrivateSite | None:
    """The private site whose local update is running here, or None without DP."""
    return _ACTIVE.get()


# ---------------------------------------------------------------------------------- DP-SGD


def steps_per_epoch(num_samples: float, batch_size: int) -> int:
    """Poisson-sampled steps in one epoch: as many as minibatches of ``batch_size`` there are."""
    return max(1, math.ceil(num_samples / batch_size))


def sample_rate(num_samples: float, batch_size: int) -> float:
    """q = batch-size / n, at most 1."""
    return min(1.0, batch_size / num_samples)


def poisson_batch(num_samples: int, rate: float, generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """The indices of one Poisson sample: each record in it with probability ``rate``, on its own."""
    chosen = torch.rand(num_samples, generator=generator) < rate
    return torch.nonzero(chosen).flatten().to(device)


def clip_factors(per_sample_grads: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """min(1, C / ||g_i||) for each record i, ||g_i|| over all of its parameters' gradients."""
    norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample_grads]).norm(dim=0)
    return (max_norm / (norms + 1e-6)).clamp(max=1.0)


def private_gradient(per_sample_grads: Sequence[torch.Tensor], settings: PrivacySettings, expected_batch: float,
                     generator: torch.Generator) -> list[torch.Tensor]:
    """DP-SGD's gradient: (sum_i clip(g_i) + N(0, (sigma C)^2 I)) / expected batch size, for each
    parameter (``per_sample_grads``: one (B, *shape) tensor per parameter)."""
    factors = clip_factors(per_sample_grads, settings.max_grad_norm)
    std = settings.noise_multiplier * settings.max_grad_norm
    noisy = []
    for g in per_sample_grads:
        summed = torch.einsum("i,i...->...", factors.to(g.dtype), g)
        noise = torch.normal(0.0, std, summed.shape, generator=generator).to(summed.device, summed.dtype)
        noisy.append((summed + noise) / expected_batch)
    return noisy


class PerSampleGradients:
    """Opacus's hooks on ``module`` while the block runs: after each backward pass, every
    trainable parameter of it carries its per-sample gradients (``grad_sample``)."""

    def __init__(self, module: nn.Module) -> None:
        self.module = module
        self.params = [p for p in module.parameters() if p.requires_grad]

    def __enter__(self) -> PerSampleGradients:
        # Opacus takes a second to import: only a site with DP on pays it
        from opacus.grad_sample import GradSampleHooks  # pylint: disable=import-outside-toplevel

        self.hooks = GradSampleHooks(self.module, loss_reduction="mean")
        self.hooks.enable_hooks()
        # A head trained on features extracted without gradients has inputs that need none:
        # torch warns that its backward hook sees only the output's gradient, which is all the
        # per-sample gradients of its weights need.
        self._warnings = ExitStack()
        self._warnings.enter_context(warnings.catch_warnings())
        warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with "
                                "respect to module outputs", category=UserWarning)
        return self

    def __exit__(self, *exc: object) -> None:
        self._warnings.close()
        self.hooks.remove_hooks()
        self.clear()
        for module in self.module.modules():
            for name in ("activations", "max_batch_len"):
                if hasattr(module, name):
                    delattr(module, name)
        for param in self.module.parameters():
            for name in ("_forward_counter", "_current_grad_sample"):
                if hasattr(param, name):
                    delattr(param, name)

    def grads(self, batch: int) -> list[torch.Tensor]:
        """Each parameter's per-sample gradients of the last backward pass ((0, ...) for none)."""
        grads = []
        for param in self.params:
            sample = getattr(param, "grad_sample", None)
            grads.append(torch.zeros((0, *param.shape), device=param.device, dtype=param.dtype)
                         if sample is None or batch == 0 else sample)
        return grads

    def clear(self) -> None:
        for param in self.params:
            param.grad_sample = None  # type: ignore[attr-defined]  # set by the hooks


# ----------------------------------------------------------------------- statistics


def clip_features(z: torch.Tensor, max_norm: float) -> torch.Tensor:
    """Each row of ``z`` scaled down to L2 norm ``max_norm`` where it is longer."""
    norms = z.norm(dim=1, keepdim=True)
    return z * (max_norm / norms.clamp(min=1e-12)).clamp(max=1.0)


def gaussian(values: torch.Tensor, sensitivity: float, site: PrivateSite) -> torch.Tensor:
    """``values`` with N(0, (sigma_s * sensitivity)^2) noise on every entry: one release."""
    sigma = site.settings.statistics_noise_multiplier
    noise = torch.normal(0.0, sigma * sensitivity, values.shape, generator=site.noise, dtype=torch.float64)
    site.ledger.record(sigma, 1.0)
    return values + noise.to(values.device, values.dtype)


def counts_summing_to(noisy: torch.Tensor, total: int) -> torch.Tensor:
    """Non-negative whole counts that sum to ``total``, in proportion to ``noisy`` (largest
    remainders, ties to the lowest class, so that the result is the same on every machine):
    post-processing of a noisy count vector and the public n."""
    clipped = noisy.clamp(min=0).to(torch.float64)
    if total == 0:
        return torch.zeros_like(clipped)
    mass = clipped.sum()
    share = clipped / mass * total if mass > 0 else torch.full_like(clipped, total / len(clipped))
    whole = share.floor()
    remainder = int(total - whole.sum().item())
    if remainder > 0:
        order = torch.argsort(share - whole, descending=True, stable=True)
        whole[order[:remainder]] += 1
    return whole


def private_counts(labels: torch.Tensor, num_classes: int, site: PrivateSite) -> torch.Tensor:
    """The class counts of ``labels`` as the site releases them this round: noised once (one
    release however often the round uses them), then whole and summing to the public n."""
    key = (labels.data_ptr(), labels.numel(), num_classes)
    if key not in site._counts:  # pylint: disable=protected-access
        exact = torch.bincount(labels, minlength=num_classes).to(torch.float64)
        site._counts[key] = counts_summing_to(gaussian(exact, 1.0, site), len(labels))  # pylint: disable=protected-access
    return site._counts[key]  # pylint: disable=protected-access
