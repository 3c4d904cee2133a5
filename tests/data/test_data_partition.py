"""Properties of fedsim.data.partition: coverage, disjointness, determinism, skew and the 100k-client scale."""

from __future__ import annotations

import time

import numpy as np
import pytest

from fedsim.data import client_test_shards, partition, split_validation
from fedsim.data.partition import label_histograms
from fedsim.errors import ConfigError

LABELS = np.repeat(np.arange(10), 600)  # 6,000 samples, 600 per class


def _check_exact_cover(parts: list[np.ndarray], n: int) -> None:
    flat = np.concatenate(parts)
    assert len(flat) == n and np.array_equal(np.sort(flat), np.arange(n))  # disjoint and complete
    assert all(np.array_equal(p, np.sort(p)) for p in parts)
    assert all(p.dtype == np.int64 for p in parts)


@pytest.mark.parametrize("kind", ["iid", "dirichlet", "shards"])
def test_partition_covers_disjoint_and_is_deterministic(kind: str) -> None:
    parts = partition(LABELS, 20, kind, seed=3)
    _check_exact_cover(parts, len(LABELS))
    again = partition(LABELS, 20, kind, seed=3)
    other = partition(LABELS, 20, kind, seed=4)
    assert all(np.array_equal(a, b) for a, b in zip(parts, again))
    assert any(not np.array_equal(a, b) for a, b in zip(parts, other))


def test_iid_sizes_are_near_equal() -> None:
    sizes = [len(p) for p in partition(LABELS, 7, "iid", 0)]
    assert max(sizes) - min(sizes) <= 1


def test_dirichlet_min_samples_and_skew() -> None:
    parts = partition(LABELS, 50, "dirichlet", 0, alpha=0.1, min_samples=30)
    assert min(len(p) for p in parts) >= 30
    _check_exact_cover(parts, len(LABELS))

    def skew(alpha: float) -> float:  # mean share of a client's most frequent label
        h = label_histograms(LABELS, partition(LABELS, 20, "dirichlet", 1, alpha=alpha, min_samples=1), 10)
        return float((h.max(axis=1) / h.sum(axis=1)).mean())

    assert skew(0.05) > skew(1.0) > skew(100.0)
    assert skew(100.0) < 0.3  # near-iid for a large alpha


def test_dirichlet_infeasible_min_samples_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="data.partition.min_samples"):
        partition(LABELS, 100, "dirichlet", 0, min_samples=61)


def test_dirichlet_100k_clients_on_200k_labels() -> None:
    labels = np.random.default_rng(0).integers(0, 10, 200_000)
    start = time.perf_counter()
    parts = partition(labels, 100_000, "dirichlet", 0, alpha=0.5, min_samples=1)
    assert time.perf_counter() - start < 10
    assert len(parts) == 100_000 and min(len(p) for p in parts) >= 1
    _check_exact_cover(parts, len(labels))


def test_shards_give_label_sorted_shards() -> None:
    parts = partition(LABELS, 100, "shards", 0, shards_per_client=2)  # 200 shards of 30, 20 per class
    assert all(len(p) == 60 for p in parts)
    hist = label_histograms(LABELS, parts, 10)
    assert ((hist % 30) == 0).all() and ((hist > 0).sum(axis=1) <= 2).all()
    _check_exact_cover(parts, len(LABELS))
    with pytest.raises(ConfigError, match="shards_per_client"):
        partition(LABELS[:100], 60, "shards", 0, shards_per_client=2)


def test_unknown_kind_and_bad_clients() -> None:
    with pytest.raises(ConfigError, match="iid"):
        partition(LABELS, 3, "random", 0)
    with pytest.raises(ConfigError, match="num_clients"):
        partition(LABELS, 0, "iid", 0)


def test_split_validation() -> None:
    parts = partition(LABELS, 10, "dirichlet", 0, min_samples=1) + [np.array([5]), np.array([], dtype=np.int64)]
    train, val = split_validation(parts, 0.1, seed=0)
    for p, t, v in zip(parts, train, val):
        assert np.array_equal(np.sort(np.concatenate([t, v])), np.sort(p)) and not np.intersect1d(t, v).size
        assert len(p) == 0 or len(t) >= 1
        assert len(v) == round(0.1 * len(p)) or len(p) <= 1
    train0, val0 = split_validation(parts, 0.0, seed=0)
    assert all(len(v) == 0 for v in val0) and all(np.array_equal(a, b) for a, b in zip(train0, parts))
    again = split_validation(parts, 0.1, seed=0)[1]
    assert all(np.array_equal(a, b) for a, b in zip(val, again))


def test_balanced_test_shards() -> None:
    test_labels = np.repeat(np.arange(10), 100)
    shards = client_test_shards(test_labels, 10, "balanced", seed=0)
    hist = label_histograms(test_labels, shards, 10)
    assert (hist == 10).all()
    assert len(np.unique(np.concatenate(shards))) == 1000  # disjoint while the test set suffices
    tiny = np.repeat(np.arange(10), 2)  # 20 samples for 8 clients: one per class each, shards overlap
    small = client_test_shards(tiny, 8, "balanced", seed=0)
    assert (label_histograms(tiny, small, 10) == 1).all()
    sized = client_test_shards(test_labels, 3, "balanced", seed=0, shard_size=25)
    assert all(len(s) == 25 for s in sized) and (label_histograms(test_labels, sized, 10).max(axis=1) == 3).all()


def test_proportional_test_shards_follow_train_labels() -> None:
    train = partition(LABELS, 5, "dirichlet", 0, alpha=0.1, min_samples=10)
    test_labels = np.repeat(np.arange(10), 100)
    shards = client_test_shards(test_labels, 5, "proportional", 0, train_parts=train, train_labels=LABELS)
    h_train = label_histograms(LABELS, train, 10)
    h_test = label_histograms(test_labels, shards, 10)
    p_train = h_train / h_train.sum(axis=1, keepdims=True)
    p_test = h_test / h_test.sum(axis=1, keepdims=True)
    assert np.abs(p_train - p_test).max() < 0.05
    with pytest.raises(ConfigError):
        client_test_shards(test_labels, 5, "proportional", 0)
