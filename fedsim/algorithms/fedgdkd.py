"""FedGDKD (Banerjee 2022, "FedGDKD: Federated GAN-Based Data-Free Knowledge Distillation for Heterogeneous
Models", MEng thesis, Imperial College London).

Every client keeps a private classifier C_k (any architecture with c logits); it never leaves the worker.
A round has three phases:
  gan (sum):        [catch-up KD for clients absent last round], then n epochs of local cGAN training in
                    which C_k is the discriminator through D = sigmoid(LSE(logits)); uploads G_k only.
                    The server averages G (all state, BN buffers included) weighted by |D_k|.
  logits (each):    every participant rebuilds the same class-balanced synthetic set from (θ_G, noise
                    seed) with G in eval mode, uploads C_k's logits on it.
  codistill (each): each participant distils towards the leave-one-out mean of the others' logits with
                    (1-α)·CE + α·τ²·KL(teacher ‖ student), then is scored on its own test shard.
[C] marks the author's code choices (arj119/FedML), used where the thesis is silent.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F

from fedsim import rng
from fedsim.algorithms._gan import FeatureFD, GanParams, gen_optimizer, randn, same_state, step, synthetic_set
from fedsim.algorithms._personal import (
    PersonalScores,
    balanced_labels,
    personal_model,
    require_client_test,
    score,
    seeded_init,
    test_shard,
    with_model,
)
from fedsim.config.limits import MAX_BATCH, MAX_EPOCHS, MAX_ROUNDS, MAX_SAMPLES
from fedsim.data import subsample as _subsample  # noqa: F401  (registers the thesis data view)
from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    DistillConfig,
    Env,
    Message,
    Phase,
    RoundInfo,
    SummedUpdate,
    as_summable,
    average_by_arch,
    batch_indices,
    clone_state,
    distill,
    knob,
    leave_one_out,
    make_optimizer,
    mechanism,
    predict_logits,
    register_algorithm,
    register_state,
    soften,
)
from fedsim.models.thesis_nets import build_generator

GEN = "generator"
PHASES = (Phase("gan", "sum", broadcast="send_gan", client="gan_client", server="average_gan"),
          Phase("logits", "each", broadcast="send_kd_set", client="logits_client", server="loo_teachers"),
          Phase("codistill", "each", broadcast="send_teachers", client="codistill_client", server="codistill_server"))


def lse(logits: torch.Tensor) -> torch.Tensor:
    """LSE = log Σ_i exp(l_i): log Z of the classifier, so that D(x) = Z/(Z+1) = sigmoid(LSE)."""
    return torch.logsumexp(logits, dim=1)


def generator_loss(fake_logits: torch.Tensor, y_gen: torch.Tensor) -> torch.Tensor:
    """L_G = −log D(G(z,ŷ)) + CE = softplus(−LSE(fake)) + CE(fake, ŷ) (eq. 4.8, non-saturating)."""
    return F.softplus(-lse(fake_logits)).mean() + F.cross_entropy(fake_logits, y_gen)


def classifier_loss(real_logits: torch.Tensor, y: torch.Tensor, fake_logits: torch.Tensor,
                    y_gen: torch.Tensor) -> torch.Tensor:
    """L_C = CE(real) − log D(real) + CE(fake, ŷ) − log(1 − D(fake)) (eqs. 4.5–4.6, sign corrected)."""
    return (F.cross_entropy(real_logits, y) + F.softplus(-lse(real_logits)).mean()
            + F.cross_entropy(fake_logits, y_gen) + F.softplus(lse(fake_logits)).mean())


@dataclass
class FedGDKDParams(GanParams):
    half_losses: bool = knob(False, doc="[C] halve L_G and each half of L_C as the author's code does")
    kd_alpha: float = knob(0.8, ge=0, le=1, doc="KD weight α in (1-α)·CE + α·τ²·KL (Table 5.1)")
    kd_T: float = knob(4.0, gt=0, doc="soft-target temperature τ (Table 5.1)")
    kd_epochs: int = knob(5, ge=1, le=MAX_EPOCHS, doc="distillation epochs d over the synthetic set (Table 5.1)")
    kd_batch_size: int = knob(32, ge=1, le=MAX_BATCH, doc="distillation batch size (Table 5.1)")
    kd_size: int = knob(10000, ge=1, le=MAX_SAMPLES, doc="distillation set size N (Table 5.1)")
    kd_noise: Literal["shared", "independent"] = knob(
        "shared", doc="'shared': ⌈N/c⌉ noise rows reused for every class (eq. 4.10, c·⌈N/c⌉ samples); "
        "'independent': [C] N noise rows with balanced labels")
    catch_up: bool = knob(True, doc="catch-up distillation for clients absent last round (§4.5)")
    fid_every: int = knob(0, ge=0, le=MAX_ROUNDS,
                          doc="INTERNAL-ONLY generator Fréchet distance every this many evaluated "
                          "rounds (0: off); its feature net is trained on the pooled real train set")


@register_state
@dataclass
class Prev:
    """Last round's knowledge, for catch-up: who got it, and how to rebuild the set and its teacher."""

    participants: list[int]
    kd_seed: int
    generator: dict[str, torch.Tensor]
    mean_logits: torch.Tensor


