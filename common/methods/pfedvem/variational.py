"""pFedVEM (Zhu, Ma, Blaschko, CVPR 2023): the math of a Bayesian linear head and its server side.

Client j holds a mean-field Gaussian posterior q_j(W, b) = N(mu_j, diag sigma_j^2) over a linear
head with sigma = softplus(s); the server holds w = (W_bar, b_bar), the mean of the prior
N(w, rho_j^2 I). Logits are z @ W + b with W shaped (d, K): the *transpose* of
``nn.Linear.weight``. Everything follows the official code (JunyiZhu-AI/confidence_aware_PFL,
``vem/vem_client.py`` and ``vem/server.py``) where the paper is silent; see PFEDVEM_SPEC.md.
Plain torch and numpy; nothing here knows about Flower.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.nn.functional as F

from common import privacy

from common.averaging import weighted_average
from common.methods.pfedvem import SAMPLE_PROTOCOLS as PROTOCOLS


def softplus_inverse(scale: float) -> float:
    """s with softplus(s) = ``scale``: the code's initial s (0.5413 for scale = 1).

    Like the code, a scale >= 20 is used as s directly: softplus(s) = s to float precision
    there, and expm1 would overflow for large scales.
    """
    if scale <= 0:
        raise ValueError(f"the initial sigma must be positive, got {scale}")
    return math.log(math.expm1(scale)) if scale < 20 else float(scale)


def head_from_linear(weight: np.ndarray, bias: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``nn.Linear`` layout (K, d), (K,) -> pFedVEM layout (d, K), (K,) (a copy)."""
    weight, bias = np.asarray(weight), np.asarray(bias)
    if weight.ndim != 2 or bias.shape != (weight.shape[0],):
        raise ValueError(f"nn.Linear weight (K, d) {weight.shape} and bias (K,) {bias.shape} do not match")
    return weight.T.copy(), bias.copy()


