"""Run arms × grid × sampled settings × seeds of a base config as Ray Tune trials and write one table.

    fedsim sweep configs/x/sweep.yaml [-o KEY=VALUE] [--backend ray|local] [--output-dir DIR] [--resume]
                 [--parallel N] [--out table.md] [--dry-run] [--fresh]

Each run is one trial with the share of the cluster its config asks for (jobs.sweep_tune); trials run side
by side as the cluster fits them, a failed one is recorded without stopping the others, and `--resume`
continues a sweep whose driver died. The table is built from the runs' result DataFrames: best and final
accuracy (mean ± std over seeds, population std), rounds to reach the target accuracy, and accuracy at fixed
round budgets (empty past the rounds a run made). It is printed, and written to DIR (default
results/sweeps/<title>/; a folder or a URI such as s3://bucket/sweep) as table.md and table.parquet, with one
row per run in runs.parquet. Runs are named by a hash of their resolved config, so a rerun reuses the runs that
finished and redoes only the rest (--fresh redoes all).
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import math
import os
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pandas as pd

from fedsim.config.knobs import from_dict, knob, shown
from fedsim.config.limits import MAX_ROUNDS, MAX_SEED, MAX_SWEEP_RUNS
from fedsim.errors import ConfigError
from fedsim.persist.storage import Location, location
from jobs.cached_runs import FINISHED, KILLED, run_cached, run_folder, run_key, unfinished_status


@dataclass
class Arm:
    name: str = knob("", doc="row label")
    overrides: list[str] = knob([], doc="key=value overrides for this arm")
    config: str | None = knob(None, doc="another base config for this arm")


@dataclass
class EarlyStop:
    metric: str = knob("accuracy", doc="column of rounds.parquet that ASHA compares trials on")
    mode: Literal["max", "min"] = knob("max", doc="whether higher (max) or lower (min) values are better")
    grace_rounds: int = knob(1, ge=1, doc="rounds every trial runs before it can be stopped")
    reduction_factor: float = knob(2.0, gt=1, doc="ASHA keeps about 1/reduction_factor of the trials at each rung")


@dataclass
class Sweep:
    title: str = knob("sweep", doc="table title, also the output file name")
    base: str = knob("", doc="base run config (path relative to the repository root or to this file)")
    seeds: list[int] = knob([0, 1], ge=0, le=MAX_SEED, doc="run seeds")
    overrides: list[str] = knob([], doc="overrides applied to every arm")
    grid: dict[str, list[Any]] = knob({}, doc="cartesian product of key: [values], one table block each")
    space: dict[str, Any] = knob({}, doc="key: {choice|uniform|loguniform|randint: ...}, drawn `samples` times "
                                         "(jobs.sweep_space)")
    samples: int = knob(1, ge=1, le=10_000, doc="settings drawn from `space`, each run with every seed")
    space_seed: int = knob(0, ge=0, doc="seed of the draws from `space`")
    arms: list[Arm] = knob(factory=list, doc="rows of the table; none: one row, the base config as it is")
    target: float | None = knob(None, doc="accuracy threshold for rounds-to-target")
    target_by: list[Literal["rounds", "virtual_time", "updates"]] = knob(
        ["rounds"], doc="what reaching the target is counted in, a column each: rounds, virtual_time (the virtual "
        "clock's seconds) or updates (client updates that arrived, summed over the rounds): runs whose rounds differ "
        "(synchronous rounds, asynchronous versions) compare by the last two")
    budgets: list[int] = knob([], ge=1, le=MAX_ROUNDS, doc="report accuracy after these many rounds")
    metric: str = knob("accuracy", doc="column of rounds.parquet to score")
    model: str = knob("best", doc="global-model row to use: best (highest final), macro (mean), or a model name")
    out: str | None = knob(None, doc="markdown output path (default OUTPUT_DIR/table.md)")
    early_stop: EarlyStop | None = knob(None, doc="stop weak trials early with ASHA (default: every run runs all "
                                                  "its rounds)")
    max_parallel: int | None = knob(None, ge=1, doc="at most this many trials at once (default: as many as fit)")


def load_sweep(path: str | Path) -> Sweep:
    from fedsim.config.schema import read_yaml

    sw = from_dict(Sweep, read_yaml(path))
    if not sw.base and (not sw.arms or any(a.config is None for a in sw.arms)):
        raise ConfigError(f"{path}: base: required unless every arm names its own config")
    if not sw.arms:
        sw.arms = [Arm(name=Path(sw.base).stem)]
    if sw.samples > 1 and not sw.space:
        raise ConfigError(f"{path}: samples: {sw.samples} draws need a space: to draw from")
    if set(sw.space) & set(sw.grid):
        raise ConfigError(f"{path}: space: {sorted(set(sw.space) & set(sw.grid))} also in grid: a key is one or the "
                          "other")
    if not sw.seeds:
        raise ConfigError(f"{path}: seeds: expected at least one seed, got []")
    for what, values in (("seeds", sw.seeds), ("arms", [a.name for a in sw.arms])):
        twice = _first_repeat(values)  # a seed twice: two trials in one run folder; an arm twice: one pooled row
        if twice is not None:
            raise ConfigError(f"{path}: {what}: {twice!r} is listed twice")
    empty = [k for k, values in sw.grid.items() if not values]
    if empty:
        raise ConfigError(f"{path}: grid.{empty[0]}: expected a non-empty list of values, got []")
    for key, values in sw.grid.items():  # one value twice: two trials writing one run folder
        try:
            spelled = [json.dumps(v, sort_keys=True) for v in values]
        except (TypeError, ValueError):  # a tagged value (!!timestamp, !!binary, !!set): no config takes one
            raise ConfigError(f"{path}: grid.{key}: expected plain values (text, numbers, true/false, null, lists, "
                              f"mappings), got {shown(values)}") from None
        twice = _first_repeat(spelled)
        if twice is not None:
            raise ConfigError(f"{path}: grid.{key}: {twice} is listed twice")
    sizes = {"grid." + k: len(v) for k, v in sw.grid.items()} | {"samples": sw.samples, "arms": len(sw.arms),
                                                                  "seeds": len(sw.seeds)}
    if math.prod(sizes.values()) > MAX_SWEEP_RUNS:  # counted before any run is planned: a product grows fast
        product = " x ".join(f"{n} {k}" for k, n in sizes.items() if n > 1)
        raise ConfigError(f"{path}: {product} is {math.prod(sizes.values()):,} runs, more than a sweep may plan "
                          f"({MAX_SWEEP_RUNS:,}); split it into several sweeps")
    elsewhere = _seed_set_elsewhere(sw)
    if elsewhere:
        raise ConfigError(f"{path}: {elsewhere}: a sweep sets each run's seed from seeds: (every setting runs with "
                          "every seed); list the seeds there instead")
    return sw


def _first_repeat(values: list[Any]) -> Any:
    """The first value of `values` seen before, or None."""
    seen: set[Any] = set()
    for v in values:
        if v in seen:
            return v
        seen.add(v)
    return None


def _seed_set_elsewhere(sw: Sweep) -> str | None:
    """Where the sweep file sets `seed` other than in `seeds` (each run's seed from `seeds` would override it)."""
    for section, keys in (("grid", sw.grid), ("space", sw.space)):
        if "seed" in keys:
            return f"{section}.seed"
    for where, overs in [("overrides", sw.overrides), *((f"arms.{a.name}.overrides", a.overrides) for a in sw.arms)]:
        for o in overs:
            if _key(o) == "seed":
                return f"{where}: {o}"
    return None


def _key(override: str) -> str:
    return override.split("=", 1)[0].strip()


def _resolve(path: str, sweep_file: Path) -> Path:
    p = Path(path)
    return p if p.exists() or p.is_absolute() else sweep_file.parent / p


def plan(sw: Sweep, sweep_file: Path) -> list[dict]:
    """Every run of the sweep: arm, grid point, drawn setting (`space`, with its `sample` number), seed, config
    path and overrides."""
    from jobs.sweep_space import draw, override

    keys = list(sw.grid)
    points = list(itertools.product(*(sw.grid[k] for k in keys))) or [()]
    draws = draw(sw.space, sw.samples, sw.space_seed)
    runs = []
    for point in points:
        grid_over = [override(k, v) for k, v in zip(keys, point)]  # JSON: "1e-3" stays text, null stays null
        for sample, setting in enumerate(draws):
            space_over = [override(k, v) for k, v in setting.items()]
            for arm in sw.arms:
                for seed in sw.seeds:
                    run = {"arm": arm.name, "grid": dict(zip(keys, point)), "seed": seed,
                           "config": str(_resolve(arm.config or sw.base, sweep_file)),
                           "overrides": [*sw.overrides, *grid_over, *space_over, *arm.overrides, f"seed={seed}"]}
                    if sw.space:
                        run["space"] = {"sample": sample, **setting}
                    runs.append(run)
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


TO_TARGET = {"rounds": "rounds_to_target", "virtual_time": "time_to_target", "updates": "updates_to_target"}
"""The score of each `target_by` count."""


def progress(rounds: pd.DataFrame) -> pd.DataFrame:
    """Per round (1-based index, as `curve`'s): the virtual time at its end and the client updates that arrived up to
    it (rounds.parquet's `arrived`, summed; an async run's versions count theirs)."""
    per = rounds.groupby("round", sort=True).first()
    arrived = per["arrived"] if "arrived" in per else pd.Series(0, index=per.index)
    time = per["virtual_time"] if "virtual_time" in per else pd.Series(np.nan, index=per.index)
    return pd.DataFrame({"virtual_time": time.to_numpy(), "updates": arrived.cumsum().to_numpy()},
                        index=per.index.to_numpy() + 1)


def score(c: pd.Series, target: float | None, budgets: list[int], made: pd.DataFrame | None = None,
          by: Sequence[str] = ("rounds",)) -> dict[str, float]:
    """best, final, what reaching the target took (rounds; with `made`, `progress` of the run, also virtual time and
    client updates) and accuracy-at-budget of one run; a budget past its last round is NaN."""
    out = {"best": float(c.max()), "final": float(c.iloc[-1])}
    if target is not None:
        hit = c[c >= target]
        first = hit.index[0] if len(hit) else None
        for count in by:
            if first is None:
                out[TO_TARGET[count]] = np.nan
            elif count == "rounds":
                out[TO_TARGET[count]] = float(first)
            elif made is not None:
                out[TO_TARGET[count]] = float(made.loc[first, count])
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


def setting_columns(sw: Sweep) -> list[str]:
    """The columns that name a setting besides its arm: grid keys, then the draw's number and keys."""
    return [*sw.grid, *(["sample", *sw.space] if sw.space else [])]


def _key_cell(value: Any, drawn: bool) -> str:
    return f"{value:.4g}" if drawn and isinstance(value, float) else str(value)


def _runs_cell(status: pd.Series) -> str:
    """'2/3 finished, 1 failed': how a setting's runs ended, when not all of them finished."""
    counts = status.value_counts()
    rest = ", ".join(f"{n} {s}" for s, n in counts.items() if s != "finished")
    return f"{counts.get('finished', 0)}/{len(status)} finished" + (f", {rest}" if rest else "")


def summary(df: pd.DataFrame, sw: Sweep) -> tuple[list[str], list[tuple[tuple, list[str]]]]:
    """Table head and rows, one per setting and arm: ((setting values..., arm), cells), mean ± std over seeds; a
    last column says how the runs ended when some did not finish (failed, stopped early, not run)."""
    grid_cols = setting_columns(sw)
    drawn = {"sample", *sw.space}
    head = [*grid_cols, "method", "best acc (%)", "final acc (%)"]
    if sw.target is not None:
        names = {"rounds": "rounds", "virtual_time": "virtual s", "updates": "client updates"}
        head += [f"{names[count]} to {sw.target * 100:g}%" for count in sw.target_by]
    head += [f"acc @ {b} rounds (%)" for b in sw.budgets]
    unfinished = "status" in df and bool((df["status"] != "finished").any())
    if unfinished:
        head.append("runs")
    rows = []
    for keys, g in df.groupby([*grid_cols, "arm"] if grid_cols else ["arm"], sort=False):
        keys = keys if isinstance(keys, tuple) else (keys,)
        cells = [_key_cell(k, c in drawn) for c, k in zip([*grid_cols, "arm"], keys)]
        cells += [_pm(g["best"]), _pm(g["final"])]
        for count in sw.target_by if sw.target is not None else []:
            took = g[TO_TARGET[count]]
            reached = took.notna().sum()
            cell = _pm(took, pct=False) if reached else "not reached"
            cells.append(cell + (f" ({reached}/{len(g)} seeds)" if 0 < reached < len(g) else ""))
        cells += [_pm(g[f"at_{b}"]) for b in sw.budgets]
        if unfinished:
            cells.append(_runs_cell(g["status"]))
        rows.append((keys, cells))
    return head, rows


def summary_frame(df: pd.DataFrame, sw: Sweep) -> pd.DataFrame:
    """The table as numbers: per setting and arm, mean and (population) std over seeds of every score, the
    seeds that gave one, and how many runs finished; a budget past every run's rounds is empty (NaN)."""
    keys = [*setting_columns(sw), "arm"]
    scores = [c for c in ["best", "final", *TO_TARGET.values(), *(f"at_{b}" for b in sw.budgets)] if c in df]
    rows = []
    for values, g in df.groupby(keys, sort=False, dropna=False):
        row: dict[str, Any] = dict(zip(keys, values if isinstance(values, tuple) else (values,)))
        row["runs"] = len(g)
        row["finished"] = int((g["status"] == "finished").sum()) if "status" in g else len(g)
        for c in scores:
            v = g[c].dropna()
            row[f"{c}_mean"] = float(v.mean()) if len(v) else np.nan
            row[f"{c}_std"] = float(v.std(ddof=0)) if len(v) else np.nan
            row[f"{c}_n"] = len(v)
        rows.append(row)
    return pd.DataFrame(rows)


def markdown(head: list[str], rows: list[list[str]]) -> str:
    """A markdown table."""
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(r) + " |" for r in rows])


