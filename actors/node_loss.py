"""A node that leaves the cluster mid-run: the failure its workers' clients are recorded with, and the worker that
takes over a lost worker's clients when no node has room to start it again.

A lost worker's clients keep their slot (fedsim.runtime.backend.owner stays fixed for the run); when the pool
shrinks, the slot is served by a surviving actor, which then hosts the clients of two slots.
"""

from __future__ import annotations

import logging
import socket
import time
from collections import Counter

import ray

from actors.placement import alive_nodes
from fedsim.errors import FedsimError
from fedsim.runtime.backend import WorkerFailure

log = logging.getLogger("fedsim.cluster")

NODE_DEATH_WORDS = ("node has died", "node died", "node was terminated", "node is dead")


class NodeLostError(FedsimError):
    """The node that held the server actor left the cluster: the run stops at its last checkpoint."""


def raylet_answers(node_id: str, timeout_s: float = 5.0) -> bool:
    """Whether the raylet of `node_id` accepts a connection on its port (a node whose processes were killed refuses
    at once, seconds before the cluster's health checks mark it dead)."""
    node = next((n for n in ray.nodes() if n["NodeID"] == node_id), None)
    if node is None or not node.get("Alive"):
        return False
    try:
        socket.create_connection((node["NodeManagerAddress"], int(node["NodeManagerPort"])), timeout=timeout_s).close()
        return True
    except OSError:  # refused or unreachable: the node is going or gone
        return False


def node_gone(node_id: str, error_text: str = "", grace_s: float = 5.0) -> bool:
    """Whether `node_id` has left the cluster or its raylet no longer answers; when Ray's error speaks of a dead
    node, wait up to `grace_s` for that to show."""
    if not node_id:
        return False
    end = time.monotonic() + (grace_s if any(w in error_text.lower() for w in NODE_DEATH_WORDS) else 0.0)
    while raylet_answers(node_id):
        if time.monotonic() >= end:
            return False
        time.sleep(0.2)
    return True


def await_marked_dead(node_id: str, limit_s: float) -> None:
    """Wait (up to `limit_s`) until the cluster itself counts `node_id` as dead, so that nothing is placed on it
    again and its placement-group bundles are placed anew."""
    end = time.monotonic() + limit_s
    while node_id in alive_nodes() and time.monotonic() < end:
        time.sleep(0.2)


def node_lost_failure(worker: int, node_id: str, reason: BaseException | None = None) -> WorkerFailure:
    """What each client of a worker whose node left mid-phase is recorded with (status failed); its traceback
    column holds Ray's error that told of the loss (ActorDiedError, NodeDiedError, ...: which one depends on when
    the node went)."""
    told = f"{type(reason).__name__}: {str(reason).strip()}"[:4000] if reason is not None else ""
    return WorkerFailure("NodeLost", f"node {node_id[:12]} of worker {worker} left the cluster during the phase; "
                                     "this phase's update of the client is lost, its state comes back from the last "
                                     "checkpoint", told)


def pick_host(hosts: list[int], candidates: list[int], lost: int) -> int:
    """The surviving slot whose actor takes over slot `lost`: of `candidates` (slots serving themselves on nodes
    that are alive), the one serving the fewest slots, lowest index first."""
    load = Counter(hosts)
    if not candidates:
        raise FedsimError(f"worker {lost} was lost with its node and no worker on a live node is left to host its "
                          "clients")
    return min(candidates, key=lambda h: (load[h], h))
