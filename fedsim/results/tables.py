"""Run folders and their tables: writing them atomically, and loading them back as DataFrames.

<results.root>/<run_id>/ (a local folder, or one in a store: fedsim.persist.storage) holds config.yaml (resolved),
meta.json (versions, git sha, hardware), rounds.parquet (one row per round and global model), clients.parquet
(one row per client, phase and round), while a long run is on their tail files (TableWriter), and checkpoints/.
Timing columns measured on the wall clock end in `_s`; `virtual_*` columns are the deterministic virtual clock
(seconds).
"""

from __future__ import annotations

import json
import os
import platform
import subprocess
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, Literal, TypedDict

import pandas as pd

from fedsim.errors import CheckpointError, ConfigError
from fedsim.persist.io import atomic_write, atomic_write_text
from fedsim.persist.storage import Location, StorePath, glob_folders, location
from fedsim.plugins import identities

ROUND_COLUMNS = ["round", "model", "accuracy", "loss", "participants", "arrived", "stragglers", "failures",
                 "bytes_up", "bytes_down", "virtual_time", "virtual_round", "wall_round_s"]
ROUND_LEVEL = frozenset({"round", "model", "participants", "arrived", "stragglers", "over_selected", "failures",
                         "bytes_up", "bytes_down", "virtual_round", "virtual_time", "deadline", "wall_round_s",
                         "wall_clients_s", "wall_server_s", "wall_eval_s", "clients_batched", "clients_online",
                         "offline"})
CLIENT_COLUMNS = ["round", "phase", "client", "worker", "arch", "samples", "status", "virtual_duration",
                  "bytes_up", "bytes_down", "wall_s", "error", "error_type", "error_message", "error_traceback"]


def model_metric(column: str) -> bool:
    """Whether a rounds.parquet column is one global model's (accuracy, loss, ...) rather than the round's own
    (participants, bytes, clocks, and the method's `<phase>/<metric>` server metrics)."""
    return column not in ROUND_LEVEL and "/" not in column


def failure_columns(error_type: str, message: str, traceback: str = "") -> dict[str, str]:
    """A failed client's columns in clients.parquet (present once any client failed): `error`, one line
    "Type: message"; `error_type` and `error_message`, the original exception's; `error_traceback`, its last frames.
    A client whose whole worker was lost carries the worker's error."""
    first = (message.strip().splitlines() or [""])[0]
    return {"error": f"{error_type}: {first}"[:500], "error_type": error_type, "error_message": message,
            "error_traceback": traceback}


FRESH_ROWS = 10_000
"""A table of up to this many rows is rewritten whole with every round's rows (a few milliseconds)."""
REWRITE_GROWTH = 0.05
"""A larger one is rewritten whole once it has grown by this share; the rows since go to its tail file."""
FOLLOWS_ROWS = b"fedsim.follows_rows"
"""The tail file's metadata key: how many rows of the main file the tail's rows come after."""


def tail_of(path: Location) -> Location:
    """The tail file of a table (clients.parquet: clients.tail.parquet): its latest rows while a long run is on."""
    return path.parent / path.name.replace(".parquet", ".tail.parquet")


def table_columns(path: Location) -> list[str]:
    """The columns a run's table puts first, in this order (the rest follow in first-seen order)."""
    return {"rounds.parquet": ROUND_COLUMNS, "clients.parquet": CLIENT_COLUMNS}.get(path.name, [])


