"""Runs named by a hash of their resolved config, reused once finished: what sweeps, Tune trials and the
reproduce tables share."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedsim.persist.storage import Location, location, remove_tree

FINISHED = "finished.json"  # written into a run folder once its run returned: {wall_s, hardware, code}
KILLED = "killed"  # meta.json's status of a run whose process ended without recording one


def code_version() -> str:
    """Hash of the fedsim package's source: a finished run is reused only by the code that made it."""
    import fedsim

    root = Path(fedsim.__file__).parent
    h = hashlib.sha1()
    for f in sorted(root.rglob("*.py")):
        h.update(str(f.relative_to(root)).encode() + b"\0" + f.read_bytes() + b"\0")
    return h.hexdigest()[:16]


def hardware(cfg: Any) -> str:
    """CPU count, the torch threads `cfg`'s clients train with (on either backend) and the platform."""
    from fedsim.threads import client_threads

    return f"{os.cpu_count()} CPUs, torch threads {client_threads(cfg)}, {platform.platform()}"


def run_folder(cfg: Any) -> Location:
    """Where run_cached runs `cfg`: results.root/<name>-<algorithm>-s<seed>-<hash of the config> (a local folder or
    one in a store)."""
    root = location(cfg.results.root, "results.root")
    return root / f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{run_key(cfg)[:10]}"


def run_cached(cfg: Any, fresh: bool = False, callbacks: Sequence[Any] = (), resume: bool = False) -> Location:
    """Run `cfg` in run_folder(cfg), or return that folder if a run finished there.

    A folder without the finished marker is an interrupted run, and one finished by other code (fedsim's source
    changed since) is out of date: either is removed and run again, unless another process is writing it (then a
    ConfigError says so, and the folder is kept). With `resume` (a sweep's --resume), an
    interrupted run of this config continues from its checkpoint instead (fedsim's own resume, which loads
    weights only, with the plugins `cfg` names: the same SHA-256s wherever their files now lie), and one stopped
    early is kept as it stopped. `callbacks` go to the run (not to a reused one).
    """
    from actors.backend import make_backend
    from fedsim.plugins import PluginSources, shipped_paths
    from fedsim.runtime.loop import run

    folder = run_folder(cfg)
    cfg.results.run_id = folder.name
    code = code_version()
    if (folder / FINISHED).is_file() and (folder / "rounds.parquet").is_file() and not fresh:
        if _finished_code(folder) == code:
            print(f"  reusing {folder}", file=sys.stderr, flush=True)
            return folder
        print(f"  {folder} was made by other fedsim code: running it again", file=sys.stderr, flush=True)
    elif resume and not fresh:
        ended = interrupted(folder, cfg)
        if ended == "stopped":  # stopped early (ASHA): an uninterrupted sweep leaves it so too
            print(f"  keeping {folder} (stopped early)", file=sys.stderr, flush=True)
            return folder
        if ended is not None:
            print(f"  resuming {folder} ({ended})", file=sys.stderr, flush=True)
            mine = PluginSources(tuple(Path(p) for p in shipped_paths(cfg.plugins) if Path(p).exists()))
            return _timed(cfg, code, lambda: run(resume=folder, backend=make_backend(cfg), callbacks=callbacks,
                                                 plugin_sources=mine))
    if folder.exists():
        from fedsim.runtime.rundir import RunLock

        with RunLock(folder):  # refused while another process writes the run (a second sweep of the same runs)
            remove_tree(folder)
    return _timed(cfg, code, lambda: run(cfg, backend=make_backend(cfg), callbacks=callbacks))


def _timed(cfg: Any, code: str, start: Callable[[], Location]) -> Location:
    """Run `start` and write the finished marker into the folder it returns."""
    from fedsim.persist.io import atomic_write_text

    t0 = time.perf_counter()
    run_dir = start()
    info = {"wall_s": round(time.perf_counter() - t0, 3), "hardware": hardware(cfg), "code": code}
    atomic_write_text(run_dir / FINISHED, json.dumps(info) + "\n")
    return run_dir


