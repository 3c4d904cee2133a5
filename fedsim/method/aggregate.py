"""Aggregation, written once: the weighted average of client states and the per-architecture sum.

The `reduce="sum"` conventions live here. A summable payload is a flat dict of tensors whose keys are
prefixed with the client's architecture (`<arch>/<key>`) and which carries `<arch>/__weight__` = 1, so one
weighted sum over all clients serves every architecture and tells each one its own total weight. Sums
are order-independent (fedsim.method.sums), so results do not depend on how clients meet in workers.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from fedsim.errors import AggregationError
from fedsim.method.contract import SummedUpdate
from fedsim.method.sums import WeightedSum

State = dict[str, torch.Tensor]
WEIGHT_KEY = "__weight__"


def as_summable(arch: str, state: Mapping[str, torch.Tensor]) -> State:
    """Prefix keys with the architecture and add a weight counter, so one sum serves every architecture. The
    counter lies where the state does: a GPU worker's sum then copies no CPU tensor, which would wait for the GPU."""
    out = {f"{arch}/{k}": v for k, v in state.items()}
    out[f"{arch}/{WEIGHT_KEY}"] = torch.ones((), device=next(iter(state.values())).device if state else None)
    return out


def check_like(expected: Mapping[str, torch.Tensor], got: Mapping[str, torch.Tensor], client: int | str) -> None:
    """Raise AggregationError naming `client` when `got` has other keys or shapes than `expected`."""
    missing, extra = sorted(set(expected) - set(got)), sorted(set(got) - set(expected))
    if missing or extra:
        raise AggregationError(f"aggregate: client {client} sent keys that differ from the others "
                               f"(missing {missing[:3]}, unexpected {extra[:3]})")
    for k, v in got.items():
        if tuple(v.shape) != tuple(expected[k].shape):
            raise AggregationError(f"aggregate: client {client} sent {k!r} with shape {tuple(v.shape)}, "
                                   f"expected {tuple(expected[k].shape)}")


def weighted_sum(states: Mapping[int, Mapping[str, torch.Tensor]], weights: Mapping[int, float]) -> WeightedSum:
    """Σ w_k·state_k over clients (in id order), checking that every client sent the same keys and shapes."""
    total = WeightedSum()
    first: Mapping[str, torch.Tensor] | None = None
    for cid in sorted(states):
        w = float(weights[cid])
        if not (w > 0 and w < float("inf")):
            raise AggregationError(f"aggregate: client {cid} has weight {w!r}; it must be finite and > 0")
        if first is None:
            first = states[cid]
        else:
            check_like(first, states[cid], cid)
        total.add(states[cid], w)
    return total


def weighted_average(states: Mapping[int, Mapping[str, torch.Tensor]], weights: Mapping[int, float]) -> State:
    """The weighted mean Σ w_k·state_k / Σ w_k, cast back to each entry's dtype (buffers included)."""
    if not states:
        raise AggregationError("aggregate: no client states to average")
    total = weighted_sum(states, weights)
    like = states[min(states)]
    return {k: (v / total.weight).to(like[k].dtype) for k, v in total.totals().items()}


def sum_by_arch(states: Mapping[int, Mapping[str, torch.Tensor]], weights: Mapping[int, float],
                archs: Sequence[str]) -> SummedUpdate:
    """The per-architecture summed update of whole client states (`archs[cid]` is client cid's architecture)."""
    by_arch: dict[str, int] = {}
    total = WeightedSum()
    for cid in sorted(states):
        arch = archs[cid]
        if arch in by_arch:
            check_like(states[by_arch[arch]], states[cid], cid)
        else:
            by_arch[arch] = cid
        w = float(weights[cid])
        if not (w > 0 and w < float("inf")):
            raise AggregationError(f"aggregate: client {cid} has weight {w!r}; it must be finite and > 0")
        total.add(as_summable(arch, states[cid]), w)
    return SummedUpdate(total.totals(), total.weight, total.count)


def average_by_arch(summed: SummedUpdate, previous: Mapping[str, State]) -> dict[str, State]:
    """Per-architecture weighted means from a SummedUpdate; architectures nobody trained keep their model."""
    out = {}
    for arch, old in previous.items():
        w = summed.total.get(f"{arch}/{WEIGHT_KEY}")
        if w is None or float(w) <= 0:
            out[arch] = old
            continue
        new = {}
        for k, v in old.items():
            key = f"{arch}/{k}"
            if key not in summed.total:
                raise AggregationError(f"aggregate: key {key!r} missing from the summed client updates")
            if tuple(summed.total[key].shape) != tuple(v.shape):
                raise AggregationError(f"aggregate: {key!r} summed with shape {tuple(summed.total[key].shape)}, "
                                       f"the global model has {tuple(v.shape)}")
            new[k] = (summed.total[key] / w).to(v.dtype)
        out[arch] = new
    return out


def move_toward(old: Mapping[str, torch.Tensor], target: Mapping[str, torch.Tensor], lr: float) -> State:
    """A server step of size `lr` from `old` toward `target` on floating-point entries (lr 1 gives `target`);
    integer buffers (BatchNorm's step counter) take `target` as is."""
    if lr == 1.0:
        return dict(target)
    return {k: (v + lr * (target[k].to(v.dtype) - v)) if v.is_floating_point() else target[k]
            for k, v in old.items()}


def split_by_arch(summed: SummedUpdate) -> dict[str, tuple[float, State]]:
    """Each architecture's total weight and its summed entries with the `<arch>/` prefix removed."""
    out: dict[str, tuple[float, State]] = {}
    for key, v in summed.total.items():
        arch, _, name = key.partition("/")
        weight, entries = out.setdefault(arch, (0.0, {}))
        if name == WEIGHT_KEY:
            out[arch] = (float(v), entries)
        else:
            entries[name] = v
    return out