class TableWriter:
    """One growing table, kept converted to Arrow, written as rows arrive: rows already converted stay converted,
    so a round costs its own rows' conversion and one columnar write of a size that does not grow with the run.

    Rewriting the whole table every round made a long run's rounds slower and slower (the bench's C, 100 clients
    a round: 0.063 s a round at first, 0.133 s after 1,250 rounds). Up to FRESH_ROWS rows the file is rewritten
    whole; past it, once the table has grown by REWRITE_GROWTH since the last rewrite (all rewrites together cost
    about 21 times the last one), and the rows since then are written to the tail file instead (at most that
    share of the table). `read_table` joins the two; `flush` (at the run's end) writes the main file whole and
    removes the tail.
    A column a later round adds (a failure's `error`) or widens (int to float) is promoted as pandas would."""

    def __init__(self, path: Location, columns: list[str], fresh_rows: int | None = None,
                 growth: float | None = None) -> None:
        self.path, self.tail, self.columns = path, tail_of(path), columns
        self.fresh_rows = FRESH_ROWS if fresh_rows is None else fresh_rows
        self.growth = REWRITE_GROWTH if growth is None else growth
        self._table: Any = None  # pyarrow Table of the rows converted so far
        self._converted = 0  # how many rows that is
        self._on_disk: int | None = None  # how many rows the main file holds (None: not written by this writer)
        self._tail_rows = 0  # how many the tail file holds after them

    def write(self, rows: list[dict]) -> None:
        """Write `rows` (every row so far; the ones before the last call's are taken as unchanged) to the main file."""
        if len(rows) < self._converted:  # not the rows this writer has seen: start again
            self._table, self._converted, self._on_disk = None, 0, None
        self.append(rows[self._converted:])
        self.flush()

    def append(self, rows: list[dict]) -> None:
        """Add `rows` (new ones) to the table and write them: a rewrite of the main file or of the tail."""
        import pyarrow as pa

        if rows or self._table is None:
            chunk = _arrow_rows(rows)
            self._table = chunk if self._table is None else \
                pa.concat_tables([self._table, chunk], promote_options="permissive")
            self._converted += len(rows)
        if self._on_disk is None or self._converted <= self.fresh_rows or \
                self._converted - self._on_disk >= self.growth * self._on_disk:
            self.flush()
        elif self._converted > self._on_disk + self._tail_rows:
            on_disk = self._on_disk
            tail = _in_order(self._table.slice(on_disk), self.columns).replace_schema_metadata(
                {FOLLOWS_ROWS: str(on_disk)})
            atomic_write(self.tail, lambda tmp: _write_parquet(tail, tmp))
            self._tail_rows = self._converted - on_disk

    def flush(self) -> None:
        """Rewrite the main file with every row converted so far (unless it holds them already); no tail is left."""
        if self._table is None or (self._on_disk == self._converted and not self._tail_rows):
            return
        first = self._on_disk is None
        # one chunk per column again: a table of a thousand one-round chunks took 15 ms to write, 0.8 ms combined
        table = _in_order(self._table.combine_chunks(), self.columns)
        self._table = table
        atomic_write(self.path, lambda tmp: _write_parquet(table, tmp))
        self._on_disk = self._converted
        if first or self._tail_rows:  # a tail left by an earlier process must not be joined to this file
            self.tail.unlink(missing_ok=True)
            self._tail_rows = 0


def _in_order(table: Any, first: list[str]) -> Any:
    """`table` with the columns `first` names first, in that order, and the others after them as they are."""
    names = table.column_names
    return table.select([c for c in first if c in names] + [c for c in names if c not in first])


def _arrow_rows(rows: list[dict]) -> Any:
    """`rows` as an Arrow table: every key a column, in first-seen order, as pandas would make them."""
    import pyarrow as pa

    names = list(dict.fromkeys(k for r in rows for k in r))
    chunk = pa.table({k: [r.get(k) for r in rows] for k in names})  # (a tenth of a DataFrame's cost)
    # float32 metrics become float64, as pandas makes them once a later round leaves the column empty
    return chunk.cast(pa.schema([pa.field(f.name, pa.float64()) if pa.types.is_floating(f.type) else f
                                 for f in chunk.schema])).replace_schema_metadata(None)


def _write_parquet(table: Any, path: Any) -> None:
    import pyarrow.parquet as pq

    pq.write_table(table, path)


