"""Record-level differential privacy at a site (``common.privacy``): the per-sample gradients are
right and clipped before the noise, the noise has the mechanism's scale, the accountant agrees
with an independent computation, a site over its budget stops while the run goes on, and the
site's ledger and epsilon reach the outputs."""

from __future__ import annotations

import csv
import logging
import math
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
from common.methods.client import LocalData, Received, SiteState
from common.model import FedPACNet
from common.privacy import Ledger, PrivacyBudgetSpent, PrivacySettings, private_site
from common.site_privacy import Entry, SiteLedger
from common.statistics import class_feature_sums, class_means
from common.training import train_extractor, train_head, train_joint
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


def test_the_per_sample_gradients_are_each_record_s_own():
    """Opacus's hooks on the product's model give, for each record of a batch, the gradient of
    that record's loss alone (checked against autograd one record at a time), for the whole model
    and for the extractor under a frozen head."""
    x, y = _data(8)
    for frozen_head in (False, True):
        model = _model()
        module = model.extractor if frozen_head else model
        model.head.requires_grad_(not frozen_head)
        with privacy.PerSampleGradients(module) as per_sample:
            F.cross_entropy(model(x), y).backward()
            grads = [g.clone() for g in per_sample.grads(len(x))]
        params = [q for q in module.parameters() if q.requires_grad]
        for i in range(len(x)):
            expected = torch.autograd.grad(F.cross_entropy(model(x[i:i + 1]), y[i:i + 1]), params)
            for got, want in zip(grads, expected):
                torch.testing.assert_close(got[i], want, rtol=1e-4, atol=1e-6)
        assert not any(hasattr(q, "grad_sample") and q.grad_sample is not None for q in params)  # cleaned up


@pytest.mark.parametrize("routine", ["joint", "head", "extractor with alignment"])
def test_no_record_s_gradient_passes_the_clipping_norm_before_the_noise(routine, monkeypatch):
    """Every step of every training routine clips each record's gradient (over all parameters
    it trains) to dp-max-grad-norm before the noise; the norm is small enough here that most
    records' gradients were longer."""
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    original = privacy.private_gradient

    def spy(per_sample_grads, settings, expected_batch, generator):
        if len(per_sample_grads[0]):
            norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample_grads]).norm(dim=0)
            clipped = norms * privacy.clip_factors(per_sample_grads, settings.max_grad_norm)
            seen.append((norms, clipped))
        return original(per_sample_grads, settings, expected_batch, generator)

    monkeypatch.setattr(privacy, "private_gradient", spy)
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


def test_noisy_counts_become_whole_counts_that_sum_to_the_public_n():
    assert privacy.counts_summing_to(torch.tensor([10.4, -3.0, 5.2, 4.9]), 20).tolist() == [10.0, 0.0, 5.0, 5.0]
    assert privacy.counts_summing_to(torch.tensor([-1.0, -2.0]), 3).sum() == 3
    for seed in range(20):
        noisy = torch.randn(7, generator=torch.Generator().manual_seed(seed)) * 50
        counts = privacy.counts_summing_to(noisy, 123)
        assert int(counts.sum()) == 123 and float(counts.min()) >= 0 and torch.equal(counts, counts.round())


# ---------------------------------------------------------------------------- accountant


