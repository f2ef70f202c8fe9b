"""Dataset loaders: embedded MNIST, IDX files, Hugging Face datasets (built locally)."""

import gzip
import struct

import numpy as np
import pytest
import torch

from common.config import parse_run_config
from common.data import (
    check_shape,
    load_client_directory,
    DataError,
    load_dataset,
    load_embedded_mnist,
    load_hf_dataset,
    load_idx_dataset,
    normalization,
    read_idx,
    to_tensors,
)
from common.model import FedPACNet


def _write_idx(path, array, compress):
    header = bytes([0, 0, 0x08, array.ndim]) + b"".join(struct.pack(">I", s) for s in array.shape)
    payload = header + array.astype(np.uint8).tobytes()
    if compress:
        with gzip.open(path, "wb") as stream:
            stream.write(payload)
    else:
        path.write_bytes(payload)


def _idx_folder(tmp_path, compress):
    rng = np.random.default_rng(0)
    arrays = {
        "train-images-idx3-ubyte": rng.integers(0, 256, (40, 28, 28)),
        "train-labels-idx1-ubyte": np.arange(40) % 10,
        "t10k-images-idx3-ubyte": rng.integers(0, 256, (20, 28, 28)),
        "t10k-labels-idx1-ubyte": np.arange(20) % 10,
    }
    for stem, array in arrays.items():
        _write_idx(tmp_path / (stem + (".gz" if compress else "")), array, compress)
    return arrays


def test_embedded_mnist_loads_offline_with_a_fixed_stratified_split():
    data = load_embedded_mnist()
    assert data.train_images.shape == (3500, 28, 28, 1) and data.test_images.shape == (1500, 28, 28, 1)
    assert np.bincount(data.train_labels).tolist() == [350] * 10
    assert np.bincount(data.test_labels).tolist() == [150] * 10
    assert data.train_images.max() == 255 and data.train_images.mean() > 10  # real digits
    again = load_embedded_mnist()
    np.testing.assert_array_equal(data.test_labels, again.test_labels)


@pytest.mark.parametrize("compress", [True, False])
def test_idx_folder_round_trip(tmp_path, compress):
    arrays = _idx_folder(tmp_path, compress)
    data = load_idx_dataset("mnist", tmp_path)
    np.testing.assert_array_equal(data.train_images[..., 0], arrays["train-images-idx3-ubyte"])
    np.testing.assert_array_equal(data.test_labels, arrays["t10k-labels-idx1-ubyte"])
    assert data.num_classes == 10


def test_idx_errors_are_clear(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_idx_dataset("mnist", tmp_path / "missing")
    with pytest.raises(DataError, match="missing train-images"):
        load_idx_dataset("mnist", tmp_path)
    bad = tmp_path / "x.idx"
    bad.write_bytes(b"\x00\x00\x0d\x01\x00\x00\x00\x02ab")
    with pytest.raises(DataError, match="not an unsigned-byte IDX"):
        read_idx(bad)
    truncated = tmp_path / "y.idx"
    truncated.write_bytes(bytes([0, 0, 8, 1]) + struct.pack(">I", 5) + b"abc")
    with pytest.raises(DataError, match="header says"):
        read_idx(truncated)


def test_mnist_from_a_data_dir_through_the_run_config(tmp_path):
    _idx_folder(tmp_path, compress=True)
    data = load_dataset(parse_run_config({"dataset": "mnist", "data-dir": str(tmp_path)}))
    assert data.train_images.shape == (40, 28, 28, 1)
    with pytest.raises(DataError, match="needs data-dir"):
        load_dataset(parse_run_config({"dataset": "mnist"}))


def test_hugging_face_dataset_saved_locally(tmp_path):
    import datasets  # flwr-datasets brings it: a broken install fails here, not skips
    from PIL import Image

    rng = np.random.default_rng(1)

    def split(n):
        images = [Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)) for _ in range(n)]
        return datasets.Dataset.from_dict(
            {"img": images, "label": [i % 10 for i in range(n)]},
            features=datasets.Features({"img": datasets.Image(), "label": datasets.ClassLabel(num_classes=10)}),
        )

    datasets.DatasetDict({"train": split(30), "test": split(10)}).save_to_disk(str(tmp_path / "cifar"))
    data = load_hf_dataset("", str(tmp_path / "cifar"))
    assert data.train_images.shape == (30, 32, 32, 3) and data.train_images.dtype == np.uint8
    assert data.test_labels.tolist() == [i % 10 for i in range(10)]
    cfg = parse_run_config({"dataset": "cifar10", "data-dir": str(tmp_path / "cifar")})
    loaded = load_dataset(cfg)
    x, _ = to_tensors(loaded.train_images[:4], loaded.train_labels[:4], *normalization(loaded.train_images),
                      torch.device("cpu"))
    model = FedPACNet(cfg.image_channels, cfg.image_size, cfg.num_classes)
    assert model(x).shape == (4, 10)
    # the same data under a config that expects grayscale 28x28 images is refused
    with pytest.raises(DataError, match="expects"):
        load_dataset(parse_run_config({"dataset": "hf", "data-dir": str(tmp_path / "cifar")}))


