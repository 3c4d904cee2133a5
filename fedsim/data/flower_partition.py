"""flwr-datasets 0.6's partitioners, draw for draw, so that a fedsim client holds exactly the samples Flower's
partition of the same id holds (docs/data/partitioners.md).

Flower's `FederatedDataset(shuffle=True, seed)` permutes the split with `default_rng(seed).permutation(n)` before
any partitioner sees it, and every partitioner draws from its own `default_rng(seed)`. Each function here works on
the labels in that shuffled order, in the order Flower consumes its generator, and maps the result back: what it
returns are sorted indices into the original, unshuffled training set, as fedsim's own partitions are. Flower's
closing per-partition `rng.shuffle` comes after every draw that decides membership, so it is left out.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fedsim.data.partition import _as_labels
from fedsim.errors import ConfigError

if TYPE_CHECKING:
    from fedsim.config.schema import PartitionConfig, RunConfig

FLOWER_SEED = 42  # FederatedDataset's and every partitioner's default seed
NEW_KINDS = ("inner_dirichlet", "pathological", "linear", "square", "exponential")
NATURAL_KINDS = ("natural_id", "grouped_natural_id")
SIZE_FUNCTIONS: dict[str, Callable[[np.ndarray], np.ndarray]] = {
    "linear": lambda x: x, "square": np.square, "exponential": np.exp}  # Flower's IdToSizeFncPartitioner weights
DIRICHLET_ATTEMPTS = 11  # Flower redraws the whole split up to 10 times after the first


@dataclass(frozen=True)
class FlowerOptions:
    """The options of Flower's partitioners, under fedsim's `data.partition.*` names."""

    alpha: float = 0.5
    min_samples: int = 10
    self_balancing: bool = False
    sizes: tuple[int, ...] = ()
    size_skew: str = "equal"
    classes_per_client: int = 2
    class_assignment: str = "random"
    shards_per_client: int | None = 2
    shard_size: int | None = None
    keep_incomplete: bool = False


def flower_partition(labels: np.ndarray, num_clients: int, kind: str, seed: int,
                     opts: FlowerOptions | None = None) -> list[np.ndarray]:
    """Flower's partitioner `kind` (iid, dirichlet, shards, inner_dirichlet, pathological, linear, square,
    exponential) after FederatedDataset's pre-shuffle, both with `seed`; one sorted int64 index array per client."""
    opts = opts or FlowerOptions()
    labels = _as_labels(labels)
    n, k = len(labels), num_clients
    if k > n:
        raise ConfigError(f"data.num_clients: {k} clients but only {n} training samples")
    perm = np.random.default_rng(seed).permutation(n)
    shuffled = labels[perm]
    rng = np.random.default_rng(seed)
    if kind == "iid":
        parts = _contiguous(_even_sizes(n, k))
    elif kind in SIZE_FUNCTIONS:
        parts = _contiguous(skewed_sizes(kind, n, k))
    elif kind == "dirichlet":
        parts = _dirichlet(shuffled, k, rng, opts.alpha, opts.min_samples, opts.self_balancing)
    elif kind == "inner_dirichlet":
        parts = _inner_dirichlet(shuffled, _inner_sizes(opts, n, k), rng, opts.alpha)
    elif kind == "pathological":
        parts = _pathological(shuffled, k, rng, opts.classes_per_client, opts.class_assignment)
    elif kind == "shards":
        by_label = np.argsort(shuffled, kind="stable")  # HF's Dataset.sort: pyarrow's stable sort_indices
        parts = [by_label[p] for p in _shards(n, k, rng, opts.shards_per_client, opts.shard_size,
                                              opts.keep_incomplete)]
    else:
        raise ConfigError(f"data.partition.kind: {kind!r} has no Flower partitioner here")
    return [np.sort(perm[p]).astype(np.int64) for p in parts]


def _even_sizes(n: int, k: int) -> np.ndarray:
    """HF's contiguous `shard`: the first n mod k clients one sample more."""
    q, r = divmod(n, k)
    return q + (np.arange(k) < r)


