"""Where time-varying availability comes from (participation.availability): FedScale's client_behave_trace pickle,
a CSV of online intervals, or the diurnal generator. Files are data: the pickle is read by the safe unpickler
(plain values only), and any problem is one DataError naming the key and the file."""

from __future__ import annotations

import math
import os
from typing import Any

import numpy as np

from fedsim import rng as streams
from fedsim.config.knobs import shown
from fedsim.config.schema import DiurnalConfig, RunConfig
from fedsim.errors import DataError
from fedsim.runtime.availability import OnlineWindows, build
from fedsim.runtime.csv_trace import client_column, number_column, read_csv

KEY = "participation.availability"
DIURNAL = "diurnal"
FEDSCALE_KEYS = ("active", "inactive", "finish_time")  # what FedScale's is_active reads ('duration', 'model' are not)
DIURNAL_STREAM = "participation/diurnal"


def load_availability(cfg: RunConfig) -> OnlineWindows | None:
    """The run's time-varying availability, or None when participation.availability is a probability."""
    value, n = cfg.participation.availability, cfg.data.num_clients
    if not isinstance(value, str):
        return None
    if value == DIURNAL:
        return diurnal(cfg.participation.diurnal, n, cfg.seed)
    if not value.strip():
        raise DataError(f"{KEY}: an empty string; expected a probability in (0, 1], {DIURNAL}, or a trace file")
    if not os.path.isfile(value):
        what = "a folder" if os.path.isdir(value) else "not a regular file" if os.path.exists(value) else "no such file"
        raise DataError(f"{KEY}: cannot read {shown(value, 300)} ({what}); expected a probability in (0, 1], "
                        f"{DIURNAL}, or a trace file: FedScale's client_behave_trace pickle or a .csv of "
                        "client,start,end")
    return read_intervals_csv(value, n) if value.lower().endswith(".csv") else read_fedscale(value, n)


def read_fedscale(path: str, n: int) -> OnlineWindows:
    """FedScale's client_behave_trace: a pickled dict {client id: {'active': [...], 'inactive': [...],
    'finish_time': int, ...}}; the client is online iff active[i] <= t mod finish_time <= inactive[i] for some i.
    Every client 0..n-1 needs an entry."""
    from fedsim.data.safe_pickle import load_pickle_data

    try:
        trace = load_pickle_data(path, arrays=False)
    except OSError as exc:
        raise DataError(f"{KEY}: cannot read {path} ({exc.strerror or type(exc).__name__})") from None
    except DataError as exc:
        raise DataError(f"{KEY}: {exc}") from None
    if not isinstance(trace, dict):
        raise DataError(f"{KEY}: {path} holds a {type(trace).__name__}; FedScale's client_behave_trace is a dict "
                        "keyed by client id")
    bad_key = next((k for k in trace if not _integer(k)), None)
    if bad_key is not None:
        raise DataError(f"{KEY}: {path}: key {shown(bad_key)} is not a client id (0, 1, 2, ...)")
    unknown = sorted(k for k in trace if not 0 <= k < n)
    if unknown:
        raise DataError(f"{KEY}: {path}: client {unknown[0]} is not one of the run's clients 0..{n - 1} "
                        f"(data.num_clients; {len(unknown)} such)")
    absent = np.setdiff1d(np.arange(n), np.fromiter(trace, dtype=np.int64, count=len(trace)))
    if len(absent):
        raise DataError(f"{KEY}: {path}: no entry for client {absent[0]} ({len(absent)} of the {n} clients in "
                        "data.num_clients have none)")
    owners, starts, ends, period = [], [], [], np.zeros(n)
    for c in range(n):  # once, as the run starts
        active, inactive, period[c] = _fedscale_entry(trace[c], path, c)
        owners.append(np.full(len(active), c, dtype=np.int64))
        starts.append(active)
        ends.append(inactive)
    owner = np.concatenate(owners)
    return build(n, owner, np.concatenate(starts), np.concatenate(ends), period, f"{KEY}: {path}",
                 lambda i: f"client {owner[i]}, interval {i - np.searchsorted(owner, owner[i])}")