def table(df: pd.DataFrame, sw: Sweep) -> str:
    """Markdown: one row per grid point and arm, mean ± std over seeds (accuracies in %)."""
    head, rows = summary(df, sw)
    return markdown(head, [cells for _, cells in rows])


def _run_one(job: tuple[Any, bool, str]) -> str:
    cfg, fresh, label = job
    print(label, file=sys.stderr, flush=True)
    return str(run_cached(cfg, fresh))


def run_all(configs: list, labels: list[str], fresh: bool = False, jobs: int = 1) -> list[Location]:
    """run_cached for every config, `jobs` at a time in separate processes (each run is deterministic on its
    own, so the numbers do not depend on `jobs`); Ray-backed configs run one by one in this process."""
    todo = [(cfg, fresh, label) for cfg, label in zip(configs, labels)]
    if jobs <= 1 or len(todo) <= 1 or any(c.runtime.backend == "ray" for c in configs):
        with ray_session(configs):
            return [location(_run_one(job)) for job in todo]
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
    return [location(d) for d in done]


@contextlib.contextmanager
def ray_session(configs: list, always: bool = False) -> Iterator[None]:
    """One Ray instance for every Ray-backed config of a job (none if all run locally, unless `always`)."""
    started = False
    if always or any(c.runtime.backend == "ray" for c in configs):
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        from actors.boot import check_reachable, import_ray, init_ray
        from actors.plugins import job_runtime_env

        ray = import_ray()
        if not ray.is_initialized():  # the job carries every run's plugins to the trials and their workers
            check_reachable(configs[0].runtime.ray_address)
            started = True
            init_ray(configs[0].runtime.ray_address, job_runtime_env(*configs))
    try:
        yield
    finally:
        if started:
            ray.shutdown()


