"""The round loop, written once: sample, schedule stragglers, run each phase on the backend, record.

`run()` is the one driver: the CLI, sweeps, `fedsim stress` and the bench all call it, and differ only in the
callbacks they attach (fedsim.runtime.callbacks; tables, checkpoints and meta.json are the default ones) and, for
the bench, in the `Inputs` a run starts from. Backends only move messages (fedsim.runtime.backend):
`LocalBackend` (in-process, the reference) and the Ray backend in actors/.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from fedsim.config.schema import RunConfig
from fedsim.data import Dataset
from fedsim.errors import AlgorithmError, CheckpointError, DataError, FedsimError, RunFailedError
from fedsim.method.contract import Phase, RoundInfo, get_algorithm
from fedsim.models.size import check_models
from fedsim.persist.checkpoint import (
    load_run_checkpoint,
    pack,
    read_manifest,
    state_mismatch,
    verified_round,
    verify_checkpoint,
)
from fedsim.persist.storage import Location, StorePath, location
from fedsim.plugins import PluginSources
from fedsim.results.tables import failure_columns, read_table, table_rows, update_meta
from fedsim.runtime.availability import next_online, online, online_until
from fedsim.runtime.backend import Backend, BroadcastReply, owner
from fedsim.runtime.callbacks import Callback, Callbacks, RoundRows, RunInfo, RunStatus, default_callbacks
from fedsim.runtime.clock import Profiles, Schedule, durations, make_profiles, sample_round, schedule
from fedsim.runtime.rundir import NewRunDir, RunLock, planned_run_dir, resume_config
from fedsim.runtime.setup import AnyPartition, client_archs, load_data, make_partition
from fedsim.runtime.signals import shielded
from fedsim.runtime.tracking import tracking_callbacks
from fedsim.runtime.worker import WorkerReply
from fedsim.transforms import check_availability, check_round
from fedsim.transforms.compression import keeps_client_state, predicted_upload
from fedsim.transforms.secagg import EXTRA_ROUND_TRIPS

log = logging.getLogger("fedsim.loop")


@dataclass(frozen=True)
class Inputs:
    """What a run starts from; by default all derived from its config. A harness that brings its own data,
    partition, client draws or initial server state (the bench's prepared folder) sets them here."""

    data: Callable[[RunConfig], Dataset] = load_data
    partition: Callable[[RunConfig, Dataset], AnyPartition] = make_partition
    draw: Callable[[RunConfig, int, Profiles], np.ndarray] = sample_round  # (cfg, round, profiles) -> client ids
    initial_state: Callable[[Any], Any] | None = None  # the algorithm's fresh server state -> the one to start from


def assign(clients: list[int], num_workers: int, cost: dict[int, int] | None = None) -> dict[int, list[int]]:
    """Each client's worker for one phase: its owner, or, given `cost` (clients without state), the costliest
    first to the least-loaded worker, so no worker idles while another trains the round's largest shards."""
    out: dict[int, list[int]] = {}
    if cost is None or num_workers == 1:
        for c in sorted(clients):
            out.setdefault(owner(c, num_workers), []).append(c)
        return out
    load = [0] * num_workers
    for c in sorted(clients, key=lambda c: (-cost[c], c)):
        w = min(range(num_workers), key=lambda i: (load[i], i))
        load[w] += cost[c]
        out.setdefault(w, []).append(c)
    return {w: sorted(cs) for w, cs in sorted(out.items())}


@dataclass
class _RoundRecord:
    """What one round accumulates across its phases."""

    round: int
    schedule: Schedule
    num_samples: dict[int, int]
    status: dict[tuple[int, int], str] = field(default_factory=dict)  # (phase index, client) -> status
    client_rows: list[dict] = field(default_factory=list)
    metrics: dict[str, Any] = field(default_factory=dict)
    bytes_up: int = 0
    bytes_down: int = 0
    failures: int = 0
    clients_s: float = 0.0
    batched: int = 0  # client steps the workers' batched trainer ran (runtime.batch_clients)


@dataclass(frozen=True)
class _Trained:
    """A round trained and aggregated: its row so far (without the evaluation), client rows and virtual seconds."""

    round: int
    base: dict[str, Any]
    client_rows: list[dict]
    virtual_round: float
    evaluate: bool  # whether the round is evaluated (eval.every, the last round, a finished method)


@dataclass
class RunState:
    """What the loop carries between rounds (and restores from a checkpoint)."""

    next_round: int = 0
    virtual_time: float = 0.0
    rounds: list[dict] = field(default_factory=list)
    clients: list[dict] = field(default_factory=list)


class Simulation:
    """One run of a config on a backend: setup, restore, and the rounds; `run()` below drives it."""

    def __init__(self, cfg: RunConfig, backend: Backend, run_dir: Location, inputs: Inputs | None = None) -> None:
        self.cfg, self.backend, self.run_dir = cfg, backend, run_dir
        self.inputs = inputs or Inputs()
        self.failed_steps = 0  # client steps that failed, and the rounds they failed in
        self.failed_rounds: set[int] = set()
        self.ckpt_path = run_dir / "checkpoints" / "last.pt"

    def setup(self) -> None:
        cfg = self.cfg
        data = self.inputs.data(cfg)
        from fedsim.runtime.local import LocalBackend

        # before any model is built: one too large for this machine is one line, not an allocator's traceback
        check_models(cfg, data.input_shape, data.num_classes, isinstance(self.backend, LocalBackend))
        self.part = self.inputs.partition(cfg, data)
        self.num_samples = self.part.num_samples()
        from fedsim.results.partition_report import write_once

        # partition.parquet, once: a resumed run reads back the numbers of the one it started with
        self.partition_stats = write_once(self.run_dir, self.part, data.y_train, data.y_test, data.num_classes)
        self.archs = client_archs(cfg)
        from fedsim.transforms.robustness import check_classes, malicious_clients

        check_classes(cfg, data.num_classes)  # before any worker starts
        bad = malicious_clients(cfg)  # each client's role, a clients.parquet column when the run has attackers
        self.roles = {c: {"role": "malicious" if c in bad else "benign"} for c in range(cfg.data.num_clients)} \
            if cfg.attack.kind != "none" else {}
        self.algorithm = get_algorithm(cfg.algorithm.name)
        # error feedback's residuals pin clients to their workers, as a method's own client states do
        self.balance = self.algorithm.stateless_clients(cfg) and not keeps_client_state(cfg)
        arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
        meta = {"num_classes": data.num_classes, "mean": tuple(data.mean), "std": tuple(data.std),
                "extras": data.extras}
        del data  # `arrays` is now the driver's only reference: the Ray backend frees it once it is shared
        self.profiles = make_profiles(cfg)  # before the workers start: a bad device trace costs no Ray start
        check_availability(cfg, self.profiles.availability)
        t0 = time.perf_counter()
        self.backend.start(cfg, arrays, self.part, meta, self.run_dir)
        self.startup_s = time.perf_counter() - t0
        if self.inputs.initial_state is not None:
            self.backend.server.set_state(self.inputs.initial_state(self.backend.server.get_state()))
        try:  # a state class missing @register_state fails now, not at round 0's checkpoint
            if cfg.results.checkpoint_every:
                pack(self.backend.server.get_state())
        except TypeError as exc:
            raise AlgorithmError(f"{self.cfg.algorithm.name}: its server state cannot be checkpointed: {exc}") \
                from None

    def describe(self) -> dict:
        """The backend as meta.json records it."""
        return {"backend": type(self.backend).__name__, "num_workers": self.backend.num_workers,
                "startup_s": self.startup_s, **self.backend.describe()}

    def restore(self, rounds: pd.DataFrame, clients: pd.DataFrame, saved_round: int | None = None) -> RunState:
        """Resume from the last checkpoint (of `saved_round`, as its manifest records), dropping table rows written
        after it."""
        ck = load_run_checkpoint(self.ckpt_path)
        verified_round(ck, self.ckpt_path, saved_round)
        fresh_state = self.backend.server.get_state()
        kept, fresh = type(ck["server_state"]), type(fresh_state)
        if kept is not fresh:
            raise CheckpointError(f"{self.ckpt_path}: does not fit this run (its server state is a {kept.__name__}; "
                                  f"{self.cfg.algorithm.name} keeps a {fresh.__name__})")
        misfit = state_mismatch(fresh_state, ck["server_state"]) or self._misfit(ck, rounds)
        if misfit:
            raise CheckpointError(f"{self.ckpt_path}: does not fit this run ({misfit})")
        try:
            self.backend.server.set_state(ck["server_state"])
            self.backend.load_states(ck["client_states"])
        except FedsimError:
            raise
        except Exception as exc:  # well-formed, but another run's or another method's state
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise CheckpointError(f"{self.ckpt_path}: does not fit this run ({lines[-1][:300]})") from None
        last = ck["round"]
        chain_state = ck.get("chain_state") or {}
        if not isinstance(chain_state, dict) or not all(isinstance(v, torch.Tensor) for v in chain_state.values()):
            raise CheckpointError(f"{self.ckpt_path}: malformed checkpoint (chain_state is not a dict of tensors)")
        saved = rounds[rounds["round"] == last]
        if len(saved):  # the chain's state after that round (the adaptive clip), from its columns
            self.backend.server.resume_chain({k: float(v) for k, v in saved.iloc[-1].items()
                                              if isinstance(k, str) and k.startswith("privacy/") and pd.notna(v)},
                                             chain_state)
        return RunState(last + 1, ck["virtual_time"], table_rows(rounds[rounds["round"] <= last]),
                        table_rows(clients[clients["round"] <= last]))

    def _misfit(self, ck: dict, rounds: pd.DataFrame) -> str | None:
        """What in a checkpoint's bookkeeping contradicts this run's tables and clients, or None."""
        last, done = ck["round"], (int(rounds["round"].max()) if len(rounds) else -1)
        if not 0 <= last <= done:
            return f"it is of round {last}, and rounds.parquet ends at round {done}"
        if not math.isfinite(ck["virtual_time"]) or ck["virtual_time"] < 0:
            return f"virtual_time {ck['virtual_time']}"
        strangers = [c for c in ck["client_states"] if not 0 <= c < len(self.num_samples)]
        if strangers:
            return f"a state for client {strangers[0]}, and the run has {len(self.num_samples)} clients"
        return None

    def run(self, state: RunState, callbacks: Callbacks) -> RunStatus:
        """The rounds from `state.next_round` on, each handed to the callbacks once recorded. A resumed run whose
        method finished after its last saved round (a one-shot method) trains no further round. In async mode the
        rounds are server versions, made by clients arriving on the virtual clock (fedsim.runtime.async_run)."""
        if self.cfg.participation.mode == "async":
            from fedsim.runtime.async_run import AsyncRun

            return AsyncRun(self, assign).run(state, callbacks)
        if state.next_round > 0 and self.backend.server.finished(state.next_round - 1):
            return "completed"
        for r in range(state.next_round, self.cfg.rounds):
            status = self.record(state, self.train_round(r, state.virtual_time), callbacks)
            if status is not None:
                return status
        return "completed"

    def record(self, state: RunState, trained: _Trained, callbacks: Callbacks) -> RunStatus | None:
        """Evaluate `trained` (when due), add its rows to `state` and hand them to the callbacks; how the run ends
        there ("completed" after its last round, "stopped" when a callback asked), or None to go on."""
        r = trained.round
        rows, clients = self.round_rows(trained), trained.client_rows
        state.virtual_time += trained.virtual_round
        for row in rows:
            row["virtual_time"] = state.virtual_time
        state.rounds.extend(rows)
        state.clients.extend(clients)
        state.next_round = r + 1
        last = r + 1 == self.cfg.rounds or self.backend.server.finished(r)
        stop = callbacks.round_end(r, RoundRows(r, rows, clients, state.rounds, state.clients, last))
        if last:
            return "completed"
        return "stopped" if stop else None

    def train_round(self, r: int, start: float = 0.0) -> _Trained:
        """Sample and schedule the round that is due at virtual time `start`, and run its phases in order."""
        cfg, backend = self.cfg, self.backend
        t_round = time.perf_counter()
        due = start
        profiles, start = self.online_at(start)
        sampled = np.asarray(self.inputs.draw(cfg, r, profiles))
        phases = backend.server.phases(r)
        for phase in phases:
            self.algorithm.check_phase(phase)
        check_round(cfg, phases)  # under DP: one model-update phase a round, or the run stops here
        ids = [int(c) for c in sampled]
        n_of = {c: int(self.num_samples[c]) for c in ids}
        sent = backend.server.broadcast(phases[0], RoundInfo(r, phases[0].name, ids, ids, n_of))
        server_s = sent.seconds
        # predicted durations decide lateness before anything is computed (uploads assumed the uncompressed
        # download's size, compressed as the config says)
        down = np.array([sent.common_bytes + sent.per_client_bytes.get(c, 0) for c in ids], dtype=float)
        up = predicted_upload(cfg, np.array([sent.dense_bytes(c) for c in ids], dtype=float))
        trips = 1 + (EXTRA_ROUND_TRIPS if cfg.privacy.secure_aggregation != "none" else 0)  # SecAgg's messages
        dur = durations(cfg, profiles, sampled, self.num_samples[sampled], down, up, trips)
        until = online_until(profiles.windows, sampled, start) if profiles.windows is not None else None
        sch = schedule(cfg, sampled, dur, None if until is None else until < start + dur)  # offline before the end
        kept, late = [int(c) for c in sch.participants], [int(c) for c in sch.late]
        offline = [int(c) for c in sch.offline]
        rec = _RoundRecord(r, sch, {c: n_of[c] for c in kept})
        arrived = [c for c in kept if c not in set(late)]
        for pi, phase in enumerate(phases):
            if pi > 0:
                sent = backend.server.broadcast(phase, RoundInfo(r, phase.name, kept, arrived, rec.num_samples))
                server_s += sent.seconds
            replies = self.run_phase(rec, pi, phase, sent, arrived, late if pi == 0 else [],
                                     offline if pi == 0 else [])
            arrived = [c for c in arrived if rec.status.get((pi, c)) == "ok"]
            step = backend.server.step(phase, [replies[w] for w in sorted(replies)],
                                       RoundInfo(r, phase.name, kept, arrived, rec.num_samples))
            server_s += step.seconds
            rec.metrics.update({f"{phase.name}/{k}": v for k, v in step.metrics.items()})
            rec.metrics.update(step.round_columns)
            for row in rec.client_rows if step.client_columns else ():  # the chain's per client (kept, ...)
                if row["phase"] == phase.name and row["client"] in step.client_columns:
                    row.update(step.client_columns[row["client"]])
        evaluate = (r + 1) % cfg.eval.every == 0 or r + 1 == cfg.rounds or backend.server.finished(r)
        vround = min(sch.deadline, max(sch.duration[c] for c in kept)) if kept else 0.0
        if not kept and offline and until is not None:  # the round lasts until the last of its clients has left
            vround = min(sch.deadline, float(until.max() - start))
        vround += start - due  # waiting for a client to come online
        late_kept = sum(rec.status.get((0, c)) != "failed" for c in late)  # a late client that raised is a failure
        base = {"round": r, "participants": len(kept), "arrived": len(arrived), "stragglers": late_kept,
                "over_selected": len(sch.over_selected), "failures": rec.failures, "bytes_up": rec.bytes_up,
                "bytes_down": rec.bytes_down, "virtual_round": vround, "deadline": sch.deadline,
                "wall_round_s": time.perf_counter() - t_round, "wall_clients_s": rec.clients_s,
                "wall_server_s": server_s, "wall_eval_s": 0.0, "clients_batched": rec.batched, **rec.metrics}
        if profiles.online is not None:  # availability over time: who was online as the round started, who left
            base.update(clients_online=int(profiles.online.sum()), offline=len(offline))
        return _Trained(r, base, rec.client_rows, vround, evaluate)

    def online_at(self, t: float) -> tuple[Profiles, float]:
        """The profiles of a round due at virtual time t, with who is online as it starts, and when it starts: at t,
        or, when no client is online then, as soon as one is (a DataError when none ever is again)."""
        w = self.profiles.windows
        if w is None:
            return self.profiles, t
        everyone = np.arange(w.num_clients)
        on = online(w, everyone, t)
        for _ in range(100):  # each pass moves past at least one interval (an instant that rounding misses)
            if on.any():
                return replace(self.profiles, online=on), t
            t = float(next_online(w, everyone, t).min())
            if not math.isfinite(t):
                break
            on = online(w, everyone, t)
            if not on.any():
                t = float(np.nextafter(t, math.inf))
        raise DataError(f"{w.source}: no client is online at virtual time {t:g} or later, so no round can start; "
                        "give the trace a period (FedScale's finish_time, a CSV's period column) or more intervals")

    def round_rows(self, trained: _Trained) -> list[dict]:
        """The round's rows of rounds.parquet, one per global model the evaluation scores (one unscored row when
        the round is not evaluated)."""
        if not trained.evaluate:
            return [{**trained.base, "model": ""}]
        t0 = time.perf_counter()
        measured_s = self.measure(trained.round)
        evaluated = self.backend.server.evaluate()
        base = {**trained.base, "wall_eval_s": evaluated.seconds + measured_s}
        base["wall_round_s"] += time.perf_counter() - t0  # a server actor's round trip included
        return [{**base, **row} for row in (evaluated.rows or [{"model": ""}])]

    def measure(self, r: int) -> float:
        """The method's evaluation-only phase before round r's evaluation (Algorithm.measurement), when it has one:
        run on the workers that own its clients, its results folded into the server's state; its wall seconds. A
        measurement, not communication: no bytes, no virtual time, no clients.parquet rows. A client whose step fails
        keeps what the state held (a warning counts them); a dead worker is replaced as in a round."""
        t0 = time.perf_counter()
        m = self.backend.server.measure(r)
        if m is None:
            return time.perf_counter() - t0
        clients = m.info.participants
        assignments = assign(clients, self.backend.num_workers)
        replies, failed = self.backend.run_phase(r, 0, m.phase, m.broadcast, assignments, [],
                                                 self.cfg.runtime.round_timeout_s)
        if failed:
            self.replace_workers(sorted(failed))
        answered = {o.client_id for reply in replies.values() for o in reply.outcomes if o.status == "ok"}
        if len(answered) < len(clients):
            log.warning("round %d: %s failed for %d of %d clients; they keep their last values", r, m.phase.name,
                        len(clients) - len(answered), len(clients))
        self.backend.server.measured(m.phase, [replies[w] for w in sorted(replies)], m.info)
        return time.perf_counter() - t0

    def run_phase(self, rec: _RoundRecord, pi: int, phase: Phase, sent: BroadcastReply, arrived: list[int],
                  late: list[int], offline: Sequence[int] = ()) -> dict[int, WorkerReply]:
        """Run one phase on the workers and record every client's outcome (`offline`: clients that left before they
        finished, never run); returns the replies by worker."""
        common_b, per_b = sent.common_bytes, sent.per_client_bytes
        W = self.backend.num_workers
        skip = self.cfg.stragglers.skip_late
        # late clients downloaded too, and so did those that went offline
        rec.bytes_down += sum(common_b + per_b.get(c, 0) for c in [*arrived, *late, *offline])
        if sent.compressed:  # they hold the server's replica now (compression.download)
            self.backend.server.synced(sorted([*arrived, *late, *offline]))
        clients = arrived + ([] if skip else late)
        steps = self.cfg.train.steps
        cost = {c: steps or max(rec.num_samples.get(c, 0), 1) for c in clients} if self.balance else None
        assignments = assign(clients, W, cost)
        t0 = time.perf_counter()
        replies, failed = self.backend.run_phase(rec.round, pi, phase, sent.broadcast, assignments, late,
                                                 self.cfg.runtime.round_timeout_s)
        rec.clients_s += time.perf_counter() - t0
        rec.batched += sum(int(reply.info.get("batched", 0)) for reply in replies.values())
        if self.balance:
            kept = [c for reply in replies.values() for c in reply.info.get("kept_state", ())]
            if kept:  # balanced clients move between workers: a state kept in one would be lost
                raise AlgorithmError(f"{self.algorithm.__name__}: client {min(kept)} returned a state in phase "
                                     f"{phase.name!r}, but {self.algorithm.__name__}.stateless_clients(config) is "
                                     "True, so clients move between workers and the state would be lost; override "
                                     "stateless_clients to return False")

        def row(c: int, w: int, status: str, bytes_up: int, wall: float, **extra: Any) -> dict:
            rec.status[(pi, c)] = status
            rec.failures += status == "failed"
            up = bytes_up if status == "ok" else 0
            rec.bytes_up += up
            # the worker that served the slot: after a node loss, the survivor that took its clients over
            return {"round": rec.round, "phase": phase.name, "client": c, "worker": self.backend.worker_of(w),
                    "arch": self.archs[c], "samples": rec.num_samples.get(c, 0), "status": status,
                    "virtual_duration": rec.schedule.duration.get(c, math.nan), "bytes_up": up,
                    "bytes_down": common_b + per_b.get(c, 0), "wall_s": wall, **self.roles.get(c, {}), **extra}

        rows = []
        for w, reply in sorted(replies.items()):
            for o in reply.outcomes:
                extra: dict[str, Any] = {}
                if o.result is not None:
                    extra = {k: float(v) for k, v in o.result.metrics.items()}
                if o.status == "failed" and o.error is not None:
                    extra.update(failure_columns(o.error.error_type, o.error.error_message, o.error.traceback))
                rows.append(row(o.client_id, w, o.status, o.bytes_up, o.seconds, **extra))
        for w, lost in sorted(failed.items()):
            rows.extend(row(c, w, "failed", 0, math.nan, **failure_columns(lost.error_type, lost.message,
                                                                            lost.traceback))
                        for c in assignments.get(w, []))
        if failed:
            self.replace_workers(sorted(failed))
        if skip:
            rows.extend(row(c, owner(c, W), "late", 0, 0.0) for c in late)
        rows.extend(row(c, owner(c, W), "offline", 0, 0.0, samples=int(self.num_samples[c])) for c in offline)
        rows.sort(key=lambda x: x["client"])
        rec.client_rows.extend(rows)
        on_dead = {c for w in failed for c in assignments.get(w, [])}  # a dead worker is replaced: not the run's fault
        ran = set(clients) - on_dead
        self.note_failures(rec.round, phase.name, [r for r in rows if r["client"] in ran])
        return replies

    def note_failures(self, round: int, phase: str, ran: list[dict]) -> None:
        """Count the failed clients among the rows of those that ran; when every one failed, stop the run naming the
        first one's error (a method or data fault, not one client's bad luck)."""
        failed = [r for r in ran if r["status"] == "failed"]
        self.failed_steps += len(failed)
        if failed:
            self.failed_rounds.add(round)
        if ran and len(failed) == len(ran):
            first = failed[0]
            raise RunFailedError(f"round {round}, phase {phase!r}: every client failed ({len(failed)} of "
                                 f"{len(ran)}); the first, client {first['client']}: "
                                 f"{first.get('error', 'no result')}")

    def replace_workers(self, ws: list[int]) -> None:
        """Restart dead workers, together; their clients get their states back from the last checkpoint, if any
        (the clients of every slot the backend says the dead workers served: after a node loss, one worker may
        serve several). Each event is logged once, and meta.json's placement is rewritten to where workers are now."""
        restarted = self.backend.restart_workers(ws)
        if self.ckpt_path.exists():
            ck = load_run_checkpoint(self.ckpt_path)
            n, lost = self.backend.num_workers, set(restarted.slots)
            self.backend.load_states({c: s for c, s in ck["client_states"].items() if owner(c, n) in lost},
                                     workers=restarted.slots)
            states = f"their clients' personal states come back from round {ck['round']}'s checkpoint"
        elif self.cfg.results.checkpoint_every:
            states = "before the first checkpoint: their clients' personal states start afresh"
        else:
            states = "results.checkpoint_every=0: their clients' personal states start afresh"
        for event in restarted.events:
            log.warning("%s; %s", event, states)
        update_meta(self.run_dir, self.describe())


def resume_tables(run_dir: Location) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tables a checkpointed run wrote; a missing or corrupt one, or one whose rows are not numbered by round,
    fails now, before anything starts (the rows kept are chosen by round: a bad one would drop rows)."""
    tables = []
    for name in ("rounds.parquet", "clients.parquet"):
        table = read_table(run_dir / name)
        col = table.get("round")
        if col is None or not pd.api.types.is_integer_dtype(col.dtype) or col.isna().any() or \
                (len(col) and col.min() < 0):
            what = ("has no round column" if col is None
                    else f"has a round column of {col.dtype} values, not round numbers")
            raise CheckpointError(f"{run_dir / name}: {what} (the run folder is damaged)")
        tables.append(table)
    return tables[0], tables[1]


def run(cfg: RunConfig | None = None, backend: Backend | None = None, resume: str | Path | StorePath | None = None,
        callbacks: Sequence[Callback] = (), inputs: Inputs | None = None,
        plugin_sources: PluginSources | None = None) -> Location:
    """Run (or resume) a simulation; returns the run folder (a Path, or a StorePath for a run kept in a store).

    A new run's folder is claimed before anything is written (fedsim.runtime.rundir), and removed again if the
    run stops before its first round is written: a run that cannot start leaves nothing behind. A resumed run keeps
    its saved config (see fedsim.runtime.rundir), and imports its plugins only from what the user has
    (`plugin_sources`: fedsim.plugins.for_resume). `callbacks` run after the default ones (meta.json, tables and
    checkpoints, then the trackers `cfg.tracking` turns on); any of them may stop the run after a round
    (fedsim.runtime.callbacks).
    """
    from fedsim.runtime.local import LocalBackend

    tables, saved_round = None, None
    try:
        if resume is not None:
            run_dir = location(resume, "--resume")
            cfg = resume_config(run_dir, plugin_sources)
            saved_round = verify_checkpoint(run_dir / "checkpoints", read_manifest(run_dir / "checkpoints"))
            if saved_round is not None:
                tables = resume_tables(run_dir)
        else:
            if cfg is None:
                raise ValueError("run() needs a config or a run folder to resume")
            run_dir = planned_run_dir(cfg)
    except BaseException:
        if backend is not None:  # one the caller made, perhaps already starting Ray
            backend.shutdown()
        raise
    backend = backend or LocalBackend()
    sim: Simulation | None = None
    hooks = Callbacks([])
    created: NewRunDir | None = None
    held: RunLock | None = None
    info: RunInfo | None = None
    status: RunStatus = "failed"
    try:
        if resume is None:  # the folder's name is claimed before anything is written (another run may want it)
            created = NewRunDir(run_dir, cfg)
            run_dir = created.path
        else:
            held = RunLock(run_dir)
        sim = Simulation(cfg, backend, run_dir, inputs)
        # first: a tracking library that is not installed fails the run before anything starts
        hooks = Callbacks([*default_callbacks(backend), *tracking_callbacks(cfg), *callbacks])
        sim.setup()
        state = sim.restore(*tables, saved_round) if tables is not None else RunState()
        info = RunInfo(cfg, run_dir, sim.describe(), state.next_round, sim.partition_stats)
        hooks.setup_end(info)
        status = sim.run(state, hooks)
    except KeyboardInterrupt:
        status = "interrupted"
        raise
    finally:
        with shielded():
            try:
                if sim is not None and sim.failed_steps and status != "failed":
                    log.warning("%d client step(s) failed in %d round(s); their errors and tracebacks are in %s "
                                "(rows with status 'failed')", sim.failed_steps, len(sim.failed_rounds),
                                run_dir / "clients.parquet")
                if info is not None:
                    _end(hooks, info, status)
            finally:
                backend.shutdown()
                if created is not None:
                    if created.has_rounds():
                        created.release()
                    else:
                        created.remove()
                if held is not None:
                    held.release()
    return run_dir


def _end(hooks: Callbacks, info: RunInfo, status: RunStatus) -> None:
    """Tell the callbacks how the run ended; when it ended with an error, theirs must not hide it."""
    if status in ("completed", "stopped"):
        hooks.run_end(info, status)
        return
    try:
        hooks.run_end(info, status)
    except Exception:  # the run's own error is already on its way up
        pass
