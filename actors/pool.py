"""The Ray backend: sizes the worker pool from the cluster, creates the actors, moves each phase's messages.

The dataset and partition are `ray.put` once and every worker maps them zero-copy; each phase's common
broadcast is put once and all workers get the same reference. Every wait has a timeout taken from the config
(runtime.startup_timeout_s while actors start, runtime.round_timeout_s afterwards): a worker that dies or
hangs in a phase costs only its clients' results for that phase, and is replaced; any other call that hangs
or fails is one FedsimError naming it.

The server is a ServerActor when it reserves resources (runtime.server_gpus or runtime.server_cpus > 0).
Without a reservation it is hosted in the driver: the loop is synchronous, so a separate process would
only add its start-up (~3 CPU-seconds of imports) and memory (~1 GB of torch) and a hop for every broadcast.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import ray
from ray.exceptions import GetTimeoutError, RayError, RayTaskError

from actors.autoscale import asked_for, await_workers
from actors.boot import RayBoot
from actors.client_worker import ClientWorkerActor
from actors.node_loss import NodeLostError, await_marked_dead, log, node_gone, node_lost_failure, pick_host
from actors.placement import WorkerPlacement, alive_nodes, cluster_nodes, size_pool
from actors.plugins import job_runtime_env
from actors.server_actor import ServerActor
from actors.wire import for_the_wire
from fedsim.errors import ConfigError, FedsimError, OutOfMemory, ResourceError
from fedsim.method.contract import Broadcast, Phase, RoundInfo
from fedsim.runtime.backend import (
    BroadcastReply,
    EvalReply,
    Measurement,
    Restarted,
    ServerAPI,
    StepReply,
    WorkerFailure,
)
from fedsim.runtime.rundir import spill_folder
from fedsim.runtime.server import Server
from fedsim.runtime.worker import WorkerReply
from fedsim.threads import server_threads

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.persist.storage import Location
    from fedsim.runtime.setup import AnyPartition

CLOSE_WAIT_S = 2.0  # at most this long for the workers to remove their spilled states when the run stops


def free_nodes() -> list[dict[str, float]]:
    """The cluster's free resources, as one node: Ray's public API has no per-node view of what is free, so a
    worker that fits only across two nodes' leftovers is tried, and then waits for room like any actor."""
    return [ray.available_resources()]


def group_bundles() -> list[dict[str, float]] | None:
    """The bundles of the placement group this process runs in (a Ray Tune trial's share), without the bundle
    that holds the trial itself; None outside a placement group."""
    group = ray.util.get_current_placement_group()
    if group is None:
        return None
    bundles = [dict(b) for b in group.bundle_specs]
    try:
        from ray import tune

        trial = tune.get_context().get_trial_resources()
    except Exception:  # not a Tune trial: every bundle is the run's
        return bundles
    return bundles if trial is None or trial.head_bundle_is_empty else bundles[1:]


def pool_size(cfg: RunConfig, requested: int | None = None) -> int:
    """How many client workers a run takes: never more of the cluster than its config asks for.

    Inside a placement group (a Ray Tune trial) the run's share is the group: its workers go there, as many as
    asked or as fit. Elsewhere runtime.num_workers (or `requested`) is taken as it is (workers beyond what is
    free wait for room); left unset, the run takes what is free now, at least one worker, so runs started
    side by side share the cluster instead of each sizing itself to all of it."""
    rt = cfg.runtime
    asked = requested or rt.num_workers
    bundles = group_bundles()
    if bundles is not None:
        fits = size_pool(cfg, bundles)
        n = asked or fits
        if n > fits:
            raise ResourceError(f"{asked_for(cfg, requested)} but the placement group this run is in (its share of "
                                f"the cluster) holds {fits} workers of runtime.client_cpus={rt.client_cpus} and "
                                f"runtime.client_gpus={rt.client_gpus}")
        return n
    fits = size_pool(cfg, cluster_nodes())
    if asked:
        if asked > fits:
            raise ResourceError(f"{asked_for(cfg, requested)} but only {fits} workers fit with runtime.client_cpus="
                                f"{rt.client_cpus} and runtime.client_gpus={rt.client_gpus}")
        return asked
    try:
        free = size_pool(cfg, free_nodes())
    except ResourceError:  # the cluster is busy: one worker, which waits for room
        free = 1
    return min(free, fits)


