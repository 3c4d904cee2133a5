"""Order-independent weighted sums: double-double (float64 pair) accumulation.

Each term w·x (integer-ish weight, float32 value) is exact in float64; accumulating with Knuth's TwoSum
(fedsim.method.twosum) keeps the error near 2^-106 relative, so the float32 result
does not depend on how clients were grouped into workers or in which order partial sums arrive.

While every payload has the same keys and shapes in the same order (one architecture: the usual case), the
accumulators are one flat float64 buffer each: an upload costs a copy and one TwoSum over the whole buffer instead
of one of each per tensor. The arithmetic is elementwise either way, so every layout gives the same bits.

`WeightedSum(exact=False)` (runtime.exact_sum: false) adds a flat payload into hi in plain float64 instead, with a
rounding error near 2^-53 relative that depends on the order of the additions (so, rarely, on the worker count).
Partial sums are still merged exactly.

A worker whose clients train on a GPU sums there (`WeightedSum(device=...)`, the torch operations, the same bits) and
hands the sum over on the CPU (`to_cpu`): a client's upload then never leaves the GPU.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from fedsim.errors import AggregationError
from fedsim.method import twosum

Layout = tuple[tuple[str, torch.Size, torch.dtype], ...]

# values of these dtypes have at most 24 significant bits, so times a weight of at most 29 they are exact in float64
NARROW_DTYPES = frozenset({torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.uint8, torch.int8,
                           torch.int16})


def exact_product(weight: float) -> bool:
    """Whether w·x is exact in float64 for every x of a narrow dtype: at most 29 significant bits, and an exponent
    far from float64's overflow and underflow."""
    if not math.isfinite(weight) or weight == 0:
        return False
    mantissa, exponent = math.frexp(weight)
    return abs(exponent) < 500 and (mantissa * 2.0 ** 29).is_integer()


def _layout(payload: dict[str, torch.Tensor]) -> Layout:
    return tuple((k, v.shape, v.dtype) for k, v in payload.items())