def execute(runs: list[dict], configs: list, sw: Sweep, fresh: bool = False, jobs: int = 1) -> pd.DataFrame:
    """Run (or reuse) every planned run in this process or `jobs` processes, without Tune (jobs.reproduce); one row
    per run with its setting, arm, seed, folder and scores."""
    from fedsim.results.tables import load

    labels = [f"[{i + 1}/{len(runs)}] {r['arm']} {r['grid']} seed={r['seed']}" for i, r in enumerate(runs)]
    rows = []
    for r, run_dir in zip(runs, run_all(configs, labels, fresh, jobs)):
        table = load(run_dir)["rounds"]
        c = curve(table, sw.metric, sw.model)
        rows.append({**r["grid"], **r.get("space", {}), "arm": r["arm"], "seed": r["seed"], "run": str(run_dir),
                     "rounds_run": int(c.index.max()),
                     **score(c, sw.target, sw.budgets, progress(table), sw.target_by)})
    return pd.DataFrame(rows)


def trial_rows(runs: list[dict], configs: list, sw: Sweep, errors: dict[int, str]) -> pd.DataFrame:
    """One row per planned run: its setting, arm, seed, folder, how it ended and its scores (NaN if it made no
    round): finished, failed (with the error), killed (its process, without an error from Tune; recorded in its
    meta.json too), stopped (early, by ASHA or by hand) or not run."""
    from fedsim.results.tables import load

    rows = []
    for i, (r, cfg) in enumerate(zip(runs, configs)):
        folder = run_folder(cfg)
        ended = unfinished_status(folder)
        row: dict[str, Any] = {**r["grid"], **r.get("space", {}), "arm": r["arm"], "seed": r["seed"],
                               "run": str(folder), "error": errors.get(i, "")}
        scores: dict[str, Any] = {}
        if (folder / "rounds.parquet").is_file():
            table = load(folder)["rounds"]
            c = curve(table, sw.metric, sw.model)
            if len(c):
                scores = {"rounds_run": int(c.index.max()),
                          **score(c, sw.target, sw.budgets, progress(table), sw.target_by)}
        finished = (folder / FINISHED).is_file() and i not in errors
        row["status"] = "finished" if finished else "failed" if i in errors else KILLED if ended == KILLED else \
            "stopped" if scores else "not run"
        rows.append({**row, **scores})
    df = pd.DataFrame(rows)
    for col in ["rounds_run", "best", "final", *([TO_TARGET[b] for b in sw.target_by] if sw.target is not None else []),
                *(f"at_{b}" for b in sw.budgets)]:
        if col not in df:
            df[col] = np.nan
    return df


