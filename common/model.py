"""The paper's CNNs (Appendix B.1), each split into a feature extractor and a linear head.

FedPAC shares the extractor ``theta`` (every layer up to the d-dimensional embedding) and keeps
the head ``phi`` (d -> K) personal, so the split is part of the model's structure: parameter
names start with ``extractor.`` or ``head.``.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn

EMBEDDING_DIM = 128
EXTRACTOR_PREFIX = "extractor."
HEAD_PREFIX = "head."


def _conv_block(in_channels: int, out_channels: int, kernel: int, padding: int) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, padding=padding),
        nn.LeakyReLU(),
        nn.MaxPool2d(2),
    ]


def _extractor(in_channels: int, image_size: int) -> nn.Sequential:
    """The paper's extractor: 2 conv blocks for 28x28x1, 3 for 32x32x3, then fc -> d."""
    if (in_channels, image_size) == (1, 28):
        convs = _conv_block(1, 16, 5, 0) + _conv_block(16, 32, 5, 1)
    elif (in_channels, image_size) == (3, 32):
        convs = _conv_block(3, 16, 5, 0) + _conv_block(16, 32, 5, 1) + _conv_block(32, 64, 3, 1)
    else:
        raise ValueError(
            f"no FedPAC CNN for {image_size}x{image_size}x{in_channels} images; "
            "supported: 28x28x1 (MNIST family) and 32x32x3 (CIFAR family)"
        )
    body = nn.Sequential(*convs, nn.Flatten())
    with torch.no_grad():
        flat_dim = body(torch.zeros(1, in_channels, image_size, image_size)).shape[1]
    return nn.Sequential(*body, nn.Linear(flat_dim, EMBEDDING_DIM), nn.LeakyReLU())


class FedPACNet(nn.Module):
    """Feature extractor ``f_theta`` followed by a linear classifier head ``phi``."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int) -> None:
        super().__init__()
        self.extractor = _extractor(in_channels, image_size)
        self.head = nn.Linear(EMBEDDING_DIM, num_classes)

    @property
    def embedding_dim(self) -> int:
        return self.head.in_features

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extractor(x))


def initial_model(in_channels: int, image_size: int, num_classes: int, seed: int) -> FedPACNet:
    """The run's round-0 model: the same for a given seed on every machine, so that a site can
    build for itself the parts of it that its method never sends (``Rule.LOCAL``). Torch's global
    random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FedPACNet(in_channels, image_size, num_classes)


def part_of(key: str) -> str:
    """The model part (``extractor`` or ``head``) a state-dict key belongs to."""
    return key.split(".", 1)[0]


def split_state(state: dict[str, torch.Tensor]) -> tuple[dict, dict]:
    """Split a full state dict into (extractor, head) parts, keys kept as they are."""
    extractor = {k: v for k, v in state.items() if k.startswith(EXTRACTOR_PREFIX)}
    head = {k: v for k, v in state.items() if k.startswith(HEAD_PREFIX)}
    return extractor, head


def weights_digest(module: nn.Module) -> bytes:
    """A digest of ``module``'s parameters and buffers (names, shapes, dtypes and values, bit for
    bit): what a cache of the module's outputs is keyed by."""
    digest = hashlib.blake2b(digest_size=32)
    for name, tensor in module.state_dict().items():
        value = tensor.detach().cpu().contiguous()
        digest.update(f"{name}:{tuple(value.shape)}:{value.dtype};".encode())
        digest.update(value.reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.digest()
