"""FedDF (Lin et al. 2020, https://arxiv.org/abs/2006.07242): fuse client models by ensemble distillation on a
proxy set, as extended by Soni et al. 2024 (https://arxiv.org/abs/2406.12658, "FL with a single shared image").

A round is one phase, `train` (reduce="each"): every sampled client trains locally (optionally with
FedProx and logit clipping), then computes its logits on the proxy samples the server selected (only their
indices travel). On FedAvg-initialisation rounds (every `fedavg_every` rounds) it also uploads its weights.
The server averages the logits by sample count into the teacher, starts each architecture's global model
("mirror") from the FedAvg of that architecture's clients or from last round's distilled model, distils
every mirror from the same all-client teacher (best-on-validation kept), then selects next round's proxy
subset with the best mirror. The proxy pool is rebuilt in every process from the config and cached.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Literal

import numpy as np
import torch
from torch import nn

from fedsim import rng
from fedsim.algorithms._selection import SelectionConfig, embed_and_predict, select
from fedsim.config.limits import MAX_ROUNDS, MAX_SAMPLES, MAX_SEED, MAX_STEPS
from fedsim.data.proxy import proxy_pool, split_test_halves
from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    DistillConfig,
    Env,
    GlobalModels,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    average_by_arch,
    clone_state,
    distill,
    ensemble_teacher,
    evaluate_classifier,
    evaluate_models,
    init_global_models,
    knob,
    loaded_model,
    mechanism,
    predict_logits,
    register_algorithm,
    register_state,
    sum_by_arch,
)


@dataclass
class ServerDistill(DistillConfig):
    """The single-image paper's server distillation: Adam 0.005, 500 steps, batch 32, T=1, clipping 2.5."""

    clip_logits: float | None = knob(2.5, gt=0, doc="logit clipping factor c of the reference code (null: off)")


@dataclass
class NoSelection(SelectionConfig):
    """FedDF distils on its whole proxy set unless selection is switched on (paper Table 6)."""

    kmeans: bool = knob(False, doc="KMeans class balancing on the global model's embeddings")
    entropy: bool = knob(False, doc="entropy (max-softmax confidence) pruning")


@dataclass
class DistillFLParams:
    """Knobs shared by FedDF and single-image FL; defaults are the single-image paper's settings."""

    distill: ServerDistill = knob(factory=ServerDistill)
    selection: SelectionConfig = knob(factory=SelectionConfig)
    fedavg_every: int = knob(5, ge=1, le=MAX_ROUNDS,
                             doc="FedAvg initialisation every this many rounds (rate 100/50/20% = 1/2/5); "
                             "other rounds start from the last distilled model")
    fedavg_first: int = knob(1, ge=0, le=MAX_ROUNDS, doc="the first rounds always use FedAvg initialisation")
    schedule: Literal["fixed", "cosine_restart"] = knob("fixed", doc="distillation steps per round: fixed, or "
                                                        "cosine from distill.steps to steps_min, restarting")
    steps_min: int = knob(250, ge=1, le=MAX_STEPS, doc="fewest steps of the cosine_restart schedule (Table 4: 250)")
    steps_interval: int = knob(5, ge=1, le=MAX_ROUNDS, doc="restart period (rounds) of the cosine_restart schedule")
    validation: Literal["pooled", "none"] = knob("pooled", doc="score students on the pooled client validation "
                                                 "splits (held by the server, as in the reference code) or not")
    client_clip: bool = knob(True, doc="clip logits (distill.clip_logits) in the clients' CE too, as the reference")
    mu: float = knob(0.0, ge=0, doc="FedProx proximal weight for local training (0: plain local SGD)")
    weighting: Literal["samples", "uniform"] = knob("samples", doc="teacher and FedAvg weights")
    mix: Literal["logits", "probs"] = knob("logits", doc="average client logits (FedDF) or probabilities")

    def __post_init__(self) -> None:
        if self.schedule == "cosine_restart" and (self.distill.steps is None or self.steps_min > self.distill.steps):
            raise ValueError("schedule=cosine_restart needs distill.steps set and >= steps_min")


