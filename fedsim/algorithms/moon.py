"""MOON (Li, He, Song, CVPR 2021, https://arxiv.org/abs/2103.16257): model-contrastive federated learning.

    client k: from the global model w, local SGD on  CE + μ·ℓ_con,  per batch
              ℓ_con = −log( e^{cos(z, z_glob)/τ} / (e^{cos(z, z_glob)/τ} + Σ_prev e^{cos(z, z_prev)/τ}) )
              z: the local model's representation of the batch; z_glob: the frozen global model's;
              z_prev: each of the client's own last `buffer` local models' (frozen, eval mode)
    server:   FedAvg, w ← Σ_k n_k·w_k / Σ_k n_k

The representation is the model's penultimate embedding (`Classifier.embed`; the logits are `head` of it), so a
model that does not expose one is refused. A client's previous local models are its own per-client state (memory
N × buffer × the model), checkpointed with it; in a client's first round there is none, and the contrastive term is
exactly 0 (the frozen models are not even run). The server side is FedAvg's, so the update chain (DP at client level,
robust aggregators, attacks, secure aggregation) applies; sample-level DP-SGD does not, as it clips each sample's CE
gradient and the contrastive term couples a sample to three models.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedsim.algorithms.fedavg import FedAvg, FedAvgParams
from fedsim.method import (
    Classifier,
    ClientContext,
    ClientResult,
    ConfigError,
    Env,
    LocalTraining,
    Message,
    Phase,
    State,
    as_summable,
    clone_state,
    knob,
    new_model,
    register_algorithm,
)

MAX_BUFFER = 100  # previous local models a client keeps (each one a copy of the model in its state)


@dataclass
class MoonParams(FedAvgParams):
    mu: float = knob(1.0, ge=0, doc="μ, the weight of the model-contrastive term (the official code's default); 0 "
                                    "trains FedAvg's steps")
    temperature: float = knob(0.5, gt=0, doc="τ, the temperature of the cosine similarities")
    buffer: int = knob(1, ge=1, le=MAX_BUFFER, doc="previous local models each client keeps as negatives (the "
                                                   "official model_buffer_size)")


def contrastive_loss(z: torch.Tensor, z_glob: torch.Tensor, z_prev: Sequence[torch.Tensor],
                     temperature: float) -> torch.Tensor:
    """ℓ_con over a batch (its mean): CE with target 0 over the logits [cos(z, z_glob), cos(z, z_prev)...]/τ;
    exactly 0 with no previous model (a single logit)."""
    sims = [F.cosine_similarity(z, z_glob, dim=-1), *(F.cosine_similarity(z, p, dim=-1) for p in z_prev)]
    logits = torch.stack(sims, dim=1) / temperature
    return F.cross_entropy(logits, torch.zeros(len(z), dtype=torch.long, device=z.device))


def check_embeddings(env: Env, arch: str) -> None:
    """A ConfigError naming the model key unless `arch` is a Classifier whose forward is head(embed(x))."""
    with torch.random.fork_rng(devices=[]):
        model = new_model(env, arch)
    cls = type(model)
    if not isinstance(model, Classifier) or cls.embed is Classifier.embed or cls.head is Classifier.head or \
            cls.forward is not Classifier.forward:
        key = "model.mix" if env.config.model.mix else "model.name"
        raise ConfigError(f"{key}: moon contrasts the model's penultimate features, and {arch!r} does not expose "
                          "them (a Classifier with embed(x) and head(z), forward = head(embed(x)))")


def frozen(ctx: ClientContext, role: str, weights: State) -> Classifier:
    """A worker-reused instance of the client's architecture for `role`, holding `weights`, in eval mode."""
    model = ctx.models.get(f"moon/{role}/{ctx.arch}", lambda: new_model(ctx.env, ctx.arch))
    model.load_state_dict(weights)
    return model.eval()


@register_algorithm
class Moon(FedAvg):
    """FedAvg whose clients add a model-contrastive term: near the global model's representation, away from their
    own previous model's."""

    name = "moon"
    Params = MoonParams

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        if env is None:  # built without a run (the config checks read phases only)
            return
        if env.config.privacy.level == "sample":
            raise ConfigError("privacy.level: sample-level DP-SGD clips each sample's cross-entropy gradient, and "
                              "moon's contrastive term is not one; use level client or local")
        for arch in env.archs:
            check_embeddings(env, arch)

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum", model_update=True)]  # its own loss: one client at a time

    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD on CE + μ·ℓ_con from the broadcast model; the trained model is uploaded (weight as FedAvg's)
        and appended to the client's previous models, of which the last `buffer` are kept."""
        p = self.params
        start = msg.common[ctx.arch]
        previous: list[State] = list(state.get("previous", [])) if state else []
        keep = ctx.env.config.train.keep_optimizer_state
        contrast = p.mu > 0 and bool(previous)
        glob = frozen(ctx, "global", start) if contrast else None
        prev = [frozen(ctx, f"previous{i}", w) for i, w in enumerate(previous)] if contrast else []
        total = torch.zeros((), dtype=torch.float64, device=ctx.device)
        seen = [0]

        def batch_loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            z = model.embed(x)  # type: ignore[operator]
            ce = F.cross_entropy(model.head(z), y)  # type: ignore[operator]
            if glob is None:
                return ce
            with torch.no_grad():
                z_glob, z_prev = glob.embed(x), [m.embed(x) for m in prev]
            con = contrastive_loss(z, z_glob, z_prev, p.temperature)
            total.add_(con.detach().double() * len(y))
            seen[0] += len(y)
            return ce + p.mu * con

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            kept: dict[str, Any] = {"previous": (previous + [clone_state(model)])[-p.buffer:]}
            if keep:
                kept["optimizer"] = optimizer
            if p.mu > 0:
                metrics = {**metrics, "contrastive_loss": float(total) / seen[0] if seen[0] else 0.0}
            return ClientResult(payload=as_summable(ctx.arch, model.state_dict()), weight=self.client_weight(ctx),
                                metrics=metrics, state=kept)

        saved = state.get("optimizer") if keep and state else None
        return LocalTraining.of(ctx, start, finish, mu=self.proximal_mu(), batch_loss=batch_loss,
                                optimizer_state=saved, keep_optimizer=keep)