def test_models_have_the_papers_sizes():
    small = FedPACNet(1, 28, 10)
    assert sum(p.numel() for p in small.parameters()) == 117_066
    assert small.extractor(torch.zeros(2, 1, 28, 28)).shape == (2, 128)
    large = FedPACNet(3, 32, 10)
    assert 105_000 < sum(p.numel() for p in large.parameters()) < 112_000
    assert all(k.startswith(("extractor.", "head.")) for k in small.state_dict())


def test_normalized_tensors_have_zero_mean_unit_std():
    data = load_embedded_mnist()
    mean, std = normalization(data.train_images)
    x, y = to_tensors(data.train_images, data.train_labels, mean, std, torch.device("cpu"))
    assert x.shape == (3500, 1, 28, 28) and y.dtype == torch.int64
    assert abs(x.mean().item()) < 1e-3 and abs(x.std().item() - 1) < 1e-3


def _images_and_labels(n, seed, channels=None):
    rng = np.random.default_rng(seed)
    shape = (n, 28, 28) if channels is None else (n, 28, 28, channels)
    return rng.integers(0, 256, shape).astype(np.uint8), np.arange(n) % 10


def test_client_directory_of_npz_files(tmp_path):
    for split, n in (("train", 30), ("test", 12)):
        x, y = _images_and_labels(n, n)
        np.savez(tmp_path / f"{split}.npz", x=x, y=y)
    data = load_client_directory(tmp_path, num_classes=10)
    assert data.train_images.shape == (30, 28, 28, 1) and data.test_images.shape == (12, 28, 28, 1)
    np.testing.assert_array_equal(data.train_labels, np.arange(30) % 10)
    cfg = parse_run_config({})
    assert check_shape(data, cfg) is data


def test_client_directory_of_idx_files(tmp_path):
    _idx_folder(tmp_path, compress=True)
    data = load_client_directory(tmp_path, num_classes=10)
    assert data.train_images.shape == (40, 28, 28, 1) and len(data.test_labels) == 20


def test_client_directory_of_image_folders(tmp_path):
    from PIL import Image

    x, y = _images_and_labels(14, 3)
    for i, (image, label) in enumerate(zip(x, y)):
        split = "train" if i < 10 else "test"
        (tmp_path / split / str(label)).mkdir(parents=True, exist_ok=True)
        Image.fromarray(image).save(tmp_path / split / str(label) / f"{i}.png")
    data = load_client_directory(tmp_path, num_classes=10)
    assert data.train_images.shape == (10, 28, 28, 1) and len(data.test_labels) == 4
    order = np.argsort(data.train_labels, kind="stable")
    np.testing.assert_array_equal(data.train_images[order][:, :, :, 0], x[:10][np.argsort(y[:10], kind="stable")])


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda d: None, "holds none of"),
        (lambda d: [np.savez(d / f"{s}.npz", x=np.zeros((5, 28, 28), np.float32), y=np.zeros(5, int))
                    for s in ("train", "test")], "must be uint8"),
        (lambda d: [np.savez(d / f"{s}.npz", x=np.zeros((5, 28, 28), np.uint8), y=np.full(5, 12))
                    for s in ("train", "test")], "labels outside"),
        (lambda d: [np.savez(d / f"{s}.npz", x=np.zeros((n, 28, 28), np.uint8), y=np.zeros(n, int))
                    for s, n in (("train", 5), ("test", 0))], "must not be empty"),
        (lambda d: [np.savez(d / f"{s}.npz", images=np.zeros((5, 28, 28), np.uint8)) for s in ("train", "test")],
         "no label array"),
    ],
)
def test_client_directory_errors_are_clear(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(DataError, match=message):
        load_client_directory(tmp_path, num_classes=10)


def test_client_directory_must_fit_the_model(tmp_path):
    for split in ("train", "test"):
        np.savez(tmp_path / f"{split}.npz", x=np.zeros((4, 32, 32, 3), np.uint8), y=np.zeros(4, int))
    with pytest.raises(DataError, match="run config expects"):
        check_shape(load_client_directory(tmp_path, 10), parse_run_config({}))
    with pytest.raises(DataError, match="does not exist"):
        load_client_directory(tmp_path / "missing", 10)