def _independent_epsilon(history: list[tuple[float, float, int]], delta: float) -> float:
    """Epsilon of composed Poisson-subsampled Gaussian mechanisms from the closed form of their
    Rényi DP at integer orders (Mironov, Talwar, Zhang 2019, eq. for integer alpha:
    A_a = sum_k C(a, k) (1 - q)^(a - k) q^k exp((k^2 - k) / (2 sigma^2)), RDP = log A_a / (a - 1)),
    summed over the mechanisms and converted as Balle et al. 2020 (Theorem 21)."""
    best = math.inf
    for alpha in range(2, 64):
        rdp = 0.0
        for sigma, q, times in history:
            terms = [math.lgamma(alpha + 1) - math.lgamma(k + 1) - math.lgamma(alpha - k + 1)
                     + (alpha - k) * math.log1p(-q) + k * math.log(q) + (k * k - k) / (2 * sigma**2)
                     if q < 1 else ((alpha * alpha - alpha) / (2 * sigma**2) if k == alpha else -math.inf)
                     for k in range(alpha + 1)]
            top = max(terms)
            rdp += times * (top + math.log(sum(math.exp(t - top) for t in terms))) / (alpha - 1)
        eps = rdp + math.log1p(-1 / alpha) - (math.log(delta) + math.log(alpha)) / (alpha - 1)
        best = min(best, eps)
    return best


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
    the folder every in-process run of this process shares."""
    return {"state-dir": f"{tmp_path}-sites"}


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
              "dp": True, "dp-epsilon-budget": budget, "output-dir": str(tmp_path)}
    with caplog.at_level(logging.INFO):
        run_fedpac(cast(Grid, InProcessGrid(config, 4, node_config=_own_sites(tmp_path))), parse_run_config(config), 1)
    status = [d for d in tmp_path.iterdir() if d.is_dir()][0] / "status.json"
    assert '"finished"' in status.read_text()
    clients = [r for r in _rows(tmp_path, "clients.csv") if r["trained"] == "1"]
    assert all(float(r["dp_epsilon"]) <= budget for r in clients)
    trained: dict[str, int] = {}
    for r in clients:
        trained[r["partition_id"]] = trained.get(r["partition_id"], 0) + 1
    assert max(trained.values()) == 2  # 12 trainings asked of 4 sites: some were asked a third time
    assert "stops training at round" in caplog.text and "over its budget" in caplog.text
    rounds = _rows(tmp_path, "rounds.csv")
    assert [r["round"] for r in rounds] == [str(t) for t in range(1, 7)]
    assert sum(int(r["num_rejected"]) for r in rounds) >= 1
    assert all(float(r["max_dp_epsilon"]) <= budget for r in rounds if r["max_dp_epsilon"])


def test_every_method_reports_a_growing_epsilon_from_the_site_s_ledger(tmp_path):
    """With dp on, each trained site's reply carries its epsilon, which is its ledger's (kept at
    the site) and grows from round to round; the round line's maximum is the largest of them."""
    config = {"strategy": "fedpac", "samples-per-client": 60, "test-samples-per-client": 20, "local-epochs": 1,
              "batch-size": 20, "num-server-rounds": 2, "dp": True, "output-dir": str(tmp_path)}
    run_fedpac(cast(Grid, InProcessGrid(config, 3, node_config=_own_sites(tmp_path))), parse_run_config(config), 1)
    clients = _rows(tmp_path, "clients.csv")
    by_round = {t: [float(r["dp_epsilon"]) for r in clients if r["round"] == str(t)] for t in (1, 2)}
    assert len(by_round[1]) == len(by_round[2]) == 3
    assert min(by_round[2]) > max(by_round[1]) > 0
    rounds = _rows(tmp_path, "rounds.csv")
    assert [float(r["max_dp_epsilon"]) for r in rounds] == [max(by_round[1]), max(by_round[2])]
    # one round of FedPAC at a site: a head epoch and an extractor epoch of DP-SGD, the statistics
    # before training (counts, sums, squares) and the centroids after it (sums: the counts are
    # the round's, and the squares, which only V needs, are not released)
    settings = PrivacySettings()
    steps = privacy.steps_per_epoch(60, 20)
    one_round = Ledger([(1.0, 20 / 60, 2 * steps), (settings.statistics_noise_multiplier, 1.0, 4)])
    assert by_round[1][0] == pytest.approx(one_round.epsilon(DELTA), rel=1e-9)
    assert by_round[2][0] == pytest.approx(one_round.repeated(2).epsilon(DELTA), rel=1e-9)
    assert p.DP_EPSILON == "dp-epsilon"


def test_pfedvem_s_per_sample_e_step_gradients_are_each_record_s_own():
    """pFedVEM's E-step trains a Bayesian head on raw tensors: its per-sample gradients come in
    closed form. Each equals autograd's gradient of that record's NLL under the same head draws."""
    from common.variational import GaussianHead, per_sample_nll_gradients  # pylint: disable=import-outside-toplevel

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
    from common.variational import GaussianHead, e_step  # pylint: disable=import-outside-toplevel

    clipped_norms: list[torch.Tensor] = []
    original = privacy.private_gradient

    def spy(per_sample_grads, settings, expected_batch, generator):
        norms = torch.stack([g.flatten(1).norm(dim=1) for g in per_sample_grads]).norm(dim=0)
        clipped_norms.append(norms * privacy.clip_factors(per_sample_grads, settings.max_grad_norm))
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
