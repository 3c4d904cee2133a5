"""Server optimisers on state dicts: the FedOpt family's step (Reddi et al. 2021, Algorithm 2) and server momentum
(Hsu et al. 2019), written once for every method that steps the global model with one.

With Δ = averaged − x (the mean client model minus the server model; local minus global, so the step is +):

    adam:     m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²                      x ← x + η_t·m/(√v + τ)
    yogi:     m ← β1·m + (1−β1)·Δ;  v ← v − (1−β2)·Δ²·sign(v − Δ²)             x ← x + η_t·m/(√v + τ)
    adagrad:  m ← β1·m + (1−β1)·Δ;  v ← v + Δ²                                 x ← x + η_t·m/(√v + τ)
    avgm:     g = x − averaged;     u ← β·u + g                                x ← x − η·u

η_t = η, or with `bias_correction` η·√(1−β2^t)/(1−β1^t), t = 1, 2, ... the architecture's server step. Arithmetic
is float64 on the floating entries (parameters and floating buffers); integer buffers (BatchNorm's step counter)
take the averaged model's value, as FedAvg does. The optimiser's state (step, m, v, or the momentum u) lives per
architecture in `GlobalModels.extra["server_opt"]` as plain float64 tensors, so a checkpoint carries it exactly and
a resumed run continues it. An architecture nobody trained this round keeps its model and its optimiser state.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedsim.method.aggregate import WEIGHT_KEY, average_by_arch
from fedsim.method.contract import SummedUpdate
from fedsim.method.toolkit import GlobalModels

State = dict[str, torch.Tensor]
RULES = ("adam", "yogi", "adagrad", "avgm")
EXTRA_KEY = "server_opt"


@dataclass(frozen=True)
class ServerOptimizer:
    """One server optimiser's rule and hyperparameters (`momentum` is avgm's β; the betas, tau, v_init and
    bias_correction are the adaptive rules')."""

    rule: str
    lr: float
    beta1: float = 0.9
    beta2: float = 0.99
    tau: float = 1e-3
    v_init: float = 0.0
    bias_correction: bool = False
    momentum: float = 0.0

    def __post_init__(self) -> None:
        if self.rule not in RULES:
            raise ValueError(f"server optimiser rule must be one of {RULES}, got {self.rule!r}")
        if self.bias_correction and self.rule != "adam":
            raise ValueError("bias_correction is FedAdam's (Flower's form); the other rules take none")


def fresh_slots(opt: ServerOptimizer, model: Mapping[str, torch.Tensor]) -> dict[str, Any]:
    """The optimiser state before the first step: zeros (v at v_init) over the model's floating entries."""
    floats = {k: v for k, v in model.items() if v.is_floating_point()}
    if opt.rule == "avgm":
        return {"step": 0, "momentum": {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in floats.items()}}
    return {"step": 0, "m": {k: torch.zeros(v.shape, dtype=torch.float64) for k, v in floats.items()},
            "v": {k: torch.full(v.shape, float(opt.v_init), dtype=torch.float64) for k, v in floats.items()}}


def server_opt_step(opt: ServerOptimizer, model: Mapping[str, torch.Tensor], averaged: Mapping[str, torch.Tensor],
                    slots: Mapping[str, Any] | None = None) -> tuple[State, dict[str, Any]]:
    """One server step of one architecture: the new model (each entry in the old one's dtype and device) and the
    new optimiser state, from the old model, the clients' averaged model and the old state (None: fresh)."""
    slots = fresh_slots(opt, model) if slots is None else slots
    step = int(slots["step"]) + 1
    new: State = {}
    out: dict[str, Any] = {"step": step}
    if opt.rule == "avgm":
        out["momentum"] = {}
    else:
        out["m"], out["v"] = {}, {}
    lr = opt.lr
    if opt.bias_correction:
        lr = opt.lr * math.sqrt(1.0 - opt.beta2 ** step) / (1.0 - opt.beta1 ** step)
    for k, old in model.items():
        target = averaged[k]
        if not old.is_floating_point():
            new[k] = target
            continue
        x = old.detach().to("cpu", torch.float64)
        avg = target.detach().to("cpu", torch.float64)
        if opt.rule == "avgm":
            u = opt.momentum * slots["momentum"][k] + (x - avg)
            out["momentum"][k] = u
            x_new = x - lr * u
        else:
            delta = avg - x
            m = opt.beta1 * slots["m"][k] + (1.0 - opt.beta1) * delta
            sq = delta * delta
            v_old = slots["v"][k]
            if opt.rule == "adam":
                v = opt.beta2 * v_old + (1.0 - opt.beta2) * sq
            elif opt.rule == "yogi":
                v = v_old - (1.0 - opt.beta2) * sq * torch.sign(v_old - sq)
            else:
                v = v_old + sq
            out["m"][k], out["v"][k] = m, v
            x_new = x + lr * m / (torch.sqrt(v) + opt.tau)
        new[k] = x_new.to(device=old.device, dtype=old.dtype)
    return new, out


STEP_RATIO_COLUMNS = {"train/step_ratio": "the server step's length over the round's mean client update's, "
                      "‖x_new − x‖/‖avg − x‖ over the floating entries (FedAvg's is its server_lr): how much further "
                      "or shorter the server optimizer goes than the clients' average; recorded every round"}
"""The rounds.parquet column a server optimizer's step records, which a reproduce table may show (docs/methods/
fedopt.md)."""


def server_opt_by_arch(opt: ServerOptimizer, state: GlobalModels,
                       updates: SummedUpdate) -> tuple[GlobalModels, dict[str, float]]:
    """The round's server step for every architecture that clients trained: average their models (the method's
    own weights), then step each global model with `opt`; the optimiser state is kept in `state.extra`. Also the
    step's length over the mean update's, ‖x_new − x‖/‖avg − x‖ over the floating entries (`step_ratio`; FedAvg's
    is its server_lr): how much further, or shorter, the adaptive step goes than the clients' average would."""
    if updates.count == 0:
        return state, {}
    averaged = average_by_arch(updates, state.models)
    kept: dict[str, Any] = dict(state.extra.get(EXTRA_KEY, {}))
    models = dict(state.models)
    step_sq = update_sq = 0.0
    for arch, old in state.models.items():
        w = updates.total.get(f"{arch}/{WEIGHT_KEY}")
        if w is None or float(w) <= 0:
            continue  # nobody trained this architecture: its model and its optimiser state stay as they are
        models[arch], kept[arch] = server_opt_step(opt, old, averaged[arch], kept.get(arch))
        for k, x in old.items():
            if x.is_floating_point():
                x64 = x.detach().to("cpu", torch.float64)
                step_sq += float((models[arch][k].detach().to("cpu", torch.float64) - x64).pow(2).sum())
                update_sq += float((averaged[arch][k].detach().to("cpu", torch.float64) - x64).pow(2).sum())
    info = {"step_ratio": math.sqrt(step_sq / update_sq)} if update_sq > 0 else {}
    return GlobalModels(models=models, extra={**state.extra, EXTRA_KEY: kept}), info
