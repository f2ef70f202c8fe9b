"""Record-level differential privacy at a site (``common.privacy``): the per-sample gradients are
right and clipped before the noise, the noise has the mechanism's scale, the accountant agrees
with an independent computation, a site over its budget stops while the run goes on, and the
site's ledger and epsilon reach the outputs."""

from __future__ import annotations

import csv
import logging
import math
import re
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from flwr.serverapp import Grid
from torch import nn

from client_app import app as client_app
from common import privacy
from common import protocol as p
from common.config import parse_run_config, privacy_settings
from common.methods import METHODS
from common.methods.client import ClientResult, LocalData, Received, SiteState, client_routine
from common.model import FedPACNet, model_inputs
from common.privacy import Ledger, PrivacyBudgetSpent, PrivacySettings, private_site
from common.site_privacy import Entry, SiteLedger
from common.methods.fedpac.statistics import feature_statistics
from common.statistics import class_feature_sums, class_means
from common.training import class_counts, sgd_epochs, train_extractor, train_head, train_joint
from federation import InProcessGrid
from server_app.app import run_fedpac

DELTA = 1e-5


def _data(n: int = 96, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, 1, 28, 28, generator=g), torch.randint(0, 10, (n,), generator=g)


def _model(seed: int = 0) -> FedPACNet:
    torch.manual_seed(seed)
    return FedPACNet(1, 28, 10)


CFG = parse_run_config({"batch-size": 16, "local-epochs": 1, "extractor-lr": 0.05})


# ------------------------------------------------------------------------------- DP-SGD


def _clipped_sum_by_autograd(params: list[torch.Tensor], loss_of, n: int,
                             max_norm: float) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """Each record's gradient by autograd, one record at a time; their norms and clipped sum."""
    per_record = [torch.autograd.grad(loss_of(slice(i, i + 1)), params) for i in range(n)]
    norms = torch.stack([torch.cat([g.flatten() for g in grads]).norm() for grads in per_record])
    factors = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    return norms, [sum(factors[i] * per_record[i][j] for i in range(n)) for j in range(len(params))]


@pytest.mark.parametrize("case", ["whole model", "extractor under a frozen head", "head on frozen features",
                                  "a layer called twice", "strided and dilated convolution",
                                  "behind the ScatterNet front end"])
def test_the_clipped_sum_is_each_record_s_own_gradient_clipped_and_summed(case):
    """DP-SGD's clipped sum, read from each layer's input and output gradient (the linear layers'
    without forming any record's gradient), equals the sum of every record's own gradient by
    autograd, one record at a time, each scaled to the clipping norm: for the product's model
    trained whole, its extractor under a frozen head, its head on features without gradients, a
    layer a step calls twice, a convolution with a stride, a dilation and padding, and the model
    behind the ScatterNet front end (its normalization has no parameters to clip)."""
    x, y = _data(9)
    model = _model()
    if case == "a layer called twice":
        layer = nn.Linear(4, 4)
        model = nn.Sequential(layer, nn.LeakyReLU(), layer)
        x = torch.randn(9, 4) * 3
        module, params = model, list(model.parameters())
        loss_of = lambda i: F.cross_entropy(model(x[i]), y[i] % 4)  # noqa: E731
    elif case == "strided and dilated convolution":
        model = nn.Sequential(nn.Conv2d(1, 4, 3, stride=2, dilation=2, padding=(2, 1)), nn.Flatten(), nn.LazyLinear(10))
        model(x[:1])
        module, params = model, list(model.parameters())
        loss_of = lambda i: F.cross_entropy(model(x[i]), y[i])  # noqa: E731
    elif case == "behind the ScatterNet front end":
        torch.manual_seed(0)
        model = FedPACNet(1, 28, 10, "scatternet")
        x = model_inputs(x, "scatternet")
        module, params = model, list(model.parameters())
        loss_of = lambda i: F.cross_entropy(model(x[i]), y[i])  # noqa: E731
    elif case == "head on frozen features":
        with torch.no_grad():
            features = model.extractor(x)
        module, params = model.head, list(model.head.parameters())
        loss_of = lambda i: F.cross_entropy(model.head(features[i]), y[i])  # noqa: E731
    else:
        frozen_head = case == "extractor under a frozen head"
        model.head.requires_grad_(not frozen_head)
        module = model.extractor if frozen_head else model
        params = [q for q in module.parameters() if q.requires_grad]
        loss_of = lambda i: F.cross_entropy(model(x[i]), y[i])  # noqa: E731
    max_norm = 0.5
    norms, want = _clipped_sum_by_autograd(params, loss_of, len(y), max_norm)
    assert int((norms > max_norm).sum()) > len(y) // 2  # the clipping bites
    with privacy.ClippedGradients(module) as clipped:
        loss_of(slice(None)).backward()
        got = clipped.clipped_sums(max_norm, len(y))
    assert len(got) == len(params)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)


def test_clipping_refuses_a_layer_it_cannot_clip_and_an_empty_step_sums_to_zero():
    model = nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4))
    with pytest.raises(ValueError, match="LayerNorm"):
        privacy.ClippedGradients(model)
    head = nn.Linear(4, 2)
    with privacy.ClippedGradients(head) as clipped:  # a Poisson sample with no record: no backward pass
        sums = clipped.clipped_sums(1.0, 0)
    assert all(s.shape == q.shape and not s.any() for s, q in zip(sums, head.parameters()))