@dataclass
class FedDFParams(DistillFLParams):
    selection: NoSelection = knob(factory=NoSelection)  # keeps its place after `distill`
    proxy: Literal["dataset", "test_half", "extras"] = knob(
        "dataset", doc="proxy set: another dataset's train inputs, half of this dataset's test set (the other half "
        "scores the models, as the reference does for a same-dataset proxy), or env.extras['proxy']")
    proxy_dataset: str = knob("cifar100", doc="dataset of the proxy (proxy=dataset), e.g. CIFAR-100 for CIFAR-10")
    proxy_size: int = knob(500, ge=1, le=MAX_SAMPLES, doc="proxy samples drawn (Tables 3-4: 500 CIFAR-100 samples)")
    proxy_seed: int = knob(0, ge=0, le=MAX_SEED, doc="seed of the proxy draw and of the test-set halves")


@register_state
@dataclass
class FedDFState(GlobalModels):
    """Mirrors (one model per architecture) plus the proxy indices selected for the coming round."""

    indices: np.ndarray = field(default_factory=lambda: np.zeros(0, np.int64))
    best: str = ""
    val: dict[str, float] = field(default_factory=dict)
    total_steps: int = 0
    selection: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class FedDFRound:
    """What every client gets: the proxy indices to compute logits on, whether to upload weights too, and (one
    architecture) the global model; with several architectures each client's own mirror comes per client."""

    indices: torch.Tensor
    fedavg: bool
    models: dict[str, dict[str, torch.Tensor]] | None = None


def scheduled_steps(round1: int, steps: int, steps_min: int, interval: int) -> int:
    """The reference's cosine-with-restarts steps for 1-based round `round1`; round 1 gets the maximum."""
    if round1 <= 1 or interval <= 1:
        return steps
    pos = round1 % interval
    pos = pos + 1 if pos else 1
    return int(steps_min + 0.5 * (steps - steps_min) * (1 + math.cos((pos - 1) / (interval - 1) * math.pi)))


