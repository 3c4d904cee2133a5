"""SCAFFOLD (Karimireddy et al. 2020, https://arxiv.org/abs/1910.06378): local SGD corrected by control variates.

    server: x, c = 0;  every client i: c_i = 0
    each round: sample clients S; send (x, c)
      client i ∈ S: y ← x;  K times: y ← y − η_l·(g_i(y) − c_i + c)
                    c_i⁺ ← c_i − c + (x − y)/(K·η_l)          (option II)   or  g_i(x), full batch (option I)
                    send Δy_i = y − x, Δc_i = c_i⁺ − c_i;  keep c_i ← c_i⁺
      server:       x ← x + η_g·mean_S(Δy_i);   c ← c + (1/N)·Σ_S Δc_i

The control variates c_i are per-client state that lives in the client's worker; x and c are server state.
The correction enters local training as the linear loss term ⟨c − c_i, y⟩, whose gradient is exactly
c − c_i. One x and c per architecture; N counts the clients of that architecture. BatchNorm buffers are
averaged like FedAvg's. The phase is `reduce="sum"`: workers pre-sum Δy, the buffers and Δc.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    ConfigError,
    Env,
    Message,
    Phase,
    RoundInfo,
    State,
    SummedUpdate,
    as_summable,
    evaluate_models,
    init_global_models,
    knob,
    make_optimizer,
    new_model,
    register_algorithm,
    register_state,
    split_by_arch,
    train_classifier,
)


@dataclass
class ScaffoldParams:
    server_lr: float = knob(1.0, gt=0, doc="η_g, the global step size (the paper's experiments: 1)")
    control: Literal["II", "I"] = knob("II", doc="c_i⁺ option: II reuses the local steps (the paper's choice), "
                                       "I is the full-batch gradient at x (one more pass over the data)")
    weighting: Literal["uniform", "samples"] = knob("uniform", doc="mean of Δy over the sampled clients: 1/|S| "
                                                    "(the paper) or by sample count")


@register_state
@dataclass
class ScaffoldState:
    """x (one model per architecture) and the server control variate c (its trainable parameters)."""

    models: dict[str, State] = field(default_factory=dict)
    controls: dict[str, State] = field(default_factory=dict)


@dataclass(frozen=True)
class ScaffoldRound:
    """What every sampled client receives: x and c."""

    models: dict[str, State]
    controls: dict[str, State]


def trainable_names(env: Env, arch: str) -> list[str]:
    """Names of an architecture's trainable parameters (the entries that carry control variates)."""
    with torch.random.fork_rng(devices=[]):
        return [n for n, p in new_model(env, arch).named_parameters() if p.requires_grad]