@register_state
@dataclass
class FedGDKDState:
    shared: dict[str, dict[str, torch.Tensor]]  # the aggregated shared models: {"generator": state, ...}
    round: int = -1
    kd_seed: int = 0
    teachers: dict[int, torch.Tensor] = field(default_factory=dict)  # this round's LOO teachers
    mean_logits: torch.Tensor | None = None
    prev: Prev | None = None
    scores: PersonalScores = field(default_factory=PersonalScores)


@register_algorithm
class FedGDKD(Algorithm):
    """Federated cGAN with the classifier as LSE discriminator, plus leave-one-out co-distillation."""

    name = "fedgdkd"
    Params = FedGDKDParams
    shared_names: tuple[str, ...] = (GEN,)
    mechanism_columns = {
        "logits/mech_gen_ensemble_acc": "the round's synthetic set scored by the mean of the participants' logits: "
                                        "accuracy of its argmax against the class the cGAN was asked for",
        "logits/mech_gen_ensemble_maxp": "the same ensemble's mean largest softmax probability (τ = 1) on the set",
        "logits/mech_loo_teacher_synth_acc": "each participant's leave-one-out teacher on the synthetic set: "
                                             "accuracy against the requested class, mean over participants",
        "logits/mech_loo_teacher_test_acc": "each participant's leave-one-out teacher (the mean of the other "
                                            "participants' logits) on the real test subset, mean over participants",
        "logits/mech_student_synth_acc": "each participant's own model on the synthetic set before distilling: "
                                         "accuracy against the requested class, mean (1: nothing left to teach)",
        "codistill/mech_personal_acc_before_kd": "personal accuracy on the client's own test shard just before "
                                                 "co-distillation (after the GAN phase), mean over distilled clients",
        "codistill/mech_personal_acc_after_kd": "the same clients' personal accuracy right after co-distillation",
    }

    @classmethod
    def pooled_data_key(cls, cfg: Any) -> str | None:
        return "algorithm.fid_every" if cfg.algorithm.params.fid_every else None  # FeatureFD trains on all of it

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        require_client_test(env, self.name)
        self._fid: FeatureFD | None = None

    # ---------------------------------------------------------------- shared models
    def build(self, name: str) -> torch.nn.Module:
        env = self.env
        return build_generator(env.num_classes, env.input_shape, self.params.generator, env.mean, env.std)

    def init_server(self, env: Env) -> FedGDKDState:
        shared = {}
        for name in self.shared_names:
            m = seeded_init(self.build(name), lambda n=name: self.build(n), rng.seed(env.config.seed, f"init/{name}"))
            shared[name] = clone_state(m)
        return FedGDKDState(shared=shared)

    def module(self, ctx: ClientContext, name: str, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
        m = ctx.models.get(f"{self.name}/{name}", build=lambda: self.build(name))
        m.load_state_dict(weights)
        return m

    def phases(self, round: int) -> list[Phase]:
        return list(PHASES)

    # ---------------------------------------------------------------- server
    def send_gan(self, state: FedGDKDState, info: RoundInfo) -> Broadcast:
        """The shared GAN; clients absent last round also get last round's KD set and full-mean teacher."""
        per, prev = None, state.prev
        if self.params.catch_up and prev is not None:
            own = {"kd_seed": prev.kd_seed, "teacher": prev.mean_logits}
            if not same_state(prev.generator, state.shared[GEN]):  # only after a restore or a skipped gan
                own[GEN] = prev.generator
            per = {c: own for c in info.participants if c not in set(prev.participants)} or None
        return Broadcast(common=state.shared, per_client=per)

    def average_gan(self, state: FedGDKDState, updates: SummedUpdate, info: RoundInfo) -> tuple[Any, dict]:
        shared = average_by_arch(updates, state.shared) if updates.count else state.shared
        seed = rng.seed(self.env.config.seed, "fedgdkd/kd_set", info.round)
        return FedGDKDState(shared, info.round, seed, {}, None, state.prev, state.scores), \
            {"clients": float(updates.count)}

    def send_kd_set(self, state: FedGDKDState, info: RoundInfo) -> Broadcast:
        return Broadcast(common={GEN: state.shared[GEN], "kd_seed": state.kd_seed})

    def loo_teachers(self, state: FedGDKDState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        ids = sorted(updates)
        if not ids:
            return state, {}
        stacked = torch.stack([updates[c].payload["logits"].float() for c in ids])
        teachers = dict(zip(ids, leave_one_out(stacked))) if len(ids) > 1 else {}
        mean = stacked.mean(0)
        y = balanced_labels(len(mean), self.env.num_classes)
        metrics = {"ensemble_synthetic_accuracy": float((mean.argmax(1) == y).float().mean()),
                   **self._mechanism_synthetic(stacked, teachers, y), **self._mechanism_loo_test(updates)}
        return FedGDKDState(state.shared, state.round, state.kd_seed, teachers, mean, state.prev,
                            state.scores), metrics

    def send_teachers(self, state: FedGDKDState, info: RoundInfo) -> Broadcast:
        return Broadcast(common=None, per_client={c: {"teacher": t} for c, t in state.teachers.items()})

    def codistill_server(self, state: FedGDKDState, updates: dict[int, ClientResult],
                         info: RoundInfo) -> tuple[Any, dict]:
        scores = state.scores.record(updates)
        mech = self._mechanism_kd(updates)
        prev = state.prev
        if state.mean_logits is not None:
            prev = Prev(sorted(updates), state.kd_seed, state.shared[GEN], state.mean_logits)
        new = FedGDKDState(state.shared, state.round, state.kd_seed, {}, None, prev, scores)
        return new, {**scores.summary(this_round=sorted(updates)), **mech}

    def _mechanism_synthetic(self, stacked: torch.Tensor, teachers: dict[int, torch.Tensor],
                             y: torch.Tensor) -> dict[str, float]:
        """How the synthetic set reads to the participants (their uploaded logits [K, N, c]): evaluation only."""
        if not mechanism.enabled(self.env):
            return {}
        mean = stacked.mean(0)
        loo = [mechanism.accuracy(t, y) for t in teachers.values()]
        return mechanism.columns({
            "gen_ensemble_acc": mechanism.accuracy(mean, y),
            "gen_ensemble_maxp": float(F.softmax(mean, 1).max(1).values.mean()),
            "loo_teacher_synth_acc": float(np.mean(loo)) if loo else float("nan"),
            "student_synth_acc": float(np.mean([mechanism.accuracy(s, y) for s in stacked])),
        })

    def _mechanism_loo_test(self, updates: dict[int, ClientResult]) -> dict[str, float]:
        """Each participant's leave-one-out teacher scored on the real test subset, from the personal models'
        logits the clients sent beside their upload (ClientResult.probe: evaluation only, not traffic)."""
        probe = mechanism.probe_set(self.env)
        probes = [u.probe for u in updates.values() if u.probe is not None]
        if probe is None or len(probes) != len(updates):
            return {}
        if len(probes) < 2:
            return mechanism.columns({"loo_teacher_test_acc": float("nan")})
        teachers = leave_one_out(torch.stack([p.float() for p in probes]).to(probe[1].device))
        return mechanism.columns({"loo_teacher_test_acc": float(np.mean([mechanism.accuracy(t, probe[1])
                                                                          for t in teachers]))})

    def _mechanism_kd(self, updates: dict[int, ClientResult]) -> dict[str, float]:
        """Mean over the clients that distilled of their personal accuracy before and after it (client-measured)."""
        if not mechanism.enabled(self.env):
            return {}
        rows = [u.metrics for u in updates.values() if "mech_personal_acc_before_kd" in u.metrics]
        return mechanism.columns({
            f"personal_acc_{when}_kd": float(np.mean([r[f"mech_personal_acc_{when}_kd"] for r in rows]))
            if rows else float("nan") for when in ("before", "after")})

    def evaluate(self, state: FedGDKDState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        rows = state.scores.rows()
        every = self.params.fid_every
        if rows and every and state.round >= 0 and (state.round + 1) % every == 0:
            rows[0]["generator_fd"] = self.frechet(state, device)
        return rows

    # ---------------------------------------------------------------- client
    def gan_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        C = personal_model(ctx, state)
        common, own = msg.common, msg.own
        metrics: dict[str, float] = {"catch_up": 0.0}
        if own is not None:  # selected now, absent last round: last round's set, full-mean teacher
            G = self.module(ctx, GEN, own.get(GEN, common[GEN]))
            x, y = self.kd_set(G, own["kd_seed"], ctx)
            metrics = {"catch_up": 1.0, **{f"catch_up_{k}": v for k, v in self.kd(C, x, y, own["teacher"],
                                                                                ctx).items()}}
        mods = {name: self.module(ctx, name, common[name]) for name in self.shared_names}
        metrics.update(self.local_gan(C, mods, ctx))
        payload: dict[str, torch.Tensor] = {}
        for name, m in mods.items():
            payload.update(as_summable(name, clone_state(m)))
        return ClientResult(payload, self.client_weight(ctx), metrics,
                            with_model(state, C, kd_generator=None, kd_seed=None))

    def logits_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        C = personal_model(ctx, state)
        common = msg.common
        x, _ = self.kd_set(self.module(ctx, GEN, common[GEN]), common["kd_seed"], ctx)
        logits = predict_logits(C, x, ctx.env.config.eval.batch_size).cpu()
        probe = mechanism.probe_set(ctx.env)
        return ClientResult({"logits": logits}, float(ctx.data.num_samples), {},
                            with_model(state, C, kd_generator=common[GEN], kd_seed=int(common["kd_seed"])),
                            probe=None if probe is None else mechanism.logits(C, probe[0]).cpu())

    def codistill_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        C = personal_model(ctx, state)
        n, own = float(ctx.data.num_samples), msg.own
        metrics = {}
        if own is not None and state is not None and "kd_generator" in state:
            x, y = self.kd_set(self.module(ctx, GEN, state["kd_generator"]), state["kd_seed"], ctx)
            before = self._personal_accuracy(C, ctx) if mechanism.enabled(ctx.env) else None
            metrics = self.kd(C, x, y, own["teacher"], ctx)
            if before is not None:
                metrics.update(mechanism.columns({"personal_acc_before_kd": before,
                                                  "personal_acc_after_kd": self._personal_accuracy(C, ctx)}))
        metrics.update(score(C, ctx))
        return ClientResult(None, n, metrics, with_model(state, C, kd_generator=None, kd_seed=None))

    @staticmethod
    def _personal_accuracy(C: torch.nn.Module, ctx: ClientContext) -> float:
        """The personal model's accuracy on its own test shard (eval mode restored); evaluation only."""
        x_test, y_test = test_shard(ctx)
        return mechanism.accuracy(mechanism.logits(C, x_test, ctx.env.config.eval.batch_size), y_test)

    def client_weight(self, ctx: ClientContext) -> float:
        """Generator averaging weight: |D_k| (eq. 4.9)."""
        return float(ctx.data.num_samples)

    def kd_set(self, G: torch.nn.Module, seed: int, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        p = self.params
        return synthetic_set(G, seed, p.kd_size, ctx.env.num_classes, p.generator.nz, p.kd_noise, ctx.device)

    def kd(self, C: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, teacher_logits: torch.Tensor,
           ctx: ClientContext) -> dict[str, float]:
        """d epochs of (1-α)·CE(C(x), y) + α·τ²·KL(softmax(teacher/τ) ‖ softmax(C(x)/τ)), fixed order, fresh SGD."""
        p, tr = self.params, ctx.env.config.train
        cfg = DistillConfig(steps=None, epochs=p.kd_epochs, batch_size=p.kd_batch_size, lr=tr.lr,
                            optimizer=tr.optimizer, momentum=tr.momentum, weight_decay=tr.weight_decay, T=p.kd_T,
                            kd_weight=p.kd_alpha, ce_weight=1.0 - p.kd_alpha, shuffle=False, keep_best=False)
        out = distill(C, x, soften(teacher_logits.to(x.device).float(), p.kd_T), cfg, ctx.generator(), hard_labels=y)
        return {"kd_loss": out["loss"], "kd_steps": out["steps"]}

    def local_gan(self, C: torch.nn.Module, mods: dict[str, torch.nn.Module], ctx: ClientContext) -> dict[str, float]:
        """Per real batch: a G step on L_G, then a C step on L_C with the same fake batch detached (Alg. 4)."""
        G, tr, c = mods[GEN], ctx.env.config.train, ctx.env.num_classes
        half = 0.5 if self.params.half_losses else 1.0
        opt_g, opt_c = gen_optimizer(G, self.params), make_optimizer(C.parameters(), tr)
        gen, d = ctx.generator(), ctx.data
        G.train()
        C.train()
        sums, steps = [0.0, 0.0], 0
        for idx in batch_indices(d.num_samples, tr.batch_size, gen, tr.epochs, tr.steps, d.x.device):
            z = randn((len(idx), self.params.generator.nz), gen, d.x.device)
            y_gen = torch.randint(0, c, (len(idx),), generator=gen).to(d.x.device)
            fake = G(z, y_gen)
            sums[0] += step(opt_g, half * generator_loss(C(fake), y_gen))
            sums[1] += step(opt_c, half * classifier_loss(C(d.x[idx]), d.y[idx], C(fake.detach()), y_gen))
            steps += 1
        return {"loss_g": sums[0] / max(steps, 1), "loss_c": sums[1] / max(steps, 1), "gan_steps": float(steps)}

    # ---------------------------------------------------------------- internal-only generator quality
    def frechet(self, state: FedGDKDState, device: torch.device) -> float:
        """Fréchet distance of the round's synthetic set to the real test set (INTERNAL ONLY, see FeatureFD)."""
        if self._fid is None:
            self._fid = FeatureFD(self.env, device)
        G = self.build(GEN).to(device)
        G.load_state_dict(state.shared[GEN])
        p = self.params
        x, _ = synthetic_set(G, state.kd_seed, p.kd_size, self.env.num_classes, p.generator.nz, p.kd_noise, device)
        return self._fid(x)
