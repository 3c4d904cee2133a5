"""DaFKD: domain-aware federated knowledge distillation (Wang et al., CVPR 2023; preprint 202303.0432).

Each client trains a shared trunk with a class head and a personal sigmoid domain head (its discriminator,
kept across rounds in the worker's state store) on CE + BCE(real = own data, fake = global generator
samples), then trains its copy of the generator against that discriminator. The server averages
classifiers and generators over the arrivals (BN buffers included), draws a distillation set from the
global generator with a logged seed, weights every client per sample by α̂_{k,i} = f_k(x_i) / Σ_k' f_k'(x_i)
over the arrivals, and distils the α̂-weighted ensemble into the averaged classifier with fedsim.method.distill.

upload="discriminator" (main text): clients upload classifier, generator and domain head; the server
scores. upload="scores" (App. B): clients regenerate the distillation set from the broadcast generator and
seed and upload f_k(x_i)·s_k(x_i) and f_k(x_i); the discriminator never leaves the client. With
distill_from="aggregated" this is a second phase after aggregation; with "start" (the official code) the
set comes from the start-of-round generator and the scores ride on the train phase. Every ambiguity
between the paper and its code (A1-A10 in the Params docs) is a Params key with the paper's reading as default.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal, TypeVar, cast

import numpy as np
import torch
import torch.nn.functional as F

from fedsim import rng
from fedsim.config.limits import MAX_CHANNELS, MAX_EPOCHS, MAX_ROUNDS, MAX_SAMPLES, MAX_STEPS, MAX_WIDTH
from fedsim.method import (
    Adam,
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    DistillConfig,
    Env,
    Message,
    Phase,
    RoundInfo,
    batch_indices,
    batchnorm_stats_kept,
    clone_state,
    distill,
    domain_weights,
    ensemble_teacher,
    evaluate_models,
    init_global_models,
    knob,
    loaded_model,
    make_optimizer,
    mechanism,
    new_model,
    register_algorithm,
    register_state,
    soften,
    weighted_average,
)
from fedsim.models.dafkd_nets import DomainHead, ImageGenerator, build_generator, generator_step, gradient_penalty

State = dict[str, torch.Tensor]
M = TypeVar("M", bound=torch.nn.Module)


@dataclass
class DaFKDDistill(DistillConfig):
    """The server KD of Eq. 8: lr 0.01 (paper) with SGD (the paper names no optimizer; Adam, the code's, at the
    paper's rate wrecks the student, see the README); 40 epochs over 40 batches of 32 (code); T = 1 (A1:
    Eq. 8 has plain softmax; the code uses 20); no validation-based selection (the paper has none)."""

    steps: int | None = knob(None, ge=1, le=MAX_STEPS, doc="optimizer steps (exclusive with epochs)")
    epochs: int | None = knob(40, ge=1, le=MAX_EPOCHS, doc="passes over the distillation set (code: 40)")
    lr: float = knob(0.01, gt=0, doc="distillation learning rate (paper: 0.01; code: 1e-4 with Adam)")
    optimizer: Literal["adam", "sgd"] = knob(
        "sgd", doc="distillation optimizer (paper: not named; code: adam, at lr 1e-4)")
    keep_best: bool = knob(False, doc="restore the best-on-validation student (DaFKD has no validation set)")


@dataclass
class DaFKDParams:
    """Every ambiguity of the spec (§7, A1-A10) is a key; defaults follow the paper, the code's choice noted."""

    weighting: Literal["uniform", "samples"] = knob(
        "uniform", doc="A2: average generators and classifiers 'uniform' (Eqs. 4, 6) or by 'samples' (code)")
    mix: Literal["probs", "logits"] = knob(
        "probs", doc="A1: the teacher mixes α̂-weighted softmax 'probs' (Eq. 8) or 'logits' (code); T in distill.T")
    distill_from: Literal["aggregated", "start"] = knob(
        "aggregated", doc="A3: D̂_g comes from this round's 'aggregated' generator (text) or the 'start' one (code)")
    generator: Literal["dcgan", "conditional"] = knob(
        "dcgan", doc="A4: unconditional 'dcgan' g(z) (equations, code) or §4.1's label-'conditional' MLP")
    noise_dim: int = knob(100, ge=1, le=MAX_WIDTH, doc="A7: generator noise dimension d (code: 100)")
    gen_width: int = knob(64, ge=1, le=MAX_CHANNELS,
                          doc="generator width: DCGAN features of the last stage, MLP embedding size")
    gen_lr: float | None = knob(None, gt=0, doc="generator Adam lr, betas (0.5, 0.99); None: train.lr (paper)")
    schedule: Literal["sequential", "alternating"] = knob(
        "sequential", doc="A5: 'sequential' (CE+D for the local epochs, then G against the fixed D; Eqs. 2-3) "
        "or 'alternating' (a D step and a G step per minibatch; code)")
    gen_epochs: int | None = knob(None, ge=1, le=MAX_EPOCHS,
                                  doc="A5: epochs of G steps (None: as many as local epochs; code: 5)")
    disc_epochs: int | None = knob(None, ge=1, le=MAX_EPOCHS,
                                   doc="A5: local epochs with the D loss on (None: all; code: 5)")
    disc_rounds: int | None = knob(None, ge=0, le=MAX_ROUNDS,
                                   doc="A5: D loss only in rounds < this (None: always; code: 3)")
    gen_rounds: int | None = knob(None, ge=0, le=MAX_ROUNDS,
                                  doc="A5: G trained only in rounds < this (None: always; code: 5)")
    gp_weight: float = knob(0.0, ge=0, doc="A5: gradient penalty on real/fake interpolates (code: 0.3)")
    disc_weight: float = knob(1.0, ge=0, doc="weight of Eq. 2's BCE (mean over real+fake) next to CE (Eq. 9)")
    score_mode: Literal["eval", "train"] = knob(
        "eval", doc="A9: BatchNorm mode when scoring f and teacher logits: 'eval' or 'train' (code)")
    sharing: bool = knob(True, doc="A8, Table 3: false = 'no sharing', a separate personal discriminator network")
    correlation: bool = knob(True, doc="A8, Table 3: false = 'no correlation', uniform teacher weights")
    upload: Literal["discriminator", "scores"] = knob(
        "discriminator", doc="A10: 'discriminator' (main text: the server scores) or 'scores' (App. B: clients "
        "upload f·s and f on a seed-regenerated set)")
    distill_size: int = knob(1280, ge=1, le=MAX_SAMPLES, doc="A7: |D̂_g|, generated samples per round (code: 40 × 32)")
    distill_from_round: int = knob(0, ge=0, le=MAX_ROUNDS, doc="rounds before this one only average (code: 1)")
    eps: float = knob(1e-8, gt=0, doc="ε in α̂ = f / (Σ f + ε)")
    distill: DaFKDDistill = knob(factory=DaFKDDistill)


