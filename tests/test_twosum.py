"""The exact adds against the same arithmetic written out one numpy operation at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.method import twosum


def _values(rng: np.random.Generator, n: int) -> np.ndarray:
    """float32 values over 30 binades, with signed zeros and exact cancellations mixed in."""
    x = (rng.standard_normal(n) * 10.0 ** rng.integers(-15, 15, n)).astype(np.float32)
    x[rng.random(n) < 0.05] = -0.0
    x[rng.random(n) < 0.05] = 0.0
    return x.astype(np.float64)


def _add_written_out(hi: np.ndarray, lo: np.ndarray, term: np.ndarray, w: float) -> None:
    b = w * term
    s = hi + b
    bp = s - hi
    lo += (hi - (s - bp)) - (bp - b)
    hi[...] = s


def _merge_written_out(hi: np.ndarray, lo: np.ndarray, ohi: np.ndarray, olo: np.ndarray) -> None:
    s = hi + ohi
    bp = s - hi
    lo += ((hi - (s - bp)) - (bp - ohi)) + olo
    hi[...] = s


def test_adding_gives_the_bits_of_the_written_out_arithmetic():
    """Weights whose product with a float32 is exact and others (0.1, 1e-3: the product rounds first), terms over
    30 binades with signed zeros; then a merge. hi and lo match bit for bit, and the sum is exact where it can be."""
    rng = np.random.default_rng(7)
    n = 5003
    hi, lo = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    ref_hi, ref_lo = np.zeros(n), np.zeros(n)
    for w in (3.0, 17.0, 0.1, 2.0 ** 40, 1.0, 1e-3, 4095.0, -5.0):
        term = _values(rng, n)
        _add_written_out(ref_hi, ref_lo, term, w)
        twosum.add_scaled(hi, lo, torch.from_numpy(term), w)
    assert hi.numpy().tobytes() == ref_hi.tobytes() and lo.numpy().tobytes() == ref_lo.tobytes()

    other_hi, other_lo = torch.from_numpy(_values(rng, n)), torch.from_numpy(_values(rng, n) * 2.0 ** -60)
    twosum.merge(hi, lo, other_hi, other_lo)
    _merge_written_out(ref_hi, ref_lo, other_hi.numpy(), other_lo.numpy())
    assert hi.numpy().tobytes() == ref_hi.tobytes() and lo.numpy().tobytes() == ref_lo.tobytes()

    # a term 2^-60 below the running sum is kept in lo, where a plain float64 add drops it
    hi, lo = torch.tensor([1.0, 3.0], dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
    twosum.add_scaled(hi, lo, torch.tensor([2.0 ** -60, 2.0 ** -70], dtype=torch.float64), 1.0)
    twosum.add_scaled(hi, lo, torch.tensor([-1.0, -3.0], dtype=torch.float64), 1.0)
    assert (hi + lo).tolist() == [2.0 ** -60, 2.0 ** -70]


def test_buffers_the_adds_cannot_take_are_refused_before_anything_is_written():
    hi, lo = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    with pytest.raises(ValueError, match="differ in size"):
        twosum.add_scaled(hi, lo, torch.ones(3, dtype=torch.float64), 1.0)
    with pytest.raises(TypeError, match="float64"):
        twosum.add_scaled(hi, lo, torch.ones(4), 1.0)
    with pytest.raises(ValueError, match="contiguous"):
        twosum.add_scaled(hi, lo, torch.ones(4, 2, dtype=torch.float64).t()[0], 1.0)
    strided = torch.zeros(4, 2, dtype=torch.float64).t()
    with pytest.raises(ValueError, match="contiguous"):
        twosum.merge(strided, torch.zeros(2, 4, dtype=torch.float64), torch.ones(2, 4, dtype=torch.float64),
                     torch.zeros(2, 4, dtype=torch.float64))
    whole = torch.zeros(8, dtype=torch.float64)
    with pytest.raises(ValueError, match="overlap"):
        twosum.add_scaled(whole[:4], whole[2:6], torch.ones(4, dtype=torch.float64), 1.0)
    with pytest.raises(ValueError, match="overlap"):
        twosum.add_scaled(hi, lo, torch.ones(4, dtype=torch.float64), 1.0, out=hi)
    meta = torch.empty(4, dtype=torch.float64, device="meta")  # a buffer on another device than hi's
    with pytest.raises(TypeError, match="float64 tensors on cpu, got torch.float64 on meta"):
        twosum.add_scaled(hi, lo, meta, 1.0)
    with pytest.raises(TypeError, match="on cpu, got torch.float64 on meta"):
        twosum.merge(hi, lo, meta, torch.zeros(4, dtype=torch.float64))
    assert not hi.any() and not lo.any() and not strided.any() and not whole.any()