def _fedscale_entry(entry: Any, path: str, c: int) -> tuple[np.ndarray, np.ndarray, float]:
    """One client's (active, inactive, finish_time), checked for shape and types."""
    if not isinstance(entry, dict):
        raise DataError(f"{KEY}: {path}: client {c}'s entry is a {type(entry).__name__}, not a dict with keys "
                        f"{list(FEDSCALE_KEYS)}")
    missing = [k for k in FEDSCALE_KEYS if k not in entry]
    if missing:
        raise DataError(f"{KEY}: {path}: client {c}'s entry lacks {missing} (it has {sorted(map(str, entry))})")
    lists = []
    for name in ("active", "inactive"):
        value = entry[name]
        if not isinstance(value, (list, tuple)) or not all(_number(v) for v in value):
            raise DataError(f"{KEY}: {path}: client {c}'s {name} is not a list of numbers: {shown(value)}")
        lists.append(np.array(value, dtype=np.float64))
    if len(lists[0]) != len(lists[1]):
        raise DataError(f"{KEY}: {path}: client {c} has {len(lists[0])} active times and {len(lists[1])} inactive "
                        "ones; each interval needs both")
    finish = entry["finish_time"]
    if not _number(finish) or not 0 < finish < math.inf:
        raise DataError(f"{KEY}: {path}: client {c}'s finish_time {shown(finish)} is not a positive number "
                        "(the period its trace repeats with)")
    return lists[0], lists[1], float(finish)


def read_intervals_csv(path: str, n: int) -> OnlineWindows:
    """A CSV with columns client, start, end (virtual seconds; the client is online on [start, end]) and optionally
    period (each client's, the same on all its rows; time then folds modulo it). A client without rows is never
    online; each client's rows are in time order (clients' rows may interleave)."""
    df, row_no = read_csv(path, KEY, ("client", "start", "end", "period"), ("client", "start", "end"))
    clients = client_column(df, KEY, path, row_no)
    start = number_column(df, "start", KEY, path, row_no)
    end = number_column(df, "end", KEY, path, row_no)
    order = np.argsort(clients, kind="stable")  # each client's rows together, in the order written
    period = np.full(n, np.inf)
    if "period" in df.columns:
        given = number_column(df, "period", KEY, path, row_no, bounds=(0.0, math.inf))
        known = clients < n  # an unknown client is refused by build, with its row
        period[clients[known]] = given[known]
        differs = known & (given != period[np.minimum(clients, n - 1)])
        if differs.any():
            i = int(np.flatnonzero(differs)[0])
            raise DataError(f"{KEY}: {path} column period, row {row_no[i]}: client {clients[i]} has another period "
                            "on another row; a client's period is one number")
    return build(n, clients[order], start[order], end[order], period, f"{KEY}: {path}",
                 lambda i: f"row {row_no[order[i]]}")


def diurnal(d: DiurnalConfig, n: int, seed: int) -> OnlineWindows:
    """Each client online or not in each slot of its local day, with the probability of the curve at the slot's
    middle hour (low + (high - low) (1 + cos(2 pi (hour - peak_hour) / 24)) / 2), and a time zone drawn uniformly
    over zone_spread_h hours; all from one seeded stream, so the same seed gives the same intervals."""
    gen = streams.numpy_generator(seed, DIURNAL_STREAM)
    zone_h = gen.uniform(-d.zone_spread_h / 2, d.zone_spread_h / 2, n) if d.zone_spread_h > 0 else np.zeros(n)
    slot = d.period_s / d.slots
    on = gen.random((n, d.slots), dtype=np.float32) < diurnal_probability(d, (np.arange(d.slots) + 0.5) * 24 / d.slots)
    edges = np.diff(np.pad(on.astype(np.int8), ((0, 0), (1, 1))), axis=1)  # +1 where a run starts, -1 past its end
    owner, first = np.nonzero(edges == 1)
    _, past = np.nonzero(edges == -1)  # row-major: the runs of each client in order, starts and ends paired
    period = np.full(n, float(d.period_s))
    # local time = t + zone (hours ahead of virtual time 0), folded into the day
    shift = np.mod(zone_h * d.period_s / 24, d.period_s)
    return build(n, owner, first * slot, np.minimum(past * slot, d.period_s), period, f"{KEY}: {DIURNAL}",
                 lambda i: f"client {owner[i]}", shift)


def diurnal_probability(d: DiurnalConfig, hour: np.ndarray) -> np.ndarray:
    """The curve: the online probability at each local hour of the day (0 <= hour < 24)."""
    return d.low + (d.high - d.low) * (1 + np.cos(2 * np.pi * (hour - d.peak_hour) / 24)) / 2


def _integer(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
