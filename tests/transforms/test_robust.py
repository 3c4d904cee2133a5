"""Robust aggregation rules against hand computations written here with plain loops and numpy (never the module's
helpers), their refusals, and a sanity check that the robust ones shrug off far outliers where the mean does not."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import trim_mean

from fedsim.transforms import robust
from fedsim.transforms.robust import SUM_COMPATIBLE, aggregate, requirement


def rows(n: int, d: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).normal(size=(n, d))


def t(a: np.ndarray) -> torch.Tensor:
    return torch.tensor(a, dtype=torch.float64)


def ones(n: int) -> torch.Tensor:
    return torch.ones(n, dtype=torch.float64)


def hand_sq_distances(x: np.ndarray) -> np.ndarray:
    n = len(x)
    out = np.zeros((n, n))
    for i in range(n):
        for j in range(n):
            out[i, j] = float(np.sum((x[i] - x[j]) ** 2))
    return out


def hand_scores(x: np.ndarray, f: int) -> list[float]:
    """Krum's score, with k from this n (at least 1), self left out by index."""
    n, dist = len(x), hand_sq_distances(x)
    k = min(n - 1, max(1, n - f - 2))
    return [sum(sorted(dist[i, j] for j in range(n) if j != i)[:k]) for i in range(n)]


def first_lowest(values: list[float], m: int = 1) -> list[int]:
    return sorted(range(len(values)), key=lambda i: (values[i], i))[:m]


def hand_bulyan_selection(x: np.ndarray, f: int) -> list[int]:
    left, picked = list(range(len(x))), []
    while len(picked) < len(x) - 2 * f:
        best = left[first_lowest(hand_scores(x[left], f))[0]]
        picked.append(best)
        left.remove(best)
    return sorted(picked)


def hand_closest_mean(picked: np.ndarray, keep: int) -> np.ndarray:
    out = []
    for column in picked.T:
        med = np.median(column)
        closest = sorted(sorted(column), key=lambda v: abs(v - med))[:keep]  # stable: ties to the smaller value
        out.append(np.mean(closest))
    return np.array(out)


def hand_weiszfeld(x: np.ndarray, w: np.ndarray, nu: float, max_iter: int, ftol: float) -> tuple[np.ndarray, int]:
    alpha = w / w.sum()
    z = np.sum(alpha[:, None] * x, axis=0)
    obj = sum(a * np.linalg.norm(z - v) for a, v in zip(alpha, x))
    steps = 0
    for _ in range(max_iter):
        beta = np.array([a / max(nu, np.linalg.norm(z - v)) for a, v in zip(alpha, x)])
        z = np.sum(beta[:, None] * x, axis=0) / beta.sum()
        prev, obj = obj, sum(a * np.linalg.norm(z - v) for a, v in zip(alpha, x))
        steps += 1
        if abs(prev - obj) < ftol * obj:
            break
    return z, steps


# --- mean, Krum, Multi-Krum


def test_mean_is_the_weighted_mean():
    x, w = rows(7, 5), np.arange(1.0, 8.0)
    out = aggregate("mean", t(x), t(w))
    np.testing.assert_allclose(out.aggregate.numpy(), (w[:, None] * x).sum(0) / w.sum(), rtol=1e-12)
    assert out.kept.all() and out.info == {}


def test_squared_distances_match_a_hand_computation_symmetric_with_a_zero_diagonal():
    x = rows(9, 5000, seed=1) * 1e-2  # update-sized rows
    x[4] = x[2]  # an exact duplicate
    got = robust.squared_distances(t(x)).numpy()
    assert (np.diag(got) == 0).all() and (got == got.T).all() and (got >= 0).all()
    np.testing.assert_allclose(got, hand_sq_distances(x), rtol=1e-9, atol=1e-12)
    assert got[2, 4] <= 1e-15 * got.max()