@pytest.mark.parametrize("routine", ["joint", "head", "extractor with alignment"])
def test_no_record_s_gradient_passes_the_clipping_norm_before_the_noise(routine, monkeypatch):
    """Every step of every training routine clips each record's gradient (over all parameters
    it trains) to dp-max-grad-norm before the noise; the norm is small enough here that most
    records' gradients were longer."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = privacy.clip_factors

    def spy(norms, max_norm):
        factors = original(norms, max_norm)
        if len(norms):
            seen.append((norms, norms * factors))
        return factors

    monkeypatch.setattr(privacy, "clip_factors", spy)
    x, y = _data()
    model, g = _model(), torch.Generator().manual_seed(0)
    settings = PrivacySettings(noise_multiplier=1.0, max_grad_norm=0.05)
    with private_site(settings, 1) as site:
        if routine == "joint":
            train_joint(model, x, y, CFG, g)
        elif routine == "head":
            train_head(model, x, y, CFG, g)
        else:
            train_extractor(model, x, y, CFG, g, lambda f, labels: f.square().mean(), 1.0)
    assert len(seen) >= 4
    assert all(float(clipped.max()) <= settings.max_grad_norm * (1 + 1e-5) for _, clipped in seen)
    assert sum(int((norms > settings.max_grad_norm).sum()) for norms, _ in seen) > len(x) // 2
    # the steps went into the site's ledger: one epoch of ceil(96 / 16) Poisson-sampled steps
    assert site.ledger.history == [(1.0, 16 / 96, 6)]


def test_dp_sgd_noise_has_the_mechanism_s_scale():
    """The noisy gradient of a step with no record in it is N(0, (sigma C)^2) / expected batch."""
    settings = PrivacySettings(noise_multiplier=1.3, max_grad_norm=0.7)
    empty = [torch.zeros((0, 200, 500))]
    (noise,) = privacy.private_gradient(empty, settings, 32.0, torch.Generator().manual_seed(0))
    assert abs(float(noise.mean())) < 0.01 * 1.3 * 0.7 / 32
    assert float(noise.std()) == pytest.approx(1.3 * 0.7 / 32, rel=0.02)


class _RecordingSGD(torch.optim.SGD):
    """Plain SGD at step size 0 (the model stays put, so each record's gradient stays the same)
    that keeps the gradient of every step it takes."""

    def __init__(self, params) -> None:  # noqa: ANN001  # torch.optim.SGD's
        super().__init__(params, lr=0.0, momentum=0.0)
        self.seen: list[list[torch.Tensor]] = []

    def step(self, closure=None):  # noqa: ANN001, ANN201  # torch.optim.SGD's
        self.seen.append([q.grad.clone() for group in self.param_groups for q in group["params"]])
        return super().step(closure)


def test_dp_sgd_s_steps_are_a_from_scratch_mechanism_normalized_by_the_expected_batch():
    """Every step of ``sgd_epochs`` at a private site, with q = 1/5: the records a Poisson draw of
    the sampling generator takes, each record's own gradient (autograd, one record at a time)
    clipped to C over all parameters, their sum plus N(0, (sigma C)^2) from the site's generator,
    divided by the *expected* batch q n = 8, not by the batch the draw happened to give."""
    n, batch, d, k = 40, 8, 6, 3
    sigma, clip = 0.6, 1.5
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n, d, generator=g) * torch.linspace(0.02, 3.0, n).unsqueeze(1)  # short and long gradients
    y = torch.randint(0, k, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(d, k)
    optimizer = _RecordingSGD(model.parameters())
    with private_site(PrivacySettings(noise_multiplier=sigma, max_grad_norm=clip), 9) as site:
        sgd_epochs(optimizer, lambda idx: F.cross_entropy(model(x[idx]), y[idx]), 2, n, batch,
                   torch.Generator().manual_seed(5), torch.device("cpu"), model)

    params = list(model.parameters())
    own = [torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params) for i in range(n)]
    norms = [math.sqrt(sum(float(g_i.square().sum()) for g_i in grads)) for grads in own]
    assert sum(norm < clip for norm in norms) >= 3 and sum(norm > clip for norm in norms) >= n // 2
    clipped = [[g_i * min(1.0, clip / norm) for g_i in grads] for grads, norm in zip(own, norms)]
    q = batch / n
    sampling, noise = torch.Generator().manual_seed(5), torch.Generator().manual_seed(9)
    sizes = []
    assert len(optimizer.seen) == 2 * math.ceil(n / batch)
    for got in optimizer.seen:
        chosen = torch.nonzero(torch.rand(n, generator=sampling) < q).flatten().tolist()  # each with prob. q
        sizes.append(len(chosen))
        for j, param in enumerate(params):
            summed = sum((clipped[i][j] for i in chosen), torch.zeros_like(param))
            noisy = summed + sigma * clip * torch.randn(param.shape, generator=noise)
            torch.testing.assert_close(got[j], noisy / (q * n), rtol=1e-5, atol=1e-7)
    assert sum(size != q * n for size in sizes) >= len(sizes) // 2  # the two normalizations differ
    assert site.ledger.history == [(sigma, q, len(sizes))]


def test_dp_alone_trains_with_the_recipe_and_fedpac_aligns_with_its_dp_weight():
    """``dp = true`` alone brings the DP recipe (docs/RESULTS.md): the ScatterNet front end,
    Poisson batches of 1,024 at step size 0.5 with momentum 0.9, and FedPAC's routine aligning
    features with ``dp-lambda-align`` (0: not at all) instead of ``lambda-align``; without dp the
    paper's CNN and alignment; each piece stays the user's to set."""
    private, plain = parse_run_config({"dp": True}), parse_run_config({})
    assert (private.extractor_front_end, plain.extractor_front_end) == ("scatternet", "none")
    settings = privacy_settings(private)
    assert settings is not None and (settings.batch_size, settings.step_size, settings.momentum) == (1024, 0.5, 0.9)
    assert parse_run_config({"dp": True, "extractor-front-end": "none"}).extractor_front_end == "none"
    centroids = {p.CENTROIDS: {p.CENTROID_VALUES: np.ones((10, 128), dtype=np.float32),
                               p.CENTROID_MASK: np.ones(10, dtype=bool)}}
    x, y = _data(40)

    def update(run_config: dict) -> tuple[ClientResult, Ledger]:
        cfg = parse_run_config({"strategy": "fedpac", "local-epochs": 1, "batch-size": 20, **run_config})
        torch.manual_seed(0)
        model = FedPACNet(1, 28, 10, cfg.extractor_front_end)
        inputs = model_inputs(x, cfg.extractor_front_end)
        with private_site(PrivacySettings(batch_size=20, step_size=0.1), 0) as site:
            result = client_routine(METHODS["fedpac"]).local_update(
                model, LocalData(inputs, y, inputs, y), Received(sections=centroids), cfg,
                torch.Generator().manual_seed(0))
        return result, site.ledger

    assert update({})[0].metrics["align-loss"] > 0
    aligned, aligned_ledger = update({"dp": True, "dp-lambda-align": 1.0})
    assert aligned.metrics["align-loss"] > 0 and p.CENTROID_VALUES in aligned.statistics
    # at weight 0 the term is not even computed, and no centroid is released or charged
    unaligned, unaligned_ledger = update({"dp": True})
    assert "align-loss" not in unaligned.metrics and p.CENTROID_VALUES not in unaligned.statistics
    def full_batch_releases(ledger: Ledger) -> int:
        return sum(times for _, q, times in ledger.history if q == 1.0)

    assert full_batch_releases(unaligned_ledger) == full_batch_releases(aligned_ledger) - 1


@pytest.mark.parametrize("momentum", [0.0, 0.5])
def test_the_dp_recipe_s_batch_and_step_replace_the_routine_s_for_private_steps_only(momentum):
    """``dp-batch-size``, ``dp-step-size`` and ``dp-momentum``: a private site's steps sample at
    the recipe's rate (q = 8/40, not the routine's 20/40) and move the weights by exactly the step
    size times the heavy-ball average (the recipe's momentum, not the optimizer's 0.9) of the
    from-scratch DP-SGD gradients, without the optimizer's weight decay; the ledger records the
    recipe's rate and number of steps. Without DP the routine's own SGD runs."""
    n, routine_batch, recipe_batch, d, k = 40, 20, 8, 5, 3
    sigma, clip, step = 0.7, 1.0, 0.4
    g = torch.Generator().manual_seed(1)
    x, y = torch.randn(n, d, generator=g) * 2.0, torch.randint(0, k, (n,), generator=g)
    torch.manual_seed(0)
    model = nn.Linear(d, k)
    start = [param.detach().clone() for param in model.parameters()]
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.1)
    settings = PrivacySettings(noise_multiplier=sigma, max_grad_norm=clip, batch_size=recipe_batch, step_size=step,
                               momentum=momentum)
    with private_site(settings, 3) as site:
        sgd_epochs(optimizer, lambda idx: F.cross_entropy(model(x[idx]), y[idx]), 1, n, routine_batch,
                   torch.Generator().manual_seed(4), torch.device("cpu"), model)

    q = recipe_batch / n
    expected = nn.Linear(d, k)
    with torch.no_grad():
        for param, value in zip(expected.parameters(), start):
            param.copy_(value)
    params = list(expected.parameters())
    sampling, noise = torch.Generator().manual_seed(4), torch.Generator().manual_seed(3)
    velocity: list[torch.Tensor] | None = None
    for _ in range(math.ceil(n / recipe_batch)):
        chosen = torch.nonzero(torch.rand(n, generator=sampling) < q).flatten().tolist()
        summed = [torch.zeros_like(param) for param in params]
        for i in chosen:
            grads = torch.autograd.grad(F.cross_entropy(expected(x[i:i + 1]), y[i:i + 1]), params)
            factor = min(1.0, clip / math.sqrt(sum(float(g_i.square().sum()) for g_i in grads)))
            summed = [total + g_i * factor for total, g_i in zip(summed, grads)]
        noisy = [(total + sigma * clip * torch.randn(param.shape, generator=noise)) / (q * n)
                 for param, total in zip(params, summed)]
        velocity = noisy if velocity is None else [momentum * v + g_i for v, g_i in zip(velocity, noisy)]
        with torch.no_grad():
            for param, v in zip(params, velocity):
                param -= step * v
    for got, want in zip(model.parameters(), params):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert site.ledger.history == [(sigma, q, math.ceil(n / recipe_batch))]

    # without DP the recipe is not read: the routine's batches and its optimizer as configured
    assert privacy_settings(parse_run_config({"dp": False, "dp-batch-size": 8, "dp-step-size": 0.4})) is None
    recipe = privacy_settings(parse_run_config({"dp": True, "dp-batch-size": 8, "dp-step-size": 0.4,
                                                "dp-momentum": 0.5}))
    assert recipe is not None and (recipe.batch_size, recipe.step_size, recipe.momentum) == (8, 0.4, 0.5)
    plain = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9, weight_decay=0.1)
    sgd_epochs(plain, lambda idx: F.cross_entropy(model(x[idx]), y[idx]), 1, n, routine_batch,
               torch.Generator().manual_seed(4), torch.device("cpu"), model)
    configured = [(group["lr"], group["momentum"], group["weight_decay"]) for group in plain.param_groups]
    assert configured == [(0.01, 0.9, 0.1)]


def test_a_penalty_term_joins_after_the_noise_unclipped(monkeypatch):
    """FedProx's proximal term reads no record: its gradient is added to the noisy one as it
    is. With no noise and a clipping norm no gradient reaches, DP-SGD's step is the plain
    gradient of (mean CE over the Poisson batch) + the penalty."""
    x, y = _data(32)
    model = _model()
    anchor = {name: q.detach() + 0.5 for name, q in model.named_parameters()}
    weight = 0.3

    def penalty() -> torch.Tensor:
        return 0.5 * weight * torch.stack([(q - anchor[n]).square().sum() for n, q in model.named_parameters()]).sum()

    cfg = parse_run_config({"batch-size": 32, "local-epochs": 1, "momentum": 0.0, "weight-decay": 0.0})
    before = {n: q.detach().clone() for n, q in model.named_parameters()}
    g = torch.Generator().manual_seed(3)
    generator_copy = torch.Generator().manual_seed(3)
    with private_site(PrivacySettings(noise_multiplier=1e-12, max_grad_norm=1e6), 0):
        train_joint(model, x, y, cfg, g, penalty=penalty)
    idx = privacy.poisson_batch(32, 1.0, generator_copy, torch.device("cpu"))
    reference = _model()
    reference.load_state_dict(before)
    loss = F.cross_entropy(reference(x[idx]), y[idx]) + 0.5 * weight * torch.stack(
        [(q - anchor[n]).square().sum() for n, q in reference.named_parameters()]).sum()
    grads = torch.autograd.grad(loss, list(reference.parameters()))
    for (name, q), grad in zip(reference.named_parameters(), grads):
        torch.testing.assert_close(dict(model.named_parameters())[name].detach(), q.detach() - cfg.extractor_lr * grad,
                                   rtol=1e-4, atol=1e-6)


# ---------------------------------------------------------------------------- statistics


class _Identity(nn.Module):
    """An 'extractor' whose features are the inputs themselves."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # pylint: disable=missing-function-docstring
        return x


