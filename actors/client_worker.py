"""The ClientWorker actor: fedsim's ClientWorker, placed on the GPU fraction Ray assigned to it."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
import torch

from fedsim.plugins import import_in_worker
from fedsim.runtime.allocator import keep_freed_blocks
from fedsim.runtime.worker import ClientWorker
from fedsim.threads import client_threads

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.runtime.setup import AnyPartition


def assigned_device(gpu_fraction: float) -> str:
    """cuda when Ray gave this actor a GPU that torch can see (memory capped to the fraction), else cpu."""
    if ray.get_gpu_ids() and torch.cuda.is_available():
        if 0 < gpu_fraction < 1:
            torch.cuda.set_per_process_memory_fraction(gpu_fraction)
        return "cuda"
    return "cpu"


class ClientWorkerActor(ClientWorker):
    """Hosts many virtual clients; one instance per worker slot."""

    def __init__(self, cfg: RunConfig, worker_index: int, spill_dir: str | None = None) -> None:
        """The process starts (Python, torch, the run's plugins) before the data is shared; `attach` builds the
        worker on it, so the two overlap."""
        keep_freed_blocks()
        import_in_worker(cfg.plugins)  # the run's own modules register their methods before anything is built
        self._args = (cfg, worker_index, spill_dir)

    def attach(self, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any]) -> dict[str, Any]:
        """Build the worker on the shared dataset and partition; returns what `ping` returns."""
        cfg, worker_index, spill_dir = self._args
        super().__init__(cfg, arrays, part, meta, worker_index, device=assigned_device(cfg.runtime.client_gpus),
                         threads=client_threads(cfg), spill_dir=spill_dir)
        return self.ping()

    def ping(self) -> dict[str, Any]:
        out = super().ping()
        out.update(gpu_ids=[str(g) for g in ray.get_gpu_ids()], node_id=ray.get_runtime_context().get_node_id(),
                   cuda_visible_devices=os.environ.get("CUDA_VISIBLE_DEVICES", ""))
        return out

    def close(self) -> None:
        if hasattr(self, "store"):  # a worker that never attached has spilled nothing
            super().close()

    def merge_states(self, states: dict[int, Any]) -> None:
        """Add `states` to this worker's clients' states, keeping the others (a worker that took over the clients
        of a worker lost with its node)."""
        for cid, state in sorted(states.items()):
            self.store.put(int(cid), state)

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss
