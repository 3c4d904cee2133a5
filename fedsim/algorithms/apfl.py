"""APFL (Deng, Kamani & Mahdavi 2020, https://arxiv.org/abs/2003.13461): adaptive personalised FL, a personal
model mixed with the global one.

    client k, each local batch ξ (train.epochs or train.steps of them):
              w_k ← w_k − η·∇f(w_k; ξ)                        (from the broadcast global w; uploaded)
              v̄   = α_k·v_k + (1 − α_k)·w_k                    (the personal model: a mixture of parameters)
              v_k ← v_k − η·∇_v f(v̄; ξ) = v_k − η·α_k·∇f(v̄; ξ)
              α_k ← clip₀¹(α_k − η_α·⟨v_k − w_k, ∇f(v̄; ξ)⟩)   (only when `alpha_lr` > 0; else α fixed)
    server:   w ← Σ_k |D_k|·w_k / Σ_k |D_k|

v_k and α_k stay at the client (v_k starts as the global model it first receives, α_k at `alpha`). The v step
uses the run's optimizer settings through an optimizer of its own; the w step runs first, so v̄ mixes the w of the
same batch after its step. The personal model scored on the client's shard is v̄ with the client's last w_k.
[Differs] Plato mixes logits and updates α once per round; the authors' FedRep repo's baseline mixes with α on both
terms; here parameters are mixed, per batch, as in the paper's Algorithm 1.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch.func import functional_call

from fedsim.method import (
    ClientContext,
    ClientResult,
    Message,
    PersonalMethod,
    Phase,
    batch_indices,
    knob,
    make_optimizer,
    personal,
    register_algorithm,
)


@dataclass
class APFLParams:
    alpha: float = knob(0.75, ge=0, le=1, doc="α, the personal model's share of the mixture αv + (1−α)w at a "
                                              "client's first round (Plato's and the FedRep repo's 0.75)")
    alpha_lr: float = knob(0.0, ge=0, doc="η_α, the step on α along ⟨v − w, ∇f(v̄)⟩ each batch; 0 keeps α fixed")


def mixed(v: torch.nn.Module, w: torch.nn.Module, alpha: torch.Tensor) -> dict[str, torch.Tensor]:
    """αv + (1−α)w over the parameters (w detached), with v's buffers: the mixture's entries for functional_call."""
    params = {n: alpha * p + (1 - alpha) * dict(w.named_parameters())[n].detach() for n, p in v.named_parameters()}
    return {**params, **dict(v.named_buffers())}


@register_algorithm
class APFL(PersonalMethod):
    """FedAvg's global model, and per client a personal model and mixing weight trained on the mixture."""

    name = "apfl"
    Params = APFLParams
    global_model = True

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                    ctx: ClientContext) -> ClientResult:
        glob, train = msg.common[ctx.arch], ctx.env.config.train
        w = ctx.models.get(ctx.arch)
        w.load_state_dict(glob)
        v = personal.loaded(ctx, "apfl/personal", (state or {}).get("model", glob))
        a0 = float((state or {}).get("alpha", self.params.alpha))
        alpha = torch.tensor(a0, device=ctx.device, requires_grad=self.params.alpha_lr > 0)
        opt_w, opt_v = make_optimizer(w.parameters(), train), make_optimizer(v.parameters(), train)
        w.train(), v.train()
        x, y = ctx.data.x, ctx.data.y
        total_w = total_v = 0.0
        steps = 0
        for idx in batch_indices(len(y), train.batch_size, ctx.generator(), train.epochs, train.steps, x.device):
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            loss_w = F.cross_entropy(w(xb), yb)
            opt_w.zero_grad(set_to_none=True)
            loss_w.backward()
            opt_w.step()
            loss_v = F.cross_entropy(functional_call(v, mixed(v, w, alpha), (xb,)), yb)
            opt_v.zero_grad(set_to_none=True)
            if alpha.requires_grad:
                alpha.grad = None
            loss_v.backward()
            opt_v.step()
            if alpha.requires_grad:
                with torch.no_grad():
                    alpha.sub_(self.params.alpha_lr * alpha.grad).clamp_(0.0, 1.0)
            total_w += float(loss_w.detach()) * len(idx)
            total_v += float(loss_v.detach()) * len(idx)
            steps += len(idx)
        a1 = float(alpha.detach()) if alpha.requires_grad else a0  # a fixed α stays exactly as given
        metrics = {"train_loss": total_w / max(steps, 1), "personal_train_loss": total_v / max(steps, 1),
                   "alpha": a1}
        mix = personal.loaded(ctx, "apfl/mixture", personal.mixture(v, w, a1))
        result = self.upload(ctx, w, metrics, state, personal=mix, start=glob)
        result.state = {**(result.state or {}), "model": personal.keep(v.state_dict(), v.state_dict()),
                        "alpha": a1}
        return result
