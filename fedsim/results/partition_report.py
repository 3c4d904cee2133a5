"""The partition report: each client's sample counts and label histograms, and the split's heterogeneity in a few
numbers, written once as a run starts and read back with `fedsim.partition_report(run)`.

`partition.parquet` holds one row per client id (`client`, `train`, `val`, `test` sample counts) and the numbers in
its metadata (also in meta.json's `partition`); `partition_labels.parquet` holds the label histograms as a sparse
long table (`client`, `split`, `label`, `count`, only the nonzero counts), so it never outgrows the split itself:
100k clients × 100 classes of a 50k-sample dataset is at most 50k rows per split, never 10M.

Generated shards (`data.partition.kind: generated`) draw each client's labels from its own stream when it trains;
drawing them all here would cost ~75 µs a client (7.5 s at 100k clients), so their report has the counts only,
and `stats["labels"]` says so.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from fedsim.errors import CheckpointError, FedsimError

if TYPE_CHECKING:
    import pandas as pd

    from fedsim.persist.storage import Location, StorePath
    from fedsim.runtime.setup import AnyPartition

log = logging.getLogger("fedsim.partition")

PARTITION_FILE = "partition.parquet"
LABELS_FILE = "partition_labels.parquet"
STATS_KEY = b"fedsim.partition"
"""partition.parquet's metadata key holding the stats, as JSON."""
SPLITS = ("train", "val", "test")
GENERATED_NOTE = "counts only: generated shards draw each client's labels as it trains"
OTHER_LABELS_NOTE = "counts only: the dataset's labels are not one class id per sample"
_DENSE_BINS = 1 << 22  # a split is counted with one bincount up to this many (client, class) bins, else sorted


@dataclass(frozen=True)
class PartitionReport:
    """A run's split: `clients` (one row per client id: `client`, `train`, `val`, `test` sample counts), `labels`
    (the nonzero label counts as `client`, `split`, `label`, `count`; None for generated shards, whose labels are
    drawn as clients train) and `stats` (the heterogeneity numbers: see docs/results.md)."""

    clients: pd.DataFrame
    labels: pd.DataFrame | None
    stats: dict[str, Any]

    def histogram(self, split: str = "train") -> np.ndarray:
        """The clients × classes matrix of `split`'s label counts (dense: for a few thousand clients, not 100k)."""
        if self.labels is None:
            raise CheckpointError(f"partition report: no label histograms ({self.stats.get('labels')})")
        if split not in SPLITS:
            raise FedsimError(f"split: one of {', '.join(SPLITS)}, got {split!r}"[:200])
        rows = self.labels[self.labels["split"] == split]
        out = np.zeros((len(self.clients), int(self.stats["classes"])), dtype=np.int64)
        np.add.at(out, (rows["client"].to_numpy(), rows["label"].to_numpy()), rows["count"].to_numpy())
        return out


@dataclass(frozen=True)
class _Counts:
    """What the report is computed into: sizes (clients × 3), the sparse label rows (None: not known), the stats."""

    sizes: np.ndarray
    rows: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None  # client, split index, label, count
    stats: dict[str, Any]


def compute(part: AnyPartition, y_train: np.ndarray, y_test: np.ndarray, num_classes: int) -> _Counts:
    """The report of `part` (index lists into `y_train` / `y_test`, or generated shards), vectorised: per split, one
    count of client·classes + label over every index it holds; the label rows are sorted by split, client, label."""
    if hasattr(part, "split_sizes"):  # generated shards (fedsim.data.generated): sizes only, until drawn
        sizes = part.split_sizes()
        return _Counts(sizes, None, _stats(sizes, None, int(num_classes), GENERATED_NOTE))
    k = len(part.train)
    lists = [(part.train, y_train), (part.val, y_train)] + ([(part.test, y_test)] if part.test is not None else [])
    sizes = np.zeros((k, len(SPLITS)), dtype=np.int64)
    for s, (ragged, _) in enumerate(lists):
        sizes[:, s] = ragged.lengths()
    ys = [_class_ids(y) for _, y in lists]
    known = [y for y in ys if y is not None]
    if len(known) < len(ys):
        return _Counts(sizes, None, _stats(sizes, None, int(num_classes), OTHER_LABELS_NOTE))
    found = [_nonzero(ragged.flat, y, sizes[:, s], num_classes) for s, ((ragged, _), y) in enumerate(zip(lists, known))]
    classes = max([int(num_classes)] + [c for *_, c in found])
    client = np.concatenate([f[0] for f in found])
    split = np.concatenate([np.full(len(f[0]), s, dtype=np.int64) for s, f in enumerate(found)])
    label = np.concatenate([f[1] for f in found])
    counts = np.concatenate([f[2] for f in found])
    return _Counts(sizes, (client, split, label, counts), _stats(sizes, found[0][:3], classes))


