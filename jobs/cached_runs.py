"""Runs named by a hash of their resolved config, reused once finished: what sweeps, Tune trials and the
reproduce tables share."""

from __future__ import annotations

import hashlib
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from fedsim.persist.storage import Location

FINISHED = "finished.json"  # written into a run folder once its run returned: {wall_s, hardware, code}


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


def run_folder(cfg: Any) -> Path:
    """Where run_cached runs `cfg`: results.root/<name>-<algorithm>-s<seed>-<hash of the config>."""
    return Path(cfg.results.root) / f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{run_key(cfg)[:10]}"


def run_cached(cfg: Any, fresh: bool = False, callbacks: Sequence[Any] = (), resume: bool = False) -> Location:
    """Run `cfg` in run_folder(cfg), or return that folder if a run finished there.

    A folder without the finished marker is an interrupted run, and one finished by other code (fedsim's source
    changed since) is out of date: either is removed and run again, unless another process is writing it (then a
    ConfigError says so, and the folder is kept). With `resume` (a sweep's --resume), an
    interrupted run of this config continues from its checkpoint instead (fedsim's own resume, which loads
    weights only), and one stopped early is kept as it stopped. `callbacks` go to the run (not to a reused one).
    """
    from actors.backend import make_backend
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
            return _timed(cfg, code, lambda: run(resume=folder, backend=make_backend(cfg), callbacks=callbacks))
    if folder.exists():
        from fedsim.runtime.rundir import RunLock

        with RunLock(folder):  # refused while another process writes the run (a second sweep of the same runs)
            shutil.rmtree(folder)
    return _timed(cfg, code, lambda: run(cfg, backend=make_backend(cfg), callbacks=callbacks))


def _timed(cfg: Any, code: str, start: Callable[[], Location]) -> Location:
    """Run `start` and write the finished marker into the folder it returns."""
    from fedsim.persist.io import atomic_write_text

    t0 = time.perf_counter()
    run_dir = start()
    info = {"wall_s": round(time.perf_counter() - t0, 3), "hardware": hardware(cfg), "code": code}
    atomic_write_text(run_dir / FINISHED, json.dumps(info) + "\n")
    return run_dir


def interrupted(folder: Path, cfg: Any) -> str | None:
    """How the unfinished run in `folder` ended (meta.json's status, 'killed' without one) if it can continue: it
    has its tables and checkpoint, and both its saved configs are `cfg`'s experiment; else None. Reads YAML and
    JSON only."""
    from fedsim.config.schema import config_to_dict, read_yaml
    from fedsim.errors import FedsimError
    from fedsim.runtime.rundir import STARTED_CONFIG

    if not all((folder / name).is_file() for name in ("rounds.parquet", "run.json", "checkpoints/last.pt",
                                                      "checkpoints/manifest.json")):
        return None  # nothing to continue from, or a folder whose checkpoints cannot be verified: run again
    try:
        saved = [_experiment(read_yaml(folder / name)) for name in ("config.yaml", STARTED_CONFIG)]
        meta = json.loads((folder / "meta.json").read_text())
    except (FedsimError, OSError, ValueError, TypeError, AttributeError, RecursionError):
        return None
    if any(s != _experiment(config_to_dict(cfg)) for s in saved):
        return None
    status = meta.get("status") if isinstance(meta, dict) else None
    return status if isinstance(status, str) else "killed"


# where a run goes and how long it waits to start: they change no number, so a sweep run locally and resumed on a
# cluster (runtime.ray_address) reuses what finished
WHERE_KEYS = {"results": ("root", "run_id"), "data": ("root",),
              "runtime": ("ray_address", "spill_dir", "startup_timeout_s", "autoscale_timeout_s")}


def run_key(cfg: Any) -> str:
    """Hash of the resolved config, without where it runs and where its results go: equal keys mean the same
    experiment."""
    from fedsim.config.schema import config_to_dict

    return hashlib.sha1(_experiment(config_to_dict(cfg)).encode()).hexdigest()


def _experiment(config: dict) -> str:
    """A config's keys and values as canonical JSON, without WHERE_KEYS."""
    d = dict(config)
    for section, keys in WHERE_KEYS.items():
        d[section] = {k: v for k, v in d.get(section, {}).items() if k not in keys}
    return json.dumps(d, sort_keys=True, default=str)


def _finished_code(folder: Path) -> str | None:
    try:
        info = json.loads((folder / FINISHED).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return None
    return info.get("code") if isinstance(info, dict) else None


def finished_info(run_dir: str | Path) -> dict:
    """The finished marker of a run folder written by run_cached."""
    return json.loads((Path(run_dir) / FINISHED).read_text())
