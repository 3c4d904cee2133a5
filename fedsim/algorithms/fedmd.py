"""FedMD (Li & Wang 2019, https://arxiv.org/abs/1910.03581) as run in Banerjee 2022 (FedGDKD thesis, Alg. 1).

The public set is built from a random 5% of every client's private data (round 0 `share` phase; the thesis
assumes no proxy set exists). Initialisation ("transfer learning"): each party trains on the public set,
then on its private set. Each round: communicate (logits on the public set, fixed order) → aggregate (the
consensus is the plain mean over the arrived clients, no leave-one-out) → distribute → digest (KD towards
the consensus on the public set) → revisit (a few epochs on private data).

The digest uses the shared KD loop: (1-α)·CE(public labels) + α·τ²·KL(consensus ‖ student), with the
thesis's Table 5.1 α = 0.8, τ = 4 "if applicable". [C] The author's code used CE + 0.5·MSE(logits,
consensus), which fedsim.distill does not offer.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fedsim.algorithms._personal import personal_model, score, with_model
from fedsim.algorithms.base import Broadcast, ClientContext, ClientResult, Phase, RoundInfo, register_algorithm
from fedsim.algorithms.local_only import LocalOnly, PoolState, pool_data
from fedsim.configtools import knob
from fedsim.distill import DistillConfig, distill, soften
from fedsim.limits import MAX_BATCH, MAX_EPOCHS
from fedsim.train import predict_logits


@dataclass
class FedMDParams:
    public_fraction: float = knob(0.05, gt=0, le=1, doc="fraction of each client's data pooled as the public set")
    pretrain_public_epochs: int = knob(20, ge=0, le=MAX_EPOCHS, doc="[C] transfer learning: epochs on the public set")
    pretrain_private_epochs: int = knob(5, ge=0, le=MAX_EPOCHS,
                                        doc="[C] transfer learning: then epochs on the private set")
    digest_epochs: int = knob(5, ge=1, le=MAX_EPOCHS, doc="[C] epochs of KD towards the consensus per round")
    revisit_epochs: int = knob(5, ge=0, le=MAX_EPOCHS, doc="[C] epochs on the private data per round after digesting")
    kd_alpha: float = knob(0.8, ge=0, le=1, doc="KD weight α (Table 5.1)")
    kd_T: float = knob(4.0, gt=0, doc="soft-target temperature τ (Table 5.1)")
    kd_batch_size: int = knob(32, ge=1, le=MAX_BATCH, doc="digest batch size")


@register_algorithm
class FedMD(LocalOnly):
    """Model distillation through a consensus of logits on a shared public set."""

    name = "fedmd"
    Params = FedMDParams
    work_phase = "logits"

    @property
    def share_fraction(self) -> float:  # type: ignore[override]
        return self.params.public_fraction

    def phases(self, round: int) -> list[Phase]:
        return super().phases(round) + [Phase("digest", "each")]

    def broadcast(self, phase: Phase, state: PoolState, info: RoundInfo) -> Broadcast:
        if phase.name == "digest":
            return Broadcast(common={"consensus": state.extra.get("consensus")})
        return super().broadcast(phase, state, info)

    def server_step(self, phase: Phase, state: PoolState, updates: Any, info: RoundInfo) -> tuple[Any, dict]:
        if phase.name == "logits":
            held = sorted(set(state.has_pool) | set(updates))
            if not updates:
                return dataclasses.replace(state, has_pool=held, extra={}), {}
            consensus = torch.stack([updates[c].payload["logits"].float() for c in sorted(updates)]).mean(0)
            acc = float((consensus.argmax(1) == state.pool["y"]).float().mean())
            return dataclasses.replace(state, has_pool=held, extra={"consensus": consensus}), \
                {"consensus_public_accuracy": acc}
        if phase.name == "digest":
            scores = state.scores.record(updates)
            return dataclasses.replace(state, scores=scores, extra={}), scores.summary(sorted(updates))
        return super().server_step(phase, state, updates, info)

    def client_step(self, phase: Phase, state: dict | None, msg: Any, ctx: ClientContext) -> ClientResult:
        if phase.name == "share":
            return super().client_step(phase, state, msg, ctx)
        p, n, gen = self.params, float(ctx.data.num_samples), ctx.generator()
        state = self.receive_pool(state, msg)
        public = pool_data(state)
        model = personal_model(ctx, state)
        dev = ctx.data.x.device
        px, py = public[0].to(dev), public[1].to(dev)
        if phase.name == "logits":
            metrics: dict[str, float] = {}
            if state is None or "model" not in state:  # transfer learning: public set, then private set
                metrics.update({f"pretrain_public_{k}": v for k, v in
                                self.epochs(model, px, py, p.pretrain_public_epochs, ctx, gen).items()})
                self.epochs(model, ctx.data.x, ctx.data.y, p.pretrain_private_epochs, ctx, gen)
            logits = predict_logits(model, px, ctx.env.config.eval.batch_size).cpu()
            return ClientResult({"logits": logits}, n, metrics, with_model(state, model))
        tr = ctx.env.config.train
        cfg = DistillConfig(steps=None, epochs=p.digest_epochs, batch_size=p.kd_batch_size, lr=tr.lr,
                            optimizer=tr.optimizer, momentum=tr.momentum, weight_decay=tr.weight_decay, T=p.kd_T,
                            kd_weight=p.kd_alpha, ce_weight=1.0 - p.kd_alpha, keep_best=False)
        consensus = msg["consensus"].to(dev).float()
        out = distill(model, px, soften(consensus, p.kd_T), cfg, gen, hard_labels=py)
        metrics = {"digest_loss": out["loss"]}
        metrics.update({f"revisit_{k}": v for k, v in
                        self.epochs(model, ctx.data.x, ctx.data.y, p.revisit_epochs, ctx, gen).items()})
        metrics.update(score(model, ctx))
        return ClientResult(None, n, metrics, with_model(state, model))