def _class_ids(y: np.ndarray) -> np.ndarray | None:
    """`y` as one int64 class id per sample, or None when it is not (sequences of labels, negative ids)."""
    y = np.asarray(y)
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer) or (len(y) and y.min() < 0):
        return None
    return y.astype(np.int64, copy=False)


def _nonzero(flat: np.ndarray, y: np.ndarray, sizes: np.ndarray,
             num_classes: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, int]:
    """(client, label, count) of every nonzero count of one split, sorted by client then label, and the number of
    classes seen: one bincount of client·classes + label (a sort instead when that is far more bins than samples)."""
    labels = y[flat]
    classes = max(int(num_classes), int(labels.max()) + 1 if len(labels) else 0)
    key = np.repeat(np.arange(len(sizes), dtype=np.int64) * classes, sizes) + labels
    bins = len(sizes) * classes
    if bins <= max(_DENSE_BINS, 4 * len(key)):
        counted = np.bincount(key, minlength=bins)
        keys = np.flatnonzero(counted)
        count = counted[keys]
    else:
        keys, count = np.unique(key, return_counts=True)
    client, label = np.divmod(keys, classes)
    return client, label, count, classes


def _stats(sizes: np.ndarray, train_rows: tuple[np.ndarray, ...] | None, classes: int,
           why_not: str = "") -> dict[str, Any]:
    """The split's numbers: totals, the spread of training sizes (CV, Gini), and, from the training label
    histograms (`train_rows`: client, label, count), each client's total-variation distance to the pooled training
    labels and its number of classes."""
    train = sizes[:, 0]
    k = len(train)
    mean = float(train.mean()) if k else 0.0
    out: dict[str, Any] = {
        "clients": k, "classes": int(classes),
        **{f"{s}_samples": int(sizes[:, i].sum()) for i, s in enumerate(SPLITS)},
        "empty_clients": int((train == 0).sum()),
        "size_mean": mean, "size_min": int(train.min()) if k else 0, "size_max": int(train.max()) if k else 0,
        "size_cv": float(train.std() / mean) if mean > 0 else None, "size_gini": _gini(train),
        "labels": "recorded" if train_rows is not None else why_not,
        "tv_mean": None, "tv_p10": None, "tv_median": None, "tv_p90": None,
        "classes_per_client_mean": None, "classes_per_client_min": None, "classes_per_client_max": None,
    }
    if train_rows is not None and mean > 0:
        client, label, count = train_rows
        tv = _tv(client, label, count, train, classes)
        held = train > 0
        per_client = np.bincount(client, minlength=k)[held]
        p10, median, p90 = np.percentile(tv[held], [10, 50, 90])
        out.update(tv_mean=float(tv[held].mean()), tv_p10=float(p10), tv_median=float(median), tv_p90=float(p90),
                   classes_per_client_mean=float(per_client.mean()), classes_per_client_min=int(per_client.min()),
                   classes_per_client_max=int(per_client.max()))
    return out


def _tv(client: np.ndarray, label: np.ndarray, count: np.ndarray, sizes: np.ndarray, classes: int) -> np.ndarray:
    """Each client's total-variation distance ½·Σ_c |p_c − q_c| between its training labels p and the pooled ones
    q, from the nonzero counts alone: a class the client lacks adds q_c, so TV = ½·(1 + Σ_nonzero (|p_c − q_c| − q_c));
    NaN for a client without training samples."""
    q = np.bincount(label, weights=count, minlength=classes) / max(int(count.sum()), 1)
    p = count / np.maximum(sizes[client], 1)
    terms = np.abs(p - q[label]) - q[label]
    with np.errstate(invalid="ignore"):
        tv = 0.5 * (1.0 + np.bincount(client, weights=terms, minlength=len(sizes)))
    return np.where(sizes > 0, np.clip(tv, 0.0, 1.0), np.nan)


def _gini(x: np.ndarray) -> float | None:
    """The Gini coefficient of the client sizes (0: all equal; near 1: one client holds everything)."""
    total = float(x.sum())
    if len(x) == 0 or total <= 0:
        return None
    s = np.sort(x).astype(np.float64)
    n = len(s)
    return float(2.0 * np.dot(np.arange(1, n + 1), s) / (n * total) - (n + 1) / n)


