"""The in-process backend: the reference implementation of message passing, with no Ray.

It hosts `num_workers` ClientWorker objects in this process (default 1), so worker-count invariance and
failure handling can be tested without a cluster.
"""

from __future__ import annotations

import os
import traceback
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim.errors import ConfigError, OutOfMemory
from fedsim.method.contract import Broadcast, Phase
from fedsim.runtime.backend import Restarted, WorkerFailure
from fedsim.runtime.rundir import spill_folder
from fedsim.runtime.server import Server
from fedsim.runtime.worker import ClientWorker, WorkerReply
from fedsim.threads import client_threads, server_threads, torch_threads

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.persist.storage import Location
    from fedsim.runtime.setup import AnyPartition


class LocalBackend:
    """Workers and server as plain objects; a worker that raises counts as a failed worker."""

    def __init__(self, num_workers: int | None = None, device: str | None = None) -> None:
        self._requested = num_workers
        self.device = device
        self.workers: list[ClientWorker] = []
        self._server: Server | None = None

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    def start(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
              run_dir: Location) -> None:
        n = self._requested or cfg.runtime.num_workers or 1
        self._args = (cfg, arrays, part, meta)
        self._spill = spill_folder(cfg, run_dir)
        # one process, so torch's thread count is switched: clients get what a Ray worker would and the server what
        # the Ray backend's server would (the same numbers on both backends)
        self._threads = client_threads(cfg)
        self._server = Server(cfg, arrays, part, meta, device=self.device, threads=server_threads(cfg))
        self.workers = [self._make(i) for i in range(n)]

    def _make(self, i: int) -> ClientWorker:
        cfg, arrays, part, meta = self._args
        return ClientWorker(cfg, arrays, part, meta, i, device=self.device, threads=None,
                            spill_dir=str(self._spill / f"w{i}"))

    @property
    def server(self) -> Server:
        if self._server is None:
            raise RuntimeError("LocalBackend.server: the backend is not started")
        return self._server

    def describe(self) -> dict[str, Any]:
        return {"placement": [w.ping() for w in self.workers], "server": {"pid": os.getpid(),
                                                                          "device": str(self.server.device)}}

    def run_phase(self, round: int, phase_index: int, phase: Phase, bc: Broadcast,
                  assignments: dict[int, list[int]], late: list[int],
                  timeout: float) -> tuple[dict[int, WorkerReply], dict[int, WorkerFailure]]:
        replies: dict[int, WorkerReply] = {}
        failed: dict[int, WorkerFailure] = {}
        with torch_threads(self._threads):
            for w, cids in sorted(assignments.items()):
                per = {c: bc.per_client[c] for c in cids if bc.per_client and c in bc.per_client}
                try:
                    replies[w] = self.workers[w].run_phase(round, phase_index, phase, bc.common, per, cids, late,
                                                           bc.chain)
                except (OutOfMemory, ConfigError):  # a client ran out of memory, or cannot run this config: the run
                    # stops, naming it
                    raise
                except Exception as exc:  # the whole worker failed
                    failed[w] = WorkerFailure(type(exc).__name__, str(exc), traceback.format_exc(limit=-5))
        return replies, failed

    def restart_workers(self, indices: list[int]) -> Restarted:
        for i in indices:
            self.workers[i] = self._make(i)
        named = ", ".join(map(str, sorted(indices)))
        return Restarted(sorted(indices), [f"worker{'s' if len(indices) > 1 else ''} {named} started again"])

    def worker_of(self, slot: int) -> int:
        """Every slot is served by its own worker here."""
        return slot

    def export_states(self) -> dict[int, Any]:
        out: dict[int, Any] = {}
        for w in self.workers:
            out.update(w.export_states())
        return out

    def load_states(self, states: dict[int, Any], workers: list[int] | None = None) -> None:
        from fedsim.runtime.backend import owner

        targets = workers if workers is not None else range(self.num_workers)
        for i in targets:
            self.workers[i].load_states({c: s for c, s in states.items() if owner(c, self.num_workers) == i})

    def shutdown(self) -> None:
        for w in self.workers:
            w.close()
        self.workers = []
