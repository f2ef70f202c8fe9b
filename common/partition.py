"""Client partitions: the paper's scheme (Appendix B.2), concept shift, FedCCFA's and pFedVEM's
schemes (``common.class_wise_partition``), and flwr-datasets' own.

All partitioners are flwr-datasets ``Partitioner`` subclasses over a ``datasets.Dataset`` with a
``label`` column (images stay in numpy; the partitioner only chooses indices, carried in an
``index`` column). A client's test split is drawn from the dataset's test pool with the same
label proportions as its training partition, whichever partitioner made that partition, except
under FedCCFA's ``dirichlet-min`` scheme (:class:`MinimumDirichletPartitioner`), which partitions
the whole test pool with the same per-class Dirichlet proportions as the training set, and under
pFedVEM's schemes (:class:`ClassChunkPartitioner`: ``vem-pairs``, ``super-labels``), where a
client's test set is the whole test set of each class it holds, as in the authors' code.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import datasets
import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner, Partitioner, PathologicalPartitioner

from common.class_wise_partition import (
    ClassChunkPartitioner,
    ComplementaryPairsPartitioner,
    MinimumDirichletPartitioner,
    SuperLabelPartitioner,
    proportional_counts,
)
from common.config import FedPACConfig, dataset_classes
from common.data import DataError, ImageDataset, int_column

# Partitioning selects a few hundred rows per client; a progress bar per call is only noise.
datasets.disable_progress_bars()

EMNIST_GROUPS = (tuple(range(10)), tuple(range(10, 36)), tuple(range(36, 62)))


def dominant_class_groups(num_classes: int) -> tuple[tuple[int, ...], ...]:
    """The paper's client groups and their dominant classes.

    10 classes: {0,1,2}, {2,3,4}, {4,5,6}, {6,7,8}, {8,9,0}; 62 classes (EMNIST): digits, upper
    case, lower case. Any other K continues the 10-class pattern: group g dominates classes
    2g, 2g+1, 2g+2 (mod K).
    """
    if num_classes == 62:
        return EMNIST_GROUPS
    return tuple(
        tuple(sorted({(2 * g + j) % num_classes for j in range(3)}))
        for g in range(max(1, num_classes // 2))
    )


def split_evenly(total: int, classes: tuple[int, ...], num_classes: int, rng: np.random.Generator) -> np.ndarray:
    """Spread ``total`` samples over ``classes`` as evenly as integers allow; random remainder."""
    counts = np.zeros(num_classes, dtype=np.int64)
    base, remainder = divmod(total, len(classes))
    counts[list(classes)] = base
    counts[rng.choice(classes, size=remainder, replace=False)] += 1
    return counts


class ClassPools:
    """Per-class shuffled index pools, handed out in turn so clients overlap only when they must.

    The paper's 100-client Fashion-MNIST setting asks for more samples of a dominant class than
    the dataset has, so clients then share samples; within one client every index is distinct.
    """

    def __init__(self, labels: np.ndarray, num_classes: int, rng: np.random.Generator) -> None:
        self._pools = [rng.permutation(np.flatnonzero(labels == k)) for k in range(num_classes)]
        self._cursors = [0] * num_classes

    def take(self, class_id: int, count: int) -> np.ndarray:
        pool = self._pools[class_id]
        if count > len(pool):
            raise DataError(
                f"a client needs {count} samples of class {class_id} but the dataset has only "
                f"{len(pool)}: lower samples-per-client or test-samples-per-client"
            )
        start = self._cursors[class_id]
        taken = np.take(pool, np.arange(start, start + count), mode="wrap")
        self._cursors[class_id] = (start + count) % len(pool)
        return taken


def _labels_dataset(labels: np.ndarray) -> Dataset:
    return Dataset.from_dict({"label": labels, "index": np.arange(len(labels))})


class FedPACPartitioner(Partitioner):
    """The paper's label-skew scheme: s % of each client's samples uniform over all classes,
    the rest from its group's dominant classes (client i is in group i mod #groups);
    every client gets the same number of samples.
    """

    def __init__(  # pylint: disable=too-many-arguments
        self,
        num_partitions: int,
        num_classes: int,
        samples_per_partition: int,
        uniform_share: float,
        seed: int = 0,
        groups: tuple[tuple[int, ...], ...] | None = None,
    ) -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self.num_classes = num_classes
        self.samples_per_partition = samples_per_partition
        self.uniform_share = uniform_share
        self.seed = seed
        self.groups = groups or dominant_class_groups(num_classes)
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def group_of(self, partition_id: int) -> int:
        return partition_id % len(self.groups)

    def class_counts(self, partition_id: int) -> np.ndarray:
        """The exact number of samples of each class that ``partition_id`` receives."""
        rng = np.random.default_rng([self.seed, partition_id])
        n_uniform = round(self.samples_per_partition * self.uniform_share / 100.0)
        all_classes = tuple(range(self.num_classes))
        dominant = self.groups[self.group_of(partition_id)]
        return split_evenly(n_uniform, all_classes, self.num_classes, rng) + split_evenly(
            self.samples_per_partition - n_uniform, dominant, self.num_classes, rng
        )

    def _partition_indices(self) -> list[np.ndarray]:
        if self._indices is None:
            labels = int_column(self.dataset, "label")
            pools = ClassPools(labels, self.num_classes, np.random.default_rng(self.seed))
            self._indices = [
                np.concatenate(
                    [pools.take(k, int(c)) for k, c in enumerate(self.class_counts(pid)) if c > 0]
                )
                for pid in range(self.num_partitions)
            ]
        return self._indices

    def load_partition(self, partition_id: int) -> Dataset:
        if not 0 <= partition_id < self.num_partitions:
            raise ValueError(f"partition-id {partition_id} outside [0, {self.num_partitions})")
        return self.dataset.select(self._partition_indices()[partition_id])


class ConceptShiftPartitioner(Partitioner):
    """Concept shift (Table 3): another partitioner's partitions, relabeled per group.

    Group g (partition i is in group i mod ``num_groups``) maps every label y to
    ``permutations[g][y]``, a fixed permutation drawn from the seed.
    """

    def __init__(self, base: Partitioner, num_classes: int, num_groups: int, seed: int = 0) -> None:
        super().__init__()
        self.base = base
        rng = np.random.default_rng([seed, 1])
        self.permutations = np.stack([rng.permutation(num_classes) for _ in range(num_groups)])

    @property
    def num_partitions(self) -> int:
        return self.base.num_partitions

    @Partitioner.dataset.setter
    def dataset(self, value: Dataset) -> None:
        Partitioner.dataset.fset(self, value)
        self.base.dataset = value

    def relabel(self, partition_id: int, labels: np.ndarray) -> np.ndarray:
        return self.permutations[partition_id % len(self.permutations)][labels]

    def load_partition(self, partition_id: int) -> Dataset:
        part = self.base.load_partition(partition_id)
        relabeled = self.relabel(partition_id, int_column(part, "label"))
        return part.remove_columns("label").add_column("label", relabeled)


@dataclass(frozen=True)
class ClientSplit:
    """Indices into the dataset's train and test pools, and labels after any relabeling."""

    train_indices: np.ndarray
    train_labels: np.ndarray
    test_indices: np.ndarray
    test_labels: np.ndarray


