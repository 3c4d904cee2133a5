"""Client partitions of a labelled dataset: pure numpy, seeded and deterministic, vectorised for 100k+ clients.

Every function returns one sorted int64 index array per client.
"""

from __future__ import annotations

import numpy as np

from fedsim.errors import ConfigError

KINDS = ("iid", "dirichlet", "shards")
TEST_MODES = ("balanced", "proportional")
MAX_TRIES = 1000
_DRAW_BUDGET = 20_000_000  # bounds (tries × classes × clients) so huge client counts stay fast


def partition(
    labels: np.ndarray,
    num_clients: int,
    kind: str,
    seed: int,
    *,
    alpha: float = 0.5,
    min_samples: int = 10,
    shards_per_client: int = 2,
) -> list[np.ndarray]:
    """Split sample indices 0..len(labels)-1 among `num_clients` clients; each client's indices sorted."""
    labels = _as_labels(labels)
    n = len(labels)
    if num_clients < 1:
        raise ConfigError(f"data.num_clients: must be >= 1, got {num_clients}")
    if num_clients > n:
        raise ConfigError(f"data.num_clients: {num_clients} clients but only {n} training samples")
    rng = np.random.default_rng(seed)
    if kind == "iid":
        return [np.sort(p) for p in np.array_split(rng.permutation(n), num_clients)]
    if kind == "dirichlet":
        return _dirichlet(labels, num_clients, rng, alpha, min_samples)
    if kind == "shards":
        return _shards(labels, num_clients, rng, shards_per_client)
    raise ConfigError(f"data.partition.kind: unknown partition {kind!r}; choose one of {list(KINDS)}")


def _as_labels(labels: np.ndarray) -> np.ndarray:
    labels = np.asarray(labels)
    if labels.ndim == 2 and labels.shape[1] == 1:
        labels = labels[:, 0]
    if labels.ndim != 1 or not np.issubdtype(labels.dtype, np.integer):
        raise ConfigError(f"labels must be a 1-d integer array, got {labels.dtype} of shape {labels.shape}")
    if len(labels) and labels.min() < 0:
        raise ConfigError("labels must be non-negative class ids")
    return labels.astype(np.int64, copy=False)


def _group(owner: np.ndarray, num_clients: int) -> list[np.ndarray]:
    """Sample indices grouped by owner; stable sort keeps each group ascending."""
    order = np.argsort(owner, kind="stable")
    counts = np.bincount(owner, minlength=num_clients)
    return np.split(order, np.cumsum(counts)[:-1])