def test_krum_picks_the_lowest_score_over_the_n_minus_f_minus_2_nearest():
    x, f = rows(7, 5, seed=3), 1
    x[6] += 8.0  # an outlier
    scores = hand_scores(x, f)
    best = first_lowest(scores)[0]
    out = aggregate("krum", t(x), ones(7), f)
    assert out.aggregate.tolist() == x[best].tolist()
    assert out.kept.nonzero().flatten().tolist() == [best]
    np.testing.assert_allclose(robust.krum_scores(t(hand_sq_distances(x)), f).numpy(), scores, rtol=1e-12)


def test_krum_ties_go_to_the_lowest_index():
    x, f = rows(7, 5, seed=4) * 3, 1
    x[5] = x[2] = np.zeros(5)  # two identical rows at the middle of the cloud: equal, lowest scores
    scores = hand_scores(x, f)
    assert scores[2] == scores[5] == min(scores)
    out = aggregate("krum", t(x), ones(7), f)
    assert out.kept.nonzero().flatten().tolist() == [2]
    x[0] = 0.0  # a third copy, at a lower index
    scores = hand_scores(x, f)
    assert scores[0] == scores[2] == scores[5] == min(scores)
    assert aggregate("krum", t(x), ones(7), f).kept.nonzero().flatten().tolist() == [0]


def test_multi_krum_averages_the_m_lowest_with_their_weights():
    x, w, f, m = rows(7, 5, seed=5), np.array([3.0, 1, 4, 1, 5, 9, 2]), 1, 3
    x[0] += 5.0
    chosen = first_lowest(hand_scores(x, f), m)
    out = aggregate("multi_krum", t(x), t(w), f, m=m)
    assert sorted(out.kept.nonzero().flatten().tolist()) == sorted(chosen)
    want = sum(w[i] * x[i] for i in chosen) / sum(w[i] for i in chosen)
    np.testing.assert_allclose(out.aggregate.numpy(), want, rtol=1e-12)
    default = aggregate("multi_krum", t(x), t(w), f)  # m = n - f
    assert sorted(default.kept.nonzero().flatten().tolist()) == sorted(first_lowest(hand_scores(x, f), 6))


# --- Bulyan


@pytest.mark.parametrize(("n", "f", "integers"), [(11, 2, False), (7, 1, False), (11, 2, True), (15, 3, True)])
def test_bulyan_selects_theta_by_recursive_krum_then_averages_the_beta_closest_to_the_median(n, f, integers):
    rng = np.random.default_rng(n + f)
    x = rng.integers(0, 4, size=(n, 6)).astype(float) if integers else rng.normal(size=(n, 6))  # ints: many ties
    x[-f:] += 20.0  # the attackers, far off
    out = aggregate("bulyan", t(x), ones(n), f)
    picked = hand_bulyan_selection(x, f)
    assert out.kept.nonzero().flatten().tolist() == picked and len(picked) == n - 2 * f
    np.testing.assert_allclose(out.aggregate.numpy(), hand_closest_mean(x[picked], n - 4 * f), rtol=1e-12)


def test_bulyan_without_byzantine_rows_is_the_mean():
    x = rows(5, 4, seed=6)
    out = aggregate("bulyan", t(x), ones(5), 0)
    np.testing.assert_allclose(out.aggregate.numpy(), x.mean(0), rtol=1e-12)
    assert out.kept.all()


# --- coordinate-wise median and trimmed mean


@pytest.fixture(params=["sort", "select"])
def coordinate_path(request, monkeypatch):
    """Both ways the median and trimmed mean compute: one sort (small cohorts) and numpy's selection by blocks of
    columns on two threads (one column a block, so that every thread gets several)."""
    if request.param == "select":
        monkeypatch.setattr(robust, "_SORT_BELOW", 0)
        monkeypatch.setattr(robust, "_BLOCK", 1)
        monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    return request.param


