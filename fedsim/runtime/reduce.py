"""Order-independent weighted sums: double-double (float64 pair) accumulation.

Each term w·x (integer-ish weight, float32 value) is exact in float64; accumulating with Knuth's TwoSum
keeps the error near 2^-106 relative, so the float32 result does not depend on how clients were
grouped into workers or in which order partial sums arrive.
"""

from __future__ import annotations

import torch

from fedsim.errors import AggregationError

Pair = tuple[torch.Tensor, torch.Tensor]


def _two_sum_into(a: torch.Tensor, b: torch.Tensor, s: torch.Tensor, tmp: torch.Tensor) -> tuple[torch.Tensor,
                                                                                                  torch.Tensor]:
    """Knuth's TwoSum without allocating: returns (s, error) with s = fl(a + b) and s + error = a + b exactly.
    `s` and `tmp` are scratch buffers; `b` is overwritten and `a` ends holding the error. The sum is
    memory-bound and runs over every weight of the model for every client, so allocations are what it costs."""
    torch.add(a, b, out=s)      # s = a + b
    torch.sub(s, a, out=tmp)    # bp = s - a
    b.sub_(tmp)                 # b - bp
    torch.sub(s, tmp, out=tmp)  # s - bp
    a.sub_(tmp)                 # a - (s - bp)
    a.add_(b)                   # (a - (s - bp)) + (b - bp)
    return s, a


class WeightedSum:
    """Σ w_k·p_k over dicts of tensors, with hi/lo float64 accumulators per key."""

    def __init__(self) -> None:
        self.hi: dict[str, torch.Tensor] = {}
        self.lo: dict[str, torch.Tensor] = {}
        self._scratch: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # per key, two buffers for TwoSum
        self.weight = 0.0
        self.count = 0

    def add(self, payload: object, weight: float, client: int | str = "?") -> None:
        """Add one client's payload (a dict of tensors) with its weight. Any other payload, or a tensor whose
        shape differs from the sum's, is an AggregationError naming `client`, and leaves the sum untouched."""
        if not isinstance(payload, dict) or not all(isinstance(v, torch.Tensor) for v in payload.values()):
            raise AggregationError(f"aggregate: client {client} sent a {type(payload).__name__}, not a dict of "
                                   "tensors, in a reduce='sum' phase")
        for k, v in payload.items():
            if k in self.hi and self.hi[k].shape != v.shape:
                raise AggregationError(f"aggregate: client {client} sent {k!r} with shape {tuple(v.shape)}, "
                                       f"the others {tuple(self.hi[k].shape)}")
        for k, v in payload.items():
            term = v.detach().to("cpu", torch.float64, copy=True).mul_(weight)
            if k not in self.hi:
                self.hi[k], self.lo[k] = term, torch.zeros_like(term)
            else:
                self.lo[k] += self._two_sum(k, term)
        self.weight += weight
        self.count += 1

    def merge(self, other: WeightedSum) -> None:
        """Fold in another partial sum (from another worker)."""
        for k, v in other.hi.items():
            if k in self.hi and self.hi[k].shape != v.shape:
                raise AggregationError(f"aggregate: partial sums disagree on the shape of {k!r}: "
                                       f"{tuple(v.shape)} vs {tuple(self.hi[k].shape)}")
            if k not in self.hi:
                self.hi[k], self.lo[k] = v.clone(), other.lo[k].clone()
            else:
                self.lo[k] += self._two_sum(k, v.clone()).add_(other.lo[k])
        self.weight += other.weight
        self.count += other.count

    def __getstate__(self) -> dict:
        return {**self.__dict__, "_scratch": {}}  # a partial sum travels to the driver without its scratch

    def _two_sum(self, k: str, term: torch.Tensor) -> torch.Tensor:
        """hi[k] += term, returning the rounding error (in a buffer that is scratch from the next call on)."""
        hi = self.hi[k]
        s, tmp = self._scratch.get(k) or (torch.empty_like(hi), torch.empty_like(hi))
        self.hi[k], err = _two_sum_into(hi, term, s, tmp)
        self._scratch[k] = (err, tmp)  # the old hi buffer, free once the caller has added the error
        return err

    def totals(self) -> dict[str, torch.Tensor]:
        """The sums as float64 tensors."""
        return {k: self.hi[k] + self.lo[k] for k in self.hi}
