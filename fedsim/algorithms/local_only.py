"""Baseline (local training only), the lower bound of Banerjee 2022 (FedGDKD thesis, §5.1, Table 5.2).

Every client trains its own classifier on its own data; nothing is communicated. [C] The author's code
pre-trains 15 epochs on the private data before round 1, then trains n epochs per round (train.epochs),
with all clients every round. Subclasses add a shared pool of client data (local_shared, centralised):
in round 0 a `share` phase uploads a seeded fraction of each participant's data, the server pools the
shares in client-id order and sends the pool once to each client, which keeps it in its personal state.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch

from fedsim.algorithms._personal import (
    PersonalScores,
    init_seed,
    pool,
    require_client_test,
    score,
    share_sample,
    with_model,
)
from fedsim.config.limits import MAX_EPOCHS
from fedsim.method import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientResult,
    Env,
    LocalTraining,
    Message,
    Phase,
    RoundInfo,
    Stage,
    knob,
    register_algorithm,
    register_state,
    seeded_model,
    train_classifier,
)


@dataclass
class LocalOnlyParams:
    pretrain_epochs: int = knob(15, ge=0, le=MAX_EPOCHS, doc="[C] epochs on the private data before the first round")


@register_state
@dataclass
class PoolState:
    """Server state of the personal baselines: the shared pool (if any), who holds it, and the scores."""

    pool: dict[str, torch.Tensor] = field(default_factory=dict)
    has_pool: list[int] = field(default_factory=list)
    scores: PersonalScores = field(default_factory=PersonalScores)
    extra: dict[str, Any] = field(default_factory=dict)


def pool_data(state: dict | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The shared pool a client keeps in its personal state, if it has received one."""
    if state is None or "pool_x" not in state:
        return None
    return state["pool_x"], state["pool_y"]


@register_algorithm
class LocalOnly(Algorithm):
    """Train the personal model on private data only; upload nothing."""

    name = "local_only"
    Params: ClassVar[type] = LocalOnlyParams  # any params class: subclasses bring their own

    def __init__(self, params: Any, env: Env) -> None:
        super().__init__(params, env)
        require_client_test(env, self.name)

    @property
    def share_fraction(self) -> float:
        """The fraction of each client's private data pooled and shared in round 0 (none here)."""
        return 0.0

    def init_server(self, env: Env) -> PoolState:
        return PoolState()

    def phases(self, round: int) -> list[Phase]:
        share = Phase("share", "each", client="share_client", server="share_server")
        work = Phase("train", "each", broadcast="send_pool", server="train_server", local_training=True)
        return ([share] if round == 0 and self.share_fraction > 0 else []) + [work]

    def pool_messages(self, state: PoolState, info: RoundInfo) -> dict[int, Any] | None:
        """The pool for participants that do not hold it yet (sent once per client)."""
        if not state.pool:
            return None
        held = set(state.has_pool)
        return {c: {"pool": state.pool} for c in info.participants if c not in held} or None

    def send_pool(self, state: PoolState, info: RoundInfo) -> Broadcast:
        return Broadcast(common=None, per_client=self.pool_messages(state, info))

    def share_server(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        shared = pool(updates)
        return dataclasses.replace(state, pool=shared), {"pool_samples": float(len(shared.get("y", [])))}

    def train_server(self, state: PoolState, updates: dict[int, ClientResult], info: RoundInfo) -> tuple[Any, dict]:
        held = sorted(set(state.has_pool) | (set(updates) if state.pool else set()))
        scores = state.scores.record(updates)
        return dataclasses.replace(state, has_pool=held, scores=scores), scores.summary(sorted(updates))

    def evaluate(self, state: PoolState, x_test: torch.Tensor, y_test: torch.Tensor,
                 device: torch.device) -> list[dict[str, Any]]:
        return state.scores.rows()

    # ---------------------------------------------------------------- client
    def receive_pool(self, state: dict | None, msg: Message) -> dict | None:
        """The client's state with a newly received pool stored in it."""
        if msg.own and "pool" in msg.own:
            p = msg.own["pool"]
            return {**(state or {}), "pool_x": p["x"], "pool_y": p["y"]}
        return state

    def training_set(self, state: dict | None, ctx: ClientContext) -> tuple[torch.Tensor, torch.Tensor]:
        """Private data plus the shared pool ([C]: shares are not removed from their owners' data)."""
        shared = pool_data(state)
        if shared is None:
            return ctx.data.x, ctx.data.y
        dev = ctx.data.x.device
        return torch.cat([ctx.data.x, shared[0].to(dev)]), torch.cat([ctx.data.y, shared[1].to(dev)])

    def epochs(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, epochs: int,
               ctx: ClientContext, gen: torch.Generator) -> dict[str, float]:
        """`epochs` epochs of plain CE with the run's train settings (a fresh optimizer each call)."""
        if epochs <= 0:
            return {}
        tr = dataclasses.replace(ctx.env.config.train, epochs=epochs, steps=None)
        return train_classifier(model, x, y, tr, gen)

    def share_client(self, state: dict | None, msg: Message, ctx: ClientContext) -> ClientResult:
        return ClientResult(share_sample(ctx, self.share_fraction), float(ctx.data.num_samples))

    def training(self, state: dict | None, msg: Message, ctx: ClientContext) -> LocalTraining:
        """The train phase's client step: pre-training on a client's first visit, then the round's epochs on the
        private data (and pool), one generator throughout; then score the personal model and keep it."""
        state = self.receive_pool(state, msg)
        x, y = self.training_set(state, ctx)
        first = state is None or "model" not in state
        if state is not None and "model" in state:
            start = state["model"]
        else:  # the first visit: the client's own seeded initial weights
            start = seeded_model(ctx.env, ctx.arch, init_seed(ctx.env.config.seed, ctx.client_id)).state_dict()
        stages = ((Stage(self.params.pretrain_epochs, prefix="pretrain_"),) if first else ()) + \
            (Stage(ctx.env.config.train.epochs),)

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            metrics = {**metrics, **score(model, ctx)}
            return ClientResult(None, float(ctx.data.num_samples), metrics, with_model(state, model))

        return LocalTraining.of(ctx, start, finish, x=x, y=y, stages=tuple(s for s in stages if s.epochs > 0))

    def local_training(self, phase: Phase, state: dict | None, msg: Message,
                       ctx: ClientContext) -> LocalTraining | None:
        return self.training(state, msg, ctx) if phase.local_training else None
