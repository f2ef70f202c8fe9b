"""pFedVEM's math (common/methods/pfedvem/variational.py) against hand computations and Monte Carlo."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.distributions as D
import torch.nn.functional as F

from common.methods.pfedvem.variational import (
    GaussianHead,
    aggregate_bases,
    aggregate_heads,
    confidence,
    confidence_rho,
    e_step,
    gaussian_kl,
    head_from_linear,
    head_kl,
    initial_global_head,
    negative_elbo,
    posterior_mean_logits,
    predict,
    sampled_mean_nll,
    softplus_inverse,
    summed_nll,
    VEMProtocol,
)

D_FEAT, K = 6, 4


def make_head(seed: int = 0, scale: float = 1.0) -> tuple[GaussianHead, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    w, b = initial_global_head(D_FEAT, K, generator=g)
    return GaussianHead.from_prior(w, b, scale=scale), w, b


def data(n: int, seed: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, D_FEAT, generator=g), torch.randint(0, K, (n,), generator=g)


# ---------------------------------------------------------------- initialization and layout


def test_initial_scale_is_the_codes_softplus_inverse():
    assert softplus_inverse(1.0) == pytest.approx(math.log(math.e - 1))
    assert softplus_inverse(1.0) == pytest.approx(0.5413, abs=1e-4)
    assert softplus_inverse(25.0) == 25.0  # the code's shortcut for scale >= 20
    head, w, b = make_head()
    torch.testing.assert_close(head.weight_sigma(), torch.ones(D_FEAT, K))
    torch.testing.assert_close(head.bias_sigma(), torch.ones(K))
    # mu is a copy of w, not an alias: training the posterior must not move the prior
    with torch.no_grad():
        head.weight_mu.add_(1.0)
    assert not torch.equal(head.weight_mu, w)


def test_global_head_is_standard_normal_not_linear_init():
    w, b = initial_global_head(200, 50, generator=torch.Generator().manual_seed(0))
    assert w.shape == (200, 50) and b.shape == (50,)
    assert w.std().item() == pytest.approx(1.0, abs=0.05)  # nn.Linear's would be ~1/sqrt(3 * 200)


def test_layout_is_d_by_k_the_transpose_of_nn_linear():
    torch.manual_seed(0)
    linear = torch.nn.Linear(D_FEAT, K)
    weight, bias = head_from_linear(linear.weight.detach().numpy(), linear.bias.detach().numpy())
    assert weight.shape == (D_FEAT, K)
    z = torch.randn(5, D_FEAT)
    torch.testing.assert_close(
        posterior_mean_logits(z, torch.from_numpy(weight), torch.from_numpy(bias)), linear(z).detach()
    )
    with pytest.raises(ValueError, match="transposed"):
        GaussianHead.from_prior(linear.weight.detach(), linear.bias.detach())  # (K, d) with bias (K,)
    with pytest.raises(ValueError):
        head_from_linear(weight, bias)  # already (d, K): bias length is not weight.shape[0]


# ---------------------------------------------------------------- KL


def test_closed_form_kl_matches_torch_distributions():
    g = torch.Generator().manual_seed(0)
    mu_q, mu_p = torch.randn(50, generator=g), torch.randn(50, generator=g)
    sigma_q = torch.rand(50, generator=g) + 0.1
    ours = gaussian_kl(mu_q, sigma_q, mu_p, 0.7)
    ref = D.kl_divergence(D.Normal(mu_q, sigma_q), D.Normal(mu_p, 0.7 * torch.ones(50)))
    torch.testing.assert_close(ours, ref)


def test_closed_form_kl_matches_monte_carlo():
    g = torch.Generator().manual_seed(0)
    f64 = torch.float64
    mu_q, sigma_q = torch.tensor([0.3, -1.0, 2.0], dtype=f64), torch.tensor([0.5, 1.5, 1.0], dtype=f64)
    mu_p, sigma_p = torch.tensor([0.0, 0.5, 1.0], dtype=f64), 1.3
    n = 200_000
    x = mu_q + sigma_q * torch.randn(n, 3, generator=g, dtype=torch.float64)
    log_ratio = D.Normal(mu_q, sigma_q).log_prob(x) - D.Normal(mu_p, sigma_p).log_prob(x)
    estimate, stderr = log_ratio.mean(0), log_ratio.std(0) / math.sqrt(n)
    exact = gaussian_kl(mu_q, sigma_q, mu_p, sigma_p)
    assert ((estimate - exact).abs() < 5 * stderr).all(), (estimate, exact, stderr)


def test_kl_is_zero_iff_the_distributions_are_equal():
    mu, sigma = torch.tensor([0.2, -0.4]), torch.tensor([0.8, 0.8])
    torch.testing.assert_close(gaussian_kl(mu, sigma, mu, 0.8), torch.zeros(2))
    assert (gaussian_kl(mu + 0.1, sigma, mu, 0.8) > 0).all()  # different means
    assert (gaussian_kl(mu, sigma, mu, 0.9) > 0).all()  # different scales
    assert (gaussian_kl(mu, sigma * 1.2, mu, 0.8) > 0).all()


def test_head_kl_is_summed_over_all_d_elements():
    head, w, b = make_head()
    with torch.no_grad():
        head.weight_mu.add_(0.3)
        head.bias_s.sub_(0.5)
    rho = 0.9
    elementwise = torch.cat(
        [
            gaussian_kl(head.weight_mu, head.weight_sigma(), w, rho).flatten(),
            gaussian_kl(head.bias_mu, head.bias_sigma(), b, rho),
        ]
    )
    assert elementwise.numel() == head.num_elements == D_FEAT * K + K
    torch.testing.assert_close(head_kl(head, w, b, rho), elementwise.sum())


# ---------------------------------------------------------------- rsample and the NLL


def test_gradients_reach_mu_and_sigma_through_rsample():
    head, _, _ = make_head()
    z, y = data(20)
    summed_nll(head, z, y, n_mc=3).backward()  # the data term alone, no KL
    for p in head.parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0


def test_sample_cuts_the_gradient_to_the_head_but_not_to_the_base():
    head, _, _ = make_head()
    z, y = data(20)
    z.requires_grad_(True)
    sampled_mean_nll(head, z, y, n_mc=3).backward()
    assert all(p.grad is None for p in head.parameters())
    assert z.grad is not None and z.grad.abs().sum() > 0


def test_nll_is_a_sum_doubling_the_data_doubles_it_but_not_the_kl():
    head, w, b = make_head()
    z, y = data(30)
    loss1, nll1, kl1 = negative_elbo(head, z, y, w, b, 0.8, n_mc=5, generator=torch.Generator().manual_seed(7))
    z2, y2 = torch.cat([z, z]), torch.cat([y, y])
    loss2, nll2, kl2 = negative_elbo(head, z2, y2, w, b, 0.8, n_mc=5, generator=torch.Generator().manual_seed(7))
    torch.testing.assert_close(nll2, 2 * nll1)
    torch.testing.assert_close(kl2, kl1)
    torch.testing.assert_close(loss1, nll1 + kl1)
    # and the scale is n_j times the per-sample CE, not the mean
    g = torch.Generator().manual_seed(3)
    one = summed_nll(head, z, y, n_mc=1, generator=g)
    weight, bias = head.rsample(torch.Generator().manual_seed(3))
    torch.testing.assert_close(one, F.cross_entropy(z @ weight + bias, y) * len(y))


def test_nll_averages_over_mc_samples():
    head, _, _ = make_head()
    z, y = data(10)
    g = torch.Generator().manual_seed(5)
    got = summed_nll(head, z, y, n_mc=4, generator=g)
    g = torch.Generator().manual_seed(5)
    terms = []
    for _ in range(4):
        weight, bias = head.rsample(g)
        terms.append(F.cross_entropy(z @ weight + bias, y, reduction="sum"))
    torch.testing.assert_close(got, torch.stack(terms).mean())
    with pytest.raises(ValueError):
        summed_nll(head, z, y, n_mc=0)


# ---------------------------------------------------------------- confidence (M-step for rho)


def test_rho_is_one_in_round_zero():
    head, w, b = make_head()
    assert confidence_rho(head, w, b) == pytest.approx(1.0)
    assert confidence(1.0) == 1.0


def test_rho_by_hand():
    w, b = torch.zeros(2, 1), torch.zeros(1)
    head = GaussianHead(
        weight_mu=torch.tensor([[1.0], [2.0]]),
        bias_mu=torch.tensor([0.5]),
        weight_s=torch.tensor([[softplus_inverse(0.5)], [softplus_inverse(1.0)]]),
        bias_s=torch.tensor([softplus_inverse(2.0)]),
    )
    # [sigma^2: 0.25 + 1 + 4] + [||mu - w||^2: 1 + 4 + 0.25] = 10.5 over D = 3
    assert confidence_rho(head, w, b) == pytest.approx(math.sqrt(10.5 / 3), rel=1e-6)
    assert confidence(math.sqrt(10.5 / 3)) == pytest.approx(3 / 10.5)
    assert confidence(0.0) == math.inf
    assert confidence(1e-170) == math.inf  # rho^2 underflows: still an infinite confidence


def test_rho_is_taken_before_the_e_step_and_the_e_step_keeps_it_fixed():
    head, w, b = make_head()
    z, y = data(40)
    rho = confidence_rho(head, w, b)
    e_step(head, z, y, w, b, rho, steps=5, lr=1e-2, generator=torch.Generator().manual_seed(0))
    after = confidence_rho(head, w, b)
    # the posterior moved, so recomputing rho after the E-step would give another weight
    assert after != pytest.approx(rho, rel=1e-4)


# ---------------------------------------------------------------- E-step


def test_e_step_lowers_the_negative_elbo_and_keeps_w():
    head, w, b = make_head()
    w0, b0 = w.clone(), b.clone()
    z, y = data(64)
    rho = confidence_rho(head, w, b)

    def loss() -> float:
        g = torch.Generator().manual_seed(1)
        return float(negative_elbo(head, z, y, w, b, rho, n_mc=64, generator=g)[0].detach())

    before = loss()
    result = e_step(head, z, y, w, b, rho, steps=30, lr=1e-3, generator=torch.Generator().manual_seed(0))
    assert not result.restored and math.isfinite(result.train_loss)
    assert loss() < before
    assert torch.equal(w, w0) and torch.equal(b, b0)  # the prior mean is the server's, untouched


def test_e_step_nan_guard_restores_the_posterior():
    head, w, b = make_head()
    saved = head.snapshot()
    z, y = data(16)
    z[3, 2] = float("nan")
    result = e_step(head, z, y, w, b, 1.0, steps=3, generator=torch.Generator().manual_seed(0))
    assert result.restored and math.isnan(result.train_loss)
    for p, q in zip(head.parameters(), saved):
        assert torch.equal(p.detach(), q)


# ---------------------------------------------------------------- prediction


def test_prediction_uses_the_posterior_mean():
    head, _, _ = make_head()
    z, _ = data(12)
    expected = (z @ head.weight_mu + head.bias_mu).argmax(1)
    with torch.no_grad():
        head.weight_s.add_(5.0)  # sigma must not matter
    assert torch.equal(predict(z, head.weight_mu, head.bias_mu), expected)


# ---------------------------------------------------------------- server


def test_confidence_weighted_global_head_by_hand():
    weights = [np.full((2, 3), 1.0, np.float32), np.full((2, 3), 4.0, np.float32)]
    biases = [np.array([0.0, 1.0, 2.0], np.float32), np.array([3.0, 3.0, 3.0], np.float32)]
    rhos = [1.0, 0.5]  # tau = 1 and 4
    out = aggregate_heads(weights, biases, rhos)
    np.testing.assert_allclose(out.weight, np.full((2, 3), (1 * 1 + 4 * 4) / 5))
    np.testing.assert_allclose(out.bias, (1 * biases[0] + 4 * biases[1]) / 5, rtol=1e-6)
    assert out.used == [0, 1] and out.excluded == {} and not out.kept_previous
    # beta blends in the previous head (server momentum, off by default)
    prev = (np.zeros((2, 3), np.float32), np.zeros(3, np.float32))
    blended = aggregate_heads(weights, biases, rhos, previous=prev, beta=0.25)
    np.testing.assert_allclose(blended.weight, 0.75 * out.weight, rtol=1e-6)


def test_tiny_rho_does_not_overflow_the_sum_of_confidences():
    weights = [np.ones((1, 1)), np.full((1, 1), 3.0)]
    biases = [np.zeros(1), np.zeros(1)]
    out = aggregate_heads(weights, biases, [1e-154, 1e-154])  # tau = 1e308 each: their sum overflows
    np.testing.assert_allclose(out.weight, [[2.0]])


def test_global_head_nan_guard_excludes_with_reasons():
    good_w, good_b = np.ones((2, 2)), np.ones(2)
    bad_w = good_w.copy()
    bad_w[0, 1] = np.nan
    out = aggregate_heads(
        [good_w, bad_w, good_w * 3, good_w * 5, good_w * 7],
        [good_b, good_b, good_b * 3, good_b * 5, good_b * 7],
        [1.0, 1.0, float("nan"), 0.0, 2.0],
    )
    assert out.used == [0, 4]
    assert set(out.excluded) == {1, 2, 3}
    assert "mu_W" in out.excluded[1] and "rho" in out.excluded[2] and "infinite" in out.excluded[3]
    # tau 1 and 1/4
    np.testing.assert_allclose(out.weight, (1 * 1 + 0.25 * 7) / 1.25 * np.ones((2, 2)))
    assert np.isfinite(out.weight).all() and np.isfinite(out.bias).all()
    # the floor (our addition) lets a collapsed client in with a large but finite weight
    floored = aggregate_heads([good_w, good_w * 3], [good_b, good_b], [1.0, 0.0], rho_floor=0.5)
    np.testing.assert_allclose(floored.weight, (1 + 4 * 3) / 5 * np.ones((2, 2)))


def test_global_head_without_usable_clients():
    nan_w = np.full((1, 1), np.nan)
    prev = (np.full((1, 1), 2.0), np.zeros(1))
    out = aggregate_heads([nan_w], [np.zeros(1)], [1.0], previous=prev)
    assert out.kept_previous and out.used == [] and 0 in out.excluded
    np.testing.assert_array_equal(out.weight, prev[0])
    with pytest.raises(ValueError, match="no usable head"):
        aggregate_heads([nan_w], [np.zeros(1)], [1.0])


def test_sample_weighted_bases_with_nan_guard():
    states = [
        {"a": np.array([1.0, 1.0], np.float32)},
        {"a": np.array([4.0, 4.0], np.float32)},
        {"a": np.array([np.inf, 0.0], np.float32)},
        {"a": np.array([9.0, 9.0], np.float32)},
    ]
    out = aggregate_bases(states, [10, 30, 100, 0])
    np.testing.assert_allclose(out.state["a"], [(10 * 1 + 30 * 4) / 40] * 2)
    assert out.used == [0, 1] and set(out.excluded) == {2, 3}
    assert "non-finite" in out.excluded[2] and "n = 0" in out.excluded[3]
    empty = aggregate_bases(states[2:3], [5], previous={"a": np.zeros(2, np.float32)})
    assert empty.used == [] and np.array_equal(empty.state["a"], np.zeros(2))
    assert aggregate_bases(states[2:3], [5]).state is None


def test_every_unusable_rho_is_excluded_with_its_own_reason():
    """A negative, NaN or infinite rho is no confidence at all (an infinite rho would weigh 0 and,
    alone, divide 0 by 0): each is excluded, saying why, and the others are averaged."""
    ones_w, ones_b = np.ones((2, 2)), np.ones(2)
    out = aggregate_heads([ones_w, ones_w * 3, ones_w * 5, ones_w * 7], [ones_b] * 4,
                          [1.0, -0.5, float("nan"), float("inf")])
    assert out.used == [0] and sorted(out.excluded) == [1, 2, 3]
    assert all("is not a finite non-negative number" in out.excluded[j] for j in (1, 2, 3))
    np.testing.assert_array_equal(out.weight, ones_w)
    with pytest.raises(ValueError, match="no usable head"):
        aggregate_heads([ones_w], [ones_b], [float("inf")])


@pytest.mark.parametrize("beta, previous", [(0.5, None), (1.5, (np.ones((2, 2)), np.ones(2))), (-0.1, None)])
def test_server_momentum_needs_a_beta_in_0_1_and_the_previous_head(beta, previous):
    with pytest.raises(ValueError, match="beta must be in \\[0, 1\\], and beta > 0 needs the previous head"):
        aggregate_heads([np.ones((2, 2))], [np.ones(2)], [1.0], previous=previous, beta=beta)


def test_a_posterior_whose_scales_do_not_fit_its_means_is_refused():
    head, w, b = make_head()
    with pytest.raises(ValueError, match="scales must have the shapes of the means"):
        GaussianHead(head.weight_mu, head.bias_mu, head.weight_s[:, :2], head.bias_s)


def test_a_sample_is_the_mean_plus_sigma_times_a_standard_normal_draw_in_the_heads_dtype():
    """The reparameterization w = mu + sigma * eps, eps ~ N(0, I) drawn from the generator in
    the head's own dtype (a float64 head draws float64 noise, which is another sequence)."""
    g = torch.Generator().manual_seed(0)
    w, b = initial_global_head(D_FEAT, K, generator=g)
    head = GaussianHead.from_prior(w.double(), b.double(), scale=0.5)
    weight, bias = head.rsample(torch.Generator().manual_seed(7))
    expected = torch.Generator().manual_seed(7)
    eps_w = torch.randn(head.weight_mu.shape, generator=expected, dtype=torch.float64)
    eps_b = torch.randn(head.bias_mu.shape, generator=expected, dtype=torch.float64)
    torch.testing.assert_close(weight, head.weight_mu + F.softplus(head.weight_s) * eps_w, rtol=0, atol=0)
    torch.testing.assert_close(bias, head.bias_mu + F.softplus(head.bias_s) * eps_b, rtol=0, atol=0)


def test_a_sampling_rate_outside_0_1_is_refused_with_the_rate():
    with pytest.raises(ValueError, match=r"the sampling rate must be in \(0, 1\], got 1.5"):
        VEMProtocol(sampling_rate=1.5)
