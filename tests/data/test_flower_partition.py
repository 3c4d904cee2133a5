"""flwr-datasets' partitioners in fedsim (fedsim.data.flower_partition): each against a hand computation of
Flower's algorithm on a few labels, the natural splits and their own test sets, the bad inputs through the CLI,
and a natural split trained on one and two workers. The equality with Flower's own code is in tests/test_bench.py
(test_partitions_equal_flower_datasets_own)."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from fedsim import rng
from fedsim.data import Dataset, partition
from fedsim.data.flower_partition import FlowerOptions, flower_partition, natural_groups, natural_members
from fedsim.errors import ConfigError
from fedsim.runtime.setup import make_partition
from tests.test_hostile_config import assert_one_line_error, fedsim_run


def shuffled(n: int, seed: int) -> np.ndarray:
    """HF's Dataset.shuffle(seed), as FederatedDataset applies it: the original index at each shuffled position."""
    return np.random.default_rng(seed).permutation(n)


def same(parts: list[np.ndarray], want: list) -> None:
    assert len(parts) == len(want)
    for got, w in zip(parts, want):
        np.testing.assert_array_equal(got, np.sort(np.asarray(w, dtype=np.int64)))


@pytest.mark.parametrize("kind, k, sizes", [
    ("iid", 3, [7, 7, 6]),
    ("linear", 4, [2, 4, 6, 8]),  # 20 · i/10
    ("square", 3, [1, 5, 14]),  # 20 · (1, 4, 9)/14 = 1.43, 5.71, 12.86 truncated; the 2 left to the last
    ("exponential", 3, [1, 4, 15]),  # 20 · (e, e², e³)/Σ = 1.80, 4.89, 13.30 truncated; the 2 left to the last
])
def test_iid_and_size_skews_cut_the_shuffled_set_into_consecutive_runs(kind, k, sizes) -> None:
    perm = shuffled(20, 5)
    cuts = np.cumsum([0, *sizes])
    same(flower_partition(np.zeros(20, np.int64), k, kind, 5), [perm[a:b] for a, b in zip(cuts[:-1], cuts[1:])])


def test_flower_iid_is_fedsims_iid_at_the_same_seed() -> None:
    labels = np.arange(50) % 4
    same(flower_partition(labels, 6, "iid", 11), partition(labels, 6, "iid", 11))


def test_pathological_deterministic_and_first_deterministic_by_hand() -> None:
    labels = np.arange(12) % 3
    perm = shuffled(12, 1)
    pos = {c: perm[np.flatnonzero(labels[perm] == c)] for c in range(3)}  # each class in shuffled order
    opts = FlowerOptions(classes_per_client=2, class_assignment="deterministic")
    # client 0 holds classes {0, 1}, client 1 {1, 2}, client 2 {2, 0}: the lower client id gets the first half
    same(flower_partition(labels, 3, "pathological", 1, opts),
         [np.r_[pos[0][:2], pos[1][:2]], np.r_[pos[1][2:], pos[2][:2]], np.r_[pos[2][2:], pos[0][2:]]])
    opts = FlowerOptions(classes_per_client=1, class_assignment="first-deterministic")
    # client i holds class i mod 3: class 0 is split over clients 0 and 3, class 1 over 1 and 4
    same(flower_partition(labels, 5, "pathological", 1, opts),
         [pos[0][:2], pos[1][:2], pos[2], pos[0][2:], pos[1][2:]])
    random = flower_partition(labels, 5, "pathological", 1, FlowerOptions(classes_per_client=2))
    assert all(len(np.unique(labels[p])) <= 2 for p in random)


def test_shards_deal_label_sorted_shards_of_the_shuffled_set() -> None:
    labels = np.array([2, 0, 1, 1, 0, 2, 2, 1, 0, 0, 1, 2])
    perm = shuffled(12, 9)
    by_label = perm[np.argsort(labels[perm], kind="stable")]  # original indices, by label, ties in shuffled order
    deal = np.random.default_rng(9).permutation(4)  # the partitioner's own generator: 4 shards of 12 // (2·2) = 3
    shard = [by_label[3 * s:3 * s + 3] for s in range(4)]
    same(flower_partition(labels, 2, "shards", 9, FlowerOptions(shards_per_client=2)),
         [np.r_[shard[deal[0]], shard[deal[1]]], np.r_[shard[deal[2]], shard[deal[3]]]])
    five = [by_label[5 * s:5 * s + 5] for s in range(3)]  # shards of 5: two whole ones and [10, 12)
    deal = np.random.default_rng(9).permutation(2)
    same(flower_partition(labels, 2, "shards", 9, FlowerOptions(shards_per_client=None, shard_size=5)),
         [five[deal[0]], five[deal[1]]])
    deal = np.random.default_rng(9).permutation(3)  # keep_incomplete: 3 shards, the first client takes two
    same(flower_partition(labels, 2, "shards", 9,
                          FlowerOptions(shards_per_client=None, shard_size=5, keep_incomplete=True)),
         [np.r_[five[deal[0]], five[deal[1]]], five[deal[2]]])


