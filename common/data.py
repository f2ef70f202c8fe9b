"""Image datasets as plain arrays: the embedded default, local IDX files, Hugging Face datasets,
and a deployed client's own data directory (IDX, .npz or image folders).

Every loader returns an :class:`ImageDataset` of uint8 NHWC images with int64 labels and the
dataset's own train/test split. Partitioning (``common.partition``) and tensor conversion
(``to_tensors``) work on that one shape, whatever the source.
"""

from __future__ import annotations

import gzip
import hashlib
import importlib.resources
import lzma
import zipfile
import zlib
from dataclasses import dataclass
from functools import cached_property, lru_cache
from pathlib import Path

import numpy as np
import torch

from common.config import SUPER_LABEL_SIZE, FedPACConfig, configured_normalization, dataset_classes

FASHION_MNIST_DIR = "/usr/share/datasets/fashion-mnist"
CIFAR10_HF_REPO = "uoft-cs/cifar10"
# Class-stratified split of the embedded 5,000 images (500 per class) into train and test pools.
EMBEDDED_TEST_PER_CLASS = 150
# The embedded MNIST subset: package data of fedpac_data (see its README.md), a (5000, 785) uint8
# table, xz-compressed; the digest is the decompressed table's, so a damaged copy is an error.
EMBEDDED_MNIST_PACKAGE = "fedpac_data"
EMBEDDED_MNIST_FILE = "mnist_5k.u8.xz"
EMBEDDED_MNIST_SHAPE = (5000, 785)
EMBEDDED_MNIST_SHA256 = "1b845fda528288bf79346626fdf2fff6549f0170890dc9174bc1ef609807bbfa"
IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".bmp")
# Per-channel (mean, std) of each named dataset's training images, in [0, 1] units. Every client
# of a run normalizes with the same values, whether it holds a slice of the dataset (simulation)
# or its own data folder (deployment): a site's own statistics would put its features on
# another scale than its peers' and shift the centroids, h_i and V_i the server compares.
# Values: `normalization(train_images)` of the whole training set (MNIST: its 60,000 images).
DATASET_NORMALIZATION: dict[str, tuple[tuple[float, ...], tuple[float, ...]]] = {
    "mnist-5k": ((0.13102469559252272,), (0.3081915009877465,)),
    "fashion-mnist": ((0.2860405969887955,), (0.3530242445149226,)),
    "mnist": ((0.13066047740239506,), (0.3081078038564622,)),
    "cifar10": ((0.4913996786152028, 0.4821584083946076, 0.44653091444546616),
                (0.24703223246328202, 0.24348512800005568, 0.26158784172796473)),
}
NORMALIZATION_EPSILON = 1e-8  # added to the std before dividing
_IDX_FILES = {
    "train_images": "train-images-idx3-ubyte",
    "train_labels": "train-labels-idx1-ubyte",
    "test_images": "t10k-images-idx3-ubyte",
    "test_labels": "t10k-labels-idx1-ubyte",
}


class DataError(ValueError):
    """A dataset could not be found or is not in the expected format."""


@dataclass(frozen=True)
class ImageDataset:
    """A labelled image dataset with its train/test split, as NHWC uint8 arrays."""

    name: str
    train_images: np.ndarray
    train_labels: np.ndarray
    test_images: np.ndarray
    test_labels: np.ndarray
    num_classes: int

    def __post_init__(self) -> None:
        for split in ("train", "test"):
            images, labels = getattr(self, f"{split}_images"), getattr(self, f"{split}_labels")
            if images.ndim != 4 or images.dtype != np.uint8:
                raise DataError(f"{self.name}: {split} images must be uint8 NHWC, got "
                                f"{images.dtype} {images.shape}")
            if len(images) != len(labels):
                raise DataError(f"{self.name}: {len(images)} {split} images but "
                                f"{len(labels)} labels")
            if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DataError(f"{self.name}: {split} labels outside [0, {self.num_classes})")

    @cached_property
    def train_normalization(self) -> tuple[np.ndarray, np.ndarray]:
        """Mean and std of the training images (computed once per loaded dataset)."""
        return normalization(self.train_images)

    @property
    def image_shape(self) -> tuple[int, int, int]:
        """(height, width, channels)."""
        return tuple(self.train_images.shape[1:])


