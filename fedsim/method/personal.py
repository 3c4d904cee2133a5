"""Personalised FL, written once: split a model into shared and personal entries, average the shared ones, and
score every client's personal model on its own test shard.

A split names parameter-name prefixes (`fc` names `fc.weight`, `fc.bias`); `split_keys` turns them into the
state-dict keys they cover, refusing a split that names no entry of the model or all of them. `PersonalServer`
is the server state of the personal methods (FedPer, FedRep, FedBN, LG-FedAvg, Ditto, APFL, Per-FedAvg,
FedAvg fine-tuned): the full model per architecture (its shared entries averaged each round, its personal ones
left at their initial values, so it is what a client that has never trained starts from) and every client's
latest personal score; `PersonalMethod` is their server side.

The personal columns of rounds.parquet (`personal_columns`): each client counts once, with the latest score of its
personal model on its own shard. Where that model moves while the client sits rounds out (`rescores`: the split
methods, whose personal model is the server's current shared entries with the client's own, and Per-FedAvg, a
one-step fine-tune of the current global model), every client that has
trained is re-scored before each evaluation by an evaluation-only phase (`measurement`, run on the workers that hold
the clients' states; no bytes, no virtual time); elsewhere (Ditto, APFL: the personal model changes only when its
client trains) the score is the one the client got at the end of the last round it trained, which is exact. A
client that has never trained reports the server model's accuracy on its shard and is counted in
`personal_never_trained` (every client is, where the personal model is the server's: `personal_is_global`). The
mean is over clients, not samples; `personal_accuracy_p10` is the mean of the worst tenth (at least one client).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedsim import rng
from fedsim.errors import ConfigError
from fedsim.method.aggregate import weighted_average
from fedsim.method.contract import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    Message,
    Phase,
    RoundInfo,
)
from fedsim.method.toolkit import State, evaluate_models, evaluation_model, init_global_models, new_model, seeded_model
from fedsim.persist.checkpoint import register_state
from fedsim.training.train import evaluate_classifier, predict_logits, train_classifier

BN_TYPES = (torch.nn.BatchNorm1d, torch.nn.BatchNorm2d, torch.nn.BatchNorm3d)


def require_client_test(env: Env, method: str, hint: str = "") -> None:
    """Personal models are scored on personal test shards; refuse to run without them."""
    if env.config.data.client_test == "none":
        raise ConfigError(f"data.client_test: {method} scores each personal model on its own test shard; "
                          f"set it to 'balanced'{hint}, 'proportional' or 'natural'")


def head_prefixes(model: torch.nn.Module) -> list[str]:
    """The classifier head: the module that owns the model's last parameter (`fc` for the built-in models)."""
    names = [n for n, _ in model.named_parameters()]
    return [names[-1].rpartition(".")[0]] if names else []


def covers(key: str, prefixes: Iterable[str]) -> bool:
    """Whether state-dict `key` lies under one of `prefixes` (a whole dotted component: `fc` is not `fc2`)."""
    return any(key == p or key.startswith(p + ".") for p in prefixes)


