"""Participation and stragglers on a virtual clock: who is sampled, how long each takes, who is late.

Every draw is seeded by (run seed, round), so the same clients are sampled and dropped whatever the
number of workers, and whether or not late clients are computed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from fedsim.config import DistConfig, RunConfig, clients_per_round
from fedsim.errors import DataError


@dataclass
class Profiles:
    """Per-client device profile: compute speed (×), bandwidth (bytes/s), availability probability."""

    speed: np.ndarray
    bandwidth: np.ndarray
    availability: np.ndarray


def _draw(rng: np.random.Generator, d: DistConfig, n: int) -> np.ndarray:
    if d.dist == "constant":
        return np.full(n, d.mean)
    if d.dist == "uniform":
        return rng.uniform(d.mean * (1 - d.sigma), d.mean * (1 + d.sigma), n).clip(min=1e-9)
    return d.mean * np.exp(d.sigma * rng.standard_normal(n))


def make_profiles(cfg: RunConfig) -> Profiles:
    """Draw device profiles from the configured distributions, or read them from a trace CSV."""
    n, s = cfg.data.num_clients, cfg.stragglers
    if s.trace:
        return _read_trace(s.trace, n)
    rng = np.random.default_rng([cfg.seed, 7919])
    speed = _draw(rng, s.speed, n)
    bw = _draw(rng, s.bandwidth_mbps, n) * 1e6 / 8
    return Profiles(speed, bw, np.full(n, cfg.participation.availability))


def _read_trace(path: str, n: int) -> Profiles:
    import pandas as pd

    try:
        df = pd.read_csv(path)
    except (OSError, ValueError) as exc:
        raise DataError(f"stragglers.trace: cannot read {path}: {exc}") from None
    need = {"client", "speed", "bandwidth_mbps"}
    if not need <= set(df.columns):
        raise DataError(f"stragglers.trace: {path} lacks columns {sorted(need - set(df.columns))}")
    df = df.set_index("client").reindex(range(n))
    if df[["speed", "bandwidth_mbps"]].isna().any().any():
        raise DataError(f"stragglers.trace: {path} has no row for some of the {n} clients")
    avail = df["availability"].fillna(1.0).to_numpy() if "availability" in df else np.ones(n)
    return Profiles(df["speed"].to_numpy(float), df["bandwidth_mbps"].to_numpy(float) * 1e6 / 8, avail)


def sample_round(cfg: RunConfig, round: int, profiles: Profiles) -> np.ndarray:
    """Sorted client ids sampled for `round` among the available ones (over-selection included)."""
    n = cfg.data.num_clients
    rng = np.random.default_rng([cfg.seed, round, 104729])
    avail = np.flatnonzero(rng.random(n) < profiles.availability) if (profiles.availability < 1).any() \
        else np.arange(n)
    k = clients_per_round(cfg)
    if cfg.stragglers.enabled and cfg.stragglers.over_select > 0:
        k = math.ceil(k * (1 + cfg.stragglers.over_select))
    k = min(k, len(avail))
    return np.sort(rng.choice(avail, size=k, replace=False)) if k < len(avail) else avail


def work_samples(cfg: RunConfig, num_samples: np.ndarray) -> np.ndarray:
    """Training samples each client processes in a round (epochs × shard, or steps × batch)."""
    t = cfg.train
    if t.steps is not None:
        return np.full(len(num_samples), t.steps * t.batch_size, dtype=float)
    return num_samples.astype(float) * max(t.epochs, 1)


def durations(cfg: RunConfig, profiles: Profiles, cids: np.ndarray, num_samples: np.ndarray,
              bytes_down: np.ndarray, bytes_up: np.ndarray) -> np.ndarray:
    """Virtual seconds per client: download + local compute + upload."""
    compute = work_samples(cfg, num_samples) * cfg.stragglers.sample_seconds / profiles.speed[cids]
    return (bytes_down + bytes_up) / profiles.bandwidth[cids] + compute


@dataclass
class Schedule:
    """Who does what this round: kept participants, over-selected extras dropped, late ones, the deadline."""

    participants: np.ndarray
    late: np.ndarray
    over_selected: np.ndarray
    deadline: float
    duration: dict[int, float]


def schedule(cfg: RunConfig, sampled: np.ndarray, dur: np.ndarray) -> Schedule:
    """Apply over-selection (keep the fastest K) and the deadline to the sampled clients."""
    s = cfg.stragglers
    by_id = {int(c): float(d) for c, d in zip(sampled, dur)}
    if not s.enabled:
        return Schedule(sampled, np.array([], int), np.array([], int), math.inf, by_id)
    k = min(clients_per_round(cfg), len(sampled))
    order = np.lexsort((sampled, dur))  # fastest first, ties by id
    kept = np.sort(sampled[order[:k]])
    extra = np.sort(sampled[order[k:]])
    kept_dur = np.array([by_id[int(c)] for c in kept])
    if s.deadline == "fixed":
        deadline = s.deadline_value
    elif s.deadline == "quantile":
        deadline = float(np.quantile(kept_dur, min(s.deadline_value, 1.0))) if len(kept_dur) else math.inf
    else:
        deadline = math.inf
    late = kept[kept_dur > deadline]
    return Schedule(kept, late, extra, deadline, by_id)