def run_meta() -> dict:
    """Versions, git sha and hardware, for meta.json."""
    import numpy
    import torch

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    from importlib.metadata import PackageNotFoundError, version

    try:
        ray_version = version("ray")  # without importing Ray (seconds) into a local run
    except PackageNotFoundError:
        ray_version = ""
    import fedsim

    return {"fedsim": fedsim.__version__, "git_sha": sha, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "ray": ray_version,
            "platform": platform.platform(), "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "cuda": torch.cuda.is_available(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def write_meta(run_dir: Location, extra: dict) -> None:
    atomic_write_text(run_dir / "meta.json", json.dumps({**run_meta(), **extra}, indent=2, default=str))


def update_meta(run_dir: Location, changes: dict) -> None:
    """Rewrite meta.json (atomically) with `changes` over what it holds: the workers' placement after a replacement,
    the run's status at its end. A meta.json damaged since the run wrote it keeps only the changes; a missing one
    stays missing."""
    path = run_dir / "meta.json"
    if not path.is_file():
        return
    try:
        meta = json.loads(path.read_text())
    except (ValueError, RecursionError):
        meta = {}
    meta = meta if isinstance(meta, dict) else {}
    atomic_write_text(path, json.dumps({**meta, **changes}, indent=2, default=str))


def read_table(path: Location) -> pd.DataFrame:
    """A parquet table of a run (with its tail file's rows while a long run is on: TableWriter), with a one-line
    CheckpointError naming the file if it is missing or corrupt."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the run folder is incomplete)")
    main = _read_bytes(path)  # the main file first: a tail read after it follows this file or a later one
    tail = tail_of(path)
    try:
        rest = _parquet(tail, pq.read_table, _read_bytes(tail)) if tail.is_file() else None
    except CheckpointError:
        if tail.exists():
            raise
        rest = None  # removed meanwhile: the main file was rewritten whole after this one was read
    if rest is None or (rest.schema.metadata or {}).get(FOLLOWS_ROWS) != \
            str(_parquet(path, lambda f: pq.ParquetFile(f).metadata.num_rows, main)).encode():
        return _parquet(path, pd.read_parquet, main)
    try:
        table = pa.concat_tables([_parquet(path, pq.read_table, main), rest.replace_schema_metadata(None)],
                                 promote_options="permissive")
    except (pa.ArrowInvalid, pa.ArrowTypeError) as exc:
        raise CheckpointError(f"{tail}: does not fit {path.name} ({_first_line(exc)})") from None
    table = _in_order(table, table_columns(path))
    sink = pa.BufferOutputStream()  # read back as the main file would be, had it every row
    pq.write_table(table, sink)
    return pd.read_parquet(pa.BufferReader(sink.getvalue()))


def table_rows(df: pd.DataFrame) -> list[dict]:
    """A table read back (read_table) as the rows it was written from: a value missing from a column of text or
    other objects is None, as the run made it, not the float NaN that pandas reads it as (which would make the
    column numbers when the rows are written again); a float column keeps its NaN."""
    rows = df.to_dict("records")
    loose = [c for c in df.columns if not pd.api.types.is_float_dtype(df[c].dtype)]
    for row in rows:
        for c in loose:
            v = row[c]
            if v is pd.NA or (isinstance(v, float) and v != v):
                row[c] = None
    return rows


def _read_bytes(path: Location) -> bytes:
    """A run's file in one read (a table that a live run replaces meanwhile is still read whole)."""
    try:
        with path.open("rb") as f:
            return f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing (the run folder is incomplete)") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {_first_line(exc)})") from None


def _parquet(path: Location, read: Callable[[Any], Any], data: bytes) -> Any:
    """`read` (a parquet reader) of `data`, the bytes of `path`, naming the file in one line if it is not a table."""
    try:
        return read(_arrow_owned(data))
    except Exception as exc:  # truncated, foreign or corrupt file: name it, no traceback
        raise CheckpointError(f"{path}: unreadable table ({type(exc).__name__}: {_first_line(exc)})") from None