def build_partitioner(cfg: FedPACConfig, num_partitions: int) -> Partitioner:
    """The partitioner the run config names, for ``num_partitions`` clients."""
    if cfg.partition in ("fedpac", "concept-shift"):
        base = FedPACPartitioner(
            num_partitions, cfg.num_classes, cfg.samples_per_client, cfg.uniform_share, cfg.seed
        )
        if cfg.partition == "fedpac":
            return base
        return ConceptShiftPartitioner(base, cfg.num_classes, len(base.groups), cfg.seed)
    if cfg.partition == "vem-pairs":
        return ComplementaryPairsPartitioner(num_partitions, dataset_classes(cfg), cfg.seed,
                                             cfg.class_train_samples, cfg.class_test_samples)
    if cfg.partition == "super-labels":
        return SuperLabelPartitioner(num_partitions, dataset_classes(cfg), cfg.seed,
                                     cfg.class_train_samples, cfg.class_test_samples)
    if cfg.partition == "dirichlet-min":
        return MinimumDirichletPartitioner(
            num_partitions, cfg.num_classes, cfg.dirichlet_alpha, cfg.min_train_per_class, cfg.seed
        )
    if cfg.partition == "dirichlet":
        return DirichletPartitioner(
            num_partitions, "label", cfg.dirichlet_alpha, self_balancing=True, seed=cfg.seed
        )
    return PathologicalPartitioner(
        num_partitions, "label", cfg.pathological_classes, class_assignment_mode="deterministic",
        seed=cfg.seed,
    )


