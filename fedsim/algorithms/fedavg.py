"""FedAvg (McMahan et al. 2017, https://arxiv.org/abs/1602.05629): sample-weighted averaging of local models.

The server keeps one global model per client architecture, so heterogeneous runs average within each
architecture (the first half of client-model mirroring). Updates are summed inside the workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedsim.algorithms.base import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    Phase,
    RoundInfo,
    SummedUpdate,
    register_algorithm,
)
from fedsim.checkpoint import register_state
from fedsim.configtools import knob
from fedsim.errors import AggregationError
from fedsim.models import build_model
from fedsim.train import evaluate_classifier, make_optimizer, train_classifier

State = dict[str, torch.Tensor]
WEIGHT_KEY = "__weight__"


@dataclass
class FedAvgParams:
    weighting: str = knob("samples", doc="aggregation weight: 'samples' (|D_k|) or 'uniform'")
    server_lr: float = knob(1.0, gt=0, doc="server step on the averaged update (1.0 is plain FedAvg)")

    def __post_init__(self) -> None:
        if self.weighting not in ("samples", "uniform"):
            raise ValueError(f"weighting must be 'samples' or 'uniform', got {self.weighting!r}")


@register_state
@dataclass
class GlobalModels:
    """Server state of the FedAvg family: one state dict per architecture."""

    models: dict[str, State] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


def new_model(env: Env, arch: str) -> torch.nn.Module:
    """Build an architecture for this run's input shape and class count."""
    shape = env.input_shape
    channels = shape[0] if len(shape) == 3 else 1
    size = shape[-1] if len(shape) == 3 else 0
    return build_model(arch, channels, env.num_classes, size, **env.config.model.options)


def init_global_models(env: Env) -> dict[str, State]:
    """One freshly initialised model per architecture, seeded by the run seed."""
    out = {}
    for i, arch in enumerate(env.archs):
        torch.manual_seed(env.config.seed * 1000 + i)
        out[arch] = {k: v.detach().clone() for k, v in new_model(env, arch).state_dict().items()}
    return out


def clone_state(model: torch.nn.Module) -> State:
    """A detached CPU copy of a model's state dict (what a client uploads)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def as_summable(arch: str, state: State) -> dict[str, torch.Tensor]:
    """Prefix keys with the architecture and add a weight counter, so one sum serves every architecture."""
    out = {f"{arch}/{k}": v for k, v in state.items()}
    out[f"{arch}/{WEIGHT_KEY}"] = torch.ones(())
    return out


def average_by_arch(summed: SummedUpdate, previous: dict[str, State]) -> dict[str, State]:
    """Per-architecture weighted means from a SummedUpdate; architectures nobody trained keep their model."""
    out = {}
    for arch, old in previous.items():
        w = summed.total.get(f"{arch}/{WEIGHT_KEY}")
        if w is None or float(w) <= 0:
            out[arch] = old
            continue
        new = {}
        for k, v in old.items():
            key = f"{arch}/{k}"
            if key not in summed.total:
                raise AggregationError(f"aggregate: key {key!r} missing from the summed client updates")
            new[k] = (summed.total[key] / w).to(v.dtype)
        out[arch] = new
    return out


@register_algorithm
class FedAvg(Algorithm):
    """Local SGD on sampled clients, then the sample-weighted average of their models."""

    name = "fedavg"
    Params = FedAvgParams

    def init_server(self, env: Env) -> GlobalModels:
        return GlobalModels(models=init_global_models(env))

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum")]

    def broadcast(self, phase: Phase, state: GlobalModels, info: RoundInfo) -> Broadcast:
        return Broadcast(common=state.models)

    @classmethod
    def stateless_clients(cls, cfg) -> bool:
        return not cfg.train.keep_optimizer_state

    def client_weight(self, ctx: ClientContext) -> float:
        return float(ctx.data.num_samples) if self.params.weighting == "samples" else 1.0

    def extra_loss(self, model: torch.nn.Module, global_state: State):
        """A term added to the local CE loss (None for FedAvg; FedProx's proximal term)."""
        return None

    def local_train(self, model: torch.nn.Module, global_state: State, ctx: ClientContext,
                    personal: dict | None) -> tuple[dict[str, float], dict | None]:
        """Train `model` (already holding the global weights) on the client's data."""
        train = ctx.env.config.train
        opt = make_optimizer(model.parameters(), train)
        if train.keep_optimizer_state and personal and "optimizer" in personal:
            opt.load_state_dict(personal["optimizer"])
        metrics = train_classifier(model, ctx.data.x, ctx.data.y, train, ctx.generator(),
                                   extra_loss=self.extra_loss(model, global_state), optimizer=opt)
        return metrics, ({"optimizer": opt.state_dict()} if train.keep_optimizer_state else None)

    def client_step(self, phase: Phase, state: dict | None, msg: Any, ctx: ClientContext) -> ClientResult:
        model = ctx.models.get(ctx.arch)
        global_state = msg[ctx.arch]
        model.load_state_dict(global_state)
        metrics, new_state = self.local_train(model, global_state, ctx, state)
        return ClientResult(payload=as_summable(ctx.arch, clone_state(model)), weight=self.client_weight(ctx),
                            metrics=metrics, state=new_state)

    def server_step(self, phase: Phase, state: GlobalModels, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[GlobalModels, dict]:
        if updates.count == 0:
            return state, {}
        averaged = average_by_arch(updates, state.models)
        lr = self.params.server_lr
        if lr != 1.0:
            averaged = {a: {k: (old + lr * (averaged[a][k].to(old.dtype) - old)) if old.is_floating_point()
                            else averaged[a][k] for k, old in state.models[a].items()}
                        for a in state.models}
        return GlobalModels(models=averaged, extra=state.extra), {}

    def evaluate(self, state: GlobalModels, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        rows = []
        for arch, weights in state.models.items():
            model = new_model(self.env, arch).to(device)
            model.load_state_dict(weights)
            rows.append({"model": arch, **evaluate_classifier(model, x_test, y_test,
                                                              self.env.config.eval.batch_size)})
        return rows
