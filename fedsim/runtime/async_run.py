"""Asynchronous FL on the virtual clock (participation.mode: async): clients in flight, each arrival an event.

At virtual time 0, C clients are dispatched (participation.concurrency), each drawn from the available clients not
in flight; a client trains from the server version current at its dispatch, for its clock duration (download,
compute, upload: fedsim.runtime.clock.durations), and arrives at dispatch + duration. Arrivals are handled in the
order (time, client id, dispatch number); the method's server step (fedsim.method.asynchronous) applies each one
and says when it made a new server version, which is one row of rounds.parquet (`rounds` counts versions). Each
arrival is replaced by a new dispatch at its time, once every arrival of that same instant is applied, so a
version made at that instant is what the replacements start from.

A client's training depends only on its start version, known at dispatch, so training is eager: when an arrival's
result is needed, every dispatched client not yet trained is trained, one backend phase call per start version (the
workers' existing calls, clients balanced over them). A client's seeds are those of a synchronous round with the
start version as the round and, as the phase index, how many earlier dispatches of that client started from that
version (0 almost always): numbers depend neither on the workers nor on how training is grouped, and with K = C and
equal durations FedBuff's versions are FedAvg's rounds. Staleness = version at apply − version at dispatch.

A checkpoint, at a version, holds the server state and the event state: the clients in flight (client, dispatch
number, start version, seeds' phase index, dispatch and arrival times), the replacements still owed, and the models
of the versions they start from. Their results are not kept: a resumed run trains them again, to the same numbers.
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim import rng as streams
from fedsim.errors import AlgorithmError, CheckpointError, ClientFailedError, DataError, RunFailedError
from fedsim.method.asynchronous import NEW_VERSION, Arrival, concurrency
from fedsim.method.contract import Broadcast, Phase, RoundInfo
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import failure_columns
from fedsim.runtime.availability import next_online, online, online_until
from fedsim.runtime.backend import BroadcastReply
from fedsim.runtime.callbacks import Callbacks, ResultsWriter, RoundRows, RunStatus
from fedsim.runtime.clock import durations
from fedsim.runtime.worker import ClientOutcome, WorkerReply

if TYPE_CHECKING:
    from fedsim.runtime.loop import RunState, Simulation

Assign = Callable[[list[int], int, dict[int, int]], dict[int, list[int]]]  # fedsim.runtime.loop.assign

DISPATCH_STREAM = "async/dispatch"  # one draw per dispatch, keyed by its number
CHECKPOINT_KEY = "async"


@dataclass(order=True)
class Task:
    """One dispatched client: its arrival time, who, the dispatch number, its start version and seeds' phase index,
    and its dispatch time. Tasks order as arrivals are handled: by time, then client id, then dispatch number."""

    arrival: float
    client: int
    dispatch: int
    version: int
    slot: int
    start: float
    offline: bool = False  # its client goes offline before it arrives (participation.availability over time)


@dataclass
class Events:
    """The event state a checkpoint keeps (besides the server's): everything the next arrivals depend on."""

    now: float = 0.0
    dispatched: int = 0  # dispatches so far: the next one's number
    owed: int = 0  # replacements owed at `now`, dispatched once every arrival of that instant is applied
    slots: dict[int, int] = field(default_factory=dict)  # dispatches per client from the current version
    flying: list[Task] = field(default_factory=list)  # a heap: the next arrival first


class FreeClients:
    """The clients not in flight, in id order: the k-th of them, and taking one out or putting it back, each in
    O(log N) (a Fenwick tree of 0/1 counts), so a dispatch costs the same at 10k and at 1M registered clients."""

    def __init__(self, n: int) -> None:
        self.n, self.count = n, n
        self.tree = [i & -i for i in range(n + 1)]  # every client free: node i counts its lowbit(i) clients
        self.top = 1 << max(n.bit_length() - 1, 0)

    def __len__(self) -> int:
        return self.count

    def _add(self, client: int, delta: int) -> None:
        i, tree = client + 1, self.tree
        while i <= self.n:
            tree[i] += delta
            i += i & -i
        self.count += delta

    def take(self, client: int) -> None:
        self._add(client, -1)

    def put(self, client: int) -> None:
        self._add(client, 1)

    def kth(self, k: int) -> int:
        """The id of the k-th (from 0) client not in flight."""
        pos, rest, step, tree = 0, k + 1, self.top, self.tree
        while step:
            if pos + step <= self.n and tree[pos + step] < rest:
                pos += step
                rest -= tree[pos]
            step >>= 1
        return pos


@dataclass
class _Span:
    """What the arrivals of one version accumulate."""

    start: float
    client_rows: list[dict] = field(default_factory=list)
    staleness: list[int] = field(default_factory=list)
    failures: int = 0
    offline: int = 0
    bytes_up: int = 0
    bytes_down: int = 0
    clients_s: float = 0.0
    server_s: float = 0.0
    metrics: dict[str, Any] = field(default_factory=dict)
    t0: float = field(default_factory=time.perf_counter)


class AsyncRun:
    """The rounds of a run in async mode: an event loop over a set-up Simulation (its backend, clock profiles,
    records and worker replacement), which hands its run over here (fedsim.runtime.loop.Simulation.run)."""

    def __init__(self, sim: Simulation, assign: Assign) -> None:
        self.sim, self.assign = sim, assign
        self.cfg, self.backend = sim.cfg, sim.backend
        self.profiles, self.num_samples = sim.profiles, sim.num_samples
        self.concurrency = concurrency(self.cfg)
        phases = self.backend.server.phases(0)
        if len(phases) != 1 or phases[0].reduce != "each":
            raise AlgorithmError(f"{self.cfg.algorithm.name}: an async method has one phase with reduce='each'")
        self.phase: Phase = phases[0]
        sim.algorithm.check_phase(self.phase)
        self.events = Events()
        self.version = 0
        self.models: dict[int, BroadcastReply] = {}  # the broadcast of each version a client in flight starts from
        self.results: dict[int, tuple[ClientOutcome, int]] = {}  # dispatch -> its outcome and worker
        self.untrained: list[Task] = []  # dispatched, not yet trained
        self.busy = np.zeros(self.cfg.data.num_clients, bool)  # the clients in flight
        self.free = FreeClients(self.cfg.data.num_clients)  # the others, in id order
        self.some_away = bool((self.profiles.availability < 1).any())  # a fixed probability below 1 somewhere
        self.refs: dict[int, int] = {}  # clients in flight per start version
        self.consecutive_failures = 0

    def _seconds(self, down: int) -> np.ndarray:
        """Every client's duration: download and upload of `down` bytes, compute and one round trip's latency."""
        n = self.cfg.data.num_clients
        ids = np.arange(n)
        size = np.full(n, float(down))
        return durations(self.cfg, self.profiles, ids, np.asarray(self.num_samples)[ids], size, size)

    def restore(self, state: RunState) -> None:
        """The event state of the checkpoint the Simulation restored `state` from."""
        path = self.sim.ckpt_path
        saved: Any = load_run_checkpoint(path).get(CHECKPOINT_KEY)
        try:
            ev = saved["events"]
            tasks = [Task(**t) for t in ev["flying"]]
            self.events = Events(float(ev["now"]), int(ev["dispatched"]), int(ev["owed"]),
                                 {int(c): int(k) for c, k in ev["slots"].items()}, tasks)
            heapq.heapify(self.events.flying)
            self.models = {int(v): BroadcastReply(Broadcast(common=m["common"]), int(m["bytes"]), {}, 0.0)
                           for v, m in saved["models"].items()}
            self.version = int(saved["version"])
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{path}: not an async run's checkpoint (its event state: {exc!r}"[:300]
                                  + ")") from None
        n = self.cfg.data.num_clients
        if self.version != state.next_round or any(t.version not in self.models or not 0 <= t.client < n
                                                    for t in tasks):
            raise CheckpointError(f"{path}: its event state does not fit round {state.next_round - 1}")
        for t in tasks:
            self.fly(t)

    def checkpoint_state(self) -> dict[str, Any]:
        """The event state at the last version recorded, for the checkpoint (ResultsWriter adds it)."""
        ev = self.events
        kept = self.refs
        return {CHECKPOINT_KEY: {
            "version": self.version,
            "events": {"now": ev.now, "dispatched": ev.dispatched, "owed": ev.owed, "slots": dict(ev.slots),
                       "flying": [asdict(t) for t in ev.flying]},
            "models": {v: {"common": m.broadcast.common, "bytes": m.common_bytes}
                       for v, m in self.models.items() if v in kept}}}

    def run(self, state: RunState, callbacks: Callbacks) -> RunStatus:
        """Versions from `state.next_round` on (a resumed run's events from its checkpoint), each handed to the
        callbacks once recorded."""
        if state.next_round > 0:
            self.restore(state)
        for cb in callbacks.items:
            if isinstance(cb, ResultsWriter):
                cb.extra = self.checkpoint_state
        if self.version not in self.models:
            self.models[self.version] = self._broadcast()
        self.seconds = self._seconds(self.models[self.version].common_bytes)
        ev = self.events
        if state.next_round == 0 and not ev.flying and ev.dispatched == 0:
            ev.owed = self.concurrency  # the first C dispatches, as many as are online at 0 (the rest wait)
        span = _Span(ev.now)
        while True:
            nxt = ev.flying[0] if ev.flying else None
            if ev.owed and (nxt is None or nxt.arrival > ev.now):
                on = self.online_at(ev.now)
                ready = len(self.free) if on is None else int((on & ~self.busy).sum())
                if ready:
                    count = min(ev.owed, ready)
                    self.dispatch(count, on)
                    ev.owed -= count
                    continue
                wake = self.next_free_online(ev.now)  # nobody free is online: the dispatch waits for one
                if nxt is None or wake < nxt.arrival:
                    ev.now = wake
                    continue
            assert nxt is not None, "clients are always in flight"
            heapq.heappop(ev.flying)
            ev.now, ev.owed = nxt.arrival, ev.owed + 1
            new = self.apply(nxt, span)
            self.land(nxt)
            if new:
                status = self.record_version(state, span, callbacks)
                if status is not None:
                    return status
                span = _Span(ev.now)

    def _broadcast(self) -> BroadcastReply:
        return self.backend.server.broadcast(self.phase, RoundInfo(self.version, self.phase.name, [], [], {}))

    def online_at(self, t: float) -> np.ndarray | None:
        """Who is online at t, every client (O(N)); None without an availability over time."""
        w = self.profiles.windows
        return None if w is None else online(w, np.arange(self.cfg.data.num_clients), t)

    def next_free_online(self, t: float) -> float:
        """The first time after t that a client not in flight comes online (a DataError when none ever does and no
        client is in flight to wait for)."""
        w = self.profiles.windows
        free = np.flatnonzero(~self.busy)  # O(N), as the online lookup over them
        wake = float(next_online(w, free, t).min()) if w is not None and len(free) else math.inf
        if not math.isfinite(wake) and not self.events.flying:
            source = w.source if w is not None else "participation.availability"
            raise DataError(f"{source}: no client is online at virtual time {t:g} or later, so no client can be "
                            "dispatched; give the trace a period or more intervals")
        return wake

    def dispatch(self, count: int, on: np.ndarray | None) -> None:
        """Dispatch `count` clients at `now`, one draw each among the available clients not in flight (all those not
        in flight when none is available), from the current version. With an availability over time only clients
        online now (`on`) are drawn (the caller counted at least `count`), and one whose interval ends before it would
        arrive is marked offline: it is never trained, and its update is lost."""
        ev, cfg = self.events, self.cfg
        n = cfg.data.num_clients
        avail = self.profiles.availability
        some_away = self.some_away
        w = self.profiles.windows
        for _ in range(count):
            if some_away or on is not None:
                g = streams.numpy_generator(cfg.seed, DISPATCH_STREAM, ev.dispatched)
                free = ~self.busy if on is None else ~self.busy & on
                up = free & (g.random(n) < avail) if some_away else free
                pool = np.flatnonzero(up) if up.any() else np.flatnonzero(free)
                c = int(pool[g.integers(len(pool))])
            else:  # every client available: the stream's seed picks among the free ones, in id order (31 bits)
                c = self.free.kth(streams.seed(cfg.seed, DISPATCH_STREAM, ev.dispatched) * len(self.free) >> 31)
            slot = ev.slots.get(c, 0)
            ev.slots[c] = slot + 1
            arrival = ev.now + float(self.seconds[c])
            gone = w is not None and float(online_until(w, np.array([c]), ev.now)[0]) < arrival
            task = Task(arrival, c, ev.dispatched, self.version, slot, ev.now, gone)
            heapq.heappush(ev.flying, task)
            self.fly(task)
            ev.dispatched += 1

    def fly(self, task: Task) -> None:
        """Count `task` in flight: its client busy, its start version referenced, its training due."""
        self.busy[task.client] = True
        self.free.take(task.client)
        self.refs[task.version] = self.refs.get(task.version, 0) + 1
        self.untrained.append(task)

    def land(self, task: Task) -> None:
        """`task` arrived: its client free, its start version's model dropped once no client in flight needs it."""
        self.busy[task.client] = False
        self.free.put(task.client)
        self.refs[task.version] -= 1
        if not self.refs[task.version]:
            del self.refs[task.version]
            if task.version != self.version:
                self.models.pop(task.version, None)

    def train(self, span: _Span) -> None:
        """Train every dispatched client not yet trained: one phase call per (start version, seeds' phase index)."""
        groups: dict[tuple[int, int], list[Task]] = {}
        for t in self.untrained:
            if not t.offline:  # it leaves before it arrives: nothing of it is computed
                groups.setdefault((t.version, t.slot), []).append(t)
        self.untrained = []
        W = self.backend.num_workers
        steps = self.cfg.train.steps
        for (version, slot), tasks in sorted(groups.items()):
            by_client = {t.client: t for t in tasks}
            clients = sorted(by_client)
            cost = {c: steps or max(int(self.num_samples[c]), 1) for c in clients}
            assignments = self.assign(clients, W, cost)
            t0 = time.perf_counter()
            replies, failed = self.backend.run_phase(version, slot, self.phase, self.models[version].broadcast,
                                                     assignments, [], self.cfg.runtime.round_timeout_s)
            span.clients_s += time.perf_counter() - t0
            for w, reply in replies.items():
                for o in reply.outcomes:
                    self.results[by_client[o.client_id].dispatch] = (o, w)
            for w, lost in failed.items():  # a worker that returned nothing: each of its clients failed
                for c in assignments.get(w, []):
                    err = ClientFailedError(c, version, self.phase.name, lost.error_type, lost.message, lost.traceback)
                    self.results[by_client[c].dispatch] = (ClientOutcome(c, "failed", error=err), w)
            if failed:
                self.sim.replace_workers(sorted(failed))

    def apply(self, task: Task, span: _Span) -> bool:
        """Apply one arrival (training it, and every other untrained client in flight, first); whether it made a new
        server version."""
        if task.offline:
            return self.lost(task, span)
        if task.dispatch not in self.results:
            self.train(span)
        outcome, worker = self.results.pop(task.dispatch)
        c = task.client
        staleness = self.version - task.version
        sent = self.models[task.version]
        down = sent.common_bytes + sent.per_client_bytes.get(c, 0)
        span.bytes_down += down
        row: dict[str, Any] = {
            "round": self.version, "phase": self.phase.name, "client": c, "worker": self.backend.worker_of(worker),
            "arch": self.sim.archs[c], "samples": int(self.num_samples[c]), "status": outcome.status,
            "virtual_duration": task.arrival - task.start, "bytes_up": 0, "bytes_down": down,
            "wall_s": outcome.seconds, "dispatch": task.dispatch, "start_version": task.version,
            "dispatch_time": task.start, "arrival_time": task.arrival, "staleness": staleness,
            **self.sim.roles.get(c, {})}
        if outcome.result is not None:
            row.update({k: float(v) for k, v in outcome.result.metrics.items()})
        new = False
        if outcome.status == "ok":
            self.consecutive_failures = 0
            row["bytes_up"] = outcome.bytes_up
            span.bytes_up += outcome.bytes_up
            span.staleness.append(staleness)
            info = Arrival(self.version, self.phase.name, [c], [c], {c: int(self.num_samples[c])},
                           staleness=staleness, start_version=task.version, time=task.arrival)
            step = self.backend.server.step(self.phase, [WorkerReply([outcome])], info)
            span.server_s += step.seconds
            metrics = dict(step.metrics)
            new = bool(metrics.pop(NEW_VERSION, 0))
            span.metrics.update({f"{self.phase.name}/{k}": v for k, v in metrics.items()})
        else:
            span.failures += 1
            self.consecutive_failures += 1
            if outcome.error is not None:
                e = outcome.error
                row.update(failure_columns(e.error_type, e.error_message, e.traceback))
            self.sim.failed_steps += 1
            self.sim.failed_rounds.add(self.version)
            if self.consecutive_failures >= self.concurrency:
                raise RunFailedError(f"version {self.version}: the last {self.consecutive_failures} arrivals all "
                                     f"failed; client {c}: {row.get('error', 'no result')}")
        span.client_rows.append(row)
        if new:
            self.version += 1
            self.events.slots = {}
            self.models[self.version] = self._broadcast()
            if self.version - 1 not in self.refs:  # the old version's model, unless a client in flight needs it
                self.models.pop(self.version - 1, None)
        return new

    def lost(self, task: Task, span: _Span) -> bool:
        """An arrival whose client went offline before it: recorded with status offline (its download counted, no
        upload), applied to nothing."""
        c = task.client
        sent = self.models[task.version]
        down = sent.common_bytes + sent.per_client_bytes.get(c, 0)
        span.bytes_down += down
        span.offline += 1
        span.client_rows.append({
            "round": self.version, "phase": self.phase.name, "client": c, "worker": -1, "arch": self.sim.archs[c],
            "samples": int(self.num_samples[c]), "status": "offline", "virtual_duration": task.arrival - task.start,
            "bytes_up": 0, "bytes_down": down, "wall_s": 0.0, "dispatch": task.dispatch,
            "start_version": task.version, "dispatch_time": task.start, "arrival_time": task.arrival,
            "staleness": self.version - task.version, **self.sim.roles.get(c, {})})
        return False

    def record_version(self, state: RunState, span: _Span, callbacks: Callbacks) -> RunStatus | None:
        """The row of the version just made (evaluated at the eval cadence), handed to the callbacks."""
        r = self.version - 1
        cfg = self.cfg
        ok = len(span.staleness)
        mean = float(np.mean(span.staleness)) if ok else math.nan
        base = {"round": r, "participants": len(span.client_rows), "arrived": ok, "updates": ok,
                "stragglers": 0, "failures": span.failures, "bytes_up": span.bytes_up, "bytes_down": span.bytes_down,
                "virtual_round": self.events.now - span.start, "deadline": math.inf,
                "staleness_mean": mean, "staleness_max": float(max(span.staleness)) if ok else math.nan,
                "in_flight": len(self.events.flying), "wall_round_s": time.perf_counter() - span.t0,
                "wall_clients_s": span.clients_s, "wall_server_s": span.server_s, "wall_eval_s": 0.0,
                "clients_batched": 0, **span.metrics}
        if self.profiles.windows is not None:  # availability over time: the version's clients that went offline
            base["offline"] = span.offline
        rows = [{**base, "model": ""}]
        if (r + 1) % cfg.eval.every == 0 or r + 1 == cfg.rounds:
            t0 = time.perf_counter()
            evaluated = self.backend.server.evaluate()
            base.update(wall_eval_s=evaluated.seconds, wall_round_s=base["wall_round_s"] + time.perf_counter() - t0)
            rows = [{**base, **row} for row in (evaluated.rows or [{"model": ""}])]
        for row in rows:
            row["virtual_time"] = self.events.now
        state.virtual_time = self.events.now
        state.rounds.extend(rows)
        state.clients.extend(span.client_rows)
        state.next_round = r + 1
        last = r + 1 == cfg.rounds
        stop = callbacks.round_end(r, RoundRows(r, rows, span.client_rows, state.rounds, state.clients, last))
        if last:
            return "completed"
        return "stopped" if stop else None

