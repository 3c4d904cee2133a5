"""Both ways of adding (torch operations, the compiled loop) against the same arithmetic written out one numpy
operation at a time."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.runtime import twosum


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


@pytest.fixture(params=["torch", "compiled"])
def way(request, monkeypatch) -> str:
    """Each way a process adds: torch operations (before its adds have taken LOAD_SECONDS), or the compiled loop."""
    monkeypatch.setattr(twosum, "_torch_seconds", 0.0)
    monkeypatch.setattr(twosum, "LOAD_SECONDS", float("inf") if request.param == "torch" else 0.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    return request.param


def test_both_ways_of_adding_give_the_bits_of_the_written_out_arithmetic(way):
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
    assert twosum.compiled() == (way == "compiled")
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


def test_a_process_loads_the_loop_once_its_torch_adds_have_taken_as_long_as_loading_it(monkeypatch):
    """Ski rental: torch adds until they have cost LOAD_SECONDS, the compiled loop after that (their buffers
    dropped), on one torch thread only; the sum's bits do not show where the switch fell."""
    monkeypatch.setattr(twosum, "_torch_seconds", 0.0)
    monkeypatch.setattr(twosum, "LOAD_SECONDS", 0.02)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 2)
    rng = np.random.default_rng(0)
    hi, lo = torch.zeros(4, dtype=torch.float64), torch.zeros(4, dtype=torch.float64)
    twosum.add_scaled(hi, lo, torch.from_numpy(_values(rng, 4)), 1.0)
    monkeypatch.setattr(twosum, "_torch_seconds", 1.0)
    assert not twosum.compiled()  # two threads: the budget is spent, but torch's adds stay
    monkeypatch.setattr(twosum, "_torch_seconds", 0.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    rng = np.random.default_rng(1)
    n = 50_000
    hi, lo = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
    ref_hi, ref_lo = np.zeros(n), np.zeros(n)
    torch_adds = 0
    for i in range(10_000):
        if twosum.compiled():
            break
        term = _values(rng, n)
        _add_written_out(ref_hi, ref_lo, term, 3.0 + i % 5)
        twosum.add_scaled(hi, lo, torch.from_numpy(term), 3.0 + i % 5)
        torch_adds += 1
    assert twosum.compiled() and torch_adds > 1 and twosum._scratch  # the buffers stay until the next add
    for i in range(3):
        term = _values(rng, n)
        _add_written_out(ref_hi, ref_lo, term, 0.1 * (i + 1))
        twosum.add_scaled(hi, lo, torch.from_numpy(term), 0.1 * (i + 1))
    assert not twosum._scratch
    assert hi.numpy().tobytes() == ref_hi.tobytes() and lo.numpy().tobytes() == ref_lo.tobytes()


def test_buffers_the_loops_cannot_take_are_refused_before_anything_is_written(way):
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
    assert not hi.any() and not lo.any() and not strided.any()


def test_where_the_loop_cannot_be_loaded_the_adds_stay_torch_operations_said_once(monkeypatch, caplog):
    """numba missing (or unable to compile) costs speed, not a client: the adds go on with the same bits."""
    import sys

    monkeypatch.setitem(sys.modules, "numba", None)  # `import numba` raises ImportError
    monkeypatch.setattr(twosum, "_torch_seconds", 0.0)
    monkeypatch.setattr(twosum, "LOAD_SECONDS", 0.0)
    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    twosum._kernel.cache_clear()
    try:
        rng = np.random.default_rng(3)
        n = 999
        hi, lo = torch.zeros(n, dtype=torch.float64), torch.zeros(n, dtype=torch.float64)
        ref_hi, ref_lo = np.zeros(n), np.zeros(n)
        with caplog.at_level("WARNING", logger="fedsim.twosum"):
            for w in (3.0, 0.1, 7.0):
                term = _values(rng, n)
                _add_written_out(ref_hi, ref_lo, term, w)
                twosum.add_scaled(hi, lo, torch.from_numpy(term), w)
        assert not twosum.compiled()
        assert hi.numpy().tobytes() == ref_hi.tobytes() and lo.numpy().tobytes() == ref_lo.tobytes()
        said = [r.getMessage() for r in caplog.records if r.name == "fedsim.twosum"]
        assert len(said) == 1 and "ModuleNotFoundError" in said[0]
    finally:
        twosum._kernel.cache_clear()  # later tests load the real loop
