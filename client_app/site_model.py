"""A site's personalized model: what a deployed client keeps, and how to run it.

After the last round (and every ``save-model-every`` rounds) each deployed SuperNode writes the
model it was just evaluated with, the global extractor with its own combined head (FedPAC), into
the folder its node config names as ``model-dir``. Every site gets the last round's model, whatever
``fraction-evaluate`` is: the server sends it, in an evaluate message of the last round, to each
site that round's evaluation did not reach (``PersonalizedStrategy.deliver``; a site offline then is asked again
until the round timeout, and the run's status.json lists under ``delivery`` who got it and who not):

* ``model.pt``: the PyTorch state dict (``torch.load`` gives it back; ``extractor.*`` and
  ``head.*`` tensors of :class:`common.model.FedPACNet`);
* ``model.json``: the round, its accuracy on the site's own test split, the method, the model
  shape and the input normalization the model expects.

Both are replaced atomically, so the folder always holds one complete model. To use it::

    from client_app.site_model import load_site_model, predict
    model, info = load_site_model("/srv/fedpac-model")
    labels, probabilities = predict(model, info, images)   # uint8 images, N x H x W [x C]

or from the shell, on a folder of images or an .npz file (array ``x``)::

    fedpac-predict /srv/fedpac-model path/to/images --out predictions.csv
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from common.data import IMAGE_SUFFIXES, to_tensors
from common.files import atomic_write
from common.model import FedPACNet

MODEL_FILE = "model.pt"
INFO_FILE = "model.json"


@dataclass(frozen=True)
class SiteModel:
    """What ``model.json`` says about the model next to it."""

    method: str
    run_id: int
    round: int
    partition_id: int
    accuracy: float  # on the site's own test split, when it was saved
    num_classes: int
    image_size: int
    image_channels: int
    mean: list[float]  # per-channel input normalization, in [0, 1] pixel units
    std: list[float]


def save_site_model(directory: str | Path, model: FedPACNet, info: SiteModel) -> None:
    """Write ``model.pt`` then ``model.json`` into ``directory`` (created if needed)."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    atomic_write(directory / MODEL_FILE, buffer.getvalue())
    atomic_write(directory / INFO_FILE, (json.dumps(asdict(info), indent=2) + "\n").encode())


def load_site_model(directory: str | Path, device: str | torch.device = "cpu") -> tuple[FedPACNet, SiteModel]:
    """The model a site saved, in eval mode on ``device``, and its description."""
    directory = Path(directory)
    try:
        info = SiteModel(**json.loads((directory / INFO_FILE).read_text()))
        state = torch.load(directory / MODEL_FILE, map_location=device, weights_only=True)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{directory} holds no site model ({MODEL_FILE} + {INFO_FILE}): {err}") from err
    model = FedPACNet(info.image_channels, info.image_size, info.num_classes)
    model.load_state_dict(state, strict=True)
    return model.to(device).eval(), info


@torch.no_grad()
def predict(model: FedPACNet, info: SiteModel, images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Class and softmax probabilities for uint8 images (N x H x W, or N x H x W x C)."""
    images = images[..., None] if images.ndim == 3 else images
    expected = (info.image_size, info.image_size, info.image_channels)
    if images.dtype != np.uint8 or tuple(images.shape[1:]) != expected:
        raise ValueError(f"images must be uint8 of shape N x {' x '.join(map(str, expected))}, "
                         f"got {images.dtype} {images.shape}")
    device = next(model.parameters()).device
    x, _ = to_tensors(images, np.zeros(len(images), dtype=np.int64), np.asarray(info.mean),
                      np.asarray(info.std), device)
    probabilities = torch.softmax(model(x), dim=1).cpu().numpy()
    return probabilities.argmax(axis=1), probabilities


def read_images(source: Path) -> tuple[list[str], np.ndarray]:
    """(names, uint8 images) from a folder of image files (sorted) or an .npz with array ``x``."""
    if source.is_file() and source.suffix == ".npz":
        with np.load(source, allow_pickle=False) as arrays:
            images = arrays["x"]
        return [f"{source.name}[{i}]" for i in range(len(images))], images
    from PIL import Image  # pylint: disable=import-outside-toplevel  # comes with torchvision

    files = sorted(f for f in source.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES) if source.is_dir() else []
    if not files:
        raise ValueError(f"{source}: neither a folder of {'/'.join(IMAGE_SUFFIXES)} images nor an .npz file")
    images = []
    for file in files:
        with Image.open(file) as image:
            images.append(np.asarray(image, dtype=np.uint8))
    return [f.name for f in files], np.stack(images)


def main(argv: list[str] | None = None) -> int:
    """``fedpac-predict MODEL_DIR IMAGES [--out CSV]``: one line per image, class and confidence."""
    cli = argparse.ArgumentParser(prog="fedpac-predict", description="Run a site's personalized FedPAC model.")
    cli.add_argument("model_dir", type=Path, help="the SuperNode's model-dir (model.pt + model.json)")
    cli.add_argument("images", type=Path, help="a folder of image files, or an .npz file with array x")
    cli.add_argument("--out", type=Path, help="CSV file to write (default: standard output)")
    cli.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    args = cli.parse_args(argv)
    try:
        model, info = load_site_model(args.model_dir, args.device)
        names, images = read_images(args.images)
        labels, probabilities = predict(model, info, images)
    except (OSError, ValueError, KeyError) as err:
        print(f"fedpac-predict: {err}", file=sys.stderr)
        return 2
    with open(args.out, "w", newline="") if args.out else contextlib.nullcontext(sys.stdout) as stream:
        writer = csv.writer(stream)
        writer.writerow(["image", "class", "confidence"])
        for name, label, row in zip(names, labels, probabilities):
            writer.writerow([name, int(label), f"{row[label]:.4f}"])
    print(f"fedpac-predict: {len(names)} images, model of round {info.round} (accuracy "
          f"{100 * info.accuracy:.2f}% on the site's test split)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