def run_normalization(cfg: FedPACConfig, dataset: ImageDataset | None = None) -> tuple[np.ndarray, np.ndarray]:
    """The one (mean, std) of a run: the run config's, else the named dataset's constants, else
    (a generic Hugging Face dataset) the statistics of the run's whole training set.

    ``dataset`` is the run's dataset where this process has it (simulation, demos); a deployed
    site with its own data folder passes None, and then a dataset without constants needs the
    values in the run config: a statistic of one site's data is never used.
    """
    configured = configured_normalization(cfg)
    if configured is None and cfg.dataset in DATASET_NORMALIZATION:
        configured = DATASET_NORMALIZATION[cfg.dataset]
    if configured is not None:
        mean, std = configured
        return np.asarray(mean, dtype=np.float64), np.asarray(std, dtype=np.float64)
    if dataset is None:
        raise DataError(
            f"dataset '{cfg.dataset}' has no fixed normalization: set run config keys normalize-mean "
            "and normalize-std (one value per channel, e.g. the training set's) so that every site "
            "normalizes its data alike"
        )
    return dataset.train_normalization


def embedded_mnist_table() -> np.ndarray:
    """The embedded MNIST subset as one (5000, 785) uint8 table: 784 pixels, then the label.

    Read from the installed project's ``fedpac_data`` package, not from the app bundle: the FAB
    carries text files only, so a site needs the project installed to use ``mnist-5k``.
    """
    try:
        packed = importlib.resources.files(EMBEDDED_MNIST_PACKAGE).joinpath(EMBEDDED_MNIST_FILE).read_bytes()
    except (ImportError, OSError) as err:
        raise DataError(
            f"dataset 'mnist-5k': cannot read {EMBEDDED_MNIST_PACKAGE}/{EMBEDDED_MNIST_FILE} ({_reason(err)}); "
            "it is installed with the project (pip install -e . or make install): install the project "
            "on this machine, or give the site its own data (node config data-path)"
        ) from err
    try:
        raw = lzma.decompress(packed)
    except lzma.LZMAError as err:
        raise DataError(f"dataset 'mnist-5k': {EMBEDDED_MNIST_FILE} is damaged ({_reason(err)})") from err
    if hashlib.sha256(raw).hexdigest() != EMBEDDED_MNIST_SHA256:
        raise DataError(f"dataset 'mnist-5k': {EMBEDDED_MNIST_FILE} does not hold the expected images "
                        "(SHA-256 mismatch): reinstall the project")
    return np.frombuffer(raw, dtype=np.uint8).reshape(EMBEDDED_MNIST_SHAPE)


def load_embedded_mnist() -> ImageDataset:
    """MNIST, 5,000 images (500 per class) shipped with the project: loads offline."""
    table = embedded_mnist_table()
    labels = table[:, -1].astype(np.int64)  # 784 pixel columns, then the label
    images = table[:, :-1].reshape(-1, 28, 28, 1)
    # A fixed split (independent of the run's seed), so every run tests on the same images.
    rng = np.random.default_rng(0)
    test_mask = np.zeros(len(labels), dtype=bool)
    for k in range(10):
        members = np.flatnonzero(labels == k)
        test_mask[rng.choice(members, EMBEDDED_TEST_PER_CLASS, replace=False)] = True
    return ImageDataset(
        name="mnist-5k",
        train_images=images[~test_mask],
        train_labels=labels[~test_mask],
        test_images=images[test_mask],
        test_labels=labels[test_mask],
        num_classes=10,
    )


