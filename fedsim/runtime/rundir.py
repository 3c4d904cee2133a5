"""Run folders: created only once a run can start, gone again if it fails before its first round is written,
and checked on resume against the config the run started with.

A new run writes its resolved config twice: `config.yaml`, for people to read (and to edit, to extend a
run), and `checkpoints/config.yaml`, the copy fedsim never rewrites. On `--resume`, the two are compared
key by key: keys that change what the saved state means (data, partition, model, algorithm, training,
participation, stragglers, seed) must be unchanged, or the checkpoint's states would be loaded into a
different experiment; keys in RESUME_SAFE may change (more `rounds`, another backend or worker count,
evaluation cadence, where the results and datasets live, where metrics are tracked). Runs saved before the
copy existed are not checked; their first resume writes it.
"""

from __future__ import annotations

import hashlib
import math
import os
import tempfile
from datetime import datetime
from pathlib import Path
from typing import Any

from fedsim.config.schema import RESUME_SAFE, RunConfig, config_to_dict, read_yaml
from fedsim.configure import load_config, save_config
from fedsim.errors import CheckpointError, ConfigError, FedsimError
from fedsim.persist.storage import Location, check_reachable, location, remove_tree

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
    if path.exists() and not path.is_dir():
        raise ConfigError(f"results.run_id: {path} exists and is not a folder")
    if path.exists() and next(iter(path.iterdir()), None) is not None:
        raise ConfigError(f"results.run_id: {path} exists and holds files that are not a run's; choose another "
                          "run_id or an empty folder")
    return path


class NewRunDir:
    """A run folder this process created, removable as a whole until the run's first round is written."""

    def __init__(self, path: Location, cfg: RunConfig) -> None:
        self.path = path
        self._existed = path.exists()
        self._created: list[Location] = []  # the parents this run creates, innermost first (results.root may be new)
        parent = path.parent
        while not parent.exists() and parent.parent != parent:
            self._created.append(parent)
            parent = parent.parent
        try:
            path.mkdir(parents=True, exist_ok=True)
            save_config(cfg, path / "config.yaml")
            save_config(cfg, path / STARTED_CONFIG)
        except OSError as exc:
            self.remove()
            raise ConfigError(f"results.root: cannot create the run folder {path} ({exc.strerror or exc})") from None

    def has_rounds(self) -> bool:
        return (self.path / "rounds.parquet").exists()

    def remove(self) -> None:
        """Delete what this run wrote; a folder that existed before (empty, or the user's) is kept itself."""
        if not self._existed:
            remove_tree(self.path)
            for folder in self._created:  # only while empty: another run may have started beside this one
                try:
                    folder.rmdir()
                except OSError:
                    break
            return
        for name in ("config.yaml", "meta.json", "checkpoints", "spill", "tensorboard", "tracking.json", "wandb"):
            target = self.path / name
            if target.is_dir():
                remove_tree(target)
            elif target.exists():
                target.unlink(missing_ok=True)


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


def _check_plugins(run_dir: Location, path: Location) -> None:
    """A resumed run imports its plugins: only the ones it started with, and none from inside its own folder (a
    run's files are data, never code)."""
    plugins = read_yaml(_named(path)).get("plugins") or []
    started_path = run_dir / STARTED_CONFIG
    if started_path.is_file():
        try:
            started = read_yaml(_named(started_path)).get("plugins") or []
        except FedsimError as exc:
            raise CheckpointError(f"{started_path}: unreadable ({exc})") from None
        if plugins != started:
            raise ConfigError(f"{path}: plugins ({started!r} -> {plugins!r}) changed since the run started "
                              f"({started_path}); start a new run instead")
    if isinstance(run_dir, Path) and isinstance(plugins, list):
        from fedsim.plugins import _locate

        folder = run_dir.resolve()
        for entry in plugins:  # found as the config's loader would find it: relative paths and names start here
            found = _locate(entry, folder).path if isinstance(entry, str) else None
            if found is not None and found.resolve().is_relative_to(folder):
                raise ConfigError(f"{path}: plugin {entry} lies inside the run folder ({found}); a run's files are "
                                  "data, not code: keep plugins beside your configs")


def _named(path: Location) -> str | Path:
    """A path as load_config takes it: a local one as it is, one in a store as its URI."""
    return path if isinstance(path, Path) else str(path)


def resume_config(run_dir: Location) -> RunConfig:
    """The config of the run in `run_dir`, refused if it was edited in a way the saved state cannot follow."""
    path = run_dir / "config.yaml"
    if not run_dir.is_dir():
        why = "a file, not a folder" if run_dir.exists() else "no such folder"
        raise CheckpointError(f"--resume {run_dir}: not a run folder ({why})")
    if not path.is_file():
        raise CheckpointError(f"--resume {run_dir}: not a run folder (no config.yaml)")
    _check_plugins(run_dir, path)  # before load_config imports them
    cfg = load_config(_named(path))
    started_path = run_dir / STARTED_CONFIG
    if started_path.exists() and not started_path.is_file():
        raise CheckpointError(f"{started_path}: not a file (the config the run started with belongs there)")
    if not started_path.is_file():
        if started_path.parent.is_dir():
            save_config(cfg, started_path)
        return cfg
    try:
        started = load_config(_named(started_path))
    except FedsimError as exc:
        raise CheckpointError(f"{started_path}: unreadable ({exc})") from None
    diff = unsafe_changes(started, cfg)
    if diff:
        shown = ", ".join(f"{k} ({a!r} -> {b!r})" for k, a, b in diff)
        raise ConfigError(f"{path}: {shown} changed since the run started ({started_path}); a resumed run keeps "
                          f"them (only {', '.join(RESUME_SAFE)} may change); start a new run instead")
    return cfg