def split_clients(
    data: ImageDataset,
    partitioner: Partitioner,
    test_samples_per_client: int,
    seed: int,
    min_test_per_class: int = 2,
) -> list[ClientSplit]:
    """Every client's train partition and a test split with the same label distribution.

    Test samples come from the dataset's test pool, drawn per class in the proportions of the
    client's *original* training labels, so concept shift relabels test data the same way.
    Under a :class:`MinimumDirichletPartitioner` the whole test pool is partitioned instead, by
    the same scheme and seed with ``min_test_per_class`` of every class per client (so the
    Dirichlet shares match the training partition's); under a :class:`ClassChunkPartitioner` a
    client's test set is the whole test set of each class it holds, relabelled as its training
    data. ``test_samples_per_client`` is unused in both.
    """
    partitioner.dataset = _labels_dataset(data.train_labels)
    test_partitioner = None
    if isinstance(partitioner, MinimumDirichletPartitioner):
        test_partitioner = MinimumDirichletPartitioner(
            partitioner.num_partitions, partitioner.num_classes, partitioner.alpha,
            min_test_per_class, partitioner.seed,
        )
        test_partitioner.dataset = _labels_dataset(data.test_labels)
    pools = ClassPools(data.test_labels, data.num_classes, np.random.default_rng([seed, 2]))
    splits = []
    for pid in range(partitioner.num_partitions):
        part = partitioner.load_partition(pid)
        train_indices = int_column(part, "index")
        if len(train_indices) == 0:
            raise DataError(f"partition {pid} is empty: fewer samples than clients need")
        if isinstance(partitioner, ClassChunkPartitioner):
            test_indices = partitioner.test_rows(pid, data.test_labels)
        elif test_partitioner is not None:
            try:
                test_indices = test_partitioner.partition_rows(pid)
            except DataError as err:
                raise DataError(f"test pool: {err}") from err
        else:
            original = data.train_labels[train_indices]
            counts = proportional_counts(np.bincount(original, minlength=data.num_classes),
                                         test_samples_per_client)
            test_indices = np.concatenate(
                [pools.take(k, int(c)) for k, c in enumerate(counts) if c > 0]
            )
        test_labels = data.test_labels[test_indices]
        if isinstance(partitioner, (ConceptShiftPartitioner, ClassChunkPartitioner)):
            test_labels = partitioner.relabel(pid, test_labels)
        splits.append(
            ClientSplit(
                train_indices=train_indices,
                train_labels=int_column(part, "label"),
                test_indices=test_indices,
                test_labels=test_labels,
            )
        )
    return splits


@lru_cache(maxsize=4)
def _cached_splits(cfg: FedPACConfig, num_partitions: int) -> tuple[ClientSplit, ...]:
    from common.data import load_source_dataset  # pylint: disable=import-outside-toplevel

    data = load_source_dataset(cfg)
    partitioner = build_partitioner(cfg, num_partitions)
    return tuple(
        split_clients(
            data, partitioner, cfg.test_samples_per_client, cfg.seed, cfg.min_test_per_class
        )
    )


def client_split(cfg: FedPACConfig, partition_id: int, num_partitions: int) -> ClientSplit:
    """The split of one client (all clients' splits are computed once per process)."""
    if not 0 <= partition_id < num_partitions:
        raise DataError(f"partition-id {partition_id} outside [0, num-partitions = {num_partitions})")
    return _cached_splits(cfg, num_partitions)[partition_id]


def group_of(cfg: FedPACConfig, partition_id: int) -> int:
    """The client group of a partition under the paper's scheme (used to order plots)."""
    return partition_id % len(dominant_class_groups(cfg.num_classes))
