"""Availability that changes over virtual time: each client's online intervals, and stateless lookups in them.

A client is online at virtual time t iff its local time t' = (t + shift) mod period (t + shift when it has no
period) lies in one of its intervals [start, end], both ends included, as in FedScale's `is_active`. The lookups
are one binary search (np.searchsorted) over all the run's intervals for a whole array of clients, so they answer
for any t in any order (FedScale's index moves one interval forward a call) and cost no Python loop over clients.
`online`, `online_until` and `next_online` are what a round loop, sync or async, asks; where the intervals come
from (a FedScale trace, a CSV, the diurnal generator) is fedsim.runtime.availability_sources.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from fedsim.errors import DataError

Time = float | np.ndarray  # one virtual time for all the clients asked about, or one per client


@dataclass(frozen=True)
class OnlineWindows:
    """Every client's online intervals, sorted by (client, start) and disjoint: interval i is client `owner[i]`'s
    [start[i], end[i]] in its local time. `period` (inf: no folding) and `shift` are per client; `source` names
    where the intervals came from (a file, or diurnal) in messages."""

    owner: np.ndarray  # int64
    start: np.ndarray  # float64
    end: np.ndarray  # float64
    period: np.ndarray  # float64, one per client
    shift: np.ndarray  # float64, one per client
    source: str
    key: np.ndarray = field(init=False, repr=False)  # (client, start) as complex: numpy orders it lexicographically
    first: np.ndarray = field(init=False, repr=False)  # client c's intervals are first[c]:first[c + 1]

    @property
    def num_clients(self) -> int:
        return len(self.period)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", self.owner.astype(np.float64) + 1j * self.start)
        object.__setattr__(self, "first", np.searchsorted(self.owner, np.arange(len(self.period) + 1)))


def _local(w: OnlineWindows, clients: np.ndarray, t: Time) -> np.ndarray:
    """Each client's local time at virtual time t: t + shift, folded into [0, period) where it has a period."""
    period = w.period[clients]
    local = t + w.shift[clients]  # a new array, whether t is one time or one per client
    folded = np.isfinite(period)
    local[folded] = np.mod(local[folded], period[folded])
    return local


def _current(w: OnlineWindows, clients: np.ndarray, local: np.ndarray) -> np.ndarray:
    """The index of each client's last interval that starts at or before its local time, or -1 if none does."""
    i = np.searchsorted(w.key, clients + 1j * local, side="right") - 1
    return np.where(i >= w.first[clients], i, -1)


def online(w: OnlineWindows, clients: np.ndarray, t: Time) -> np.ndarray:
    """Whether each of `clients` is online at virtual time t (bool array)."""
    clients = np.asarray(clients, dtype=np.int64)
    local = _local(w, clients, t)
    i = _current(w, clients, local)
    return (i >= 0) & (local <= w.end[np.maximum(i, 0)])


def online_until(w: OnlineWindows, clients: np.ndarray, t: Time) -> np.ndarray:
    """The virtual time each of `clients` stays online until from t on: the end of its current interval, carried
    over a period's end into the next period's interval that starts at 0 (inf for a client always online), and
    -inf for a client offline at t."""
    clients = np.asarray(clients, dtype=np.int64)
    local = _local(w, clients, t)
    i = _current(w, clients, local)
    j = np.maximum(i, 0)
    on = (i >= 0) & (local <= w.end[j])
    end = w.end[j].copy()
    period = w.period[clients]
    first = w.first[clients]
    wraps = on & (end >= period) & (w.start[np.where(on, first, 0)] <= 0)  # and the period's first starts at 0
    end[wraps & (j == first)] = np.inf  # one interval over the whole period
    carry = wraps & (j != first)
    end[carry] = period[carry] + w.end[first[carry]]
    return np.where(on, t + (end - local), -np.inf)


