"""FedCCFA's and pFedVEM's partition schemes: a partition dealt out class by class.

FedCCFA's ``dirichlet-min`` (:class:`MinimumDirichletPartitioner`: a minimum of every class, then
Dirichlet shares) and pFedVEM's ``vem-pairs`` and ``super-labels`` (:class:`ClassChunkPartitioner`:
each class cut into very unequal chunks, one per client that holds it). ``common.partition``
builds them from the run config and draws their clients' test sets.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar

import numpy as np
from datasets import Dataset
from flwr_datasets.partitioner import Partitioner

from common.config import SUPER_LABEL_SIZE
from common.data import DataError, int_column, super_labels


def proportional_counts(reference: np.ndarray, total: int) -> np.ndarray:
    """Integer counts summing to ``total`` in the proportions of ``reference`` (largest remainder)."""
    exact = reference / reference.sum() * total
    counts = np.floor(exact).astype(np.int64)
    shortfall = total - counts.sum()
    counts[np.argsort(-(exact - counts), kind="stable")[:shortfall]] += 1
    return counts


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
            labels = int_column(self.dataset, "label")
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
        relabeled = self.relabel(partition_id, int_column(part, "label"))
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