def test_statistics_come_from_clipped_features_with_noise_of_the_mechanism_s_scale():
    g = torch.Generator().manual_seed(0)
    n, k, d = 400, 10, 2000
    z = torch.randn(n, d, generator=g) * 3.0
    labels = torch.arange(n) % k
    clip, sigma = 20.0, 2.5
    exact_z = privacy.clip_features(z.double(), clip)
    assert float(exact_z.norm(dim=1).max()) <= clip * (1 + 1e-9)
    assert float(z.norm(dim=1).min()) > clip  # every record was clipped
    exact = class_feature_sums(_Identity(), exact_z, labels, k)
    settings = PrivacySettings(statistics_noise_multiplier=sigma, feature_clip=clip)
    with private_site(settings, 5) as site:
        noisy = class_feature_sums(_Identity(), z, labels, k)
    residual = (noisy.sums - exact.sums).flatten()
    assert float(residual.std()) == pytest.approx(sigma * clip, rel=0.02)
    assert abs(float(residual.mean())) < 0.05 * sigma * clip
    # the sums of squared norms: sensitivity clip^2 (10 entries only: a loose check of the scale)
    sq_residual = (noisy.sq_norm_sums - exact.sq_norm_sums)
    assert 0.2 * sigma * clip**2 < float(sq_residual.abs().mean()) < 3 * sigma * clip**2
    # counts: noised, then whole, non-negative and summing to the public n
    assert torch.equal(noisy.counts, noisy.counts.round()) and float(noisy.counts.min()) >= 0
    assert int(noisy.counts.sum()) == n
    # three Gaussian releases at sampling rate 1; the counts are released once a round
    assert site.ledger.history == [(sigma, 1.0, 3)]
    with private_site(settings, 5) as site:
        class_feature_sums(_Identity(), z, labels, k)
        class_feature_sums(_Identity(), z, labels, k)
    assert site.ledger.history == [(sigma, 1.0, 5)]
    # class means (centroids, anchors) need neither the squares nor a second release of the counts
    with private_site(settings, 5) as site:
        class_feature_sums(_Identity(), z, labels, k)
        means = class_means(_Identity(), z, labels, k)
    assert site.ledger.history == [(sigma, 1.0, 4)]
    assert float((means.double() - exact.class_means()).abs().mean()) < 3 * sigma * clip / (n / k) ** 0.5


