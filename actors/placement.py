"""Where client workers go on a cluster: one placement group (runtime.placement: spread | pack), the group a caller
already runs in (a Tune trial's), or Ray's default scheduling; and whether a lost worker still fits somewhere.

A worker's slot in its own group is a bundle of its CPUs and GPU fraction, so a run holds exactly what it asked
for. Inside a captured group no group is nested: the workers take any free bundle of the captured one.
"""

from __future__ import annotations

import math
import time
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import PlacementGroup, get_current_placement_group, placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from fedsim.errors import ResourceError

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig, RuntimeConfig

STRATEGIES = {"spread": "SPREAD", "pack": "PACK"}


def worker_bundle(rt: RuntimeConfig) -> dict[str, float]:
    """The resources of one client worker (Ray refuses zero-valued entries in a bundle)."""
    bundle = {"CPU": float(rt.client_cpus)}
    if rt.client_gpus > 0:
        bundle["GPU"] = float(rt.client_gpus)
    return bundle


NO_ROOM_SETTLE_S = 1.0  # how long "placed nowhere, room nowhere" must hold before a lost worker is given up


def _holds(free: dict[str, float], need: dict[str, float]) -> bool:
    return all(free.get(k, 0.0) >= v - 1e-9 for k, v in need.items())


def alive_nodes() -> set[str]:
    """Ids of the nodes that are alive now."""
    return {n["NodeID"] for n in ray.nodes() if n.get("Alive")}


class WorkerPlacement:
    """The scheduling of every client worker: in bundle i of a group of our own, in any bundle of a captured group,
    or free (no group)."""

    def __init__(self, rt: RuntimeConfig, group: PlacementGroup | None = None, owned: bool = False) -> None:
        self.rt, self.group, self.owned = rt, group, owned

    @classmethod
    def make(cls, rt: RuntimeConfig, n: int) -> WorkerPlacement:
        """The placement of `n` workers; a group of our own must be placed within runtime.startup_timeout_s."""
        captured = get_current_placement_group()
        if captured is not None:
            return cls(rt, captured)
        if rt.placement == "none":
            return cls(rt)
        group = placement_group([worker_bundle(rt)] * n, strategy=STRATEGIES[rt.placement])
        ready, _ = ray.wait([group.ready()], timeout=rt.startup_timeout_s)
        if not ready:
            ray.util.remove_placement_group(group)
            raise ResourceError(f"runtime.placement={rt.placement}: {n} bundles of {worker_bundle(rt)} were not "
                                f"placed within runtime.startup_timeout_s={rt.startup_timeout_s}")
        return cls(rt, group, owned=True)

    @property
    def kind(self) -> str:
        """spread, pack, none, or captured (the caller's group)."""
        if self.group is None:
            return "none"
        return self.rt.placement if self.owned else "captured"

    def options(self, index: int) -> dict[str, Any]:
        """`.options(...)` of worker `index`'s actor."""
        if self.group is None:
            return {}
        return {"scheduling_strategy": PlacementGroupSchedulingStrategy(
            self.group, placement_group_bundle_index=index if self.owned else -1)}

    def _free(self, index: int) -> dict[str, float]:
        """The resources worker `index` draws on, under the names Ray gives a group's bundles."""
        bundle = worker_bundle(self.rt)
        if self.group is None:
            return bundle
        tag = f"{index}_{self.group.id.hex()}" if self.owned else self.group.id.hex()
        return {f"{k}_group_{tag}": v for k, v in bundle.items()}

    def fits(self, index: int, grace_s: float) -> bool:
        """Whether worker `index` can be started again on a node that is alive, waiting up to `grace_s` for Ray to
        re-place a lost node's bundles and to report the survivors' free resources. It answers no sooner when, in
        two looks NO_ROOM_SETTLE_S apart, the worker's bundle is placed nowhere alive and no alive node has the
        room to take it: Ray re-places a bundle as soon as it marks the node dead, or never (measured on a local
        cluster: at the same poll, or still unplaced 10 s later)."""
        need = self._free(index)
        end = time.monotonic() + grace_s
        hopeless_since: float | None = None
        while True:
            alive = alive_nodes()
            free = {"cluster": ray.available_resources()}  # public Ray has no per-node view of what is free
            if any(_holds(f, need) for f in free.values()):
                return True
            now = time.monotonic()
            if now >= end:
                return False
            if self._unplaced(index, alive) and not any(_holds(f, worker_bundle(self.rt)) for f in free.values()):
                hopeless_since = now if hopeless_since is None else hopeless_since
                if now - hopeless_since >= NO_ROOM_SETTLE_S:
                    return False
            else:
                hopeless_since = None
            time.sleep(min(0.5, max(0.0, end - now)))

    def _unplaced(self, index: int, alive: set[str]) -> bool:
        """Whether worker `index`'s slot is reserved on no alive node: with no group, there is nothing to reserve;
        in a group of our own, its bundle (Ray leaves a bundle it cannot re-place unassigned); a captured group is
        its owner's to re-place, so it counts as placed (the whole grace is waited for)."""
        if self.group is None:
            return True
        if not self.owned:
            return False
        try:
            where = ray.util.placement_group_table(self.group).get("bundles_to_node_id", {})
        except Exception:  # no answer: as placed, so the whole grace is waited for
            return False
        return where.get(index) not in alive

    def release(self) -> None:
        """Give back a group of our own (a captured one is its owner's)."""
        if self.owned and self.group is not None:
            try:
                ray.util.remove_placement_group(self.group)
            except Exception:  # Ray is already down
                pass
            self.group = None


def size_pool(cfg: RunConfig, nodes: list[dict[str, float]]) -> int:
    """How many client workers fit, node by node, after the server's reservation; fails naming the knob."""
    rt = cfg.runtime
    total = 0
    server_left = True
    for res in sorted(nodes, key=lambda r: -r.get("GPU", 0.0)):
        cpus, gpus = res.get("CPU", 0.0), res.get("GPU", 0.0)
        if server_left and cpus >= rt.server_cpus and gpus >= rt.server_gpus:
            cpus, gpus, server_left = cpus - rt.server_cpus, gpus - rt.server_gpus, False
        fit = math.floor(cpus / rt.client_cpus + 1e-9)
        if rt.client_gpus > 0:
            fit = min(fit, math.floor(gpus / rt.client_gpus + 1e-9))
        total += max(fit, 0)
    if server_left:
        raise ResourceError(f"the server actor does not fit: it needs runtime.server_cpus={rt.server_cpus} and "
                            f"runtime.server_gpus={rt.server_gpus} on one node")
    if total == 0:
        most = max(nodes, key=lambda r: r.get("CPU", 0.0), default={})
        raise ResourceError(f"0 client workers fit: each needs runtime.client_cpus={rt.client_cpus} and "
                            f"runtime.client_gpus={rt.client_gpus}; the largest node has {most.get('CPU', 0)} CPUs "
                            f"and {most.get('GPU', 0)} GPUs; lower runtime.client_cpus or runtime.client_gpus")
    return min(total, cfg.data.num_clients)


def cluster_nodes() -> list[dict[str, float]]:
    """Schedulable resources of each alive node."""
    return [n["Resources"] for n in ray.nodes() if n.get("Alive")]