def wait_released(before: dict[str, float], share: dict[str, float], limit: float) -> None:
    """Wait (at most `limit` s) until the cluster's free resources hold again the share a run gave back: Ray frees
    a killed actor's resources a moment after the kill, and a run started next in this process and sized from
    the free resources (pool_size) should find them. What a lost node held never comes back: the wait is for no
    more than the nodes still in the cluster hold (it waited its whole limit after a node was lost)."""
    want = {k: before.get(k, 0.0) + v for k, v in share.items() if v > 0}
    if not want:  # nothing given back (a Ray this run stops itself, or already stopped): nothing to ask Ray
        return
    total = ray.cluster_resources()
    want = {k: min(v, total.get(k, 0.0)) for k, v in want.items()}
    deadline = time.monotonic() + limit
    while want and time.monotonic() < deadline:
        free = ray.available_resources()
        if all(free.get(k, 0.0) >= v - 1e-6 for k, v in want.items()):
            return
        time.sleep(0.05)


def wait_for(refs: Any, what: str, limit: float, knob: str) -> Any:
    """ray.get with a timeout: a hung or dead actor is one FedsimError naming `what` and the `knob` that limits it;
    a FedsimError the actor raised is passed on as it is."""
    try:
        return ray.get(refs, timeout=limit)
    except GetTimeoutError:
        raise FedsimError(f"{what}: no answer within {knob}={limit}") from None
    except RayTaskError as exc:
        if isinstance(getattr(exc, "cause", None), FedsimError):
            raise exc.cause from None
        raise FedsimError(f"{what} failed: {_cause(exc)}") from None
    except RayError as exc:  # the actor, its process or its node gone, or the answer lost with its node
        raise FedsimError(f"{what} failed: {_short(exc)}") from None