def output_dir(sw: Sweep, given: str | None) -> Location:
    """The sweep's folder: `given` (a path or a URI), or results/sweeps/<title>."""
    return location(given, "--output-dir") if given else Path("results") / "sweeps" / _slug(sw.title)


def run_sweep(sweep_file: str | Path, out: str | None = None, dry_run: bool = False, fresh: bool = False,
              overrides: Sequence[str] = (), backend: str | None = None, out_dir: str | None = None,
              resume: bool = False, parallel: int | None = None) -> str:
    """Plan, run as Tune trials (or resume) and tabulate a sweep; returns the markdown it printed and wrote."""
    from fedsim.configure import load_config
    from fedsim.persist.io import atomic_write, atomic_write_text
    from jobs.sweep_tune import check_replaceable, check_resume, make_output_dir, run_trials, trial_bundles

    sweep_file = Path(sweep_file)
    sw = load_sweep(sweep_file)
    seeded = next((o for o in overrides if _key(o) == "seed"), None)
    if seeded is not None:
        raise ConfigError(f"-o {seeded}: a sweep sets each run's seed from seeds: in {sweep_file}; list the seeds "
                          "there instead")
    runs = plan(sw, sweep_file)
    dest_dir = output_dir(sw, out_dir)
    dest = table_path(dest_dir, out, sw.out)
    runs_root = dest_dir / "runs"
    extra = [f"results.root={runs_root.resolve() if isinstance(runs_root, Path) else runs_root}", *overrides,
             *([f"runtime.backend={backend}"] if backend else [])]
    for r in runs:
        r["config"] = str(Path(r["config"]).resolve())
        r["overrides"] = [*r["overrides"], *extra]
    configs = [load_config(r["config"], r["overrides"]) for r in runs]  # validate everything before running
    check_scoring(sw, configs)
    if dry_run:
        return "\n".join(f"{r['arm']} {r['grid']}{' ' + str(r['space']) if 'space' in r else ''} seed={r['seed']}: "
                         f"{r['config']} {r['overrides']} share={trial_bundles(c)}" for r, c in zip(runs, configs))
    metrics = [sw.metric] + ([sw.early_stop.metric] if sw.early_stop and sw.early_stop.metric != sw.metric else [])
    specs = [{"index": i, "config": r["config"], "overrides": r["overrides"], "cwd": os.getcwd(), "fresh": fresh,
              "metrics": metrics, "bundles": trial_bundles(c), "key": run_key(c)}
             for i, (r, c) in enumerate(zip(runs, configs))]
    if resume:
        check_resume(dest_dir, specs)
    check_replaceable(dest_dir)
    make_output_dir(dest_dir)
    with ray_session(configs, always=True):
        errors = run_trials(specs, dest_dir, resume, parallel or sw.max_parallel, sw.early_stop,
                            max(c.rounds for c in configs))
    df = trial_rows(runs, configs, sw, errors)
    command = f"fedsim sweep {sweep_file}" + "".join(f" -o {o}" for o in overrides) + \
        (f" --backend {backend}" if backend else "")
    md = f"### {sw.title}\n\n{table(df, sw)}\n\nCommand: `{command}`; seeds {sw.seeds}; mean ± std (population) " \
         "over seeds; an empty cell is a budget past the rounds run.\n"
    failed = [f"  {r.arm} seed={r.seed} ({r.run}): {r.error}" for r in df.itertuples() if r.status == "failed"]
    if failed:
        md += "\nFailed runs:\n" + "\n".join(failed) + "\n"
    counts = df["status"].value_counts()
    if counts.get("not run", 0) or counts.get(KILLED, 0):
        told = [f"{counts[s]} runs {what}" for s, what in (("not run", "did not run (the sweep was stopped)"),
                                                           (KILLED, "were killed")) if counts.get(s, 0)]
        md += f"\n{' and '.join(told)}: continue with `{command}{f' --output-dir {out_dir}' if out_dir else ''} " \
              "--resume`\n"
    atomic_write(dest_dir / "table.parquet", lambda tmp: summary_frame(df, sw).to_parquet(tmp, index=False))
    atomic_write(dest_dir / "runs.parquet", lambda tmp: df.to_parquet(tmp, index=False))
    atomic_write_text(dest, md)
    return md


