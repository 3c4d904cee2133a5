"""FedAvgM (Hsu, Qi & Brown 2019, https://arxiv.org/abs/1909.06335): FedAvg with momentum on the server.

    server: w ← init, v ← 0
    each round: w̄ ← FedAvg of the sampled clients' models
                v ← β·v + (w − w̄);  w ← w − η·v

A plugin: this file lives outside the fedsim package, and `plugins: [my_method]` in a config beside it
imports it on the driver and on every Ray worker. It registers its method and the dataclass its server
keeps, so checkpoints of that state load on --resume. fedsim has FedAvgM built in (`fedavgm`); this copy registers
as `my_fedavgm` to show the plugin route.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

from fedsim.algorithms.fedavg import FedAvg
from fedsim.method import (
    Env,
    Phase,
    RoundInfo,
    SummedUpdate,
    average_by_arch,
    init_global_models,
    knob,
    register_algorithm,
    register_state,
)

State = dict[str, torch.Tensor]


@dataclass
class FedAvgMParams:
    beta: float = knob(0.9, ge=0, lt=1, doc="server momentum")
    server_lr: float = knob(1.0, gt=0, doc="server step size on the momentum")
    weighting: Literal["samples", "uniform"] = knob("samples", doc="aggregation weight: 'samples' (|D_k|) or 'uniform'")


@register_state
@dataclass
class MomentumState:
    """The global model of each architecture and its momentum buffer (float entries only)."""

    models: dict[str, State] = field(default_factory=dict)
    velocity: dict[str, State] = field(default_factory=dict)


@register_algorithm
class FedAvgM(FedAvg):
    """FedAvg's clients; the server steps along a running average of the rounds' updates."""

    name = "my_fedavgm"
    Params = FedAvgMParams

    def init_server(self, env: Env) -> MomentumState:
        models = init_global_models(env)
        velocity = {a: {k: torch.zeros_like(v) for k, v in m.items() if v.is_floating_point()}
                    for a, m in models.items()}
        return MomentumState(models=models, velocity=velocity)

    def server_step(self, phase: Phase, state: MomentumState, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[MomentumState, dict]:
        if updates.count == 0:
            return state, {}
        averaged = average_by_arch(updates, state.models)
        beta, lr = self.params.beta, self.params.server_lr
        models, velocity = {}, {}
        for arch, old in state.models.items():
            v = {k: beta * state.velocity[arch][k] + (old[k] - averaged[arch][k].to(old[k].dtype))
                 for k in state.velocity[arch]}
            models[arch] = {k: old[k] - lr * v[k] if k in v else averaged[arch][k] for k in old}
            velocity[arch] = v
        norm = sum(float(t.float().norm() ** 2) for v in velocity.values() for t in v.values()) ** 0.5
        return MomentumState(models=models, velocity=velocity), {"velocity_norm": norm}
