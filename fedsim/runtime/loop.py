"""The round loop, written once: sample, schedule stragglers, run each phase on the backend, record, checkpoint.

Backends only move messages: `LocalBackend` (in-process, the reference) and the Ray backend in actors/.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd

from fedsim.algorithms import get_algorithm
from fedsim.algorithms.base import Broadcast, Phase, RoundInfo
from fedsim.checkpoint import load_run_checkpoint, save_checkpoint
from fedsim.config import RunConfig
from fedsim.errors import CheckpointError, FedsimError
from fedsim.results import CLIENT_COLUMNS, ROUND_COLUMNS, failure_columns, read_table, write_meta, write_table
from fedsim.runtime.clock import Schedule, durations, make_profiles, sample_round, schedule
from fedsim.runtime.rundir import NewRunDir, planned_run_dir, resume_config
from fedsim.runtime.setup import Partition, client_archs, load_data, make_partition
from fedsim.runtime.signals import shielded
from fedsim.runtime.worker import WorkerReply


class Backend(Protocol):
    """Where workers and the server live. `run_phase` returns replies by worker and failures by worker."""

    num_workers: int

    def start(self, cfg: RunConfig, arrays: dict, part: Partition, meta: dict, run_dir: Path) -> None:
        """Start workers and server. A backend that copies the data elsewhere may empty `arrays`."""

    def server(self, method: str, *args: Any) -> Any: ...
    def run_phase(self, round: int, phase_index: int, phase: Phase, bc: Broadcast,
                  assignments: dict[int, list[int]], late: list[int],
                  timeout: float) -> tuple[dict[int, WorkerReply], dict[int, str]]: ...
    def restart_worker(self, index: int) -> None: ...
    def export_states(self) -> dict[int, Any]: ...
    def load_states(self, states: dict[int, Any], workers: list[int] | None = None) -> None: ...
    def shutdown(self) -> None: ...


def owner(client_id: int, num_workers: int) -> int:
    """The worker that hosts a client, fixed for the whole run so personal state stays put."""
    return client_id % num_workers


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


@dataclass
class RunState:
    """What the loop carries between rounds (and restores from a checkpoint)."""

    next_round: int = 0
    virtual_time: float = 0.0
    rounds: list[dict] = field(default_factory=list)
    clients: list[dict] = field(default_factory=list)


def new_run_dir(cfg: RunConfig) -> Path:
    """results/<run_id>/, created now, with a timestamped id by default; never reuses a folder holding a run."""
    path = planned_run_dir(cfg)
    path.mkdir(parents=True, exist_ok=True)
    return path


class Simulation:
    """One run of a config on a backend."""

    def __init__(self, cfg: RunConfig, backend: Backend, run_dir: Path,
                 progress: Callable[[int, dict], None] | None = None) -> None:
        self.cfg, self.backend, self.run_dir, self.progress = cfg, backend, run_dir, progress
        self.ckpt_path = run_dir / "checkpoints" / "last.pt"

    def setup(self) -> None:
        cfg = self.cfg
        data = load_data(cfg)
        self.part = make_partition(cfg, data)
        self.num_samples = self.part.train.lengths()
        self.archs = client_archs(cfg)
        self.balance = get_algorithm(cfg.algorithm.name).stateless_clients(cfg)
        arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
        meta = {"num_classes": data.num_classes, "mean": tuple(data.mean), "std": tuple(data.std),
                "extras": data.extras}
        del data  # `arrays` is now the driver's only reference: the Ray backend frees it once it is shared
        t0 = time.perf_counter()
        self.backend.start(cfg, arrays, self.part, meta, self.run_dir)
        self.startup_s = time.perf_counter() - t0
        self.profiles = make_profiles(cfg)

    def restore(self, rounds: pd.DataFrame, clients: pd.DataFrame) -> RunState:
        """Resume from the last checkpoint, dropping table rows written after it."""
        ck = load_run_checkpoint(self.ckpt_path)
        kept, fresh = type(ck["server_state"]), type(self.backend.server("get_state"))
        if kept is not fresh:
            raise CheckpointError(f"{self.ckpt_path}: does not fit this run (its server state is a {kept.__name__}; "
                                  f"{self.cfg.algorithm.name} keeps a {fresh.__name__})")
        try:
            self.backend.server("set_state", ck["server_state"])
            self.backend.load_states(ck["client_states"])
        except FedsimError:
            raise
        except Exception as exc:  # well-formed, but another run's or another method's state
            lines = str(exc).strip().splitlines() or [type(exc).__name__]
            raise CheckpointError(f"{self.ckpt_path}: does not fit this run ({lines[-1][:300]})") from None
        last = ck["round"]
        return RunState(last + 1, ck["virtual_time"], rounds[rounds["round"] <= last].to_dict("records"),
                        clients[clients["round"] <= last].to_dict("records"))

    def run(self, state: RunState | None = None) -> RunState:
        state = state or RunState()
        for r in range(state.next_round, self.cfg.rounds):
            row_list, client_rows, vround = self.run_round(r)
            state.virtual_time += vround
            for row in row_list:
                row["virtual_time"] = state.virtual_time
            state.rounds.extend(row_list)
            state.clients.extend(client_rows)
            state.next_round = r + 1
            done = r + 1 == self.cfg.rounds or self.backend.server("finished", r)
            every = self.cfg.results.checkpoint_every
            self.write(state, checkpoint=bool(every) and ((r + 1) % every == 0 or done), round=r)
            if self.progress:
                self.progress(r, row_list[0])
            if done:
                break
        return state

    def write(self, state: RunState, checkpoint: bool, round: int) -> None:
        """Tables first, then the checkpoint, so a resume never misses rows (it truncates extra ones).

        Ctrl-C and SIGTERM wait until both are written, so an interrupted run keeps its last round."""
        with shielded():
            write_table(state.rounds, self.run_dir / "rounds.parquet", ROUND_COLUMNS)
            write_table(state.clients, self.run_dir / "clients.parquet", CLIENT_COLUMNS)
            if checkpoint:
                save_checkpoint(self.ckpt_path, {"round": round, "virtual_time": state.virtual_time,
                                                 "server_state": self.backend.server("get_state"),
                                                 "client_states": self.backend.export_states()})

    def run_round(self, r: int) -> tuple[list[dict], list[dict], float]:
        """Sample and schedule the round, run its phases in order, evaluate; returns rows and virtual seconds."""
        cfg, backend = self.cfg, self.backend
        t_round = time.perf_counter()
        sampled = sample_round(cfg, r, self.profiles)
        phases: list[Phase] = backend.server("phases", r)
        ids = [int(c) for c in sampled]
        n_of = {c: int(self.num_samples[c]) for c in ids}
        bc, common_b, per_b, server_s = backend.server("broadcast", phases[0],
                                                       RoundInfo(r, phases[0].name, ids, ids, n_of))
        # predicted durations decide lateness before anything is computed (uploads assumed the download's size)
        down = np.array([common_b + per_b.get(c, 0) for c in ids], dtype=float)
        sch = schedule(cfg, sampled, durations(cfg, self.profiles, sampled, self.num_samples[sampled], down, down))
        kept, late = [int(c) for c in sch.participants], [int(c) for c in sch.late]
        rec = _RoundRecord(r, sch, {c: n_of[c] for c in kept})
        arrived = [c for c in kept if c not in set(late)]
        for pi, phase in enumerate(phases):
            if pi > 0:
                info = RoundInfo(r, phase.name, kept, arrived, rec.num_samples)
                bc, common_b, per_b, s = backend.server("broadcast", phase, info)
                server_s += s
            replies = self.run_phase(rec, pi, phase, bc, common_b, per_b, arrived, late if pi == 0 else [])
            arrived = [c for c in arrived if rec.status.get((pi, c)) == "ok"]
            m, s = backend.server("step", phase, [replies[w] for w in sorted(replies)],
                                  RoundInfo(r, phase.name, kept, arrived, rec.num_samples))
            server_s += s
            rec.metrics.update({f"{phase.name}/{k}": v for k, v in m.items()})
        eval_rows, eval_s = [{"model": ""}], 0.0
        if (r + 1) % cfg.eval.every == 0 or r + 1 == cfg.rounds or backend.server("finished", r):
            rows, eval_s = backend.server("evaluate")
            eval_rows = rows or eval_rows
        vround = min(sch.deadline, max(sch.duration[c] for c in kept)) if kept else 0.0
        base = {"round": r, "participants": len(kept), "arrived": len(arrived), "stragglers": len(late),
                "over_selected": len(sch.over_selected), "failures": rec.failures, "bytes_up": rec.bytes_up,
                "bytes_down": rec.bytes_down, "virtual_round": vround, "deadline": sch.deadline,
                "wall_round_s": time.perf_counter() - t_round, "wall_clients_s": rec.clients_s,
                "wall_server_s": server_s, "wall_eval_s": eval_s, **rec.metrics}
        return [{**base, **row} for row in eval_rows], rec.client_rows, vround

    def run_phase(self, rec: _RoundRecord, pi: int, phase: Phase, bc: Broadcast, common_b: int,
                  per_b: dict[int, int], arrived: list[int], late: list[int]) -> dict[int, WorkerReply]:
        """Run one phase on the workers and record every client's outcome; returns the replies by worker."""
        W = self.backend.num_workers
        skip = self.cfg.stragglers.skip_late
        rec.bytes_down += sum(common_b + per_b.get(c, 0) for c in arrived + late)  # late clients downloaded too
        clients = arrived + ([] if skip else late)
        steps = self.cfg.train.steps
        cost = {c: steps or max(rec.num_samples.get(c, 0), 1) for c in clients} if self.balance else None
        assignments = assign(clients, W, cost)
        t0 = time.perf_counter()
        replies, failed = self.backend.run_phase(rec.round, pi, phase, bc, assignments, late,
                                                 self.cfg.runtime.round_timeout_s)
        rec.clients_s += time.perf_counter() - t0

        def row(c: int, w: int, status: str, bytes_up: int, wall: float, **extra: Any) -> dict:
            rec.status[(pi, c)] = status
            rec.failures += status == "failed"
            up = bytes_up if status == "ok" else 0
            rec.bytes_up += up
            return {"round": rec.round, "phase": phase.name, "client": c, "worker": w, "arch": self.archs[c],
                    "samples": rec.num_samples.get(c, 0), "status": status,
                    "virtual_duration": rec.schedule.duration.get(c, math.nan), "bytes_up": up,
                    "bytes_down": common_b + per_b.get(c, 0), "wall_s": wall, **extra}

        rows = []
        for w, reply in sorted(replies.items()):
            for o in reply.outcomes:
                extra = {k: float(v) for k, v in o.result.metrics.items()} if o.result is not None else {}
                if o.status == "failed" and o.error is not None:
                    extra.update(failure_columns(o.error.error_type, o.error.error_message, o.error.traceback))
                rows.append(row(o.client_id, w, o.status, o.bytes_up, o.seconds, **extra))
        for w, err in sorted(failed.items()):
            rows.extend(row(c, w, "failed", 0, math.nan, **failure_columns("WorkerError", err))
                        for c in assignments.get(w, []))
            self.replace_worker(w)
        if skip:
            rows.extend(row(c, owner(c, W), "late", 0, 0.0) for c in late)
        rec.client_rows.extend(sorted(rows, key=lambda x: x["client"]))
        return replies

    def replace_worker(self, w: int) -> None:
        """Restart a dead worker; its clients get their states back from the last checkpoint, if any."""
        self.backend.restart_worker(w)
        if self.ckpt_path.exists():
            states = load_run_checkpoint(self.ckpt_path)["client_states"]
            self.backend.load_states({c: s for c, s in states.items()
                                      if owner(c, self.backend.num_workers) == w}, workers=[w])