def test_a_site_reports_the_noise_in_its_h_and_its_v_carries_none_of_it_on_average():
    """What FedPAC's QP needs to take the noise off its distances (common.methods.fedpac.
    collaboration): the reported E||h - noiseless h||^2 is the squared error of the noisy h
    over many draws, and V (whose ||h||^2 term the noise inflates) is unbiased."""
    g = torch.Generator().manual_seed(0)
    n, k, d, clip, sigma = 600, 5, 64, 4.0, 6.0
    z = torch.randn(n, d, generator=g) + torch.arange(n).remainder(k).unsqueeze(1).double().float()
    labels = torch.arange(n) % k
    exact = feature_statistics(class_feature_sums(_Identity(), privacy.clip_features(z.double(), clip), labels, k))
    assert exact.h_noise == 0.0
    errors, vs = [], []
    settings = PrivacySettings(statistics_noise_multiplier=sigma, feature_clip=clip)
    for seed in range(200):
        with private_site(settings, seed):
            noisy = feature_statistics(class_feature_sums(_Identity(), z, labels, k))
        errors.append(float((noisy.h - exact.h).square().sum()))
        vs.append(noisy.v)
    assert noisy.h_noise == pytest.approx(k * d * (sigma * clip / n) ** 2)
    assert np.mean(errors) == pytest.approx(noisy.h_noise, rel=0.05)
    spread = np.std(vs) / len(vs) ** 0.5
    assert abs(np.mean(vs) - exact.v) < 4 * spread
    assert abs(np.mean(vs) - noisy.h_noise - exact.v) > 4 * spread  # the bias it would have


def test_dp_sgd_s_noise_outweighs_the_sampling_variance_by_the_reported_inflation():
    """``variance_inflation``'s claim, measured: the variance of DP-SGD's mean clipped gradient
    over Poisson batches (summed over a head's coordinates) is at most C^2 / B, and the noise's
    is sigma^2 p / B times that bound. FedPAC's client reports the inflation with its statistics."""
    g = torch.Generator().manual_seed(0)
    n, d, k, batch, clip, sigma = 300, 8, 3, 20, 1.0, 2.0
    head = nn.Linear(d, k)
    x, y = torch.randn(n, d, generator=g) * 3, torch.randint(0, k, (n,), generator=g)
    grads = []
    for i in range(n):
        head.zero_grad()
        F.cross_entropy(head(x[i : i + 1]), y[i : i + 1]).backward()
        flat = torch.cat([t.grad.flatten() for t in head.parameters()])
        grads.append(flat * min(1.0, clip / float(flat.norm())))
    clipped = torch.stack(grads).double()
    means = torch.stack([clipped[torch.rand(n, generator=g) < batch / n].sum(0) / batch for _ in range(4000)])
    sampling = float(means.var(dim=0).sum())
    params = d * k + k
    assert sampling <= clip**2 / batch
    noise = params * (sigma * clip / batch) ** 2
    settings = PrivacySettings(noise_multiplier=sigma, batch_size=batch)
    inflation = privacy.variance_inflation(settings, 64, n, params)
    assert inflation == pytest.approx(1 + sigma**2 * params / batch)
    assert noise / sampling >= inflation - 1
    # the routine's own batch where the recipe sets none, and never more than the records
    assert privacy.variance_inflation(PrivacySettings(noise_multiplier=sigma), 50, n, params) == 1 + 4 * params / 50
    assert privacy.variance_inflation(settings, 64, 10, params) == 1 + 4 * params / 10

    cfg = parse_run_config({"strategy": "fedpac", "local-epochs": 1, "batch-size": 20, "dp": True})
    images, labels = _data(40)
    model = FedPACNet(1, 28, 10, cfg.extractor_front_end)
    inputs = model_inputs(images, cfg.extractor_front_end)
    with private_site(settings, 0):
        result = client_routine(METHODS["fedpac"]).local_update(
            model, LocalData(inputs, labels, inputs, labels), Received(), cfg, torch.Generator().manual_seed(0))
    assert result.metrics[p.V_INFLATION] == pytest.approx(1 + sigma**2 * (10 * 128 + 10) / batch)
    plain = parse_run_config({"strategy": "fedpac", "local-epochs": 1, "batch-size": 20})
    model = FedPACNet(1, 28, 10)
    result = client_routine(METHODS["fedpac"]).local_update(
        model, LocalData(images, labels, images, labels), Received(), plain, torch.Generator().manual_seed(0))
    assert result.metrics[p.V_INFLATION] == 1.0


