"""Asynchronous FL's authoring kit: staleness weights, what one arrival tells the server step, the config check.

In `participation.mode: async` (fedsim.runtime.async_run) clients train from the server version current when they
were dispatched and arrive one at a time on the virtual clock; the server step sees each arrival alone, as an
`Arrival` (a RoundInfo that adds the update's staleness), and says in its metrics whether it made a new version.
Staleness counts server versions, as FLSim, FedScale and Plato do: the version at apply minus the version at
dispatch. Only methods built for it (subclasses of `AsyncAlgorithm`) run asynchronously: a synchronous server step
aggregates a round's whole cohort, which never exists when clients arrive one by one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from fedsim.config.knobs import knob
from fedsim.errors import AlgorithmError, ConfigError
from fedsim.method.contract import Algorithm, Broadcast, Env, Phase, RoundInfo, get_algorithm
from fedsim.method.toolkit import GlobalModels, init_global_models

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

NEW_VERSION = "new_version"  # a server-step metric: 1 when the step made a new server version, else 0
ASYNC_COLUMNS = {"staleness_mean": "an async version's applied updates' mean staleness (server versions between "
                                   "their dispatch and their arrival)",
                 "staleness_max": "an async version's largest staleness among its applied updates"}
"""rounds.parquet columns of an async run that a reproduce table may show (docs/async.md)."""
Staleness = Literal["constant", "polynomial", "hinge"]


def staleness_weight(kind: str, staleness: int, a: float, b: float) -> float:
    """s(staleness) of FedAsync (Xie et al. 2019): constant 1; polynomial (1 + s)^−a; hinge 1 for s ≤ b, else
    1/(a·(s − b) + 1). FedBuff's default 1/√(1 + s) is the polynomial with a = 0.5."""
    if staleness < 0:
        raise ValueError(f"staleness must be >= 0, got {staleness}")
    if kind == "constant":
        return 1.0
    if kind == "polynomial":
        return float((staleness + 1.0) ** -a)
    if kind == "hinge":
        return 1.0 if staleness <= b else 1.0 / (a * (staleness - b) + 1.0)
    raise ValueError(f"staleness function must be constant, polynomial or hinge, got {kind!r}")


@dataclass
class StalenessParams:
    """The staleness knobs the async methods share (FedAsync's s(·); FedBuff's weight of a buffered update)."""

    staleness: Staleness = knob("polynomial", doc="s(staleness): constant (1), polynomial ((1+s)^-a) or hinge "
                                                  "(1 for s <= b, else 1/(a(s-b)+1)); s counts server versions")
    a: float = knob(0.5, gt=0, doc="exponent of polynomial, slope of hinge (the papers: 0.5, and 10 for hinge)")
    b: float = knob(4.0, ge=0, doc="hinge: staleness up to b weighs 1 (FedAsync's paper: 4)")

    def weight(self, staleness: int) -> float:
        return staleness_weight(self.staleness, staleness, self.a, self.b)


@dataclass
class Arrival(RoundInfo):
    """One client's upload as the async server step sees it: `round` is the server version it is applied to,
    `participants` and `arrived` name the one client."""

    staleness: int = 0  # server versions between the client's dispatch and this apply
    start_version: int = 0  # the version the client trained from
    time: float = 0.0  # virtual seconds at the arrival


def arrival(info: RoundInfo) -> Arrival:
    """The Arrival an async server step was given; an AlgorithmError when a synchronous round called it."""
    if not isinstance(info, Arrival):
        raise AlgorithmError(f"an async method's server step got a synchronous round's {type(info).__name__} "
                             "(participation.mode: async runs it)")
    return info


class AsyncAlgorithm(Algorithm):
    """Base of the methods built for async mode: one phase, `reduce="each"`, whose server step takes one `Arrival`
    at a time and reports NEW_VERSION in its metrics. Their clients keep no state (any worker may train any)."""

    @classmethod
    def stateless_clients(cls, cfg: RunConfig) -> bool:
        return True

    @classmethod
    def check_async(cls, cfg: RunConfig, concurrency: int) -> None:
        """A ConfigError for this method's parameters that do not fit `concurrency` clients in flight."""

    def init_server(self, env: Env) -> GlobalModels:
        return GlobalModels(models=init_global_models(env))

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "each", local_training=True)]

    def broadcast(self, phase: Phase, state: GlobalModels, info: RoundInfo) -> Broadcast:
        """The global models, which each dispatched client trains from."""
        return Broadcast(common=state.models)


def concurrency(cfg: RunConfig) -> int:
    """C, the clients in flight: participation.concurrency, else the synchronous cohort size."""
    from fedsim.config.schema import clients_per_round

    c = cfg.participation.concurrency
    return c if c is not None else clients_per_round(cfg)


def check_mode(cfg: RunConfig) -> None:
    """The config checks of participation.mode: methods built for one mode refuse the other, and async mode refuses
    what it cannot simulate; each a one-line ConfigError naming the key."""
    p, name = cfg.participation, cfg.algorithm.name
    cls = get_algorithm(name)
    if p.mode == "sync":
        if issubclass(cls, AsyncAlgorithm):
            raise ConfigError(f"algorithm.name: {name} is asynchronous; set participation.mode: async")
        if p.concurrency is not None:
            raise ConfigError("participation.concurrency: only async mode has clients in flight (participation.mode: "
                              "async); a synchronous round samples participation.clients_per_round")
        return
    if not issubclass(cls, AsyncAlgorithm):
        raise ConfigError(f"participation.mode: async cannot run {name}: its server step aggregates a whole round's "
                          "cohort, which never exists when clients arrive one at a time; use fedasync or fedbuff")
    n, c = cfg.data.num_clients, concurrency(cfg)
    if c > n:
        raise ConfigError(f"participation.concurrency: {c} clients in flight exceeds data.num_clients={n}")
    if p.sampling != "fixed":
        raise ConfigError("participation.sampling: async mode draws one client per arrival; use fixed")
    for key, value, default in (("privacy.level", cfg.privacy.level, "none"),
                                ("privacy.secure_aggregation", cfg.privacy.secure_aggregation, "none"),
                                ("attack.kind", cfg.attack.kind, "none"), ("aggregator.name", cfg.aggregator.name,
                                                                           "mean")):
        if value != default:
            raise ConfigError(f"{key}: {value!r} is not simulated in async mode (updates are applied one by one); "
                              f"use {default}")
    if cfg.train.keep_optimizer_state:
        raise ConfigError("train.keep_optimizer_state: async clients keep no state between dispatches")
    cls.check_async(cfg, c)

