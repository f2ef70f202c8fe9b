"""The paper's CNNs (Appendix B.1), each split into a feature extractor and a linear head.

FedPAC shares the extractor ``theta`` (every layer up to the d-dimensional embedding) and keeps
the head ``phi`` (d -> K) personal, so the split is part of the model's structure: parameter
names start with ``extractor.`` or ``head.``.

A second extractor, for differentially private training (``extractor-front-end = "scatternet"``),
puts a fixed scattering transform in front of one trained layer: Tramer & Boneh, "Differentially
private learning needs better features (or much more data)", ICLR 2021.
"""

from __future__ import annotations

import copy
import hashlib
from collections.abc import Sequence

import torch
from torch import nn

EMBEDDING_DIM = 128
EXTRACTOR_PREFIX = "extractor."
HEAD_PREFIX = "head."
FRONT_ENDS = ("none", "scatternet")
SCATTERING_SCALES = 2  # J: Tramer & Boneh's choice for 28x28 and 32x32 images


def _conv_block(in_channels: int, out_channels: int, kernel: int, padding: int) -> list[nn.Module]:
    return [
        nn.Conv2d(in_channels, out_channels, kernel, padding=padding),
        nn.LeakyReLU(),
        nn.MaxPool2d(2),
    ]


class ScatterNet(nn.Module):
    """A scattering transform (Oyallon & Mallat; ``kymatio``): fixed wavelet filters, nothing
    learned from data, so its features cost a private site no privacy, and they are far better
    than what DP-SGD learns in conv layers from a site's few thousand records.

    It is not part of :class:`FedPACNet`: having nothing to learn, it is applied once to a site's
    images (:func:`model_inputs`) instead of at every epoch, and its filters, which every party
    builds the same way, are never sent, saved or averaged. Output: ``N x (C * 81) x H/4 x W/4``
    for J = 2 and 8 angles."""

    def __init__(self, image_size: int) -> None:
        super().__init__()
        # The 2-D frontend's own module: ``kymatio.torch`` also loads the 3-D transform, which
        # needs ``scipy.special.sph_harm`` (gone from SciPy 1.15).
        from kymatio.scattering2d.frontend.torch_frontend import (  # pylint: disable=import-outside-toplevel
            ScatteringTorch2D,
        )

        self.transform = ScatteringTorch2D(J=SCATTERING_SCALES, shape=(image_size, image_size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.transform(x.contiguous()).flatten(1, 2)


def _known_front_end(front_end: str) -> str:
    """``front_end``, or a ValueError that names the known ones."""
    if front_end not in FRONT_ENDS:
        raise ValueError(f"unknown extractor front end {front_end!r}; known: {', '.join(FRONT_ENDS)}")
    return front_end


def scattering_shape(in_channels: int, image_size: int) -> tuple[int, int, int]:
    """The shape of one image's scattering: (C * 81) x H/4 x W/4 (J = 2, 8 angles)."""
    angles = 8
    orders = 1 + SCATTERING_SCALES * angles + angles**2 * SCATTERING_SCALES * (SCATTERING_SCALES - 1) // 2
    side = image_size // 2**SCATTERING_SCALES
    return in_channels * orders, side, side


@torch.no_grad()
def model_inputs(images: torch.Tensor, front_end: str, chunk: int = 1000) -> torch.Tensor:
    """What :class:`FedPACNet` reads: the normalized images themselves, or with the ScatterNet
    front end their scattering, computed here once for a site's whole split (``chunk`` images at
    a time, to bound the transform's memory)."""
    if _known_front_end(front_end) == "none":
        return images
    scattering = ScatterNet(images.shape[-1]).to(images.device)
    if len(images) == 0:
        return images.new_zeros((0, *scattering_shape(images.shape[1], images.shape[-1])))
    return torch.cat([scattering(part) for part in images.split(chunk)])


def _scatternet_extractor(in_channels: int, image_size: int) -> nn.Sequential:
    """For scattered images: a parameter-free group normalization (Tramer & Boneh's), then one
    fc layer -> d."""
    channels, height, width = scattering_shape(in_channels, image_size)
    return nn.Sequential(nn.GroupNorm(27, channels, affine=False), nn.Flatten(),
                         nn.Linear(channels * height * width, EMBEDDING_DIM), nn.LeakyReLU())


def _extractor(in_channels: int, image_size: int, front_end: str = "none") -> nn.Sequential:
    """The paper's extractor: 2 conv blocks for 28x28x1, 3 for 32x32x3, then fc -> d; or, behind
    the ScatterNet front end (:func:`model_inputs`), one fc layer."""
    if _known_front_end(front_end) == "scatternet":
        return _scatternet_extractor(in_channels, image_size)
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


class Branches(nn.Module):
    """Several extractors side by side on the same input, their features concatenated."""

    def __init__(self, extractors: Sequence[nn.Module]) -> None:
        super().__init__()
        self.branches = nn.ModuleList(extractors)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([branch(x) for branch in self.branches], dim=1)


class FedPACNet(nn.Module):
    """Feature extractor ``f_theta`` followed by a linear classifier head ``phi``. With a front
    end, it reads :func:`model_inputs` of the images instead of the images.

    With ``branches`` > 1 the extractor is that many of the paper's extractors side by side
    (:class:`Branches`) and the head reads their features together: the shape of a weighted sum
    of several models' outputs (:func:`output_mixture`), which a site evaluates, saves and loads
    like any other model."""

    def __init__(self, in_channels: int, image_size: int, num_classes: int, front_end: str = "none",
                 branches: int = 1) -> None:
        super().__init__()
        if branches < 1:
            raise ValueError(f"a model has at least one extractor, not {branches}")
        if branches == 1:
            self.extractor: nn.Module = _extractor(in_channels, image_size, front_end)
        else:
            self.extractor = Branches([_extractor(in_channels, image_size, front_end) for _ in range(branches)])
        self.head = nn.Linear(branches * EMBEDDING_DIM, num_classes)

    @property
    def embedding_dim(self) -> int:
        return self.head.in_features

    @property
    def num_classes(self) -> int:
        return self.head.out_features

    @property
    def branches(self) -> int:
        """How many extractors run side by side (1: the paper's model)."""
        return len(self.extractor.branches) if isinstance(self.extractor, Branches) else 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.extractor(x))


@torch.no_grad()
def output_mixture(models: Sequence[FedPACNet], weights: Sequence[float]) -> FedPACNet:
    """One network whose logits are ``sum_k weights[k] * models[k](x)``: the models' extractors
    side by side, and as head their heads side by side, each scaled by its weight (the biases
    summed with the same weights). The models are copied, not shared."""
    if len(models) != len(weights) or not models:
        raise ValueError(f"{len(models)} models and {len(weights)} weights")
    if any(model.branches != 1 for model in models):
        raise ValueError("the mixed models must each have one extractor")
    mixture = copy.deepcopy(models[0])
    mixture.extractor = Branches([copy.deepcopy(model.extractor) for model in models])
    head = models[0].head
    mixture.head = nn.Linear(len(models) * head.in_features, head.out_features, device=head.weight.device,
                             dtype=head.weight.dtype)
    mixture.head.weight.copy_(torch.cat([weight * model.head.weight for model, weight in zip(models, weights)], dim=1))
    mixture.head.bias.copy_(torch.stack([weight * model.head.bias for model, weight in zip(models, weights)]).sum(0))
    return mixture


def initial_model(in_channels: int, image_size: int, num_classes: int, seed: int,
                  front_end: str = "none") -> FedPACNet:
    """The run's round-0 model: the same for a given seed on every machine, so that a site can
    build for itself the parts of it that its method never sends (``Rule.LOCAL``). Torch's global
    random state is left as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return FedPACNet(in_channels, image_size, num_classes, front_end)


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
