"""Knuth's TwoSum accumulation: hi + lo += w·term, fused into one pass, and the merge of two (hi, lo) pairs.

Written as whole-buffer torch operations, one exact add is eight passes over the model's weights, which made it
the largest cost of a small client after its training (285 µs of a 200k-weight MLP's ~1 ms, bench config C).
Compiled by numba into one loop it reads each buffer once (52 µs). The arithmetic is strict IEEE (no fast-math,
so nothing is reassociated or contracted): the same bits as the operations written out one by one, on every
machine. Merges are few (one per worker and round) and stay torch operations.
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import numpy as np
import torch

Kernel = Callable[..., None]


def _add_scaled(hi: np.ndarray, lo: np.ndarray, term: np.ndarray, weight: float) -> None:
    for i in range(hi.shape[0]):
        a = hi[i]
        b = weight * term[i]
        s = a + b
        bp = s - a
        lo[i] += (a - (s - bp)) - (bp - b)
        hi[i] = s


@functools.cache
def _kernel() -> Kernel:
    """The loop compiled for contiguous float64 buffers, once per process (numba's cache keeps the machine code
    beside this file, or under the user's cache folder, so later processes load it: about 0.4 s, mostly numba's
    own imports)."""
    import numba

    signature = "void(f8[::1], f8[::1], f8[::1], f8)"
    try:
        return numba.njit(signature, nogil=True, cache=True)(_add_scaled)
    except RuntimeError:  # no writable cache folder: compiled for this process only
        return numba.njit(signature, nogil=True)(_add_scaled)


def _buffer(t: torch.Tensor, written: bool = False) -> np.ndarray:
    """A CPU float64 tensor as the flat array the kernels take (the tensor's own memory when it is written to)."""
    if t.dtype != torch.float64 or t.device.type != "cpu":
        raise TypeError(f"TwoSum buffers are CPU float64 tensors, got {t.dtype} on {t.device}")
    if written and not t.is_contiguous():
        raise ValueError("TwoSum accumulators must be contiguous (they are written in place)")
    return t.detach().contiguous().view(-1).numpy()


def _same_size(*arrays: np.ndarray) -> None:
    if len({a.shape[0] for a in arrays}) != 1:  # the loops do not check bounds
        raise ValueError(f"TwoSum buffers differ in size: {[a.shape[0] for a in arrays]}")


def add_scaled(hi: torch.Tensor, lo: torch.Tensor, term: torch.Tensor, weight: float) -> None:
    """hi + lo += weight·term, elementwise: hi takes the rounded sum and lo adds its rounding error (term is left
    as it is; weight·term is exact when the weight has few significant bits and the term came from float32)."""
    arrays = (_buffer(hi, True), _buffer(lo, True), _buffer(term))
    _same_size(*arrays)
    _kernel()(*arrays, float(weight))


def merge(hi: torch.Tensor, lo: torch.Tensor, other_hi: torch.Tensor, other_lo: torch.Tensor) -> None:
    """hi + lo += other_hi + other_lo, elementwise (another partial sum folded in). Torch operations: a round merges
    one partial sum per worker, so the driver need not load the compiled loop for it."""
    _same_size(_buffer(hi, True), _buffer(lo, True), _buffer(other_hi), _buffer(other_lo))
    s = hi + other_hi
    bp = s - hi
    lo += ((hi - (s - bp)) - (bp - other_hi)) + other_lo
    hi.copy_(s)
