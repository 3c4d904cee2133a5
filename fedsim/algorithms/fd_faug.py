"""FD + FAug (Jeong et al. 2018, https://arxiv.org/abs/1811.11479) as run in Banerjee 2022 (FedGDKD thesis,
Algorithm 2): federated distillation of per-label logits plus GAN data augmentation.

FAug: in round 0 every participant uploads a random 5% of its data (`share` phase); the server trains a
conditional GAN on that pool ([C] FedGAN-style ACGAN, 200 epochs) and sends the generator once to each
client, which appends [C] 10,000 class-balanced synthetic samples to its training set.
FD: each round a client trains n epochs on (1-α)·CE(C(x), y) + α·CE(C(x), softmax(l̂^(y))) (the shared KD
loop at T = 1; the teacher's entropy is a constant), where l̂^(y) is the leave-one-out mean of the other
clients' latest per-label average logits ([C] a label a client lacks counts as zero logits); it then
uploads its own c×c per-label averages (computed after training, on its private data). Round 0 has no
teacher, so no KD term.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

import torch

from fedsim import rng
from fedsim.algorithms._gan import GanParams, synthetic_set, train_acgan
from fedsim.algorithms._personal import personal_model, score, with_model
from fedsim.algorithms.local_only import LocalOnly, PoolState
from fedsim.config.limits import MAX_BATCH, MAX_CHANNELS, MAX_EPOCHS, MAX_SAMPLES
from fedsim.method import (
    Broadcast,
    ClientContext,
    ClientResult,
    DistillConfig,
    Message,
    Phase,
    RoundInfo,
    clone_state,
    distill,
    knob,
    predict_logits,
    register_algorithm,
    soften,
)
from fedsim.models.thesis_nets import CNNDiscriminator, build_generator


@dataclass
class FDFAugParams(GanParams):
    share_fraction: float = knob(0.05, gt=0, le=1, doc="fraction of each client's data uploaded for the GAN")
    faug_epochs: int = knob(200, ge=0, le=MAX_EPOCHS, doc="[C] epochs of central GAN training on the pooled shares")
    faug_samples: int = knob(10000, ge=0, le=MAX_SAMPLES,
                             doc="[C] class-balanced synthetic samples each client appends")
    gan_batch_size: int = knob(32, ge=1, le=MAX_BATCH, doc="central GAN batch size (Table 5.1)")
    disc_widths: list[int] = knob([8, 16, 16], ge=1, le=MAX_CHANNELS,
                                  doc="[C] ACGAN discriminator conv widths (cnn_medium, B.3.2)")
    disc_lr: float = knob(0.01, gt=0, doc="discriminator SGD learning rate (Table 5.1)")
    real_label: float = knob(0.9, gt=0, le=1, doc="[C] soft BCE target for real samples")
    kd_alpha: float = knob(0.8, ge=0, le=1, doc="[C] kd_gamma: weight of the distillation term")


@register_algorithm
class FDFAug(LocalOnly):
    """Per-label logit distillation (FD) on private + GAN-augmented data (FAug)."""

    name = "fd_faug"
    Params = FDFAugParams

    @property
    def share_fraction(self) -> float:
        return self.params.share_fraction

    def generator(self) -> torch.nn.Module:
        env = self.env
        return build_generator(env.num_classes, env.input_shape, self.params.generator, env.mean, env.std)

    def phases(self, round: int) -> list[Phase]:
        share = [Phase("share", "each", client="share_client", server="train_faug")] if round == 0 else []
        return share + [Phase("train", "each", broadcast="send_teachers", client="fd_client", server="fd_server")]

    # ---------------------------------------------------------------- server
    def send_teachers(self, state: PoolState, info: RoundInfo) -> Broadcast:
        """Per participant: the FAug generator (once) and the leave-one-out mean of the others' label logits."""
        held, ex = set(state.has_pool), state.extra
        uploads: dict[int, torch.Tensor] = ex.get("label_logits", {})
        per: dict[int, dict] = {}
        for c in info.participants:
            own: dict[str, Any] = {}
            if "faug_generator" in ex and c not in held:
                own["faug"] = {"generator": ex["faug_generator"], "seed": ex["faug_seed"]}
            others = [uploads[j] for j in sorted(uploads) if j != c]
            if others:
                own["teacher"] = torch.stack(others).mean(0)  # leave-one-out over the other clients
            if own:
                per[c] = own
        return Broadcast(common=None, per_client=per or None)

    def train_faug(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        """Pool the shares and train the conditional GAN on them ([C] ACGAN)."""
        state, metrics = self.share_server(state, updates, info)
        if not state.pool:
            return state, metrics
        p, env = self.params, self.env
        gen = rng.torch_generator(env.config.seed, "fd_faug/gan_training")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.seed(env.config.seed, "init/fd_faug/gan"))
            G = self.generator().to(env.device)
            shape = env.input_shape
            D = CNNDiscriminator(shape[0], shape[-1], list(p.disc_widths), env.num_classes).to(env.device)
        x, y = state.pool["x"].to(env.device), state.pool["y"].to(env.device)
        m = train_acgan(G, D, x, y, p, p.faug_epochs, p.gan_batch_size, p.disc_lr, p.real_label,
                        env.num_classes, gen)
        seed = rng.seed(env.config.seed, "fd_faug/synthetic")
        extra = {**state.extra, "faug_generator": clone_state(G), "faug_seed": seed}
        return dataclasses.replace(state, extra=extra), {**metrics, **{f"faug_{k}": v for k, v in m.items()}}

    def fd_server(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        uploads = dict(state.extra.get("label_logits", {}))
        uploads.update({c: r.payload["label_logits"] for c, r in updates.items()})
        held = sorted(set(state.has_pool) | (set(updates) if "faug_generator" in state.extra else set()))
        scores = state.scores.record(updates)
        extra = {**state.extra, "label_logits": uploads}
        return dataclasses.replace(state, has_pool=held, scores=scores, extra=extra), scores.summary(sorted(updates))

    # ---------------------------------------------------------------- client
    def fd_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        p, d, c = self.params, ctx.data, ctx.env.num_classes
        own = msg.own or {}
        if "faug" in own:
            state = {**(state or {}), "faug_generator": own["faug"]["generator"], "faug_seed": own["faug"]["seed"]}
        model = personal_model(ctx, state)
        x, y = d.x, d.y
        if state is not None and "faug_generator" in state and p.faug_samples > 0:
            G = ctx.models.get("fd_faug/generator", build=self.generator)
            G.load_state_dict(state["faug_generator"])
            xs, ys = synthetic_set(G, state["faug_seed"], p.faug_samples, c, p.generator.nz, "independent",
                                   d.x.device)
            x, y = torch.cat([x, xs]), torch.cat([y, ys])
        gen = ctx.generator()
        if "teacher" in own:
            tr = ctx.env.config.train
            cfg = DistillConfig(steps=None, epochs=tr.epochs, batch_size=tr.batch_size, lr=tr.lr,
                                optimizer=tr.optimizer, momentum=tr.momentum, weight_decay=tr.weight_decay,
                                T=1.0, kd_weight=p.kd_alpha, ce_weight=1.0 - p.kd_alpha, keep_best=False)
            teacher = soften(own["teacher"].to(x.device).float())[y]
            metrics = {"fd_loss": distill(model, x, teacher, cfg, gen, hard_labels=y)["loss"]}
        else:
            metrics = self.epochs(model, x, y, ctx.env.config.train.epochs, ctx, gen)
        logits = predict_logits(model, d.x, ctx.env.config.eval.batch_size)
        sums = torch.zeros(c, c, dtype=logits.dtype, device=logits.device).index_add_(0, d.y, logits)
        counts = torch.bincount(d.y, minlength=c).clamp_min(1).to(logits.dtype)
        metrics.update(score(model, ctx))
        return ClientResult({"label_logits": (sums / counts[:, None]).cpu()}, float(d.num_samples), metrics,
                            with_model(state, model))