def skewed_sizes(kind: str, n: int, k: int) -> np.ndarray:
    """Client sizes of Flower's Linear/Square/ExponentialPartitioner (or equal ones): weights f(1..k), truncated
    shares of n, the remainder to the last client; a client left with no sample is a ConfigError."""
    if kind == "equal":
        return _even_sizes(n, k)
    units = SIZE_FUNCTIONS[kind](np.linspace(start=1, stop=k, num=k))
    with np.errstate(invalid="ignore", over="ignore"):
        sizes = np.array(units / units.sum() * n, dtype=np.int64)
        sizes[-1] += n - sizes.sum()
    if not np.isfinite(units.sum()) or sizes.min() < 1:
        small = int(np.argmin(sizes)) if np.isfinite(units.sum()) else 0
        raise ConfigError(f"data.partition.kind: {kind} sizes leave client {small} with "
                          f"{max(int(sizes[small]), 0)} of the {n} training samples (each needs >= 1) at "
                          f"{k} clients; use fewer clients or another kind")
    return sizes


def _contiguous(sizes: np.ndarray) -> list[np.ndarray]:
    """Consecutive ranges of the shuffled set with these sizes."""
    return np.split(np.arange(int(sizes.sum())), np.cumsum(sizes)[:-1])


def _dirichlet(labels: np.ndarray, k: int, rng: np.random.Generator, alpha: float, min_samples: int,
               self_balancing: bool) -> list[np.ndarray]:
    """DirichletPartitioner: per class in sorted order, proportions ~ Dir(alpha) over the clients cut the class's
    positions at int(cumsum·count); with self_balancing a client above n/k samples gets no share of later
    classes. The whole split is redrawn, same generator, until every client has min_samples."""
    n = len(labels)
    classes = np.unique(labels)
    alphas = np.full(k, float(alpha))
    avg = n / k
    smallest = 0
    for _ in range(DIRICHLET_ATTEMPTS):
        sizes = np.zeros(k, dtype=np.int64)
        pieces: list[tuple[np.ndarray, np.ndarray]] = []  # (positions of a class, owner of each)
        for c in classes:
            idx = np.flatnonzero(labels == c)
            props = rng.dirichlet(alphas)
            if self_balancing:  # Flower's Python sum over a dict of np.float64 and 0: kept as written
                kept = [0 if sizes[j] > avg else props[j] for j in range(k)]
                total = sum(kept)
                props = np.array([p / total for p in kept], dtype=np.float64)
            cuts = np.clip((np.cumsum(props) * len(idx)).astype(int)[:-1], 0, len(idx))
            counts = np.diff(np.concatenate(([0], cuts, [len(idx)])))
            pieces.append((idx, np.repeat(np.arange(k), counts)))
            sizes += counts
        smallest = int(sizes.min())
        if smallest >= min_samples:
            idx = np.concatenate([p for p, _ in pieces])
            owner = np.concatenate([o for _, o in pieces])
            return np.split(idx[np.argsort(owner, kind="stable")], np.cumsum(sizes)[:-1])
    raise ConfigError(f"data.partition.min_samples: Flower's Dirichlet(alpha={alpha}) split gave a client "
                      f"{smallest} < min_samples {min_samples} samples in all {DIRICHLET_ATTEMPTS} attempts "
                      f"({k} clients, {n} samples); lower data.partition.min_samples or raise alpha")


def _inner_sizes(opts: FlowerOptions, n: int, k: int) -> np.ndarray:
    """inner_dirichlet's client sizes: data.partition.sizes, else those of data.partition.size_skew."""
    if not opts.sizes:
        return skewed_sizes(opts.size_skew, n, k)
    sizes = np.asarray(opts.sizes, dtype=np.int64)
    if len(sizes) != k:
        raise ConfigError(f"data.partition.sizes: {len(sizes)} sizes for data.num_clients={k}")
    if int(sizes.sum()) != n:
        raise ConfigError(f"data.partition.sizes: they sum to {int(sizes.sum())}, not to the {n} training samples")
    return sizes