def interrupted(folder: Location, cfg: Any) -> str | None:
    """How the unfinished run in `folder` ended (meta.json's status, 'killed' without one) if it can continue: it
    has its tables and checkpoint, and both its saved configs are `cfg`'s experiment (its plugins compared by the
    SHA-256s its manifest recorded, not by path); else None. Reads YAML and JSON only."""
    from fedsim.config.schema import config_to_dict, read_yaml
    from fedsim.errors import FedsimError
    from fedsim.persist.checkpoint import read_manifest
    from fedsim.runtime.rundir import STARTED_CONFIG

    if not all((folder / name).is_file() for name in ("rounds.parquet", "run.json", "checkpoints/last.pt",
                                                      "checkpoints/manifest.json")):
        return None  # nothing to continue from, or a folder whose checkpoints cannot be verified: run again
    try:
        recorded = read_manifest(folder / "checkpoints")["plugins"]
        saved = [_experiment(read_yaml(folder / name), recorded) for name in ("config.yaml", STARTED_CONFIG)]
        meta = json.loads((folder / "meta.json").read_text())
    except (FedsimError, OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None
    if any(s != _experiment(config_to_dict(cfg)) for s in saved):
        return None
    status = meta.get("status") if isinstance(meta, dict) else None
    return status if isinstance(status, str) else KILLED


def unfinished_status(folder: Location) -> str | None:
    """meta.json's status of the unfinished run in `folder` (None for a finished run, or none there), after recording
    'killed' in it for a run whose process ended without recording how, unless a process still writes the run. For
    a sweep that has no trial running any more."""
    from fedsim.errors import ConfigError
    from fedsim.persist.io import atomic_write_text
    from fedsim.runtime.rundir import RunLock

    path = folder / "meta.json"
    try:
        if (folder / FINISHED).is_file() or not path.is_file():
            return None
        meta = json.loads(path.read_text())
        if not isinstance(meta, dict):
            return None
        if "status" not in meta:
            with RunLock(folder):
                atomic_write_text(path, json.dumps({**meta, "status": KILLED}, indent=2))
            return KILLED
    except (ConfigError, OSError, ValueError, RecursionError):  # in use, or unreadable: left as it is
        return None
    return meta["status"] if isinstance(meta["status"], str) else None


# where a run goes and how long it waits to start: they change no number, so a sweep run locally and resumed on a
# cluster (runtime.ray_address) reuses what finished
WHERE_KEYS = {"results": ("root", "run_id"), "data": ("root",),
              "runtime": ("ray_address", "spill_dir", "startup_timeout_s", "autoscale_timeout_s")}


def run_key(cfg: Any) -> str:
    """Hash of the resolved config, without where it runs and where its results go, its plugins by module name and
    SHA-256 rather than path: equal keys mean the same experiment, wherever its files lie."""
    from fedsim.config.schema import config_to_dict

    return hashlib.sha1(_experiment(config_to_dict(cfg)).encode()).hexdigest()


def _experiment(config: dict, recorded: dict | None = None) -> str:
    """A config's keys and values as canonical JSON, without WHERE_KEYS, its plugins as fedsim.plugins.identities
    (by what a run's manifest `recorded` of them, if given)."""
    from fedsim.plugins import identities, own_identities

    d = dict(config)
    for section, keys in WHERE_KEYS.items():
        d[section] = {k: v for k, v in d.get(section, {}).items() if k not in keys}
    # a run folder's plugins by its manifest alone (its files are data); the user's own config's by their files
    d["plugins"] = own_identities(d.get("plugins")) if recorded is None else identities(d.get("plugins"), recorded)
    return json.dumps(d, sort_keys=True, default=str)


def _finished_code(folder: Location) -> str | None:
    try:
        info = json.loads((folder / FINISHED).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return None
    return info.get("code") if isinstance(info, dict) else None


def finished_info(run_dir: str | Location) -> dict:
    """The finished marker of a run folder written by run_cached."""
    return json.loads((location(run_dir) / FINISHED).read_text())
