"""pFedVEM's data protocols: ``vem-pairs`` (the authors' label-distribution skew) and
``super-labels`` (our own label concept-drift analogue for 28x28 data).

Both cut each class's training set at random points per class into one chunk per client that
holds the class, distribute the whole training set, and test a client on the whole test set of
its classes. The last tests run a short pFedVEM federation on each partition.
"""

from __future__ import annotations

import numpy as np
import pytest

from common import data as data_module
from common.config import ConfigError, dataset_classes, parse_run_config
from common.data import DataError, load_dataset, load_source_dataset, super_labels
from common.class_wise_partition import ComplementaryPairsPartitioner, SuperLabelPartitioner, random_chunk_sizes
from common.partition import build_partitioner, split_clients
from federation import InProcessGrid
from synthetic import labelled_dataset
from server_app.app import run_fedpac

K = 10
# MNIST's training classes (5,923, 6,742, ..., 5,949), a tenth of them: unequal as MNIST's
MNIST_LIKE = (592, 674, 596, 613, 584, 542, 592, 627, 585, 595)


def _dataset(train_per_class=MNIST_LIKE, test_per_class=(98, 113, 103, 101, 98, 89, 96, 103, 97, 101)):
    train_labels = np.random.default_rng(0).permutation(np.repeat(np.arange(K), train_per_class))
    test_labels = np.random.default_rng(1).permutation(np.repeat(np.arange(K), test_per_class))
    return labelled_dataset(train_labels, test_labels, K, name="mnist-like")


def _splits(partition, clients=8, seed=0, data=None):
    cfg = parse_run_config({"partition": partition, "seed": seed})
    return split_clients(data or _dataset(), build_partitioner(cfg, clients), 50, seed)


def _classes(data, split):
    return set(np.unique(data.train_labels[split.train_indices]).tolist())


# --- the chunking both partitions share ----------------------------------------------------------

def test_chunks_cover_the_class_and_none_is_empty():
    rng = np.random.default_rng(0)
    for size, chunks in ((600, 50), (51, 50), (50, 50), (7, 1)):
        sizes = random_chunk_sizes(size, chunks, rng)
        assert len(sizes) == chunks and sizes.sum() == size and sizes.min() >= 1
    with pytest.raises(DataError, match="49 samples cannot give each of its 50 clients"):
        random_chunk_sizes(49, 50, rng)


def test_chunk_sizes_are_very_unequal():
    sizes = random_chunk_sizes(6000, 50, np.random.default_rng(3))
    assert sizes.max() > 3 * sizes.mean() and sizes.min() < sizes.mean() / 5


@pytest.mark.parametrize("partition", ["vem-pairs", "super-labels"])
def test_cut_points_come_from_each_class_own_size(partition):
    # one class much smaller than class 0: cut points taken from class 0's size (the authors'
    # RandomDataSplit) would leave most of the small class's chunks empty and give its last
    # holder almost all of the large one; per class, every holder gets some of every class
    sizes = (3000, 40, 600, 600, 600, 600, 600, 600, 600, 2000)
    data = _dataset(train_per_class=sizes)
    splits = _splits(partition, clients=40, data=data)
    per_class = np.zeros((40, K), dtype=np.int64)
    for pid, split in enumerate(splits):
        per_class[pid] = np.bincount(data.train_labels[split.train_indices], minlength=K)
    for c in range(K):
        held = per_class[:, c][per_class[:, c] > 0]
        assert len(held) == 20  # one chunk per holder (half of the clients), none empty
        assert held.sum() == sizes[c]  # the whole class, each sample once
        assert held.max() < sizes[c] / 2  # no holder takes the lion's share


@pytest.mark.parametrize("partition", ["vem-pairs", "super-labels"])
def test_every_training_sample_goes_to_exactly_one_client(partition):
    data = _dataset()
    splits = _splits(partition, clients=10, data=data)
    everything = np.sort(np.concatenate([s.train_indices for s in splits]))
    np.testing.assert_array_equal(everything, np.arange(len(data.train_labels)))
    assert min(len(s.train_indices) for s in splits) > 0


@pytest.mark.parametrize("partition", ["vem-pairs", "super-labels"])
def test_partitions_are_deterministic_in_the_seed(partition):
    a, b, c = _splits(partition, seed=4), _splits(partition, seed=4), _splits(partition, seed=5)
    for x, y in zip(a, b):
        np.testing.assert_array_equal(x.train_indices, y.train_indices)
        np.testing.assert_array_equal(x.train_labels, y.train_labels)
        np.testing.assert_array_equal(x.test_indices, y.test_indices)
    assert not all(np.array_equal(x.train_indices, y.train_indices) for x, y in zip(a, c))