@register_state
@dataclass
class DaFKDState:
    """Global classifier per architecture, the global generator, and what a score phase still needs."""

    models: dict[str, State]
    generator: State
    pending: dict[str, Any] = field(default_factory=dict)


def _active(limit: int | None, value: int) -> bool:
    return limit is None or value < limit


@register_algorithm
class DaFKD(Algorithm):
    """Domain-aware ensemble distillation with a federated generator and personal discriminators."""

    name = "dafkd"
    Params = DaFKDParams
    mechanism_columns = {
        "train/mech_teacher_acc": "test accuracy of the α̂-weighted ensemble of this round's arrivals (the "
                                  "paper's domain-aware teacher; the server's discriminators, upload=discriminator)",
        "train/mech_teacher_acc_uniform": "test accuracy of the same arrivals' uniformly weighted ensemble",
        "train/mech_disc_auc": "mean over arrivals of the AUC of f_k on its own training inputs vs the other "
                               "arrivals' (0.5: the discriminator cannot tell its domain apart)",
        "train/mech_acc_before_distill": "test accuracy of the averaged classifier before distillation",
        "train/mech_acc_after_distill": "test accuracy of the same classifier after distillation (NaN: no "
                                        "distillation this round)",
        "train/mech_alpha_max_mean": "α̂ on the distillation set: mean largest weight (1/K: uniform, 1: one client)",
        "train/mech_alpha_entropy": "α̂ on the distillation set: mean entropy as a fraction of log2 K (1: uniform)",
        "train/mech_gen_class_entropy": "the distillation set's classes as the teacher labels them: histogram "
                                        "entropy as a fraction of log2 C (1: balanced, low: a collapsed generator)",
        "train/mech_gen_max_share": "the largest class's share of the distillation set, as the teacher labels it",
    }  # in App. B's two-phase mode (upload=scores, distill_from=aggregated) the last five are score/mech_*

    def __init__(self, params: DaFKDParams, env: Env) -> None:
        super().__init__(params, env)
        self._server_modules: dict[str, torch.nn.Module] = {}

    # ------------------------------------------------------------------ shared helpers

    def new_generator(self) -> ImageGenerator:
        p, e = self.params, self.env
        return build_generator(p.generator, p.noise_dim, e.num_classes, e.input_shape, p.gen_width, e.mean, e.std)

    def distill_seed(self, round: int) -> int:
        """The round's distillation-set seed (< 2^32, exact in the float metrics tables)."""
        return rng.seed(self.env.config.seed, "dafkd/distill_set", round)

    def distill_set(self, gen: ImageGenerator, seed: int) -> torch.Tensor:
        """D̂_g: distill_size samples of `gen` in chunks of the distillation batch (BN in batch mode, as
        when it was trained). Server and clients call this with the same weights and seed: same bits."""
        n, b = self.params.distill_size, self.params.distill.batch_size
        g = torch.Generator().manual_seed(seed)
        gen.train()
        with torch.no_grad():
            return torch.cat([gen.sample(min(b, n - i), g) for i in range(0, n, b)])

    @torch.no_grad()
    def score(self, model, head, disc, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Class logits [N, C] and domain scores f(x) ∈ (0, 1) [N], in the configured BN mode (A9)."""
        d_net = model if disc is None else disc
        for m in (model, head, d_net):
            m.train(self.params.score_mode == "train")
        logits, f = [], []
        for i in range(0, len(x), self.params.distill.batch_size):
            xb = x[i:i + self.params.distill.batch_size]
            z = model.embed(xb)
            logits.append(model.head(z))
            f.append(torch.sigmoid(head(z if disc is None else disc.embed(xb))))
        return torch.cat(logits), torch.cat(f)

    # ------------------------------------------------------------------ server

    def init_server(self, env: Env) -> DaFKDState:
        models = init_global_models(env)
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(rng.seed(env.config.seed, "init/dafkd/generator"))
            generator = self.new_generator()
        return DaFKDState(models, clone_state(generator))

    def phases(self, round: int) -> list[Phase]:
        p = self.params
        two = p.upload == "scores" and p.distill_from == "aggregated" and round >= p.distill_from_round
        train = Phase("train", "each", broadcast="send_models", client="train_client", server="train_server")
        score = Phase("score", "each", broadcast="send_generator", client="score_client", server="score_server")
        return [train, score] if two else [train]

    def send_generator(self, state: DaFKDState, info: RoundInfo) -> Broadcast:
        """App. B second phase: the aggregated generator and the noise seed."""
        return Broadcast(common={"generator": state.generator, "seed": self.distill_seed(info.round)})

    def send_models(self, state: DaFKDState, info: RoundInfo) -> Broadcast:
        seed = self.distill_seed(info.round)
        common = {"models": state.models, "generator": state.generator}
        p = self.params
        if p.upload == "scores" and p.distill_from == "start" and info.round >= p.distill_from_round:
            common["seed"] = seed
        return Broadcast(common=common)

    def score_server(self, state: DaFKDState, updates: dict[int, ClientResult],
                     info: RoundInfo) -> tuple[DaFKDState, dict]:
        """App. B: the teacher from the uploaded scores, distilled into the averaged models."""
        models = state.pending.get("models", state.models)
        metrics: dict[str, Any] = {}
        if updates:
            teacher, metrics = self.teacher_from_scores(updates)
            x = self.distill_set(self.server_module("generator", self.new_generator, state.generator),
                                 state.pending["seed"])
            distilled, m = self.distil_all(models, x, teacher, info.round)
            metrics.update({**m, **self.mechanism_accuracy(models, distilled)})
            models = distilled
        return DaFKDState(models, state.generator), {"distill_seed": state.pending.get("seed", -1), **metrics}

    def train_server(self, state: DaFKDState, updates: dict[int, ClientResult],
                     info: RoundInfo) -> tuple[DaFKDState, dict]:
        p = self.params
        if not updates:
            return state, {}
        ids = list(updates)
        weights = {c: updates[c].weight for c in ids}
        generator = weighted_average({c: updates[c].payload["generator"] for c in ids}, weights)
        models = dict(state.models)
        for arch in dict.fromkeys(self.env.client_archs[c] for c in ids):
            mine = [c for c in ids if self.env.client_archs[c] == arch]
            models[arch] = weighted_average({c: updates[c].payload["model"] for c in mine}, weights)
        seed = self.distill_seed(info.round)
        out = {"arrived": float(len(ids)), "distill_seed": float(seed), **self.mechanism_teacher(updates)}
        if info.round < p.distill_from_round:
            return DaFKDState(models, generator), {**out, **self.mechanism_accuracy(models, None)}
        if p.upload == "scores" and p.distill_from == "aggregated":
            return DaFKDState(state.models, generator, {"models": models, "seed": seed}), out
        gen_state = generator if p.distill_from == "aggregated" else state.generator
        x = self.distill_set(self.server_module("generator", self.new_generator, gen_state), seed)
        teacher, m = (self.teacher_from_scores(updates) if p.upload == "scores"
                      else self.teacher_from_models(updates, x))
        distilled, m2 = self.distil_all(models, x, teacher, info.round)
        return DaFKDState(distilled, generator), {**out, **m, **m2, **self.mechanism_accuracy(models, distilled)}

    def server_module(self, key: str, build: Callable[[], M], state: State) -> M:
        """A reused server-side module for `key` (always built by the same `build`), loaded with `state`."""
        if key not in self._server_modules:
            self._server_modules[key] = build().to(self.env.device)
        mod = cast(M, self._server_modules[key])
        mod.load_state_dict(state)
        return mod

    def client_modules(self, cid: int, res: ClientResult) -> tuple[Any, Any, Any]:
        """An arrival's classifier, domain head and (without sharing) discriminator, on reused server modules."""
        arch = self.env.client_archs[cid]
        build = lambda a=arch: new_model(self.env, a)  # noqa: E731
        model = self.server_module(arch, build, res.payload["model"])
        head = self.server_module(f"head/{arch}", lambda: DomainHead(model.embed_dim), res.payload["head"])
        disc = self.server_module(f"disc/{arch}", build, res.payload["disc"]) if "disc" in res.payload else None
        return model, head, disc

    def teacher_from_models(self, updates: dict[int, ClientResult], x: torch.Tensor) -> tuple[torch.Tensor, dict]:
        """Main mode: the server scores D̂_g with each arrival's classifier and discriminator (Eqs. 7-8)."""
        logits, scores = [], []
        for cid, res in updates.items():
            lg, f = self.score(*self.client_modules(cid, res), x)
            logits.append(lg)
            scores.append(f)
        s = torch.stack(scores)
        alpha = domain_weights(s, self.params.eps) if self.params.correlation else None
        teacher = ensemble_teacher(torch.stack(logits), alpha, self.params.distill.T, self.params.mix)
        return teacher, {**self.alpha_metrics(s), **self.mechanism_distill_set(teacher)}

    def teacher_from_scores(self, updates: dict[int, ClientResult]) -> tuple[torch.Tensor, dict]:
        """App. B: teacher_i = Σ_k f_k(x_i)·o_k(x_i) / (Σ_k f_k(x_i) + ε), o = softmax(·/T) or logits (A1)."""
        num = sum(res.payload["weighted"].double() for res in updates.values())
        s = torch.stack([res.payload["f"] for res in updates.values()])
        mixed = (num / (s.double().sum(0)[:, None] + self.params.eps)).float().to(self.env.device)
        teacher = mixed if self.params.mix == "probs" else soften(mixed, self.params.distill.T)
        return teacher, {**self.alpha_metrics(s), **self.mechanism_distill_set(teacher)}

    def alpha_metrics(self, s: torch.Tensor) -> dict:
        """The mean domain score, and (evaluation only) how concentrated α̂ is on the distillation set."""
        out = {"f_mean": float(s.mean())}
        if mechanism.enabled(self.env):
            conc = mechanism.concentration(domain_weights(s, self.params.eps))
            out.update(mechanism.columns({"alpha_max_mean": conc["max_mean"], "alpha_entropy": conc["entropy_frac"]}))
        return out

    # ------------------------------------------------------------------ mechanism (evaluation only)

    def mechanism_teacher(self, updates: dict[int, ClientResult]) -> dict:
        """On the test subset: the α̂-weighted vs the uniform ensemble of the arrivals (the paper's claim is
        that domain weighting makes the better teacher under non-IID data); per arrival, the AUC of its domain
        score on its own training inputs vs the other arrivals'. NaN where the server holds no discriminators."""
        probe = mechanism.probe_set(self.env)
        if probe is None:
            return {}
        keys = ("teacher_acc", "teacher_acc_uniform", "disc_auc")
        if self.params.upload != "discriminator":
            return mechanism.columns(dict.fromkeys(keys, math.nan))
        x, y = probe
        own = mechanism.client_samples(self.env, list(updates), 32)
        logits, scores, aucs = [], [], []
        for cid, res in updates.items():
            modules = self.client_modules(cid, res)
            lg, f = self.score(*modules, x)
            logits.append(lg)
            scores.append(f)
            if own is not None:
                _, f_own = self.score(*modules, own[0])
                aucs.append(mechanism.auc(f_own[own[1] == cid], f_own[own[1] != cid]))
        lg, alpha = torch.stack(logits), domain_weights(torch.stack(scores), self.params.eps)
        T, mix = self.params.distill.T, self.params.mix
        aucs = [a for a in aucs if not math.isnan(a)]
        return mechanism.columns({
            "teacher_acc": mechanism.accuracy(ensemble_teacher(lg, alpha, T, mix), y),
            "teacher_acc_uniform": mechanism.accuracy(ensemble_teacher(lg, None, T, mix), y),
            "disc_auc": float(np.mean(aucs)) if aucs else math.nan})

    def mechanism_distill_set(self, teacher: torch.Tensor) -> dict:
        """The distillation set's classes as the teacher labels them (a collapsed generator shows here)."""
        if not mechanism.enabled(self.env):
            return {}
        bal = mechanism.class_balance(teacher.argmax(1), self.env.num_classes)
        return mechanism.columns({"gen_class_entropy": bal["entropy_frac"], "gen_max_share": bal["max_share"]})

    def mechanism_accuracy(self, averaged: dict[str, State], distilled: dict[str, State] | None) -> dict:
        """Test accuracy of the averaged classifier before and after distillation (mean over architectures)."""
        probe = mechanism.probe_set(self.env)
        if probe is None:
            return {}
        x, y = probe

        def acc(models: dict[str, State]) -> float:
            scores = []
            for arch, weights in models.items():
                model = self.server_module(f"probe/{arch}", partial(new_model, self.env, arch), weights)
                scores.append(mechanism.accuracy(mechanism.logits(model, x), y))
            return float(np.mean(scores))

        return mechanism.columns({"acc_before_distill": acc(averaged),
                                  "acc_after_distill": math.nan if distilled is None else acc(distilled)})

    def distil_all(self, models: dict[str, State], x: torch.Tensor, teacher: torch.Tensor,
                   round: int) -> tuple[dict[str, State], dict]:
        """Distil the teacher into every architecture's averaged model (the student starts from ŵ, Eq. 8)."""
        out, metrics = dict(models), {}
        for arch, weights in models.items():
            student = loaded_model(self.env, arch, weights)
            r = distill(student, x, teacher, self.params.distill,
                        rng.torch_generator(self.env.config.seed, f"dafkd/distill/{arch}", round))
            out[arch] = clone_state(student)
            metrics.update({"distill_loss": r["loss"], "distill_steps": r["steps"]})
        return out, metrics

    def evaluate(self, state: DaFKDState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return evaluate_models(self.env, state.models, x_test, y_test, device)

    # ------------------------------------------------------------------ client

    def personal_modules(self, state: dict | None, ctx: ClientContext, model) -> tuple[Any, Any]:
        """The client's domain head (and separate discriminator without sharing), from its state or fresh."""
        head = ctx.models.get(f"dafkd/head/{ctx.arch}", build=lambda: DomainHead(model.embed_dim))
        state = state or {}
        if "head" in state:
            head.load_state_dict(state["head"])
        else:  # first participation: a seeded fresh head
            head.reset(ctx.stream("dafkd/head_init"))
        disc = None
        if not self.params.sharing:
            disc = ctx.models.get(f"dafkd/disc/{ctx.arch}", build=lambda: new_model(ctx.env, ctx.arch))
            disc.load_state_dict(state.get("disc", model.state_dict()))  # first time: the global trunk
        return head, disc

    def client_weight(self, ctx: ClientContext) -> float:
        return float(ctx.data.num_samples) if self.params.weighting == "samples" else 1.0

    def score_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        """App. B second phase: this round's trained model scores the aggregated generator's set."""
        if state is None or "pending" not in state:
            raise ValueError(f"client {ctx.client_id} has no model trained this round to score with")
        model = ctx.models.get(ctx.arch)
        gen = ctx.models.get("dafkd/generator", build=self.new_generator)
        gen.load_state_dict(msg.common["generator"])
        model.load_state_dict(state["pending"])
        head, disc = self.personal_modules(state, ctx, model)
        kept = {k: v for k, v in state.items() if k != "pending"}
        return ClientResult(self.upload_scores(model, head, disc, self.distill_set(gen, msg.common["seed"])),
                            self.client_weight(ctx), {}, kept)

    def train_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        p, common = self.params, msg.common
        weight = self.client_weight(ctx)
        model = ctx.models.get(ctx.arch)
        gen = ctx.models.get("dafkd/generator", build=self.new_generator)
        gen.load_state_dict(common["generator"])
        model.load_state_dict(common["models"][ctx.arch])
        head, disc = self.personal_modules(state, ctx, model)
        metrics = self.local_train(model, head, disc, gen, ctx)
        payload: dict[str, Any] = {"model": clone_state(model), "generator": clone_state(gen)}
        new_state = {"head": clone_state(head)} | ({} if disc is None else {"disc": clone_state(disc)})
        if p.upload == "discriminator":
            payload.update(new_state)
        elif "seed" in common:  # distill_from=start (code): scores on the start-of-round generator's set
            start_gen = ctx.models.get("dafkd/generator0", build=self.new_generator)
            start_gen.load_state_dict(common["generator"])
            payload.update(self.upload_scores(model, head, disc, self.distill_set(start_gen, common["seed"])))
        elif p.distill_from == "aggregated" and ctx.round >= p.distill_from_round:
            new_state["pending"] = payload["model"]  # for this round's score phase
        return ClientResult(payload, weight, metrics, new_state)

    def upload_scores(self, model, head, disc, x: torch.Tensor) -> dict[str, torch.Tensor]:
        """App. B upload: f_k(x_i)·o_k(x_i) [N, C] and f_k(x_i) [N] (f ≡ 1 without correlation)."""
        logits, f = self.score(model, head, disc, x)
        if not self.params.correlation:
            f = torch.ones_like(f)
        o = soften(logits, self.params.distill.T) if self.params.mix == "probs" else logits
        return {"weighted": (f[:, None] * o).cpu(), "f": f.cpu()}

    def local_train(self, model, head, disc, gen, ctx: ClientContext) -> dict[str, float]:
        """Eq. 9: CE + Eq. 2's BCE on a shared trunk, and the generator against the local D (Eq. 3)."""
        p, tc, x, y = self.params, ctx.env.config.train, ctx.data.x, ctx.data.y
        rng = ctx.generator()
        d_net = model if disc is None else disc

        def discriminate(v: torch.Tensor) -> torch.Tensor:
            """Domain logit (its sigmoid is f(θ_k^d; v)) of generated inputs or interpolates: BatchNorm keeps
            the running statistics of real data, the ones the classifier is evaluated and scored with."""
            with batchnorm_stats_kept(d_net):
                return head(d_net.embed(v))

        opt = make_optimizer([*model.parameters(), *head.parameters()]
                             + ([] if disc is None else list(disc.parameters())), tc)
        gopt = Adam(gen.parameters(), lr=p.gen_lr or tc.lr, betas=(0.5, 0.99),
                                weight_decay=tc.weight_decay)
        d_round, g_round = _active(p.disc_rounds, ctx.round), _active(p.gen_rounds, ctx.round)
        per_epoch = -(-len(y) // tc.batch_size)
        logs: dict[str, list[float]] = {"train_loss": [], "d_loss": [], "d_real": [], "d_fake": [], "g_loss": []}
        for step, idx in enumerate(batch_indices(len(y), tc.batch_size, rng, tc.epochs, tc.steps, x.device)):
            epoch = step // per_epoch
            for m in (model, head, d_net, gen):
                m.train()
            z = model.embed(x[idx])
            loss = F.cross_entropy(model.head(z), y[idx])
            logs["train_loss"].append(float(loss.detach()))
            if d_round and _active(p.disc_epochs, epoch):
                with torch.no_grad():
                    fake = gen.sample(len(idx), rng)
                real_logit = head(z if disc is None else disc.embed(x[idx]))
                fake_logit = discriminate(fake)
                target = torch.cat([torch.ones_like(real_logit), torch.zeros_like(fake_logit)])
                d_loss = F.binary_cross_entropy_with_logits(torch.cat([real_logit, fake_logit]), target)
                if p.gp_weight > 0:
                    d_loss = d_loss + p.gp_weight * gradient_penalty(discriminate, x[idx], fake, rng)
                loss = loss + p.disc_weight * d_loss
                logs["d_loss"].append(float(d_loss.detach()))
                logs["d_real"].append(float(torch.sigmoid(real_logit.detach()).mean()))
                logs["d_fake"].append(float(torch.sigmoid(fake_logit.detach()).mean()))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if p.schedule == "alternating" and g_round and _active(p.gen_epochs, epoch):
                logs["g_loss"].append(generator_step(gen, gopt, discriminate, len(idx), rng))
        if p.schedule == "sequential" and g_round:
            d_net.eval()  # the discriminator is fixed now: its BN uses the statistics of real data
            head.eval()
            total = len(logs["train_loss"]) if p.gen_epochs is None else p.gen_epochs * per_epoch
            for _ in range(total):
                logs["g_loss"].append(generator_step(gen, gopt, discriminate, min(tc.batch_size, len(y)), rng))
        return {"steps": float(len(logs["train_loss"])), **{k: float(np.mean(v)) for k, v in logs.items() if v}}

