"""LEAF's preprocessing steps (`data/utils/sample.py`, `remove_users.py`, `split_data.py`) redone in memory.

Each step makes the same `random.Random` calls, in the same order, as LEAF's scripts, so that with the same seeds
and the same file order the users and samples equal what `preprocess.sh` writes. One RNG serves every file of a
step (the sampling seed for sampling, the split seed for the split), as in LEAF; the file order is the caller's
(LEAF takes `os.listdir`'s, which depends on the file system). Samples are numpy arrays indexed per user.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

SHAKESPEARE_WINDOW = 80  # Shakespeare's test samples start 79 windows after the last training one (no overlap)


@dataclass
class Part:
    """One JSON file's users: `users` in the file's order, `data[u] = (x, y)` in `user_data`'s key order."""

    name: str
    users: list[str]
    data: dict[str, tuple[np.ndarray, np.ndarray]] = field(default_factory=dict)

    def count(self, user: str) -> int:
        return len(self.data[user][1])


Users = list[tuple[str, np.ndarray, np.ndarray]]  # (user id, x, y) in order


def sample_niid(part: Part, fraction: float, rng: random.Random) -> Part:
    """Whole users in shuffled order until ⌊fraction·total⌋ samples; the last one cut to that count, keeping its
    first samples in an order drawn by `rng.sample` (LEAF's non-iid sampling)."""
    wanted = int(fraction * sum(part.count(u) for u in part.users))
    users = list(part.users)
    rng.shuffle(users)
    out = Part(part.name, [])
    taken = 0
    while taken < wanted:
        user = users[len(out.users)]
        x, y = part.data[user]
        n = len(y)
        if taken + n > wanted:
            n = wanted - taken
            order = rng.sample(list(range(n)), n)
            x, y = x[order], y[order]
        out.users.append(user)
        out.data[user] = (x, y)
        taken += n
    return out


def sample_iid(part: Part, fraction: float, user_fraction: float, rng: random.Random, first: int) -> Part:
    """⌊fraction·total⌋ samples drawn without replacement from all users (in `user_data`'s order), dealt into
    round(user_fraction·users) (at least 1) new users named str(first), str(first + 1), ... (LEAF's iid sampling)."""
    xs = [x for x, _ in part.data.values()]
    ys = [y for _, y in part.data.values()]
    total = sum(len(y) for y in ys)
    wanted = int(fraction * total)
    groups = max(1, int(round(user_fraction * len(part.users))))
    picked = rng.sample(list(range(total)), wanted)
    if not xs:
        return Part(part.name, [])
    all_x, all_y = np.concatenate(xs)[picked], np.concatenate(ys)[picked]
    size, big = divmod(wanted, groups)  # LEAF's iid_divide: the `groups - big` small groups first
    bounds, start = [], 0
    for g in range(groups):
        end = start + size + (g >= groups - big)
        bounds.append((start, end))
        start = end
    names = [str(first + g) for g in range(groups)]
    return Part(part.name, names, {n: (all_x[a:b], all_y[a:b]) for n, (a, b) in zip(names, bounds)})


def remove_users(part: Part, min_samples: int) -> Part:
    """The users with at least `min_samples` samples, in order (LEAF's remove_users)."""
    users = [u for u in part.users if part.count(u) >= min_samples]
    return Part(part.name, users, {u: part.data[u] for u in users})


def split_by_sample(parts: list[Part], fraction: float, rng: random.Random, time_ordered: bool) -> tuple[Users, Users]:
    """Each user's samples into train and test (LEAF's `-t sample`): users with under 2 samples are dropped,
    max(1, int(fraction·n)) samples train (1 of 2), drawn with `rng.sample` and kept in their original order.
    `time_ordered` (Shakespeare): the first ones train and the test starts 79 windows later, without drawing."""
    train: Users = []
    test: Users = []
    for part in parts:
        for user in part.users:
            x, y = part.data[user]
            n = len(y)
            if n < 2:
                continue
            n_train = 1 if n == 2 else max(1, int(fraction * n))
            if time_ordered:
                chosen = np.zeros(n, dtype=bool)
                chosen[:n_train] = True
                rest = np.arange(n_train + SHAKESPEARE_WINDOW - 1, n)
            else:
                chosen = np.zeros(n, dtype=bool)
                chosen[rng.sample(list(range(n)), n_train)] = True
                rest = np.flatnonzero(~chosen)
            if len(rest) == 0:
                continue
            train.append((user, x[chosen], y[chosen]))
            test.append((user, x[rest], y[rest]))
    return train, test


def split_by_user(parts: list[Part], fraction: float, rng: random.Random) -> tuple[Users, Users]:
    """int(fraction·users) users, drawn with `rng.sample` over all files' users in order, train; the others
    test (LEAF's `-t user`)."""
    users = [(u, part.data[u]) for part in parts for u in part.users]
    chosen = set(rng.sample(list(range(len(users))), int(fraction * len(users))))
    train = [(u, x, y) for i, (u, (x, y)) in enumerate(users) if i in chosen]
    test = [(u, x, y) for i, (u, (x, y)) in enumerate(users) if i not in chosen]
    return train, test