@pytest.mark.parametrize("balancing", [False, True])
def test_dirichlet_draws_one_proportion_vector_per_class_in_class_order(balancing) -> None:
    labels = np.repeat(np.arange(3), [9, 12, 7])
    n, k, seed = len(labels), 3, 4
    perm = shuffled(n, seed)
    g = np.random.default_rng(seed)
    owner = np.full(n, -1)
    sizes = np.zeros(k)
    for c in range(3):
        idx = np.flatnonzero(labels[perm] == c)
        p = g.dirichlet(np.ones(k))
        if balancing:
            p = np.where(sizes > n / k, 0, p)
            p = p / p.sum()
        for j, piece in enumerate(np.split(idx, (np.cumsum(p) * len(idx)).astype(int)[:-1])):
            owner[piece] = j
            sizes[j] += len(piece)
    assert sizes.min() >= 1  # so Flower keeps this first draw
    got = flower_partition(labels, k, "dirichlet", seed, FlowerOptions(alpha=1.0, min_samples=1,
                                                                     self_balancing=balancing))
    same(got, [perm[owner == j] for j in range(k)])


def test_dirichlet_redraws_and_then_refuses_naming_the_bound() -> None:
    labels = np.arange(200) % 4
    first = flower_partition(labels, 5, "dirichlet", 0, FlowerOptions(alpha=0.3, min_samples=1))
    strict = flower_partition(labels, 5, "dirichlet", 0, FlowerOptions(alpha=0.3, min_samples=min(map(len, first)) + 1))
    assert min(map(len, strict)) > min(map(len, first))  # a later draw of the same generator
    with pytest.raises(ConfigError, match=r"min_samples: .* gave a client \d+ < min_samples 41 samples in all 11"):
        flower_partition(labels, 5, "dirichlet", 0, FlowerOptions(alpha=0.3, min_samples=41))


def test_inner_dirichlet_gives_each_client_its_size_and_skews_its_classes() -> None:
    labels = np.arange(300) % 5
    parts = flower_partition(labels, 4, "inner_dirichlet", 2, FlowerOptions(alpha=0.2, sizes=(30, 60, 90, 120)))
    assert [len(p) for p in parts] == [30, 60, 90, 120]
    assert np.array_equal(np.sort(np.concatenate(parts)), np.arange(300))
    top = [np.bincount(labels[p], minlength=5).max() / len(p) for p in parts]
    assert np.mean(top) > 0.4  # alpha 0.2: a client's prior favours few classes (0.2 would be uniform)
    linear = flower_partition(labels, 4, "inner_dirichlet", 2, FlowerOptions(size_skew="linear"))
    assert [len(p) for p in linear] == [30, 60, 90, 120]


TRAIN_IDS = np.array([3, 1, 3, 0, 2, 1, 4, 0, 2])  # first appearance: 3, 1, 0, 2, 4
TEST_IDS = np.array([0, 4, 4, 1, 2, 3, 3])


@pytest.mark.parametrize("mode, train, test", [
    ("allow-smaller", [[0, 1, 2, 5], [3, 4, 7, 8], [6]], [[3, 5, 6], [0, 4], [1, 2]]),  # {3,1} {0,2} {4}
    ("allow-bigger", [[0, 1, 2, 3, 5, 7], [4, 6, 8]], [[0, 3, 5, 6], [1, 2, 4]]),  # {3,1,0} {2,4}
    ("drop-reminder", [[0, 1, 2, 5], [3, 4, 7, 8]], [[3, 5, 6], [0, 4]]),  # id 4's samples belong to no client
])
def test_grouped_natural_ids_by_hand_with_their_own_test_samples(mode, train, test) -> None:
    cfg_k = len(train)
    data = tiny_dataset(TRAIN_IDS, TEST_IDS)
    part = make_partition(config("data.partition.kind=grouped_natural_id", "data.partition.group_size=2",
                                 f"data.partition.group_mode={mode}", f"data.num_clients={cfg_k}",
                                 "data.client_test=natural", "data.val_fraction=0"), data)
    same([part.train[i] for i in range(cfg_k)], train)
    assert part.test is not None
    same([part.test[i] for i in range(cfg_k)], test)