def test_private_statistics_are_a_from_scratch_gaussian_mechanism_on_clipped_features():
    """``class_feature_sums`` at a private site (in batches of 32) against the mechanism written
    out: each feature vector scaled down to norm C where longer, per-class counts, sums and sums
    of squared norms, then N(0, (sigma_s s)^2) from the site's generator on each (sensitivities
    1, C and C^2, in that order), the counts made whole by largest remainders summing to n. The
    counts the training routines read (``class_counts``) in the same round are those counts."""
    n, k, d, clip, sigma = 120, 4, 5, 2.0, 3.0
    g = torch.Generator().manual_seed(0)
    z = torch.randn(n, d, generator=g) * torch.linspace(0.1, 1.6, n).unsqueeze(1)
    labels = torch.randint(0, k, (n,), generator=g)
    with private_site(PrivacySettings(statistics_noise_multiplier=sigma, feature_clip=clip), 11) as site:
        got = class_feature_sums(_Identity(), z, labels, k, batch_size=32)
        counts_read = class_counts(labels, k)
    assert site.ledger.history == [(sigma, 1.0, 3)]

    features = z.double()
    norms = features.norm(dim=1)
    assert int((norms > clip).sum()) >= n // 4 and int((norms < clip).sum()) >= n // 4
    features = features * (clip / norms).clamp(max=1.0).unsqueeze(1)
    one_hot = F.one_hot(labels, k).double()
    noise = torch.Generator().manual_seed(11)
    counts = one_hot.sum(dim=0) + sigma * 1.0 * torch.randn(k, generator=noise, dtype=torch.float64)
    sums = one_hot.T @ features + sigma * clip * torch.randn(k, d, generator=noise, dtype=torch.float64)
    squares = one_hot.T @ features.square().sum(dim=1) + sigma * clip**2 * torch.randn(
        k, generator=noise, dtype=torch.float64)
    torch.testing.assert_close(got.sums, sums, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got.sq_norm_sums, squares, rtol=1e-12, atol=1e-12)
    share = counts.clamp(min=0) / counts.clamp(min=0).sum() * n
    whole = share.floor()
    for i in sorted(range(k), key=lambda c: float(whole[c] - share[c]))[:n - int(whole.sum())]:
        whole[i] += 1
    assert got.counts.tolist() == whole.tolist() and counts_read.tolist() == whole.tolist()
    assert got.counts.tolist() != one_hot.sum(dim=0).tolist()  # noised


def test_a_site_without_the_last_classes_releases_a_count_for_every_class():
    """A label-skewed site often holds none of some classes: its released counts still have one
    entry per class (the missing ones noised from zero), or the server's per-class statistics
    would be misaligned."""
    labels = torch.tensor([0, 1, 1, 2, 0, 2, 2])
    with private_site(PrivacySettings(statistics_noise_multiplier=1.0), 3):
        counts = class_counts(labels, 10)
    assert counts.shape == (10,) and int(counts.sum()) == len(labels)


def test_noisy_counts_become_whole_counts_that_sum_to_the_public_n():
    assert privacy.counts_summing_to(torch.tensor([10.4, -3.0, 5.2, 4.9]), 20).tolist() == [10.0, 0.0, 5.0, 5.0]
    assert privacy.counts_summing_to(torch.tensor([-1.0, -2.0]), 3).sum() == 3
    for seed in range(20):
        noisy = torch.randn(7, generator=torch.Generator().manual_seed(seed)) * 50
        counts = privacy.counts_summing_to(noisy, 123)
        assert int(counts.sum()) == 123 and float(counts.min()) >= 0 and torch.equal(counts, counts.round())


def test_tied_remainders_go_to_the_lowest_classes_whatever_their_number():
    """The released counts are a function of the noisy ones alone, the same on every machine:
    tied remainders go to the lowest class indices, also past the size (about 100 entries) from
    which torch's default sort stops keeping the order of equal keys."""
    for classes in (3, 200):
        extra = classes // 4
        counts = privacy.counts_summing_to(torch.ones(classes, dtype=torch.float64), classes + extra)
        assert counts.tolist() == [2.0] * extra + [1.0] * (classes - extra)


# ---------------------------------------------------------------------------- accountant


def _closed_form_rdp(sigma: float, q: float, alpha: int) -> float:
    """Rényi DP of one Poisson-subsampled Gaussian mechanism at an integer order, from its closed
    form (Mironov, Talwar, Zhang 2019, eq. for integer alpha:
    A_a = sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)), RDP = log A_a / (a - 1))."""
    terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
             + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
             if q < 1 else ((alpha * alpha - alpha) / (2 * sigma**2) if k == alpha else -math.inf)
             for k in range(alpha + 1)]
    top = max(terms)
    return (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)


def _integrated_rdp(sigma: float, q: float, alpha: float) -> float:
    """The same at any order, from the definition: log E_{z ~ mu_0}[(mu(z) / mu_0(z))^alpha] / (alpha - 1)
    with mu_0 = N(0, sigma^2) and mu = (1 - q) mu_0 + q N(1, sigma^2), integrated numerically (a
    Riemann sum in log space on a grid of step sigma / 40 that covers the integrand's mass)."""
    z = np.arange(-12 * sigma - 1, alpha + 12 * sigma + 1, sigma / 40)
    log_mu0 = -z * z / (2 * sigma**2) - math.log(sigma * math.sqrt(2 * math.pi))
    shift = (2 * z - 1) / (2 * sigma**2)  # log N(1, sigma^2) / N(0, sigma^2)
    log_ratio = shift if q == 1 else np.logaddexp(math.log1p(-q), math.log(q) + shift)
    log_integrand = log_mu0 + alpha * log_ratio
    top = float(log_integrand.max())
    return (top + math.log(float(np.exp(log_integrand - top).sum()) * sigma / 40)) / (alpha - 1)


