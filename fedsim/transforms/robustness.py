"""Attackers and robust aggregation, as stages of the update chain.

- Roles: a fixed, seeded set of malicious clients for the whole run (`attack.fraction` or `attack.clients`).
- Data poisoning (label_flip, backdoor) changes a malicious client's shard where its worker trains it, in any phase.
- Model poisoning replaces the malicious clients' updates where every update of the round meets: the server side of
  the chain, before the defence. The colluding attacks (alie, min_max, min_sum, ipm) read the benign statistics
  there, every honest update of the round or only the colluders' own (`attack.knowledge`), in client-id order, so
  the numbers are the same on 1 or N workers and whichever workers the colluders are on.
- The defence (`aggregator.name`) combines the round's updates into one, which the method's server step then
  reads as if it were the clients' mean. The mean keeps the workers' partial sums (with no model attack the run is
  the method's own, bit for bit), as does norm bounding: each update is clipped in its worker. Every other rule,
  and any model attack, has each client's update reach the server.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsim import rng
from fedsim.config.schema import clients_per_round
from fedsim.errors import ConfigError
from fedsim.method.aggregate import WEIGHT_KEY
from fedsim.method.contract import ClientData, ClientResult
from fedsim.transforms import attacks, robust
from fedsim.transforms.updates import (
    as_upload,
    clip_to,
    flatten,
    l2_norm,
    noised_entries,
    stack,
    unflatten,
    update_of,
)

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

DATA_ATTACKS = ("label_flip", "backdoor")


def malicious_clients(cfg: RunConfig) -> frozenset[int]:
    """The run's attackers: `attack.clients`, or round(fraction·N) clients drawn once from the stream
    `attack-roles` (none when attack.kind is none)."""
    a, n = cfg.attack, cfg.data.num_clients
    if a.kind == "none":
        return frozenset()
    if a.clients:
        return frozenset(int(c) for c in a.clients)
    count = int(round(a.fraction * n))
    return frozenset(int(c) for c in rng.numpy_generator(cfg.seed, "attack-roles").choice(n, count, replace=False))


def check_robustness(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """The attack and aggregator sections against the rest of the config, one line per problem (ConfigError)."""
    a, g = cfg.attack, cfg.aggregator
    if a.kind == "none" and g.name == "mean":
        return
    n_all = cfg.data.num_clients
    if a.clients and a.fraction:
        raise ConfigError("attack.clients: give the malicious clients by id or by attack.fraction, not both")
    bad = [c for c in a.clients if c >= n_all]
    if bad:
        raise ConfigError(f"attack.clients: client {bad[0]} is not among the run's {n_all} (data.num_clients)")
    if a.kind != "none" and not a.clients and not a.fraction:
        raise ConfigError(f"attack.kind: {a.kind} with no attacker: set attack.fraction or attack.clients")
    model_attack = a.kind not in ("none", *DATA_ATTACKS)
    name = cfg.algorithm.name
    if (model_attack or g.name != "mean") and uploads_model_update is False:
        what = f"aggregator.name: {g.name}" if g.name != "mean" else f"attack.kind: {a.kind}"
        raise ConfigError(f"{what} works on each client's model update, and {name}'s server does not aggregate "
                          "client models (its round is not one phase that uploads a model update, model_update=True)")
    if (model_attack or g.name != "mean") and len(set(cfg.model.mix) or {cfg.model.name}) > 1:
        raise ConfigError("aggregator.name: clients of several architectures (model.mix) are not supported with a "
                          "model attack or a robust aggregator")
    if cfg.privacy.level in ("client", "local") and (model_attack or g.name != "mean"):  # sample level: each
        # client's DP-SGD is private whatever the server does with its update
        raise ConfigError(f"privacy.level: {cfg.privacy.level}-level DP's noise is calibrated to the clipped mean; a "
                          "robust aggregator's or a model attack's sensitivity is not what the accountant assumes: use "
                          "one or the other (or privacy.level: sample)")
    if g.name == "norm_bound" and g.bound is None:
        raise ConfigError("aggregator.bound: norm_bound needs the L2 norm to clip each update to")
    problem = robust.requirement(g.name, clients_per_round(cfg), g.f, g.beta)
    if problem:
        raise ConfigError(f"aggregator.f: {problem}, with the round's participants (participation)")
    if g.name == "multi_krum" and g.m is not None and g.m > clients_per_round(cfg):
        raise ConfigError(f"aggregator.m: keeps {g.m} updates of the round's {clients_per_round(cfg)}")


def check_classes(cfg: RunConfig, num_classes: int) -> None:
    """The backdoor's target among the data's classes (known once the data is loaded)."""
    if cfg.attack.kind == "backdoor" and cfg.attack.target >= num_classes:
        raise ConfigError(f"attack.target: {cfg.attack.target} is not a class of {cfg.data.name} "
                          f"(labels 0..{num_classes - 1})")


@dataclass
class Robustness:
    """The attack and the defence of a run: roles and data poisoning in the workers, model poisoning and the
    aggregator on the server."""

    cfg: RunConfig
    malicious: frozenset[int]
    num_classes: int = 0  # label flipping maps l to num_classes - 1 - l
    mean: Any = None  # the data's normalisation, which the backdoor's trigger (in raw pixels) goes through
    std: Any = None
    raw_max: float = 1.0  # the trigger's default value: the training data's largest raw pixel
    center: torch.Tensor | None = None  # centered_clip: the previous round's aggregate
    root: dict[str, torch.Tensor] | None = None  # fltrust: the server's root-set update, set each round by the server
    poisoned: dict[int, ClientData] = field(default_factory=dict)  # a worker's poisoned shards, made once

    @property
    def model_attack(self) -> bool:
        return self.cfg.attack.kind not in ("none", *DATA_ATTACKS)

    @property
    def on_updates(self) -> bool:
        """Whether a stage acts on the model updates (a model attack or a defence other than the mean)."""
        return self.model_attack or self.cfg.aggregator.name != "mean"

    @property
    def per_client(self) -> bool:
        """Whether each client's update must reach the server (else the workers' partial sums do)."""
        return self.model_attack or self.cfg.aggregator.name not in robust.SUM_COMPATIBLE

    @property
    def clips(self) -> bool:
        """Norm bounding over the workers' partial sums: each update clipped in its worker."""
        return not self.per_client and self.cfg.aggregator.name == "norm_bound"

    @property
    def trigger_value(self) -> float:
        return self.raw_max if self.cfg.attack.trigger_value is None else float(self.cfg.attack.trigger_value)

    def triggered_test(self, x_test: torch.Tensor, y_test: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The backdoor's test set: every test image not of the target class, triggered and labelled the target
        (a model's accuracy on it is the attack's success rate)."""
        a = self.cfg.attack
        return attacks.triggered_test(x_test, y_test, a.target, a.trigger_size, self.trigger_value, self.mean,
                                      self.std)

    def role(self, client: int) -> str:
        return "malicious" if client in self.malicious else "benign"

    # ---- the workers' side ---------------------------------------------------------------------------
    def poison(self, client: int, data: ClientData) -> ClientData:
        """A malicious client's shard as it trains on it (a benign client's is returned as it is)."""
        a = self.cfg.attack
        if client not in self.malicious or a.kind not in DATA_ATTACKS:
            return data
        if client not in self.poisoned:
            if a.kind == "label_flip":
                x, y = data.x, attacks.flip_labels(data.y, self.num_classes)
            else:
                gen = rng.torch_generator(self.cfg.seed, "attack-backdoor", client=client)
                x, y = attacks.poison_backdoor(data.x, data.y, a.target, a.poison_fraction, gen, a.trigger_size,
                                               self.trigger_value, self.mean, self.std)
            self.poisoned[client] = ClientData(x, y, data.x_val, data.y_val, data.x_test, data.y_test)
        return self.poisoned[client]

    def client(self, res: ClientResult, arch: str, reference: Mapping[str, torch.Tensor]) -> ClientResult:
        """A client's upload as its worker hands it on: its update (per client), or its update clipped to the bound
        (norm bounding over partial sums); its norm among its metrics."""
        update = update_of(res.payload, arch, reference)
        if self.clips:
            update, norm = clip_to(update, float(self.cfg.aggregator.bound))  # type: ignore[arg-type]
            device = next(iter(update.values())).device if update else None
            update[f"{arch}/{WEIGHT_KEY}"] = torch.ones((), dtype=torch.float64, device=device)
        else:  # it travels to the server alone: on the CPU, as a worker's partial sum does
            norm = l2_norm(update)
            update = {k: v.to("cpu") for k, v in update.items()}
        return ClientResult(payload=update, weight=res.weight, metrics={**res.metrics, "update_norm": norm},
                            state=res.state, probe=res.probe)

    # ---- the server's side ---------------------------------------------------------------------------
    def bounded_mean(self, total: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
                     count: int, round: int, phase: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """Norm bounding over the partial sums: the weighted mean of the clipped updates, plus the weak-DP noise, in
        the upload's summed form over the `count` updates (in_sum_form)."""
        weight = sum(float(v) for k, v in total.items() if k.endswith(f"/{WEIGHT_KEY}")) or 1.0
        noise = self.cfg.aggregator.noise
        gen = rng.torch_generator(self.cfg.seed, f"aggregator-noise/{phase}", round) if noise else None
        mean = noised_entries(total, references, noise, gen, divide=weight)
        return in_sum_form(mean, references, max(count, 1)), {}

    def aggregate(self, results: Mapping[int, ClientResult], references: Mapping[str, Mapping[str, torch.Tensor]],
                  round: int, phase: str) -> tuple[dict[str, torch.Tensor], dict[str, float], dict[int, dict]]:
        """The round's updates, the malicious ones crafted, combined by the defence: the aggregate in the upload's
        summed form, the round's columns and each client's (kept)."""
        ids = sorted(results)
        if not ids:
            return in_sum_form({}, references, 1), {}, {}
        keys = sorted(results[ids[0]].payload)
        like = results[ids[0]].payload
        rows = stack([results[c].payload for c in ids], keys)
        weights = torch.tensor([float(results[c].weight) for c in ids], dtype=torch.float64)
        bad = [i for i, c in enumerate(ids) if c in self.malicious]
        columns: dict[str, float] = {"attack/attackers": float(len(bad))}
        a, g = self.cfg.attack, self.cfg.aggregator
        if self.model_attack and bad:
            own = rows[bad]
            reference = rows if a.knowledge == "omniscient" else own
            needs_spread = a.kind == "alie" or (a.kind in ("min_max", "min_sum") and a.perturbation == "std")
            if needs_spread and reference.shape[0] < 2:  # one colluder alone has no std to hide in: it sends its own
                columns["attack/crafted"] = 0.0
            else:
                gen = rng.torch_generator(self.cfg.seed, f"attack-noise/{phase}", round)
                crafted, info = attacks.craft(a.kind, own, reference, len(ids), scale=a.scale, sigma=a.sigma,
                                              z=a.z, perturbation=a.perturbation, epsilon=a.epsilon, generator=gen)
                rows[bad] = crafted.to(torch.float64)
                columns.update({"attack/crafted": 1.0, **info})
        norms = rows.norm(dim=1)
        problem = robust.requirement(g.name, len(ids), g.f, g.beta)
        if problem:  # fewer arrived than the rule needs: the round leaves the model where it was
            columns.update({"aggregator/skipped": 1.0, "aggregator/kept": 0.0, "aggregator/kept_malicious": 0.0})
            dropped = {c: {"kept": False, "update_norm": float(norms[i])} for i, c in enumerate(ids)}
            return in_sum_form({}, references, len(ids)), columns, dropped
        noise_gen = rng.torch_generator(self.cfg.seed, f"aggregator-noise/{phase}", round) if g.noise else None
        center = self.center if self.center is not None and self.center.numel() == rows.shape[1] else None
        out = robust.aggregate(g.name, rows, weights, g.f, m=g.m, beta=g.beta, nu=g.nu, max_iter=g.max_iter,
                               ftol=g.ftol, bound=g.bound, noise=g.noise, generator=noise_gen, tau=g.tau,
                               iterations=g.iterations, center=center,
                               root=flatten(self.root, keys) if self.root is not None else None)
        if g.name == "centered_clip":
            self.center = out.aggregate.clone()
        kept = out.kept.tolist()
        columns.update({"aggregator/skipped": 0.0, "aggregator/kept": float(sum(kept)),
                        "aggregator/kept_malicious": float(sum(kept[i] for i in bad))})
        columns.update({f"aggregator/{k}": float(v) for k, v in out.info.items()})
        per = {c: {"kept": bool(kept[i]), "update_norm": float(norms[i])} for i, c in enumerate(ids)}
        return in_sum_form(unflatten(out.aggregate, like, keys), references, len(ids)), columns, per

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the defence: centred clipping's centre."""
        return {} if self.center is None else {"center": self.center}

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        self.center = state.get("center")


