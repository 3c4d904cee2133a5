"""FedRep (Collins et al. 2021, https://arxiv.org/abs/2102.07078): a shared representation, personal heads.

    client k: from (global body φ, own head h_k):
              `head_epochs` epochs on h_k with φ frozen, then train.epochs epochs (or train.steps) on φ with h_k frozen
              φ_k up, h_k kept
    server:   φ ← Σ_k |D_k|·φ_k / Σ_k |D_k|

`personal_layers` names the head by parameter-name prefix (default: the model's classifier head). The paper's code
trains the head for 10 epochs and the body for 1 (`head_epochs` 10 with `train.epochs` 1); each part gets a fresh
optimizer with the run's train settings, and one batch stream serves both. The personal model scored on the
client's own shard, at each evaluation, is the server's current body with the client's own head.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fedsim.config.limits import MAX_EPOCHS
from fedsim.method import (
    ClientContext,
    ClientResult,
    Env,
    Message,
    PersonalMethod,
    Phase,
    knob,
    personal,
    register_algorithm,
)


@dataclass
class FedRepParams:
    personal_layers: list[str] = knob([], doc="parameter-name prefixes of the head each client keeps (e.g. ['fc']); "
                                              "empty: the model's classifier head")
    head_epochs: int = knob(10, ge=0, le=MAX_EPOCHS, doc="epochs on the personal head (body frozen) before "
                                                         "train.epochs on the body (head frozen); the paper's 10")


@register_algorithm
class FedRep(PersonalMethod):
    """Train the head alone, then the body alone; the body is averaged, the head stays at the client."""

    name = "fedrep"
    Params = FedRepParams

    def personal_keys(self, env: Env, arch: str) -> frozenset[str]:
        return personal.split_keys(env, arch, self.params.personal_layers, "algorithm.personal_layers")

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                    ctx: ClientContext) -> ClientResult:
        """Head epochs (body frozen), then body epochs (head frozen), from (broadcast body, own head)."""
        model = ctx.models.get(ctx.arch)
        start = personal.start_state(ctx, msg.common[ctx.arch], (state or {}).get("personal"))
        model.load_state_dict(start)
        own = self.personal[ctx.arch]
        params = [n for n, _ in model.named_parameters()]
        gen, train = ctx.generator(), ctx.env.config.train
        head = personal.train_only(model, [n for n in params if n in own], ctx.data.x, ctx.data.y, train, gen,
                                   self.params.head_epochs)
        body = personal.train_only(model, [n for n in params if n not in own], ctx.data.x, ctx.data.y, train, gen,
                                   train.epochs, train.steps)
        metrics = {**{f"head_{k}": v for k, v in head.items()}, **body}
        return self.upload(ctx, model, metrics, state, start=start)
