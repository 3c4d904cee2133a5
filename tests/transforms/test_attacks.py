"""Attacks against their formulas, recomputed here with numpy on small seeded vectors: every model-poisoning rule
(min-max and min-sum: the γ found passes its constraint and a slightly larger one fails), the data-poisoning helpers
on images laid out as fedsim.data stores them, and bad arguments refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.stats import norm

from fedsim.transforms.attacks import (
    MODEL_ATTACKS,
    add_trigger,
    craft,
    flip_labels,
    poison_backdoor,
    triggered_test,
)


def updates(rows: int, d: int = 12, seed: int = 0, shift: float = 0.5) -> np.ndarray:
    return np.random.default_rng(seed).normal(shift, 1.0, size=(rows, d))


def t(x: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(x)


OWN, BENIGN = updates(3, seed=1), updates(9, seed=2)


def test_sign_flip_negates_and_scales_own_updates():
    out, diag = craft("sign_flip", t(OWN), t(BENIGN), 12)
    np.testing.assert_array_equal(out.numpy(), -OWN)
    out, diag = craft("sign_flip", t(OWN), t(BENIGN), 12, scale=2.5)
    np.testing.assert_allclose(out.numpy(), -2.5 * OWN, rtol=0, atol=0)
    assert out.dtype == torch.float64 and diag == {"attack/scale": 2.5}


def test_scaling_boosts_by_n_over_a_by_default():
    out, diag = craft("scaling", t(OWN), t(BENIGN), 12)
    np.testing.assert_allclose(out.numpy(), 12 / 3 * OWN, rtol=1e-15)
    assert diag == {"attack/scale": 4.0}
    out, _ = craft("scaling", t(OWN), t(BENIGN), 12, scale=7.0)
    np.testing.assert_allclose(out.numpy(), 7.0 * OWN, rtol=1e-15)


def test_gaussian_rows_come_in_order_from_the_generator():
    def draw(rows: int, seed: int = 5, d: int = 12) -> torch.Tensor:
        own = t(updates(rows, d=d))
        return craft("gaussian", own, own, 10, sigma=0.3, generator=torch.Generator().manual_seed(seed))[0]

    first = draw(3)
    assert torch.equal(first, draw(3)) and not torch.equal(first, draw(3, seed=6))
    assert torch.equal(draw(2), first[:2])  # row i does not depend on how many attackers there are
    g = torch.Generator().manual_seed(5)
    assert torch.equal(first[1], 0.3 * torch.stack([torch.randn(12, generator=g, dtype=torch.float64)
                                                     for _ in range(2)])[1])
    big = draw(2, d=50_000)
    assert abs(big.std().item() - 0.3) < 0.005 and abs(big.mean().item()) < 0.005


@pytest.mark.parametrize(("n", "a", "prob"), [(50, 10, 34 / 50), (51, 12, 37 / 51), (20, 3, 12 / 20),
                                               (10, 6, 9 / 10),  # attackers a majority: one supporter assumed
                                               (2, 1, 0.5)])
def test_alie_z_and_rows(n, a, prob):
    own = updates(a, seed=3)
    out, diag = craft("alie", t(own), t(BENIGN), n)
    z = float(norm.ppf(prob))
    assert diag["attack/z"] == pytest.approx(z, abs=1e-9)
    want = BENIGN.mean(0) + z * BENIGN.std(0, ddof=1)
    np.testing.assert_allclose(out.numpy(), np.tile(want, (a, 1)), rtol=1e-12, atol=1e-12)


def test_alie_named_z_and_the_supporter_count():
    assert math.floor(50 / 2 + 1) - 10 == 16  # the brief's worked example: s = 16, z = Φ^-1(34/50)
    out, diag = craft("alie", t(OWN), t(BENIGN), 50, z=1.5)
    assert diag == {"attack/z": 1.5}
    np.testing.assert_allclose(out.numpy()[2], BENIGN.mean(0) + 1.5 * BENIGN.std(0, ddof=1), rtol=1e-12)


def direction(kind: str, v: np.ndarray) -> np.ndarray:
    mu = v.mean(0)
    return {"unit_vec": mu / np.linalg.norm(mu), "sign": np.sign(mu), "std": -v.std(0, ddof=1)}[kind]


def satisfied(kind: str, m: np.ndarray, v: np.ndarray) -> bool:
    pair = ((v[:, None, :] - v[None, :, :]) ** 2).sum(-1)
    dist = ((m[None] - v) ** 2).sum(-1)
    if kind == "min_max":
        return bool(dist.max() <= pair.max())
    return bool(dist.sum() <= pair.sum(1).min())


@pytest.mark.parametrize("perturbation", ["unit_vec", "sign", "std"])
@pytest.mark.parametrize("kind", ["min_max", "min_sum"])
def test_min_max_and_min_sum_find_the_largest_gamma(kind, perturbation):
    out, diag = craft(kind, t(OWN), t(BENIGN), 12, perturbation=perturbation)
    gamma = diag["attack/gamma"]
    assert 0.1 < gamma < 19  # inside the search's range, so maximality below means something
    p = direction(perturbation, BENIGN)
    m = BENIGN.mean(0) - gamma * p
    np.testing.assert_allclose(out.numpy(), np.tile(m, (3, 1)), rtol=1e-12, atol=1e-12)
    assert satisfied(kind, m, BENIGN)
    assert not satisfied(kind, BENIGN.mean(0) - gamma * (1 + 1e-3) * p, BENIGN)


def test_min_max_with_colluders_only():
    """Colluders pass their own updates as the reference; one update alone leaves no room (γ = 0, m = μ)."""
    out, diag = craft("min_max", t(OWN), t(OWN), 12, perturbation="sign")
    assert satisfied("min_max", out.numpy()[0], OWN) and diag["attack/gamma"] > 0
    out, diag = craft("min_max", t(OWN[:1]), t(OWN[:1]), 12, perturbation="sign")
    assert diag == {"attack/gamma": 0.0}
    np.testing.assert_array_equal(out.numpy(), OWN[:1])


def test_ipm_sends_minus_epsilon_times_the_benign_mean():
    out, diag = craft("ipm", t(OWN), t(BENIGN), 12)
    np.testing.assert_allclose(out.numpy(), np.tile(-0.1 * BENIGN.mean(0), (3, 1)), rtol=1e-12)
    out, diag = craft("ipm", t(OWN), t(BENIGN), 12, epsilon=4.0)
    np.testing.assert_allclose(out.numpy()[0], -4.0 * BENIGN.mean(0), rtol=1e-12)
    assert diag == {"attack/epsilon": 4.0}


def test_outputs_are_new_float64_tensors():
    own = t(OWN.copy())
    for kind in MODEL_ATTACKS:
        out, diag = craft(kind, own, own, 12, generator=torch.Generator().manual_seed(0))
        assert out.shape == own.shape and out.dtype == torch.float64
        assert all(isinstance(v, float) for v in diag.values())
        out += 1.0  # writing to the result never touches the input
    np.testing.assert_array_equal(own.numpy(), OWN)


@pytest.mark.parametrize(("call", "message"), [
    (lambda: craft("flip", t(OWN), t(BENIGN), 12), "unknown attack 'flip'"),
    (lambda: craft("gaussian", t(OWN), t(BENIGN), 12), "needs a generator"),
    (lambda: craft("alie", t(OWN), t(BENIGN[:1]), 12), "at least 2 reference"),
    (lambda: craft("min_sum", t(OWN), t(BENIGN), 12, perturbation="abs"), "unknown perturbation 'abs'"),
    (lambda: craft("min_max", t(OWN), t(BENIGN[:1]), 12, perturbation="std"), "at least 2 reference"),
    (lambda: craft("ipm", t(OWN), t(BENIGN[:, :5]), 12), "columns"),
    (lambda: craft("scaling", t(OWN), t(BENIGN), 2), "cannot hold 3 attackers"),
    (lambda: craft("sign_flip", t(OWN[0]), t(BENIGN), 12), "2-d"),
])
def test_bad_arguments_are_one_line_value_errors(call, message):
    with pytest.raises(ValueError, match=message) as err:
        call()
    assert "\n" not in str(err.value)


# ---------------------------------------------------------------- data poisoning


def images(n: int, channels: int, size: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).normal(size=(n, channels, size, size)).astype(np.float32))


def test_flip_labels():
    y = torch.tensor([0, 3, 9, 5])
    assert flip_labels(y, 10).tolist() == [9, 6, 0, 4] and y.tolist() == [0, 3, 9, 5]
    with pytest.raises(ValueError, match="0..9"):
        flip_labels(torch.tensor([10]), 10)


@pytest.mark.parametrize(("mean", "std"), [((0.3,), (0.4,)), ((0.49, 0.48, 0.45), (0.25, 0.24, 0.26))])
def test_add_trigger_sets_the_patch_in_raw_space(mean, std):
    x = images(5, len(mean))
    before = x.clone()
    out = add_trigger(x, 3, 1.0, mean, std)
    assert torch.equal(x, before)  # not mutated
    m, s = np.asarray(mean).reshape(1, -1, 1, 1), np.asarray(std).reshape(1, -1, 1, 1)
    raw = out.numpy().astype(np.float64) * s + m
    np.testing.assert_allclose(raw[:, :, 5:, 5:], 1.0, rtol=0, atol=1e-6)
    mask = np.ones(raw.shape, dtype=bool)
    mask[:, :, 5:, 5:] = False
    np.testing.assert_array_equal(out.numpy()[mask], x.numpy()[mask])


def test_add_trigger_on_the_embedded_digits():
    from fedsim.data import load_dataset

    ds = load_dataset("digits")
    x = torch.from_numpy(ds.x_test[:4])
    assert x.shape == (4, 1, 8, 8)  # fedsim stores N×C×H×W, normalised with per-channel mean/std of pixels/16
    raw = add_trigger(x, 2, 1.0, ds.mean, ds.std).numpy() * ds.std[0] + ds.mean[0]
    np.testing.assert_allclose(raw[:, 0, 6:, 6:], 1.0, atol=1e-5)


@pytest.mark.parametrize(("x", "size", "mean", "message"), [
    (torch.zeros(4, 64), 2, (0.0,), "N×C×H×W"),
    (torch.zeros(4, 8, 8), 2, (0.0,), "N×C×H×W"),
    (torch.zeros(4, 5, dtype=torch.int64), 2, (0.0,), "N×C×H×W"),
    (torch.zeros(4, 1, 8, 8), 9, (0.0,), "size must be in 1..8"),
    (torch.zeros(4, 3, 8, 8), 2, (0.0, 0.0), "mean has 2 values"),
])
def test_add_trigger_refuses_what_cannot_carry_a_patch(x, size, mean, message):
    with pytest.raises(ValueError, match=message):
        add_trigger(x, size, 1.0, mean, (1.0,))


def test_poison_backdoor_count_labels_and_reproducibility():
    x, y = images(40, 1), torch.arange(40) % 10
    x0, y0 = x.clone(), y.clone()

    def poison(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
        return poison_backdoor(x, y, 7, 0.25, torch.Generator().manual_seed(seed), 2, 1.0, (0.3,), (0.4,))

    px, py = poison(0)
    assert torch.equal(x, x0) and torch.equal(y, y0)
    changed = (px != x).flatten(1).any(1)
    assert int(changed.sum()) == 10  # ⌊0.25·40⌋ rows, each triggered
    triggered = add_trigger(x, 2, 1.0, (0.3,), (0.4,))
    assert torch.equal(px[changed], triggered[changed]) and torch.equal(px[~changed], x[~changed])
    assert (py[changed] == 7).all() and torch.equal(py[~changed], y[~changed])
    qx, qy = poison(0)
    assert torch.equal(px, qx) and torch.equal(py, qy)
    assert not torch.equal(poison(1)[0], px)


def test_poison_backdoor_rounds_the_count_as_meant():
    x, y = images(100, 1, size=4), torch.zeros(100, dtype=torch.int64)
    assert 0.29 * 100 < 29
    _, py = poison_backdoor(x, y, 3, 0.29, torch.Generator().manual_seed(0), 1, 1.0, (0.0,), (1.0,))
    assert int((py == 3).sum()) == 29


def test_triggered_test_drops_the_target_class():
    x, y = images(30, 3), torch.arange(30) % 5
    tx, ty = triggered_test(x, y, 2, 3, 1.0, (0.5,), (0.25,))
    assert len(tx) == len(ty) == 24 and (ty == 2).all() and ty.dtype == y.dtype
    np.testing.assert_array_equal(tx.numpy(), add_trigger(x[y != 2], 3, 1.0, (0.5,), (0.25,)).numpy())