def blank(env: Env, arch: str) -> torch.nn.Module:
    """An instance of `arch` to read names from (torch's RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        return new_model(env, arch)


def all_keys(env: Env, arch: str) -> list[str]:
    """Every state-dict key of `arch`."""
    return list(blank(env, arch).state_dict())


def split_keys(env: Env, arch: str, prefixes: Sequence[str], config_key: str) -> frozenset[str]:
    """The state-dict keys of `arch` under `prefixes` (default: the classifier head); a ConfigError naming
    `config_key` when they cover no entry of the model or every one."""
    model = blank(env, arch)
    chosen = list(prefixes) or head_prefixes(model)
    keys = list(model.state_dict())
    inside = frozenset(k for k in keys if covers(k, chosen))
    if not inside:
        raise ConfigError(f"{config_key}: {list(chosen)} names no layer of model {arch!r} (its layers: "
                          f"{sorted({k.rpartition('.')[0] for k in keys})[:12]})")
    if len(inside) == len(keys):
        raise ConfigError(f"{config_key}: {list(chosen)} names every layer of model {arch!r}; nothing would be "
                          "shared")
    return inside


def batchnorm_keys(env: Env, arch: str, config_key: str) -> frozenset[str]:
    """The state-dict keys of `arch`'s BatchNorm layers (weights, biases and running statistics); a ConfigError
    naming `config_key` when the model has none."""
    model = blank(env, arch)
    mods = [n for n, m in model.named_modules() if isinstance(m, BN_TYPES)]
    if not mods:
        raise ConfigError(f"{config_key}: model {arch!r} has no BatchNorm layer, so FedBN would be FedAvg; "
                          "choose a model with BatchNorm (e.g. resnet8)")
    return frozenset(k for k in model.state_dict() if covers(k, mods))


def keep(state: Mapping[str, torch.Tensor], keys: Iterable[str], inside: bool = True) -> State:
    """The entries of `state` in `keys` (or, `inside=False`, the others), as CPU copies."""
    ks = set(keys)
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items() if (k in ks) == inside}


def initial_state(ctx: ClientContext) -> Mapping[str, torch.Tensor]:
    """The run's initial model of the client's architecture (stream "init/<arch>", as the server's), which gives a
    client's personal entries before it first trains; built once per worker."""
    model = ctx.models.get(f"personal/init/{ctx.arch}", lambda: seeded_model(
        ctx.env, ctx.arch, rng.seed(ctx.env.config.seed, f"init/{ctx.arch}")))
    return model.state_dict()


def start_state(ctx: ClientContext, shared: Mapping[str, torch.Tensor], own: Mapping[str, torch.Tensor] | None
                ) -> dict[str, torch.Tensor]:
    """The client's model: the broadcast shared entries with its own personal ones (initial ones before it trains)."""
    base = dict(initial_state(ctx))
    base.update(shared)
    if own:
        base.update(own)
    return base


def test_shard(ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The client's own test inputs and labels; a ConfigError when the run gives clients none."""
    d = ctx.data
    if d.x_test is None or d.y_test is None:
        raise ConfigError("data.client_test: this method needs personal test shards ('balanced', 'proportional' or "
                          "'natural')")
    return d.x_test, d.y_test


def score(model: torch.nn.Module, ctx: ClientContext) -> dict[str, float]:
    """Accuracy and loss of a personal model on the client's own test shard (with its size)."""
    x_test, y_test = test_shard(ctx)
    m = evaluate_classifier(model, x_test, y_test, ctx.env.config.eval.batch_size)
    return {"personal_accuracy": m["accuracy"], "personal_loss": m["loss"], "test_samples": float(len(y_test))}


def average_each(updates: Mapping[int, ClientResult], archs: Sequence[str], previous: Mapping[str, State]
                 ) -> dict[str, State]:
    """The server model of each architecture with the entries its clients uploaded (each payload a dict of some of
    its entries) replaced by their weighted mean; architectures nobody trained keep theirs."""
    out = {a: dict(s) for a, s in previous.items()}
    for arch in previous:
        mine = {c: r for c, r in updates.items() if archs[c] == arch}
        if mine:
            avg = weighted_average({c: r.payload for c, r in mine.items()}, {c: r.weight for c, r in mine.items()})
            out[arch].update({k: v.to(previous[arch][k].dtype) for k, v in avg.items()})
    return out


def worst_mean(values: Sequence[float], fraction: float = 0.1) -> float:
    """The mean of the lowest `fraction` of `values` (at least one of them)."""
    k = max(1, math.ceil(fraction * len(values)))
    return float(sum(sorted(values)[:k]) / k)


def shard_accuracies(env: Env, arch: str, weights: Mapping[str, torch.Tensor], clients: Sequence[int],
                     device: torch.device) -> dict[int, float]:
    """The accuracy of one model on each of `clients`' own test shards, computed on the server from the partition
    (one pass over the test set for index shards; generated shards are drawn client by client)."""
    part = env.extras.get("partition")
    data = env.extras.get("server_data")
    if part is None or not clients:
        return {}
    model = evaluation_model(env, arch, weights, device)
    bs = env.config.eval.batch_size
    with torch.no_grad():
        return _shard_accuracies(part, data, model, clients, device, bs)


def _shard_accuracies(part: Any, data: Any, model: torch.nn.Module, clients: Sequence[int], device: torch.device,
                      bs: int) -> dict[int, float]:
    """shard_accuracies' work: the partition's index shards into the server's test set, or drawn generated shards."""
    test = getattr(part, "test", None)
    if test is not None and data is not None:
        x = torch.as_tensor(data.x_test, device=device)
        y = torch.as_tensor(data.y_test, device=device)
        right = (predict_logits(model, x, bs).argmax(1) == y).double().cpu()
        out = {}
        for c in clients:
            idx = torch.as_tensor(test[c], dtype=torch.long)
            out[c] = float(right[idx].mean()) if len(idx) else math.nan
        return out
    if hasattr(part, "shard"):
        out = {}
        for c in clients:
            xs, ys = part.shard(c)[4:6]
            if len(ys):
                m = evaluate_classifier(model, torch.as_tensor(xs, device=device), torch.as_tensor(ys, device=device),
                                        bs)
                out[c] = m["accuracy"]
        return out
    return {}


@register_state
@dataclass
class PersonalServer:
    """Server state of a personal method: each architecture's server model and each client's latest personal score
    (accuracy, loss, test samples) by client id."""

    models: dict[str, State] = field(default_factory=dict)
    scores: dict[int, tuple[float, float, float]] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)

    def recorded(self, updates: Mapping[int, ClientResult]) -> dict[int, tuple[float, float, float]]:
        """The scores with those the arrived clients report."""
        new = dict(self.scores)
        for cid, res in updates.items():
            m = res.metrics
            if "personal_accuracy" in m:
                new[int(cid)] = (float(m["personal_accuracy"]), float(m["personal_loss"]), float(m["test_samples"]))
        return new


def personal_columns(env: Env, state: PersonalServer, device: torch.device, server_scores_all: bool = False
                     ) -> dict[str, float]:
    """personal_accuracy_mean and _p10 over every client (never-trained ones at the server model's accuracy on
    their shard; every client so when `server_scores_all`: the personal model is the server's), and the counts
    personal_never_trained and personal_trained."""
    n = len(env.client_archs)
    accs = {c: s[0] for c, s in state.scores.items()}
    never = [c for c in range(n) if c not in accs]
    for arch in env.archs:
        mine = [c for c in (range(n) if server_scores_all else never) if env.client_archs[c] == arch]
        accs.update({c: a for c, a in shard_accuracies(env, arch, state.models[arch], mine, device).items()
                     if not math.isnan(a)})
    values = [accs[c] for c in sorted(accs)]
    out = {"personal_never_trained": float(len(never)), "personal_trained": float(n - len(never))}
    if values:
        out.update(personal_accuracy_mean=float(sum(values) / len(values)), personal_accuracy_p10=worst_mean(values))
    return out


class PersonalMethod(Algorithm):
    """The server side of the personal methods, and their client's bookkeeping. One phase a round, `reduce="each"`:
    the broadcast holds each architecture's shared entries, every client uploads its trained shared entries (and
    reports its personal score), and the server replaces the shared entries by their sample-weighted mean.

    A subclass says which entries stay at the clients (`personal_keys`; none: the whole model is averaged), whether
    the server model is a global model worth scoring on the test set (`global_model`), and trains its clients in
    `local_training` (a plan: batchable) or `client_step`."""

    global_model: ClassVar[bool] = False  # rounds.parquet gets the server model's test accuracy too
    mechanism_columns: ClassVar[dict[str, str]] = {
        "train/mech_personal_gain": "mean over the round's clients of their personal model's accuracy on their own "
                                    "test shard minus that of the model they started the round from (the received "
                                    "global model, or for split models the received shared entries with their own "
                                    "personal ones): what the round's personalisation adds on the client's own data",
    }

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        self.personal: dict[str, frozenset[str]] = {}
        if env is None:  # built without a run (the config checks read phases only)
            return
        require_client_test(env, self.name)
        self.personal = {arch: self.personal_keys(env, arch) for arch in env.archs}

    def personal_keys(self, env: Env, arch: str) -> frozenset[str]:
        """The state-dict keys of `arch` each client keeps to itself (default: none)."""
        return frozenset()

    def personal_is_global(self) -> bool:
        """Whether every client's personal model is the server's model, so the server scores all of them on their
        shards each evaluation, not only those who never trained (FedAvg's global model as a reference)."""
        return False

    def init_server(self, env: Env) -> PersonalServer:
        return PersonalServer(models=init_global_models(env))

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "each", local_training=type(self).local_training is not Algorithm.local_training)]

    def broadcast(self, phase: Phase, state: PersonalServer, info: RoundInfo) -> Broadcast:
        return Broadcast(common={a: {k: v for k, v in m.items() if k not in self.personal.get(a, ())}
                                 for a, m in state.models.items()})

    # ------------------------------------------------------------- re-scoring
    def rescores(self) -> bool:
        """Whether a client's personal model moves when it does not train, so every client that has trained is
        re-scored at each evaluation (`rescore`): the split methods, whose personal model is the server's current
        shared entries with the client's own (Per-FedAvg overrides it). Ditto and APFL keep exact scores (their
        personal model changes only when the client trains) and skip the pass."""
        return any(self.personal.values())

    def rescore(self, ctx: ClientContext, shared: Mapping[str, torch.Tensor], state: dict[str, Any] | None
                ) -> torch.nn.Module | None:
        """The client's personal model at an evaluation, from the server model's shared entries (`shared`, of the
        client's architecture) and the client's state; None keeps its last score. Default, for the split methods:
        the shared entries with the client's own personal ones (initial ones if its state was lost)."""
        if not self.personal.get(ctx.arch):
            return None
        return loaded(ctx, "personal/rescore", start_state(ctx, shared, (state or {}).get("personal")))

    def measurement(self, state: PersonalServer) -> tuple[Phase, list[int]] | None:
        """Re-score, before each evaluation, every client that has trained (its score is in the state), where the
        method `rescores`."""
        if not self.rescores():
            return None
        return Phase("rescore", "each", broadcast="rescore_broadcast", client="rescore_client",
                     server="rescore_server", measure=True), sorted(state.scores)

    def rescore_broadcast(self, state: PersonalServer, info: RoundInfo) -> Broadcast:
        """The server model's shared entries, as a round's broadcast holds them."""
        return self.broadcast(Phase("rescore"), state, info)

    def rescore_client(self, state: dict[str, Any] | None, msg: Message, ctx: ClientContext) -> ClientResult:
        """The score of the client's personal model now (`rescore`) on its own test shard; nothing goes up."""
        model = self.rescore(ctx, msg.common[ctx.arch], state)
        return ClientResult(metrics=score(model, ctx) if model is not None else {})

    def rescore_server(self, state: PersonalServer, updates: dict[int, ClientResult], info: RoundInfo
                       ) -> tuple[PersonalServer, dict[str, Any]]:
        """The scores with the re-scored clients' new ones."""
        return PersonalServer(models=state.models, scores=state.recorded(updates), extra=state.extra), {}

    def server_step(self, phase: Phase, state: PersonalServer, updates: dict[int, ClientResult],
                    info: RoundInfo) -> tuple[PersonalServer, dict[str, Any]]:
        models = average_each(updates, self.env.client_archs, state.models)
        scores = state.recorded(updates)
        got = [scores[c][0] for c in updates if c in scores]
        metrics = {"personal_accuracy_clients": float(sum(got) / len(got))} if got else {}
        gains = [r.metrics["personal_accuracy"] - r.metrics["mech_start_accuracy"] for r in updates.values()
                 if "mech_start_accuracy" in r.metrics]
        if gains:
            metrics["mech_personal_gain"] = float(sum(gains) / len(gains))
        return PersonalServer(models=models, scores=scores, extra=state.extra), metrics

    def evaluate(self, state: PersonalServer, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        cols = personal_columns(self.env, state, device, self.personal_is_global())
        if not self.global_model:
            return [{"model": "personal", **cols}]
        return [{**row, **cols} for row in evaluate_models(self.env, state.models, x_test, y_test, device)]

    # ---------------------------------------------------------------- client
    def upload(self, ctx: ClientContext, model: torch.nn.Module, metrics: dict[str, float],
               state: dict[str, Any] | None, personal: torch.nn.Module | None = None,
               start: Mapping[str, torch.Tensor] | None = None) -> ClientResult:
        """The client's result: the trained shared entries up, its personal entries kept (with `state`'s other
        entries), and the score of its personal model (`personal`, default the trained model) on its own shard;
        with eval.mechanism, also the score of the model it started from (`start`), for mech_personal_gain."""
        sd = model.state_dict()
        own = self.personal.get(ctx.arch, frozenset())
        kept = dict(state or {})
        if own:
            kept["personal"] = keep(sd, own)
        scored = score(personal if personal is not None else model, ctx)
        if start is not None and ctx.env.config.eval.mechanism:
            scored["mech_start_accuracy"] = score(loaded(ctx, "personal/start", start), ctx)["personal_accuracy"]
        return ClientResult(payload=keep(sd, own, inside=False), weight=float(ctx.data.num_samples),
                            metrics={**metrics, **scored}, state=kept or None)


def train_only(model: torch.nn.Module, trainable: Iterable[str], x: torch.Tensor, y: torch.Tensor, train: Any,
               generator: torch.Generator, epochs: int, steps: int | None = None, **options: Any
               ) -> dict[str, float]:
    """`epochs` epochs (or `steps` batches) of `train_classifier` with a fresh optimizer on the parameters named in
    `trainable`, the others frozen (no gradient, so SGD leaves them, weight decay included); flags restored after."""
    if epochs <= 0 and not steps:
        return {}
    names = set(trainable)
    flags = {n: p.requires_grad for n, p in model.named_parameters()}
    try:
        for n, p in model.named_parameters():
            p.requires_grad_(n in names)
        cfg = dataclasses.replace(train, epochs=epochs, steps=steps)
        return train_classifier(model, x, y, cfg, generator, **options)
    finally:
        for n, p in model.named_parameters():
            p.requires_grad_(flags[n])


def loaded(ctx: ClientContext, role: str, weights: Mapping[str, torch.Tensor]) -> torch.nn.Module:
    """A worker-reused instance of the client's architecture for `role` (a second model: Ditto's, APFL's personal
    one), holding `weights`."""
    model = ctx.models.get(f"{role}/{ctx.arch}", lambda: blank(ctx.env, ctx.arch).to(ctx.device))  # RNG untouched
    model.load_state_dict(weights)
    return model


def replace_epochs(train: Any, epochs: int) -> Any:
    """The run's train settings with `epochs` epochs (and no step count)."""
    return dataclasses.replace(train, epochs=epochs, steps=None)


def mixture(v: torch.nn.Module, w: torch.nn.Module, alpha: float) -> State:
    """The state αv + (1−α)w on floating-point entries (v's integer buffers as they are)."""
    sw = w.state_dict()
    return {k: (alpha * t + (1 - alpha) * sw[k]).detach() if t.is_floating_point() else t.detach()
            for k, t in v.state_dict().items()}
