"""pFedHN's hypernetwork and its update, in plain PyTorch and numpy (nothing of Flower).

The hypernetwork h(v; phi) maps a client's embedding v_i to every weight of its model: an MLP
(``embedding-dim`` -> ``hidden``, then ``HIDDEN_LAYERS`` times ReLU and ``hidden`` -> ``hidden``)
followed by one linear generator per target array (``hidden`` -> that array's size, reshaped), the
authors' ``CNNHyper`` (``experiments/pfedhn/models.py``) written for any target model, as FL-bench's
``HyperNetwork`` (``src/server/pfedhn.py``) is.

Its state travels as numpy arrays (the server keeps them in its ``ServerState``, so checkpoints
hold them): phi by the module's state-dict keys, v_i as one vector. :class:`HyperNetwork` is a
skeleton whose own parameters are never used: :func:`generate` and :func:`gradient` call it on
the arrays given (``torch.func.functional_call``).

The update (the paper's Algorithm 1): a client trains the generated theta_i = h(v_i; phi) into
theta~_i; the gradient of phi and v_i is the chain rule's, (d theta_i / d (phi, v_i))^T
(theta_i - theta~_i) (:func:`gradient`), at the (phi, v_i) that generated theta_i -Delta theta_i
backpropagated through h (the server takes the round's later steps at the phi they start from:
``server.Server.step``); the step is
the authors' optimizer, SGD with momentum 0.9 and weight decay 1e-3 on the gradient clipped to a
total norm of 50 (:func:`sgd_step`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.func import functional_call

# Arrays by name (the product's ``common.protocol.NDArrays``, not imported: no Flower here).
Arrays = dict[str, np.ndarray]

# The authors' hypernetwork and optimizer (``experiments/pfedhn/trainer.py``: --n-hidden 3,
# SGD(momentum=0.9, weight_decay=--wd 1e-3), clip_grad_norm_(hnet.parameters(), 50)), the same
# defaults as FL-bench's (hidden_num 3, hn_momentum 0.9, hn_weight_decay 1e-3, norm_clip 50).
HIDDEN_LAYERS = 3
MOMENTUM = 0.9
WEIGHT_DECAY = 1e-3
MAX_GRAD_NORM = 50.0
# The key of the embedding among the arrays one step updates (phi's keys all hold a dot).
EMBEDDING = "embedding"
# Streams of the seeded embeddings (numpy SeedSequence entropy [seed, stream, ...]): a client's
# own, and the one of a node bound to no partition.
_CLIENT_STREAM = 0x70FE_D4E0
_UNBOUND_STREAM = 0x70FE_D4E1


@dataclass(frozen=True)
class Architecture:
    """The hypernetwork's sizes: the embedding's, the MLP's width and depth."""

    embedding_dim: int
    hidden: int
    hidden_layers: int = HIDDEN_LAYERS


def _generator_key(target: str) -> str:
    """A target array's generator's name in the ModuleDict (which refuses dots)."""
    return target.replace(".", "-")


class HyperNetwork(nn.Module):
    """h(v; phi): the embedding through the MLP, then one linear generator per target array."""

    def __init__(self, targets: Mapping[str, tuple[int, ...]], architecture: Architecture) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Linear(architecture.embedding_dim, architecture.hidden)]
        for _ in range(architecture.hidden_layers):
            layers += [nn.ReLU(), nn.Linear(architecture.hidden, architecture.hidden)]
        self.mlp = nn.Sequential(*layers)
        self.targets = {name: tuple(shape) for name, shape in targets.items()}
        self.generators = nn.ModuleDict({_generator_key(name): nn.Linear(architecture.hidden, math.prod(shape))
                                         for name, shape in self.targets.items()})

    def forward(self, embedding: torch.Tensor) -> dict[str, torch.Tensor]:
        features = self.mlp(embedding)
        return {name: self.generators[_generator_key(name)](features).reshape(shape)
                for name, shape in self.targets.items()}


def size(targets: Mapping[str, tuple[int, ...]], architecture: Architecture) -> int:
    """The number of phi's parameters: (hidden + 1) per target weight, plus the MLP's."""
    width, depth = architecture.hidden, architecture.hidden_layers
    mlp = (architecture.embedding_dim + 1) * width + depth * (width + 1) * width
    return mlp + (width + 1) * sum(math.prod(shape) for shape in targets.values())


