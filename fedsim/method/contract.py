"""The Algorithm interface: a round is an ordered list of phases, each broadcast -> client step -> server step.

An algorithm owns both sides of a round; the runtime (local or Ray) only moves messages, keeps client
state in the worker that owns the client, and records what happened. Everything here is plain data
(dataclasses of tensors/arrays), so states and messages pickle, checkpoint with `torch.save` and cross
process boundaries unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar, overload

import numpy as np
import torch

from fedsim import registry, rng
from fedsim.errors import AlgorithmError, ConfigError
from fedsim.method.client_archs import ClientArchs

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.models import Classifier
    from fedsim.training.dpsgd import DPSGD
    from fedsim.training.local import LocalTraining

Reduce = Literal["each", "sum"]
M = TypeVar("M", bound=torch.nn.Module)


@dataclass(frozen=True)
class Phase:
    """One exchange of a round, and the methods that handle it.

    `reduce="sum"`: client payloads are dicts of tensors that the server only needs as a weighted sum;
    workers pre-sum them (float64, in client-id order) and send one partial sum. `reduce="each"`: the
    server needs every client's own payload (logits, per-sample weights, LOO teachers ...).

    `broadcast`, `client` and `server` name the algorithm's methods for this phase (names, not functions,
    because phases travel to workers that hold their own Algorithm instance). A method with one phase may
    leave them unset and override the hooks `broadcast`, `client_step` and `server_step` directly.

    `local_training=True` opts the phase in to batching: its client step is the method's `local_training(...)`
    plan, which the worker may train together with other clients of one architecture (`runtime.batch_clients`).
    Such a phase names no client handler, and the class keeps Algorithm's `client_step`: a variant that wraps the
    client step declares its phase without `local_training` (check_phase refuses the mix).

    `model_update=True` (with `reduce="sum"`) says the payload is a model or a model update, relative to what
    `Algorithm.upload_reference` gives: the update chain (fedsim.transforms: DP clipping and noise) then applies to it.

    `measure=True` marks the evaluation-only phase of `Algorithm.measurement`: its handlers are called as named (never
    through overridden hooks), its clients' states are left as they are, and it costs no bytes and no virtual time.
    """

    name: str
    reduce: Reduce = "each"
    broadcast: str | None = None  # (state, info) -> Broadcast; unset: an empty broadcast
    client: str | None = None  # (state, msg, ctx) -> ClientResult
    server: str | None = None  # (state, updates, info) -> (state, metrics)
    local_training: bool = False  # the client step is `Algorithm.local_training(...)`, batchable
    model_update: bool = False  # a "sum" payload that is a model (update): the update chain may clip and noise it
    measure: bool = False  # an evaluation-only phase (Algorithm.measurement), not communication


@dataclass
class Broadcast:
    """What goes down in a phase: `common` is sent once to every worker (one object ref), `per_client`
    holds client-specific payloads (e.g. leave-one-out teachers). Each client receives them as a Message.
    """

    common: Any = None
    per_client: dict[int, Any] | None = None
    chain: dict[str, Any] | None = None  # set by the runtime: the update chain's settings for the round (its clip)

    def for_client(self, client_id: int) -> Any:
        return None if self.per_client is None else self.per_client.get(client_id)


@dataclass(frozen=True)
class Message:
    """What a client step receives: the phase's common part and this client's own part (either may be None)."""

    common: Any = None
    own: Any = None


@dataclass
class ClientResult:
    """What a client step returns.

    payload: what goes up (bytes are counted from it); for `reduce="sum"` a dict of tensors.
    weight: the aggregation weight (usually the client's sample count); must be finite and > 0.
    metrics: scalars for this client's row in clients.parquet (loss, personal accuracy, ...).
    state: the client's new personal state to persist, or None to keep the old one. Algorithms never
      mutate the state they were given: a straggler's dropped round must leave it untouched.
    probe: evaluation-only data for the server's mechanism columns (fedsim.method.mechanism), e.g. the client model's
      logits on the test subset; never counted as traffic nor on the virtual clock, None when
      `eval.mechanism` is off. Reaches the server in `reduce="each"` phases only.
    """

    payload: Any = None
    weight: float = 1.0
    metrics: dict[str, float] = field(default_factory=dict)
    state: dict[str, Any] | None = None
    probe: Any = None


@dataclass
class SummedUpdate:
    """Weighted sum of `reduce="sum"` payloads over the clients that arrived: Σ w_k·p_k, Σ w_k, count."""

    total: dict[str, torch.Tensor]
    weight: float
    count: int

    def mean(self, dtype: torch.dtype = torch.float32) -> dict[str, torch.Tensor]:
        return {k: (v / self.weight).to(dtype) for k, v in self.total.items()}


Updates = SummedUpdate | dict[int, ClientResult]
"""What a server step receives: a SummedUpdate for reduce="sum", else {client_id: ClientResult} sorted by id."""


@dataclass
class ClientData:
    """A client's private data, as tensors on the worker's device (views into the worker's one copy)."""

    x: torch.Tensor
    y: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor | None = None  # personal test shard, where the config asks for one
    y_test: torch.Tensor | None = None

    @property
    def num_samples(self) -> int:
        return int(self.y.shape[0])


@dataclass
class Env:
    """Everything both sides know before the first round: problem shape, the run's config, the device.

    `config` is the whole resolved RunConfig (fedsim.config.schema); algorithms read `config.train`,
    `config.model` and their own `params`.
    """

    config: RunConfig
    params: Any
    num_classes: int
    input_shape: tuple[int, ...]
    mean: tuple[float, ...]
    std: tuple[float, ...]
    client_archs: Sequence[str]  # architecture of each client id (fedsim.method.client_archs.ClientArchs in a run)
    num_samples: np.ndarray  # train samples per client id
    device: torch.device = torch.device("cpu")
    extras: dict[str, Any] = field(default_factory=dict)  # dataset extras (embedding tables, ...)
    evaluation_models: dict[tuple[str, str], Classifier] = field(
        default_factory=dict, init=False, repr=False, compare=False)  # fedsim.method.toolkit.evaluation_model's

    @property
    def archs(self) -> list[str]:
        """Distinct architectures, in first-appearance order."""
        if isinstance(self.client_archs, ClientArchs):
            return self.client_archs.distinct()  # without visiting every registered client
        return list(dict.fromkeys(self.client_archs))


@dataclass
class RoundInfo:
    """What the server step knows about a phase: the round, and which clients took part and arrived."""

    round: int
    phase: str
    participants: list[int]  # sorted client ids that started the round
    arrived: list[int]  # sorted client ids whose result for this phase arrived
    num_samples: dict[int, int]  # train samples of each participant


class Models(Protocol):
    """The worker's module instances, reused by its clients: `get(arch)` is the client architecture's classifier,
    `get(key, build)` any other module, built once by `build`."""

    @overload
    def get(self, key: str) -> Classifier: ...
    @overload
    def get(self, key: str, build: Callable[[], M]) -> M: ...


@dataclass
class ClientContext:
    """What a client step may use besides its state and message."""

    client_id: int
    round: int
    phase: str
    arch: str
    data: ClientData
    device: torch.device
    seed: int  # stream "client" at (round, client id, phase index): the seed of `generator()`
    models: Models  # `models.get(arch)` returns this worker's reused instance
    env: Env
    phase_index: int = 0
    dp_sgd: DPSGD | None = None  # privacy.level sample: pass to train_classifier / LocalTraining (they use it)

    def generator(self, device: torch.device | None = None) -> torch.Generator:
        """A torch generator seeded for this client, round and phase: the one for local training."""
        g = torch.Generator(device=device or "cpu")
        g.manual_seed(self.seed)
        return g

    def stream(self, name: str) -> torch.Generator:
        """Another named stream of this client, round and phase (fedsim.rng), independent of `generator()`."""
        return rng.torch_generator(self.env.config.seed, name, self.round, self.client_id, self.phase_index)


class Algorithm:
    """Base class. Subclasses set `name` and `Params`, and implement the hooks below.

    The hooks:
      init_server(env) -> state            server state: global model(s), generator, ...
      phases(round) -> list[Phase]         the exchanges of this round, in order
      broadcast(phase, state, info) -> Broadcast
      client_step(phase, state, msg: Message, ctx) -> ClientResult     runs inside a worker
      local_training(phase, state, msg, ctx) -> LocalTraining | None   the client step, when it is plain local
        training, as data (workers may then train many clients together)
      server_step(phase, state, updates, info) -> (state, metrics)
        updates is a SummedUpdate for reduce="sum", else {client_id: ClientResult} sorted by id
      evaluate(state, x_test, y_test, device) -> list of rows, one per global model ({"model": name, ...})
    The three middle hooks call the handlers a Phase names; a one-phase method may override them instead.

    The server and every worker each build their own instance (from the same params and Env): nothing
    set on `self` during a round travels between them; what must travel goes in a Broadcast or a
    ClientResult, and what a client keeps goes in its state.
    """

    name: ClassVar[str] = ""
    Params: ClassVar[type] = type(None)
    # The evaluation-only columns (fedsim.method.mechanism) this method's server step reports, as
    # "<phase>/mech_<name>" -> what it measures; docs/mechanism.md is generated from it.
    mechanism_columns: ClassVar[dict[str, str]] = {}

    def __init__(self, params: Any, env: Env) -> None:
        self.params = params
        self.env = env

    def init_server(self, env: Env) -> Any:
        raise NotImplementedError

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "sum")]

    def broadcast(self, phase: Phase, state: Any, info: RoundInfo) -> Broadcast:
        if phase.broadcast is None:
            return Broadcast()
        return self.handler(phase, "broadcast")(state, info)

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message, ctx: ClientContext) -> ClientResult:
        """The phase's client handler; for a phase that names none, the method's `local_training` plan, run."""
        if phase.client is None:
            plan = self.local_training(phase, state, msg, ctx)
            if plan is not None:
                return plan.run()
        return self.handler(phase, "client")(state, msg, ctx)

    def local_training(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                       ctx: ClientContext) -> LocalTraining | None:
        """A phase's client step as plain local training of a classifier (fedsim.training.local), or None. Where the
        phase names no client handler, `client_step` runs it; where the phase declares `local_training=True`, the
        worker may instead train many clients of one architecture together (`runtime.batch_clients`)."""
        return None

    def upload_reference(self, phase: Phase, common: Any, arch: str) -> dict[str, torch.Tensor]:
        """For a `model_update` phase: what a client of `arch` uploads relative to, by payload key (without the
        `<arch>/` prefix): the client's update is upload − reference. Default: the broadcast model, `common[arch]`;
        a method whose upload holds differences already gives zeros for those entries."""
        return dict(common[arch])

    def server_step(self, phase: Phase, state: Any, updates: Any, info: RoundInfo) -> tuple[Any, dict[str, Any]]:
        """Fold a phase's `updates` into the state. They are one of `Updates`, as `phase.reduce` says; `Any` here so
        that an override names the one its phase gets."""
        return self.handler(phase, "server")(state, updates, info)

    def handler(self, phase: Phase, side: Literal["broadcast", "client", "server"]) -> Callable[..., Any]:
        """The method `phase` names for `side`; a clear error when it names none or one that does not exist."""
        name = getattr(phase, side)
        hook = {"broadcast": "broadcast", "client": "client_step", "server": "server_step"}[side]
        if name is None:
            raise TypeError(f"{type(self).__name__}: phase {phase.name!r} names no {side} handler "
                            f"(set Phase({phase.name!r}, {side}=...) or override {hook})")
        fn = getattr(self, name, None)
        if not callable(fn):
            raise TypeError(f"{type(self).__name__}: phase {phase.name!r} names {side} handler {name!r}, "
                            "which is not a method of the algorithm")
        return fn

    @classmethod
    def check_phase(cls, phase: Phase) -> None:
        """An AlgorithmError for a phase whose handlers this class lacks, raised on the driver before the phase is
        sent, rather than every client failing on it in the workers."""
        if phase.local_training and (phase.client is not None or cls.client_step is not Algorithm.client_step):
            raise AlgorithmError(f"{cls.__name__}: phase {phase.name!r} declares local_training=True, so its client "
                                 "step is local_training(...); it names a client handler or the class overrides "
                                 "client_step (override local_training instead, or leave local_training unset)")
        for side, hook in (("client", "client_step"), ("server", "server_step"), ("broadcast", "broadcast")):
            name = getattr(phase, side)
            if side == "client" and name is None and (phase.local_training or
                                                      cls.local_training is not Algorithm.local_training):
                continue  # the client step is the method's local_training plan
            if name is None:
                if side != "broadcast" and getattr(cls, hook) is getattr(Algorithm, hook):
                    raise AlgorithmError(f"{cls.__name__}: phase {phase.name!r} names no {side} handler and the "
                                         f"class does not override {hook} (set Phase({phase.name!r}, {side}=...))")
            elif not callable(getattr(cls, name, None)):
                raise AlgorithmError(f"{cls.__name__}: phase {phase.name!r} names {side} handler {name!r}, which is "
                                     "not a method of the class")

    def evaluate(
        self, state: Any, x_test: torch.Tensor, y_test: torch.Tensor, device: torch.device
    ) -> list[dict[str, Any]]:
        return []

    def measurement(self, state: Any) -> tuple[Phase, list[int]] | None:
        """An evaluation-only phase (`measure=True`, naming its three handlers) that the runtime runs before each
        evaluation, on the workers that own the given clients (sorted ids), or None (the default: none). The clients'
        results go to the phase's server handler, which folds their metrics into the state that `evaluate` reads;
        their states are left as they are. A measurement, not communication: no bytes, no virtual time, no
        clients.parquet rows (a personal method re-scores its clients' personal models with it)."""
        return None

    def finished(self, state: Any, round: int) -> bool:
        """Whether the run should stop after `round` (one-shot methods stop after round 0)."""
        return False

    @classmethod
    def stateless_clients(cls, cfg: RunConfig) -> bool:
        """Whether clients keep no state between rounds, so any worker may train any client (the driver then balances
        each phase's clients over the workers by cost). A client state returned while this is True stops the run."""
        return False

    @classmethod
    def pooled_data_key(cls, cfg: RunConfig) -> str | None:
        """The config key under which the server reads the clients' pooled training data (a validation set, a
        centralised reference), or None; generated client shards (data.partition.kind: generated) have none."""
        return None


def register_algorithm(cls: type[Algorithm]) -> type[Algorithm]:
    """Class decorator: make an algorithm available under `cls.name` in configs."""
    registry.register("algorithm", cls.name, cls)
    return cls


def algorithm_names() -> list[str]:
    """Every algorithm name, built-ins and plugins', sorted."""
    return registry.names("algorithm")


def get_algorithm(name: str) -> type[Algorithm]:
    """The algorithm class registered under `name`; a ConfigError naming the choices when there is none."""
    cls = registry.lookup("algorithm", name)
    if cls is None:
        broken = "".join(f"; module {m} failed to import ({e})" for m, e in sorted(registry.import_failures.items()))
        raise ConfigError(f"algorithm.name: unknown algorithm {name!r}; choose one of {algorithm_names()}{broken}")
    return cls