def _inner_dirichlet(labels: np.ndarray, sizes: np.ndarray, rng: np.random.Generator,
                     alpha: float) -> list[np.ndarray]:
    """InnerDirichletPartitioner: class priors ~ Dir(alpha) per client; one sample at a time, a random client
    that still has room draws a class from its prior and takes that class's last remaining position; an
    exhausted class leaves every prior, renormalised."""
    classes = np.unique(labels)
    num_classes = len(classes)
    if not np.array_equal(classes, np.arange(num_classes)):
        raise ConfigError(f"data.partition.kind: inner_dirichlet (Flower's InnerDirichletPartitioner) needs the "
                          f"classes 0..{num_classes - 1} each present; the training labels have {classes.tolist()}")
    k = len(sizes)
    priors = rng.dirichlet(alpha=np.full(num_classes, float(alpha)), size=k)
    idx_list = [np.flatnonzero(labels == c) for c in range(num_classes)]
    class_sizes = [len(i) for i in idx_list]
    out = [np.zeros(int(s), dtype=np.int64) for s in sizes]
    left = {cid: int(s) for cid, s in enumerate(sizes)}
    not_full = list(range(k))
    choices = list(range(num_classes))
    while sum(left.values()) != 0:
        cid = rng.choice(not_full)
        if left[cid] == 0:  # a full client is dropped only once drawn, and its draw is spent
            not_full.pop(not_full.index(cid))
            continue
        left[cid] -= 1
        probs = priors[cid]
        while True:
            try:
                c = rng.choice(choices, p=probs)
            except ValueError as exc:  # every class it can still draw has prior 0 (a tiny alpha underflowed)
                raise ConfigError(f"data.partition.alpha: Flower's inner Dirichlet split with alpha={alpha} left "
                                  f"client {cid} no class to draw ({exc}); raise alpha") from None
            if class_sizes[c] == 0:
                priors[:, c] = 0
                with np.errstate(invalid="ignore", divide="ignore"):  # a row left all zero: refused above next draw
                    priors = priors / priors.sum(axis=1, keepdims=True)
                probs = priors[cid]
                continue
            class_sizes[c] -= 1
            out[cid][left[cid]] = idx_list[c][class_sizes[c]]
            break
    return out


def _pathological(labels: np.ndarray, k: int, rng: np.random.Generator, per_client: int,
                  mode: str) -> list[np.ndarray]:
    """PathologicalPartitioner: each client gets `per_client` classes (random, deterministic, or its own class
    id mod C first and random others); each class's positions are split evenly among the clients holding it."""
    unique = np.unique(labels)
    num_classes = len(unique)
    if per_client > num_classes:
        raise ConfigError(f"data.partition.classes_per_client: {per_client} classes per client but the training "
                          f"set has {num_classes}")
    held: list[list[int]] = []
    for pid in range(k):
        if mode == "random":
            held.append(rng.choice(unique, size=per_client, replace=False).tolist())
        elif mode == "deterministic":
            held.append([int(unique[(pid + i) % num_classes]) for i in range(per_client)])
        else:  # first-deterministic
            mine = [int(unique[pid % num_classes])]
            while len(mine) < per_client:
                label = int(rng.choice(unique, size=1)[0])
                if label not in mine:
                    mine.append(label)
            held.append(mine)
    parts: list[list[np.ndarray]] = [[] for _ in range(k)]
    for label in unique:
        holders = [pid for pid in range(k) if label in held[pid]]
        idx = np.flatnonzero(labels == label)
        if len(holders) > len(idx):
            raise ConfigError(f"data.partition.classes_per_client: class {label} goes to {len(holders)} clients but "
                              f"has {len(idx)} training samples; lower it or data.num_clients, or set "
                              "data.partition.class_assignment: deterministic")
        for pid, piece in zip(holders, np.array_split(idx, len(holders)) if holders else []):
            parts[pid].append(piece)
    return [np.concatenate(p) if p else np.empty(0, np.int64) for p in parts]


