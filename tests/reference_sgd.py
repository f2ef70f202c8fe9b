"""From-scratch pieces for the tests' reference updates, written without the product's training
code: torch's SGD with momentum and weight decay as a formula, the cross-entropy of a network
at given parameters, and the shuffle convention every local update follows (one
``torch.randperm`` of the samples per epoch from the round's generator, split into batches)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

Params = dict[str, torch.Tensor]


def batches(num_samples: int, batch_size: int, epochs: int, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """The minibatches of ``epochs`` epochs, each a fresh shuffle."""
    for _ in range(epochs):
        yield from torch.randperm(num_samples, generator=generator).split(batch_size)


def loss_and_gradient(net: nn.Module, params: Params, x: torch.Tensor, y: torch.Tensor) -> tuple[float, Params]:
    """CE of ``net`` at ``params`` on (x, y), and its gradient with respect to them."""
    leaves = {k: v.detach().clone().requires_grad_(True) for k, v in params.items()}
    loss = F.cross_entropy(functional_call(net, leaves, (x,)), y)
    grads = torch.autograd.grad(loss, list(leaves.values()))
    return float(loss.detach()), dict(zip(leaves, grads))


def sgd_step(params: Params, grads: Params, buffers: Params, lr: float, momentum: float,
             weight_decay: float) -> Params:
    """d = g + wd p; b = d on the first step, else momentum b + d; p <- p - lr b. ``buffers`` is
    updated in place."""
    stepped = {}
    for key, value in params.items():
        d = grads[key] + weight_decay * value
        buffers[key] = d.clone() if key not in buffers else momentum * buffers[key] + d
        stepped[key] = value - lr * buffers[key]
    return stepped


def params_of(net: nn.Module) -> Params:
    return {k: v.detach().clone() for k, v in net.named_parameters()}
