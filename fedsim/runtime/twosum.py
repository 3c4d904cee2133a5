"""Knuth's TwoSum accumulation: hi + lo += w·term elementwise, and the merge of two (hi, lo) pairs.

As whole-buffer torch operations, one exact add is nine passes over the model's weights: 0.31 ms per upload of a
200k-weight MLP on one thread (bench config C, `python -m bench.sum_cost`). Compiled by numba into one loop it
reads each buffer once (0.10-0.12 ms), but loading numba costs a process about 0.4 s and 120 MB. So a process adds
with torch until those adds have taken as long as the load (runs with few or large clients never load it), then
loads the loop: at most twice the best choice's time (ski rental). Only a process with one torch thread (a Ray
worker by default) does: on more, torch spreads each operation over them and the serial loop gains nothing. Both
give the same bits: the loop is strict IEEE (no fast-math, so nothing is reassociated or contracted) and does the
torch operations' arithmetic in their order. Merges are few (one per worker and round) and stay torch operations.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable

import numpy as np
import torch

Kernel = Callable[..., None]
log = logging.getLogger("fedsim.twosum")

LOAD_SECONDS = 0.4  # what loading the compiled loop costs a process (numba's imports, LLVM), measured warm
_torch_seconds = 0.0  # what this process has spent in torch adds so far
_scratch: dict[tuple[int, int], torch.Tensor] = {}  # the torch adds' buffers, by element count and use


def _add_scaled(hi: np.ndarray, lo: np.ndarray, term: np.ndarray, weight: float) -> None:
    for i in range(hi.shape[0]):
        a = hi[i]
        b = weight * term[i]
        s = a + b
        bp = s - a
        lo[i] += (a - (s - bp)) - (bp - b)
        hi[i] = s


@functools.cache
def _kernel() -> Kernel | None:
    """The loop compiled for contiguous float64 buffers, once per process (numba's cache keeps the machine code
    beside this file, or under the user's cache folder, so later processes load it: about 0.4 s, mostly numba's
    own imports). None, said once, where it cannot be had: the torch operations then go on, with the same bits."""
    signature = "void(f8[::1], f8[::1], f8[::1], f8)"
    try:
        import numba

        try:
            return numba.njit(signature, nogil=True, cache=True)(_add_scaled)
        except RuntimeError:  # no writable cache folder: compiled for this process only
            return numba.njit(signature, nogil=True)(_add_scaled)
    except Exception as exc:  # numba missing or unable to compile here: exact adds stay torch operations
        log.warning("exact sums stay torch operations: the compiled loop could not be loaded (%s: %s)",
                    type(exc).__name__, exc)
        return None


def _flat(t: torch.Tensor, written: bool = False) -> torch.Tensor:
    """`t` as one flat run of memory, checked: a CPU float64 tensor (its own memory when it is written to)."""
    if t.dtype != torch.float64 or t.device.type != "cpu":
        raise TypeError(f"TwoSum buffers are CPU float64 tensors, got {t.dtype} on {t.device}")
    if written and not t.is_contiguous():
        raise ValueError("TwoSum accumulators must be contiguous (they are written in place)")
    return t.detach().contiguous().view(-1)


def _same_size(*flats: torch.Tensor) -> None:
    if len({t.numel() for t in flats}) != 1:  # the loop does not check bounds
        raise ValueError(f"TwoSum buffers differ in size: {[t.numel() for t in flats]}")


def add_scaled(hi: torch.Tensor, lo: torch.Tensor, term: torch.Tensor, weight: float, product_exact: bool = False,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """hi + lo += weight·term, elementwise: the new hi takes the rounded sum and lo adds its rounding error; returns
    the tensor that holds the new hi. That is `hi`, unless `out` (a spare buffer like hi) is given and the torch
    operations ran: then it is `out`, and `hi` is left as scratch. `term` is scratch too. `product_exact`: the
    caller knows weight·term is exact in float64 (a term from float32 and a weight of few significant bits), so
    the torch operations may fold the product into the sums."""
    global _torch_seconds
    flats = (_flat(hi, True), _flat(lo, True), _flat(term, True))
    spare = None if out is None else _flat(out, True)
    _same_size(*flats, *(() if spare is None else (spare,)))
    kernel = _kernel() if _loop_pays() else None
    if kernel is None:
        start = time.perf_counter()
        s = _scratch_buffer(flats[0], 1) if spare is None else spare
        _add_scaled_torch(*flats, float(weight), product_exact, s, _scratch_buffer(flats[0], 0))
        if spare is None:
            flats[0].copy_(s)
        _torch_seconds += time.perf_counter() - start
        return hi if out is None else out
    _scratch.clear()
    kernel(*(t.numpy() for t in flats), float(weight))
    return hi


def _scratch_buffer(like: torch.Tensor, slot: int) -> torch.Tensor:
    key = (like.numel(), slot)
    if key not in _scratch:
        _scratch[key] = torch.empty_like(like)
    return _scratch[key]


def compiled() -> bool:
    """Whether this process adds with the compiled loop now."""
    return _loop_pays() and _kernel() is not None


def _loop_pays() -> bool:
    """The torch adds have cost as much as loading the loop, and run on one thread: with more, torch spreads each
    operation over them, and the serial loop gained nothing (0.19 ms per C upload either way on two threads)."""
    return _torch_seconds >= LOAD_SECONDS and torch.get_num_threads() == 1


def _add_scaled_torch(hi: torch.Tensor, lo: torch.Tensor, b: torch.Tensor, weight: float, product_exact: bool,
                      s: torch.Tensor, t: torch.Tensor) -> None:
    """The loop's arithmetic as whole-buffer torch operations: the new hi goes to `s`, the rounding error (added
    to lo) is left in `hi`; `b` and `t` are scratch."""
    if product_exact:  # a + w·b and bp - w·b round as a + (w·b) and bp - (w·b): one pass fewer
        torch.add(hi, b, alpha=weight, out=s)
        torch.sub(s, hi, out=t)
        torch.sub(t, b, alpha=weight, out=b)
    else:
        b.mul_(weight)
        torch.add(hi, b, out=s)  # s = a + b
        torch.sub(s, hi, out=t)  # bp = s - a
        torch.sub(t, b, out=b)   # bp - b
    torch.sub(s, t, out=t)   # ap = s - bp
    hi.sub_(t).sub_(b)       # (a - ap) - (bp - b): the rounding error
    lo.add_(hi)


def merge(hi: torch.Tensor, lo: torch.Tensor, other_hi: torch.Tensor, other_lo: torch.Tensor) -> None:
    """hi + lo += other_hi + other_lo, elementwise (another partial sum folded in). Torch operations: a round merges
    one partial sum per worker, so the driver need not load the compiled loop for it."""
    _same_size(_flat(hi, True), _flat(lo, True), _flat(other_hi), _flat(other_lo))
    s = hi + other_hi
    bp = s - hi
    lo += ((hi - (s - bp)) - (bp - other_hi)) + other_lo
    hi.copy_(s)
