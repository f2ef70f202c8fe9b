"""Partitioners: sizes, the s % uniform share, group dominance, test splits, concept shift,
FedCCFA's minimum-per-class Dirichlet."""

import numpy as np
import pytest

from common.config import parse_run_config
from common.data import DataError
from common.class_wise_partition import MinimumDirichletPartitioner
from common.partition import (
    ConceptShiftPartitioner,
    FedPACPartitioner,
    _labels_dataset,
    build_partitioner,
    dominant_class_groups,
    split_clients,
)
from synthetic import labelled_dataset

K = 10


def _dataset(train_per_class=300, test_per_class=100):
    return labelled_dataset(np.repeat(np.arange(K), train_per_class), np.repeat(np.arange(K), test_per_class), K)


def test_paper_groups_for_ten_classes():
    assert dominant_class_groups(10) == ((0, 1, 2), (2, 3, 4), (4, 5, 6), (6, 7, 8), (0, 8, 9))
    assert len(dominant_class_groups(62)) == 3


@pytest.mark.parametrize("share", [0, 20, 50, 80, 100])
def test_sizes_uniform_share_and_group_dominance(share):
    data = _dataset()
    partitioner = FedPACPartitioner(20, K, 600, share, seed=1)
    splits = split_clients(data, partitioner, test_samples_per_client=100, seed=1)
    for pid, split in enumerate(splits):
        counts = np.bincount(split.train_labels, minlength=K)
        assert counts.sum() == 600 and len(set(split.train_indices)) == 600
        dominant = list(dominant_class_groups(K)[pid % 5])
        others = [k for k in range(K) if k not in dominant]
        n_uniform = round(600 * share / 100)
        # every non-dominant class gets exactly its uniform share (+-1 for rounding)
        assert all(abs(counts[k] - n_uniform / K) <= 1 for k in others)
        assert counts[dominant].sum() == pytest.approx(600 - n_uniform * 7 / 10, abs=3)
        if share < 100:
            assert counts[dominant].min() > counts[others].max()


def test_test_split_has_the_training_label_distribution():
    data = _dataset()
    splits = split_clients(data, FedPACPartitioner(10, K, 600, 20, seed=2), 200, seed=2)
    for split in splits:
        train = np.bincount(split.train_labels, minlength=K) / 600
        test = np.bincount(split.test_labels, minlength=K) / 200
        np.testing.assert_allclose(test, train, atol=1 / 200 + 1e-9)
        assert len(set(split.test_indices)) == 200


def test_clients_do_not_overlap_while_the_data_suffices():
    data = _dataset(train_per_class=600)
    splits = split_clients(data, FedPACPartitioner(10, K, 300, 20, seed=0), 50, seed=0)
    everything = np.concatenate([s.train_indices for s in splits])
    assert len(set(everything)) == len(everything)


def test_asking_more_of_a_class_than_exists_is_a_clear_error():
    data = _dataset(train_per_class=50)
    with pytest.raises(DataError, match="samples of class"):
        split_clients(data, FedPACPartitioner(5, K, 600, 20), 50, seed=0)


def test_partitions_are_deterministic_in_the_seed():
    data = _dataset()
    a = split_clients(data, FedPACPartitioner(5, K, 100, 20, seed=4), 20, seed=4)
    b = split_clients(data, FedPACPartitioner(5, K, 100, 20, seed=4), 20, seed=4)
    c = split_clients(data, FedPACPartitioner(5, K, 100, 20, seed=5), 20, seed=5)
    assert all(np.array_equal(x.train_indices, y.train_indices) for x, y in zip(a, b))
    assert not all(np.array_equal(x.train_indices, y.train_indices) for x, y in zip(a, c))


def test_concept_shift_relabels_each_group_with_its_own_permutation():
    data = _dataset()
    base = FedPACPartitioner(10, K, 200, 20, seed=3)
    shifted = ConceptShiftPartitioner(FedPACPartitioner(10, K, 200, 20, seed=3), K, 5, seed=3)
    plain = split_clients(data, base, 50, seed=3)
    moved = split_clients(data, shifted, 50, seed=3)
    perms = shifted.permutations
    assert all(sorted(perm) == list(range(K)) for perm in perms)
    assert len({tuple(perm) for perm in perms}) == 5
    for pid, (a, b) in enumerate(zip(plain, moved)):
        np.testing.assert_array_equal(a.train_indices, b.train_indices)  # same images
        perm = perms[pid % 5]
        np.testing.assert_array_equal(b.train_labels, perm[a.train_labels])
        np.testing.assert_array_equal(b.test_labels, perm[data.test_labels[b.test_indices]])
    # clients in one group (pid mod 5) share the labelling, and other groups' differ
    labels = np.arange(K)
    np.testing.assert_array_equal(shifted.relabel(0, labels), shifted.relabel(5, labels))
    assert not np.array_equal(shifted.relabel(0, labels), shifted.relabel(1, labels))


@pytest.mark.parametrize("scheme", ["dirichlet", "pathological"])
def test_flwr_datasets_partitioners_are_selectable(scheme):
    cfg = parse_run_config({"partition": scheme, "pathological-classes": 2, "dirichlet-alpha": 0.3})
    splits = split_clients(_dataset(), build_partitioner(cfg, 6), 40, seed=0)
    assert len(splits) == 6
    every = np.concatenate([s.train_indices for s in splits])
    assert len(set(every)) == len(every)  # these partition the training set
    if scheme == "pathological":
        assert all(len(np.unique(s.train_labels)) <= 2 for s in splits)
    for split in splits:
        assert set(np.unique(split.test_labels)) <= set(np.unique(split.train_labels))