def _dirichlet(
    labels: np.ndarray, k: int, rng: np.random.Generator, alpha: float, min_samples: int
) -> list[np.ndarray]:
    """Label-Dirichlet split (Hsu et al. 2019): per class, proportions ~ Dir(alpha·1_k) over clients.

    Full redraws are tried first (up to MAX_TRIES, fewer when classes×clients is huge). If none gives
    every client `min_samples`, the draw with the smallest shortfall is topped up: each short client
    takes samples from clients above `min_samples`, preferring the classes its own Dirichlet weights favour.
    This is what makes e.g. 100k clients × 1 sample on 200k labels feasible, where redraws alone never are.
    """
    n = len(labels)
    if alpha <= 0:
        raise ConfigError(f"data.partition.alpha: must be > 0, got {alpha}")
    if min_samples < 0:
        raise ConfigError(f"data.partition.min_samples: must be >= 0, got {min_samples}")
    if k * min_samples > n:
        raise ConfigError(
            f"data.partition.min_samples: {k} clients × min_samples {min_samples} = {k * min_samples} "
            f"exceeds the {n} training samples; lower data.partition.min_samples or the number of clients"
        )
    classes = np.flatnonzero(np.bincount(labels))
    n_c = np.bincount(labels)[classes]
    tries = int(min(MAX_TRIES, max(1, _DRAW_BUDGET // (len(classes) * k))))
    best: tuple[np.ndarray, np.ndarray] | None = None
    best_short: int | None = None
    for _ in range(tries):
        props = rng.dirichlet(np.full(k, alpha), size=len(classes))  # classes × clients
        bounds = (np.cumsum(props, axis=1) * n_c[:, None]).astype(np.int64)
        bounds[:, -1] = n_c
        counts = np.diff(bounds, axis=1, prepend=0)  # classes × clients
        short = int(np.maximum(min_samples - counts.sum(axis=0), 0).sum())
        if best_short is None or short < best_short:
            best, best_short = (props, counts), short
        if short == 0:
            break
    assert best is not None  # tries >= 1
    props, counts = best
    owner = np.empty(n, dtype=np.int64)
    for ci, c in enumerate(classes):
        idx = rng.permutation(np.flatnonzero(labels == c))
        owner[idx] = np.repeat(np.arange(k), counts[ci])
    if best_short:
        _top_up(owner, labels, props * n_c[:, None], classes, k, min_samples, rng)
    parts = _group(owner, k)
    if min(len(p) for p in parts) < min_samples:  # defensive: the feasibility check makes this unreachable
        raise ConfigError(
            f"data.partition.min_samples: no Dirichlet(alpha={alpha}) split gives every one of {k} clients "
            f"{min_samples} samples after {tries} tries; lower data.partition.min_samples"
        )
    return parts


def _top_up(
    owner: np.ndarray,
    labels: np.ndarray,
    weight: np.ndarray,
    classes: np.ndarray,
    k: int,
    min_samples: int,
    rng: np.random.Generator,
) -> None:
    """Move samples, in place, from clients above min_samples to clients below it (vectorised)."""
    totals = np.bincount(owner, minlength=k)
    need = np.maximum(min_samples - totals, 0)
    surplus = np.maximum(totals - min_samples, 0)
    # Movable pool: a random `surplus[c]` of each client's samples.
    perm = rng.permutation(len(owner))
    grouped = perm[np.argsort(owner[perm], kind="stable")]
    starts = np.concatenate(([0], np.cumsum(totals)[:-1]))
    rank = np.arange(len(owner)) - starts[owner[grouped]]
    movable = grouped[rank < surplus[owner[grouped]]]
    movable = movable[rng.permutation(len(movable))]
    # One slot per missing sample; its wanted class follows the short client's own Dirichlet weights.
    short = np.flatnonzero(need)
    slot_owner = np.repeat(short, need[short])
    w = weight[:, short].T  # short clients × classes
    cdf = np.cumsum(w, axis=1)
    cdf /= np.where(cdf[:, -1:] > 0, cdf[:, -1:], 1.0)
    u = rng.random(len(slot_owner))
    row = np.repeat(np.arange(len(short)), need[short])
    wanted = classes[np.minimum((cdf[row] < u[:, None]).sum(axis=1), len(classes) - 1)]
    taken = np.zeros(len(movable), dtype=bool)
    filled = np.zeros(len(slot_owner), dtype=bool)
    mov_labels = labels[movable]
    for c in classes:
        slots = np.flatnonzero(wanted == c)
        pool = np.flatnonzero(mov_labels == c)
        m = min(len(slots), len(pool))
        owner[movable[pool[:m]]] = slot_owner[slots[:m]]
        taken[pool[:m]] = True
        filled[slots[:m]] = True
    rest_slots = np.flatnonzero(~filled)
    rest_pool = np.flatnonzero(~taken)[: len(rest_slots)]
    owner[movable[rest_pool]] = slot_owner[rest_slots[: len(rest_pool)]]


def _shards(labels: np.ndarray, k: int, rng: np.random.Generator, per_client: int) -> list[np.ndarray]:
    """McMahan et al. 2017: sort by label, cut into k·per_client near-equal shards, deal them at random."""
    n_shards = k * per_client
    if per_client < 1:
        raise ConfigError(f"data.partition.shards_per_client: must be >= 1, got {per_client}")
    if n_shards > len(labels):
        raise ConfigError(
            f"data.partition.shards_per_client: {k} clients × {per_client} shards exceeds the "
            f"{len(labels)} training samples"
        )
    perm = rng.permutation(len(labels))  # random order within a label, then sort by label
    by_label = perm[np.argsort(labels[perm], kind="stable")]
    shards = np.array_split(by_label, n_shards)  # sizes differ by at most one; every sample is dealt
    deal = rng.permutation(n_shards).reshape(k, per_client)
    return [np.sort(np.concatenate([shards[s] for s in row])) for row in deal]


def split_validation(
    parts: list[np.ndarray], fraction: float = 0.1, seed: int = 0
) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Hold out round(fraction·n) of each client's samples for validation; each client keeps >= 1 train sample."""
    if not 0 <= fraction < 1:
        raise ConfigError(f"data.val_fraction: must be in [0, 1), got {fraction}")
    k = len(parts)
    if fraction == 0 or k == 0:
        return [np.sort(p).astype(np.int64) for p in parts], [np.empty(0, np.int64) for _ in parts]
    lens = np.array([len(p) for p in parts], dtype=np.int64)
    n_val = np.minimum(np.rint(fraction * lens).astype(np.int64), np.maximum(lens - 1, 0))
    flat = np.concatenate(parts).astype(np.int64)
    owner = np.repeat(np.arange(k), lens)
    rng = np.random.default_rng(seed)
    order = np.lexsort((rng.random(len(flat)), owner))  # by client, random within a client
    starts = np.concatenate(([0], np.cumsum(lens)[:-1]))
    is_val = np.empty(len(flat), dtype=bool)
    is_val[order] = (np.arange(len(flat)) - starts[owner[order]]) < n_val[owner[order]]
    train = _group_values(flat[~is_val], owner[~is_val], k)
    val = _group_values(flat[is_val], owner[is_val], k)
    return train, val


def _group_values(values: np.ndarray, owner: np.ndarray, k: int) -> list[np.ndarray]:
    """Split `values` by owner, each group sorted ascending."""
    order = np.lexsort((values, owner))
    return np.split(values[order], np.cumsum(np.bincount(owner, minlength=k))[:-1])


def label_histograms(labels: np.ndarray, parts: list[np.ndarray], num_classes: int) -> np.ndarray:
    """Clients × classes matrix of label counts, e.g. to log or plot the skew of a partition."""
    labels = _as_labels(labels)
    lens = np.array([len(p) for p in parts], dtype=np.int64)
    if lens.sum() == 0:
        return np.zeros((len(parts), num_classes), dtype=np.int64)
    owner = np.repeat(np.arange(len(parts)), lens)
    flat_labels = labels[np.concatenate(parts).astype(np.int64)]
    return np.bincount(owner * num_classes + flat_labels, minlength=len(parts) * num_classes).reshape(
        len(parts), num_classes
    )


def client_test_shards(
    test_labels: np.ndarray,
    num_clients: int,
    mode: str,
    seed: int,
    train_parts: list[np.ndarray] | None = None,
    train_labels: np.ndarray | None = None,
    *,
    shard_size: int | None = None,
) -> list[np.ndarray]:
    """Per-client test index sets for personalised evaluation.

    `balanced`: every client gets `shard_size` test samples split evenly over the classes present
    (default max(n_test // num_clients, number of classes)). `proportional`: client i's shard follows
    its train label histogram, sized n_test·|train_i|/|train| (at least 1) unless `shard_size` is given.
    Within a class, shards take consecutive runs of a seeded permutation, so they are disjoint while the
    class has enough test samples and wrap around (overlap) when the test set is smaller than the demand.
    """
    labels = _as_labels(test_labels)
    if num_clients < 1:
        raise ConfigError(f"data.num_clients: must be >= 1, got {num_clients}")
    if len(labels) == 0:
        return [np.empty(0, np.int64) for _ in range(num_clients)]
    present = np.flatnonzero(np.bincount(labels))
    if mode == "balanced":
        size = shard_size if shard_size is not None else max(len(labels) // num_clients, len(present))
        quota = _balanced_quota(num_clients, len(present), size)
    elif mode == "proportional":
        if train_parts is None or train_labels is None:
            raise ConfigError("data.client_test: mode 'proportional' needs the clients' train parts and labels")
        if len(train_parts) != num_clients:
            raise ConfigError(f"data.client_test: {len(train_parts)} train parts for {num_clients} clients")
        quota = _proportional_quota(labels, present, train_parts, train_labels, shard_size)
    else:
        raise ConfigError(f"data.client_test: unknown mode {mode!r}; choose one of {list(TEST_MODES)}")
    rng = np.random.default_rng(seed)
    owners, picks = [], []
    for ci, c in enumerate(present):
        idx = rng.permutation(np.flatnonzero(labels == c))
        q = quota[:, ci]
        total = int(q.sum())
        picks.append(idx[np.arange(total) % len(idx)])
        owners.append(np.repeat(np.arange(num_clients), q))
    return _group_values(np.concatenate(picks), np.concatenate(owners), num_clients)


def _balanced_quota(k: int, n_classes: int, size: int) -> np.ndarray:
    """k × classes quotas summing to `size` per client; the remainder rotates over classes by client."""
    if size < 0:
        raise ConfigError(f"client_test_shards: shard_size must be >= 0, got {size}")
    base, extra = divmod(size, n_classes)
    quota = np.full((k, n_classes), base, dtype=np.int64)
    offset = (np.arange(k)[:, None] + np.arange(n_classes)[None, :]) % n_classes  # rotated class rank
    quota += offset < extra
    return quota


def _proportional_quota(
    labels: np.ndarray,
    present: np.ndarray,
    train_parts: list[np.ndarray],
    train_labels: np.ndarray,
    shard_size: int | None,
) -> np.ndarray:
    """k × classes quotas following each client's train label histogram (largest-remainder rounding)."""
    train_labels = _as_labels(train_labels)
    num_classes = int(max(train_labels.max(initial=0), labels.max())) + 1
    hist = label_histograms(train_labels, train_parts, num_classes)[:, present].astype(np.float64)
    lens = hist.sum(axis=1)
    empty = lens == 0
    hist[empty] = 1.0  # a client without (test-present) train labels gets a balanced shard
    lens = np.where(empty, len(present), lens)
    if shard_size is None:
        n_train = max(sum(len(p) for p in train_parts), 1)
        sizes = np.maximum(np.rint(len(labels) * np.array([len(p) for p in train_parts]) / n_train), 1)
    else:
        sizes = np.full(len(train_parts), shard_size, dtype=np.float64)
    exact = hist / lens[:, None] * sizes[:, None]
    quota = np.floor(exact).astype(np.int64)
    left = sizes.astype(np.int64) - quota.sum(axis=1)
    rank = np.argsort(np.argsort(-(exact - quota), axis=1, kind="stable"), axis=1)
    quota += rank < left[:, None]
    return quota
