"""Per-FedAvg (Fallah, Mokhtari & Ozdaglar 2020, https://arxiv.org/abs/2002.07948), first-order (FO) version:
FedAvg of a model meant to be fine-tuned, MAML-style.

    client k, from the global θ, for each pair of batches (D, D′) (train.epochs or train.steps batches in all):
              θ' = θ − α·∇f(θ; D)            (a trial step)
              θ  ← θ − β·∇f(θ'; D′)          (first order: the gradient at θ', applied to θ)
    server:   θ ← Σ_k |D_k|·θ_k / Σ_k |D_k|
    personal model of client k: one step θ − α·∇f(θ; D) from the broadcast global model on one batch of D_k

Both steps are plain SGD (no momentum or weight decay: Plato's pitfall of one optimizer carrying momentum across
both steps does not arise). Defaults α 0.01, β 0.001 as Plato's. At each evaluation every client that has trained is
re-scored (the kit's re-scoring pass) with the current global model's one-step fine-tune on a batch of its data
drawn at that round; a never-trained client reports the global model's accuracy.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedsim.method import (
    ClientContext,
    ClientResult,
    Message,
    PersonalMethod,
    Phase,
    batch_indices,
    knob,
    personal,
    register_algorithm,
)


@dataclass
class PerFedAvgParams:
    alpha: float = knob(0.01, gt=0, doc="α, the inner (trial and fine-tuning) step size")
    beta: float = knob(0.001, gt=0, doc="β, the outer (meta) step size")


def sgd_step(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, lr: float,
             at: torch.nn.Module | None = None) -> float:
    """model ← model − lr·∇f(at; x, y) (at: default the model itself); the batch's loss at `at`."""
    src = model if at is None else at
    loss = F.cross_entropy(src(x), y)
    grads = torch.autograd.grad(loss, list(src.parameters()))
    with torch.no_grad():
        for p, g in zip(model.parameters(), grads):
            p.sub_(lr * g)
    return float(loss.detach())


@register_algorithm
class PerFedAvg(PersonalMethod):
    """FedAvg of a meta-model trained with first-order MAML steps; each client's model is one step from it."""

    name = "perfedavg"
    Params = PerFedAvgParams
    global_model = True

    def fine_tuned(self, ctx: ClientContext, glob: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """The client's personal model: one α-step from `glob` on the first batch of its stream
        "perfedavg/personal" (at the round)."""
        x, y = ctx.data.x, ctx.data.y
        tuned = personal.loaded(ctx, "perfedavg/personal", glob)
        tuned.train()
        first = next(batch_indices(len(y), ctx.env.config.train.batch_size, ctx.stream("perfedavg/personal"), 1,
                                   None, x.device))
        sgd_step(tuned, x.index_select(0, first), y.index_select(0, first), self.params.alpha)
        return tuned

    def rescores(self) -> bool:
        return True  # the personal model is fine-tuned from the current global model, which moves every round

    def rescore(self, ctx: ClientContext, shared: Mapping[str, torch.Tensor], state: dict[str, Any] | None
                ) -> torch.nn.Module:
        """The current global model's one-step fine-tune on the client's data (its batch drawn at the evaluated
        round)."""
        return self.fine_tuned(ctx, shared)

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                    ctx: ClientContext) -> ClientResult:
        glob, train, p = msg.common[ctx.arch], ctx.env.config.train, self.params
        x, y = ctx.data.x, ctx.data.y
        tuned = self.fine_tuned(ctx, glob)
        theta = ctx.models.get(ctx.arch)
        theta.load_state_dict(glob)
        trial = personal.loaded(ctx, "perfedavg/trial", glob)
        theta.train(), trial.train()
        batches = list(batch_indices(len(y), train.batch_size, ctx.generator(), train.epochs, train.steps, x.device))
        total, seen = 0.0, 0
        # a meta-step takes two batches (inner, outer); a client with one batch uses it for both rather than not
        # training at all, and an odd last batch is left out
        pairs = list(zip(batches[0::2], batches[1::2])) or [(batches[0], batches[0])]
        for d, d2 in pairs:
            trial.load_state_dict(theta.state_dict())
            sgd_step(trial, x.index_select(0, d), y.index_select(0, d), p.alpha)
            loss = sgd_step(theta, x.index_select(0, d2), y.index_select(0, d2), p.beta, at=trial)
            total += loss * len(d2)
            seen += len(d2)
        metrics = {"train_loss": total / max(seen, 1), "steps": float(len(pairs))}
        return self.upload(ctx, theta, metrics, state, personal=tuned, start=glob)
