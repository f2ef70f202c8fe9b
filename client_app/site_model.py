"""A site's personalized models: what a deployed client keeps, by run, and how to run one.

After the last round (and every ``save-model-every`` rounds) each deployed SuperNode writes the
model it was just evaluated with, the global extractor with its own combined head (FedPAC), into
the folder its node config names as ``model-dir``. Every site gets the last round's model, whatever
``fraction-evaluate`` is: the server sends it, in an evaluate message of the last round, to each
site that round's evaluation did not reach (``PersonalizedStrategy.deliver``; a site offline then is asked again
until the round timeout, and the run's status.json lists under ``delivery`` who got it and who not).

A model is two files:

* ``model.pt``: the PyTorch state dict (``torch.load`` gives it back; ``extractor.*`` and
  ``head.*`` tensors of :class:`common.model.FedPACNet`, with ``branches`` extractors side by side);
* ``model.json``: the run, the round, its accuracy on the site's own test split, the method, the
  model shape, the input normalization the model expects and when it was saved.

Each run keeps its own, so that a smoke test or another experiment never overwrites the model a
site works with::

    model-dir/runs/<run-id>/model.pt, model.json   each run's latest save (every save-model-every
                                                   rounds, then its last round's)
    model-dir/current                              the run id of the site's current model
    model-dir/model.pt, model.json                 a copy of the current model, for tools that
                                                   open the files themselves

The current model changes only when a run completes (its last round's save): a run that stops
early, or is still under way, leaves it as it was. The ``KEPT_RUNS`` (5) runs that saved last are
kept, and the current one whatever its age; older run folders are deleted at the next save. Every
file is replaced atomically, and ``current`` is written last, so a crash leaves the previous
current model in force, never a half-written one. A ``model-dir`` written before runs were kept
(``model.pt`` and ``model.json`` at the top, no ``current``) still loads, and its model moves into
``runs/`` the first time a run completes. To use a model::

    from client_app.site_model import load_site_model, predict
    model, info = load_site_model("/srv/fedpac-model")              # the current model
    model, info = load_site_model("/srv/fedpac-model", run=123456)  # a kept run's
    labels, probabilities = predict(model, info, images)   # uint8 images, N x H x W [x C]

or from the shell, on a folder of images or an .npz file (array ``x``)::

    fedpac-predict /srv/fedpac-model path/to/images --out predictions.csv [--run RUN_ID]
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import shutil
import sys
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from common.data import IMAGE_SUFFIXES, to_tensors
from common.files import atomic_write
from common.model import FedPACNet, model_inputs

MODEL_FILE = "model.pt"
INFO_FILE = "model.json"
RUNS_DIR = "runs"  # one folder per run, named by its run id
CURRENT_FILE = "current"  # the run id of the site's current model
KEPT_RUNS = 5  # run folders kept: those of the runs that saved last, and the current run's whatever its age


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
    saved_at: float = 0.0  # Unix time of the save (0: written before runs were kept); orders the runs
    front_end: str = "none"  # the run's extractor-front-end: what the model reads (common.model.model_inputs)
    branches: int = 1  # extractors side by side (common.model.FedPACNet): 2 for APFL's output mixture


def run_id_of(run: int | str) -> int:
    """A run id as a folder name may hold it: a whole number >= 0 in ASCII digits, so that a
    ``--run`` argument (or a corrupted ``current``) can never name a path outside ``runs/``."""
    text = str(run).strip()
    if not _is_run_name(text):
        raise ValueError(f"{run!r} is not a run id (a whole number)")
    return int(text)


def _is_run_name(name: str) -> bool:
    """Whether ``name`` is a run folder's name: ASCII digits only (``str.isdigit`` also takes
    digits such as superscripts, which ``int`` refuses)."""
    return name.isascii() and name.isdigit()


def run_folder(directory: str | Path, run: int | str) -> Path:
    """Where run ``run`` keeps its model in ``directory``."""
    return Path(directory) / RUNS_DIR / str(run_id_of(run))


def current_run(directory: str | Path) -> int | None:
    """The run id of ``directory``'s current model; None before a run completed under this layout
    (an empty folder, or one written before runs were kept)."""
    pointer = Path(directory) / CURRENT_FILE
    try:
        text = pointer.read_text(encoding="ascii")
    except FileNotFoundError:
        return None
    try:
        return run_id_of(text)
    except ValueError as err:
        raise ValueError(f"{pointer}: {err}") from err


def kept_runs(directory: str | Path) -> list[int]:
    """The run ids of ``directory``'s run folders, the latest save first."""
    runs = Path(directory) / RUNS_DIR
    folders = [f for f in runs.iterdir() if f.is_dir() and _is_run_name(f.name)] if runs.is_dir() else []
    return [int(f.name) for f in sorted(folders, key=_saved_at, reverse=True)]


def _saved_at(folder: Path) -> float:
    """When ``folder``'s model was saved: ``saved_at`` in its model.json, else the file's time (a
    model written before runs were kept, or one whose model.json is missing)."""
    info = folder / INFO_FILE
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        saved = float(json.loads(info.read_text()).get("saved_at") or 0.0)
        if saved > 0:
            return saved
    with contextlib.suppress(OSError):
        return info.stat().st_mtime
    return 0.0


