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