def initial_global_head(
    dim: int, num_classes: int, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The server's w^0: W_bar (d, K) and b_bar (K,) drawn ~ N(0, 1), as the code's ``torch.randn``.

    Not ``nn.Linear``'s initialization: the prior mean starts at unit scale.
    """
    return (
        torch.randn(dim, num_classes, generator=generator),
        torch.randn(num_classes, generator=generator),
    )


@dataclass
class GaussianHead:
    """A client's posterior q_j(W, b): means ``weight_mu`` (d, K), ``bias_mu`` (K,) and
    pre-softplus scales ``weight_s``, ``bias_s`` of the same shapes.

    Persistent client state: the code never resets mu to w^t between rounds.
    """

    weight_mu: torch.Tensor
    bias_mu: torch.Tensor
    weight_s: torch.Tensor
    bias_s: torch.Tensor

    def __post_init__(self) -> None:
        if self.weight_mu.ndim != 2 or self.bias_mu.shape != (self.weight_mu.shape[1],):
            raise ValueError(
                f"head weight must be (d, K) with bias (K,), got {tuple(self.weight_mu.shape)} "
                f"and {tuple(self.bias_mu.shape)}; nn.Linear's (K, d) must be transposed"
            )
        if self.weight_s.shape != self.weight_mu.shape or self.bias_s.shape != self.bias_mu.shape:
            raise ValueError("scales must have the shapes of the means")

    @classmethod
    def from_prior(cls, weight: torch.Tensor, bias: torch.Tensor, scale: float = 1.0) -> GaussianHead:
        """mu = a copy of w, sigma = ``scale`` everywhere (the code's client initialization)."""
        s = softplus_inverse(scale)
        return cls(
            weight_mu=weight.detach().clone().requires_grad_(True),
            bias_mu=bias.detach().clone().requires_grad_(True),
            weight_s=torch.full_like(weight, s).requires_grad_(True),
            bias_s=torch.full_like(bias, s).requires_grad_(True),
        )

    @classmethod
    def from_linear(
        cls, weight_mu: torch.Tensor, bias_mu: torch.Tensor, weight_s: torch.Tensor, bias_s: torch.Tensor
    ) -> GaussianHead:
        """A posterior from tensors in ``nn.Linear``'s layout, weight (K, d): the wire's and the
        server's layout. The weights are transposed here to pFedVEM's (d, K) (trainable copies)."""
        return cls(
            weight_mu=weight_mu.detach().T.clone().requires_grad_(True),
            bias_mu=bias_mu.detach().clone().requires_grad_(True),
            weight_s=weight_s.detach().T.clone().requires_grad_(True),
            bias_s=bias_s.detach().clone().requires_grad_(True),
        )

    def linear_mean(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(mu_W^T (K, d), mu_b): the posterior mean as an ``nn.Linear`` head (detached copies)."""
        return self.weight_mu.detach().T.clone(), self.bias_mu.detach().clone()

    def linear_scale(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(s_W^T (K, d), s_b): the pre-softplus scales in ``nn.Linear``'s layout (detached copies)."""
        return self.weight_s.detach().T.clone(), self.bias_s.detach().clone()

    def parameters(self) -> list[torch.Tensor]:
        """[weight_mu, bias_mu, weight_s, bias_s], the code's ``var_params`` order."""
        return [self.weight_mu, self.bias_mu, self.weight_s, self.bias_s]

    @property
    def num_elements(self) -> int:
        """D = d K + K, the number of head weights (rho is averaged over these)."""
        return self.weight_mu.numel() + self.bias_mu.numel()

    def weight_sigma(self) -> torch.Tensor:
        return F.softplus(self.weight_s)

    def bias_sigma(self) -> torch.Tensor:
        return F.softplus(self.bias_s)

    def rsample(self, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(W, b) = mu + sigma * eps, eps ~ N(0, I): the reparameterization trick.

        Gradients reach mu and s through the sample; the E-step needs this (``sample()`` would
        leave only the KL term to move the posterior).
        """
        eps_w = torch.randn(self.weight_mu.shape, generator=generator, dtype=self.weight_mu.dtype)
        eps_b = torch.randn(self.bias_mu.shape, generator=generator, dtype=self.bias_mu.dtype)
        eps_w, eps_b = eps_w.to(self.weight_mu.device), eps_b.to(self.bias_mu.device)
        return self.weight_mu + self.weight_sigma() * eps_w, self.bias_mu + self.bias_sigma() * eps_b

    def sample(self, generator: torch.Generator | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """A sample with no gradient to the head: what base training uses."""
        with torch.no_grad():
            return self.rsample(generator)

    def snapshot(self) -> list[torch.Tensor]:
        """Detached copies of the parameters, to restore with ``restore``."""
        return [p.detach().clone() for p in self.parameters()]

    def restore(self, saved: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for p, q in zip(self.parameters(), saved, strict=True):
                p.copy_(q)


def gaussian_kl(
    mu_q: torch.Tensor, sigma_q: torch.Tensor, mu_p: torch.Tensor, sigma_p: torch.Tensor | float
) -> torch.Tensor:
    """Elementwise KL(N(mu_q, sigma_q^2) || N(mu_p, sigma_p^2)), closed form.

    ln(sigma_p / sigma_q) + (sigma_q^2 + (mu_q - mu_p)^2) / (2 sigma_p^2) - 1/2, the formula of
    ``torch.distributions.kl_divergence`` for two Normals (the code's call).
    """
    sigma_p = torch.as_tensor(sigma_p, dtype=sigma_q.dtype, device=sigma_q.device)
    return (
        torch.log(sigma_p) - torch.log(sigma_q)
        + (sigma_q.square() + (mu_q - mu_p).square()) / (2 * sigma_p.square())
        - 0.5
    )


def head_kl(head: GaussianHead, prior_weight: torch.Tensor, prior_bias: torch.Tensor, rho: float) -> torch.Tensor:
    """KL(q_j || N(w, rho^2 I)), summed over all D weights and biases (a scalar)."""
    return (
        gaussian_kl(head.weight_mu, head.weight_sigma(), prior_weight, rho).sum()
        + gaussian_kl(head.bias_mu, head.bias_sigma(), prior_bias, rho).sum()
    )


def confidence_rho(head: GaussianHead, prior_weight: torch.Tensor, prior_bias: torch.Tensor) -> float:
    """rho_j (eq. 7): sqrt([sum sigma^2 + ||mu - w||^2] / D) over W and b together.

    Compute it *before* the E-step, from the posterior as it came out of the last round and the
    new w^t; the same rho is the prior's scale in this round's E-step and the server's weight.
    Recomputing it after the E-step, or against w^{t+1}, changes the weights.
    """
    with torch.no_grad():
        total = (
            head.weight_sigma().square().sum()
            + (head.weight_mu - prior_weight).square().sum()
            + head.bias_sigma().square().sum()
            + (head.bias_mu - prior_bias).square().sum()
        )
        return float(total.div(head.num_elements).sqrt().item())


def confidence(rho: float) -> float:
    """tau_j = 1 / rho_j^2, the client's weight in the global head (inf for rho = 0)."""
    squared = float(rho) * float(rho)
    # rho^2 underflows to 0 for rho below ~1e-162: that, too, is an infinite confidence
    return math.inf if squared == 0 else 1.0 / squared


def summed_nll(
    head: GaussianHead,
    features: torch.Tensor,
    labels: torch.Tensor,
    n_mc: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """(1/M) sum_m sum_i CE(z_i W_m + b_m, y_i) with M reparameterized samples.

    A *sum* over the n_j samples, not a mean: with a mean the KL would weigh n_j times too much.
    On minibatches, scale the batch mean by n_j instead.
    """
    if n_mc < 1:
        raise ValueError(f"n_mc must be >= 1, got {n_mc}")
    nll = features.new_zeros(())
    for _ in range(n_mc):
        weight, bias = head.rsample(generator)
        nll = nll + F.cross_entropy(features @ weight + bias, labels, reduction="sum") / n_mc
    return nll


def negative_elbo(
    head: GaussianHead,
    features: torch.Tensor,
    labels: torch.Tensor,
    prior_weight: torch.Tensor,
    prior_bias: torch.Tensor,
    rho: float,
    n_mc: int,
    generator: torch.Generator | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The E-step loss NLL + KL (eq. 5, sign as the code minimizes it). Returns (loss, nll, kl)."""
    nll = summed_nll(head, features, labels, n_mc, generator)
    kl = head_kl(head, prior_weight, prior_bias, rho)
    return nll + kl, nll, kl


@dataclass(frozen=True)
class EStepResult:
    """``train_loss``: the code's per-sample NLL averaged over steps; ``restored``: the NaN guard fired."""

    train_loss: float
    restored: bool


def e_step(
    head: GaussianHead,
    features: torch.Tensor,
    labels: torch.Tensor,
    prior_weight: torch.Tensor,
    prior_bias: torch.Tensor,
    rho: float,
    steps: int = 10,
    lr: float = 1e-3,
    momentum: float = 0.9,
    n_mc: int = 5,
    generator: torch.Generator | None = None,
) -> EStepResult:
    """``steps`` full-batch SGD steps on (mu, s) against the negative ELBO; ``features`` = f_theta(x)
    for the whole local set, computed once without gradients.

    A new optimizer each call (the code builds one per round). If the loss turns NaN, mu and s go
    back to their values at entry (the code checks its NLL; a non-finite parameter also restores
    here, our addition). With differential privacy on (``common.privacy``) each step's NLL
    gradient is DP-SGD's over the whole set (sampling rate 1), the KL's added after the noise.
    """
    features, prior_weight, prior_bias = features.detach(), prior_weight.detach(), prior_bias.detach()
    saved = head.snapshot()
    optimizer = torch.optim.SGD(head.parameters(), lr=lr, momentum=momentum)
    total = 0.0
    site = privacy.active()
    for _ in range(steps):
        optimizer.zero_grad()
        if site is None:
            loss, nll, _ = negative_elbo(head, features, labels, prior_weight, prior_bias, rho, n_mc, generator)
            loss.backward()
        else:
            nll = _private_elbo_gradient(head, features, labels, prior_weight, prior_bias, rho, n_mc, generator, site)
        optimizer.step()
        total += float(nll.item())
    train_loss = total / (max(steps, 1) * max(len(labels), 1))
    finite = all(bool(torch.isfinite(p).all()) for p in head.parameters())
    restored = math.isnan(train_loss) or not finite
    if restored:
        head.restore(saved)
    return EStepResult(train_loss=train_loss, restored=restored)


def per_sample_nll_gradients(
    head: GaussianHead, features: torch.Tensor, labels: torch.Tensor,
    draws: list[tuple[torch.Tensor, torch.Tensor]],
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Each sample's gradient of its NLL term (1/M) sum_m CE(z_i W_m + b_m, y_i), with the heads
    W_m = mu + sigma * eps_m of ``draws`` (eps_W, eps_b), with respect to ``head.parameters()``
    (one (n, *shape) tensor each), and the summed NLL. In closed form: dCE/dlogits = softmax - onehot,
    and d sigma / d s = sigmoid(s)."""
    n_mc = len(draws)
    z = features.detach()
    grad_w_mu = z.new_zeros((len(z), *head.weight_mu.shape))
    grad_b_mu = z.new_zeros((len(z), *head.bias_mu.shape))
    grad_w_s, grad_b_s = torch.zeros_like(grad_w_mu), torch.zeros_like(grad_b_mu)
    nll = z.new_zeros(())
    with torch.no_grad():
        dsigma_w, dsigma_b = torch.sigmoid(head.weight_s), torch.sigmoid(head.bias_s)
        onehot = F.one_hot(labels, head.bias_mu.numel()).to(z.dtype)
        for eps_w, eps_b in draws:
            logits = z @ (head.weight_mu + head.weight_sigma() * eps_w) + head.bias_mu + head.bias_sigma() * eps_b
            nll += F.cross_entropy(logits, labels, reduction="sum") / n_mc
            residual = (torch.softmax(logits, dim=1) - onehot) / n_mc  # (n, K)
            grad_w = z.unsqueeze(2) * residual.unsqueeze(1)  # (n, d, K)
            grad_w_mu += grad_w
            grad_w_s += grad_w * (eps_w * dsigma_w)
            grad_b_mu += residual
            grad_b_s += residual * (eps_b * dsigma_b)
    return [grad_w_mu, grad_b_mu, grad_w_s, grad_b_s], nll


def _private_elbo_gradient(  # pylint: disable=too-many-arguments
    head: GaussianHead, features: torch.Tensor, labels: torch.Tensor, prior_weight: torch.Tensor,
    prior_bias: torch.Tensor, rho: float, n_mc: int, generator: torch.Generator | None, site: privacy.PrivateSite,
) -> torch.Tensor:
    """Set the head's gradients to one DP-SGD step's on the negative ELBO (the summed NLL's
    per-sample gradients clipped and noised, the KL's exact); returns the summed NLL."""
    draws = []
    for _ in range(n_mc):  # rsample's draws, in its order
        eps_w = torch.randn(head.weight_mu.shape, generator=generator, dtype=head.weight_mu.dtype)
        eps_b = torch.randn(head.bias_mu.shape, generator=generator, dtype=head.bias_mu.dtype)
        draws.append((eps_w.to(head.weight_mu.device), eps_b.to(head.bias_mu.device)))
    per_sample, nll = per_sample_nll_gradients(head, features, labels, draws)
    # the NLL is a sum over the samples, not a mean: the noisy sum is its gradient as it is
    noisy = privacy.private_gradient(per_sample, site.settings, 1.0, site.noise)
    kl = torch.autograd.grad(head_kl(head, prior_weight, prior_bias, rho), head.parameters())
    for param, grad, kl_grad in zip(head.parameters(), noisy, kl, strict=True):
        param.grad = grad + kl_grad
    site.ledger.record(site.settings.noise_multiplier, 1.0)
    return nll


def sampled_mean_nll(
    head: GaussianHead,
    features: torch.Tensor,
    labels: torch.Tensor,
    n_mc: int,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Base-training loss: (1/M) sum_m mean_i CE(z_i W_m + b_m, y_i), fresh ``sample()`` heads.

    Gradients reach the features (the base) but never the head. A batch *mean*, unlike the E-step.
    """
    loss = features.new_zeros(())
    for _ in range(n_mc):
        weight, bias = head.sample(generator)
        loss = loss + F.cross_entropy(features @ weight + bias, labels) / n_mc
    return loss


def posterior_mean_logits(features: torch.Tensor, weight_mu: torch.Tensor, bias_mu: torch.Tensor) -> torch.Tensor:
    """Prediction: z @ mu_W + mu_b, the posterior mean (the code's ``test_use_mc = False``)."""
    return features @ weight_mu + bias_mu


def predict(features: torch.Tensor, weight_mu: torch.Tensor, bias_mu: torch.Tensor) -> torch.Tensor:
    """The argmax class under the posterior-mean head."""
    return posterior_mean_logits(features, weight_mu, bias_mu).argmax(dim=1)


# ---------------------------------------------------------------- server side (numpy)

# Separates the sample's random stream from the harness's node sampling of the same (seed, round).
_SAMPLE_STREAM = 0x56454D  # "VEM"


@dataclass(frozen=True)
class VEMProtocol:
    """How a pFedVEM round runs (run config ``vem-protocol``, ``vem-sampling-rate``), and the
    scale every client's posterior starts from (``vem-initial-sigma``).

    ``all-train`` is the paper's and the code's: every client trains every round, the server
    aggregates the sample S_t only, and keeps every client's posterior. ``sampled-train`` trains
    only S_t: cheaper, but clients outside S_t skip their E-step, which changes the algorithm.
    """

    protocol: str = "all-train"
    sampling_rate: float = 0.1
    initial_sigma: float = 1.0

    def __post_init__(self) -> None:
        if self.protocol not in PROTOCOLS:
            raise ValueError(f"protocol must be one of {', '.join(PROTOCOLS)}, got {self.protocol!r}")
        if not 0.0 < self.sampling_rate <= 1.0:
            raise ValueError(f"the sampling rate must be in (0, 1], got {self.sampling_rate}")

    @property
    def all_train(self) -> bool:
        return self.protocol == "all-train"


def draw_sample(num_clients: int, rate: float, seed: int, server_round: int, minimum: int = 2) -> list[int]:
    """S_t: each of the clients 0..num_clients-1 independently with probability ``rate``, drawn
    again until at least ``minimum`` are in (the code's ``BinomialSampler``); all of them when
    there are no more than ``minimum``.

    Seeded by (``seed``, ``server_round``) alone, as the paper says (the code seeds 1234 in every
    run): a resumed run, or a run whose nodes restarted, draws the same S_t.
    """
    if num_clients <= minimum:
        return list(range(num_clients))
    rng = np.random.default_rng([seed, server_round, _SAMPLE_STREAM])
    while True:
        chosen = np.flatnonzero(rng.random(num_clients) < rate)
        if len(chosen) >= minimum:
            return [int(j) for j in chosen]


@dataclass(frozen=True)
class SampleAggregate:
    """One pFedVEM server step over S_t: theta^{t+1}, w^{t+1} = (weight, bias) in the layout the
    inputs had, and the input indices whose base and head entered the means."""

    extractor: dict[str, np.ndarray]
    weight: np.ndarray
    bias: np.ndarray
    used: list[int]
    excluded: dict[int, str] = field(default_factory=dict)


def aggregate_sample(  # pylint: disable=too-many-arguments
    extractors: list[dict[str, np.ndarray]],
    weights: list[np.ndarray],
    biases: list[np.ndarray],
    rhos: list[float],
    num_examples: list[float] | np.ndarray,
    in_sample: list[bool],
    previous_extractor: dict[str, np.ndarray],
    previous_head: tuple[np.ndarray, np.ndarray],
) -> SampleAggregate:
    """theta^{t+1} (sample-weighted, :func:`aggregate_bases`) and w^{t+1} (confidence-weighted,
    :func:`aggregate_heads`) over the replies in S_t only (``in_sample``); replies outside S_t
    trained their posterior, which the caller keeps, but enter no mean.

    Elementwise means: ``weights`` may be in either layout, (d, K) or ``nn.Linear``'s (K, d), as
    long as ``previous_head`` is in the same. A client is used for both parts or for neither, so
    that theta^{t+1} and w^{t+1} come from the same clients. Without a usable client in S_t the
    previous extractor and head are kept.
    """
    count = len(extractors)
    if not count == len(weights) == len(biases) == len(rhos) == len(num_examples) == len(in_sample):
        raise ValueError("one extractor, head, rho, sample count and membership per reply")
    sampled = [j for j in range(count) if in_sample[j]]
    heads = aggregate_heads([weights[j] for j in sampled], [biases[j] for j in sampled],
                            [rhos[j] for j in sampled], previous=previous_head)
    usable = [sampled[i] for i in heads.used]
    excluded = {sampled[i]: reason for i, reason in heads.excluded.items()}
    n = np.asarray(num_examples, dtype=np.float64)
    bases = aggregate_bases([extractors[j] for j in usable], n[usable], previous=previous_extractor)
    excluded.update({usable[i]: reason for i, reason in bases.excluded.items()})
    used = [usable[i] for i in bases.used]
    if len(used) < len(usable):  # a client left out of the base leaves the head, too
        heads = aggregate_heads([weights[j] for j in used], [biases[j] for j in used],
                                [rhos[j] for j in used], previous=previous_head)
    assert bases.state is not None  # the previous extractor stands in when nobody is usable
    return SampleAggregate(bases.state, heads.weight, heads.bias, used, excluded)


@dataclass(frozen=True)
class HeadAggregate:
    """The new global head w^{t+1}; ``used``: input indices that entered the mean;
    ``excluded``: index -> why it was left out; ``kept_previous``: nobody was usable."""

    weight: np.ndarray
    bias: np.ndarray
    used: list[int]
    excluded: dict[int, str] = field(default_factory=dict)
    kept_previous: bool = False


def _non_finite_reason(arrays: dict[str, np.ndarray]) -> str | None:
    for key, array in arrays.items():
        if not np.isfinite(array).all():
            return f"{key} has non-finite values"
    return None


def aggregate_heads(
    weights: list[np.ndarray],
    biases: list[np.ndarray],
    rhos: list[float],
    previous: tuple[np.ndarray, np.ndarray] | None = None,
    beta: float = 0.0,
    rho_floor: float = 0.0,
) -> HeadAggregate:
    """w^{t+1} = beta w^t + (1 - beta) sum_j tau_j mu_j / sum_j tau_j, tau_j = 1 / rho_j^2, for W
    and b with the same weights (eq. 7, Alg. 1 line 9; ``update_center_model``).

    Weighted by confidence, never by n_j. A client whose mu, rho or tau is not finite (rho = 0 gives
    tau = inf) is excluded with its reason instead of turning the mean into NaN. ``rho_floor`` > 0
    clamps rho from below (our addition; 0 = off, as in the code). If no client is usable the
    previous head is kept, or a ValueError is raised when there is none.
    """
    if not len(weights) == len(biases) == len(rhos):
        raise ValueError(f"{len(weights)} weights, {len(biases)} biases and {len(rhos)} rhos")
    if not 0.0 <= beta <= 1.0 or (beta > 0 and previous is None):
        raise ValueError(f"beta must be in [0, 1], and beta > 0 needs the previous head; got {beta}")
    used, excluded, taus = [], {}, []
    for j, (weight, bias, rho) in enumerate(zip(weights, biases, rhos)):
        reason = _non_finite_reason({"mu_W": np.asarray(weight), "mu_b": np.asarray(bias)})
        if reason is None and not (math.isfinite(rho) and rho >= 0):
            reason = f"rho = {rho} is not a finite non-negative number"
        if reason is None:
            tau = confidence(max(float(rho), rho_floor))
            if not math.isfinite(tau):
                reason = f"rho = {rho} gives an infinite confidence 1/rho^2"
        if reason is not None:
            excluded[j] = reason
            continue
        used.append(j)
        taus.append(tau)
    if not used:
        if previous is None:
            raise ValueError(f"no usable head to aggregate: {excluded}")
        return HeadAggregate(previous[0].copy(), previous[1].copy(), [], excluded, kept_previous=True)
    # divide by the largest tau first: each tau is finite, but their sum can still overflow
    scaled = np.asarray(taus) / max(taus)
    mean = weighted_average([{"W": np.asarray(weights[j]), "b": np.asarray(biases[j])} for j in used], scaled)
    weight_new, bias_new = mean["W"], mean["b"]
    if previous is not None and beta > 0:
        # server momentum, only in the code (default 0 = off)
        weight_new = (beta * previous[0] + (1 - beta) * weight_new).astype(weight_new.dtype)
        bias_new = (beta * previous[1] + (1 - beta) * bias_new).astype(bias_new.dtype)
    return HeadAggregate(weight_new, bias_new, used, excluded)


@dataclass(frozen=True)
class BaseAggregate:
    """theta^{t+1}, the input indices averaged, and index -> reason for those left out."""

    state: dict[str, np.ndarray] | None  # None: nobody usable and no previous state
    used: list[int]
    excluded: dict[int, str] = field(default_factory=dict)


def aggregate_bases(
    states: list[dict[str, np.ndarray]],
    num_examples: list[int] | np.ndarray,
    previous: dict[str, np.ndarray] | None = None,
    beta: float = 0.0,
) -> BaseAggregate:
    """theta^{t+1} = beta theta^t + (1 - beta) sum_j n_j theta_j / sum_j n_j (FedAvg, ``update_base_model``).

    A client with a non-finite array or n_j <= 0 is excluded with its reason. Without usable
    clients the previous state is kept (``state`` is None when there is none).
    """
    n = np.asarray(num_examples, dtype=np.float64)
    if len(states) != len(n):
        raise ValueError(f"{len(states)} states but {len(n)} sample counts")
    if not 0.0 <= beta <= 1.0 or (beta > 0 and previous is None):
        raise ValueError(f"beta must be in [0, 1], and beta > 0 needs the previous state; got {beta}")
    used, excluded = [], {}
    for j, state in enumerate(states):
        reason = _non_finite_reason(state) if np.isfinite(n[j]) and n[j] > 0 else f"n = {n[j]} samples"
        if reason is None:
            used.append(j)
        else:
            excluded[j] = reason
    if not used:
        return BaseAggregate(None if previous is None else dict(previous), [], excluded)
    state = weighted_average([states[j] for j in used], n[used])
    if previous is not None and beta > 0:
        state = {k: (beta * previous[k] + (1 - beta) * v).astype(v.dtype) for k, v in state.items()}
    return BaseAggregate(state, used, excluded)