def _shards(n: int, k: int, rng: np.random.Generator, per_client: int | None, size: int | None,
            keep_incomplete: bool) -> list[np.ndarray]:
    """ShardPartitioner over the label-sorted positions: shards of `size` (derived from the count when unset),
    dealt by one permutation of the usable shards; `per_client` unset gives each client the usable shards
    evenly, the first ones one more."""
    if per_client is None and size is None:
        raise ConfigError("data.partition.shards_per_client: Flower's shards need it or data.partition.shard_size; "
                          "both are null")
    if per_client is not None and size is not None and size * per_client * k > n:
        raise ConfigError(f"data.partition.shard_size: {k} clients × {per_client} shards × {size} samples = "
                          f"{size * per_client * k} exceeds the {n} training samples")
    if per_client is not None:
        counts = np.full(k, per_client, dtype=np.int64)
        if size is None:
            size = n // (k * per_client)
            if size == 0:
                raise ConfigError(f"data.partition.shards_per_client: {k} clients × {per_client} shards exceeds the "
                                  f"{n} training samples")
            usable = -(-n // size) if keep_incomplete else n // size
        else:
            usable = n // size
    else:
        assert size is not None
        used = -(-n // size) if keep_incomplete else n // size
        usable = used
        counts = np.full(k, used // k, dtype=np.int64)
        counts[: used - k * (used // k)] += 1
    if usable < k:
        raise ConfigError(f"data.partition.shard_size: {usable} shards of {size} samples for {k} clients leave some "
                          "client none; lower the shard size or the number of clients")
    dealt = np.split(rng.permutation(usable)[: int(counts.sum())], np.cumsum(counts)[:-1])
    return [np.concatenate([np.arange(s * size, min((s + 1) * size, n)) for s in shards]).astype(np.int64)
            if len(shards) else np.empty(0, np.int64) for shards in dealt]


def natural_groups(ids: np.ndarray, kind: str, group_size: int = 1, mode: str = "allow-smaller") -> list[np.ndarray]:
    """Each client's natural ids: one id per client in sorted order (NaturalIdPartitioner), or Flower's
    GroupedNaturalIdPartitioner groups over the ids in order of first appearance in the training set."""
    if kind == "natural_id":
        return [np.array([i], dtype=np.int64) for i in np.unique(ids)]
    first = np.unique(ids, return_index=True)[1]
    unique = ids[np.sort(first)]  # HF's unique(): pyarrow's first-appearance order, of the unshuffled table
    count = len(unique)
    if mode != "allow-smaller" and group_size > count:
        raise ConfigError(f"data.partition.group_size: {group_size} exceeds the {count} natural ids "
                          f"(group_mode {mode}); lower it or use group_mode allow-smaller")
    groups_n, rest = divmod(count, group_size)
    if groups_n == 0 and mode == "allow-smaller":
        groups_n, rest = 1, 0
    if mode == "strict" and rest:
        raise ConfigError(f"data.partition.group_size: group_mode strict needs it to divide the {count} natural ids "
                          f"(remainder {rest})")
    if mode == "allow-bigger":
        return np.array_split(unique, groups_n)
    groups = np.array_split(unique[: groups_n * group_size], groups_n)
    if mode == "allow-smaller" and rest:
        groups.append(unique[-rest:])
    return groups


def natural_members(ids: np.ndarray, groups: list[np.ndarray]) -> list[np.ndarray]:
    """Each client's sorted sample indices: the samples whose id is in its group (others, and id -1, a test sample
    whose client has no training samples, belong to no client)."""
    members = np.concatenate(groups) if groups else np.zeros(0, dtype=np.int64)
    owner = np.full(max(int(ids.max(initial=-1)), int(members.max(initial=-1))) + 1, -1, dtype=np.int64)
    owner[members] = np.repeat(np.arange(len(groups)), [len(g) for g in groups])  # one assignment, 100k clients too
    own = np.where(ids >= 0, owner[np.maximum(ids, 0)], -1)
    keep = np.flatnonzero(own >= 0)
    order = np.argsort(own[keep], kind="stable")
    return np.split(keep[order].astype(np.int64), np.cumsum(np.bincount(own[keep], minlength=len(groups)))[:-1])


def check_partition(cfg: RunConfig) -> None:
    """The data.partition choices that contradict each other, refused when the config loads (before any data)."""
    p, n = cfg.data.partition, cfg.data.num_clients
    if cfg.data.client_test == "natural" and p.kind not in NATURAL_KINDS:
        raise ConfigError(f"data.client_test: natural needs data.partition.kind natural_id or grouped_natural_id, "
                          f"not {p.kind}")
    if p.flower and p.kind == "generated":
        raise ConfigError("data.partition.flower: generated shards have no Flower partitioner; set flower: false")
    if not p.flower and p.kind == "dirichlet" and p.self_balancing:
        raise ConfigError("data.partition.self_balancing: an option of Flower's Dirichlet split; set "
                          "data.partition.flower: true")
    if not p.flower and p.kind == "shards":
        if p.shard_size is not None or p.keep_incomplete:
            key = "shard_size" if p.shard_size is not None else "keep_incomplete"
            raise ConfigError(f"data.partition.{key}: an option of Flower's shards; set data.partition.flower: true")
        if p.shards_per_client is None:
            raise ConfigError("data.partition.shards_per_client: fedsim's shards need it (null is for Flower's, "
                              "with data.partition.flower: true and shard_size)")
    if p.kind == "inner_dirichlet" and p.sizes and len(p.sizes) != n:
        raise ConfigError(f"data.partition.sizes: {len(p.sizes)} sizes for data.num_clients={n}")


def options_of(p: PartitionConfig) -> FlowerOptions:
    """The Flower options of a data.partition section."""
    return FlowerOptions(alpha=p.alpha, min_samples=p.min_samples, self_balancing=p.self_balancing,
                         sizes=tuple(p.sizes), size_skew=p.size_skew, classes_per_client=p.classes_per_client,
                         class_assignment=p.class_assignment, shards_per_client=p.shards_per_client,
                         shard_size=p.shard_size, keep_incomplete=p.keep_incomplete)