def test_natural_id_is_one_client_per_id_in_sorted_order() -> None:
    same(natural_members(TRAIN_IDS, natural_groups(TRAIN_IDS, "natural_id")),
         [[3, 7], [1, 5], [4, 8], [0, 2], [6]])
    with pytest.raises(ConfigError, match="group_mode strict needs it to divide the 5 natural ids"):
        natural_groups(TRAIN_IDS, "grouped_natural_id", 2, "strict")
    assert len(natural_groups(TRAIN_IDS, "grouped_natural_id", 9, "allow-smaller")) == 1
    # a test sample of a client with no training samples (id -1) belongs to no client, not to the last id's
    same(natural_members(np.array([-1, 4, 0, -1]), natural_groups(TRAIN_IDS, "natural_id")),
         [[2], [], [], [], [1]])


def test_the_default_partitions_are_fedsims_own_at_the_run_seeds_stream(make_config) -> None:
    cfg = make_config("data.partition.kind=shards", "data.val_fraction=0")
    data = tiny_dataset(np.arange(60) % 6, np.arange(7) % 6)
    want = partition(data.y_train, 10, "shards", rng.seed(cfg.seed, "data/partition"), shards_per_client=2)
    same([make_partition(cfg, data).train[i] for i in range(10)], want)
    flower = make_config("data.partition.kind=shards", "data.partition.flower=true", "data.val_fraction=0")
    same([make_partition(flower, data).train[i] for i in range(10)],
         flower_partition(data.y_train, 10, "shards", 42, FlowerOptions(shards_per_client=2)))


def tiny_dataset(train_ids: np.ndarray, test_ids: np.ndarray) -> Dataset:
    """A three-class 1×8×8 set whose samples carry natural client ids."""
    g = np.random.default_rng(0)
    n, m = len(train_ids), len(test_ids)
    y_train, y_test = np.arange(n) % 3, np.arange(m) % 3
    x = g.normal(size=(n + m, 1, 8, 8)).astype(np.float32)
    x[:, 0, 0, :3] += 3 * np.eye(3, dtype=np.float32)[np.r_[y_train, y_test]]
    return Dataset("tiny_natural", x[:n], y_train, x[n:], y_test, num_classes=3, mean=(0.0,), std=(1.0,),
                   train_ids=np.asarray(train_ids, np.int64), test_ids=np.asarray(test_ids, np.int64),
                   client_names=tuple(f"writer{i}" for i in range(int(max(train_ids.max(), test_ids.max())) + 1)))


def config(*overrides: str):
    from fedsim.configure import load_config

    return load_config(None, ["runtime.backend=local", *overrides])


PLUGIN = '''
import numpy as np
from fedsim.data import Dataset, register_dataset

def tiny(ids, test_ids=None):
    g = np.random.default_rng(0)
    return Dataset("tiny", g.normal(size=(120, 1, 8, 8)).astype(np.float32), np.arange(120) % 10,
                   g.normal(size=(20, 1, 8, 8)).astype(np.float32), np.arange(20) % 10, num_classes=10,
                   mean=(0.0,), std=(1.0,), train_ids=ids, test_ids=test_ids)

register_dataset("tiny_pooled")(lambda root, download: tiny(None))
register_dataset("tiny_natural")(lambda root, download: tiny(np.arange(120) % 4, np.arange(20) % 4))
register_dataset("tiny_train_ids")(lambda root, download: tiny(np.arange(120) % 4))
'''  # no sklearn (digits' loader): each case's process costs a second instead of six