def read_idx(path: Path) -> np.ndarray:
    """Read one IDX file (optionally gzipped): the format of MNIST and Fashion-MNIST.

    An unreadable, empty, truncated or non-unsigned-byte file raises :class:`DataError` naming it.
    """
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as stream:
            raw = stream.read()
    except (OSError, EOFError, zlib.error) as err:  # gzip.BadGzipFile is an OSError
        raise DataError(f"{path}: cannot read it ({_reason(err)})") from err
    if not raw:
        raise DataError(f"{path}: the file is empty (expected an IDX file)")
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] != 0x08:
        kind = f" (type code 0x{raw[2]:02x})" if len(raw) >= 4 and raw[:2] == b"\0\0" else ""
        raise DataError(f"{path} is not an unsigned-byte IDX file{kind}: expected the header 00 00 08 <ndim>")
    ndim = raw[3]
    header_end = 4 + 4 * ndim
    if ndim == 0:
        raise DataError(f"{path}: the IDX header declares 0 dimensions")
    if len(raw) < header_end:
        raise DataError(f"{path}: truncated IDX header ({len(raw)} bytes, {ndim} dimensions need {header_end})")
    shape = tuple(int.from_bytes(raw[4 + 4 * i : 8 + 4 * i], "big") for i in range(ndim))
    data = np.frombuffer(raw, dtype=np.uint8, offset=header_end)
    if data.size != int(np.prod(shape)):
        raise DataError(f"{path}: header says {shape} but the file holds {data.size} bytes")
    return data.reshape(shape)


def _reason(err: BaseException) -> str:
    """An exception as a short reason: its type and message (strerror for OS errors)."""
    if isinstance(err, OSError) and err.strerror:
        return err.strerror
    return f"{type(err).__name__}: {err}" if str(err) else type(err).__name__