def table_path(dest_dir: Location, out: str | None, sweep_out: str | None) -> Location:
    """Where the markdown table goes (--out, the sweep file's out:, or DIR/table.md), checked before any run so
    that a bad path cannot lose the table at the end: a file path in a folder that exists, and DIR a folder."""
    if dest_dir.exists() and not dest_dir.is_dir():
        raise ConfigError(f"--output-dir {dest_dir}: exists and is not a folder")
    if not (out or sweep_out):
        return dest_dir / "table.md"
    given = f"--out {out}" if out else f"out: {sweep_out}"
    dest = Path(str(out or sweep_out))
    if dest.is_dir():
        raise ConfigError(f"{given}: is a folder; give the path of the markdown file to write")
    if not dest.parent.is_dir():
        raise ConfigError(f"{given}: the folder {dest.parent} does not exist")
    return dest


# columns some methods add to their evaluation rows (FedDF's mirrors, personal scores, FedGDKD's FID); unlike
# their mechanism_columns, methods do not declare them
EVAL_COLUMNS = ("val_accuracy", "drives_selection", "macro_accuracy", "clients_scored", "generator_fd")


def check_scoring(sw: Sweep, configs: list) -> None:
    """`metric`, `early_stop.metric` and `model` checked against what the planned runs record, before any of them
    runs. A method from a plugin records what it likes and is not checked; neither are server metrics
    (`<phase>/<name>`, undeclared) other than mechanism columns: a run's table is checked for them at the end."""
    import re

    from fedsim.method.contract import get_algorithm
    from fedsim.results.tables import ROUND_COLUMNS, ROUND_LEVEL

    metrics = {"metric": sw.metric, **({"early_stop.metric": sw.early_stop.metric} if sw.early_stop else {})}
    models: dict[str, None] = {}
    for cfg in configs:
        method = get_algorithm(cfg.algorithm.name)
        if not method.__module__.startswith("fedsim."):
            continue
        mechanism = set(method.mechanism_columns)
        columns = {*ROUND_COLUMNS, *ROUND_LEVEL, *EVAL_COLUMNS, *(mechanism if cfg.eval.mechanism else ())}
        for key, metric in metrics.items():
            if metric in mechanism and not cfg.eval.mechanism:
                raise ConfigError(f"{key}: {metric!r} is recorded only with eval.mechanism: true")
            if metric not in columns and "/" not in metric:
                raise ConfigError(f"{key}: {metric!r} is not a column of rounds.parquet that {cfg.algorithm.name} "
                                  f"records; scores: {', '.join(sorted(columns - ROUND_LEVEL))}")
        models.update(dict.fromkeys([a for a, n in cfg.model.mix.items() if n > 0] or [cfg.model.name]))
    named = sw.model not in ("best", "macro", "personal") and not re.fullmatch(r"(.+@)?after_\d+", sw.model)
    if models and named and sw.model not in models:
        raise ConfigError(f"model: {sw.model!r} is not best, macro or a global model the runs evaluate "
                          f"({', '.join(models)})")


def _slug(text: str) -> str:
    return "".join(ch if ch.isalnum() else "_" for ch in text.lower()).strip("_")[:60] or "sweep"


def from_args(args: argparse.Namespace) -> int:
    """Run the sweep that `fedsim sweep`'s parsed arguments describe and print its table."""
    print(run_sweep(args.sweep, args.out, args.dry_run, args.fresh, args.override, args.backend, args.output_dir,
                    args.resume, args.parallel))
    return 0
