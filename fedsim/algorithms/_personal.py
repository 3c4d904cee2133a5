"""Shared pieces of the personal-model methods (FedGDKD and its comparators, Banerjee 2022 §5).

Each client keeps its own classifier in `ClientResult.state["model"]`; it is created from a seed that
depends only on (run seed, client id), scored on the client's own test shard (`data.client_test`), and
the server keeps every client's latest score so the per-round mean covers clients not sampled this round.
Shared-data baselines (5% shares, FedMD's public set, FAug's GAN data) pool client uploads here too.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedsim import rng
from fedsim.method import (
    ClientContext,
    ClientResult,
    Env,
    clone_state,
    new_model,
    personal,
    register_state,
)
from fedsim.method.personal import score, test_shard  # noqa: F401  the kit's, where FedGDKD's comparators look


def require_client_test(env: Env, method: str) -> None:
    """Personal models are scored on personal test shards; refuse to run without them."""
    personal.require_client_test(env, method, " (the thesis protocol)")


def init_seed(run_seed: int, client_id: int) -> int:
    """The seed of a client's initial personal weights (stream "init/personal"): fixed across rounds and workers."""
    return rng.seed(run_seed, "init/personal", client=client_id)


def seeded_init(module: torch.nn.Module, build: Any, seed: int) -> torch.nn.Module:
    """Load freshly initialised weights (drawn from `seed`, not the global RNG stream) into `module`."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        fresh = build()
    module.load_state_dict(fresh.state_dict())
    return module


def personal_model(ctx: ClientContext, state: dict | None) -> torch.nn.Module:
    """The worker's model instance for this client's architecture, holding the client's own weights."""
    model = ctx.models.get(ctx.arch)
    if state is not None and "model" in state:
        model.load_state_dict(state["model"])
        return model
    return seeded_init(model, lambda: new_model(ctx.env, ctx.arch), init_seed(ctx.env.config.seed, ctx.client_id))


def with_model(state: dict | None, model: torch.nn.Module, **extra: Any) -> dict:
    """A new personal state: the old entries, the model's weights, and `extra` (None values drop a key)."""
    out = {k: v for k, v in (state or {}).items()}
    out["model"] = clone_state(model)
    for k, v in extra.items():
        if v is None:
            out.pop(k, None)
        else:
            out[k] = v
    return out


@register_state
@dataclass
class PersonalScores:
    """Every client's latest personal score: (accuracy, loss, test samples) by client id."""

    scores: dict[int, tuple[float, float, float]] = field(default_factory=dict)

    def record(self, updates: dict[int, ClientResult]) -> PersonalScores:
        new = dict(self.scores)
        for cid, res in updates.items():
            m = res.metrics
            if "personal_accuracy" in m:
                new[int(cid)] = (float(m["personal_accuracy"]), float(m["personal_loss"]), float(m["test_samples"]))
        return PersonalScores(new)

    def summary(self, this_round: list[int] | None = None) -> dict[str, float]:
        """Sample-weighted means over all clients scored so far (Σ correct / Σ samples) and over `this_round`."""
        out = {}
        for tag, ids in (("", list(self.scores)), ("_round", this_round)):
            rows = [self.scores[c] for c in (ids or []) if c in self.scores]
            n = sum(r[2] for r in rows)
            if n > 0:
                out[f"personal_accuracy{tag}"] = sum(r[0] * r[2] for r in rows) / n
                out[f"personal_loss{tag}"] = sum(r[1] * r[2] for r in rows) / n
        out["personal_clients"] = float(len(self.scores))
        return out

    def rows(self) -> list[dict[str, Any]]:
        """One `model: personal` row for rounds.parquet: the sample-weighted mean of every scored client."""
        s = self.summary()
        if "personal_accuracy" not in s:
            return []
        return [{"model": "personal", "accuracy": s["personal_accuracy"], "loss": s["personal_loss"],
                 "clients_scored": s["personal_clients"]}]


def share_sample(ctx: ClientContext, fraction: float) -> dict[str, torch.Tensor]:
    """A seeded random `fraction` (at least one sample) of the client's private data, for a shared pool."""
    n = ctx.data.num_samples
    k = min(n, max(1, int(round(fraction * n))))
    idx = torch.randperm(n, generator=ctx.generator())[:k].to(ctx.data.x.device)
    return {"x": ctx.data.x[idx].detach().cpu(), "y": ctx.data.y[idx].detach().cpu()}


def pool(updates: dict[int, ClientResult]) -> dict[str, torch.Tensor]:
    """The union of the clients' uploaded shares, in client-id order."""
    parts = [updates[c].payload for c in sorted(updates)]
    if not parts:
        return {}
    return {"x": torch.cat([p["x"] for p in parts]), "y": torch.cat([p["y"] for p in parts])}


def balanced_labels(n: int, num_classes: int) -> torch.Tensor:
    """n labels in round-robin class order 0, 1, ..., c-1, 0, ...: balanced; the first n mod c get one more."""
    return torch.arange(n) % num_classes