@register_algorithm
class Scaffold(Algorithm):
    """Local SGD with the drift correction c − c_i; the server averages Δy and accumulates Δc."""

    name = "scaffold"
    Params = ScaffoldParams

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        train = env.config.train
        if train.optimizer != "sgd":
            raise ConfigError(f"train.optimizer: scaffold corrects plain SGD steps; got {train.optimizer!r}")
        self.trainable = {arch: trainable_names(env, arch) for arch in env.archs}

    # ---- server ----------------------------------------------------------------------------------------
    def init_server(self, env: Env) -> ScaffoldState:
        models = init_global_models(env)
        controls = {a: {n: torch.zeros_like(models[a][n]) for n in self.trainable[a]} for a in models}
        return ScaffoldState(models=models, controls=controls)

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum", model_update=True)]

    def upload_reference(self, phase: Phase, common: ScaffoldRound, arch: str) -> dict[str, torch.Tensor]:
        """The model and control deltas are differences already (zeros); the buffers are the broadcast's."""
        names = self.trainable[arch]
        out = {f"dy/{n}": torch.zeros_like(v) for n, v in common.models[arch].items() if n in names}
        out.update({f"buf/{k}": v for k, v in common.models[arch].items() if k not in names})
        out.update({f"dc/{n}": torch.zeros_like(v) for n, v in common.controls[arch].items()})
        return out

    def broadcast(self, phase: Phase, state: ScaffoldState, info: RoundInfo) -> Broadcast:
        return Broadcast(common=ScaffoldRound(state.models, state.controls))

    def server_step(self, phase: Phase, state: ScaffoldState, updates: SummedUpdate,
                    info: RoundInfo) -> tuple[ScaffoldState, dict]:
        sums = split_by_arch(updates)
        models, controls = dict(state.models), dict(state.controls)
        for arch, (weight, total) in sums.items():
            if weight <= 0:
                continue
            n_arch = self.env.client_archs.count(arch)
            x, c = state.models[arch], state.controls[arch]
            models[arch] = {k: (v + self.params.server_lr * (total[f"dy/{k}"] / weight).to(v.dtype))
                            if k in c else (total[f"buf/{k}"] / weight).to(v.dtype) for k, v in x.items()}
            controls[arch] = {n: v + (total[f"dc/{n}"] / n_arch).to(v.dtype) for n, v in c.items()}
        norm = sum(float(v.double().pow(2).sum()) for cs in controls.values() for v in cs.values()) ** 0.5
        return ScaffoldState(models=models, controls=controls), {"control_norm": norm}

    def evaluate(self, state: ScaffoldState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)

    # ---- client ----------------------------------------------------------------------------------------
    def client_step(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        rnd: ScaffoldRound = msg.common
        train, names = ctx.env.config.train, self.trainable[ctx.arch]
        model = ctx.models.get(ctx.arch)
        model.load_state_dict(rnd.models[ctx.arch])
        x = {n: p.detach().clone() for n, p in model.named_parameters() if n in names}
        c = {n: v.to(ctx.device) for n, v in rnd.controls[ctx.arch].items()}
        c_i = {n: v.to(ctx.device) for n, v in state["control"].items()} if state else \
            {n: torch.zeros_like(v) for n, v in c.items()}
        grad_x = self.full_gradient(model, ctx) if self.params.control == "I" else None
        correction = {n: c[n] - c_i[n] for n in names}

        def drift(m: torch.nn.Module) -> torch.Tensor | float:  # gradient c − c_i
            return sum((p * correction[n]).sum() for n, p in m.named_parameters() if n in correction)

        metrics = train_classifier(model, ctx.data.x, ctx.data.y, train, ctx.generator(), extra_loss=drift,
                                   optimizer=make_optimizer(model.parameters(), train), dp=ctx.dp_sgd)
        steps = metrics["steps"]
        y = dict(model.named_parameters())
        if grad_x is not None:
            c_new = grad_x
        elif steps > 0:
            c_new = {n: c_i[n] - c[n] + (x[n] - y[n].detach()) / (steps * train.lr) for n in names}
        else:
            c_new = c_i
        weight = float(ctx.data.num_samples) if self.params.weighting == "samples" else 1.0
        upload = {f"dy/{n}": (y[n].detach() - x[n]).cpu() for n in names}
        upload.update({f"buf/{k}": v.detach().cpu() for k, v in model.state_dict().items() if k not in x})
        upload.update({f"dc/{n}": ((c_new[n] - c_i[n]) / weight).cpu() for n in names})  # Σ w·(Δc/w) = ΣΔc
        return ClientResult(payload=as_summable(ctx.arch, upload), weight=weight, metrics=metrics,
                            state={"control": {n: v.detach().cpu() for n, v in c_new.items()}})

    def full_gradient(self, model: torch.nn.Module, ctx: ClientContext) -> State:
        """Option I: ∇f_i(x) over all of the client's data, BatchNorm buffers left as they were."""
        kept = {k: v.clone() for k, v in model.named_buffers()}
        model.train()
        model.zero_grad(set_to_none=True)
        x, y, bs = ctx.data.x, ctx.data.y, ctx.env.config.train.batch_size
        for i in range(0, len(y), bs):
            (F.cross_entropy(model(x[i:i + bs]), y[i:i + bs], reduction="sum") / len(y)).backward()
        grads = {n: (p.grad.detach().clone() if p.grad is not None else torch.zeros_like(p))
                 for n, p in model.named_parameters() if n in self.trainable[ctx.arch]}
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            for k, v in model.named_buffers():
                v.copy_(kept[k])
        return grads
