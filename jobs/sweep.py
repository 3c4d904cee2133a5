"""Run arms × grid × seeds of a base config in one job and write a paper-style markdown table.

    python -m jobs.sweep configs/x/sweep.yaml [--out table.md] [--dry-run] [--fresh]

The table is built from the runs' result DataFrames: best and final accuracy (mean ± std over seeds,
population std), rounds to reach the target accuracy, and accuracy at fixed round budgets (empty past
the rounds a run made). Runs are named by a hash of their resolved config, so a rerun reuses the runs
that finished and redoes only the rest (--fresh redoes all).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import itertools
import json
import os
import platform
import shutil
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsim.configtools import from_dict, knob
from fedsim.errors import ConfigError, FedsimError
from fedsim.storage import Location


@dataclass
class Arm:
    name: str = knob("", doc="row label")
    overrides: list[str] = knob([], doc="key=value overrides for this arm")
    config: str | None = knob(None, doc="another base config for this arm")


@dataclass
class Sweep:
    title: str = knob("sweep", doc="table title, also the output file name")
    base: str = knob("", doc="base run config (path relative to the repository root or to this file)")
    seeds: list[int] = knob([0, 1], doc="run seeds")
    overrides: list[str] = knob([], doc="overrides applied to every arm")
    grid: dict[str, list[Any]] = knob({}, doc="cartesian product of key: [values], one table block each")
    arms: list[Arm] = knob(factory=list)
    target: float | None = knob(None, doc="accuracy threshold for rounds-to-target")
    budgets: list[int] = knob([], doc="report accuracy after these many rounds")
    metric: str = knob("accuracy", doc="column of rounds.parquet to score")
    model: str = knob("best", doc="global-model row to use: best (highest final), macro (mean), or a model name")
    out: str | None = knob(None, doc="markdown output path (default results/sweeps/<title>.md)")


def load_sweep(path: str | Path) -> Sweep:
    from fedsim.config import read_yaml

    sw = from_dict(Sweep, read_yaml(path))
    if not sw.arms:
        raise ConfigError(f"{path}: arms: list at least one arm")
    if not sw.base and any(a.config is None for a in sw.arms):
        raise ConfigError(f"{path}: base: required unless every arm names its own config")
    return sw


def _resolve(path: str, sweep_file: Path) -> Path:
    p = Path(path)
    return p if p.exists() or p.is_absolute() else sweep_file.parent / p


def plan(sw: Sweep, sweep_file: Path) -> list[dict]:
    """Every run of the sweep: arm, grid point, seed, config path and overrides."""
    keys = list(sw.grid)
    points = list(itertools.product(*(sw.grid[k] for k in keys))) or [()]
    runs = []
    for point in points:
        grid_over = [f"{k}={v}" for k, v in zip(keys, point)]
        for arm in sw.arms:
            for seed in sw.seeds:
                runs.append({"arm": arm.name, "grid": dict(zip(keys, point)), "seed": seed,
                             "config": str(_resolve(arm.config or sw.base, sweep_file)),
                             "overrides": [*sw.overrides, *grid_over, *arm.overrides, f"seed={seed}"]})
    return runs


def curve(rounds: pd.DataFrame, metric: str, model: str) -> pd.Series:
    """Score per round (1-based index) for the chosen global-model row."""
    if metric not in rounds:
        raise ConfigError(f"metric: {metric!r} is not a column of rounds.parquet; available: "
                          f"{sorted(c for c in rounds.columns if rounds[c].dtype.kind == 'f')}")
    ev = rounds.dropna(subset=[metric])
    if "model" in ev and ev["model"].nunique() > 1:
        if model == "macro":
            ev = ev.groupby("round", as_index=False)[metric].mean()
        elif model == "best":
            last = ev[ev["round"] == ev["round"].max()]
            ev = ev[ev["model"] == last.loc[last[metric].idxmax(), "model"]]
        else:
            ev = ev[ev["model"] == model]
    return pd.Series(ev[metric].to_numpy(), index=ev["round"].to_numpy() + 1)


def score(c: pd.Series, target: float | None, budgets: list[int]) -> dict[str, float]:
    """best, final, rounds-to-target and accuracy-at-budget of one run; a budget past its last round is NaN."""
    out = {"best": float(c.max()), "final": float(c.iloc[-1])}
    if target is not None:
        hit = c[c >= target]
        out["rounds_to_target"] = float(hit.index[0]) if len(hit) else np.nan
    last = c.index.max() if len(c) else 0
    for b in budgets:
        upto = c[c.index <= b]
        out[f"at_{b}"] = float(upto.iloc[-1]) if len(upto) and b <= last else np.nan
    return out


def _pm(values: pd.Series, pct: bool = True) -> str:
    """mean ± std of the values that exist; an empty cell when none does."""
    v = values.dropna().to_numpy() * (100 if pct else 1)
    if len(v) == 0:
        return ""
    return f"{v.mean():.2f} ± {v.std():.2f}" if pct else f"{v.mean():.1f} ± {v.std():.1f}"


def summary(df: pd.DataFrame, sw: Sweep) -> tuple[list[str], list[tuple[tuple, list[str]]]]:
    """Table head and rows, one per grid point and arm: ((grid values..., arm), cells), mean ± std over seeds."""
    grid_cols = list(sw.grid)
    head = [*grid_cols, "method", "best acc (%)", "final acc (%)"]
    if sw.target is not None:
        head.append(f"rounds to {sw.target * 100:g}%")
    head += [f"acc @ {b} rounds (%)" for b in sw.budgets]
    rows = []
    for keys, g in df.groupby([*grid_cols, "arm"] if grid_cols else ["arm"], sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = [str(k) for k in keys] + [_pm(g["best"]), _pm(g["final"])]
        if sw.target is not None:
            reached = g["rounds_to_target"].notna().sum()
            cell = _pm(g["rounds_to_target"], pct=False) if reached else "not reached"
            cells.append(cell + (f" ({reached}/{len(g)} seeds)" if 0 < reached < len(g) else ""))
        cells += [_pm(g[f"at_{b}"]) for b in sw.budgets]
        rows.append((keys, cells))
    return head, rows


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table(df: pd.DataFrame, sw: Sweep) -> str:
    """Markdown: one row per grid point and arm, mean ± std over seeds (accuracies in %)."""
    head, rows = summary(df, sw)
    return markdown(head, [cells for _, cells in rows])


def run_key(cfg: Any) -> str:
    """Hash of the resolved config, without where its results go: equal keys mean the same experiment."""
    from fedsim.config import config_to_dict

    d = config_to_dict(cfg)
    d["results"] = {k: v for k, v in d["results"].items() if k not in ("root", "run_id")}
    d["data"] = {k: v for k, v in d["data"].items() if k != "root"}
    return hashlib.sha1(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()


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
    """CPU count, torch threads and platform of the process running `cfg`."""
    import torch

    return (f"{os.cpu_count()} CPUs, torch threads {cfg.runtime.threads or torch.get_num_threads()}, "
            f"{platform.platform()}")


def run_cached(cfg: Any, fresh: bool = False) -> Location:
    """Run `cfg` in results.root/<name>-<algorithm>-s<seed>-<hash>/, or return that folder if a run finished there.

    A folder without the finished marker is an interrupted run, and one finished by other code (fedsim's source
    changed since) is out of date: either is removed and run again."""
    from fedsim.io import atomic_write_text
    from fedsim.runtime.loop import run
    from jobs.cli import make_backend

    cfg.results.run_id = f"{cfg.name}-{cfg.algorithm.name}-s{cfg.seed}-{run_key(cfg)[:10]}"
    folder = Path(cfg.results.root) / cfg.results.run_id
    code = code_version()
    if (folder / FINISHED).is_file() and (folder / "rounds.parquet").is_file() and not fresh:
        if _finished_code(folder) == code:
            print(f"  reusing {folder}", file=sys.stderr, flush=True)
            return folder
        print(f"  {folder} was made by other fedsim code: running it again", file=sys.stderr, flush=True)
    if folder.exists():
        shutil.rmtree(folder)
    if cfg.runtime.threads and cfg.runtime.backend == "local":
        import torch

        torch.set_num_threads(cfg.runtime.threads)  # the local backend runs clients in this process
    t0 = time.perf_counter()
    run_dir = run(cfg, backend=make_backend(cfg))
    info = {"wall_s": round(time.perf_counter() - t0, 3), "hardware": hardware(cfg), "code": code}
    atomic_write_text(run_dir / FINISHED, json.dumps(info) + "\n")
    return run_dir


def _run_one(job: tuple[Any, bool, str]) -> str:
    cfg, fresh, label = job
    print(label, file=sys.stderr, flush=True)
    return str(run_cached(cfg, fresh))


def run_all(configs: list, labels: list[str], fresh: bool = False, jobs: int = 1) -> list[Path]:
    """run_cached for every config, `jobs` at a time in separate processes (each run is deterministic on its
    own, so the numbers do not depend on `jobs`); Ray-backed configs run one by one in this process."""
    todo = [(cfg, fresh, label) for cfg, label in zip(configs, labels)]
    if jobs <= 1 or len(todo) <= 1 or any(c.runtime.backend == "ray" for c in configs):
        with ray_session(configs):
            return [Path(_run_one(job)) for job in todo]
    import multiprocessing

    pool = multiprocessing.get_context("spawn").Pool(min(jobs, len(todo)), maxtasksperchild=1)
    try:
        done = pool.map(_run_one, todo, chunksize=1)
        pool.close()
    except BaseException:
        pool.terminate()  # Ctrl-C, SIGTERM or a failed run: stop the others too; their folders are redone next time
        raise
    finally:
        pool.join()
    return [Path(d) for d in done]


def _finished_code(folder: Path) -> str | None:
    try:
        info = json.loads((folder / FINISHED).read_text())
    except (OSError, ValueError):
        return None
    return info.get("code") if isinstance(info, dict) else None


def finished_info(run_dir: str | Path) -> dict:
    """The finished marker of a run folder written by run_cached."""
    return json.loads((Path(run_dir) / FINISHED).read_text())


@contextlib.contextmanager
def ray_session(configs: list) -> Iterator[None]:
    """One Ray instance for every Ray-backed config of a job (none if all run locally)."""
    started = False
    if any(c.runtime.backend == "ray" for c in configs):
        import ray

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if not ray.is_initialized():
            ray.init(address=configs[0].runtime.ray_address, include_dashboard=False, configure_logging=False)
            started = True
    try:
        yield
    finally:
        if started:
            import ray

            ray.shutdown()


def execute(runs: list[dict], configs: list, sw: Sweep, fresh: bool = False, jobs: int = 1) -> pd.DataFrame:
    """Run (or reuse) every planned run; one row per run with its grid point, arm, seed, folder and scores."""
    from fedsim.results import load

    labels = [f"[{i + 1}/{len(runs)}] {r['arm']} {r['grid']} seed={r['seed']}" for i, r in enumerate(runs)]
    rows = []
    for r, run_dir in zip(runs, run_all(configs, labels, fresh, jobs)):
        c = curve(load(run_dir)["rounds"], sw.metric, sw.model)
        rows.append({**r["grid"], "arm": r["arm"], "seed": r["seed"], "run": str(run_dir),
                     "rounds_run": int(c.index.max()), **score(c, sw.target, sw.budgets)})
    return pd.DataFrame(rows)


def run_sweep(sweep_file: str | Path, out: str | None = None, dry_run: bool = False, fresh: bool = False) -> str:
    from fedsim.config import load_config

    sweep_file = Path(sweep_file)
    sw = load_sweep(sweep_file)
    runs = plan(sw, sweep_file)
    configs = [load_config(r["config"], r["overrides"]) for r in runs]  # validate everything before running
    if dry_run:
        return "\n".join(f"{r['arm']} {r['grid']} seed={r['seed']}: {r['config']} {r['overrides']}" for r in runs)
    df = execute(runs, configs, sw, fresh)
    md = f"### {sw.title}\n\n{table(df, sw)}\n\nCommand: `python -m jobs.sweep {sweep_file}`; " \
         f"seeds {sw.seeds}; mean ± std (population) over seeds.\n"
    dest = Path(out or sw.out or Path("results") / "sweeps" / f"{_slug(sw.title)}.md")
    from fedsim.io import atomic_write, atomic_write_text

    atomic_write_text(dest, md)
    atomic_write(dest.with_suffix(".csv"), lambda tmp: df.to_csv(tmp, index=False))
    return md


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")[:60] or "sweep"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="fedsim sweep", description=__doc__.splitlines()[0])
    p.add_argument("sweep")
    p.add_argument("--out")
    p.add_argument("--dry-run", action="store_true")
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    args = p.parse_args(argv)
    try:
        print(run_sweep(args.sweep, args.out, args.dry_run, args.fresh))
    except FedsimError as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