def _uneven_labels(per_class=(400, 250, 120, 300, 90, 500, 200, 150, 330, 100), seed=0):
    labels = np.repeat(np.arange(len(per_class)), per_class)
    return np.random.default_rng(seed).permutation(labels)


def _min_dirichlet_rows(labels, n=8, alpha=0.1, minimum=5, seed=0):
    partitioner = MinimumDirichletPartitioner(n, K, alpha, min_per_class=minimum, seed=seed)
    partitioner.dataset = _labels_dataset(labels)
    return [np.asarray(partitioner.load_partition(pid)["index"]) for pid in range(n)]


@pytest.mark.parametrize("minimum", [0, 1, 5])
def test_min_dirichlet_gives_every_client_the_minimum_and_distributes_everything(minimum):
    labels = _uneven_labels()
    rows = _min_dirichlet_rows(labels, n=8, minimum=minimum)
    for part in rows:
        assert np.bincount(labels[part], minlength=K).min() >= minimum
    everything = np.concatenate(rows)
    assert len(everything) == len(labels)  # nothing left over, nothing twice
    np.testing.assert_array_equal(np.sort(everything), np.arange(len(labels)))


def test_min_dirichlet_is_skewed_at_small_alpha_and_near_even_at_large():
    labels = _uneven_labels()
    # beyond the minimum, alpha 0.1 concentrates a class on few clients; alpha 1000 spreads it
    skewed = np.stack([np.bincount(labels[p], minlength=K) for p in _min_dirichlet_rows(labels)])
    even = np.stack([np.bincount(labels[p], minlength=K)
                     for p in _min_dirichlet_rows(labels, alpha=1000.0)])
    class_sizes = np.bincount(labels, minlength=K)
    assert (skewed.max(axis=0) / class_sizes).mean() > 0.5
    np.testing.assert_allclose(even / class_sizes, 1 / 8, atol=0.05)


def test_min_dirichlet_is_deterministic_in_the_seed():
    labels = _uneven_labels()
    a, b = _min_dirichlet_rows(labels, seed=3), _min_dirichlet_rows(labels, seed=3)
    c = _min_dirichlet_rows(labels, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_min_dirichlet_too_few_samples_of_a_class_is_a_clear_error():
    labels = _uneven_labels(per_class=(100,) * 9 + (39,))  # class 9: 39 < 5 * 8
    with pytest.raises(DataError, match="class 9 has 39 samples, fewer than the 40"):
        _min_dirichlet_rows(labels, n=8, minimum=5)
    with pytest.raises(ValueError, match="alpha"):
        MinimumDirichletPartitioner(4, K, 0.0)


def _min_dirichlet_dataset(train_per_class=250, test_per_class=60):
    train_labels = _uneven_labels(tuple(train_per_class + 10 * k for k in range(K)), seed=1)
    test_labels = _uneven_labels(tuple(test_per_class + 3 * k for k in range(K)), seed=2)
    return labelled_dataset(train_labels, test_labels, K, image_shape=(1, 1, 1))


def test_dirichlet_min_splits_train_and_test_pools_with_matching_mixes():
    data = _min_dirichlet_dataset()
    cfg = parse_run_config({"partition": "dirichlet-min", "dirichlet-alpha": 0.1, "seed": 7})
    partitioner = build_partitioner(cfg, 10)
    assert isinstance(partitioner, MinimumDirichletPartitioner)
    assert partitioner.min_per_class == cfg.min_train_per_class == 5
    # test-samples-per-client plays no part in this scheme
    splits = split_clients(data, partitioner, test_samples_per_client=3, seed=cfg.seed,
                           min_test_per_class=cfg.min_test_per_class)
    assert len(splits) == 10
    for split in splits:
        assert np.bincount(split.train_labels, minlength=K).min() >= 5
        assert np.bincount(split.test_labels, minlength=K).min() >= 2
        np.testing.assert_array_equal(split.train_labels, data.train_labels[split.train_indices])
        np.testing.assert_array_equal(split.test_labels, data.test_labels[split.test_indices])
    for pool, indices in (("train", [s.train_indices for s in splits]),
                          ("test", [s.test_indices for s in splits])):
        everything = np.sort(np.concatenate(indices))
        np.testing.assert_array_equal(everything, np.arange(len(getattr(data, f"{pool}_labels"))))
    # the same Dirichlet shares: a client's main class is the same in train and test
    agree = [
        np.argmax(np.bincount(s.train_labels, minlength=K))
        == np.argmax(np.bincount(s.test_labels, minlength=K))
        for s in splits
    ]
    assert sum(agree) >= 8
    # and a client's share of each class correlates strongly between the pools
    train = np.stack([np.bincount(s.train_labels, minlength=K) for s in splits]).astype(float)
    test = np.stack([np.bincount(s.test_labels, minlength=K) for s in splits]).astype(float)
    train_share, test_share = train / train.sum(axis=0), test / test.sum(axis=0)
    assert np.corrcoef(train_share.ravel(), test_share.ravel())[0, 1] > 0.9


def test_dirichlet_min_test_pool_too_small_names_the_test_pool():
    data = _min_dirichlet_dataset(test_per_class=10)  # class 0: 10 < 2 * 6
    cfg = parse_run_config({"partition": "dirichlet-min", "seed": 1})
    with pytest.raises(DataError, match="test pool: class 0 has 10 samples"):
        split_clients(data, build_partitioner(cfg, 6), 40, seed=1, min_test_per_class=2)
