"""DOSFL: Distilled One-Shot Federated Learning (Zhou et al. 2020, https://arxiv.org/abs/2009.07999 v1).

One round. The server sends an init seed; every client rebuilds the same Xavier-initialised θ0 and distils
its private data into S_d synthetic steps (a batch of B_d inputs, labels, a learned lr each) that train θ0
by plain SGD (fedsim.algorithms._meta_distill: true meta-gradients through S_d·E_d unrolled steps, Adam meta-optimiser
halved every τ epochs). The server interleaves the uploaded steps by step index over the clients that
arrived and trains θ0 with each step's own lr for E_d passes. Non-IID aids: soft labels, soft reset
(θ ~ N(θ_server, σ²) each iteration) and random masking. `mode: serial` is the paper's serial DOSFL:
the round has one phase per participant; in phase i only the i-th client (seeded order) distils, against
the model the server holds after training on the clients before it, which the server sends it (the first
gets only the seed). Values marked D1–D8 are readings of what the paper leaves open (see the Params docs).
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

import fedsim.data.text  # noqa: F401  (registers text_tsv / text_npz)
import fedsim.models.text  # noqa: F401  (registers textcnn / bilstm)
from fedsim import rng
from fedsim.algorithms._meta_distill import (
    Distiller,
    DistillSettings,
    class_balanced_labels,
    sgd_replay,
    trainable,
    xavier_init_,
)
from fedsim.config.limits import MAX_BATCH, MAX_EPOCHS, MAX_SEED
from fedsim.config.schema import clients_per_round
from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    GlobalModels,
    Message,
    Phase,
    RoundInfo,
    evaluate_models,
    knob,
    loaded_model,
    mechanism,
    new_model,
    register_algorithm,
)


@dataclass
class DOSFLParams:
    mode: Literal["parallel", "serial"] = knob("parallel", doc="parallel DOSFL (one exchange) or serial DOSFL "
                                               "(clients distil one after another against the updated model)")
    distill_steps: int = knob(10, ge=1, le=10_000, doc="S_d, synthetic steps per client (MNIST value lost [D5]; "
                              "Wang et al.'s default 10; IMDB 5)")
    distill_batch: int = knob(10, ge=1, le=100_000,
                              doc="B_d, synthetic inputs per step (lost for MNIST [D5]; 10 = one per "
                              "class per step as in Wang et al.; IMDB 1)")
    distill_epochs: int = knob(3, ge=1, le=MAX_EPOCHS,
                               doc="E_d, passes over the S_d steps, on clients and on the server "
                               "(lost for MNIST [D5]; Wang et al. 3; IMDB 10)")
    distill_lr: float = knob(0.02, gt=0, doc="η0, initial learned lr (lost for MNIST [D5]; Wang et al. 0.02; "
                             "IMDB 0.01)")
    soft_labels: bool = knob(False, doc="learn the labels too (Eq. 5), initialised one-hot")
    label_form: Literal["logits", "probs"] = knob("logits", doc="[D2] soft labels are logits (target softmax(ỹ), "
                                                  "as the appendix's 'logit 1.63 / 0') or the target itself")
    lr_per: Literal["step", "unrolled"] = knob("step", doc="[D1] one learned lr per synthetic step (the seed's "
                                               "3-tuples) or one per unrolled step S_d·E_d (Wang et al.)")
    lr_param: Literal["softplus", "raw"] = knob("softplus", doc="[D1] lrs learned through softplus (Wang et al., "
                                                "stays positive) or raw as Eq. 4 writes it")
    epochs: int = knob(30, ge=1, le=MAX_EPOCHS, doc="E, distillation epochs per client (30 images, 50 text [v3])")
    epoch_unit: Literal["passes", "iterations"] = knob("passes", doc="[D4] an epoch is a pass over the client's "
                                                       "data in real batches, or one meta-iteration")
    batch_size: int = knob(512, ge=1, le=MAX_BATCH, doc="B, real-data batch of each meta-iteration [v3]")
    meta_lr: float = knob(0.01, gt=0, doc="α, Adam lr on the synthetic data (MNIST/IMDB 0.01, TREC-6 0.1 [v3])")
    meta_beta1: float = knob(0.5, ge=0, lt=1, doc="Adam β1 (Wang et al.'s 0.5; the seed only says ADAM)")
    decay_every: int = knob(40, ge=1, le=MAX_EPOCHS,
                            doc="τ, halve α every τ epochs (MNIST 40, IMDB 10, TREC-6 30 [v3])")
    decay_factor: float = knob(0.5, gt=0, le=1, doc="meta-lr decay factor (seed: 0.5)")
    reset: Literal["none", "soft", "hard"] = knob("none", doc="start of each iteration: θ_server, soft reset "
                                                  "N(θ_server, σ²I), or a fresh Xavier init (Wang et al.)")
    soft_reset_var: float = knob(1e-4, ge=0, doc="σ², soft-reset variance (search space lost [D5])")
    soft_reset_center: Literal["server", "init"] = knob("server", doc="[D6] centre of soft resets: the model the "
                                                        "server holds (θ0 in parallel, the current one in serial) "
                                                        "or always θ0")
    soft_reset_first: bool = knob(True, doc="[D6] perturb the first iteration too (False: it starts at θ_server)")
    mask_p: float = knob(0.0, ge=0, lt=1, doc="p, random masking: fraction replaced by N(0,1) noise each "
                      "iteration and restored after it (search space lost [D5])")
    mask_unit: Literal["example", "step"] = knob("example", doc="[D3] mask single synthetic inputs or whole "
                                                 "steps; labels and lrs are kept and masked slots get no gradient")
    upload_labels: bool = knob(True, doc="[D7] send hard labels (soft ones always go); the paper counts only "
                               "S_d·B_d·|x|, reported as the `scalars` metric")
    init_seed: int | None = knob(None, ge=0, le=MAX_SEED,
                                 doc="seed of θ0 sent to clients; default derived from the run seed")
    init_gain: float = knob(1.0, gt=0, doc="Xavier-normal gain of θ0 (biases 0)")
    serial_curve: bool = knob(False, doc="serial: also evaluate the model after each client (rows 'after_k')")
    ceiling: bool = knob(True, doc="parallel, evaluation only: also distil the union of the arrived clients' data "
                         "on the server at the same budget (distill/mech_ceiling_acc); costs about one client's "
                         "distillation on all of it")

    def __post_init__(self) -> None:
        if self.soft_labels and not self.upload_labels:
            raise ValueError("upload_labels: soft labels are learned on the client and must be uploaded")


def theta_hash(params: dict[str, torch.Tensor]) -> float:
    """48-bit fingerprint of the exact bytes of θ (exactly representable as a float metric)."""
    h = hashlib.sha256()
    for n in sorted(params):
        h.update(n.encode())
        h.update(params[n].detach().cpu().contiguous().numpy().tobytes())
    return float(int(h.hexdigest()[:12], 16))


def distilled_shape(model: torch.nn.Module, input_shape: tuple[int, ...]) -> tuple[int, ...]:
    """Shape of one synthetic input: the data's, or the embedded shape for text models (after the lookup)."""
    fn = getattr(model, "continuous_input_shape", None)
    return tuple(fn(input_shape)) if fn is not None else tuple(input_shape)