@register_algorithm
class FedDF(Algorithm):
    """Ensemble distillation on a proxy set, with mirrors per architecture and optional proxy selection."""

    name = "feddf"
    Params: ClassVar[type] = FedDFParams  # any params class: subclasses bring their own

    # ---- shared pieces -------------------------------------------------------------------------------
    def pool(self, env: Env):
        """The proxy pool both sides index into."""
        p = self.params
        return proxy_pool(p.proxy, env, p.proxy_dataset, p.proxy_size, p.proxy_seed)

    @classmethod
    def pooled_data_key(cls, cfg: Any) -> str | None:
        return "algorithm.validation" if cfg.algorithm.params.validation == "pooled" else None

    def is_fedavg_round(self, round: int) -> bool:
        r1 = round + 1
        return r1 <= self.params.fedavg_first or r1 % self.params.fedavg_every == 0

    def distill_steps(self, round: int, n: int) -> int:
        """Steps of this round's distillation on n samples (fixed, epochs-based, or the cosine schedule)."""
        p = self.params
        if p.schedule == "fixed" or p.distill.steps is None:
            return p.distill.total_steps(n)
        return scheduled_steps(round + 1, p.distill.steps, p.steps_min, p.steps_interval)

    # ---- server --------------------------------------------------------------------------------------
    def init_server(self, env: Env) -> FedDFState:
        models = init_global_models(env)
        state = FedDFState(models=models, best=env.archs[0])
        state.indices, state.selection = self.select_for(state, 0)
        return state

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "each", local_training=True)]

    def broadcast(self, phase: Phase, state: FedDFState, info: RoundInfo) -> Broadcast:
        common = FedDFRound(indices=torch.from_numpy(state.indices.astype(np.int32)),
                            fedavg=self.is_fedavg_round(info.round))
        if len(state.models) == 1:
            return Broadcast(common=replace(common, models=state.models))
        archs = self.env.client_archs  # heterogeneous: each client downloads only its own architecture's mirror
        return Broadcast(common=common, per_client={c: {archs[c]: state.models[archs[c]]} for c in info.participants})

    def validator(self):
        """Accuracy on the pooled client validation splits (None when off or unavailable)."""
        if self.params.validation == "none":
            return None
        if not hasattr(self, "_val"):
            data, part = self.env.extras.get("server_data"), self.env.extras.get("partition")
            self._val = None
            if data is not None and part is not None and len(part.val.flat):
                idx = part.val.flat
                dev = self.env.device
                self._val = (torch.as_tensor(data.x_train[idx]).to(dev), torch.as_tensor(data.y_train[idx]).to(dev))
        if self._val is None:
            return None
        x, y = self._val
        bs = self.env.config.eval.batch_size
        return lambda m: evaluate_classifier(m, x, y, bs)["accuracy"]

    def server_step(self, phase: Phase, state: FedDFState, updates: dict[int, ClientResult],
                    info: RoundInfo) -> tuple[FedDFState, dict]:
        metrics = {"selection_s": state.selection.get("seconds", 0.0), "selected": float(len(state.indices)),
                   "fedavg_init": float(self.is_fedavg_round(info.round))}
        if not updates:
            return state, metrics
        t0 = time.perf_counter()
        dev, p = self.env.device, self.params
        cids = list(updates)
        logits = torch.stack([updates[c].payload["logits"].float() for c in cids])
        weights = torch.tensor([updates[c].weight for c in cids], dtype=torch.float64)
        teacher = ensemble_teacher(logits, weights, T=p.distill.T, mix=p.mix).to(dev)
        models = dict(state.models)
        if self.is_fedavg_round(info.round) and all("weights" in updates[c].payload for c in cids):
            models = self.fedavg(updates, models)
        x = self.pool(self.env).take(state.indices, dev)
        steps = self.distill_steps(info.round, len(x))
        cfg = replace(p.distill, steps=steps, epochs=None)
        validate, val, loss = self.validator(), {}, []
        probe, before, after, self._mech_s = self.mechanism_probe(), [], [], 0.0
        for arch in models:
            student = loaded_model(self.env, arch, models[arch], dev)
            before.append(self.mechanism_outputs(student, x, probe))
            gen = rng.torch_generator(self.env.config.seed, f"feddf/distill/{arch}", info.round)
            res = distill(student, x, teacher, cfg, gen, validate=validate)
            after.append(self.mechanism_outputs(student, x, probe))
            models[arch], val[arch] = clone_state(student), res["best_score"]
            loss.append(res["loss"])
        distill_s = time.perf_counter() - t0 - self._mech_s  # the mechanism's forward passes are not distillation
        best = max(val, key=lambda a: (val[a] if not math.isnan(val[a]) else -1.0))
        new = FedDFState(models=models, extra=state.extra, indices=state.indices, best=best, val=val,
                         total_steps=state.total_steps + steps, selection={})
        if probe is not None:
            metrics.update(self.mechanism_metrics(updates, weights, teacher, state.indices, probe, before, after,
                                                  info.round))
        if info.round + 1 < self.env.config.rounds:
            new.indices, new.selection = self.select_for(new, info.round + 1)
        metrics.update(distill_s=distill_s, distill_steps=float(steps), distill_steps_total=float(new.total_steps),
                       distill_loss=float(np.mean(loss)), teacher_clients=float(len(cids)),
                       **{f"val_{a}": v for a, v in val.items()})
        return new, metrics

    def fedavg(self, updates: dict[int, ClientResult], previous: dict[str, dict]) -> dict[str, dict]:
        """FedAvg within each architecture over the clients that uploaded weights."""
        summed = sum_by_arch({c: r.payload["weights"] for c, r in updates.items()},
                             {c: r.weight for c, r in updates.items()}, self.env.client_archs)
        return average_by_arch(summed, previous)

    def select_for(self, state: FedDFState, round: int) -> tuple[np.ndarray, dict[str, float]]:
        """Proxy indices for `round`, chosen with the best mirror (paper Sec. 3.2)."""
        t0 = time.perf_counter()
        cfg: SelectionConfig = self.params.selection
        pool = self.pool(self.env)
        m = cfg.candidates(len(pool))
        emb = logits = None
        if cfg.needs_model:
            model = loaded_model(self.env, state.best, state.models[state.best])
            bs = self.env.config.eval.batch_size
            parts = [embed_and_predict(model, pool.take(np.arange(i, min(i + 8192, m)), self.env.device), bs)
                     for i in range(0, m, 8192)]
            emb, logits = np.concatenate([e for e, _ in parts]), torch.cat([lg for _, lg in parts])
        idx, info = select(emb, logits, cfg, len(pool), rng.seed(self.env.config.seed, "feddf/selection", round))
        return idx, {**info, "seconds": time.perf_counter() - t0}

    def evaluate(self, state: FedDFState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        if getattr(self.params, "proxy", None) == "test_half":
            _, keep = split_test_halves(len(y_test), self.params.proxy_seed)
            keep_t = torch.from_numpy(keep).to(x_test.device)
            x_test, y_test = x_test[keep_t], y_test[keep_t]
        rows = []
        for row in evaluate_models(self.env, state.models, x_test, y_test, device):
            arch = row["model"]
            rows.append({**row, "val_accuracy": state.val.get(arch, math.nan),
                         "drives_selection": float(arch == state.best)})
        macro = float(np.mean([r["accuracy"] for r in rows]))
        return [{**r, "macro_accuracy": macro} for r in rows]

    # ---- mechanism (evaluation only) -------------------------------------------------------------------
    mechanism_columns: ClassVar[dict[str, str]] = {
        "train/mech_student_acc_before": "test-subset accuracy of the global model(s) this round starts distilling "
        "(FedAvg'd or last round's), mean over mirrors",
        "train/mech_student_acc_after": "the same after distillation (the best-on-validation student kept)",
        "train/mech_patch_agree_before": "top-1 agreement of the student with the teacher on the distillation set, "
        "before distillation (mean over mirrors)",
        "train/mech_patch_agree_after": "the same after distillation: how well the student fits the teacher where "
        "it is taught",
        "train/mech_teacher_acc": "test-subset accuracy of the teacher (the clients' weighted ensemble, as the "
        "server builds it); FedAvg-initialisation rounds only, when the clients' weights reach the server",
        "train/mech_test_agree_before": "top-1 agreement of the student with the teacher on the test subset, before "
        "distillation; FedAvg-initialisation rounds only",
        "train/mech_test_agree_after": "the same after distillation: what fitting the teacher on the distillation "
        "set transfers to real data",
        "train/mech_sel_balance": "class balance of the distillation set as the teacher labels it: entropy of the "
        "predicted-class histogram as a fraction of log2(classes) (1 = uniform)",
        "train/mech_sel_max_share": "the largest teacher-predicted class's share of the distillation set",
        "train/mech_sel_entropy": "mean entropy (bits) of the teacher's predictions on the distillation set",
        "train/mech_unsel_balance": "mech_sel_balance on up to eval.mechanism_samples proxy-pool samples left out "
        "of the distillation set; FedAvg-initialisation rounds only, NaN when nothing is left out",
        "train/mech_unsel_entropy": "mech_sel_entropy on the same left-out samples",
    }

    def mechanism_probe(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The test subset the columns score on; with a test-half proxy only the half the models are scored on."""
        probe = mechanism.probe_set(self.env)
        if probe is None or getattr(self.params, "proxy", None) != "test_half":
            return probe
        if not hasattr(self, "_mech_probe"):
            data = self.env.extras["server_data"]
            _, keep = split_test_halves(len(data.y_test), self.params.proxy_seed)
            limit = int(getattr(self.env.config.eval, "mechanism_samples", 1000))
            if len(keep) > limit:
                keep = np.sort(rng.numpy_generator(self.env.config.seed, "mechanism/probe").choice(keep, limit, False))
            self._mech_probe = (torch.as_tensor(np.ascontiguousarray(data.x_test[keep])).to(self.env.device),
                                torch.as_tensor(np.asarray(data.y_test[keep]), dtype=torch.long).to(self.env.device))
        return self._mech_probe

    def mechanism_outputs(self, model: nn.Module, x: torch.Tensor, probe) -> tuple[torch.Tensor, torch.Tensor] | None:
        """A student's eval-mode logits (CPU) on the distillation set and on the probe; None when columns are off."""
        if probe is None:
            return None
        t0 = time.perf_counter()
        out = (mechanism.logits(model, x).float().cpu(), mechanism.logits(model, probe[0]).float().cpu())
        self._mech_s += time.perf_counter() - t0
        return out

    def mechanism_metrics(self, updates: dict[int, ClientResult], weights: torch.Tensor, teacher: torch.Tensor,
                          indices: np.ndarray, probe, before: list, after: list, round: int) -> dict[str, float]:
        """This round's `mechanism_columns`: students vs teacher from outputs already computed, and the teacher's
        view of the distillation set; the teacher on real data needs the clients' models (weight-upload rounds)."""
        t0 = time.perf_counter()
        y, teacher, mean = probe[1].cpu(), teacher.float().cpu(), lambda v: float(np.mean(v))
        sel = mechanism.class_balance(teacher.argmax(1), self.env.num_classes)
        out = {"student_acc_before": mean([mechanism.accuracy(b[1], y) for b in before]),
               "student_acc_after": mean([mechanism.accuracy(a[1], y) for a in after]),
               "patch_agree_before": mean([mechanism.agreement(b[0], teacher) for b in before]),
               "patch_agree_after": mean([mechanism.agreement(a[0], teacher) for a in after]),
               "sel_balance": sel["entropy_frac"], "sel_max_share": sel["max_share"],
               "sel_entropy": float(mechanism.entropy_bits(teacher).mean()),
               **dict.fromkeys(("teacher_acc", "test_agree_before", "test_agree_after", "unsel_balance",
                                "unsel_entropy"), math.nan)}
        if all("weights" in r.payload for r in updates.values()):
            ens = self.uploaded_teacher(updates, weights, probe[0])
            out.update(teacher_acc=mechanism.accuracy(ens, y),
                       test_agree_before=mean([mechanism.agreement(b[1], ens) for b in before]),
                       test_agree_after=mean([mechanism.agreement(a[1], ens) for a in after]))
            rest = self.left_out(indices, round)
            if len(rest):
                left = self.uploaded_teacher(updates, weights, self.pool(self.env).take(rest, self.env.device))
                unsel = mechanism.class_balance(left.argmax(1), self.env.num_classes)
                out.update(unsel_balance=unsel["entropy_frac"],
                           unsel_entropy=float(mechanism.entropy_bits(left).mean()))
        self._mech_s += time.perf_counter() - t0
        return mechanism.columns(out)

    def uploaded_teacher(self, updates: dict[int, ClientResult], weights: torch.Tensor,
                         x: torch.Tensor) -> torch.Tensor:
        """The server's teacher (CPU probabilities) rebuilt from the clients' uploaded models on any inputs x; the
        models are built under a forked RNG so no training stream moves."""
        logits = []
        for cid, res in updates.items():
            model = loaded_model(self.env, self.env.client_archs[cid], res.payload["weights"])
            logits.append(mechanism.logits(model, x).float().cpu())
        p = self.params
        return ensemble_teacher(torch.stack(logits), weights, T=p.distill.T, mix=p.mix)

    def left_out(self, indices: np.ndarray, round: int) -> np.ndarray:
        """Up to eval.mechanism_samples pool indices outside the distillation set (a fixed seeded draw)."""
        rest = np.setdiff1d(np.arange(len(self.pool(self.env))), indices)
        limit = int(getattr(self.env.config.eval, "mechanism_samples", 1000))
        if len(rest) > limit:
            rest = np.sort(rng.numpy_generator(self.env.config.seed, "mechanism/left_out", round).choice(rest, limit,
                                                                                                      False))
        return rest

    # ---- client --------------------------------------------------------------------------------------
    def local_training(self, phase: Phase, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """Local SGD from the round's mirror (with FedDF's optional proximal term and clipped logits), then upload the
        logits on the round's proxy indices and, in FedAvg rounds, the weights."""
        common: FedDFRound = msg.common
        models = msg.own if msg.own is not None else common.models
        assert models is not None  # one architecture: the global model comes with the common part
        p = self.params

        def finish(model: nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            x = self.pool(ctx.env).take(common.indices, ctx.device)
            payload: dict[str, Any] = {"logits": predict_logits(model, x, ctx.env.config.eval.batch_size).float().cpu()}
            if common.fedavg:
                payload["weights"] = clone_state(model)
            weight = float(ctx.data.num_samples) if p.weighting == "samples" else 1.0
            return ClientResult(payload=payload, weight=weight, metrics=metrics)

        return LocalTraining.of(ctx, models[ctx.arch], finish, mu=p.mu,
                                clip=p.distill.clip_logits if p.client_clip else None)

