"""The ServerActor: aggregation, selection, distillation and evaluation on its own GPU fraction."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from actors.client_worker import assigned_device
from fedsim.plugins import import_in_worker
from fedsim.runtime.server import Server
from fedsim.threads import server_threads

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.runtime.setup import AnyPartition


class ServerActor(Server):
    """fedsim's Server, placed by Ray."""

    def __init__(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition,
                 meta: dict[str, Any]) -> None:
        import_in_worker(cfg.plugins)  # the run's own modules register their methods before anything is built
        super().__init__(cfg, arrays, part, meta, device=assigned_device(cfg.runtime.server_gpus),
                         threads=server_threads(cfg))

    def ping(self) -> dict[str, Any]:
        import ray

        return {**super().ping(), "node_id": ray.get_runtime_context().get_node_id()}

    def rss_bytes(self) -> int:
        import psutil

        return psutil.Process().memory_info().rss
