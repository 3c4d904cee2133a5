"""A summed upload as an update: the difference between what a client uploads and what it started from.

A `model_update` phase's payload is summable (fedsim.method.aggregate: `<arch>/<key>` entries and a weight counter).
`Algorithm.upload_reference(phase, common, arch)` gives, for every key, what the client's upload is relative to (the
broadcast model for FedAvg; zeros for entries that are differences already, as SCAFFOLD's are).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedsim.method.aggregate import WEIGHT_KEY

State = dict[str, torch.Tensor]


def update_of(payload: Mapping[str, torch.Tensor], arch: str, reference: Mapping[str, torch.Tensor]) -> State:
    """The floating-point entries of `payload` minus the reference, in float64 (integer buffers are left out: a
    run's step counters carry no client data), keyed as the payload is."""
    prefix = f"{arch}/"
    out = {}
    for key, value in payload.items():
        name = key[len(prefix):] if key.startswith(prefix) else key
        if name == WEIGHT_KEY or not value.is_floating_point():
            continue
        ref = reference.get(name)
        out[key] = value.double() - ref.to(value.device, torch.float64) if ref is not None else value.double()
    return out


def l2_norm(update: Mapping[str, torch.Tensor]) -> float:
    """The L2 norm of a whole update, every entry together (flat clipping, as McMahan et al. 2018)."""
    return float(sum(v.pow(2).sum() for v in update.values())) ** 0.5 if update else 0.0


def clip_to(update: State, bound: float) -> tuple[State, float]:
    """`update` scaled to L2 norm at most `bound` (Δ · min(1, bound / ‖Δ‖)), and its norm before."""
    norm = l2_norm(update)
    return ({k: v * (bound / norm) for k, v in update.items()} if norm > bound else update), norm


def flatten(update: Mapping[str, torch.Tensor], keys: list[str]) -> torch.Tensor:
    """One float64 row of `update`'s entries in the order of `keys` (robust aggregators read whole updates)."""
    return stack([update], keys)[0]


def stack(updates: list[Mapping[str, torch.Tensor]], keys: list[str]) -> torch.Tensor:
    """The updates as the rows of one float64 (n, d) matrix, written in place: one copy of them, no more."""
    d = sum(updates[0][k].numel() for k in keys) if updates else 0
    rows = torch.empty((len(updates), d), dtype=torch.float64)
    for row, update in zip(rows, updates):
        torch.cat([update[k].reshape(-1) for k in keys], out=row)  # one call a row (1.7x the copies key by key)
    return rows


def unflatten(row: torch.Tensor, like: Mapping[str, torch.Tensor], keys: list[str]) -> State:
    """The inverse of `flatten`: entries shaped as `like`'s."""
    out, at = {}, 0
    for k in keys:
        size = like[k].numel()
        out[k] = row[at:at + size].reshape(like[k].shape)
        at += size
    return out


def as_upload(update: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
              m: float) -> dict[str, torch.Tensor]:
    """A round's aggregated update in the summed upload's form, for the method's server step: every entry
    m·reference + `update` (an update summed over m, or a mean times m), weight m, so the method's mean is
    reference + update / m. An integer buffer (a step counter) keeps its reference, a half away from it so that the
    method's mean truncates back to it whatever m is. `update` is keyed `<arch>/<name>` (missing: zero)."""
    out: dict[str, torch.Tensor] = {}
    for arch in sorted(references):
        for name, ref in references[arch].items():
            key, base = f"{arch}/{name}", ref.to("cpu", torch.float64)
            if not ref.is_floating_point():
                out[key] = m * (base + torch.where(ref >= 0, 0.5, -0.5))
                continue
            out[key] = m * base + (update[key].to("cpu", torch.float64) if key in update else 0.0)
        out[f"{arch}/{WEIGHT_KEY}"] = torch.tensor(m, dtype=torch.float64)
    return out


def noised_entries(total: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
                   noise_std: float, generator: torch.Generator | None, divide: float = 1.0) -> State:
    """Each floating-point entry of a round's sum (keyed `<arch>/<name>`, zero where missing) divided by `divide`, plus
    N(0, noise_std²) drawn from `generator` entry by entry in key order (no draw when noise_std is 0): central DP's
    noise on the sum, norm bounding's weak-DP noise on the mean."""
    out = {}
    for arch in sorted(references):
        for name, ref in references[arch].items():
            key = f"{arch}/{name}"
            if not ref.is_floating_point():
                continue
            value = total[key].to("cpu", torch.float64) / divide if key in total else \
                torch.zeros(ref.shape, dtype=torch.float64)
            if noise_std > 0:
                value = value + noise_std * torch.randn(ref.shape, generator=generator, dtype=torch.float64)
            out[key] = value
    return out