def save_site_model(directory: str | Path, model: FedPACNet, info: SiteModel, *, run_complete: bool) -> Path:
    """Write the model of run ``info.run_id`` into its folder under ``directory`` (created if needed)
    and return that folder. ``run_complete`` (the run's last round) also makes it the site's
    current model; a save in the middle of a run leaves the current model as it is. Then run
    folders beyond the ``KEPT_RUNS`` latest are deleted, never the current one's."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)  # a model-dir that is a file fails here, named
    info = replace(info, saved_at=time.time())
    buffer = io.BytesIO()
    torch.save({k: v.detach().cpu() for k, v in model.state_dict().items()}, buffer)
    files = {MODEL_FILE: buffer.getvalue(), INFO_FILE: (json.dumps(asdict(info), indent=2) + "\n").encode()}
    folder = run_folder(directory, info.run_id)
    _write_model(folder, files)
    if run_complete:
        _make_current(directory, info.run_id, files)
    prune_runs(directory)
    return folder


def _write_model(folder: Path, files: dict[str, bytes]) -> None:
    """``model.pt`` then ``model.json`` into ``folder``, each atomically."""
    folder.mkdir(parents=True, exist_ok=True)
    for name in (MODEL_FILE, INFO_FILE):
        atomic_write(folder / name, files[name])


def _make_current(directory: Path, run_id: int, files: dict[str, bytes]) -> None:
    """Make run ``run_id``'s model (already in its folder) the current one: the copies at the top,
    then ``current``. The pointer goes last: until it is replaced, loading follows the previous
    one to a complete model, whatever a crash left of the copies."""
    _keep_unversioned_model(directory, run_id)
    _write_model(directory, files)
    atomic_write(directory / CURRENT_FILE, f"{run_id}\n".encode("ascii"))


def _keep_unversioned_model(directory: Path, run_id: int) -> None:
    """A model-dir written before runs were kept holds its model at the top only: before the
    first completed run replaces it, it moves into its own run folder (its model.json names the
    run), so that it stays loadable by run. A copy that cannot be read is left where it is."""
    if (directory / CURRENT_FILE).exists():
        return
    try:
        legacy = json.loads((directory / INFO_FILE).read_text())
        files = {name: (directory / name).read_bytes() for name in (MODEL_FILE, INFO_FILE)}
        legacy_run = run_id_of(legacy["run_id"])
    except (OSError, ValueError, KeyError, TypeError):
        return
    folder = run_folder(directory, legacy_run)
    if legacy_run == run_id or folder.exists():
        return
    if not legacy.get("saved_at"):  # ordered among the runs by when it was written
        legacy["saved_at"] = (directory / INFO_FILE).stat().st_mtime
        files[INFO_FILE] = (json.dumps(legacy, indent=2) + "\n").encode()
    _write_model(folder, files)
    atomic_write(directory / CURRENT_FILE, f"{legacy_run}\n".encode("ascii"))


def prune_runs(directory: str | Path, keep: int = KEPT_RUNS) -> list[int]:
    """Delete the run folders beyond the ``keep`` latest saves, never the current model's run;
    return the deleted run ids. A smoke test run after run must not fill the site's disk."""
    current = current_run(directory)
    deleted = [run for run in kept_runs(directory)[keep:] if run != current]
    for run in deleted:
        shutil.rmtree(run_folder(directory, run), ignore_errors=True)
    return deleted


def model_folder(directory: str | Path, run: int | str | None = None) -> Path:
    """The folder holding the model to load: run ``run``'s, or by default the current model's
    (the folder ``current`` names; the top of ``directory`` when there is no such pointer, as in
    a model-dir written before runs were kept, or when its run folder was deleted by hand)."""
    directory = Path(directory)
    if run is None:
        current = current_run(directory)
        folder = None if current is None else run_folder(directory, current)
        return folder if folder is not None and (folder / INFO_FILE).is_file() else directory
    folder = run_folder(directory, run)
    if not (folder / INFO_FILE).is_file():
        kept = ", ".join(map(str, kept_runs(directory))) or "none"
        raise FileNotFoundError(f"{directory} keeps no model of run {run_id_of(run)}; kept runs, the latest "
                                f"first: {kept} (current: {current_run(directory)})")
    return folder


def load_site_model(directory: str | Path, device: str | torch.device = "cpu",
                    run: int | str | None = None) -> tuple[FedPACNet, SiteModel]:
    """A model the site saved, in eval mode on ``device``, and its description: the current
    model, or run ``run``'s."""
    folder = model_folder(directory, run)
    try:
        info = SiteModel(**json.loads((folder / INFO_FILE).read_text()))
        state = torch.load(folder / MODEL_FILE, map_location=device, weights_only=True)
    except FileNotFoundError as err:
        raise FileNotFoundError(f"{folder} holds no site model ({MODEL_FILE} + {INFO_FILE}): {err}") from err
    model = FedPACNet(info.image_channels, info.image_size, info.num_classes, info.front_end, info.branches)
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
    probabilities = torch.softmax(model(model_inputs(x, info.front_end)), dim=1).cpu().numpy()
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
    """``fedpac-predict MODEL_DIR IMAGES [--out CSV] [--run RUN_ID]``: one line per image, class
    and confidence, by the site's current model or a kept run's."""
    cli = argparse.ArgumentParser(prog="fedpac-predict", description="Run a site's personalized FedPAC model.")
    cli.add_argument("model_dir", type=Path, help="the SuperNode's model-dir")
    cli.add_argument("images", type=Path, help="a folder of image files, or an .npz file with array x")
    cli.add_argument("--out", type=Path, help="CSV file to write (default: standard output)")
    cli.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    cli.add_argument("--run", metavar="RUN_ID",
                     help=f"the model of this run, one of those kept in MODEL_DIR/{RUNS_DIR}/ (default: the "
                          "current model, the last completed run's)")
    args = cli.parse_args(argv)
    try:
        model, info = load_site_model(args.model_dir, args.device, run=args.run)
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
    print(f"fedpac-predict: {len(names)} images, model of run {info.run_id}, round {info.round} (accuracy "
          f"{100 * info.accuracy:.2f}% on the site's test split)", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
