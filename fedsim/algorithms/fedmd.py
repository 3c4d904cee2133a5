"""FedMD (Li & Wang 2019, https://arxiv.org/abs/1910.03581) as run in Banerjee 2022 (FedGDKD thesis, Alg. 1).

The public set is built from a random 5% of every client's private data (round 0 `share` phase; the thesis
assumes no proxy set exists). Initialisation ("transfer learning"): each party trains on the public set,
then on its private set. Each round: communicate (logits on the public set, fixed order) → aggregate (the
consensus is the plain mean over the arrived clients, no leave-one-out) → distribute → digest (KD towards
the consensus on the public set) → revisit (a few epochs on private data).

The digest (`digest_loss: kl`, the default) uses the shared KD loop: (1-α)·CE(public labels) +
α·τ²·KL(consensus ‖ student), with the thesis's Table 5.1 α = 0.8, τ = 4 "if applicable".
`digest_loss: ce_mse` is the author's code instead [C]: CE(public labels) + 0.5·MSE(logits, consensus logits).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal

import torch
import torch.nn.functional as F

from fedsim.algorithms._personal import personal_model, score, test_shard, with_model
from fedsim.algorithms.local_only import LocalOnly, PoolState, pool_data
from fedsim.config.limits import MAX_BATCH, MAX_EPOCHS
from fedsim.method import (
    Broadcast,
    ClientContext,
    ClientResult,
    DistillConfig,
    Message,
    Phase,
    RoundInfo,
    batch_indices,
    distill,
    knob,
    make_optimizer,
    mechanism,
    predict_logits,
    register_algorithm,
    soften,
)


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
    digest_loss: Literal["kl", "ce_mse"] = knob(
        "kl", doc="'kl': (1-α)·CE + α·τ²·KL(consensus ‖ student) (thesis text); "
        "'ce_mse': [C] CE + mse_weight·MSE(student logits, consensus logits), shuffled batches (author's code)")
    mse_weight: float = knob(0.5, ge=0, doc="[C] weight of the MSE term of digest_loss: ce_mse")


@register_algorithm
class FedMD(LocalOnly):
    """Model distillation through a consensus of logits on a shared public set."""

    name = "fedmd"
    Params = FedMDParams
    mechanism_columns = {
        "logits/mech_consensus_public_acc": "accuracy of the consensus (mean of the arrivals' logits) on the "
                                            "public set's labels",
        "digest/mech_personal_acc_before_digest": "personal accuracy on the client's own test shard before the "
                                                  "digest step, mean over clients",
        "digest/mech_personal_acc_after_digest": "the same right after the digest step (before revisiting)",
        "digest/mech_personal_acc_after_revisit": "the same after the revisit epochs on private data (the "
                                                  "round's reported personal accuracy)",
    }

    @property
    def share_fraction(self) -> float:
        return self.params.public_fraction

    def phases(self, round: int) -> list[Phase]:
        share = [Phase("share", "each", client="share_client", server="share_server")] if round == 0 else []
        return share + [Phase("logits", "each", broadcast="send_pool", client="logits_client", server="consensus"),
                        Phase("digest", "each", broadcast="send_consensus", client="digest_client",
                              server="digest_server")]

    # ---------------------------------------------------------------- server
    def consensus(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        held = sorted(set(state.has_pool) | set(updates))
        if not updates:
            return dataclasses.replace(state, has_pool=held, extra={}), {}
        consensus = torch.stack([updates[c].payload["logits"].float() for c in sorted(updates)]).mean(0)
        acc = float((consensus.argmax(1) == state.pool["y"]).float().mean())
        mech = mechanism.columns({"consensus_public_acc": acc}) if mechanism.enabled(self.env) else {}
        return dataclasses.replace(state, has_pool=held, extra={"consensus": consensus}), \
            {"consensus_public_accuracy": acc, **mech}

    def send_consensus(self, state: PoolState, info: RoundInfo) -> Broadcast:
        return Broadcast(common={"consensus": state.extra.get("consensus")})

    def digest_server(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        scores = state.scores.record(updates)
        return dataclasses.replace(state, scores=scores, extra={}), \
            {**scores.summary(sorted(updates)), **self._mechanism_digest(updates)}

    # ---------------------------------------------------------------- client
    def public_set(self, state: dict | None, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        public = pool_data(state)
        if public is None:
            raise ValueError(f"client {ctx.client_id} holds no public set (it took no part in round 0's share)")
        return public[0].to(ctx.data.x.device), public[1].to(ctx.data.x.device)

    def logits_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        p, gen = self.params, ctx.generator()
        state = self.receive_pool(state, msg)
        px, py = self.public_set(state, ctx)
        model = personal_model(ctx, state)
        metrics: dict[str, float] = {}
        if state is None or "model" not in state:  # transfer learning: public set, then private set
            metrics.update({f"pretrain_public_{k}": v for k, v in
                            self.epochs(model, px, py, p.pretrain_public_epochs, ctx, gen).items()})
            self.epochs(model, ctx.data.x, ctx.data.y, p.pretrain_private_epochs, ctx, gen)
        logits = predict_logits(model, px, ctx.env.config.eval.batch_size).cpu()
        return ClientResult({"logits": logits}, float(ctx.data.num_samples), metrics, with_model(state, model))

    def digest_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        p, n, gen = self.params, float(ctx.data.num_samples), ctx.generator()
        px, py = self.public_set(state, ctx)
        model = personal_model(ctx, state)
        mech = {"personal_acc_before_digest": self._personal_accuracy(model, ctx)}
        consensus = msg.common["consensus"].to(px.device).float()
        metrics = {"digest_loss": self.digest(model, px, py, consensus, ctx, gen)}
        mech["personal_acc_after_digest"] = self._personal_accuracy(model, ctx)
        metrics.update({f"revisit_{k}": v for k, v in
                        self.epochs(model, ctx.data.x, ctx.data.y, p.revisit_epochs, ctx, gen).items()})
        metrics.update(score(model, ctx))
        if mechanism.enabled(ctx.env):
            metrics.update(mechanism.columns({**mech, "personal_acc_after_revisit": metrics["personal_accuracy"]}))
        return ClientResult(None, n, metrics, with_model(state, model))

    def digest(self, model: torch.nn.Module, px: torch.Tensor, py: torch.Tensor, consensus: torch.Tensor,
               ctx: ClientContext, gen: torch.Generator) -> float:
        """digest_epochs of KD towards the consensus logits on the public set; returns the mean loss."""
        p, tr = self.params, ctx.env.config.train
        if p.digest_loss == "kl":
            cfg = DistillConfig(steps=None, epochs=p.digest_epochs, batch_size=p.kd_batch_size, lr=tr.lr,
                                optimizer=tr.optimizer, momentum=tr.momentum, weight_decay=tr.weight_decay, T=p.kd_T,
                                kd_weight=p.kd_alpha, ce_weight=1.0 - p.kd_alpha, keep_best=False)
            return distill(model, px, soften(consensus, p.kd_T), cfg, gen, hard_labels=py)["loss"]
        opt = make_optimizer(model.parameters(), tr)
        model.train()
        total, steps = 0.0, 0
        for idx in batch_indices(len(py), p.kd_batch_size, gen, p.digest_epochs, device=px.device):
            z = model(px[idx])
            loss = F.cross_entropy(z, py[idx]) + p.mse_weight * F.mse_loss(z, consensus[idx])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total, steps = total + float(loss.detach()), steps + 1
        return total / max(steps, 1)

    @staticmethod
    def _personal_accuracy(model: torch.nn.Module, ctx: ClientContext) -> float:
        """The personal model's accuracy on its own test shard (NaN when not measured); evaluation only."""
        if not mechanism.enabled(ctx.env):
            return float("nan")
        x_test, y_test = test_shard(ctx)
        return mechanism.accuracy(mechanism.logits(model, x_test, ctx.env.config.eval.batch_size), y_test)

    def _mechanism_digest(self, updates: dict[int, ClientResult]) -> dict[str, float]:
        """Means over the arrivals of their client-measured accuracies around the digest step."""
        if not mechanism.enabled(self.env):
            return {}
        keys = ("personal_acc_before_digest", "personal_acc_after_digest", "personal_acc_after_revisit")
        rows = [u.metrics for u in updates.values() if f"{mechanism.PREFIX}{keys[0]}" in u.metrics]
        return mechanism.columns({k: sum(r[f"{mechanism.PREFIX}{k}"] for r in rows) / len(rows) if rows
                                  else float("nan") for k in keys})