def _epsilon(history: list[tuple[float, float, int]], delta: float, rdp, orders) -> float:  # noqa: ANN001
    """Epsilon of composed mechanisms (sigma, q, times): their Rényi DP (``rdp(sigma, q, alpha)``)
    summed at each order, converted as Balle et al. 2020 (Theorem 21), the best order."""
    return min(sum(times * rdp(sigma, q, alpha) for sigma, q, times in history)
               + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1) for alpha in orders)


def _independent_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon from the closed form at the integer orders 2-63."""
    return _epsilon(history, delta, _closed_form_rdp, range(2, 64))


# Orders 1.02 to 11.98 in steps of 0.02, then 12 to 64: finer than the accountant's own.
FINE_ORDERS = [1 + i / 50 for i in range(1, 550)] + list(range(12, 65))


def _integrated_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon from the integrated Rényi DP at :data:`FINE_ORDERS`."""
    return _epsilon(history, delta, _integrated_rdp, FINE_ORDERS)


@pytest.mark.parametrize(("sigma", "q"), [(0.8, 0.01), (2.3, 0.5), (1.1, 1 / 3), (23.0, 1.0), (0.9, 1.0)])
def test_the_integrated_renyi_dp_is_the_closed_form_at_integer_orders(sigma, q):
    for alpha in (2, 3, 7, 16, 40, 63):
        assert _integrated_rdp(sigma, q, alpha) == pytest.approx(_closed_form_rdp(sigma, q, alpha), rel=1e-9)


@pytest.mark.parametrize("history", [
    [(1.0, 64 / 6000, 94 * 10)],
    [(0.8, 0.01, 500), (12.0, 1.0, 30)],  # DP-SGD steps and full-batch statistics releases
    [(2.0, 1.0, 10)],  # pFedVEM's full-batch E-step
    [(1.1, 0.05, 100), (1.1, 0.02, 300), (6.0, 1.0, 4)],
])
def test_the_accountant_agrees_with_an_independent_computation(history):
    ledger = Ledger()
    for sigma, q, times in history:
        ledger.record(sigma, q, times)
    independent = _independent_epsilon(history, DELTA)
    # the ledger also tries fractional orders, so it can only be tighter, and never by much
    assert ledger.epsilon(DELTA) <= independent + 1e-9
    assert ledger.epsilon(DELTA) == pytest.approx(independent, rel=0.03)


@pytest.mark.parametrize(("epochs", "published"), [(10, 2.2), (50, 4.8), (100, 7.0)])
def test_epsilon_of_dp_sgd_on_6000_records_is_the_known_one(epochs, published):
    """6,000 records, batches of 64, noise multiplier 1: the values Flower's and Opacus's RDP
    accountants give (issue 40's measurement)."""
    ledger = Ledger([(1.0, 64 / 6000, epochs * privacy.steps_per_epoch(6000, 64))])
    assert ledger.epsilon(DELTA) == pytest.approx(published, abs=0.1)


def test_a_ledger_round_trips_and_refuses_a_corrupt_array():
    ledger = Ledger([(1.0, 0.01, 94), (10.0, 1.0, 5)])
    assert Ledger.from_array(ledger.to_array()) == ledger
    assert Ledger.from_array(Ledger().to_array()) == Ledger()
    for bad in ([[0.0, 0.01, 3]], [[1.0, 1.5, 3]], [[1.0, 0.1, 2.5]], [[1.0, 0.1, 0]], [[np.nan, 0.1, 1]]):
        with pytest.raises(ValueError, match="privacy ledger is corrupt"):
            Ledger.from_array(np.asarray(bad))


def test_calibration_finds_the_noise_that_reaches_the_target():
    round_ledger = Ledger([(1.0, 64 / 6000, 188), (10.0, 1.0, 5)])
    for target in (1.0, 3.0, 8.0):
        factor = privacy.calibrate(round_ledger, 10, target, DELTA)
        run = round_ledger.repeated(10)
        assert run.scaled(factor).epsilon(DELTA) <= target
        assert run.scaled(factor * 0.99).epsilon(DELTA) > target  # and not much more noise than that
    with pytest.raises(ValueError, match="releases nothing"):
        privacy.calibrate(Ledger(), 10, 1.0, DELTA)



def _opacus_prv_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    from opacus.accountants import PRVAccountant

    accountant = PRVAccountant()
    for sigma, q, times in history:  # Opacus's own bookkeeping, step by step
        for _ in range(times):
            accountant.step(noise_multiplier=sigma, sample_rate=q)
    return float(accountant.get_epsilon(delta))


def test_the_prv_accountant_is_opacus_s_and_tighter_than_renyi_dp():
    history = [(1.1, 64 / 6000, 94), (11.0, 1.0, 4), (1.1, 64 / 6000, 94), (11.0, 1.0, 4)]
    ledger = Ledger()
    for sigma, q, times in history:
        ledger.record(sigma, q, times)
    prv = ledger.epsilon(DELTA, "prv")
    assert prv == pytest.approx(_opacus_prv_epsilon(history, DELTA), rel=1e-9)
    assert prv < ledger.epsilon(DELTA) < 1.2 * prv  # tighter, by the margin known for such releases
    assert PrivacySettings(accountant="prv", delta=DELTA).epsilon(ledger) == prv
    with pytest.raises(ValueError, match="unknown accountant 'pld'"):
        ledger.epsilon(DELTA, "pld")


def test_calibration_by_prv_reaches_the_target_with_less_noise_than_by_renyi_dp():
    round_ledger = Ledger([(1.0, 64 / 6000, 188), (10.0, 1.0, 5)])
    run = round_ledger.repeated(3)
    rdp = privacy.calibrate(round_ledger, 3, 3.0, DELTA)
    prv = privacy.calibrate(round_ledger, 3, 3.0, DELTA, accountant="prv")
    assert 0.8 * rdp < prv < rdp
    assert _opacus_prv_epsilon(run.scaled(prv).history, DELTA) <= 3.0
    assert _opacus_prv_epsilon(run.scaled(prv * 0.99).history, DELTA) > 3.0


def test_the_run_config_picks_the_sites_accountant():
    settings = privacy_settings(parse_run_config({"dp": True, "dp-accountant": "prv"}))
    assert settings is not None and settings.accountant == "prv"
    assert cast(PrivacySettings, privacy_settings(parse_run_config({"dp": True}))).accountant == "rdp"


# ------------------------------------------------------------------------- at the site