def _arrow_owned(data: bytes) -> Any:
    """A reader of a copy of `data` in arrow's own memory. Arrow frees what it reads on its pool threads, after the
    read has returned; freeing a Python file or bytes object there takes the GIL, and a thread that asks for it
    while the interpreter exits aborts the process (SIGABRT, after the run's own one-line error was printed)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    sink.write(data)
    return pa.BufferReader(sink.getvalue())


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [""])[0][:200]


def _read_text(path: Location, parse) -> dict:
    """A run's config.yaml or meta.json as a dict ({} when absent), naming the file when it is corrupt."""
    if not path.is_file():
        return {}
    try:
        data = parse(path.read_text())
    except Exception as exc:
        raise CheckpointError(f"{path}: unreadable ({type(exc).__name__}: {_first_line(exc)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a mapping")
    return data


def a_folder(path: str | Path | StorePath) -> Location:
    """The folder `path` names (also as a bare run id under ./results, or as a URI), which must exist."""
    p = location(path, "run folder")
    if isinstance(p, Path) and not p.exists() and not p.is_absolute() and (Path("results") / p).exists():
        p = Path("results") / p
    if not p.is_dir():
        why = "a file, not a folder" if p.exists() else "no such folder"
        raise CheckpointError(f"{p}: not a fedsim run folder ({why})")
    return p


def run_folder(path: str | Path | StorePath) -> Location:
    """The run folder `path` names (also as a bare run id under ./results, or as a URI); it must hold rounds.parquet."""
    p = a_folder(path)
    if not (p / "rounds.parquet").exists():
        raise CheckpointError(f"{p}: not a fedsim run folder (no {p / 'rounds.parquet'})")
    return p


class SkippedRuns(UserWarning):
    """Run folders that `collect` (or a plot) passed over, each with its reason: the one warning the CLI prints."""


class RunTables(TypedDict):
    """What `load` returns for a run folder."""

    rounds: pd.DataFrame
    clients: pd.DataFrame
    config: dict[str, Any]
    meta: dict[str, Any]


def load(path: str | Path | StorePath) -> RunTables:
    """A run's tables: {"rounds": DataFrame, "clients": DataFrame, "config": dict, "meta": dict}.

    A missing clients.parquet gives an empty table; a corrupt file of any kind is a CheckpointError naming it."""
    import yaml

    p = run_folder(path)
    rounds = read_table(p / "rounds.parquet")
    if "round" not in rounds.columns:  # a parquet file of something else: no table of it would mean anything
        raise CheckpointError(f"{p / 'rounds.parquet'}: not a fedsim rounds table (it has no 'round' column)")
    clients = read_table(p / "clients.parquet") if (p / "clients.parquet").exists() else pd.DataFrame()
    return {"rounds": rounds, "clients": _up_to(clients, rounds),
            "config": _read_text(p / "config.yaml", yaml.safe_load), "meta": _read_text(p / "meta.json", json.loads)}


def _up_to(clients: pd.DataFrame, rounds: pd.DataFrame) -> pd.DataFrame:
    """`clients` without the rows of rounds past rounds.parquet's last: a run writes a round's client rows before
    its row in rounds.parquet, so a live or killed run's clients.parquet may hold a round that rounds.parquet does
    not yet; the two tables read back then hold the same rounds."""
    if "round" not in clients.columns or clients.empty:
        return clients
    done = pd.to_numeric(rounds["round"], errors="coerce")
    numbered = pd.to_numeric(clients["round"], errors="coerce")
    if done.isna().any() or numbered.isna().any():  # not round numbers: nothing to line up
        return clients
    last = done.max() if len(done) else -1
    if (numbered <= last).all():
        return clients
    return clients[numbered <= last].reset_index(drop=True)


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {"a.b": value}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if not isinstance(v, (list, dict)) else json.dumps(v)
    return out


def _is_run(p: Location) -> bool:
    return (p / "rounds.parquet").exists()


def _looks_like_run(p: Location) -> bool:
    """A folder a run started in (it has its config or meta) whether or not it finished a round; a run's own
    checkpoints/ folder, which holds a config.yaml too, is part of that run."""
    if _is_run(p):
        return True
    return ((p / "config.yaml").exists() or (p / "meta.json").exists()) and not _is_run(p.parent)