FLOWER = ["data.partition.flower=true"]
BAD = [  # (overrides of 4 clients on tiny_pooled: 120 samples, 10 classes; fragments of the one error line)
    ([*FLOWER, "data.num_clients=10", "data.partition.alpha=0.05", "data.partition.min_samples=12"],
     ["data.partition.min_samples: Flower's Dirichlet(alpha=0.05) split gave a client", "< min_samples 12",
      "all 11 attempts", "10 clients, 120 samples"]),
    (["data.partition.kind=inner_dirichlet", "data.num_clients=2", "data.partition.sizes=[10, 20]"],
     ["data.partition.sizes: they sum to 30, not to the 120 training samples"]),
    (["data.partition.kind=inner_dirichlet", "data.num_clients=2", "data.partition.sizes=[10, 20, 90]"],
     ["data.partition.sizes: 3 sizes for data.num_clients=2"]),
    (["data.partition.kind=pathological", "data.partition.classes_per_client=11"],
     ["data.partition.classes_per_client: 11 classes per client but the training set has 10"]),
    ([*FLOWER, "data.partition.kind=shards", "data.partition.shards_per_client=null"],
     ["data.partition.shards_per_client: Flower's shards need it or data.partition.shard_size; both are null"]),
    ([*FLOWER, "data.partition.kind=shards", "data.partition.shards_per_client=null",
      "data.partition.shard_size=100"], ["data.partition.shard_size: 1 shards of 100 samples for 4 clients"]),
    ([*FLOWER, "data.partition.kind=shards", "data.partition.shard_size=20"],
     ["data.partition.shard_size: 4 clients × 2 shards × 20 samples = 160 exceeds the 120 training samples"]),
    (["data.partition.kind=shards", "data.partition.shard_size=20"],
     ["data.partition.shard_size: an option of Flower's shards; set data.partition.flower: true"]),
    (["data.partition.kind=exponential", "data.num_clients=12"],
     ["data.partition.kind: exponential sizes leave client 0 with 0 of the 120 training samples (each needs >= 1) "
      "at 12 clients"]),
    (["data.partition.kind=natural_id"],
     ["data.partition.kind: natural_id needs each sample's natural client, which dataset 'tiny_pooled' does not "
      "have"]),
    (["data.partition.kind=natural_id", "data.name=tiny_natural", "data.num_clients=3"],
     ["data.num_clients: natural_id makes 4 clients of dataset 'tiny_natural', but data.num_clients is 3"]),
    (["data.partition.kind=natural_id", "data.name=tiny_train_ids", "data.client_test=natural"],
     ["data.client_test: natural needs each test sample's natural client, which dataset 'tiny_train_ids' does not "
      "have"]),
    (["data.client_test=natural"],
     ["data.client_test: natural needs data.partition.kind natural_id or grouped_natural_id, not dirichlet"]),
    (["data.partition.self_balancing=true"],
     ["data.partition.self_balancing: an option of Flower's Dirichlet split; set data.partition.flower: true"]),
]


def test_bad_partition_input_is_one_line_and_exit_2(tmp_path) -> None:
    plugin = tmp_path / "tiny_data.py"
    plugin.write_text(PLUGIN)
    config_text = (f"name: bad\nrounds: 1\nplugins: [{plugin}]\ndata: {{name: tiny_pooled, num_clients: 4}}\n"
                   "participation: {clients_per_round: 2}\n")
    for i, (overrides, fragments) in enumerate(BAD):
        case = tmp_path / str(i)
        case.mkdir()
        proc, root = fedsim_run(case, config_text, *overrides)
        assert_one_line_error(proc, root, *fragments)


def test_a_natural_split_trains_alike_on_one_and_two_workers(make_config) -> None:
    """FedPer on writers' own data, scored on each writer's own test samples (personal_accuracy_*)."""
    from fedsim.results.tables import load
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import Inputs, run

    g = np.random.default_rng(1)
    data = tiny_dataset(g.integers(0, 6, 120), g.integers(0, 6, 36))
    tables = {}
    for workers in (1, 2):
        cfg = make_config("data.partition.kind=grouped_natural_id", "data.partition.group_size=2",
                          "data.num_clients=3", "data.client_test=natural", "algorithm.name=fedper",
                          "participation.clients_per_round=3", "runtime.threads=1", f"results.run_id=w{workers}",
                          rounds=2)
        tables[workers] = load(run(cfg, LocalBackend(num_workers=workers), inputs=Inputs(data=lambda _: data)))
    assert tables[2]["clients"]["worker"].nunique() == 2
    assert "personal_accuracy_mean" in tables[1]["rounds"].columns
    for name in ("rounds", "clients"):
        keep = [c for c in tables[1][name].columns if not c.endswith("_s") and c != "worker"]
        pd.testing.assert_frame_equal(tables[1][name][keep], tables[2][name][keep], obj=name)
