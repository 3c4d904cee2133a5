"""FedBuff (Nguyen et al. 2022, "Federated Learning with Buffered Asynchronous Aggregation",
https://arxiv.org/abs/2106.06639): arrivals' updates wait in a buffer; every K of them make one server step.

    server: x ← init, buffer B ← 0; on each arrival of Δ_k = y_k − x_τ (trained from version τ, applied at t):
            B ← B + s(t − τ)·Δ_k;   after K arrivals: Δ̄ ← B/K, x ← server step along Δ̄, B ← 0, t ← t + 1

s defaults to 1/√(1 + staleness) (the paper's; `staleness: constant` turns the weighting off). The server step is
x ← x + η·Δ̄ (`server_opt: none`), or the FedOpt step (adam, yogi, adagrad) or server momentum (avgm) of
fedsim.method.server_opt along Δ̄. Clients upload their update in float64 (the exact difference of two float32
models), so the buffer's sum is exact to float64: with K = C, equal durations and s = 1, each version equals a
synchronous FedAvg round with uniform weights. Async mode only (participation.mode: async); docs/async.md.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

import torch

from fedsim.config.limits import MAX_CLIENTS
from fedsim.method import (
    ClientContext,
    ClientResult,
    ConfigError,
    GlobalModels,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    ServerOptimizer,
    SummedUpdate,
    as_summable,
    evaluate_models,
    knob,
    register_algorithm,
    server_opt_step,
    split_by_arch,
)
from fedsim.method.asynchronous import NEW_VERSION, AsyncAlgorithm, StalenessParams, arrival
from fedsim.method.server_opt import EXTRA_KEY

BUFFER, BUFFERED = "buffer", "buffered"  # GlobalModels.extra: the weighted sum of updates, arrivals per arch


@dataclass
class FedBuffParams(StalenessParams):
    buffer_size: int = knob(10, ge=1, le=MAX_CLIENTS, doc="K, arrivals buffered per server step (the paper's "
                            "typical 10); at most participation.concurrency")
    server_lr: float = knob(1.0, gt=0, doc="server step size η along the buffer's mean update")
    server_opt: Literal["none", "adam", "yogi", "adagrad", "avgm"] = knob(
        "none", doc="none: x ← x + η·Δ̄; else that server optimiser's step along Δ̄ (fedadam's, fedyogi's, "
        "fedadagrad's, fedavgm's)")
    beta1: float = knob(0.9, ge=0, lt=1, doc="adam/yogi/adagrad: first-moment decay β1")
    beta2: float = knob(0.99, ge=0, lt=1, doc="adam/yogi: second-moment decay β2")
    tau: float = knob(1e-3, gt=0, doc="adam/yogi/adagrad: adaptivity τ added to √v")
    momentum: float = knob(0.9, ge=0, lt=1, doc="avgm: server momentum β")


@register_algorithm
class FedBuff(AsyncAlgorithm):
    """Buffered asynchronous aggregation: K staleness-weighted updates, then one server step."""

    name = "fedbuff"
    Params = FedBuffParams

    @classmethod
    def check_async(cls, cfg: Any, concurrency: int) -> None:
        k = cfg.algorithm.params.buffer_size
        if k > concurrency:
            raise ConfigError(f"algorithm.buffer_size: K={k} exceeds participation.concurrency={concurrency} "
                              "(clients in flight); FedBuff buffers at most as many updates as train at once")

    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD from the model of the client's dispatch; upload y − x_τ (float64; integer buffers as they are)."""
        start = msg.common[ctx.arch]

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            delta = {k: v.detach().double() - start[k].to(v.device, torch.float64) if v.is_floating_point()
                     else v.detach().clone() for k, v in model.state_dict().items()}
            return ClientResult(payload=as_summable(ctx.arch, delta), weight=1.0, metrics=metrics)

        return LocalTraining.of(ctx, start, finish)

    def optimizer(self) -> ServerOptimizer | None:
        p = self.params
        if p.server_opt == "none":
            return None
        return ServerOptimizer(p.server_opt, p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau,
                               momentum=p.momentum)

    def server_step(self, phase: Phase, state: GlobalModels, updates: dict[int, ClientResult],
                    info: RoundInfo) -> tuple[GlobalModels, dict[str, Any]]:
        if not updates:
            return state, {NEW_VERSION: 0}
        weight = self.params.weight(arrival(info).staleness)
        buffer = dict(state.extra.get(BUFFER, {}))
        counts = dict(state.extra.get(BUFFERED, {}))
        for res in updates.values():  # one arrival
            for arch, (_, entries) in split_by_arch(SummedUpdate(res.payload, 1.0, 1)).items():
                model, held = state.models[arch], buffer.get(arch)
                add = {k: weight * v.detach().to("cpu", torch.float64) if model[k].is_floating_point()
                       else v.detach().to("cpu", torch.float64) for k, v in entries.items()}
                buffer[arch] = add if held is None else {k: held[k] + add[k] for k in held}
                counts[arch] = counts.get(arch, 0) + 1
        if sum(counts.values()) < self.params.buffer_size:
            return GlobalModels(state.models, {**state.extra, BUFFER: buffer, BUFFERED: counts}), \
                {NEW_VERSION: 0, "staleness_weight": weight}
        return self.step(state, buffer, counts), {NEW_VERSION: 1, "staleness_weight": weight}

    def step(self, state: GlobalModels, buffer: dict[str, dict[str, torch.Tensor]],
             counts: dict[str, int]) -> GlobalModels:
        """The server step along each architecture's mean buffered update B/K; the buffer emptied."""
        opt, lr = self.optimizer(), self.params.server_lr
        models = dict(state.models)
        slots: dict[str, Any] = dict(state.extra.get(EXTRA_KEY, {}))
        for arch, n in counts.items():
            x = state.models[arch]
            # integer buffers (BatchNorm's counter) take the buffered models' mean, as FedAvg's average does
            target = {k: v.detach().to("cpu", torch.float64) + buffer[arch][k] / n if v.is_floating_point()
                      else (buffer[arch][k] / n).to(v.dtype) for k, v in x.items()}
            if opt is None:
                models[arch] = {k: (target[k] if lr == 1.0 else v.detach().to("cpu", torch.float64)
                                    + lr * (buffer[arch][k] / n)).to(v.device, v.dtype)
                                if v.is_floating_point() else target[k].to(v.device) for k, v in x.items()}
            else:
                models[arch], slots[arch] = server_opt_step(opt, x, target, slots.get(arch))
        extra = {k: v for k, v in state.extra.items() if k not in (BUFFER, BUFFERED)}
        if opt is not None:
            extra[EXTRA_KEY] = slots
        return GlobalModels(models=models, extra=extra)

    def evaluate(self, state: GlobalModels, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)
