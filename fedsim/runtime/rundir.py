"""Run folders: claimed before anything is written there, gone again if the run fails before its first round is
written, and checked on resume against the config the run started with.

A new run writes its resolved config twice: `config.yaml`, for people to read (and to edit, to extend a
run), and `checkpoints/config.yaml`, the copy fedsim never rewrites. On `--resume`, the two are compared
key by key: keys that change what the saved state means (data, partition, model, algorithm, training,
participation, stragglers, seed) must be unchanged, or the checkpoint's states would be loaded into a
different experiment; keys in RESUME_SAFE may change (more `rounds`, another backend or worker count,
evaluation cadence, where the results and datasets live, where metrics are tracked). The copy is the
checkpoint's own (its SHA-256 is in checkpoints/manifest.json, fedsim.persist.checkpoint): a resume without it, or with
it changed, is refused, as is one whose manifest names another run than run.json.

A run claims its folder before it writes anything there: it creates `run.json` (its identity) where none exists,
atomically (O_EXCL on a local disk, a conditional put in a store), so of two runs given the same name exactly one
gets it. While a process writes a local run, it holds an advisory lock on that file: a second process resuming the
run, or a sweep redoing it, is refused instead of writing into it.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import socket
import tempfile
import uuid
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config.schema import RESUME_SAFE, RunConfig, config_to_dict, read_yaml
from fedsim.configure import build_config, save_config
from fedsim.errors import CheckpointError, ConfigError, FedsimError
from fedsim.persist.storage import Location, check_reachable, location, remove_tree

if TYPE_CHECKING:
    from fedsim.plugins import PluginSources

RUN_FILE = "run.json"  # the run's claim on its folder, and its identity
MAX_NAME_TRIES = 1000  # default names taken by runs started in the same microsecond
STARTED_CONFIG = Path("checkpoints") / "config.yaml"


def planned_run_dir(cfg: RunConfig) -> Location:
    """results/<run_id>/ (a timestamped id by default), without creating it; refuses a folder holding a run or
    anything else (a run's first write would replace its config.yaml, and an early stop removes what it wrote),
    and a results.root in a store that cannot be reached (fedsim.persist.storage)."""
    run_id = cfg.results.run_id or f"{cfg.name}-{datetime.now().strftime('%Y%m%d-%H%M%S-%f')}"
    root = location(cfg.results.root, "results.root")
    check_reachable(root, "results.root")
    path = root / run_id
    if (path / "rounds.parquet").exists():
        raise ConfigError(f"results.run_id: {path} already holds a run; resume it with --resume {path} "
                          "or choose another run_id")
    if (path / RUN_FILE).exists():
        raise _taken(path)
    if path.exists() and not path.is_dir():
        raise ConfigError(f"results.run_id: {path} exists and is not a folder")
    if path.exists() and next(iter(path.iterdir()), None) is not None:
        raise ConfigError(f"results.run_id: {path} exists and holds files that are not a run's; choose another "
                          "run_id or an empty folder")
    return path


class NewRunDir:
    """A run folder this process claimed, removable as a whole until the run's first round is written.

    The claim (run.json, created only where none exists) comes before any other write; a name another run holds
    is refused, or, for a default name (`results.run_id` unset), the next free one `<name>-2`, `<name>-3`, ... is
    taken. The local lock on run.json is held until `release`."""

    def __init__(self, path: Location, cfg: RunConfig) -> None:
        from fedsim.persist.checkpoint import start_manifest
        from fedsim.plugins import record

        self._created: list[Location] = []  # the parents this run creates, innermost first (results.root may be new)
        parent = path.parent
        while not parent.exists() and parent.parent != parent:
            self._created.append(parent)
            parent = parent.parent
        self.run_id = uuid.uuid4().hex
        self.path, self._existed = self._claim(path, pick_next=cfg.results.run_id is None)
        self.lock = RunLock(self.path)
        try:
            save_config(cfg, self.path / "config.yaml")
            save_config(cfg, self.path / STARTED_CONFIG)
            start_manifest(self.path / STARTED_CONFIG.parent, self.run_id, cfg.seed, STARTED_CONFIG.name,
                           record(cfg.plugins, self.path))
        except BaseException as exc:  # the claim too: a run that cannot start leaves nothing behind
            self.remove()
            if isinstance(exc, OSError):
                raise ConfigError(f"results.root: cannot create the run folder {self.path} "
                                  f"({exc.strerror or exc})") from None
            raise

    def _claim(self, path: Location, pick_next: bool) -> tuple[Location, bool]:
        """The first of `path` (then, with `pick_next`, `path-2`, `path-3`, ...) whose run.json this process
        created, and whether that folder existed before."""
        from fedsim.persist.io import write_new

        for n in range(1, MAX_NAME_TRIES + 1):
            candidate = path if n == 1 else path.parent / f"{path.name}-{n}"
            existed = candidate.exists()
            if n > 1 and existed:  # a folder of that name, claimed or not, is someone else's
                continue
            identity = {"run_id": self.run_id, "name": candidate.name, "created": datetime.now().isoformat(),
                        "host": socket.gethostname(), "pid": os.getpid()}
            try:
                candidate.mkdir(parents=True, exist_ok=True)
                if write_new(candidate / RUN_FILE, (json.dumps(identity, indent=2) + "\n").encode()):
                    return candidate, existed
            except OSError as exc:
                if not existed:
                    self._remove_created(candidate)
                raise ConfigError(f"results.root: cannot create the run folder {candidate} "
                                  f"({exc.strerror or exc})") from None
            if not pick_next:
                raise _taken(candidate)
        raise ConfigError(f"results.run_id: {path} and the next {MAX_NAME_TRIES - 1} names are taken; choose a "
                          "run_id")

    def has_rounds(self) -> bool:
        return (self.path / "rounds.parquet").exists()

    def release(self) -> None:
        """Let other processes resume or redo the run."""
        self.lock.release()

    def remove(self) -> None:
        """Delete what this run wrote; a folder that existed before (empty, or the user's) is kept itself."""
        from fedsim.results.partition_report import LABELS_FILE, PARTITION_FILE

        self.release()
        if not self._existed:
            self._remove_created(self.path)
            return
        for name in ("config.yaml", "meta.json", "checkpoints", "spill", "tensorboard", "tracking.json", "wandb",
                     "plugins", PARTITION_FILE, LABELS_FILE, RUN_FILE):
            target = self.path / name
            if target.is_dir():
                remove_tree(target)
            elif target.exists():
                target.unlink(missing_ok=True)

    def _remove_created(self, folder: Location) -> None:
        remove_tree(folder)
        for parent in self._created:  # only while empty: another run may have started beside this one
            try:
                parent.rmdir()
            except OSError:
                break


def _taken(path: Location) -> ConfigError:
    """The error for a run folder another run has claimed, naming who claimed it where run.json says."""
    try:
        who = json.loads((path / RUN_FILE).read_text())
        by = f" (claimed {who['created']} by pid {who['pid']} on {who['host']})"
    except (OSError, ValueError, TypeError, KeyError, FedsimError):
        by = ""
    return ConfigError(f"results.run_id: {path} is taken by another run{by}; choose another run_id")


class RunLock:
    """An advisory lock (flock) on a local run's run.json while this process writes the run; the system drops it
    when the process ends, however it ends. A run in a store is not locked (its claim still holds)."""

    def __init__(self, run_dir: Location) -> None:
        self._fd: int | None = None
        if not isinstance(run_dir, Path) or not (run_dir / RUN_FILE).is_file():
            return
        import fcntl

        fd = os.open(run_dir / RUN_FILE, os.O_RDONLY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise ConfigError(f"{run_dir}: in use by another fedsim process (it holds {run_dir / RUN_FILE}); "
                              "wait until it ends") from None
        except OSError:  # a file system without locks: the claim alone protects the run
            os.close(fd)
            return
        self._fd = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def __enter__(self) -> RunLock:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


class _Absent:
    def __repr__(self) -> str:
        return "absent"


_ABSENT = _Absent()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def _differences(a: Any, b: Any, prefix: str = "") -> list[tuple[str, Any, Any]]:
    """(dotted key, value in a, value in b) wherever two nested dicts differ; a key on one side only counts."""
    if isinstance(a, dict) and isinstance(b, dict):
        out = []
        for k in sorted(set(a) | set(b), key=str):
            out += _differences(a.get(k, _ABSENT), b.get(k, _ABSENT), f"{prefix}{k}.")
        return out
    return [] if _same(a, b) else [(prefix.rstrip("."), a, b)]


def resume_safe(key: str) -> bool:
    """Whether a resumed run may carry a different value for `key` than it started with."""
    return any(key == safe or key.startswith(safe + ".") for safe in RESUME_SAFE)


def unsafe_changes(started: RunConfig, now: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, started value, current value) for every key outside RESUME_SAFE that differs, sorted by key."""
    return [d for d in _differences(config_to_dict(started), config_to_dict(now)) if not resume_safe(d[0])]


def spill_folder(cfg: RunConfig, run_dir: Location) -> Path:
    """Where workers spill client states: the run's own folder inside runtime.spill_dir, else the run folder's
    spill/, or for a run kept in a store a local temporary folder (a spilled state is a cache, read back within
    the run, never a result). Runs sharing a spill_dir (a sweep's trials) never read or clear each other's files;
    a resumed run gets its folder back. A runtime.spill_dir that is a file here is refused, rather than every
    client that spills failing."""
    if cfg.runtime.spill_dir:
        where = Path(cfg.runtime.spill_dir)
        if where.exists() and not where.is_dir():
            raise ConfigError(f"runtime.spill_dir: {where} exists and is not a folder")
        digest = hashlib.sha1(str(run_dir).encode()).hexdigest()[:8]
        return Path(cfg.runtime.spill_dir) / f"{run_dir.name}-{digest}"
    if isinstance(run_dir, Path):
        return run_dir.resolve() / "spill"
    return Path(tempfile.gettempdir()) / f"fedsim-spill-{run_dir.name}-{os.getpid()}"


def _named(path: Location) -> str | Path:
    """A path as load_config takes it: a local one as it is, one in a store as its URI."""
    return path if isinstance(path, Path) else str(path)


def run_identity(run_dir: Location) -> str:
    """The run_id in a run folder's run.json, which its checkpoints' manifest must name."""
    path = run_dir / RUN_FILE
    if not path.is_file():
        raise CheckpointError(f"{path}: missing (the run's identity, which its checkpoints are checked against; a "
                              "run folder written before fedsim kept one, or damaged); start a new run")
    try:
        run_id = json.loads(path.read_text())["run_id"]
    except (OSError, ValueError, RecursionError, UnicodeDecodeError, KeyError, TypeError):
        run_id = None
    if not isinstance(run_id, str) or not run_id:
        raise CheckpointError(f"{path}: unreadable (no run_id); the run folder is damaged")
    return run_id


def resume_config(run_dir: Location, sources: PluginSources | None = None) -> RunConfig:
    """The config of the run in `run_dir`, refused if it was edited in a way the saved state cannot follow; its
    plugins are checked (fedsim.plugins.for_resume, with the user's `sources`) before any is imported."""
    from fedsim.persist.checkpoint import verify_manifest
    from fedsim.plugins import PluginSources, for_resume

    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        why = "a file, not a folder" if run_dir.exists() else "no such folder"
        raise CheckpointError(f"--resume {run_dir}: not a run folder ({why})")
    if not path.is_file():
        raise CheckpointError(f"--resume {run_dir}: not a run folder (no config.yaml)")
    started_path = run_dir / STARTED_CONFIG
    if started_path.exists() and not started_path.is_file():
        raise CheckpointError(f"{started_path}: not a file (the config the run started with belongs there)")
    manifest = verify_manifest(started_path.parent, run_identity(run_dir))  # before anything of the run's is loaded
    raw = read_yaml(_named(path))
    try:
        started_raw = read_yaml(_named(started_path))
    except FedsimError as exc:
        raise CheckpointError(f"{started_path}: unreadable ({exc})") from None
    plugins, started_plugins = raw.get("plugins") or [], started_raw.get("plugins") or []
    if plugins != started_plugins:
        raise ConfigError(f"{path}: plugins ({started_plugins!r} -> {plugins!r}) changed since the run started "
                          f"({started_path}); start a new run instead")
    raw["plugins"] = started_raw["plugins"] = for_resume(plugins, manifest["plugins"], run_dir,
                                                         sources or PluginSources())
    cfg = build_config(raw)
    try:
        started = build_config(started_raw)
    except FedsimError as exc:
        raise CheckpointError(f"{started_path}: unreadable ({exc})") from None
    diff = unsafe_changes(started, cfg)
    if diff:
        shown = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diff)
        raise ConfigError(f"{path}: {shown} changed since the run started ({started_path}); a resumed run keeps "
                          f"them (only {', '.join(RESUME_SAFE)} may change); start a new run instead")
    if cfg.privacy.level != "none" and cfg.privacy.target_epsilon is not None and cfg.rounds != started.rounds:
        raise ConfigError(f"{path}: rounds ({started.rounds} -> {cfg.rounds}) changed, but privacy.target_epsilon "
                          f"solved the run's noise for {started.rounds} rounds, and other rounds would spend another "
                          "epsilon; start a new run instead")
    return cfg