def skeleton(targets: Mapping[str, tuple[int, ...]], architecture: Architecture) -> HyperNetwork:
    """The network's structure without parameters of its own (on the meta device): what
    :func:`generate` and :func:`gradient` call on phi's arrays."""
    with torch.device("meta"):
        return HyperNetwork(targets, architecture)


def initial_phi(targets: Mapping[str, tuple[int, ...]], architecture: Architecture, seed: int) -> Arrays:
    """phi^0: PyTorch's default initialization of the network's layers (the authors'), drawn
    from ``seed`` alone; torch's global random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        network = HyperNetwork(targets, architecture)
    return {key: value.detach().numpy() for key, value in network.state_dict().items()}


def initial_embedding(embedding_dim: int, seed: int, partition_id: int | None) -> np.ndarray:
    """v_i^0 ~ N(0, I) (``nn.Embedding``'s initialization, the authors'), drawn from (seed,
    partition-id): the embedding of a client the hypernetwork has not seen is the same on every
    run with that seed, however many clients there are and whenever it first shows up. A node
    bound to no partition (``None``) has one of its own."""
    entropy = [seed, _UNBOUND_STREAM] if partition_id is None else [seed, _CLIENT_STREAM, partition_id]
    return np.random.default_rng(entropy).standard_normal(embedding_dim).astype(np.float32)


def _tensors(arrays: Mapping[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """The arrays as tensors sharing their memory (phi is ~47 MB: no copies; nothing writes to
    them)."""
    return {key: torch.from_numpy(np.asarray(value)) for key, value in arrays.items()}


def generate(network: HyperNetwork, phi: Mapping[str, np.ndarray], embedding: np.ndarray) -> Arrays:
    """theta_i = h(v_i; phi), as float32 arrays by the target model's keys."""
    with torch.no_grad():
        theta = functional_call(network, _tensors(phi), (torch.from_numpy(np.asarray(embedding)),))
    return {key: value.numpy() for key, value in theta.items()}


def gradient(network: HyperNetwork, phi: Mapping[str, np.ndarray], embedding: np.ndarray,
             trained: Mapping[str, np.ndarray]) -> Arrays:
    """The gradient of phi and v_i (key :data:`EMBEDDING`) from one client's round: theta_i -
    theta~_i backpropagated through theta_i = h(v_i; phi), the gradient of (1/2) ||theta_i -
    theta~_i||^2 (``trained`` is theta~_i). At the (phi, v_i) that generated the model the client
    trained, theta_i - theta~_i is -Delta theta_i, the authors' rule. A step against it moves the
    generated model towards the trained one."""
    params = {key: value.requires_grad_() for key, value in _tensors(phi).items()}
    v = torch.tensor(np.asarray(embedding), requires_grad=True)
    theta = functional_call(network, params, (v,))
    names = list(theta)
    back = [theta[name].detach() - torch.from_numpy(np.asarray(trained[name])) for name in names]
    grads = torch.autograd.grad([theta[name] for name in names], [*params.values(), v], grad_outputs=back)
    return {**{key: g.numpy() for key, g in zip(params, grads)}, EMBEDDING: grads[-1].numpy()}


def sgd_step(params: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray], buffers: Mapping[str, np.ndarray],
             lr: float) -> tuple[Arrays, Arrays]:
    """One step of the authors' hypernetwork optimizer on ``params`` (phi and v_i), returning new
    parameters and momentum buffers (the inputs are left as they are): the gradients scaled to a
    total norm of at most :data:`MAX_GRAD_NORM` (``torch.nn.utils.clip_grad_norm_``'s rule),
    then weight decay and heavy-ball momentum as ``torch.optim.SGD`` (g += wd * p;
    b = momentum * b + g; p -= lr * b; a buffer of zeros makes the first step's b = g)."""
    p, g, b = _tensors(params), _tensors(grads), _tensors(buffers)
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(value) for value in g.values()]))
    scale = min(1.0, MAX_GRAD_NORM / (float(norm) + 1e-6))
    new_params, new_buffers = {}, {}
    with torch.no_grad():
        for key, param in p.items():
            step = g[key].mul(scale) if scale < 1.0 else g[key].clone()
            step.add_(param, alpha=WEIGHT_DECAY)
            buffer = b[key].mul(MOMENTUM).add_(step)
            new_params[key] = param.add(buffer, alpha=-lr).numpy()
            new_buffers[key] = buffer.numpy()
    return new_params, new_buffers
