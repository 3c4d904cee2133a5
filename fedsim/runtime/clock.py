"""Participation and stragglers on a virtual clock: who is sampled, how long each takes, who is late.

Every draw is seeded by (run seed, round), so the same clients are sampled and dropped whatever the
number of workers, and whether or not late clients are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from fedsim import rng as streams
from fedsim.config.schema import DistConfig, RunConfig, clients_per_round, sampling_rate
from fedsim.errors import DataError
from fedsim.runtime.availability import OnlineWindows
from fedsim.runtime.availability_sources import load_availability
from fedsim.runtime.csv_trace import client_column, number_column, read_csv


@dataclass
class Profiles:
    """Per-client device profile: compute speed (×), bandwidth (bytes/s), availability probability; with an
    availability over time, each client's online intervals (`windows`) and, for one round, who is online as it
    starts (`online`, which sampling draws from)."""

    speed: np.ndarray
    bandwidth: np.ndarray
    availability: np.ndarray
    windows: OnlineWindows | None = None
    online: np.ndarray | None = None


def _draw(rng: np.random.Generator, d: DistConfig, n: int) -> np.ndarray:
    if d.dist == "constant":
        return np.full(n, d.mean)
    if d.dist == "uniform":
        return rng.uniform(d.mean * (1 - d.sigma), d.mean * (1 + d.sigma), n).clip(min=1e-9)
    return d.mean * np.exp(d.sigma * rng.standard_normal(n))


def make_profiles(cfg: RunConfig) -> Profiles:
    """Draw device profiles from the configured distributions, or read them from a trace CSV; read or generate the
    availability over time (participation.availability: a trace file or diurnal)."""
    n, s, p = cfg.data.num_clients, cfg.stragglers, cfg.participation
    if s.trace:
        profiles = _read_trace(s.trace, n)
    else:
        rng = streams.numpy_generator(cfg.seed, "clock/profiles")
        speed = _draw(rng, s.speed, n)
        bw = _draw(rng, s.bandwidth_mbps, n) * 1e6 / 8
        profiles = Profiles(speed, bw, np.full(n, 1.0 if isinstance(p.availability, str) else p.availability))
    profiles.windows = load_availability(cfg)
    return profiles


TRACE_COLUMNS = ("client", "speed", "bandwidth_mbps")
SPEED_RANGE = (1e-6, 1e6)  # relative to the reference device: past these, virtual times overflow to inf or NaN
BANDWIDTH_RANGE = (1e-6, 1e9)  # Mbit/s: one bit a second to a petabit


def _read_trace(path: str, n: int) -> Profiles:
    """Profiles of clients 0..n-1 from a CSV with columns client, speed, bandwidth_mbps and optionally availability.

    Speeds and bandwidths must lie in SPEED_RANGE and BANDWIDTH_RANGE, availabilities in (0, 1]; each column is
    named once, and every client needs exactly one row (rows for other ids are ignored). Anything else is a
    DataError naming the file, the column and the first bad row (counted from 1 after the header), so a typo in a
    trace never turns into a silently wrong run.
    """
    key = "stragglers.trace"
    df, row_no = read_csv(path, key, (*TRACE_COLUMNS, "availability"), TRACE_COLUMNS)
    ids = client_column(df, key, path, row_no)
    _, first = np.unique(ids, return_index=True)
    dup = np.setdiff1d(np.arange(len(ids)), first)
    if len(dup):
        row = int(dup.min())
        raise DataError(f"{key}: {path} column client, row {row_no[row]}: client {ids[row]} appears more than once")
    absent = np.setdiff1d(np.arange(n), ids)
    if len(absent):
        raise DataError(f"{key}: {path} column client: no row for client {absent[0]} "
                        f"({len(absent)} of the {n} clients in data.num_clients have none)")
    rows = np.full(n, -1, dtype=np.int64)
    keep = ids < n
    rows[ids[keep]] = np.flatnonzero(keep)
    speed = number_column(df, "speed", key, path, row_no, rows, SPEED_RANGE, low_included=True)
    bandwidth = number_column(df, "bandwidth_mbps", key, path, row_no, rows, BANDWIDTH_RANGE, low_included=True)
    avail = number_column(df, "availability", key, path, row_no, rows, (0.0, 1.0)) \
        if "availability" in df.columns else np.ones(n)
    return Profiles(speed, bandwidth * 1e6 / 8, avail)


def sample_round(cfg: RunConfig, round: int, profiles: Profiles) -> np.ndarray:
    """Sorted client ids sampled for `round` among the available ones (over-selection included): those online as
    the round starts (`profiles.online`), each also available with its probability."""
    n = cfg.data.num_clients
    rng = streams.numpy_generator(cfg.seed, "participation", round)
    # all available: draw from range(n) without building it (the same draw as from np.arange(n))
    ok = rng.random(n) < profiles.availability if (profiles.availability < 1).any() else None
    if profiles.online is not None:
        ok = profiles.online if ok is None else ok & profiles.online
    avail: np.ndarray | int = n if ok is None else np.flatnonzero(ok)
    if cfg.participation.sampling == "poisson":  # each available client joins with probability q
        joins = rng.random(n) < sampling_rate(cfg)
        return np.flatnonzero(joins) if isinstance(avail, int) else avail[joins[avail]]
    size = avail if isinstance(avail, int) else len(avail)
    k = clients_per_round(cfg)
    if cfg.stragglers.enabled and cfg.stragglers.over_select > 0:
        k = math.ceil(k * (1 + cfg.stragglers.over_select))
    if k < size:
        return np.sort(rng.choice(avail, size=k, replace=False))
    return np.arange(n) if isinstance(avail, int) else avail


def work_samples(cfg: RunConfig, num_samples: np.ndarray) -> np.ndarray:
    """Training samples each client processes in a round (epochs × shard, or steps × batch)."""
    t = cfg.train
    if t.steps is not None:
        return np.full(len(num_samples), t.steps * t.batch_size, dtype=float)
    return num_samples.astype(float) * t.epochs


def durations(cfg: RunConfig, profiles: Profiles, cids: np.ndarray, num_samples: np.ndarray,
              bytes_down: np.ndarray, bytes_up: np.ndarray, round_trips: int = 1) -> np.ndarray:
    """Virtual seconds per client: download + local compute + upload, and the latency of `round_trips` messages."""
    compute = work_samples(cfg, num_samples) * cfg.stragglers.sample_seconds / profiles.speed[cids]
    return (bytes_down + bytes_up) / profiles.bandwidth[cids] + compute + round_trips * cfg.stragglers.latency_s


@dataclass
class Schedule:
    """Who does what this round: kept participants, over-selected extras dropped, late ones, the deadline, and
    those that went offline before they finished."""

    participants: np.ndarray
    late: np.ndarray
    over_selected: np.ndarray
    deadline: float
    duration: dict[int, float]
    offline: np.ndarray = field(default_factory=lambda: np.array([], int))


def schedule(cfg: RunConfig, sampled: np.ndarray, dur: np.ndarray, gone: np.ndarray | None = None) -> Schedule:
    """Apply over-selection (keep the fastest K) and the deadline to the sampled clients. Those `gone` offline
    before they finish never report: they are set apart first, so over-selection keeps the fastest K of the rest."""
    s = cfg.stragglers
    by_id = {int(c): float(d) for c, d in zip(sampled, dur)}
    offline = sampled[gone] if gone is not None else np.array([], int)
    if gone is not None:
        sampled, dur = sampled[~gone], dur[~gone]
    if not s.enabled:
        return Schedule(sampled, np.array([], int), np.array([], int), math.inf, by_id, offline)
    poisson = cfg.participation.sampling == "poisson"  # a Poisson cohort is kept whole: its size is the draw's
    k = len(sampled) if poisson else min(clients_per_round(cfg), len(sampled))
    order = np.lexsort((sampled, dur))  # fastest first, ties by id
    kept = np.sort(sampled[order[:k]])
    extra = np.sort(sampled[order[k:]])
    kept_dur = np.array([by_id[int(c)] for c in kept])
    if s.deadline == "fixed":
        deadline = s.deadline_value
    elif s.deadline == "quantile":
        deadline = float(np.quantile(kept_dur, s.deadline_value)) if len(kept_dur) else math.inf
    else:
        deadline = math.inf
    late = kept[kept_dur > deadline]
    return Schedule(kept, late, extra, deadline, by_id, offline)