def _checked_split(  # pylint: disable=too-many-arguments
    images: np.ndarray,
    labels: np.ndarray,
    num_classes: int | None,
    images_source: object,
    labels_source: object | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """``images`` as uint8 NHWC and ``labels`` as int64 after checking shape, dtype, length and
    label range; a DataError names the file (``images_source``/``labels_source``) at fault."""
    labels_source = images_source if labels_source is None else labels_source
    if images.dtype != np.uint8:
        raise DataError(f"{images_source}: images must be uint8 (0..255), got {images.dtype}")
    if images.ndim not in (3, 4):
        raise DataError(f"{images_source}: images must be an array of shape (N, H, W) or (N, H, W, C), "
                        f"got shape {images.shape}")
    if images.ndim == 3:
        images = images[..., None]
    if not np.issubdtype(labels.dtype, np.integer):
        raise DataError(f"{labels_source}: labels must be integers (class indices), got {labels.dtype}")
    if labels.ndim != 1:
        raise DataError(f"{labels_source}: labels must be a 1-D array (one class index per image), "
                        f"got shape {labels.shape}")
    if len(images) == 0:
        raise DataError(f"{images_source}: no images (the train and test splits must not be empty)")
    if 0 in images.shape[1:]:
        raise DataError(f"{images_source}: images have an empty dimension, shape {images.shape}")
    if len(images) != len(labels):
        where = images_source if labels_source == images_source else f"{images_source} and {labels_source}"
        raise DataError(f"{where}: {len(images)} images but {len(labels)} labels")
    low, high = int(labels.min()), int(labels.max())
    if low < 0 or (num_classes is not None and high >= num_classes):
        bound = "" if num_classes is None else f", num-classes {num_classes}"
        upper = "" if num_classes is None else str(num_classes)
        raise DataError(f"{labels_source}: labels outside [0, {upper}){bound}: found labels {low}..{high}")
    return images, labels.astype(np.int64)


def _find_idx(directory: Path, stem: str) -> Path:
    for name in (f"{stem}.gz", stem):
        if (directory / name).is_file():
            return directory / name
    raise DataError(f"{directory}: missing {stem}[.gz]")


def _load_idx_split(directory: Path, split: str, num_classes: int | None) -> tuple[np.ndarray, np.ndarray]:
    """One split ("train" or "test") of the IDX files in ``directory``, checked."""
    images_path = _find_idx(directory, _IDX_FILES[f"{split}_images"])
    labels_path = _find_idx(directory, _IDX_FILES[f"{split}_labels"])
    images, labels = read_idx(images_path), read_idx(labels_path)
    if images.ndim != 3:
        raise DataError(f"{images_path}: an IDX image file must have 3 dimensions (N, H, W), got {images.shape}")
    return _checked_split(images, labels, num_classes, images_path, labels_path)


def load_idx_dataset(name: str, directory: str | Path, num_classes: int | None = None) -> ImageDataset:
    """MNIST-style IDX files in ``directory`` (train-/t10k- images and labels, .gz or raw).

    ``num_classes``: the number of classes (labels must be below it); None: one more than the
    largest training label.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"dataset '{name}': data directory {directory} does not exist")
    train = _load_idx_split(directory, "train", num_classes)
    test = _load_idx_split(directory, "test", num_classes)
    if num_classes is None:
        num_classes = int(train[1].max()) + 1
        if test[1].max() >= num_classes:
            labels_path = _find_idx(directory, _IDX_FILES["test_labels"])
            raise DataError(f"{labels_path}: test label {int(test[1].max())} is not among the training "
                            f"labels 0..{num_classes - 1}")
    return ImageDataset(name, *train, *test, num_classes=num_classes)


def _first_column(columns: list[str], candidates: tuple[str, ...], what: str) -> str:
    for name in candidates:
        if name in columns:
            return name
    raise DataError(f"no {what} column among {columns}; expected one of {candidates}")


def from_hf_dataset_dict(name: str, dataset_dict) -> ImageDataset:  # noqa: ANN001
    """Convert a Hugging Face ``DatasetDict`` with train and test splits into arrays."""
    missing = {"train", "test"} - set(dataset_dict)
    if missing:
        raise DataError(f"dataset '{name}' has no {sorted(missing)} split(s)")
    columns = dataset_dict["train"].column_names
    image_key = _first_column(columns, ("image", "img", "pixel_values"), "image")
    label_key = _first_column(columns, ("label", "labels", "fine_label"), "label")
    splits = {}
    for split in ("train", "test"):
        data = dataset_dict[split]
        images = np.stack([np.asarray(image, dtype=np.uint8) for image in data[image_key]])
        if images.ndim == 3:
            images = images[..., None]
        splits[split] = (images, np.asarray(data[label_key], dtype=np.int64))
    return ImageDataset(
        name=name,
        train_images=splits["train"][0],
        train_labels=splits["train"][1],
        test_images=splits["test"][0],
        test_labels=splits["test"][1],
        num_classes=int(max(splits["train"][1].max(), splits["test"][1].max())) + 1,
    )


def load_hf_dataset(repo: str, data_dir: str = "") -> ImageDataset:
    """A Hugging Face image dataset: from ``data_dir`` (``save_to_disk``) or from the hub."""
    import datasets  # pylint: disable=import-outside-toplevel

    if data_dir:
        if not Path(data_dir).is_dir():
            raise DataError(f"Hugging Face dataset directory {data_dir} does not exist")
        dataset_dict = datasets.load_from_disk(data_dir)
    else:
        dataset_dict = datasets.load_dataset(repo)
    return from_hf_dataset_dict(repo or data_dir, dataset_dict)


@lru_cache(maxsize=2)
def _load_cached(dataset: str, data_dir: str, hf_repo: str) -> ImageDataset:
    if dataset == "mnist-5k":
        return load_embedded_mnist()
    if dataset == "fashion-mnist":
        return load_idx_dataset(dataset, data_dir or FASHION_MNIST_DIR)
    if dataset == "mnist":
        if not data_dir:
            raise DataError("dataset 'mnist' needs data-dir: a folder of MNIST IDX files")
        return load_idx_dataset(dataset, data_dir)
    if dataset == "cifar10":
        return load_hf_dataset(hf_repo or CIFAR10_HF_REPO, data_dir)
    return load_hf_dataset(hf_repo, data_dir)


def _load_npz_split(path: Path, num_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Images and labels of one ``.npz`` split; a DataError names ``path`` and what is wrong."""
    if not path.is_file():
        raise DataError(f"{path} does not exist: a client data folder with train.npz needs test.npz too")
    try:
        with open(path, "rb") as stream:
            magic = stream.read(6)
    except OSError as err:
        raise DataError(f"{path}: cannot read it ({_reason(err)})") from err
    if not magic:
        raise DataError(f"{path}: the file is empty (expected an .npz archive of images and labels)")
    if not magic.startswith((b"PK\x03\x04", b"PK\x05\x06", b"\x93NUMPY")):
        raise DataError(f"{path}: not an .npz archive (no zip header; write it with numpy.savez)")
    try:
        arrays = np.load(path, allow_pickle=False)
        if not isinstance(arrays, np.lib.npyio.NpzFile):
            raise DataError(f"{path}: a single array (.npy), not an .npz archive of images and labels")
        with arrays:
            image_key = _first_column(list(arrays.files), ("x", "images", "image"), f"image array in {path}")
            label_key = _first_column(list(arrays.files), ("y", "labels", "label"), f"label array in {path}")
            images, labels = arrays[image_key], arrays[label_key]
    except DataError:
        raise
    except (OSError, EOFError, ValueError, zipfile.BadZipFile, zlib.error) as err:
        raise DataError(f"{path}: a corrupt or truncated .npz archive ({_reason(err)})") from err
    return _checked_split(images, labels, num_classes, path)


def _load_image_folder(directory: Path, num_classes: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    from PIL import Image  # pylint: disable=import-outside-toplevel

    if not directory.is_dir():
        raise DataError(f"{directory} does not exist: a client data folder with train/ image folders "
                        "needs test/ too")
    images, labels, files = [], [], []
    for class_dir in sorted(d for d in directory.iterdir() if d.is_dir()):
        if not class_dir.name.isdigit():
            raise DataError(f"{class_dir}: class folders must be named by the class index (0, 1, ...)")
        label = int(class_dir.name)
        if num_classes is not None and label >= num_classes:
            raise DataError(f"{class_dir}: class {label} is outside [0, {num_classes}), num-classes {num_classes}")
        for file in sorted(f for f in class_dir.iterdir() if f.suffix.lower() in IMAGE_SUFFIXES):
            images.append(_read_image(file, Image))
            labels.append(label)
            files.append(file)
    if not images:
        raise DataError(f"{directory}: no {'/'.join(IMAGE_SUFFIXES)} images in class folders")
    for file, image in zip(files, images):
        if image.shape != images[0].shape:
            raise DataError(f"{file}: image of shape {image.shape} but {files[0]} has {images[0].shape}: "
                            "every image must have the same size and channels")
    stacked = np.stack(images)
    return _checked_split(stacked, np.asarray(labels, dtype=np.int64), num_classes, directory)


def _read_image(file: Path, image_module) -> np.ndarray:  # noqa: ANN001
    """One image file as a uint8 HW or HWC array (8-bit grayscale or RGB only)."""
    try:
        with image_module.open(file) as image:
            mode = image.mode
            if mode == "1":  # black and white: 0 and 255
                image = image.convert("L")
            elif mode not in ("L", "RGB"):
                raise DataError(f"{file}: {mode} image; save it as 8-bit grayscale (L) or RGB")
            return np.asarray(image, dtype=np.uint8)
    except DataError:
        raise
    except (OSError, EOFError, ValueError, SyntaxError) as err:  # PIL.UnidentifiedImageError: OSError
        raise DataError(f"{file}: not a readable image ({_reason(err)})") from err


def load_client_directory(directory: str | Path, num_classes: int) -> ImageDataset:
    """A deployed client's own data: ``directory`` holds its train and test split as
    ``train.npz``/``test.npz`` (arrays ``x`` uint8 NHW[C], ``y`` labels), MNIST-style IDX files, or
    image folders ``train/<class>/*.png`` and ``test/<class>/*.png``.

    Unreadable, corrupt or empty files, wrong shapes or dtypes, and labels outside
    ``[0, num_classes)`` raise :class:`DataError` naming the file and what is wrong.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"client data directory {directory} does not exist")
    if (directory / "train.npz").is_file():
        train, test = (_load_npz_split(directory / f"{split}.npz", num_classes) for split in ("train", "test"))
    elif (directory / "train").is_dir():
        train, test = (_load_image_folder(directory / split, num_classes) for split in ("train", "test"))
    elif any(directory.glob(f"{_IDX_FILES['train_images']}*")):
        train, test = (_load_idx_split(directory, split, num_classes) for split in ("train", "test"))
    else:
        raise DataError(
            f"client data directory {directory} holds none of: train.npz + test.npz, "
            "train/ + test/ image folders, MNIST-style IDX files"
        )
    if len(train[1]) == 0 or len(test[1]) == 0:
        raise DataError(f"client data directory {directory}: the train and test splits must not be empty")
    return ImageDataset(str(directory), *train, *test, num_classes=num_classes)


def check_shape(data: ImageDataset, cfg: FedPACConfig) -> ImageDataset:
    """``data`` if its images and classes fit the model the run config builds, else a DataError."""
    expected = (cfg.image_size, cfg.image_size, cfg.image_channels)
    if data.image_shape != expected or data.num_classes > dataset_classes(cfg):
        raise DataError(
            f"dataset '{data.name}' has {data.image_shape} images and {data.num_classes} classes; "
            f"the run config expects {expected} and at most {dataset_classes(cfg)} classes"
        )
    return data


def int_column(dataset, name: str) -> np.ndarray:  # noqa: ANN001  (a datasets.Dataset)
    """Integer column ``name`` (labels, row indices) of a Hugging Face dataset as one int64 array.
    Through Arrow: ``dataset[name]`` yields its rows one by one (a client's partition of 60 rows
    took 3.4 ms, through Arrow 0.35 ms, paid for every client when a process builds them all)."""
    return np.array(dataset.with_format("arrow")[name].to_numpy(), dtype=np.int64)


def super_labels(labels: np.ndarray) -> np.ndarray:
    """The super-label of each class (partition ``super-labels``): a fixed grouping of
    SUPER_LABEL_SIZE consecutive classes, {0, 1} -> 0, {2, 3} -> 1, ... Fixed rather than seeded,
    so every run and every client reads a label the same way."""
    return np.asarray(labels, dtype=np.int64) // SUPER_LABEL_SIZE


def load_source_dataset(cfg: FedPACConfig) -> ImageDataset:
    """The dataset a run config names, with the dataset's own classes (what partitioners split),
    checked against the model shape the config implies. Cached per process."""
    return check_shape(_load_cached(cfg.dataset, cfg.data_dir, cfg.hf_repo), cfg)


def load_dataset(cfg: FedPACConfig) -> ImageDataset:
    """The dataset a run config names, labelled as the run's task: its own classes, except under
    ``super-labels``, whose task (and the whole test set of the generalized accuracy) is the
    super-label. The images are the cached arrays of :func:`load_source_dataset`.
    """
    data = load_source_dataset(cfg)
    if cfg.partition != "super-labels":
        return data
    return _super_labelled(cfg.dataset, cfg.data_dir, cfg.hf_repo, cfg.num_classes)


@lru_cache(maxsize=2)
def _super_labelled(dataset: str, data_dir: str, hf_repo: str, num_super_labels: int) -> ImageDataset:
    """The cached dataset with super-labels, one view per process (its normalization statistics
    are computed once, like the dataset's own)."""
    data = _load_cached(dataset, data_dir, hf_repo)
    if data.num_classes != num_super_labels * SUPER_LABEL_SIZE:
        raise DataError(
            f"partition 'super-labels' groups {num_super_labels * SUPER_LABEL_SIZE} classes into "
            f"{num_super_labels} super-labels of {SUPER_LABEL_SIZE}, but dataset '{data.name}' has "
            f"{data.num_classes} classes"
        )
    return ImageDataset(data.name, data.train_images, super_labels(data.train_labels), data.test_images,
                        super_labels(data.test_labels), num_classes=num_super_labels)


def normalization(images: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Per-channel mean and std of uint8 NHWC images, in [0, 1] units."""
    pixels = images.reshape(-1, images.shape[-1])
    # reductions in float64 without a float64 copy of the whole dataset
    mean = pixels.mean(axis=0, dtype=np.float64)
    std = pixels.std(axis=0, dtype=np.float64)
    return mean / 255.0, std / 255.0


def to_tensors(
    images: np.ndarray,
    labels: np.ndarray,
    mean: np.ndarray,
    std: np.ndarray,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Normalized NCHW float32 images and int64 labels, placed on ``device`` once."""
    x = torch.from_numpy(np.ascontiguousarray(images)).to(device)
    x = x.permute(0, 3, 1, 2).float().div_(255.0)
    mean_t = torch.as_tensor(mean, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    std_t = torch.as_tensor(std + NORMALIZATION_EPSILON, dtype=torch.float32, device=device).view(1, -1, 1, 1)
    x = ((x - mean_t) / std_t).contiguous()
    y = torch.as_tensor(labels, dtype=torch.int64, device=device)
    return x, y