def test_a_site_whose_last_round_would_pass_its_budget_refuses_without_training(monkeypatch, tmp_path):
    cfg = parse_run_config({"dp": True, "dp-epsilon-budget": 5.0})
    settings = privacy_settings(cfg)
    assert settings is not None
    spent, last = Ledger([(1.0, 0.05, 100)]), Ledger([(1.0, 0.05, 100)])
    assert spent.epsilon(DELTA) < 5.0 < spent.then(last).epsilon(DELTA)
    ledger = SiteLedger(tmp_path / "ledger.jsonl")
    ledger.append(Entry("an-earlier-release", "run-a", 5, spent))
    ledger.append(Entry("the-last-round", "run-a", 5, last, refused=True))

    def no_training(method):
        raise AssertionError("the site trained")

    monkeypatch.setattr(client_app, "client_routine", no_training)
    x, y = _data(8)
    data = LocalData(x, y, x, y, SiteState({}))
    with pytest.raises(PrivacyBudgetSpent, match=r"partition 4 stops training at round 6: its epsilon would go "
                                                 r"from [0-9.]+ to [0-9.]+ at delta = 1e-05, over its budget "
                                                 r"dp-epsilon-budget = 5"):
        client_app._private_update(METHODS["fedavg"], _model(), data, Received(server_round=6), cfg, settings, 4,
                                   client_app.SitePrivacy(bytes(32), ledger), "run-b", {})


def _own_sites(tmp_path: Path) -> dict[str, str]:
    """Sites of a test's own: their state (their privacy ledgers) in the test's folder, not in
    the folder every in-process run of this process shares (the run's outputs go to ``out``)."""
    return {"state-dir": str(tmp_path / "sites")}


def _rows(out: Path, name: str) -> list[dict]:
    (run,) = [d for d in out.iterdir() if d.is_dir()]
    with open(run / name, newline="") as f:
        return list(csv.DictReader(f))


def test_a_site_over_its_budget_stops_and_the_run_goes_on_without_it(tmp_path, caplog):
    """Half the sites train each round; a budget that two rounds of training fit in and three do
    not. The sites sampled a third time refuse (logged by the server), the others keep training,
    the run finishes, and no site's epsilon ever passes the budget."""
    steps = privacy.steps_per_epoch(60, 20)
    one_round = Ledger([(1.0, 20 / 60, steps)])
    budget = (one_round.repeated(2).epsilon(DELTA) + one_round.repeated(3).epsilon(DELTA)) / 2
    config = {"strategy": "fedavg", "samples-per-client": 60, "test-samples-per-client": 20, "local-epochs": 1,
              "batch-size": 20, "num-server-rounds": 6, "fraction-train": 0.5, "max-failed-rounds": 6,
              "dp": True, "dp-epsilon-budget": budget, "output-dir": str(tmp_path / "out")}
    with caplog.at_level(logging.INFO):
        run_fedpac(cast(Grid, InProcessGrid(config, 4, node_config=_own_sites(tmp_path))), parse_run_config(config), 1)
    status = [d for d in (tmp_path / "out").iterdir() if d.is_dir()][0] / "status.json"
    assert '"finished"' in status.read_text()
    clients = [r for r in _rows(tmp_path / "out", "clients.csv") if r["trained"] == "1"]
    assert all(float(r["dp_epsilon"]) <= budget for r in clients)
    trained: dict[str, int] = {}
    for r in clients:
        trained[r["partition_id"]] = trained.get(r["partition_id"], 0) + 1
    assert max(trained.values()) == 2  # 12 trainings asked of 4 sites: some were asked a third time
    assert "stops training at round" in caplog.text and "over its budget" in caplog.text
    rounds = _rows(tmp_path / "out", "rounds.csv")
    assert [r["round"] for r in rounds] == [str(t) for t in range(1, 7)]
    assert sum(int(r["num_rejected"]) for r in rounds) >= 1
    assert all(float(r["max_dp_epsilon"]) <= budget for r in rounds if r["max_dp_epsilon"])


def test_every_method_reports_a_growing_epsilon_from_the_site_s_ledger(tmp_path, caplog):
    """With dp on, each trained site's reply carries its epsilon, which is its ledger's (kept at
    the site) and grows from round to round; the round line's maximum is the largest of them, and
    the run's log ends with what each site spent."""
    config = {"strategy": "fedpac", "samples-per-client": 60, "test-samples-per-client": 20, "local-epochs": 1,
              "batch-size": 20, "dp-batch-size": 20, "num-server-rounds": 2, "dp": True,
              "output-dir": str(tmp_path / "out")}
    with caplog.at_level(logging.INFO, logger="flwr"):
        _, report = run_fedpac(cast(Grid, InProcessGrid(config, 3, node_config=_own_sites(tmp_path))),
                               parse_run_config(config), 1)
    clients = _rows(tmp_path / "out", "clients.csv")
    by_round = {t: [float(r["dp_epsilon"]) for r in clients if r["round"] == str(t)] for t in (1, 2)}
    assert len(by_round[1]) == len(by_round[2]) == 3
    assert min(by_round[2]) > max(by_round[1]) > 0
    rounds = _rows(tmp_path / "out", "rounds.csv")
    assert [float(r["max_dp_epsilon"]) for r in rounds] == [max(by_round[1]), max(by_round[2])]
    last = {int(r["partition_id"]): float(r["dp_epsilon"]) for r in clients if r["round"] == "2"}
    assert report.privacy_spent() == last
    (spent,) = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Privacy spent")]
    assert "delta = 1e-05" in spent
    assert spent.endswith(", ".join(f"partition {pid} {epsilon:.3g}" for pid, epsilon in sorted(last.items())))
    # one round of FedPAC at a site: a head epoch and an extractor epoch of DP-SGD and the
    # statistics before training (counts, sums, squares); no centroids after it: under DP FedPAC
    # aligns with weight dp-lambda-align, 0 by default, and releases none
    settings = PrivacySettings()
    steps = privacy.steps_per_epoch(60, 20)
    one_round = Ledger([(1.0, 20 / 60, 2 * steps), (settings.statistics_noise_multiplier, 1.0, 3)])
    assert by_round[1][0] == pytest.approx(one_round.epsilon(DELTA), rel=1e-9)
    assert by_round[2][0] == pytest.approx(one_round.repeated(2).epsilon(DELTA), rel=1e-9)
    assert p.DP_EPSILON == "dp-epsilon"


