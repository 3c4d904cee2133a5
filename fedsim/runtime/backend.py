"""What the round loop asks of a backend: typed calls to the server, and a phase's work on the client workers.

Two backends implement it: `LocalBackend` (fedsim/runtime/local.py, in-process, the reference) and the Ray
backend (actors/pool.py). The loop never names a method by string; every server call returns a small frozen
dataclass with named fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from fedsim.method.contract import Broadcast, Phase, RoundInfo

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.persist.storage import Location
    from fedsim.runtime.setup import AnyPartition
    from fedsim.runtime.worker import WorkerReply


@dataclass(frozen=True)
class BroadcastReply:
    """A phase's broadcast and what it costs to send: the common part's bytes, each client's extra bytes."""

    broadcast: Broadcast
    common_bytes: int
    per_client_bytes: dict[int, int]
    seconds: float
    # compression.download: the common part's size before encoding, and each client's extra bytes to catch up
    dense_common_bytes: int | None = None
    catch_up_bytes: dict[int, int] = field(default_factory=dict)

    @property
    def compressed(self) -> bool:
        """Whether the download was compressed (its clients then hold the server's new replica)."""
        return self.dense_common_bytes is not None

    def dense_bytes(self, client: int) -> int:
        """What the client's download would weigh uncompressed."""
        if self.dense_common_bytes is None:
            return self.common_bytes + self.per_client_bytes.get(client, 0)
        return self.dense_common_bytes + self.per_client_bytes.get(client, 0) - self.catch_up_bytes.get(client, 0)


@dataclass(frozen=True)
class StepReply:
    """The metrics of a server step (rounds.parquet columns, prefixed with the phase) and its wall seconds."""

    metrics: dict[str, Any]
    seconds: float
    round_columns: dict[str, Any] = field(default_factory=dict)  # the update chain's (privacy/epsilon, ...), as named
    client_columns: dict[int, dict[str, Any]] = field(default_factory=dict)  # the chain's per client (kept, ...)


@dataclass(frozen=True)
class EvalReply:
    """Test metrics, one row per global model, and the wall seconds evaluation took."""

    rows: list[dict[str, Any]]
    seconds: float


@dataclass(frozen=True)
class Measurement:
    """A method's evaluation-only phase (Algorithm.measurement), as the server hands it to the loop: the phase, its
    broadcast, who it reaches (`info.participants`) and the server's seconds."""

    phase: Phase
    broadcast: Broadcast
    info: RoundInfo
    seconds: float


@dataclass(frozen=True)
class WorkerFailure:
    """Why a whole worker returned nothing for a phase (it raised, died or hung): each of its clients failed."""

    error_type: str
    message: str
    traceback: str = ""


@dataclass(frozen=True)
class Restarted:
    """What `Backend.restart_workers` did: the slots whose clients' states were lost, and one line per event (a
    worker started again; a node lost and where its workers' clients went), for the loop to log once each."""

    slots: list[int]
    events: list[str]


class ServerAPI(Protocol):
    """The server as the loop calls it, in order: phases, then per phase broadcast and step; at
    an evaluation, measure and measured (a method's evaluation-only phase, when it has one), then evaluate; finished."""

    def ping(self) -> dict[str, Any]: ...
    def phases(self, round: int) -> list[Phase]: ...
    def broadcast(self, phase: Phase, info: RoundInfo) -> BroadcastReply: ...
    def synced(self, clients: list[int]) -> None: ...
    def step(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> StepReply: ...
    def measure(self, round: int) -> Measurement | None: ...
    def measured(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> float: ...
    def evaluate(self) -> EvalReply: ...
    def finished(self, round: int) -> bool: ...
    def get_state(self) -> Any: ...
    def set_state(self, state: Any) -> None: ...
    def chain_state(self) -> dict[str, Any]: ...
    def resume_chain(self, columns: dict[str, float], state: dict[str, Any] | None = None) -> None: ...


class Backend(Protocol):
    """Where workers and the server live. `server` is usable between `start` and `shutdown`."""

    @property
    def num_workers(self) -> int: ...
    @property
    def server(self) -> ServerAPI: ...

    def start(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
              run_dir: Location) -> None:
        """Start workers and server. A backend that copies the data elsewhere may empty `arrays`."""

    def describe(self) -> dict[str, Any]:
        """Facts for meta.json: each worker's placement (pid, device, ...) and the server's."""

    def run_phase(self, round: int, phase_index: int, phase: Phase, bc: Broadcast,
                  assignments: dict[int, list[int]], late: list[int],
                  timeout: float) -> tuple[dict[int, WorkerReply], dict[int, WorkerFailure]]:
        """Run a phase on the assigned workers; replies by worker, and the workers that returned none."""

    def restart_workers(self, indices: list[int]) -> Restarted:
        """Start workers `indices` again, together where the backend can. The slots whose clients' states were
        lost are `indices`, and after a node loss every slot that a lost actor served."""

    def worker_of(self, slot: int) -> int:
        """The worker that serves slot `slot` now: the slot's own, or after a node loss the survivor that took its
        clients over (clients.parquet's `worker` column)."""

    def export_states(self) -> dict[int, Any]: ...
    def load_states(self, states: dict[int, Any], workers: list[int] | None = None) -> None: ...
    def shutdown(self) -> None: ...


def owner(client_id: int, num_workers: int) -> int:
    """The worker that hosts a client, fixed for the whole run so personal state stays put."""
    return client_id % num_workers