def _tables(counts: _Counts) -> tuple[Any, Any | None]:
    """The two parquet tables of a report (the stats in the first one's metadata)."""
    import pyarrow as pa

    sizes = counts.sizes
    clients = pa.table({"client": pa.array(np.arange(len(sizes), dtype=np.int64)),
                        **{s: pa.array(sizes[:, i]) for i, s in enumerate(SPLITS)}})
    clients = clients.replace_schema_metadata({STATS_KEY: json.dumps(counts.stats).encode()})
    if counts.rows is None:
        return clients, None
    client, split, label, count = counts.rows
    names = pa.array(list(SPLITS))
    labels = pa.table({"client": pa.array(client.astype(np.int64)),
                       "split": pa.DictionaryArray.from_arrays(pa.array(split.astype(np.int8)), names),
                       "label": pa.array(label.astype(np.int32)), "count": pa.array(count.astype(np.int64))})
    return clients, labels


def write_once(run_dir: Location, part: AnyPartition, y_train: np.ndarray, y_test: np.ndarray,
               num_classes: int) -> dict[str, Any]:
    """Write the run's report unless its folder has one (a resumed run keeps the one it started with); its stats.
    A run folder from before reports gets one on its first resume (the split is the config's, so it is the same).
    The labels are written first: partition.parquet, last, is the mark of a whole report."""
    from fedsim.persist.io import atomic_write
    from fedsim.results.tables import _write_parquet

    path = run_dir / PARTITION_FILE
    if path.exists():
        try:
            return read_stats(path)
        except CheckpointError as exc:  # the run goes on without it: the report is a record, not the run's state
            log.warning("%s; the run goes on without its partition numbers in meta.json", exc)
            return {}
    counts = compute(part, y_train, y_test, num_classes)
    clients, labels = _tables(counts)
    if labels is not None:
        atomic_write(run_dir / LABELS_FILE, lambda tmp: _write_parquet(labels, tmp))
    atomic_write(path, lambda tmp: _write_parquet(clients, tmp))
    return counts.stats


def read_stats(path: Location) -> dict[str, Any]:
    """The stats in partition.parquet's metadata, from its footer alone."""
    import pyarrow.parquet as pq

    from fedsim.results.tables import _parquet, _read_bytes

    schema = _parquet(path, lambda f: pq.read_schema(f), _read_bytes(path))
    return _stats_of(path, schema.metadata or {})


def _stats_of(path: Location, metadata: dict[bytes, bytes]) -> dict[str, Any]:
    try:
        stats = json.loads(metadata[STATS_KEY])
    except (KeyError, ValueError, RecursionError, UnicodeDecodeError):
        stats = None
    if not isinstance(stats, dict) or not isinstance(stats.get("clients"), int) or \
            not isinstance(stats.get("classes"), int):
        raise CheckpointError(f"{path}: not a fedsim partition report (no {STATS_KEY.decode()} metadata)")
    return stats


def report_folder(path: str | Path | StorePath) -> Location:
    """The run folder `path` names (as fedsim.load takes it: a path, a bare run id under ./results, a URI), which
    must hold a partition report."""
    from fedsim.results.tables import a_folder

    p = a_folder(path)
    if not (p / PARTITION_FILE).is_file():
        if not any((p / name).exists() for name in ("run.json", "config.yaml", "rounds.parquet")):
            raise CheckpointError(f"{p}: not a fedsim run folder (no run.json, config.yaml or rounds.parquet)")
        raise CheckpointError(f"{p}: no partition report ({PARTITION_FILE}; runs started before fedsim wrote one "
                              "get it when resumed)")
    return p


def partition_report(path: str | Path | StorePath) -> PartitionReport:
    """A run's partition report: per-client counts, label histograms and heterogeneity numbers (PartitionReport).

    A folder that is no run, or a run without a report, or a damaged report, is a one-line CheckpointError."""
    import pyarrow.parquet as pq

    from fedsim.results.tables import _parquet, _read_bytes

    p = report_folder(path)
    table = _parquet(p / PARTITION_FILE, pq.read_table, _read_bytes(p / PARTITION_FILE))
    stats = _stats_of(p / PARTITION_FILE, table.schema.metadata or {})
    clients = table.replace_schema_metadata(None).to_pandas()
    if list(clients.columns) != ["client", *SPLITS] or len(clients) != stats["clients"]:
        raise CheckpointError(f"{p / PARTITION_FILE}: not a fedsim partition report (columns "
                              f"{list(clients.columns)[:6]}, {len(clients)} rows for {stats['clients']} clients)")
    labels = None
    if stats.get("labels") == "recorded":
        where = p / LABELS_FILE
        if not where.is_file():
            raise CheckpointError(f"{where}: missing (the partition report is incomplete)")
        labels = _parquet(where, pq.read_table, _read_bytes(where)).to_pandas()
        if list(labels.columns) != ["client", "split", "label", "count"]:
            raise CheckpointError(f"{where}: not a fedsim label histogram (columns {list(labels.columns)[:6]})")
    return PartitionReport(clients, labels, stats)
