"""The local update: what trains when, and where the alignment gradient goes."""

import contextlib
import copy
import dataclasses
import statistics

import numpy as np
import pytest
import torch
from benches import load_bench

from common import privacy
from common import protocol as p
from common.config import FedPACConfig
from common.methods import METHODS
from common.methods.client import ClientResult, LocalData, Received, client_routine
from common.methods.fedpac.client import alignment_loss
from common.model import FedPACNet
from common.methods.fedpac.statistics import feature_statistics
from common.statistics import class_feature_sums
from common.training import sgd, sgd_epochs, train_extractor, train_head

CFG = FedPACConfig(local_epochs=1, batch_size=8)


def _centroids(values: torch.Tensor, mask: torch.Tensor) -> Received:
    """A round's message with the global class centroids (section ``centroids``, numpy)."""
    return Received(sections={p.CENTROIDS: {p.CENTROID_VALUES: values.numpy(), p.CENTROID_MASK: mask.numpy()}})


def _local_update(model, x, y, received: Received, cfg: FedPACConfig) -> ClientResult:
    """The run's method's local update (no test split: x, y stand in for it)."""
    return client_routine(METHODS[cfg.strategy]).local_update(
        model, LocalData(x, y, x, y), received, cfg, torch.Generator().manual_seed(0))


def _model_and_data(n=24, seed=0):
    torch.manual_seed(seed)
    model = FedPACNet(1, 28, 10)
    x = torch.randn(n, 1, 28, 28)
    y = torch.arange(n) % 4
    return model, x, y


def _params(module):
    return [q.detach().clone() for q in module.parameters()]


def _changed(before, module):
    return [not torch.equal(b, a) for b, a in zip(before, module.parameters())]


def test_alignment_gradient_reaches_extractor_and_not_head():
    model, x, y = _model_and_data()
    centroids = torch.randn(10, 128)
    mask = torch.zeros(10, dtype=torch.bool)
    mask[:2] = True  # classes 2 and 3 have no centroid yet
    features = model.extractor(x)
    alignment_loss(features, y, centroids, mask).backward()
    assert all(q.grad is not None and q.grad.abs().sum() > 0 for q in model.extractor.parameters())
    assert all(q.grad is None for q in model.head.parameters())
    assert centroids.grad is None


def test_alignment_loss_value_and_unaligned_classes():
    features = torch.tensor([[1.0, 1.0], [3.0, 0.0], [5.0, 5.0]])
    labels = torch.tensor([0, 1, 2])
    centroids = torch.tensor([[0.0, 0.0], [1.0, 0.0], [0.0, 0.0]])
    mask = torch.tensor([True, True, False])
    # (1/B) * [ (1+1)/2 + (4+0)/2 + 0 ]  with B = 3 (class 2 unaligned but counted)
    assert alignment_loss(features, labels, centroids, mask).item() == torch.tensor(3.0 / 3).item()


def test_head_epoch_leaves_extractor_untouched():
    model, x, y = _model_and_data()
    extractor_before, head_before = _params(model.extractor), _params(model.head)
    train_head(model, x, y, CFG, torch.Generator().manual_seed(0))
    assert not any(_changed(extractor_before, model.extractor))
    assert all(_changed(head_before, model.head))


@pytest.mark.parametrize("n", [24, 27])  # full batches of 8; then a last batch of 3
def test_head_epochs_on_features_extracted_once_train_the_head_a_forward_pass_per_batch_would(n):
    cached, x, y = _model_and_data(n)
    per_batch = copy.deepcopy(cached)
    loss = train_head(cached, x, y, CFG, torch.Generator().manual_seed(0), epochs=3)
    per_batch_epochs = load_bench("head_epochs").head_epochs_per_batch
    reference = per_batch_epochs(per_batch, x, y, CFG, torch.Generator().manual_seed(0), 3)
    assert all(torch.equal(a, b) for a, b in zip(cached.extractor.parameters(), per_batch.extractor.parameters()))
    heads = list(zip(cached.head.parameters(), per_batch.head.parameters()))
    assert not torch.equal(heads[0][0], _model_and_data(n)[0].head.weight)  # the head did train
    if n % CFG.batch_size == 0:  # every batch's features are the bits of that batch's forward pass
        assert all(torch.equal(a, b) for a, b in heads)
    else:  # the last batch's samples were extracted in other chunks: rounding differences only
        assert all(torch.allclose(a, b, rtol=0, atol=1e-6) for a, b in heads)
    assert loss == pytest.approx(reference, rel=1e-6)


@pytest.mark.parametrize("shape", [(1, 28), (3, 32)])
def test_the_extractor_computes_the_same_features_in_training_and_evaluation_mode(shape):
    """What extracting the head's features once relies on: no dropout, no batch norm (no
    buffers), so f(x) does not change between epochs or with model.train()/eval()."""
    extractor = FedPACNet(*shape, 10).extractor
    assert not list(extractor.buffers())
    x = torch.randn(16, shape[0], shape[1], shape[1])
    with torch.no_grad():
        first, second = extractor.train()(x), extractor.train()(x)
        evaluated = extractor.eval()(x)
    assert torch.equal(first, second) and torch.equal(first, evaluated)