def path_items(paths: Any) -> list[Any]:
    """`paths` as a list of items: one path, URI or glob pattern (never its letters), or an iterable of them."""
    if isinstance(paths, (str, Path, StorePath)) or hasattr(paths, "__fspath__"):
        return [paths]
    if isinstance(paths, Iterable) and not isinstance(paths, (bytes, dict)):
        items = list(paths)
        if not items:  # e.g. a glob.glob() that matched nothing: an empty table would hide the mistake
            raise ConfigError("run folders: none given (an empty list)")
        return items
    raise ConfigError(f"run folders: expected a path, a URI, a glob pattern or a list of them, got "
                      f"{type(paths).__name__} {str(paths)[:60]!r}")


def find_runs(paths: str | Path | StorePath | Iterable[str | Path | StorePath]) -> tuple[list[Location], list[str]]:
    """Run folders named by `paths` and the incomplete ones skipped (as "path: reason").

    `paths` is one path, URI or glob pattern (a str or Path is one item, never its letters) or an iterable of
    them; a folder that is not itself a run but holds run folders (a results root) stands for its runs, and a sweep's
    folder (`fedsim sweep --output-dir`) for the runs in its runs/."""
    import glob

    items = path_items(paths)
    runs: list[Location] = []
    skipped: list[str] = []
    for item in items:
        text = str(item)
        matches: list[Location]
        literal = isinstance(item, StorePath) or not glob.has_magic(text) or Path(text).is_dir()
        if not literal:  # a pattern; a folder whose name holds [ ] * ? is taken as it is
            matches = glob_folders(text)
            if not matches:
                raise CheckpointError(f"{text}: matches no folder")
        else:
            folder = location(item, "run folder")
            if not folder.is_dir():
                why = "a file, not a run folder" if folder.exists() else "no such run folder"
                raise CheckpointError(f"{text}: {why}")
            matches = [folder]
        for p in matches:
            if _is_run(p):
                runs.append(p)
            elif _looks_like_run(p):
                skipped.append(f"{p}: incomplete (no rounds.parquet)")
            else:
                children = _runs_in(p) or _runs_in(p / SWEEP_RUNS)
                if not children and len(matches) == 1 and not glob.has_magic(text):
                    raise CheckpointError(f"{p}: neither a run folder nor a folder of runs")
                for c in children:
                    (runs.append(c) if _is_run(c) else skipped.append(f"{c}: incomplete (no rounds.parquet)"))
    unique: dict[Any, Location] = {}  # one entry per folder, however it was named (r/x and r/../r/x)
    for run in runs:
        unique.setdefault(run.resolve() if isinstance(run, Path) else str(run), run)
    return list(unique.values()), skipped


SWEEP_RUNS = "runs"  # a sweep's folder keeps its runs in this subfolder


def _runs_in(folder: Location) -> list[Location]:
    """The folders in `folder` that a run started in, sorted (none if it is no folder)."""
    if not folder.is_dir():
        return []
    return sorted((c for c in folder.iterdir() if c.is_dir() and _looks_like_run(c)), key=str)


def run_names(runs: Sequence[Location]) -> list[str]:
    """A name per run for the `run` column: its folder's name, with as many parent folders before it as it takes
    to tell apart runs whose folders share a name (results/a/seed0 and results/b/seed0: a/seed0 and b/seed0)."""
    parts = [[p for p in (r.parts if isinstance(r, Path) else str(r).split("/")) if p.strip("/")] or [str(r)]
             for r in runs]
    depth = [1] * len(runs)
    while True:
        names = ["/".join(ps[-d:]) for ps, d in zip(parts, depth)]
        clash = {n for n in names if names.count(n) > 1}
        grow = [i for i, n in enumerate(names) if n in clash and depth[i] < len(parts[i])]
        if not grow:
            return names
        for i in grow:
            depth[i] += 1