def in_sum_form(aggregate: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
                count: int) -> dict[str, torch.Tensor]:
    """A robust aggregate (a mean update) as the summed upload of the `count` updates it stands for: entries
    count·(reference + aggregate), weight count. A method that divides by the weight reads reference + aggregate;
    one that reads the sum itself (SCAFFOLD's control variates, Σ dc / N) reads count·aggregate, the sum the mean
    implies."""
    return as_upload({k: count * v for k, v in aggregate.items()}, references, float(count))


def build_robustness(cfg: RunConfig, data: Any = None) -> Robustness | None:
    """The run's robustness stages, or None when it has neither an attack nor a defence. `data`: the run's Dataset
    (fedsim.data), whose classes and normalisation the data attacks need."""
    if cfg.attack.kind == "none" and cfg.aggregator.name == "mean":
        return None
    out = Robustness(cfg, malicious_clients(cfg))
    if data is not None:
        check_classes(cfg, data.num_classes)
        out.num_classes, out.mean, out.std = data.num_classes, data.mean, data.std
        if cfg.attack.kind == "backdoor":
            x = np.asarray(data.x_train)
            if x.ndim != 4:
                raise ConfigError(f"attack.kind: backdoor puts a pixel pattern on images, and {cfg.data.name} holds "
                                  "none")
            # a pixel's raw value grows with its normalised one (std > 0): each channel's largest, raw
            top = x.max(axis=(0, 2, 3)).astype(np.float64) if x.size else np.zeros(x.shape[1])
            out.raw_max = float(np.max(top * np.broadcast_to(np.asarray(data.std, dtype=np.float64), top.shape)
                                       + np.broadcast_to(np.asarray(data.mean, dtype=np.float64), top.shape)))
    return out

