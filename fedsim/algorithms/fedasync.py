"""FedAsync (Xie, Koyejo & Gupta 2019, "Asynchronous Federated Optimization", https://arxiv.org/abs/1903.03934):
every arrival is mixed into the global model at once, with a weight that shrinks with its staleness.

    server: x ← init; on each arrival of x_new, trained from version τ, applied to version t:
            α_t ← α·s(t − τ);   x ← (1 − α_t)·x + α_t·x_new;   t ← t + 1

s is constant, polynomial or hinge (fedsim.method.asynchronous). α_t is recomputed from the base α at every
arrival: Plato's example multiplies its mixing weight by s at each update, so α decays over the whole run (a bug).
Clients run plain local SGD from the version they were dispatched with and upload their model. Async mode only
(participation.mode: async); docs/async.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedsim.method import (
    ClientContext,
    ClientResult,
    GlobalModels,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    SummedUpdate,
    as_summable,
    evaluate_models,
    knob,
    register_algorithm,
    split_by_arch,
)
from fedsim.method.asynchronous import NEW_VERSION, AsyncAlgorithm, StalenessParams, arrival


@dataclass
class FedAsyncParams(StalenessParams):
    alpha: float = knob(0.6, gt=0, le=1, doc="base mixing weight α (the paper tries 0.6, 0.8 and 0.9)")


def mix(old: dict[str, torch.Tensor], new: dict[str, torch.Tensor], alpha: float) -> dict[str, torch.Tensor]:
    """(1 − α)·old + α·new on floating entries, in float64 and cast back; integer buffers take `new`."""
    out = {}
    for k, v in old.items():
        if v.is_floating_point():
            x = v.detach().to("cpu", torch.float64)
            out[k] = ((1.0 - alpha) * x + alpha * new[k].detach().to("cpu", torch.float64)).to(v.device, v.dtype)
        else:
            out[k] = new[k].to(v.device, v.dtype)
    return out


@register_algorithm
class FedAsync(AsyncAlgorithm):
    """Each arrival mixed into the global model with weight α·s(staleness)."""

    name = "fedasync"
    Params = FedAsyncParams

    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD from the model of the client's dispatch, then upload the model."""

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            return ClientResult(payload=as_summable(ctx.arch, model.state_dict()), weight=1.0, metrics=metrics)

        return LocalTraining.of(ctx, msg.common[ctx.arch], finish)

    def server_step(self, phase: Phase, state: GlobalModels, updates: dict[int, ClientResult],
                    info: RoundInfo) -> tuple[GlobalModels, dict[str, Any]]:
        if not updates:
            return state, {NEW_VERSION: 0}
        alpha = self.params.alpha * self.params.weight(arrival(info).staleness)  # from the base α every time
        models = dict(state.models)
        for res in updates.values():  # one arrival
            for arch, (_, entries) in split_by_arch(SummedUpdate(res.payload, 1.0, 1)).items():
                models[arch] = mix(models[arch], entries, alpha)
        return GlobalModels(models=models, extra=state.extra), {NEW_VERSION: 1, "alpha": alpha}

    def evaluate(self, state: GlobalModels, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)
