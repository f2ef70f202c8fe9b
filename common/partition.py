"""Client partitions: the paper's scheme (Appendix B.2), concept shift, FedCCFA's and pFedVEM's
schemes, and flwr-datasets' own.

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

from collections.abc import Iterable
from dataclasses import dataclass
from functools import lru_cache
from typing import ClassVar

import datasets
import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import DirichletPartitioner, Partitioner, PathologicalPartitioner

from common.config import SUPER_LABEL_SIZE, FedPACConfig, dataset_classes
from common.data import DataError, ImageDataset, super_labels

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


def proportional_counts(reference: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` in the proportions of ``reference`` (largest remainder)."""
    exact = reference / reference.sum() * total
    counts = np.floor(exact).astype(np.int64)
    shortfall = total - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:shortfall]] += 1
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
            labels = np.asarray(self.dataset["label"])
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
        relabeled = self.relabel(partition_id, np.asarray(part["label"]))
        return part.remove_columns("label").add_column("label", relabeled)


class ClassWisePartitioner(Partitioner):
    """A partition dealt out class by class: each class's rows are shuffled (generator seeded
    from (seed, class, ``SHUFFLE``)) and :meth:`deal` says which client gets which of them. All
    clients' rows are computed once and cached; every row goes to at most one client."""

    SHUFFLE: ClassVar[int]  # the shuffle generator's stream, one per scheme

    def __init__(self, num_partitions: int, num_classes: int, seed: int) -> None:
        super().__init__()
        self._num_partitions = num_partitions
        self.num_classes = num_classes
        self.seed = seed
        self._indices: list[np.ndarray] | None = None

    @property
    def num_partitions(self) -> int:
        return self._num_partitions

    def deal(self, class_id: int, rows: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
        """(partition-id, rows) for the shuffled ``rows`` of ``class_id``."""
        raise NotImplementedError

    def _partition_indices(self) -> list[np.ndarray]:
        if self._indices is None:
            labels = np.asarray(self.dataset["label"])
            if len(labels) and (labels.min() < 0 or labels.max() >= self.num_classes):
                raise DataError(f"labels outside [0, {self.num_classes})")
            per_client: list[list[np.ndarray]] = [[] for _ in range(self.num_partitions)]
            for c in range(self.num_classes):
                rows = np.random.default_rng([self.seed, c, self.SHUFFLE]).permutation(np.flatnonzero(labels == c))
                for pid, chunk in self.deal(c, rows):
                    per_client[pid].append(chunk)
            self._indices = [
                np.sort(np.concatenate(parts)).astype(np.int64) for parts in per_client
            ]
        return self._indices

    def partition_rows(self, partition_id: int) -> np.ndarray:
        """The dataset rows of one partition (ascending)."""
        if not 0 <= partition_id < self.num_partitions:
            raise ValueError(f"partition-id {partition_id} outside [0, {self.num_partitions})")
        return self._partition_indices()[partition_id]

    def load_partition(self, partition_id: int) -> Dataset:
        return self.dataset.select(self.partition_rows(partition_id))


class MinimumDirichletPartitioner(ClassWisePartitioner):
    """FedCCFA's partition (``utils/gen_dataset.py``): a minimum of every class, then Dirichlet.

    For each class c, the class's indices are shuffled (generator seeded from (seed, c)); the
    first ``min_per_class * N`` go ``min_per_class`` to each of the N clients, the rest by
    proportions drawn from Dirichlet(alpha) over the clients, with integer counts by largest
    remainder so the whole class is distributed. Every client holds at least ``min_per_class``
    samples of every class and every sample goes to exactly one client.

    The Dirichlet draw depends only on (seed, c, N, alpha), on a generator of its own, so a
    partitioner over the test pool with the same seed gives every client the same class
    proportions as its training partition (as the official code, which reseeds numpy with
    seed + c for both). Unlike the official code, the minimum samples are drawn from a shuffled
    class (not the dataset's first ones) and the remainder is rounded by largest remainder.
    """

    def __init__(  # pylint: disable=too-many-arguments
        self,
        num_partitions: int,
        num_classes: int,
        alpha: float,
        min_per_class: int = 5,
        seed: int = 0,
    ) -> None:
        if num_partitions < 1:
            raise ValueError(f"num_partitions must be >= 1, got {num_partitions}")
        if not alpha > 0:
            raise ValueError(f"the Dirichlet alpha must be > 0, got {alpha}")
        if min_per_class < 0:
            raise ValueError(f"min_per_class must be >= 0, got {min_per_class}")
        super().__init__(num_partitions, num_classes, seed)
        self.alpha = alpha
        self.min_per_class = min_per_class

    def class_proportions(self, class_id: int) -> np.ndarray:
        """The Dirichlet(alpha) shares of the clients in the remainder of ``class_id``."""
        rng = np.random.default_rng([self.seed, class_id, 1])
        return rng.dirichlet(np.full(self.num_partitions, float(self.alpha)))

    def class_counts(self, class_id: int, class_size: int) -> np.ndarray:
        """How many of ``class_size`` samples of ``class_id`` each client receives."""
        minimum = self.min_per_class * self.num_partitions
        if class_size < minimum:
            raise DataError(
                f"class {class_id} has {class_size} samples, fewer than the {minimum} needed to "
                f"give each of the {self.num_partitions} clients {self.min_per_class}: lower the "
                "minimum per class or the number of clients"
            )
        rest = proportional_counts(self.class_proportions(class_id), class_size - minimum)
        return rest + self.min_per_class

    SHUFFLE = 0

    def deal(self, class_id: int, rows: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
        counts = self.class_counts(class_id, len(rows))
        # the minimum first, evenly, then each client's share of the rest
        head, tail = np.split(rows, [self.min_per_class * self.num_partitions])
        mins = head.reshape(self.num_partitions, self.min_per_class)
        rest = np.split(tail, np.cumsum(counts - self.min_per_class)[:-1])
        for pid in range(self.num_partitions):
            yield pid, np.concatenate((mins[pid], rest[pid]))


def random_chunk_sizes(class_size: int, num_chunks: int, rng: np.random.Generator) -> np.ndarray:
    """pFedVEM's data quantity disparity: one class's ``class_size`` samples cut at
    ``num_chunks - 1`` uniformly random points into chunks of very unequal sizes.

    The cut points are drawn from *this* class's size: the authors' ``RandomDataSplit`` draws
    them once from class 0's size and cuts every class there, which leaves chunks empty or
    oversized when classes differ in size (MNIST: 5,421 to 6,742). As in that code, the points
    are distinct and in [1, class_size - 1], so no chunk is empty; a class with fewer samples than
    chunks is an error.
    """
    if class_size < num_chunks:
        raise DataError(
            f"a class with {class_size} samples cannot give each of its {num_chunks} clients one: "
            "use fewer clients"
        )
    cuts = np.sort(rng.choice(np.arange(1, class_size), size=num_chunks - 1, replace=False))
    return np.diff(np.concatenate(([0], cuts, [class_size]))).astype(np.int64)


class ClassChunkPartitioner(ClassWisePartitioner):
    """pFedVEM's partitions: each client holds a set of classes, and each class's training set is
    cut by :func:`random_chunk_sizes` into one chunk per client that holds it.

    Every training sample goes to exactly one client: the whole training set, or the first
    ``train_per_class`` of every class's shuffle. A client's test set is the whole test set of
    each class it holds (or the same ``test_per_class`` of it for all its holders), not
    reweighted to its training mix (the authors' code evaluates a client on the full test sets of
    its classes), so clients share test images and ``test-samples-per-client`` plays no part. Subclasses say which
    classes a client holds (``client_classes``) and how its labels read (``relabel``). Clients
    come in blocks of two, so ``num_partitions`` must be even.
    """

    scheme: ClassVar[str]  # the run config's ``partition`` value, for messages

    SHUFFLE = 4

    def __init__(self, num_partitions: int, num_classes: int, seed: int = 0, train_per_class: int = 0,
                 test_per_class: int = 0) -> None:
        if num_partitions < 2 or num_partitions % 2:
            raise DataError(
                f"partition '{self.scheme}' puts clients in pairs: num-partitions must be even and "
                f">= 2, got {num_partitions}"
            )
        if num_classes < 2 or num_classes % 2:
            raise DataError(
                f"partition '{self.scheme}' splits the classes in two: the dataset needs an even "
                f"number of classes, got {num_classes}"
            )
        super().__init__(num_partitions, num_classes, seed)
        # 0: all of a class; else the first this many of its (seeded) shuffle
        self.train_per_class, self.test_per_class = train_per_class, test_per_class

    def client_classes(self, partition_id: int) -> tuple[int, ...]:
        """The dataset classes ``partition_id`` holds, ascending."""
        raise NotImplementedError

    def relabel(self, partition_id: int, labels: np.ndarray) -> np.ndarray:  # pylint: disable=unused-argument
        """The labels a client trains and is tested on, from the dataset's classes."""
        return labels

    def holders(self, class_id: int) -> list[int]:
        """The clients that hold ``class_id``, ascending."""
        return [pid for pid in range(self.num_partitions) if class_id in self.client_classes(pid)]

    def deal(self, class_id: int, rows: np.ndarray) -> Iterable[tuple[int, np.ndarray]]:
        rows = _first(rows, self.train_per_class, f"class {class_id} has {len(rows)} training images")
        holders = self.holders(class_id)
        try:
            sizes = random_chunk_sizes(len(rows), len(holders), np.random.default_rng([self.seed, class_id, 5]))
        except DataError as err:
            raise DataError(f"class {class_id}: {err}") from err
        return zip(holders, np.split(rows, np.cumsum(sizes)[:-1]))

    def test_rows(self, partition_id: int, test_labels: np.ndarray) -> np.ndarray:
        """The client's test set: every test row of every class it holds, or the same
        ``test_per_class`` rows of each (a seeded shuffle, shared by all its holders); ascending."""
        rows = []
        for c in self.client_classes(partition_id):
            of_class = np.flatnonzero(test_labels == c)
            if self.test_per_class:
                of_class = _first(np.random.default_rng([self.seed, c, 7]).permutation(of_class),
                                  self.test_per_class, f"class {c} has {len(of_class)} test images")
            rows.append(of_class)
        return np.sort(np.concatenate(rows)).astype(np.int64)

    def load_partition(self, partition_id: int) -> Dataset:
        part = self.dataset.select(self.partition_rows(partition_id))
        relabeled = self.relabel(partition_id, np.asarray(part["label"], dtype=np.int64))
        return part.remove_columns("label").add_column("label", relabeled)


def _first(rows: np.ndarray, count: int, what: str) -> np.ndarray:
    """The first ``count`` of ``rows`` (all of them for 0); too few is an error."""
    if not count:
        return rows
    if count > len(rows):
        raise DataError(f"{what}, fewer than the {count} asked for: lower class-train-samples / "
                        "class-test-samples")
    return rows[:count]


class ComplementaryPairsPartitioner(ClassChunkPartitioner):
    """pFedVEM's label-distribution skew (the CVPR code's CIFAR-10 split): clients 2b and 2b+1
    form pair b; the pair's classes are shuffled (generator seeded from (seed, b)) and split into
    two halves, one per client, so the two have complementary label sets. Every class is then
    held by one client of every pair: num_partitions / 2 chunks per class.
    """

    scheme = "vem-pairs"

    def client_classes(self, partition_id: int) -> tuple[int, ...]:
        pair, member = divmod(partition_id, 2)
        shuffled = np.random.default_rng([self.seed, 3, pair]).permutation(self.num_classes)
        half = self.num_classes // 2
        return tuple(sorted(int(c) for c in shuffled[member * half : (member + 1) * half]))


class SuperLabelPartitioner(ClassChunkPartitioner):
    """Label concept drift for 28x28 data, **our own construction** (pFedVEM's paper has none):
    its CIFAR-100 super-class scheme with super-labels of SUPER_LABEL_SIZE (2) classes.

    The task is the super-label (:func:`common.data.super_labels`: {0, 1} -> 0, {2, 3} -> 1, ...).
    Clients 2b and 2b+1 form block b; for every super-label the block permutes its two member
    classes (generator seeded from (seed, b)), and client 2b + i takes member i. So every client
    holds exactly one member class of every super-label: P(y) is the same for all clients while
    P(x | y) differs between the two clients of a block. Each class is held by num_partitions / 2
    clients and chunked as in ``vem-pairs``.
    """

    scheme = "super-labels"

    def __init__(self, num_partitions: int, num_classes: int, seed: int = 0, train_per_class: int = 0,
                 test_per_class: int = 0) -> None:
        super().__init__(num_partitions, num_classes, seed, train_per_class, test_per_class)
        self.num_super_labels = num_classes // SUPER_LABEL_SIZE

    def members(self, block: int) -> np.ndarray:
        """(SUPER_LABEL_SIZE, num_super_labels): row i holds block member i's class of each
        super-label."""
        rng = np.random.default_rng([self.seed, 6, block])
        order = np.stack([rng.permutation(SUPER_LABEL_SIZE) for _ in range(self.num_super_labels)], axis=1)
        return order + SUPER_LABEL_SIZE * np.arange(self.num_super_labels)

    def client_classes(self, partition_id: int) -> tuple[int, ...]:
        block, member = divmod(partition_id, SUPER_LABEL_SIZE)
        return tuple(int(c) for c in self.members(block)[member])

    def relabel(self, partition_id: int, labels: np.ndarray) -> np.ndarray:
        return super_labels(labels)


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
        train_indices = np.asarray(part["index"], dtype=np.int64)
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
                train_labels=np.asarray(part["label"], dtype=np.int64),
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