def next_online(w: OnlineWindows, clients: np.ndarray, t: Time) -> np.ndarray:
    """The first virtual time at or after t that each of `clients` is online (t if it is now, inf if never)."""
    clients = np.asarray(clients, dtype=np.int64)
    local = _local(w, clients, t)
    i = _current(w, clients, local)
    on = (i >= 0) & (local <= w.end[np.maximum(i, 0)])
    first, stop = w.first[clients], w.first[clients + 1]
    nxt = np.where(i >= 0, i + 1, first)  # the next interval in this period, if the client has one
    later = nxt < stop
    start = np.full(len(clients), np.inf)
    start[later] = w.start[nxt[later]]
    period = w.period[clients]
    wrap = ~later & (first < stop) & np.isfinite(period)  # none left in this period: the next period's first
    start[wrap] = period[wrap] + w.start[first[wrap]]
    out = np.where(on, t, t + (start - local)).astype(np.float64)
    for _ in range(8):  # t + (start - local) may land an ulp before the interval: step onto it
        finite = np.flatnonzero(np.isfinite(out))
        short = finite[~online(w, clients[finite], out[finite])]
        if not len(short):
            break
        out[short] = np.nextafter(out[short], np.inf)
    return out


def build(n: int, owner: np.ndarray, start: np.ndarray, end: np.ndarray, period: np.ndarray, source: str,
          where: Callable[[int], str], shift: np.ndarray | None = None) -> OnlineWindows:
    """Windows of clients 0..n-1 from intervals listed by client, each client's in time order, checked: known
    clients, finite times >= 0, start <= end, sorted and not overlapping, and (with a period) starting inside it.
    Intervals that touch are merged; ends past a client's period are cut at it (never reached after folding).
    A problem is a DataError naming `source` and `where(i)` (the row, or the client and interval, of entry i)."""
    owner = np.asarray(owner, dtype=np.int64)
    start, end = np.asarray(start, dtype=np.float64), np.asarray(end, dtype=np.float64)

    def refuse(mask: np.ndarray, what: str) -> None:
        if mask.any():
            i = int(np.flatnonzero(mask)[0])
            raise DataError(f"{source}: {where(i)}: {what.format(c=owner[i], s=start[i], e=end[i])}")

    refuse((owner < 0) | (owner >= n), f"client {{c}} is not one of the run's clients 0..{n - 1} (data.num_clients)")
    refuse(~np.isfinite(start) | ~np.isfinite(end), "interval [{s:g}, {e:g}] is not finite")
    refuse((start < 0) | (end < 0), "interval [{s:g}, {e:g}] has a negative time")
    refuse(end < start, "interval [{s:g}, {e:g}] ends before it starts")
    same = np.r_[False, owner[1:] == owner[:-1]]  # entry i continues entry i-1's client
    refuse(np.r_[False, owner[1:] < owner[:-1]], "client {c}'s intervals are not listed together (sort by client)")
    refuse(same & (start < np.r_[0.0, start[:-1]]), "interval [{s:g}, {e:g}] starts before the one before it "
           "(each client's intervals must be in time order)")
    refuse(same & (start < np.r_[0.0, end[:-1]]), "interval [{s:g}, {e:g}] overlaps the one before it")
    per = period[owner] if len(owner) else np.zeros(0)
    refuse(start >= per, "interval [{s:g}, {e:g}] starts at or after client {c}'s period "
           "(never reached once time folds)")
    end = np.minimum(end, per)
    if not len(owner):
        raise DataError(f"{source}: no client is ever online (it holds no interval)")
    touch = same & (start <= np.r_[0.0, end[:-1]])  # starts where the previous one ends: one interval
    keep = ~touch
    run_end = np.maximum.reduceat(end, np.flatnonzero(keep))  # a merged interval ends where its last part does
    return OnlineWindows(owner[keep], start[keep], run_end, np.asarray(period, dtype=np.float64),
                         np.zeros(n) if shift is None else np.asarray(shift, dtype=np.float64), source)
