"""Patch selection: FAISS KMeans against brute force, class balancing and entropy pruning on hand-made
inputs and against a plain-loop reference, and the combined pipeline's sizes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.algorithms._selection import SelectionConfig, entropy_prune, kmeans_balance, kmeans_distances, select
from fedsim.config.knobs import from_dict
from fedsim.errors import ConfigError


def _reference_balance(pred, dist, n, balancing, easy_pct, hard_pct):
    """Alg. 2 written as plain loops over sorted python lists (the brute-force reference)."""
    def take(members, count):
        members = sorted(members, key=lambda i: (dist[i], i))
        if count >= len(members):
            return members
        n_easy, n_hard = int(easy_pct / 100 * count), int(hard_pct / 100 * count)
        n_easy += count - n_easy - n_hard
        return members[:n_easy] + (members[len(members) - n_hard:] if n_hard else [])

    classes = sorted(set(pred.tolist()))
    quota = int(n / len(classes) * balancing)
    out = []
    for c in classes:
        out += take([i for i in range(len(pred)) if pred[i] == c], quota)
    left = [i for i in range(len(pred)) if i not in set(out)]
    out += take(left, n - len(out))
    return sorted(out)


def test_faiss_assignments_match_brute_force():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(300, 8)).astype(np.float32)
    labels, dist, centroids = kmeans_distances(x, k=7, niter=10, seed=1, device="cpu")
    d2 = ((x[:, None, :].astype(np.float64) - centroids[None].astype(np.float64)) ** 2).sum(-1)
    np.testing.assert_array_equal(labels, d2.argmin(1))
    np.testing.assert_allclose(dist, np.sqrt(d2.min(1)), rtol=1e-4, atol=1e-4)
    # same distances -> the same selected indices as the brute-force path
    pred = rng.integers(0, 4, 300)
    np.testing.assert_array_equal(kmeans_balance(pred, dist, 60, 1.0, "hard"),
                                  kmeans_balance(pred, np.sqrt(d2.min(1)), 60, 1.0, "hard"))


def test_faiss_finds_separated_blobs():
    rng = np.random.default_rng(1)
    centers = np.array([[0, 0], [20, 0], [0, 20]], dtype=np.float32)
    truth = np.repeat(np.arange(3), 50)
    x = centers[truth] + rng.normal(scale=0.5, size=(150, 2)).astype(np.float32)
    labels, _, _ = kmeans_distances(x, k=3, niter=20, seed=0, device="cpu")
    assert len(set(zip(truth.tolist(), labels.tolist(), strict=True))) == 3  # a bijection of the blobs


def test_balance_hand_examples():
    pred = np.array([0, 0, 0, 0, 1, 1])
    dist = np.array([1.0, 2, 3, 4, 5, 6])
    assert kmeans_balance(pred, dist, 4, 1.0, "hard").tolist() == [2, 3, 4, 5]  # quota 2: farthest per class
    # quota 1 -> {3}, {5}; fill 2 with the farthest leftovers {4 (5.0), 2 (3.0)}
    assert kmeans_balance(pred, dist, 4, 0.5, "hard").tolist() == [2, 3, 4, 5]
    assert kmeans_balance(pred, dist, 3, 1.0, "easy").tolist() == [0, 1, 4]  # quota 1: {0}, {4}; fill {1}
    assert kmeans_balance(pred, dist, 4, 1.0, "mixed", "50-50").tolist() == [0, 3, 4, 5]
    assert kmeans_balance(pred, dist, 2, 0.0, "hard").tolist() == [4, 5]  # no quota: global hardest


@pytest.mark.parametrize("heuristic,mixed,pct", [("hard", "50-50", (0, 100)), ("easy", "50-50", (100, 0)),
                                                 ("mixed", "30-70", (30, 70))])
@pytest.mark.parametrize("balancing", [1.0, 0.5, 0.1])
def test_balance_matches_loop_reference(heuristic, mixed, pct, balancing):
    rng = np.random.default_rng(7)
    for n in (5, 37, 120):
        pred = rng.choice(5, 150, p=[0.5, 0.3, 0.1, 0.07, 0.03])  # some classes below their quota
        dist = rng.random(150)
        got = kmeans_balance(pred, dist, n, balancing, heuristic, mixed)
        assert got.tolist() == _reference_balance(pred, dist, n, balancing, *pct)
        assert len(got) == n and len(set(got.tolist())) == n


def test_entropy_prune_per_class():
    pred = np.array([0, 0, 0, 0, 1, 1])
    conf = np.array([0.9, 0.5, 0.7, 0.6, 0.8, 0.3])
    rng = np.random.default_rng(0)
    assert entropy_prune(pred, conf, 0.5, "top", rng).tolist() == [1, 3, 5]  # most confident removed
    assert entropy_prune(pred, conf, 0.5, "bottom", rng).tolist() == [0, 2, 4]
    kept = entropy_prune(pred, conf, 0.5, "random", rng)
    assert len(kept) == 3 and sum(pred[kept] == 0) == 2
    with pytest.raises(ValueError, match="removal_strategy"):
        entropy_prune(pred, conf, 0.5, "middle", rng)


def test_select_sizes_for_each_mode():
    rng = np.random.default_rng(3)
    emb = rng.normal(size=(1000, 6)).astype(np.float32)
    logits = torch.from_numpy(rng.normal(size=(1000, 4)).astype(np.float32) * 3)
    both = SelectionConfig(n=50, k=20, removal=0.8)
    idx, info = select(emb, logits, both, 1000, seed=0)
    # KMeans keeps 250; dropping int(0.8·size) per class keeps at most one extra patch per class
    assert info["candidates"] == 1000 and 50 <= len(idx) <= 54
    assert np.all(np.diff(idx) > 0)
    km = SelectionConfig(n=50, k=20, entropy=False)
    idx_km, _ = select(emb, logits, km, 1000, seed=0)
    assert len(idx_km) == 50
    ent = SelectionConfig(n=50, kmeans=False, removal=0.8)
    assert ent.candidates(1000) == 250
    idx_e, _ = select(None, logits[:250], ent, 1000, seed=0)
    assert 50 <= len(idx_e) <= 54 and idx_e.max() < 250
    none = SelectionConfig(n=50, kmeans=False, entropy=False)
    idx_n, info_n = select(None, None, none, 1000, seed=0)
    assert idx_n.tolist() == list(range(50)) and info_n["selected"] == 50
    with pytest.raises(ValueError, match="expected model outputs"):
        select(emb[:10], logits[:10], both, 1000, seed=0)


def test_config_errors_name_the_key():
    with pytest.raises(ConfigError, match="selection.*mixed"):
        from_dict(SelectionConfig, {"heuristic": "mixed", "mixed": "60-60"}, prefix="algorithm.selection")
    with pytest.raises(ConfigError, match="algorithm.selection.removal: must be < 1"):
        from_dict(SelectionConfig, {"removal": 1.0}, prefix="algorithm.selection")