@register_algorithm
class DOSFL(Algorithm):
    """One-shot FL by uploading distilled synthetic training steps instead of weights."""

    name = "dosfl"
    Params = DOSFLParams
    mechanism_columns = {
        "distill/mech_theta0_acc": "test accuracy of θ0, the shared initialisation, before any training",
        "distill/mech_alone_acc_mean": "θ0 trained the server's way (E_d passes at the learned lrs) on one client's "
                                       "distilled steps alone: test accuracy, mean over the arrived clients",
        "distill/mech_alone_acc_min": "the same, the worst client",
        "distill/mech_alone_acc_max": "the same, the best client",
        "distill/mech_merged_acc": "θ0 trained on all arrived clients' steps interleaved (what the method does): "
                                   "test accuracy",
        "distill/mech_merged_reversed_acc": "the same merge with the clients interleaved in reverse order (far from "
                                            "merged_acc: the merge is chaotic, its accuracy a draw)",
        "distill/mech_merged_lr_div_k_acc": "the same merge with every learned lr divided by the number of merged "
                                            "clients K (the merge takes K times the steps each lr was learned for)",
        "distill/mech_ceiling_acc": "1-client dataset-distillation ceiling at the same budget: θ0 trained on S_d "
                                    "steps distilled on the server from the union of the arrived clients' training "
                                    "data (params.ceiling)",
    }  # parallel mode only; the server's models are averaged over architectures when clients differ

    def settings(self) -> DistillSettings:
        p = self.params
        return DistillSettings(
            steps=p.distill_steps, batch=p.distill_batch, epochs=p.distill_epochs, lr0=p.distill_lr,
            lr_per=p.lr_per, lr_param=p.lr_param, soft_labels=p.soft_labels, label_form=p.label_form,
            meta_lr=p.meta_lr, meta_beta1=p.meta_beta1, decay_every=p.decay_every, decay_factor=p.decay_factor,
            outer_epochs=p.epochs, real_batch=p.batch_size, epoch_unit=p.epoch_unit, mask_p=p.mask_p,
            mask_unit=p.mask_unit)

    def init_seed(self) -> int:
        if self.params.init_seed is not None:
            return self.params.init_seed
        return rng.seed(self.env.config.seed, "init/dosfl/theta0")

    def theta0(self, model: torch.nn.Module, seed: int) -> dict[str, torch.Tensor]:
        """θ0 from the init seed: the state dict of `model` after the deterministic Xavier init."""
        xavier_init_(model, seed, self.params.init_gain)
        return {k: v.detach().clone() for k, v in model.state_dict().items()}

    def init_server(self, env: Env) -> GlobalModels:
        seed = self.init_seed()
        models = {arch: self.theta0(new_model(env, arch), seed) for arch in env.archs}
        return GlobalModels(models=models, extra={"init_seed": seed, "done": [], "snapshots": []})

    def phases(self, round: int) -> list[Phase]:
        if self.params.mode == "parallel":
            return [Phase("distill", "each", broadcast="send_seed", client="distill_client", server="merge")]
        return [Phase(f"serial{i}", "each", broadcast="send_next", client="distill_client", server="merge")
                for i in range(clients_per_round(self.env.config))]

    def finished(self, state: GlobalModels, round: int) -> bool:
        return True  # one communication round

    @classmethod
    def stateless_clients(cls, cfg: Any) -> bool:
        return True  # a client keeps nothing between phases: any worker may distil it

    @classmethod
    def pooled_data_key(cls, cfg: Any) -> str | None:
        return "algorithm.ceiling" if cfg.algorithm.params.ceiling and cfg.eval.mechanism else None

    # --- serial order -------------------------------------------------------------------------------------
    def serial_pick(self, state: GlobalModels, info: RoundInfo) -> int | None:
        """The next client to distil: the first of a seeded order of participants still alive and not done."""
        order = rng.numpy_generator(self.env.config.seed, "dosfl/serial_order", info.round)
        done, alive = set(state.extra["done"]), set(info.arrived)
        for cid in order.permutation(np.asarray(info.participants, dtype=np.int64)).tolist():
            if cid not in done and cid in alive:
                return int(cid)
        return None

    def send_seed(self, state: GlobalModels, info: RoundInfo) -> Broadcast:
        return Broadcast(common={"init_seed": state.extra["init_seed"]})

    def send_next(self, state: GlobalModels, info: RoundInfo) -> Broadcast:
        """Serial: the init seed, the client whose turn it is, and (after the first) the server's model."""
        seed = state.extra["init_seed"]
        cid = self.serial_pick(state, info)
        common = {"init_seed": seed, "selected": -1 if cid is None else cid}
        if cid is None or not state.extra["done"]:  # the first client rebuilds θ0 from the seed
            return Broadcast(common=common)
        return Broadcast(common=common, per_client={cid: {"model": state.models[self.env.client_archs[cid]]}})

    def starts(self, model: torch.nn.Module, center: dict[str, torch.Tensor], gen: torch.Generator):
        """θ at the start of each meta-iteration: `center`, a soft reset around it, or a fresh Xavier init."""
        p = self.params
        std = math.sqrt(p.soft_reset_var)

        def start(it: int) -> dict[str, torch.Tensor]:
            if p.reset == "soft" and (it > 0 or p.soft_reset_first):
                return {n: v + std * torch.randn(v.shape, generator=gen).to(v.device) for n, v in center.items()}
            if p.reset == "hard":
                xavier_init_(model, int(torch.randint(0, 2**62, (1,), generator=gen)), p.init_gain)
                return {n: q.detach().clone() for n, q in trainable(model)[0].items()}
            return center

        return start

    # --- client -------------------------------------------------------------------------------------------
    def distill_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        common, own = msg.common, msg.own
        if self.params.mode == "serial" and common.get("selected") != ctx.client_id:
            return ClientResult(payload=None, weight=1.0, metrics={"skipped": 1.0})
        p = self.params
        model = ctx.models.get(ctx.arch)
        init = self.theta0(model, common["init_seed"])  # the model now holds θ0
        server = own["model"] if own is not None else init
        if own is not None:
            model.load_state_dict(server)
        params, rest = trainable(model)
        names = list(params)
        center_sd = init if p.soft_reset_center == "init" else server
        center = {n: center_sd[n].to(ctx.device, copy=True) for n in names}
        rest = {k: v.detach().clone() for k, v in rest.items()}
        gen = ctx.generator()
        start = self.starts(model, center, gen)
        if ctx.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(ctx.device)
        d = Distiller(self.settings(), distilled_shape(model, self.env.input_shape), self.env.num_classes, gen,
                      ctx.device)
        metrics = d.fit(model, start, rest, ctx.data.x, ctx.data.y, gen)
        payload = d.export()
        if not p.soft_labels and not p.upload_labels:
            del payload["y"]
        metrics["theta0_hash"] = theta_hash({n: server[n] for n in names})
        metrics["scalars"] = float(payload["x"].numel())
        if ctx.device.type == "cuda":
            metrics["peak_mem_mb"] = torch.cuda.max_memory_allocated(ctx.device) / 2**20
        return ClientResult(payload=payload, weight=float(ctx.data.num_samples), metrics=metrics)

    # --- server -------------------------------------------------------------------------------------------
    def sequence(self, payloads: list[dict[str, torch.Tensor]], device: torch.device) -> list[tuple]:
        """Interleave by step index over clients (d_1^1, d_1^2, ..., d_2^1, ...), repeated for E_d passes."""
        p = self.params
        seq = []
        for e in range(p.distill_epochs):
            for j in range(p.distill_steps):
                for pl in payloads:
                    y = pl["y"][j] if "y" in pl else class_balanced_labels(p.distill_steps, p.distill_batch,
                                                                           self.env.num_classes)[j]
                    k = j if pl["lr"].numel() == p.distill_steps else e * p.distill_steps + j
                    seq.append((pl["x"][j].to(device), y.to(device), pl["lr"][k].to(device)))
        return seq

    def train_on(self, arch: str, start_sd: dict[str, torch.Tensor], payloads: list[dict]) -> dict:
        """Plain SGD from `start_sd` over the interleaved steps; returns the new state dict."""
        device = self.env.device
        model = loaded_model(self.env, arch, start_sd)
        params, rest = trainable(model)
        params = sgd_replay(model, params, rest, self.sequence(payloads, device), self.params.label_form)
        return {k: (params[k] if k in params else v).detach().cpu().clone() for k, v in model.state_dict().items()}

    def merge(self, state: GlobalModels, updates: dict[int, ClientResult],
              info: RoundInfo) -> tuple[GlobalModels, dict]:
        """θ trained on the arrived clients' steps, interleaved (per architecture)."""
        got = {cid: r.payload for cid, r in updates.items() if r.payload is not None}
        if not got:
            return state, {"clients": 0.0}
        models = dict(state.models)
        for arch in self.env.archs:
            mine = [got[c] for c in sorted(got) if self.env.client_archs[c] == arch]
            if mine:
                models[arch] = self.train_on(arch, state.models[arch], mine)
        extra = dict(state.extra)
        if self.params.mode == "serial":
            extra["done"] = extra["done"] + sorted(got)
            if self.params.serial_curve:
                extra["snapshots"] = extra["snapshots"] + [(len(extra["done"]), models)]
        scalars = sum(float(pl["x"].numel()) for pl in got.values())
        metrics = {"clients": float(len(got)), "scalars": scalars}
        if self.params.mode == "parallel":
            metrics.update(self._mechanism(state.models, models, got))
        return GlobalModels(models=models, extra=extra), metrics

    # --- mechanism (evaluation only) ----------------------------------------------------------------------
    def _probe_acc(self, arch: str, weights: dict[str, torch.Tensor], probe: tuple[torch.Tensor, ...]) -> float:
        """Test accuracy of `weights` on the mechanism probe set (eval mode, a fresh model)."""
        model = loaded_model(self.env, arch, weights)
        return mechanism.accuracy(mechanism.logits(model, probe[0]), probe[1])

    def _ceiling(self, arch: str, theta0: dict[str, torch.Tensor], clients: list[int]) -> dict[str, torch.Tensor]:
        """θ0 trained on steps the server distils from the union of `clients`' training data (same settings)."""
        data, part, device = self.env.extras["server_data"], self.env.extras["partition"], self.env.device
        idx = np.concatenate([np.asarray(part.train[c]) for c in clients])
        x = torch.as_tensor(np.ascontiguousarray(data.x_train[idx])).to(device)
        y = torch.as_tensor(np.asarray(data.y_train[idx]), dtype=torch.long).to(device)
        model = loaded_model(self.env, arch, theta0)
        params, rest = trainable(model)
        center = {n: v.clone() for n, v in params.items()}
        rest = {k: v.detach().clone() for k, v in rest.items()}
        gen = rng.torch_generator(self.env.config.seed, "mechanism/dosfl_ceiling")  # no training draw is taken
        d = Distiller(self.settings(), distilled_shape(model, self.env.input_shape), self.env.num_classes, gen, device)
        d.fit(model, self.starts(model, center, gen), rest, x, y, gen)
        return self.train_on(arch, theta0, [d.export()])

    def _mechanism(self, before: dict, after: dict, got: dict[int, dict]) -> dict[str, float]:
        """Accuracy of θ0 trained on each client's steps alone, on the merge (as is, reversed, with lr/K) and on the
        centralised distillation of the same data; the global RNG is restored so training sees no draw."""
        probe = mechanism.probe_set(self.env)
        if probe is None or not got:
            return {}
        devices = [self.env.device] if self.env.device.type == "cuda" else []
        cols: dict[str, list[float]] = {}
        with torch.random.fork_rng(devices=devices):
            for arch in self.env.archs:
                mine = {c: got[c] for c in sorted(got) if self.env.client_archs[c] == arch}
                if not mine:
                    continue
                theta0, k = before[arch], len(mine)

                def add(name: str, value: float) -> None:
                    cols.setdefault(name, []).append(value)

                add("theta0_acc", self._probe_acc(arch, theta0, probe))
                for pl in mine.values():
                    add("alone", self._probe_acc(arch, self.train_on(arch, theta0, [pl]), probe))
                add("merged_acc", self._probe_acc(arch, after[arch], probe))
                reverse = list(mine.values())[::-1]
                add("merged_reversed_acc", self._probe_acc(arch, self.train_on(arch, theta0, reverse), probe))
                scaled = [dict(pl, lr=pl["lr"] / k) for pl in mine.values()]
                add("merged_lr_div_k_acc", self._probe_acc(arch, self.train_on(arch, theta0, scaled), probe))
                if self.params.ceiling:
                    add("ceiling_acc", self._probe_acc(arch, self._ceiling(arch, theta0, list(mine)), probe))
        alone = cols.pop("alone")
        out = {name: float(np.mean(v)) for name, v in cols.items()}
        out.update(alone_acc_mean=float(np.mean(alone)), alone_acc_min=min(alone), alone_acc_max=max(alone))
        return mechanism.columns(out)

    def evaluate(self, state: GlobalModels, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        rows = evaluate_models(self.env, state.models, x_test, y_test, device)
        for k, models in state.extra.get("snapshots", []):
            for row in evaluate_models(self.env, models, x_test, y_test, device):
                arch = row.pop("model")
                rows.append({"model": f"after_{k}" if len(models) == 1 else f"{arch}@after_{k}", **row})
        return rows
