"""What a run moves through each node's object store: Ray's per-node count of bytes created in its store (an object
put there, or pulled there from another node), read at the start of a run and after every round.

On a node that hosts only client workers, a round's bytes are the broadcast pulled in and the workers' replies put
there for the driver; a dataset or shard that moved per round would show as its whole size every round.
"""

from __future__ import annotations

from typing import Any

import ray

from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo


def created_bytes() -> dict[str, int]:
    """Bytes created so far in the object store of each alive node, by node id."""
    from ray._private.internal_api import node_stats

    out = {}
    for node in ray.nodes():
        if node.get("Alive"):
            stats = node_stats(node["NodeManagerAddress"], node["NodeManagerPort"], include_memory_info=False)
            out[node["NodeID"]] = int(stats.store_stats.cumulative_created_bytes)
    return out


class StoreTraffic(Callback):
    """Per-node object-store bytes of the run's start (from `baseline`, taken before the backend starts) and of
    each round; `rows()` gives one row per stage and node."""

    def __init__(self) -> None:
        self.marks: list[tuple[str, dict[str, int]]] = [("before start", created_bytes())]

    def on_setup_end(self, run: RunInfo) -> None:
        self.marks.append(("start", created_bytes()))

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        self.marks.append((f"round {round}", created_bytes()))

    def rows(self) -> list[dict[str, Any]]:
        """Bytes created on each node during each stage (start: workers built, shards fetched; then each round)."""
        out = []
        for (_, before), (stage, after) in zip(self.marks, self.marks[1:]):
            for node, total in sorted(after.items()):
                out.append({"stage": stage, "node": node, "bytes": total - before.get(node, 0)})
        return out
