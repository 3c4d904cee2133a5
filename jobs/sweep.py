"""Run arms × grid × seeds of a base config in one job and write a paper-style markdown table.

    python -m jobs.sweep configs/x/sweep.yaml [--out table.md] [--dry-run]

The table is built from the runs' result DataFrames: best and final accuracy (mean ± std over seeds,
population std), rounds to reach the target accuracy, and accuracy at fixed round budgets.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsim.configtools import from_dict, knob
from fedsim.errors import ConfigError, FedsimError


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
    """best, final, rounds-to-target and accuracy-at-budget of one run."""
    out = {"best": float(c.max()), "final": float(c.iloc[-1])}
    if target is not None:
        hit = c[c >= target]
        out["rounds_to_target"] = float(hit.index[0]) if len(hit) else np.nan
    for b in budgets:
        upto = c[c.index <= b]
        out[f"at_{b}"] = float(upto.iloc[-1]) if len(upto) else np.nan
    return out


def _pm(values: pd.Series, pct: bool = True) -> str:
    v = values.dropna().to_numpy() * (100 if pct else 1)
    if len(v) == 0:
        return "—"
    return f"{v.mean():.2f} ± {v.std():.2f}" if pct else f"{v.mean():.1f} ± {v.std():.1f}"


def table(df: pd.DataFrame, sw: Sweep) -> str:
    """Markdown: one row per grid point and arm, mean ± std over seeds (accuracies in %)."""
    grid_cols = list(sw.grid)
    head = [*grid_cols, "method", "best acc (%)", "final acc (%)"]
    if sw.target is not None:
        head.append(f"rounds to {sw.target * 100:g}%")
    head += [f"acc @ {b} rounds (%)" for b in sw.budgets]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for keys, g in df.groupby([*grid_cols, "arm"] if grid_cols else ["arm"], sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = [str(k) for k in keys] + [_pm(g["best"]), _pm(g["final"])]
        if sw.target is not None:
            reached = g["rounds_to_target"].notna().sum()
            cell = _pm(g["rounds_to_target"], pct=False) if reached else "not reached"
            cells.append(cell + (f" ({reached}/{len(g)} seeds)" if 0 < reached < len(g) else ""))
        cells += [_pm(g[f"at_{b}"]) for b in sw.budgets]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def run_sweep(sweep_file: str | Path, out: str | None = None, dry_run: bool = False) -> str:
    from fedsim.config import load_config
    from fedsim.results import load
    from fedsim.runtime.loop import run
    from jobs.cli import make_backend

    sweep_file = Path(sweep_file)
    sw = load_sweep(sweep_file)
    runs = plan(sw, sweep_file)
    configs = [load_config(r["config"], r["overrides"]) for r in runs]  # validate everything before running
    if dry_run:
        return "\n".join(f"{r['arm']} {r['grid']} seed={r['seed']}: {r['config']} {r['overrides']}" for r in runs)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    started = False
    if any(c.runtime.backend == "ray" for c in configs):
        import ray

        if not ray.is_initialized():
            ray.init(address=configs[0].runtime.ray_address, include_dashboard=False, configure_logging=False)
            started = True
    rows = []
    try:
        for i, (r, cfg) in enumerate(zip(runs, configs)):
            print(f"[{i + 1}/{len(runs)}] {r['arm']} {r['grid']} seed={r['seed']}", file=sys.stderr, flush=True)
            run_dir = run(cfg, backend=make_backend(cfg))
            c = curve(load(run_dir)["rounds"], sw.metric, sw.model)
            rows.append({**r["grid"], "arm": r["arm"], "seed": r["seed"], "run": str(run_dir),
                         **score(c, sw.target, sw.budgets)})
    finally:
        if started:
            import ray

            ray.shutdown()
    df = pd.DataFrame(rows)
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
    args = p.parse_args(argv)
    try:
        print(run_sweep(args.sweep, args.out, args.dry_run))
    except FedsimError as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