def test_extractor_epochs_leave_head_untouched_and_use_alignment():
    model, x, y = _model_and_data()
    head_before = _params(model.head)
    centroids = torch.randn(10, 128)
    mask = torch.ones(10, dtype=torch.bool)
    _, align = train_extractor(model, x, y, CFG, torch.Generator().manual_seed(0),
                               lambda f, labels: alignment_loss(f, labels, centroids, mask), weight=1.0)
    assert not any(_changed(head_before, model.head))
    assert all(q.requires_grad for q in model.head.parameters())  # unfrozen afterwards
    assert align > 0


@pytest.mark.parametrize("private", [False, True])
def test_the_head_trained_with_the_extractor_takes_the_same_steps_as_the_whole_model(private):
    """``head-with-extractor``: FedPAC's extractor epochs move the head too, exactly as one
    model trained whole on the same loss and batches would (with DP: each record's gradient
    clipped over head and extractor together, one ledger entry for the steps), and FedPAC's
    local update then spends no steps on a head epoch of its own."""
    model, x, y = _model_and_data()
    twin = copy.deepcopy(model)
    settings = privacy.PrivacySettings(noise_multiplier=0.5, max_grad_norm=0.1)

    def train(fn):
        with privacy.private_site(settings, 3) if private else contextlib.nullcontext() as site:
            fn()
        return site

    site = train(lambda: train_extractor(model, x, y, CFG, torch.Generator().manual_seed(0), with_head=True))
    assert all(_changed(_params(twin.head), model.head))

    def whole():
        optimizer = sgd(twin.parameters(), CFG.extractor_lr, CFG)
        sgd_epochs(optimizer, lambda idx: torch.nn.functional.cross_entropy(twin(x[idx]), y[idx]), CFG.local_epochs,
                   len(x), CFG.batch_size, torch.Generator().manual_seed(0), x.device, twin)

    twin_site = train(whole)
    for a, b in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(a, b)
    if private:
        assert site.ledger.history == twin_site.ledger.history == [(0.5, 8 / 24, 3)]
    cfg = dataclasses.replace(CFG, strategy="fedpac", head_epochs=0, head_with_extractor=True)
    model, x, y = _model_and_data()
    head_before = _params(model.head)
    _local_update(model, x, y, Received(), cfg)
    assert all(_changed(head_before, model.head))


def test_lambda_changes_the_extractor_update():
    runs = []
    for lam in (0.0, 1.0):
        model, x, y = _model_and_data()
        cfg = dataclasses.replace(CFG, lambda_align=lam)
        centroids = torch.randn(10, 128, generator=torch.Generator().manual_seed(1))
        mask = torch.ones(10, dtype=torch.bool)
        train_extractor(model, x, y, cfg, torch.Generator().manual_seed(0),
                        lambda f, labels, c=centroids, m=mask: alignment_loss(f, labels, c, m),
                        weight=cfg.lambda_align)
        runs.append(_params(model.extractor))
    assert any(not torch.equal(a, b) for a, b in zip(*runs))


def test_local_update_statistics_come_from_received_model_and_centroids_from_trained():
    model, x, y = _model_and_data()
    expected_before = feature_statistics(class_feature_sums(model.extractor, x, y, 10))
    received = _centroids(torch.zeros(10, 128), torch.zeros(10, dtype=torch.bool))
    update = _local_update(model, x, y, received, CFG)
    assert update.metrics[p.V] == expected_before.v
    # h_i as it travels: float32
    assert np.array_equal(update.statistics[p.H], expected_before.h.float().numpy())
    after = class_feature_sums(model.extractor, x, y, 10)
    torch.testing.assert_close(torch.from_numpy(update.statistics[p.CENTROID_VALUES]), after.class_means().float())
    assert update.statistics[p.CLASS_COUNTS].tolist() == [6, 6, 6, 6, 0, 0, 0, 0, 0, 0]
    assert update.statistics[p.CLASS_COUNTS].dtype == np.int64
    assert update.num_examples == len(x)  # n_i in samples, not batches


def test_mixed_precision_trains_and_keeps_float32_weights():
    model, x, y = _model_and_data()
    cfg = dataclasses.replace(CFG, mixed_precision=True, local_epochs=2)
    head_before = _params(model.head)
    received = _centroids(torch.randn(10, 128), torch.ones(10, dtype=torch.bool))
    update = _local_update(model, x, y, received, cfg)
    assert all(q.dtype == torch.float32 for q in model.parameters())
    assert all(_changed(head_before, model.head))
    assert torch.isfinite(torch.tensor([update.train_loss, update.metrics["head-loss"],
                                        update.metrics["align-loss"]])).all()
    assert update.statistics[p.CENTROID_VALUES].dtype == np.float32


@pytest.mark.e2e  # starts processes
def test_a_training_process_keeps_the_memory_it_frees():
    """Without ``keep_freed_memory`` glibc unmaps every large block a batch frees and the kernel
    zeroes its pages again at the next batch (thousands of page faults per update); with it, a
    warm process trains without faulting (``bench/freed_memory.py`` times the difference)."""
    bench = load_bench("freed_memory")
    kept = bench.update_costs(keep=True, epochs=1)
    if not kept["kept"]:
        pytest.skip("mallopt is glibc's: this libc keeps its own policy")
    default = bench.update_costs(keep=False, epochs=1)
    kept_faults, default_faults = (statistics.median(run["faults"]) for run in (kept, default))
    assert kept_faults < 1000 and default_faults > 5 * kept_faults, (kept, default)
