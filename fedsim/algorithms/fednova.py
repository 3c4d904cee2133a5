"""FedNova (Wang, Liu, Liang, Joshi, Poor, NeurIPS 2020, https://arxiv.org/abs/2007.07481): FedAvg whose clients'
updates are normalised by how many local steps they took, so clients that train longer do not pull the model
toward their own optimum (objective inconsistency).

    client i: τ_i local SGD steps from x (a fresh optimiser each round), y_i the result;
              ‖a_i‖₁ = τ_i (plain SGD), or Σ_{k=1..τ_i} (1 − ρ^k)/(1 − ρ) with local momentum ρ;
              uploads d_i = (x − y_i)/‖a_i‖₁ and ‖a_i‖₁, weighted by p_i (FedAvg's weighting)
    server:   τ_eff = Σ_i p_i ‖a_i‖₁;  x ← x − η_s · τ_eff · Σ_i p_i d_i   (η_s: algorithm.server_lr, 1 in the paper)

With equal step counts τ_eff·d̄ = x − ȳ and FedNova is FedAvg (to float rounding). Buffers (BatchNorm's running
statistics) are averaged as FedAvg does. The normalised direction is not a model update, so the update chain (DP,
robust aggregators, secure aggregation) does not apply to FedNova's round.
"""

from __future__ import annotations

from typing import Any

import torch

from fedsim.algorithms.fedavg import FedAvg
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
    average_by_arch,
    register_algorithm,
)
from fedsim.method.aggregate import WEIGHT_KEY

STEPS_KEY = "__nova_steps__"
"""The payload entry ‖a_i‖₁ beside the normalised direction."""


def step_norm(steps: int, momentum: float) -> float:
    """‖a‖₁ of `steps` local SGD steps: the steps themselves, or with momentum ρ, Σ_{k=1..τ} (1 − ρ^k)/(1 − ρ)."""
    if momentum == 0:
        return float(steps)
    return sum((1.0 - momentum ** k) / (1.0 - momentum) for k in range(1, steps + 1))


@register_algorithm
class FedNova(FedAvg):
    """FedAvg's clients, each update divided by its local step norm; the server rescales by their mean."""

    name = "fednova"

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum", local_training=True)]

    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD from the broadcast weights; upload (x − y)/‖a‖₁ of the parameters, the buffers, and ‖a‖₁."""
        start = msg.common[ctx.arch]
        momentum = ctx.env.config.train.momentum if ctx.env.config.train.optimizer == "sgd" else 0.0

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            norm = step_norm(int(metrics["steps"]), momentum)
            params = {n for n, _ in model.named_parameters()}
            payload: dict[str, torch.Tensor] = {}
            for k, y in model.state_dict().items():
                x = start[k].to(y.device)
                payload[k] = (x.double() - y.double()) / max(norm, 1e-12) if k in params else y.detach().clone()
            payload[STEPS_KEY] = torch.tensor(norm, dtype=torch.float64)
            return ClientResult(payload=as_summable(ctx.arch, payload), weight=self.client_weight(ctx),
                                metrics={**metrics, "step_norm": norm})

        return LocalTraining.of(ctx, start, finish, mu=self.proximal_mu())

    def server_step(self, phase: Phase, state: GlobalModels, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[GlobalModels, dict[str, Any]]:
        if updates.count == 0:
            return state, {}
        averaged = average_by_arch(updates, state.models)  # the buffers' FedAvg mean (directions are redone below)
        models, metrics = dict(state.models), {}
        for arch, old in state.models.items():
            w = updates.total.get(f"{arch}/{WEIGHT_KEY}")
            if w is None or float(w) <= 0:
                continue
            weight = float(w)
            tau_eff = float(updates.total[f"{arch}/{STEPS_KEY}"]) / weight
            params = {k for k in old if f"{arch}/{k}" in updates.total and k in self.parameter_names(arch)}
            step = self.params.server_lr * tau_eff / weight
            models[arch] = {k: (v.double() - step * updates.total[f"{arch}/{k}"].double()).to(v.dtype)
                            if k in params else averaged[arch][k] for k, v in old.items()}
            metrics[f"tau_eff/{arch}" if len(state.models) > 1 else "tau_eff"] = tau_eff
        return GlobalModels(models=models, extra=state.extra), metrics

    def parameter_names(self, arch: str) -> set[str]:
        """The trainable entries of `arch`'s model (the rest are buffers)."""
        from fedsim.method.toolkit import new_model

        if not hasattr(self, "_params_of"):
            self._params_of: dict[str, set[str]] = {}
        if arch not in self._params_of:
            self._params_of[arch] = {n for n, _ in new_model(self.env, arch).named_parameters()}
        return self._params_of[arch]

    @classmethod
    def stateless_clients(cls, cfg: Any) -> bool:
        return True