@pytest.mark.parametrize("n", [7, 8])
def test_median_is_numpys_even_for_an_even_count(n, coordinate_path):
    x = rows(n, 5, seed=n)
    x[:, 0] = np.arange(n)  # even n: (n/2 - 1 + n/2) / 2, not the lower middle value
    x[:, 1:3] = np.random.default_rng(n).integers(0, 3, size=(n, 2))  # ties at the middle
    x[:, 3] = [1.0] * (n // 2 + 1) + [2.0] * (n - n // 2 - 1)
    out = aggregate("median", t(x), ones(n))
    np.testing.assert_array_equal(out.aggregate.numpy(), np.median(x, axis=0))
    assert out.kept.all()


@pytest.mark.parametrize(("n", "beta"), [(10, 0.25), (7, 0.3), (13, 0.1), (7, 0.1)])
def test_trimmed_mean_cuts_floor_beta_n_from_each_side(n, beta, coordinate_path):
    x = rows(n, 5, seed=n)
    cut = int(np.floor(beta * n))
    want = np.array([np.mean(sorted(col)[cut:n - cut]) for col in x.T])
    out = aggregate("trimmed_mean", t(x), ones(n), beta=beta)
    np.testing.assert_allclose(out.aggregate.numpy(), want, rtol=1e-12)
    np.testing.assert_allclose(out.aggregate.numpy(), trim_mean(x, beta, axis=0), rtol=1e-12)


# --- geometric median


def test_geometric_median_runs_smoothed_weiszfeld_to_tolerance():
    x, w = rows(7, 5, seed=7), np.array([1.0, 2, 3, 1, 2, 3, 4])
    x[3] += 10.0
    z, steps = hand_weiszfeld(x, w, 1e-5, 100, 1e-6)
    out = aggregate("geometric_median", t(x), t(w))
    assert out.info == {"iterations": steps} and 1 < steps < 100
    np.testing.assert_allclose(out.aggregate.numpy(), z, rtol=1e-10)
    capped = aggregate("geometric_median", t(x), t(w), max_iter=2)
    assert capped.info["iterations"] == 2
    np.testing.assert_allclose(capped.aggregate.numpy(), hand_weiszfeld(x, w, 1e-5, 2, 1e-6)[0], rtol=1e-10)


def test_geometric_median_nearly_minimises_the_weighted_distance_sum():
    x, w = rows(7, 5, seed=8), np.array([1.0, 2, 3, 1, 2, 3, 4])
    z = aggregate("geometric_median", t(x), t(w), max_iter=1000, ftol=1e-14).aggregate.numpy()
    objective = lambda p: float(sum(a * np.linalg.norm(p - v) for a, v in zip(w, x)))
    rng = np.random.default_rng(0)
    for _ in range(50):
        assert objective(z) <= objective(z + 1e-3 * rng.normal(size=5)) + 1e-12
    same = aggregate("geometric_median", t(np.ones((4, 3))), ones(4))  # objective 0: stops at once
    assert same.info["iterations"] == 1 and same.aggregate.tolist() == [1.0, 1.0, 1.0]


# --- norm bounding, centred clipping, FLTrust


def test_norm_bound_clips_each_row_then_takes_the_weighted_mean():
    x, w = rows(7, 5, seed=9), np.arange(1.0, 8.0)
    x[1] *= 10
    x[4] = 0.0
    bound = 2.0
    clipped = [v * min(1.0, bound / np.linalg.norm(v)) if np.linalg.norm(v) > 0 else v for v in x]
    want = sum(wi * v for wi, v in zip(w, clipped)) / w.sum()
    out = aggregate("norm_bound", t(x), t(w), bound=bound)
    np.testing.assert_allclose(out.aggregate.numpy(), want, rtol=1e-12)
    assert out.info == {"clipped": sum(np.linalg.norm(v) > bound for v in x)} and out.kept.all()


def test_norm_bound_noise_is_drawn_once_from_the_callers_generator():
    x, bound, noise = rows(7, 5, seed=10), 1.5, 0.1
    clean = aggregate("norm_bound", t(x), ones(7), bound=bound).aggregate
    noisy = [aggregate("norm_bound", t(x), ones(7), bound=bound, noise=noise,
                       generator=torch.Generator().manual_seed(s)).aggregate for s in (3, 3, 4)]
    assert torch.equal(noisy[0], noisy[1]) and not torch.equal(noisy[0], noisy[2])
    expected = noise * torch.randn(5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    torch.testing.assert_close(noisy[0] - clean, expected, rtol=1e-12, atol=1e-15)
    g = torch.Generator().manual_seed(5)
    aggregate("norm_bound", t(x), ones(7), bound=bound, generator=g)  # noise 0: nothing drawn
    assert torch.equal(g.get_state(), torch.Generator().manual_seed(5).get_state())
    with pytest.raises(ValueError, match="generator"):
        aggregate("norm_bound", t(x), ones(7), bound=bound, noise=noise)


def test_centered_clip_iterates_from_the_center():
    x, tau, iterations = rows(7, 5, seed=11), 1.2, 3
    x[0] += 30.0
    center = np.full(5, 0.3)
    v = center.copy()
    for _ in range(iterations):
        diffs = [xi - v for xi in x]
        clipped = sum(np.linalg.norm(u) > tau for u in diffs)
        v = v + sum(u * min(1.0, tau / np.linalg.norm(u)) for u in diffs) / len(x)
    out = aggregate("centered_clip", t(x), t(np.arange(1.0, 8.0)), center=t(center), tau=tau, iterations=iterations)
    np.testing.assert_allclose(out.aggregate.numpy(), v, rtol=1e-12)  # unweighted: the weights play no part
    assert out.info == {"clipped": clipped} and out.kept.all()
    from_zero = aggregate("centered_clip", t(x), ones(7), tau=1e6)  # nothing clipped, one step from 0: the mean
    np.testing.assert_allclose(from_zero.aggregate.numpy(), x.mean(0), rtol=1e-12)


def test_fltrust_weighs_rows_by_their_clipped_cosine_to_the_root_update():
    x, root = rows(7, 5, seed=12), rows(1, 5, seed=13)[0]
    x[2] = -3.0 * root  # opposite direction: trust 0
    x[5] = 0.0  # no direction: trust 0
    trust, rescaled = [], []
    for v in x:
        nv = np.linalg.norm(v)
        trust.append(max(0.0, float(v @ root) / (nv * np.linalg.norm(root))) if nv > 0 else 0.0)
        rescaled.append(v * np.linalg.norm(root) / nv if nv > 0 else v)
    want = sum(s * v for s, v in zip(trust, rescaled)) / sum(trust)
    out = aggregate("fltrust", t(x), ones(7), root=t(root))
    np.testing.assert_allclose(out.aggregate.numpy(), want, rtol=1e-12)
    assert out.kept.tolist() == [s > 0 for s in trust] and not out.kept[2] and not out.kept[5]
    assert out.info["trust_sum"] == pytest.approx(sum(trust), rel=1e-12)
    none = aggregate("fltrust", t(-np.abs(x)), ones(7), root=t(np.abs(root) + 1))  # every cosine negative
    assert none.aggregate.tolist() == [0.0] * 5 and not none.kept.any() and none.info == {"trust_sum": 0.0}


# --- refusals


def test_requirements_as_text_and_as_value_errors():
    assert requirement("krum", 6, 2) == "krum needs n > 2f + 2 (n=6, f=2)"
    assert requirement("multi_krum", 7, 2) is None and requirement("krum", 7, 2) is None
    assert requirement("bulyan", 10, 2) == "bulyan needs n >= 4f + 3 (n=10, f=2)"
    assert requirement("bulyan", 11, 2) is None
    assert requirement("trimmed_mean", 10, 0, beta=0.5) == "trimmed_mean needs 0 <= beta < 0.5 (beta=0.5)"
    assert requirement("median", 3, 0) is None and requirement("mean", 0, 0) is not None
    x = t(rows(6, 3))
    for name, f, kwargs, match in [("krum", 2, {}, r"krum needs n > 2f \+ 2 \(n=6, f=2\)"),
                                   ("multi_krum", 2, {}, r"n > 2f \+ 2"),
                                   ("bulyan", 1, {}, r"bulyan needs n >= 4f \+ 3 \(n=6, f=1\)"),
                                   ("trimmed_mean", 0, {"beta": 0.5}, r"beta < 0\.5"),
                                   ("multi_krum", 0, {"m": 7}, r"1 <= m <= n"),
                                   ("norm_bound", 0, {}, "needs bound"),
                                   ("norm_bound", 0, {"bound": 0.0}, "bound > 0"),
                                   ("fltrust", 0, {}, "needs root"),
                                   ("nope", 0, {}, "unknown robust aggregator")]:
        with pytest.raises(ValueError, match=match):
            aggregate(name, x, ones(6), f, **kwargs)
    bad = rows(6, 3)
    bad[4, 1] = np.nan
    with pytest.raises(ValueError, match=r"rows \[4\]"):
        aggregate("median", t(bad), ones(6))
    with pytest.raises(ValueError, match="weights"):
        aggregate("mean", x, torch.zeros(6, dtype=torch.float64))


def test_sum_compatible_rules_and_the_configs_names():
    from typing import get_args, get_type_hints

    from fedsim.config.schema import AggregatorConfig

    assert SUM_COMPATIBLE == {"mean", "norm_bound"} and SUM_COMPATIBLE <= set(robust.RULES)
    assert get_args(get_type_hints(AggregatorConfig)["name"]) == robust.RULES


# --- blocks and robustness


def test_small_blocks_give_the_same_numbers(monkeypatch):
    x, w = rows(15, 11, seed=14), np.arange(1.0, 16.0)
    x[13:] += 9.0
    kwargs = {"bound": 2.0, "root": t(x[0]), "center": t(x[1]), "beta": 0.2}
    whole = {name: aggregate(name, t(x), t(w), 3, **kwargs) for name in robust.RULES}
    monkeypatch.setattr(robust, "_BLOCK", 1)  # one column per block
    for name, out in whole.items():
        blocked = aggregate(name, t(x), t(w), 3, **kwargs)
        torch.testing.assert_close(blocked.aggregate, out.aggregate, rtol=1e-12, atol=1e-14, msg=name)
        assert torch.equal(blocked.kept, out.kept) and blocked.info == out.info, name


def test_robust_rules_stay_near_the_benign_point_the_mean_leaves():
    rng = np.random.default_rng(15)
    point = rng.normal(size=20)
    x = np.vstack([point + 0.01 * rng.normal(size=(10, 20)), point + 100.0 * rng.normal(size=(3, 20))])
    x = x[rng.permutation(13)]
    off = {name: np.linalg.norm(aggregate(name, t(x), ones(13), f, beta=0.25).aggregate.numpy() - point)
           for name, f in [("mean", 0), ("krum", 3), ("multi_krum", 3), ("median", 0), ("trimmed_mean", 0),
                           ("geometric_median", 0), ("bulyan", 2)]}
    assert off.pop("mean") > 10
    assert all(v < 0.05 for v in off.values()), off


@pytest.mark.parametrize("n", [1, 15])
def test_no_rule_changes_the_updates_it_reads(n, coordinate_path):
    """The coordinate-wise rules reorder their own copy of each block in place, never the caller's rows (a single
    row's transposed block is contiguous already: it must still be copied)."""
    x = rows(n, 9, seed=16)
    before = t(x)
    given = before.clone()
    kwargs = {"bound": 2.0, "root": t(x[0]), "center": t(x[-1]), "beta": 0.2}
    for name in robust.RULES:
        if robust.requirement(name, n, 1 if n > 10 else 0, 0.2) is None:
            aggregate(name, given, ones(n), 1 if n > 10 else 0, **kwargs)
    assert torch.equal(given, before)
