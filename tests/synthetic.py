"""Label-only image datasets for the partition tests: blank images, the labels that matter."""

from __future__ import annotations

import numpy as np

from common.data import ImageDataset


def labelled_dataset(train_labels: np.ndarray, test_labels: np.ndarray, num_classes: int, name: str = "synthetic",
                     image_shape: tuple[int, int, int] = (28, 28, 1)) -> ImageDataset:
    """An ImageDataset of blank ``image_shape`` images with the given labels."""
    return ImageDataset(
        name=name,
        train_images=np.zeros((len(train_labels), *image_shape), dtype=np.uint8),
        train_labels=train_labels,
        test_images=np.zeros((len(test_labels), *image_shape), dtype=np.uint8),
        test_labels=test_labels,
        num_classes=num_classes,
    )
