"""FedDyn (Acar et al. 2021, https://arxiv.org/abs/2111.04263): federated learning with dynamic regularisation.

    server: θ = init, h = 0;  every client k: g_k = 0   (g_k stands for the paper's ∇L_k(θ_k^{t−1}))
    each round: sample clients P; send θ
      client k ∈ P: θ_k ← argmin  L_k(θ_k) − ⟨g_k, θ_k⟩ + (α/2)·‖θ_k − θ‖²   (local SGD from θ)
                    g_k ← g_k − α·(θ_k − θ);  send θ_k
      server:       h ← h − α·(1/N)·Σ_{k∈P} (θ_k − θ)      N: every client, not only P
                    θ ← (1/|P|)·Σ_{k∈P} θ_k − h/α           the unweighted mean over the cohort

The linear term ⟨g_k, θ_k⟩ and the quadratic (α/2)‖θ_k − θ‖² make each client's stationary point agree with the
global one, so local optima stop pulling the model away from the federated optimum however far clients train.
g_k is per-client state in the client's worker (checkpointed with it, kept while the client sits rounds out); h is
server state, in float64. The evaluated model is the server's θ, as in the paper. One θ and h per architecture,
N counting that architecture's clients. The correction applies to trainable parameters; buffers (BatchNorm's
running statistics) are averaged as FedAvg's. The upload is the client's model, so the update chain (DP, robust
aggregators, attacks, secure aggregation) applies to it; Σ_{k∈P}(θ_k − θ) is then read from the chain's
aggregate as |P|·(mean − θ).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from fedsim.method import (
    WEIGHT_KEY,
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    State,
    SummedUpdate,
    as_summable,
    average_by_arch,
    evaluate_models,
    init_global_models,
    knob,
    new_model,
    register_algorithm,
    register_state,
)


@dataclass
class FedDynParams:
    alpha: float = knob(0.01, gt=0, doc="α, the weight of the dynamic regulariser (0.01 in the official CIFAR-10 "
                                        "example)")


@register_state
@dataclass
class FedDynState:
    """θ (one model per architecture, what is evaluated) and h (float64, over each model's trainable parameters)."""

    models: dict[str, State] = field(default_factory=dict)
    h: dict[str, State] = field(default_factory=dict)


def trainable_names(env: Env, arch: str) -> list[str]:
    """Names of an architecture's trainable parameters (the entries FedDyn corrects)."""
    with torch.random.fork_rng(devices=[]):
        return [n for n, p in new_model(env, arch).named_parameters() if p.requires_grad]


def linear_term(g: dict[str, torch.Tensor]) -> Any:
    """The loss term −⟨g, θ⟩ over the named parameters in `g` (its gradient is −g)."""

    def term(model: torch.nn.Module) -> torch.Tensor | float:
        return -sum((p * g[n]).sum() for n, p in model.named_parameters() if n in g)

    return term


def server_update(theta: State, h: State, mean: State, participants: float, total: int,
                  alpha: float) -> tuple[State, State]:
    """The server's step on one architecture's trainable entries: h ← h − α·(|P|/N)·(mean − θ), then
    θ ← mean − h/α (float64 arithmetic; θ back in its own dtype)."""
    new_h, new_theta = {}, {}
    for n, v in h.items():
        old, avg = theta[n].double(), mean[n].double()
        new_h[n] = v - alpha * (participants / total) * (avg - old)
        new_theta[n] = (avg - new_h[n] / alpha).to(theta[n].dtype)
    return new_theta, new_h


@register_algorithm
class FedDyn(Algorithm):
    """Local SGD on a dynamically regularised loss; the server corrects the cohort mean by the accumulated h."""

    name = "feddyn"
    Params = FedDynParams

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        self._trainable: dict[str, list[str]] = {}

    def trainable(self, arch: str) -> list[str]:
        if arch not in self._trainable:
            self._trainable[arch] = trainable_names(self.env, arch)
        return self._trainable[arch]

    # ---- server ----------------------------------------------------------------------------------------
    def init_server(self, env: Env) -> FedDynState:
        models = init_global_models(env)
        h = {a: {n: torch.zeros(models[a][n].shape, dtype=torch.float64) for n in self.trainable(a)} for a in models}
        return FedDynState(models=models, h=h)

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum", model_update=True)]  # its own loss: one client at a time

    def broadcast(self, phase: Phase, state: FedDynState, info: RoundInfo) -> Broadcast:
        return Broadcast(common=state.models)

    def server_step(self, phase: Phase, state: FedDynState, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[FedDynState, dict[str, Any]]:
        if updates.count == 0:
            return state, {}
        averaged = average_by_arch(updates, state.models)  # the buffers' plain mean (every client's weight is 1)
        models, h = dict(state.models), dict(state.h)
        for arch, old in state.models.items():
            w = updates.total.get(f"{arch}/{WEIGHT_KEY}")
            if w is None or float(w) <= 0:
                continue  # nobody of this architecture arrived: θ and h stay
            mean = {n: updates.total[f"{arch}/{n}"].double() / float(w) for n in state.h[arch]}  # float64
            theta, h[arch] = server_update(old, state.h[arch], mean, float(w), self.env.client_archs.count(arch),
                                           self.params.alpha)
            models[arch] = {k: theta.get(k, averaged[arch][k]) for k in old}  # buffers: the plain mean
        norm = sum(float(v.pow(2).sum()) for hs in h.values() for v in hs.values()) ** 0.5
        return FedDynState(models=models, h=h), {"h_norm": norm}

    def evaluate(self, state: FedDynState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)

    # ---- client ----------------------------------------------------------------------------------------
    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local training on CE − ⟨g_k, θ⟩ + (α/2)‖θ − θ_server‖² (the proximal term anchored at the start), then
        g_k ← g_k − α(θ_k − θ_server) kept, and θ_k uploaded with weight 1."""
        start = msg.common[ctx.arch]
        alpha = self.params.alpha
        keep = ctx.env.config.train.keep_optimizer_state
        names = self.trainable(ctx.arch)
        g = {n: v.to(ctx.device) for n, v in state["grad"].items()} if state and "grad" in state else \
            {n: torch.zeros_like(start[n], device=ctx.device) for n in names}

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            params = dict(model.named_parameters())
            grad = {n: (g[n] - alpha * (params[n].detach() - start[n].to(g[n].device))).cpu() for n in names}
            kept: dict[str, Any] = {"grad": grad}
            if keep:
                kept["optimizer"] = optimizer
            return ClientResult(payload=as_summable(ctx.arch, model.state_dict()), weight=1.0, metrics=metrics,
                                state=kept)

        saved = state.get("optimizer") if keep and state else None
        return LocalTraining.of(ctx, start, finish, mu=alpha, extra_loss=linear_term(g), optimizer_state=saved,
                                keep_optimizer=keep)