def resume_tables(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """The tables a checkpointed run wrote; a missing or corrupt one fails now, before anything starts."""
    return read_table(run_dir / "rounds.parquet"), read_table(run_dir / "clients.parquet")


def run(cfg: RunConfig | None = None, backend: Backend | None = None, resume: str | Path | None = None,
        progress: Callable[[int, dict], None] | None = None,
        on_start: Callable[[Path], None] | None = None) -> Path:
    """Run (or resume) a simulation; returns the run folder.

    A new run's folder is created once data, partition and backend are ready (`on_start` is then called
    with it), and removed again if the run stops before its first round is written: a run that cannot
    start leaves nothing behind. A resumed run keeps its saved config (see fedsim.runtime.rundir).
    """
    from fedsim.runtime.local import LocalBackend

    tables = None
    if resume is not None:
        run_dir = Path(resume)
        cfg = resume_config(run_dir)
        if (run_dir / "checkpoints" / "last.pt").exists():
            tables = resume_tables(run_dir)
    else:
        if cfg is None:
            raise ValueError("run() needs a config or a run folder to resume")
        run_dir = planned_run_dir(cfg)
    backend = backend or LocalBackend()
    sim = Simulation(cfg, backend, run_dir, progress)
    created: NewRunDir | None = None
    try:
        sim.setup()
        if resume is None:
            created = NewRunDir(run_dir, cfg)
        state = sim.restore(*tables) if tables is not None else None
        write_meta(run_dir, {"backend": type(backend).__name__, "num_workers": backend.num_workers,
                             "startup_s": sim.startup_s, **getattr(backend, "describe", lambda: {})()})
        if on_start is not None:
            on_start(run_dir)
        sim.run(state)
    finally:
        with shielded():
            backend.shutdown()
            if created is not None and not created.has_rounds():
                created.remove()
    return run_dir