class RemoteServer:
    """The ServerAPI of a ServerActor: every call waits at most runtime.round_timeout_s (the first ping, while the
    actor builds its state, runtime.startup_timeout_s)."""

    def __init__(self, actor: Any, cfg: RunConfig) -> None:
        self.actor, self.rt = actor, cfg.runtime
        self.node_id, self.run_dir = "", ""  # where the actor runs, and the run it serves (set once it answers)

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return wait_for(getattr(self.actor, method).remote(*args), f"server {method}", self.rt.round_timeout_s,
                            "runtime.round_timeout_s")
        except FedsimError as exc:
            if node_gone(self.node_id, str(exc)):
                raise NodeLostError(f"the server actor's node {self.node_id[:12]} left the cluster (server {method}); "
                                    f"the run stops at its last checkpoint: resume it with `fedsim run --resume "
                                    f"{self.run_dir}`") from None
            raise

    def ping(self) -> dict[str, Any]:
        return wait_for(self.actor.ping.remote(), "server actor start", self.rt.startup_timeout_s,
                        "runtime.startup_timeout_s")

    def phases(self, round: int) -> list[Phase]:
        return self._call("phases", round)

    def broadcast(self, phase: Phase, info: RoundInfo) -> BroadcastReply:
        return self._call("broadcast", phase, info)

    def synced(self, clients: list[int]) -> None:
        self._call("synced", clients)

    def step(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> StepReply:
        return self._call("step", phase, replies, info)

    def measure(self, round: int) -> Measurement | None:
        return self._call("measure", round)

    def measured(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> float:
        return self._call("measured", phase, replies, info)

    def evaluate(self) -> EvalReply:
        return self._call("evaluate")

    def finished(self, round: int) -> bool:
        return self._call("finished", round)

    def get_state(self) -> Any:
        return self._call("get_state")

    def set_state(self, state: Any) -> None:
        self._call("set_state", state)

    def chain_state(self) -> dict[str, Any]:
        return self._call("chain_state")

    def resume_chain(self, columns: dict[str, float], state: dict[str, Any] | None = None) -> None:
        self._call("resume_chain", columns, state)

    def rss_bytes(self) -> int:
        return self._call("rss_bytes")


def driver_server_device(client_gpus: float) -> str:
    """Where the server computes when it runs in the driver: the driver's GPU when the run's clients train on GPUs
    and the driver may use one, else the CPU (on one H100 the driver's CPUs took 1.7 s a round to evaluate a small
    CNN on 10,000 test images, its GPU 0.016 s). A driver inside a Ray actor (a sweep's Tune trial) takes a GPU
    only when Ray gave it one, and a GPU that cannot be used (busy, exclusive) leaves the server on the CPU."""
    if client_gpus <= 0:
        return "cpu"
    try:
        if ray.get_runtime_context().get_actor_id() is not None and not ray.get_gpu_ids():
            return "cpu"
        import torch

        if not torch.cuda.is_available():
            return "cpu"
        torch.zeros(1, device="cuda")  # a GPU that cannot take a context fails here, not in the first round
        return "cuda"
    except Exception as exc:  # noqa: BLE001 - any failure to use the GPU leaves the server where it always worked
        log.warning("the driver's server evaluates on the CPU: its GPU cannot be used (%s: %s)", type(exc).__name__,
                    (str(exc).splitlines() or [""])[0])
        return "cpu"


def check_gpus(rt: Any, placement: list[dict], server: dict) -> None:
    """Say once, before round 0, that GPUs the run reserves from Ray are not used (torch sees no CUDA device where
    Ray placed the actor: a CPU-only torch, a node without drivers, logical GPUs), so training quietly on the CPU is
    never mistaken for a GPU run; with runtime.require_gpu it is a ConfigError instead."""
    lacking = []
    if rt.client_gpus > 0:
        on_cpu = [p for p in placement if p.get("device") != "cuda"]
        if on_cpu:
            lacking.append(f"runtime.client_gpus={rt.client_gpus}: {len(on_cpu)} of {len(placement)} client workers")
    if rt.server_gpus > 0 and server.get("device") != "cuda":
        lacking.append(f"runtime.server_gpus={rt.server_gpus}: the server")
    if not lacking:
        return
    text = f"GPUs reserved but torch sees no CUDA device ({'; '.join(lacking)}): they compute on the CPU"
    if rt.require_gpu:
        raise ConfigError(f"runtime.require_gpu: {text}")
    log.warning("%s (runtime.require_gpu: true stops the run instead)", text)


class RayBackend:
    """Workers as Ray actors pinned to CPU/GPU fractions, and a ServerActor."""

    worker_cls: Any = ClientWorkerActor
    server_cls: Any = ServerActor

    def __init__(self, num_workers: int | None = None, boot: RayBoot | None = None) -> None:
        self._requested = num_workers
        self._boot = boot  # a start of Ray already under way (actors.backend.make_backend begins it before torch loads)
        self._startup_limit = 60.0
        self.workers: list[Any] = []
        self.placement: list[dict] = []
        self._server: ServerAPI | None = None
        self.server_placement: dict = {}
        self._where: WorkerPlacement | None = None  # how workers are placed (runtime.placement)
        self._host: list[int] = []  # the slot whose actor serves each slot: itself, or a survivor after a node loss
        self._holds: list[bool] = []  # whether each slot's actor may hold personal states (as its last reply said)
        self._room_by: dict[str, float] = {}  # a lost node's id: when the wait for room for its workers ends

    @property
    def num_workers(self) -> int:
        return len(self.workers)

    @property
    def server(self) -> ServerAPI:
        if self._server is None:
            raise RuntimeError("RayBackend.server: the backend is not started")
        return self._server

    @server.setter
    def server(self, server: ServerAPI) -> None:
        self._server = server

    def start(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
              run_dir: Location) -> None:
        rt = cfg.runtime
        self._startup_limit = rt.startup_timeout_s
        if self._boot is None:
            self._boot = RayBoot(rt.ray_address, job_runtime_env(cfg))
        self._boot.wait(rt.startup_timeout_s)
        await_workers(cfg, self._requested)
        n = pool_size(cfg, self._requested)
        self.cfg = cfg
        self._where, self._host, self._holds = WorkerPlacement.make(rt, n), list(range(n)), [True] * n
        self._spill = str(spill_folder(cfg, run_dir))
        self.workers = [self._create(i) for i in range(n)]  # they boot while the data is shared and the server built
        self._refs = (ray.put(arrays), ray.put(part), meta)
        arrays.clear()  # the object store has the data now: the driver's copy goes (the server maps the store's)
        if rt.server_gpus > 0 or rt.server_cpus > 0:
            self.server = RemoteServer(ray.remote(num_cpus=rt.server_cpus, num_gpus=rt.server_gpus, max_restarts=0)(
                self.server_cls).remote(cfg, *self._refs), cfg)
        else:
            # zero-copy views of the object store, so the driver's own copy of the data can be freed
            shared = wait_for(self._refs[0], "sharing the dataset", rt.startup_timeout_s, "runtime.startup_timeout_s")
            self.server = Server(cfg, shared, part, meta, device=driver_server_device(rt.client_gpus),
                                 threads=server_threads(cfg))
        self.placement = self._attach(list(range(n)))
        self.server_placement = self.server.ping()
        self._note_server_node(run_dir)
        check_gpus(rt, self.placement, self.server_placement)

    def _create(self, i: int) -> Any:
        rt = self.cfg.runtime
        cls = ray.remote(num_cpus=rt.client_cpus, num_gpus=rt.client_gpus, max_restarts=0)(self.worker_cls)
        cls = cls.options(**self._where.options(i)) if self._where is not None else cls
        return cls.remote(self.cfg, i, spill_dir=f"{self._spill}/w{i}")

    def _attach(self, indices: list[int]) -> list[dict]:
        """Build the workers `indices` (just created) on the shared data; their placement facts once they answer.
        The ones that do not start in runtime.startup_timeout_s are named in one FedsimError (every worker is
        stopped then)."""
        limit = self.cfg.runtime.startup_timeout_s
        refs = [self.workers[i].attach.remote(*self._refs) for i in indices]
        _, pending = ray.wait(refs, num_returns=len(refs), timeout=limit)
        try:
            if pending:
                hung = [i for i, ref in zip(indices, refs, strict=True) if ref in pending]
                raise FedsimError(f"client worker{'s' if len(hung) > 1 else ''} {', '.join(map(str, hung))} did not "
                                  f"start: no answer within runtime.startup_timeout_s={limit}")
            return wait_for(refs, "client worker start", limit, "runtime.startup_timeout_s")
        except FedsimError:
            for w in self.workers:
                ray.kill(w, no_restart=True)
            raise

    def describe(self) -> dict[str, Any]:
        return {"placement": self.placement, "server": self.server_placement, **self._node_facts()}

    def _note_server_node(self, run_dir: Any) -> None:
        """Record the node of the server (the driver's when it hosts the server), so a lost one is told apart."""
        node = ray.get_runtime_context().get_node_id()
        if isinstance(self._server, RemoteServer):
            self._server.run_dir = str(run_dir)
            node = self._server.node_id = self.server_placement.get("node_id", "")
        self.server_placement.setdefault("node_id", node)

    def _node_facts(self) -> dict[str, Any]:
        """The placement strategy and how many workers each node holds."""
        nodes: dict[str, int] = {}
        for i, p in enumerate(self.placement):
            if self._host and self._host[i] == i:
                nodes[p.get("node_id", "")] = nodes.get(p.get("node_id", ""), 0) + 1
        return {"placement_strategy": self._where.kind if self._where else "none", "workers_per_node": nodes}

    def run_phase(self, round: int, phase_index: int, phase: Phase, bc: Broadcast,
                  assignments: dict[int, list[int]], late: list[int],
                  timeout: float) -> tuple[dict[int, WorkerReply], dict[int, WorkerFailure]]:
        common = ray.put(for_the_wire(bc.common))
        futures = {}
        for w, cids in sorted(assignments.items()):
            per = {c: for_the_wire(bc.per_client[c]) for c in cids if bc.per_client and c in bc.per_client}
            futures[w] = self.workers[w].run_phase.remote(round, phase_index, phase, common, per, cids, late,
                                                          bc.chain)
        deadline = time.monotonic() + timeout
        pending = list(futures.values())
        while pending and time.monotonic() < deadline:
            _, pending = ray.wait(pending, num_returns=len(pending), timeout=max(0.0, deadline - time.monotonic()))
        replies, failed = {}, {}
        for w, ref in futures.items():
            if ref in pending:  # hung: the loop replaces (kills) this worker
                failed[w] = WorkerFailure("TimeoutError", f"no reply within runtime.round_timeout_s={timeout}")
                continue
            self._holds[w] = True  # until a reply says otherwise
            try:
                replies[w] = ray.get(ref, timeout=timeout)  # ready: returns at once
                self._holds[w] = replies[w].info.get("states", 1) > 0
            except RayTaskError as exc:  # the worker itself raised
                cause = getattr(exc, "cause", None)
                if isinstance(cause, (OutOfMemory, ConfigError)):  # out of memory, or a config a client's step
                    # cannot run under (a method without DP-SGD under sample-level DP): the run stops, naming it
                    raise cause from None
                failed[w] = WorkerFailure(type(cause).__name__ if cause is not None else type(exc).__name__,
                                          str(cause) if cause is not None else _short(exc), exc.traceback_str[-4000:])
            except RayError as exc:  # not the worker's own error: its actor or node died, or Ray lost the reply
                # (ObjectLostError, NodeDiedError, ...: which one depends on when the node went)
                failed[w] = self._node_failure(w, exc) or WorkerFailure(type(exc).__name__, _short(exc))
        return replies, failed

    def restart_workers(self, indices: list[int]) -> Restarted:
        """The actors that served the failed slots start again: those of a lost node one by one (each takes room
        that the next one's placement must see), one event per node; those on live nodes side by side (each start
        imports torch: seconds), one event for all."""
        actors = sorted({self._host[i] for i in indices})
        by_node: dict[str, list[int]] = {}
        fresh = []
        for a in actors:
            if self._node_failure(a, None) is not None:
                by_node.setdefault(self.placement[a].get("node_id", ""), []).append(a)
            else:
                fresh.append(a)
        slots, events = set(indices), []
        for node, lost in by_node.items():
            outcomes = []
            for a in lost:
                served, outcome = self._replace_lost(a)
                slots.update(served)
                outcomes.append(outcome)
            events.append(f"node {node[:12]} left the cluster: {'; '.join(outcomes)}")
        for a in fresh:
            ray.kill(self.workers[a], no_restart=True)
            self.workers[a], self._holds[a] = self._create(a), True
        if fresh:
            for a, facts in zip(fresh, self._attach(fresh), strict=True):
                self.placement[a] = facts
                served = [i for i, h in enumerate(self._host) if h == a]
                self._serve(served, a)
                slots.update(served)
            events.append(f"worker{'s' if len(fresh) > 1 else ''} {', '.join(map(str, fresh))} started again")
        return Restarted(sorted(slots), events)

    def worker_of(self, slot: int) -> int:
        """The slot whose actor serves `slot`: itself, or the survivor that took its clients over."""
        return self._host[slot] if slot < len(self._host) else slot

    def _node_failure(self, index: int, exc: BaseException | None) -> WorkerFailure | None:
        """The failure of worker `index` when its node has left the cluster (None while the node is alive), with
        Ray's error that told of it."""
        node = self.placement[index].get("node_id", "") if index < len(self.placement) else ""
        if node_gone(node, str(exc) if exc is not None else ""):
            return node_lost_failure(self.worker_of(index), node, exc)
        return None

    def _replace_lost(self, index: int) -> tuple[list[int], str]:
        """A worker whose node left: started again where a node has room, else its clients move to a surviving
        worker (the pool shrinks). Returns every slot the lost actor served, whose clients' states must come back,
        and what became of it."""
        lost = self._host[index]
        slots = [i for i, h in enumerate(self._host) if h == lost]
        node = self.placement[index].get("node_id", "")
        await_marked_dead(node, min(self.cfg.runtime.startup_timeout_s, 60.0))
        # one wait per lost node, not per lost worker: once Ray has had the grace to re-place the node's bundles,
        # its other workers are only looked up (two workers of one node took 10 s each before)
        room_by = self._room_by.setdefault(node, time.monotonic() + min(self.cfg.runtime.startup_timeout_s, 10.0))
        assert self._where is not None
        if self._where.fits(index, max(0.0, room_by - time.monotonic())):
            self.workers[index], self._host[index] = self._create(index), index
            self.placement[index] = self._attach([index])[0]
            host = index
            outcome = f"worker {index} started again on node {self.placement[index].get('node_id', '')[:12]}"
        else:
            alive = alive_nodes()
            host = pick_host(self._host, sorted(h for h in set(self._host) if h != lost and
                                                self.placement[h].get("node_id") in alive), index)
            outcome = (f"no node has room for worker {index}: its clients move to worker {host} (the pool shrinks to "
                       f"{len(set(self._host) - {lost})} workers)")
        self._serve(slots, host)
        return slots, outcome

    def _serve(self, slots: list[int], host: int) -> None:
        """Slots `slots` are served by the actor of slot `host`: their handles and placement (as meta.json records
        it: the host's node and process, `hosted_by` the host) follow it."""
        for i in slots:
            self.workers[i], self._host[i] = self.workers[host], host
            if i != host:
                self.placement[i] = {**self.placement[host], "index": i, "hosted_by": host}

    def _actors(self) -> list[Any]:
        """Each live worker actor once (after a shrink, one actor serves several slots); before the pool is whole
        (a start that failed half-way, or after shutdown), every handle there is."""
        if len(self._host) != len(self.workers):
            return list(self.workers)
        return [self.workers[i] for i in sorted(set(self._host))]

    def _get(self, refs: list[Any], what: str) -> list[Any]:
        """ray.get with the round timeout: a hung or dead actor is one FedsimError naming `what`, not a hang."""
        return wait_for(refs, what, self.cfg.runtime.round_timeout_s, "runtime.round_timeout_s")

    def export_states(self) -> dict[int, Any]:
        """Every client's personal state; actors whose last reply said they hold none are not asked (a checkpoint
        of a method without personal state then costs no round trip)."""
        holding = sorted({self._host[i] for i, h in enumerate(self._holds) if h}) if self._host else \
            range(len(self.workers))
        out: dict[int, Any] = {}
        for part in self._get([self.workers[i].export_states.remote() for i in holding],
                              "collecting client states"):
            out.update(part)
        return out

    def load_states(self, states: dict[int, Any], workers: list[int] | None = None) -> None:
        from fedsim.runtime.backend import owner

        targets = workers if workers is not None else range(self.num_workers)
        for i in targets:
            if i < len(self._holds):
                self._holds[i] = True
        shared = {h for h in self._host if self._host.count(h) > 1}  # an actor serving several slots keeps the rest
        self._get([getattr(self.workers[i], "merge_states" if self._host and self._host[i] in shared
                           else "load_states").remote({c: s for c, s in states.items()
                                                       if owner(c, self.num_workers) == i}) for i in targets],
                  "restoring client states")

    def rss_bytes(self) -> list[int]:
        """Resident memory of each actor (workers, then the server; the driver's when it hosts the server)."""
        if isinstance(self._server, RemoteServer):
            return self._get([w.rss_bytes.remote() for w in self._actors()]
                             + [self._server.actor.rss_bytes.remote()],
                             "measuring memory")
        import psutil

        return self._get([w.rss_bytes.remote() for w in self._actors()], "measuring memory") \
            + [psutil.Process().memory_info().rss]

    def _share(self) -> dict[str, float]:
        """The CPUs and GPUs this pool's actors hold (after a node loss, fewer actors than slots)."""
        rt, n = self.cfg.runtime, len(self._actors())
        server = isinstance(self._server, RemoteServer)
        return {"CPU": n * rt.client_cpus + (rt.server_cpus if server else 0.0),
                "GPU": n * rt.client_gpus + (rt.server_gpus if server else 0.0)}

    def shutdown(self) -> None:
        server_actor = [self._server.actor] if isinstance(self._server, RemoteServer) else []
        # the share comes back for a run started next on the same cluster: not needed when this Ray stops now, and
        # a group's share stays its own
        stopping = self._boot is not None and self._boot.started_ray
        share = self._share() if self.workers and group_bundles() is None and not stopping else {}
        before = ray.available_resources() if share else {}
        actors = self._actors()  # each once: after a node loss, one actor may serve several slots
        if actors:  # each removes its spilled states, on its own node; a hung one does not hold the stop up
            ray.wait([w.close.remote() for w in actors], num_returns=len(actors), timeout=CLOSE_WAIT_S)
        for actor in actors + server_actor:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:  # already gone
                continue
        self.workers, self._server = [], None
        if self._where is not None:
            self._where.release()
        wait_released(before, share, 5.0)
        if self._boot is not None:
            self._boot.stop(self._startup_limit)


def _cause(exc: RayTaskError) -> str:
    """'Type: first line' of the exception an actor raised."""
    cause = getattr(exc, "cause", None)
    if cause is None:
        return _short(exc)
    return f"{type(cause).__name__}: {(str(cause).strip().splitlines() or [''])[0][:300]}"


def _short(exc: BaseException) -> str:
    """The first meaningful line of a Ray error."""
    text = str(exc).strip().splitlines()
    return next((t for t in reversed(text) if t.strip()), type(exc).__name__)[:300]
