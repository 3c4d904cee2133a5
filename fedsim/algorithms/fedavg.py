"""FedAvg (McMahan et al. 2017, https://arxiv.org/abs/1602.05629): sample-weighted averaging of local models.

    server: w ← init
    each round: sample clients S
      client k ∈ S: w_k ← local SGD on D_k from w
      server:       w ← Σ_k |D_k|·w_k / Σ_k |D_k|

The server keeps one global model per client architecture, so heterogeneous runs average within each
architecture. The phase is `reduce="sum"`: workers pre-sum the clients' weights and send one partial sum.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    GlobalModels,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    ServerOptimizer,
    SummedUpdate,
    as_summable,
    average_by_arch,
    evaluate_models,
    init_global_models,
    knob,
    move_toward,
    register_algorithm,
    server_opt_by_arch,
)


@dataclass
class FedAvgParams:
    weighting: str = knob("samples", doc="aggregation weight: 'samples' (|D_k|) or 'uniform'")
    server_lr: float = knob(1.0, gt=0, doc="server step on the averaged update (1.0 is plain FedAvg)")

    def __post_init__(self) -> None:
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {self.weighting!r}")


@register_algorithm
class FedAvg(Algorithm):
    """Local SGD on sampled clients, then the sample-weighted average of their models."""

    name = "fedavg"
    Params = FedAvgParams

    def init_server(self, env: Env) -> GlobalModels:
        return GlobalModels(models=init_global_models(env))

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum", local_training=True, model_update=True)]

    def broadcast(self, phase: Phase, state: GlobalModels, info: RoundInfo) -> Broadcast:
        return Broadcast(common=state.models)

    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD from the broadcast weights, then upload the model (workers may train many clients together)."""
        keep = ctx.env.config.train.keep_optimizer_state

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            # the model's own tensors, not a copy: the worker adds them to its sum before the next client trains
            return ClientResult(payload=as_summable(ctx.arch, model.state_dict()), weight=self.client_weight(ctx),
                                metrics=metrics, state={"optimizer": optimizer} if keep else None)

        saved = state.get("optimizer") if keep and state else None
        return LocalTraining.of(ctx, msg.common[ctx.arch], finish, mu=self.proximal_mu(), optimizer_state=saved,
                                keep_optimizer=keep)

    def server_step(self, phase: Phase, state: GlobalModels, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[GlobalModels, dict]:
        if updates.count == 0:
            return state, {}
        optimizer = self.server_optimizer()
        if optimizer is not None:  # FedAdam, FedYogi, FedAdagrad, FedAvgM: the kit's server step
            return server_opt_by_arch(optimizer, state, updates)
        averaged = average_by_arch(updates, state.models)
        models = {a: move_toward(state.models[a], averaged[a], self.params.server_lr) for a in state.models}
        return GlobalModels(models=models, extra=state.extra), {}

    def evaluate(self, state: GlobalModels, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)

    @classmethod
    def stateless_clients(cls, cfg: Any) -> bool:
        """Stateless unless the optimizer state is kept; a variant with its own client step may return a state, so
        it is taken as stateful unless it overrides this too."""
        own_step = cls.client_step is Algorithm.client_step and cls.local_training is FedAvg.local_training
        return own_step and not cfg.train.keep_optimizer_state

    # ---- what variants change ------------------------------------------------------------------------
    def client_weight(self, ctx: ClientContext) -> float:
        return float(ctx.data.num_samples) if self.params.weighting == "samples" else 1.0

    def server_optimizer(self) -> ServerOptimizer | None:
        """The server's optimiser on the mean update (fedsim.method.server_opt); None: FedAvg's step of server_lr."""
        return None

    def proximal_mu(self) -> float:
        """The weight mu of a proximal term mu/2·||w - w_global||² in the local loss (FedProx); 0 for none."""
        return 0.0
