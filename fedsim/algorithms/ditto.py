"""Ditto (Li et al. 2021, https://arxiv.org/abs/2012.04221): FedAvg for the global model, plus a personal model
held near it by a proximal term.

    client k: w_k ← local SGD on CE from the global w (train.epochs), uploaded
              v_k ← local SGD on CE + (λ/2)·‖v_k − w‖² from its own v_k (`personal_epochs`), kept
    server:   w ← Σ_k |D_k|·w_k / Σ_k |D_k|

λ = 0 trains each personal model on its own data alone; a large λ pulls it to the global model. A client's first
v_k is the global model it receives. The anchor w is the round's broadcast global model, as in the paper's
Algorithm 1; the two models draw their batches from separate streams. rounds.parquet scores the global model on
the test set and the personal models (v_k, after the round) on their clients' shards.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedsim.config.limits import MAX_EPOCHS
from fedsim.method import (
    ClientContext,
    ClientResult,
    Message,
    PersonalMethod,
    Phase,
    knob,
    personal,
    register_algorithm,
    train_classifier,
)


@dataclass
class DittoParams:
    lam: float = knob(1.0, ge=0, doc="λ, the weight of (λ/2)·‖v − w‖² in each personal model's loss (Plato's and "
                                     "the FedRep repo's 1)")
    personal_epochs: int | None = knob(None, ge=0, le=MAX_EPOCHS, doc="epochs on the personal model each round; "
                                                                     "unset: as the global model's (train.epochs "
                                                                     "or train.steps)")


def proximal(lam: float, anchor: dict[str, torch.Tensor]) -> Any:
    """The loss term (λ/2)·Σ‖p − anchor‖² over the model's parameters."""
    def term(model: torch.nn.Module) -> torch.Tensor | float:
        return 0.5 * lam * sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
    return term


@register_algorithm
class Ditto(PersonalMethod):
    """FedAvg's global model, and per client a personal model trained with a pull of λ towards it."""

    name = "ditto"
    Params = DittoParams
    global_model = True

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                    ctx: ClientContext) -> ClientResult:
        glob = msg.common[ctx.arch]
        model = ctx.models.get(ctx.arch)
        model.load_state_dict(glob)
        metrics = train_classifier(model, ctx.data.x, ctx.data.y, ctx.env.config.train, ctx.generator())
        own = personal.loaded(ctx, "ditto/personal", (state or {}).get("model", glob))
        anchor = {k: v.to(ctx.device) for k, v in glob.items()}
        pe = self.params.personal_epochs
        tr = ctx.env.config.train if pe is None else personal.replace_epochs(ctx.env.config.train, pe)
        if pe != 0:
            done = train_classifier(own, ctx.data.x, ctx.data.y, tr, ctx.stream("ditto/personal"),
                                    extra_loss=proximal(self.params.lam, anchor))
            metrics.update({f"personal_{k}": v for k, v in done.items()})
        result = self.upload(ctx, model, metrics, state, personal=own, start=glob)
        result.state = {**(result.state or {}), "model": personal.keep(own.state_dict(), own.state_dict())}
        return result
