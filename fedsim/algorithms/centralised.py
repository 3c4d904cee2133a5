"""Centralised, the upper bound of Banerjee 2022 (FedGDKD thesis, §5.1, Table 5.2): each client's own
architecture trained on the pooled data of all clients.

Every participant uploads all of its training data in round 0 (`share` phase, counted in bytes_up), gets
the pool once, and trains only on it; the model is scored on the client's own test shard like the
federated methods. [C] The author trained one model per config entry and, in the homogeneous case,
scored it on client 0's shard only; here every client trains its own copy, so the reported mean averages
over all shards and seeds. Not a federated method: it exists to bound the others.
"""

from __future__ import annotations

import torch

from fedsim.algorithms.local_only import LocalOnly, LocalOnlyParams, pool_data
from fedsim.method import ClientContext, register_algorithm


@register_algorithm
class Centralised(LocalOnly):
    """Train every client's architecture on the union of all clients' training data."""

    name = "centralised"
    Params = LocalOnlyParams

    @property
    def share_fraction(self) -> float:
        return 1.0

    def training_set(self, state: dict | None, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        shared = pool_data(state)
        if shared is None:  # not in round 0's pool (partial participation): fall back to its own data
            return ctx.data.x, ctx.data.y
        return shared[0].to(ctx.data.x.device), shared[1].to(ctx.data.x.device)