CALIBRATED = re.compile(r"partition (\d+): noise multipliers (\S+) \(gradients\) and (\S+) \(statistics\) "
                        r"reach epsilon")


def test_a_run_with_a_target_epsilon_ends_within_1_percent_below_it(tmp_path, caplog):
    """FedPAC, 3 rounds, dp-target-epsilon = 1, sites with fresh ledgers: each site's epsilon after
    the last round, in clients.csv and recomputed from scratch (its 3 rounds of DP-SGD steps at
    q = batch / n and of statistics releases, at the noise multipliers its log line says it
    calibrated, through the integrated Rényi DP of the sampled Gaussian), lies in
    [0.99 target, target]: the calibration plans for the rounds the run has left, no fewer (the
    target would be passed) and no more (noise wasted)."""
    target, rounds, batch = 1.0, 3, 15
    config = {"strategy": "fedpac", "samples-per-client": 60, "test-samples-per-client": 20, "head-epochs": 1,
              "local-epochs": 1, "batch-size": batch, "dp-batch-size": batch, "num-server-rounds": rounds, "dp": True,
              "dp-target-epsilon": target, "output-dir": str(tmp_path / "out")}
    with caplog.at_level(logging.INFO):
        run_fedpac(cast(Grid, InProcessGrid(config, 2, node_config=_own_sites(tmp_path))), parse_run_config(config), 1)
    calibrated: dict[str, tuple[float, float]] = {}
    for record in caplog.records:
        if (match := CALIBRATED.match(record.getMessage())) is not None:
            partition, gradients, statistics = match.groups()
            assert partition not in calibrated  # once, before the site's first round
            exact = cast(tuple, record.args)[1:3]  # the same numbers, to full precision
            assert (f"{exact[0]:.4g}", f"{exact[1]:.4g}") == (gradients, statistics)
            calibrated[partition] = (float(exact[0]), float(exact[1]))
    assert sorted(calibrated) == ["0", "1"]
    clients = _rows(tmp_path / "out", "clients.csv")
    for partition, (sigma, sigma_statistics) in calibrated.items():
        site = sorted((r for r in clients if r["partition_id"] == partition), key=lambda r: int(r["round"]))
        assert [(r["round"], r["trained"]) for r in site] == [(str(t), "1") for t in range(1, rounds + 1)]
        assert sigma_statistics == pytest.approx(10 * sigma, rel=1e-12)  # one factor on both (1 and 10)
        n = int(site[-1]["num_examples"])
        # a round of FedPAC: a head epoch and an extractor epoch of ceil(n / batch) Poisson-sampled
        # steps each; counts, sums and squares before training (no centroids: FedPAC aligns with
        # dp-lambda-align under DP, 0 by default)
        history = [(sigma, batch / n, rounds * 2 * math.ceil(n / batch)), (sigma_statistics, 1.0, rounds * 3)]
        epsilon = _integrated_epsilon(history, DELTA)
        assert 0.99 * target <= epsilon <= target
        reported = float(site[-1]["dp_epsilon"])
        assert 0.99 * target <= reported <= target
        assert reported == pytest.approx(epsilon, rel=1e-3)


def test_pfedvem_s_per_sample_e_step_gradients_are_each_record_s_own():
    """pFedVEM's E-step trains a Bayesian head on raw tensors: its per-sample gradients come in
    closed form. Each equals autograd's gradient of that record's NLL under the same head draws."""
    from common.methods.pfedvem.variational import GaussianHead, per_sample_nll_gradients  # pylint: disable=import-outside-toplevel

    g = torch.Generator().manual_seed(0)
    d, k, n, n_mc = 6, 4, 5, 3
    head = GaussianHead.from_prior(torch.randn(d, k, generator=g), torch.randn(k, generator=g), scale=0.3)
    features, labels = torch.randn(n, d, generator=g), torch.randint(0, k, (n,), generator=g)
    draws = [(torch.randn(d, k, generator=g), torch.randn(k, generator=g)) for _ in range(n_mc)]
    per_sample, nll = per_sample_nll_gradients(head, features, labels, draws)
    total = torch.zeros(())
    for i in range(n):
        loss = sum(F.cross_entropy(features[i:i + 1] @ (head.weight_mu + head.weight_sigma() * ew)
                                   + head.bias_mu + head.bias_sigma() * eb, labels[i:i + 1], reduction="sum")
                   for ew, eb in draws) / n_mc
        total = total + loss.detach()
        for got, want in zip(per_sample, torch.autograd.grad(loss, head.parameters())):
            torch.testing.assert_close(got[i], want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(nll, total)


def test_pfedvem_s_e_step_clips_every_record_and_counts_full_batch_steps(monkeypatch):
    from common.methods.pfedvem.variational import GaussianHead, e_step  # pylint: disable=import-outside-toplevel

    clipped_norms: list[torch.Tensor] = []
    original = privacy.private_gradient

    def spy(per_sample_grads, settings, expected_batch, generator):
        norms = privacy.per_sample_norms(per_sample_grads)
        clipped_norms.append(norms * privacy.clip_factors(norms, settings.max_grad_norm))
        assert expected_batch == 1.0  # the E-step's NLL is a sum: its noisy sum is the gradient
        return original(per_sample_grads, settings, expected_batch, generator)

    monkeypatch.setattr(privacy, "private_gradient", spy)
    g = torch.Generator().manual_seed(1)
    head = GaussianHead.from_prior(torch.randn(16, 10, generator=g), torch.zeros(10))
    prior_w, prior_b = head.weight_mu.detach().clone(), head.bias_mu.detach().clone()
    features, labels = torch.randn(40, 16, generator=g) * 5, torch.randint(0, 10, (40,), generator=g)
    before = head.snapshot()
    with private_site(PrivacySettings(noise_multiplier=0.5, max_grad_norm=0.1), 2) as site:
        e_step(head, features, labels, prior_w, prior_b, rho=1.0, steps=3, generator=g)
    assert len(clipped_norms) == 3 and all(float(c.max()) <= 0.1 * (1 + 1e-5) for c in clipped_norms)
    assert site.ledger.history == [(0.5, 1.0, 3)]
    assert any(not torch.equal(a, b) for a, b in zip(before, head.snapshot()))  # it did train