def unfinished(res: RunTables) -> str | None:
    """Why a run's tables are not a finished run's (None when they are): meta.json records how the run ended
    (completed, or stopped by a callback, count as finished); without that record, a run is finished when its
    table reaches the configured rounds (a run still going, or killed, has not)."""
    status = res["meta"].get("status")
    if status in ("completed", "stopped"):
        return None
    rounds = res["rounds"]
    numbered = pd.to_numeric(rounds["round"], errors="coerce") if "round" in rounds else pd.Series(dtype=float)
    if numbered.isna().any():  # written by something else: no count of rounds to trust
        return "incomplete (its round column is not round numbers)"
    done = int(numbered.max()) + 1 if len(numbered) else 0
    planned = res["config"].get("rounds")
    if status is None:
        if isinstance(planned, int) and done >= planned:
            return None
        return f"incomplete ({done} of {planned} rounds; running, or killed)"
    return f"incomplete ({status} after {done} of {planned} rounds)"


def collect(paths: str | Path | Iterable[str | Path], table: Literal["rounds", "clients"] = "rounds",
            incomplete: bool = False) -> pd.DataFrame:
    """Concatenate one table of many runs, with a `run` column (run_names) and every config key as `config.<key>`
    (`config.plugins` as `module@sha256` identities: fedsim.plugins.identities).

    `paths`: run folders, folders of runs (e.g. "results") or glob patterns ("results/demo-*"). Folders a
    run started in but that hold no rounds.parquet, runs whose files are unreadable and, unless `incomplete`,
    runs that did not finish (see `unfinished`) are skipped with a warning naming each; the skipped ones are
    listed in `df.attrs["skipped"]` as "folder: reason"."""
    import warnings

    if table not in ("rounds", "clients"):
        raise ConfigError(f"fedsim.collect: table must be 'rounds' or 'clients', got {table!r}"[:200])
    runs, skipped = find_runs(paths)
    frames = []
    for path, name in zip(runs, run_names(runs)):
        try:
            res = load(path)
        except CheckpointError as exc:
            skipped.append(str(exc))
            continue
        reason = None if incomplete else unfinished(res)
        if reason is not None:
            skipped.append(f"{path}: {reason}")
            continue
        df = res[table].copy()
        if "run" in df.columns:  # what collect adds: a table gathered from several runs, saved in a run's place
            skipped.append(f"{path}: its {table} table has a 'run' column, as collected tables do")
            continue
        df.insert(0, "run", name)
        for k, v in flatten(res["config"]).items():
            df[f"config.{k}"] = v
        if res["config"].get("plugins"):
            df["config.plugins"] = json.dumps(identities(res["config"]["plugins"], _recorded_plugins(path)))
        frames.append(df)
    out = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
    for c in out.columns:  # a key one run's config lacks and another's sets to null: one missing value, None
        if c.startswith("config.") and out[c].dtype == object:
            out[c] = out[c].astype(object).where(out[c].notna(), None)
    if skipped:
        warnings.warn(f"fedsim.collect skipped {len(skipped)} folder(s): " + "; ".join(skipped), SkippedRuns,
                      stacklevel=2)
    out.attrs["skipped"] = skipped
    return out


def _recorded_plugins(run: Location) -> dict:
    """What a run's manifest recorded of its plugins ({} when it has none or it is unreadable)."""
    try:
        recorded = json.loads((run / "checkpoints" / "manifest.json").read_text()).get("plugins", {})
    except (OSError, ValueError, AttributeError):
        return {}
    return recorded if isinstance(recorded, dict) else {}


def summary(rounds: pd.DataFrame) -> pd.DataFrame:
    """One line per evaluated round and model: the columns a person reads first."""
    cols = [c for c in ["round", "model", "accuracy", "loss", "participants", "arrived", "stragglers",
                        "failures", "bytes_up", "bytes_down", "virtual_time", "wall_round_s"] if c in rounds]
    return rounds[cols]