class _Flat:
    """The hi/lo accumulators of one payload layout as one float64 buffer each, with a buffer for the incoming term
    and its per-key views."""

    def __init__(self, layout: Layout, hi: torch.Tensor, lo: torch.Tensor) -> None:
        self.layout, self.hi, self.lo = layout, hi, lo
        self.narrow = all(dtype in NARROW_DTYPES for _, _, dtype in layout)
        self._term: tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]] | None = None  # term, spare, views

    @classmethod
    def of(cls, payload: dict[str, torch.Tensor], weight: float, device: torch.device | None = None) -> _Flat:
        """The accumulators holding w·payload (hi) and zeros (lo), on `device` (default: the CPU)."""
        hi = torch.empty(sum(v.numel() for v in payload.values()), dtype=torch.float64, device=device)
        flat = cls(_layout(payload), hi, torch.zeros_like(hi))
        flat.load(hi, payload)
        hi.mul_(weight)
        return flat

    def views(self, buffer: torch.Tensor) -> list[torch.Tensor]:
        """`buffer` cut into this layout's tensors (views)."""
        out, start = [], 0
        for _, shape, _ in self.layout:
            n = math.prod(shape)
            out.append(buffer[start:start + n].view(shape))
            start += n
        return out

    def load(self, buffer: torch.Tensor, payload: dict[str, torch.Tensor], views: list[torch.Tensor] | None = None
             ) -> None:
        """Copy a payload of this layout into `buffer` as float64 (exact for float32 values)."""
        for dst, v in zip(views if views is not None else self.views(buffer), payload.values()):
            dst.copy_(v.detach())

    def fits(self, payload: dict[str, torch.Tensor]) -> bool:
        return len(payload) == len(self.layout) and all(
            k == key and v.shape == shape and v.dtype == dtype
            for (k, v), (key, shape, dtype) in zip(payload.items(), self.layout))

    def add(self, payload: dict[str, torch.Tensor], weight: float, exact: bool = True) -> None:
        """hi + lo += weight·payload, as the per-key sum does it, on the whole buffer at once (not exact: hi +=
        weight·payload, rounded)."""
        term, spare, views = self._scratch(exact)
        self.load(term, payload, views)
        if exact:
            new = twosum.add_scaled(self.hi, self.lo, term, weight, self.narrow and exact_product(weight), out=spare)
            if new is spare:  # the sum landed in the spare buffer: the old hi is the next spare
                self._term, self.hi = (term, self.hi, views), new
        else:
            self.hi.add_(term, alpha=weight)

    def to_cpu(self) -> None:
        """Move the accumulators to the CPU (the term buffers go: the next add makes new ones)."""
        self.hi, self.lo, self._term = self.hi.cpu(), self.lo.cpu(), None

    def _scratch(self, exact: bool) -> tuple[torch.Tensor, torch.Tensor | None, list[torch.Tensor]]:
        """The term buffer (its per-key views), and a spare for hi where the torch operations add."""
        if self._term is None:
            term = torch.empty_like(self.hi)
            spare = torch.empty_like(self.hi) if exact else None
            self._term = (term, spare, self.views(term))
        return self._term

    def merge(self, other: _Flat) -> None:
        """Fold in another partial sum of the same layout, as the per-key merge does (brought to this one's device)."""
        twosum.merge(self.hi, self.lo, other.hi.to(self.hi.device), other.lo.to(self.hi.device))

    def unflatten(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """The accumulators per key (views of the flat buffers)."""
        keys = [k for k, _, _ in self.layout]
        return dict(zip(keys, self.views(self.hi))), dict(zip(keys, self.views(self.lo)))


class WeightedSum:
    """Σ w_k·p_k over dicts of tensors, with hi/lo float64 accumulators per key (flat while the layout holds);
    `exact=False` rounds each flat addition (see the module's docstring)."""

    def __init__(self, exact: bool = True, device: str | torch.device | None = None) -> None:
        self.exact = exact
        self.device = torch.device(device) if device is not None else torch.device("cpu")  # where it accumulates
        self._hi: dict[str, torch.Tensor] = {}
        self._lo: dict[str, torch.Tensor] = {}
        self._flat: _Flat | None = None
        self.weight = 0.0
        self.count = 0

    @property
    def hi(self) -> dict[str, torch.Tensor]:
        return self._flat.unflatten()[0] if self._flat is not None else self._hi

    @property
    def lo(self) -> dict[str, torch.Tensor]:
        return self._flat.unflatten()[1] if self._flat is not None else self._lo

    def _empty(self) -> bool:
        return self._flat is None and not self._hi

    def _by_key(self) -> None:
        """Leave the flat layout (a payload of another layout arrived): per-key views of the same numbers."""
        if self._flat is not None:
            self._hi, self._lo = self._flat.unflatten()
            self._flat = None

    def add(self, payload: object, weight: float, client: int | str = "?") -> None:
        """Add one client's payload (a dict of tensors) with its weight. Any other payload, or a tensor whose
        shape differs from the sum's, is an AggregationError naming `client`, and leaves the sum untouched."""
        if not isinstance(payload, dict) or not all(isinstance(v, torch.Tensor) for v in payload.values()):
            raise AggregationError(f"aggregate: client {client} sent a {type(payload).__name__}, not a dict of "
                                   "tensors, in a reduce='sum' phase")
        if self._flat is not None and self._flat.fits(payload):
            self._flat.add(payload, weight, self.exact)
        elif self._empty():
            self._flat = _Flat.of(payload, weight, self.device)
        else:
            self._add_by_key(payload, weight, client)
        self.weight += weight
        self.count += 1

    def _add_by_key(self, payload: dict[str, torch.Tensor], weight: float, client: int | str) -> None:
        terms = {k: v.detach().to(self.device, torch.float64, copy=True, memory_format=torch.contiguous_format)
                 .mul_(weight) for k, v in payload.items()}
        self._fold_by_key(terms, None, lambda k, new, old: f"aggregate: client {client} sent {k!r} with shape "
                                                          f"{new}, the others {old}")

    def to_cpu(self) -> WeightedSum:
        """This sum with its accumulators on the CPU, where sums are merged and sent (returns itself)."""
        if self._flat is not None:
            self._flat.to_cpu()
        self._hi = {k: v.cpu() for k, v in self._hi.items()}
        self._lo = {k: v.cpu() for k, v in self._lo.items()}
        self.device = torch.device("cpu")
        return self

    def merge(self, other: WeightedSum) -> None:
        """Fold in another partial sum (from another worker), on this sum's device."""
        here = self.device
        if other._flat is not None and (self._empty() or (self._flat is not None
                                                          and self._flat.layout == other._flat.layout)):
            if self._flat is None:
                self._flat = _Flat(other._flat.layout, other._flat.hi.to(here, copy=True),
                                   other._flat.lo.to(here, copy=True))
            else:
                self._flat.merge(other._flat)
        else:
            terms = {k: v.to(here, copy=True, memory_format=torch.contiguous_format) for k, v in other.hi.items()}
            los = {k: v.to(here) for k, v in other.lo.items()}
            self._fold_by_key(terms, los, lambda k, new, old: f"aggregate: partial sums disagree on the shape "
                                                              f"of {k!r}: {new} vs {old}")
        self.weight += other.weight
        self.count += other.count

    def _fold_by_key(self, terms: dict[str, torch.Tensor], los: dict[str, torch.Tensor] | None,
                     mismatch: Callable[[str, tuple, tuple], str]) -> None:
        """hi + lo += terms (+ los, another sum's errors), key by key, in the per-key layout. The terms are this
        sum's to keep (contiguous). A key whose shape differs from the sum's is an AggregationError (`mismatch`
        words it) and leaves the sum untouched; so does an add (not a merge) that cannot allocate its scratch."""
        hi = self.hi
        for k, v in terms.items():
            if k in hi and hi[k].shape != v.shape:
                raise AggregationError(mismatch(k, tuple(v.shape), tuple(hi[k].shape)))
        fresh: dict[str, torch.Tensor] = {}
        if los is None:  # a client's add fails that client only: what it allocates (on a GPU, say) comes first
            fresh = {k: torch.zeros_like(v) for k, v in terms.items() if k not in hi}
            for k in terms:
                if k in hi:
                    twosum.reserve(hi[k])
        self._by_key()
        for k, v in terms.items():
            if k not in self._hi:
                self._hi[k] = v
                self._lo[k] = fresh[k] if los is None else los[k].clone(memory_format=torch.contiguous_format)
            elif los is None:
                twosum.add_scaled(self._hi[k], self._lo[k], v, 1.0, product_exact=True)
            else:
                twosum.merge(self._hi[k], self._lo[k], v, los[k])

    def __getstate__(self) -> dict:
        """A partial sum travels without its term buffer, its accumulators as numpy arrays: pickle protocol 5 (Ray's
        transport) hands those over as raw buffers, where a tensor goes through torch's own serializer, which cost a
        worker 2.5-18 ms per 3 MB reply (bench config C). A flat lo that is all +0.0 (every product and sum exact,
        the usual case for float32 payloads) is left out: half the bytes."""
        state: dict[str, Any] = {**self.__dict__, "_hi": _to_numpy(self._hi), "_lo": _to_numpy(self._lo),
                                 "device": torch.device("cpu")}  # it arrives on the CPU, wherever it was summed
        if self._flat is not None:
            lo = self._flat.lo.cpu().numpy()  # sent only when some entry's bits are not +0.0's (-0.0 is kept as is)
            state["_flat"] = (self._flat.layout, self._flat.hi.cpu().numpy(), lo if lo.view(np.int64).any() else None)
        return state

    def __setstate__(self, state: dict) -> None:
        flat = state.pop("_flat")
        state.setdefault("device", torch.device("cpu"))
        self.__dict__.update(state, _hi=_from_numpy(state["_hi"]), _lo=_from_numpy(state["_lo"]))
        if flat is not None:  # a low-order part left all zero (every product and sum exact, as is usual) is not sent
            lo = torch.zeros(len(flat[1]), dtype=torch.float64) if flat[2] is None else _tensor(flat[2])
            self._flat = _Flat(flat[0], _tensor(flat[1]), lo)
        else:
            self._flat = None

    def totals(self) -> dict[str, torch.Tensor]:
        """The sums as float64 tensors."""
        hi, lo = self.hi, self.lo
        return {k: hi[k] + lo[k] for k in hi}


def _tensor(a: Any) -> torch.Tensor:
    """A received accumulator as a tensor of its own: Ray maps a numpy array read-only from its object store."""
    return torch.from_numpy(a if a.flags.writeable else a.copy())


def _to_numpy(tensors: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {k: v.cpu().numpy() for k, v in tensors.items()}


def _from_numpy(arrays: dict[str, Any]) -> dict[str, torch.Tensor]:
    return {k: _tensor(v) for k, v in arrays.items()}