@pytest.mark.parametrize("partition", ["vem-pairs", "super-labels"])
@pytest.mark.parametrize("clients", [0, 3, 7])
def test_an_odd_number_of_clients_is_refused(partition, clients):
    cfg = parse_run_config({"partition": partition})
    with pytest.raises(DataError, match=f"'{partition}' puts clients in pairs: num-partitions must be even"):
        build_partitioner(cfg, clients)


def test_an_odd_number_of_classes_is_refused():
    with pytest.raises(ConfigError, match="odd number of classes"):
        parse_run_config({"partition": "vem-pairs", "dataset": "hf", "hf-repo": "x", "num-classes": 7})
    with pytest.raises(DataError, match="even number of classes, got 7"):
        ComplementaryPairsPartitioner(4, 7)


def test_too_few_samples_of_a_class_for_its_holders_names_the_class():
    data = _dataset(train_per_class=(60, 60, 3, 60, 60, 60, 60, 60, 60, 60))
    with pytest.raises(DataError, match="class 2: a class with 3 samples cannot give each of its 4 clients"):
        _splits("vem-pairs", clients=8, data=data)


# --- vem-pairs -----------------------------------------------------------------------------------

def test_the_clients_of_a_pair_hold_complementary_halves():
    data = _dataset()
    splits = _splits("vem-pairs", clients=10, data=data)
    label_sets = [_classes(data, s) for s in splits]
    assert all(len(labels) == K // 2 for labels in label_sets)
    for pair in range(5):
        first, second = label_sets[2 * pair], label_sets[2 * pair + 1]
        assert not first & second and first | second == set(range(K))
    assert len({frozenset(labels) for labels in label_sets}) > 2  # pairs are shuffled independently
    # a pair's classes do not depend on how many pairs there are
    partitioner = ComplementaryPairsPartitioner(4, K, seed=0)
    assert [partitioner.client_classes(pid) for pid in range(4)] == [tuple(sorted(s)) for s in label_sets[:4]]


def test_vem_pairs_test_set_is_the_whole_test_set_of_the_client_classes():
    data = _dataset()
    for split in _splits("vem-pairs", clients=6, data=data):
        classes = _classes(data, split)
        np.testing.assert_array_equal(split.test_indices, np.flatnonzero(np.isin(data.test_labels, list(classes))))
        np.testing.assert_array_equal(split.test_labels, data.test_labels[split.test_indices])
        np.testing.assert_array_equal(split.train_labels, data.train_labels[split.train_indices])
        assert set(np.unique(split.test_labels).tolist()) == classes


# --- super-labels ---------------------------------------------------------------------------------

def test_super_labels_merge_consecutive_classes_and_the_model_has_half_the_outputs():
    np.testing.assert_array_equal(super_labels(np.arange(K)), [0, 0, 1, 1, 2, 2, 3, 3, 4, 4])
    for dataset in ("mnist-5k", "fashion-mnist", "mnist"):
        cfg = parse_run_config({"partition": "super-labels", "dataset": dataset})
        assert (cfg.num_classes, dataset_classes(cfg)) == (5, 10)
    assert parse_run_config({"partition": "vem-pairs"}).num_classes == 10
    # a generic dataset: num-classes is the model's outputs, the super-labels
    hf = parse_run_config({"partition": "super-labels", "dataset": "hf", "hf-repo": "x", "num-classes": 3})
    assert (hf.num_classes, dataset_classes(hf)) == (3, 6)
    # the task's dataset view (the clients' and the generalized accuracy's): super-labels
    cfg = parse_run_config({"partition": "super-labels"})
    data, source = load_dataset(cfg), load_source_dataset(cfg)
    assert data.num_classes == 5 and set(np.unique(data.test_labels).tolist()) == set(range(5))
    np.testing.assert_array_equal(data.test_labels, source.test_labels // 2)
    assert data.train_images is source.train_images and load_dataset(cfg) is data  # one view, no copies


def test_each_client_holds_one_member_of_every_super_label_and_its_block_partner_the_other():
    data = _dataset()
    splits = _splits("super-labels", clients=10, data=data)
    members = [_classes(data, s) for s in splits]
    for pid, classes in enumerate(members):
        assert sorted(c // 2 for c in classes) == list(range(5))  # one member per super-label
        np.testing.assert_array_equal(splits[pid].train_labels, data.train_labels[splits[pid].train_indices] // 2)
        assert set(splits[pid].train_labels.tolist()) == set(range(5))  # P(y) has the same support
    for block in range(5):
        assert members[2 * block] | members[2 * block + 1] == set(range(K))
        assert not members[2 * block] & members[2 * block + 1]
    assert len({frozenset(m) for m in members}) > 2  # blocks permute independently
    partitioner = SuperLabelPartitioner(10, K, seed=0)
    assert [set(partitioner.client_classes(pid)) for pid in range(10)] == members


def test_super_label_test_set_has_the_client_members_relabelled():
    data = _dataset()
    for split in _splits("super-labels", clients=6, data=data):
        classes = _classes(data, split)
        original = data.test_labels[split.test_indices]
        assert set(np.unique(original).tolist()) == classes  # the same member classes as training
        assert np.isin(data.test_labels, list(classes)).sum() == len(split.test_indices)  # all of them
        np.testing.assert_array_equal(split.test_labels, original // 2)


def test_super_labels_need_the_dataset_to_have_twice_the_classes(monkeypatch):
    cfg = parse_run_config({"partition": "super-labels", "dataset": "hf", "hf-repo": "x", "num-classes": 6})
    monkeypatch.setattr(data_module, "_load_cached", lambda *args: _dataset(train_per_class=(5,) * K,
                                                                            test_per_class=(2,) * K))
    with pytest.raises(DataError, match="groups 12 classes into 6 super-labels of 2, but dataset 'mnist-like' has 10"):
        load_dataset(cfg)


# --- a short pFedVEM federation on each partition --------------------------------------------------

@pytest.mark.parametrize("partition, outputs", [("vem-pairs", 10), ("super-labels", 5)])
def test_a_pfedvem_run_on_the_partition(partition, outputs, tmp_path):
    config = {
        "strategy": "pfedvem", "partition": partition, "num-server-rounds": 1, "local-epochs": 1,
        "vem-head-steps": 2, "vem-mc-samples": 2, "vem-batch-size": 100, "output-dir": str(tmp_path),
        "generalized-every": 1,
    }
    strategy, report = run_fedpac(InProcessGrid(config, 4, seed=1), parse_run_config(config), 1)
    heads = strategy.state.personal["head"]  # every client's posterior mean
    assert heads and all(head["head.weight"].shape == (outputs, 128) for head in heads.values())
    last = report.rounds[-1]
    assert sorted(last.accuracy) == sorted(last.generalized) == [0, 1, 2, 3]
    assert all(0.0 <= a <= 1.0 for a in [*last.accuracy.values(), *last.generalized.values()])
    # every client trained on its whole partition: the run's training set, once
    assert sum(m["num-examples"] for m in last.train.values()) == 3500


# --- a share of the dataset: class-train-samples / class-test-samples ----------------------------

@pytest.mark.parametrize("partition", ["vem-pairs", "super-labels"])
def test_a_share_of_every_class_is_handed_out_the_same_way_by_every_process(partition):
    data = _dataset()
    cfg = parse_run_config({"partition": partition, "class-train-samples": 100, "class-test-samples": 30})
    splits = split_clients(data, build_partitioner(cfg, 8), 50, cfg.seed)
    train = np.concatenate([s.train_indices for s in splits])
    assert len(np.unique(train)) == len(train) == 100 * K  # 100 of every class, each image once
    assert (np.bincount(data.train_labels[train], minlength=K) == 100).all()
    again = split_clients(data, build_partitioner(cfg, 8), 50, cfg.seed)
    assert all(np.array_equal(a.train_indices, b.train_indices) and np.array_equal(a.test_indices, b.test_indices)
               for a, b in zip(splits, again))
    for split in splits:
        held = _classes(data, split)
        test_classes = data.test_labels[split.test_indices]
        assert set(test_classes.tolist()) == held and (np.bincount(test_classes, minlength=K)[sorted(held)] == 30).all()
    # the holders of a class are tested on the same images of it
    holders = [s for s in splits if 0 in _classes(data, s)]
    zero = [set(s.test_indices[data.test_labels[s.test_indices] == 0].tolist()) for s in holders]
    assert len(holders) == 4 and all(rows == zero[0] for rows in zero)


def test_asking_for_more_of_a_class_than_it_has_is_refused():
    cfg = parse_run_config({"partition": "vem-pairs", "class-train-samples": 560})  # class 5 has 542
    with pytest.raises(DataError, match="class 5 has 542 training images, fewer than the 560"):
        split_clients(_dataset(), build_partitioner(cfg, 8), 50, cfg.seed)
    with pytest.raises(ConfigError, match="class-test-samples"):
        parse_run_config({"class-test-samples": -1})
