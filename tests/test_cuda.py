"""The CUDA path: on a GPU every client routine computes what it computes on the CPU, and learns.

These tests need a CUDA device: the GPU kit runs them there (``deploy/gpu/run-kit.sh``, step
``tests``). Where torch sees no GPU (CI, the development machines) they are skipped: nothing
here can stand in for the device they check.
"""

from __future__ import annotations

import copy
import dataclasses

import numpy as np
import pytest
import torch

from common import protocol as p
from common.config import FedPACConfig
from common.methods import METHODS
from common.methods.client import ClientResult, LocalData, Received, client_routine
from common.model import HEAD_PREFIX, FedPACNet
from common.training import evaluate

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU kit runs it)"),
]

CUDA = torch.device("cuda")
CPU = torch.device("cpu")
# One routine of each kind: alternating with centroids, representation, joint, clustered with
# anchors, variational, proximal, personal model kept at the site, body through a fixed head.
METHODS_UNDER_TEST = ("fedpac", "fedrep", "fedavg", "fedccfa", "pfedvem", "fedprox", "ditto", "fedbabu")


def _task(n: int = 240, classes: int = 4, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Images whose class is a bright square in one of four places, under noise: learnable."""
    g = torch.Generator().manual_seed(seed)
    y = torch.arange(n) % classes
    x = 0.5 * torch.randn(n, 1, 28, 28, generator=g)
    for k in range(classes):
        row, col = divmod(k, 2)
        x[y == k, :, 14 * row + 3 : 14 * row + 11, 14 * col + 3 : 14 * col + 11] += 2.0
    return x, y


def _received(method: str, model: FedPACNet) -> Received:
    """The round's message besides the model, as the ClientApp hands it on: numpy sections (the
    routine moves them to the model's device)."""
    g = torch.Generator().manual_seed(1)
    centroids = {p.CENTROIDS: {p.CENTROID_VALUES: torch.randn(10, 128, generator=g).numpy(),
                               p.CENTROID_MASK: np.ones(10, dtype=bool)}}
    if method == "fedccfa":  # round 21: the anchors are on (align-from-round 20)
        head = {HEAD_PREFIX + k: v.detach().cpu().numpy().copy() for k, v in model.head.state_dict().items()}
        return Received(server_round=21, sections={**centroids, p.INITIAL_HEAD: head},
                        config={p.HAS_PERSONAL_HEAD: True})
    if method == "pfedvem":
        weight = torch.randn(model.head.weight.shape, generator=g)
        bias = torch.randn(model.head.bias.shape, generator=g)
        # the posterior scales are the site's own (s^0 before its first round: LocalData's empty state)
        return Received(sections={p.POSTERIOR: {p.PRIOR_WEIGHT: weight.numpy(), p.PRIOR_BIAS: bias.numpy()}})
    return Received(sections=centroids)


def _local_update(model: FedPACNet, x: torch.Tensor, y: torch.Tensor, received: Received, cfg: FedPACConfig,
                  generator: torch.Generator) -> ClientResult:
    """The run's method's local update (no test split: x, y stand in for it)."""
    return client_routine(METHODS[cfg.strategy]).local_update(model, LocalData(x, y, x, y), received, cfg, generator)


def _site_on(device: torch.device) -> tuple[FedPACNet, LocalData]:
    """A fresh model (seed 0) and the task's data (no test split: the training data stand in for
    it) on ``device``."""
    torch.manual_seed(0)
    model = FedPACNet(1, 28, 10).to(device)
    x, y = (t.to(device) for t in _task())
    return model, LocalData(x, y, x, y)


def _assert_gpu_matches_cpu(gpu_model: FedPACNet, cpu_model: FedPACNet, what: str = "") -> None:
    """The GPU model lives on the GPU and holds the CPU model's values, up to the order of the
    float arithmetic."""
    assert all(q.device.type == "cuda" for q in gpu_model.parameters())
    for (name, a), b in zip(cpu_model.state_dict().items(), gpu_model.state_dict().values()):
        torch.testing.assert_close(b.cpu(), a, rtol=2e-3, atol=2e-3, msg=f"{what}{name}")


@pytest.fixture(autouse=True)
def _no_tf32():
    """The CPU comparison wants float32 on the GPU too: cuDNN's convolutions default to TF32."""
    before = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32 = before


def _update_on(device: torch.device, method: str, cfg: FedPACConfig):
    model, data = _site_on(device)
    update = _local_update(model, data.x, data.y, _received(method, model), cfg, torch.Generator().manual_seed(0))
    return model, update


@pytest.mark.parametrize("method", METHODS_UNDER_TEST)
def test_a_local_update_on_the_gpu_matches_the_cpu(method):
    cfg = FedPACConfig(strategy=method, local_epochs=2, batch_size=20)
    cpu_model, cpu_update = _update_on(CPU, method, cfg)
    gpu_model, gpu_update = _update_on(CUDA, method, cfg)
    # Same batches, same steps: only the order of the float arithmetic differs.
    _assert_gpu_matches_cpu(gpu_model, cpu_model, f"{method}: ")
    assert gpu_update.train_loss == pytest.approx(cpu_update.train_loss, rel=1e-2, abs=1e-3)
    # the same arrays travel back, on the host: n_i, class counts, centroids, h, balanced head
    assert gpu_update.num_examples == cpu_update.num_examples
    assert set(gpu_update.statistics) == set(cpu_update.statistics)
    assert set(gpu_update.metrics) == set(cpu_update.metrics)
    if p.CENTROID_VALUES in cpu_update.statistics:
        torch.testing.assert_close(torch.from_numpy(gpu_update.statistics[p.CENTROID_VALUES]),
                                   torch.from_numpy(cpu_update.statistics[p.CENTROID_VALUES]), rtol=2e-3, atol=2e-3)
    if p.H in cpu_update.statistics:  # (mu, V) for the QP, taken before training
        assert gpu_update.metrics[p.V] == pytest.approx(cpu_update.metrics[p.V], rel=1e-4)
        torch.testing.assert_close(torch.from_numpy(gpu_update.statistics[p.H]),
                                   torch.from_numpy(cpu_update.statistics[p.H]), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mixed_precision", [False, True])
def test_fedpac_learns_on_the_gpu(mixed_precision):
    torch.backends.cudnn.allow_tf32 = True  # as the ClientApp runs: TF32 convolutions, optionally bf16
    cfg = FedPACConfig(local_epochs=3, batch_size=20, mixed_precision=mixed_precision)
    torch.manual_seed(0)
    model = FedPACNet(1, 28, 10).to(CUDA)
    x, y = (t.to(CUDA) for t in _task())
    x_test, y_test = (t.to(CUDA) for t in _task(seed=1))
    _, before = evaluate(copy.deepcopy(model), x_test, y_test)
    for server_round in (1, 2):
        _local_update(model, x, y, dataclasses.replace(_received("fedpac", model), server_round=server_round),
                      cfg, torch.Generator().manual_seed(server_round))
    _, after = evaluate(model, x_test, y_test)
    assert all(q.dtype == torch.float32 for q in model.parameters())
    assert before < 0.5 and after > 0.95


def test_dittos_personal_model_kept_on_the_gpu_matches_the_cpu():
    """Two rounds at one site: the personal model goes to the site's state as host arrays and comes
    back onto the GPU, where it is the model the site evaluates."""
    cfg = FedPACConfig(strategy="ditto", local_epochs=1, batch_size=20)
    routine = client_routine(METHODS["ditto"])
    personal = {}
    for device in (CPU, CUDA):
        model, data = _site_on(device)
        for server_round in (1, 2):
            routine.local_update(model, data, Received(server_round=server_round), cfg,
                                 torch.Generator().manual_seed(server_round))
        personal[device.type] = routine.before_evaluation(model, data, cfg, torch.Generator().manual_seed(3))
    _assert_gpu_matches_cpu(personal["cuda"], personal["cpu"])


def test_fedbabus_head_stays_and_its_fine_tuned_copy_on_the_gpu_matches_the_cpu():
    """FedBABU on the GPU: the local update sends the head back bit for bit, and the copy it
    fine-tunes before evaluation (body and head, on the GPU) is the CPU's, the received model
    untouched."""
    cfg = FedPACConfig(strategy="fedbabu", local_epochs=1, batch_size=20)
    routine = client_routine(METHODS["fedbabu"])
    tuned = {}
    for device in (CPU, CUDA):
        model, data = _site_on(device)
        head = {k: v.detach().clone() for k, v in model.head.state_dict().items()}
        routine.local_update(model, data, Received(), cfg, torch.Generator().manual_seed(1))
        assert all(torch.equal(head[k], v) for k, v in model.head.state_dict().items())
        received = {k: v.detach().clone() for k, v in model.state_dict().items()}
        tuned[device.type] = routine.before_evaluation(model, data, cfg, torch.Generator().manual_seed(3))
        assert all(torch.equal(received[k], v) for k, v in model.state_dict().items())
        assert not torch.equal(tuned[device.type].head.weight, model.head.weight)
    _assert_gpu_matches_cpu(tuned["cuda"], tuned["cpu"])
