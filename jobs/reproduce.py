"""Rebuild every method table of the docs' method pages from runs, with the paper's figure beside ours.

    python -m jobs.reproduce [--quick] [--only ID,...] [--seeds N] [--root DIR] [--fresh]
    python -m jobs.reproduce --docs [--only ID,...] [--root DIR]

configs/reproduce.yaml lists the tables: a sweep file (jobs.sweep) or DOSFL configs (jobs.dosfl_compare),
their seeds, and per arm the paper's figure for the closest setting with its source. Each table is written
as <root>/<id>.md (what its method page shows, stating data, budget, seeds, hardware, date, wall time and this
command) and <root>/<id>.parquet (one row per arm, grid point and seed: every score and the run folder).
Runs live in <root>/runs/, named by a hash of their config, so an interrupted reproduce resumes where it
stopped. --quick (one seed, a few rounds, smaller sizes) writes to results/reproduce-quick/ and only checks
that the command works. --docs pastes <root>/<id>.md between the `<!-- reproduce:<id> -->` markers of whichever
page holds them (README.md or docs/**/*.md; the method pages, docs/methods/).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedsim.config.knobs import from_dict, knob
from fedsim.errors import ConfigError, FedsimError
from jobs.args import OneLineParser
from jobs.readme_blocks import doc_pages, paste_blocks, read_page_blocks

MANIFEST = Path("configs") / "reproduce.yaml"
ROOT = Path("results") / "reproduce"
QUICK_ROOT = Path("results") / "reproduce-quick"
SWEEP_SCORES = ("best", "final")
DOSFL_SCORES = ("dosfl_best", "dosfl_mean")
ID_PATTERN = re.compile(r"[a-z0-9_-]+")
NO_FIGURE = "—"


@dataclass
class PaperFigure:
    arm: str = knob("", doc="row label (a sweep arm, or a DOSFL config's file name without .yaml)")
    value: float = knob(0.0, ge=0, le=100, doc="the paper's figure for the closest setting, in %")
    source: str = knob("", doc="where the paper reports it: table and setting")
    reference: str | None = knob(None, doc="arm the direction is measured against; none: this arm is a reference")
    reference_value: float | None = knob(None, ge=0, le=100,
                                         doc="the paper's figure for the reference setting in the same source "
                                             "(default: the reference arm's own figure)")
    grid: dict[str, Any] = knob({}, doc="grid point the figure belongs to (default: every point)")


@dataclass
class MechanismCell:
    label: str = knob("", doc="column head in the table")
    columns: list[str] = knob([], doc="rounds.parquet columns shown in the cell (their mean over rounds, then seeds)")
    sep: str = knob(" / ", doc="text between the values, e.g. ' → ' for before → after")
    percent: bool = knob(True, doc="show the values ×100 (accuracies, shares)")
    final: bool = knob(False, doc="the last round's value instead of the mean over rounds (what a run ends with: "
                                  "its epsilon)")
    arms: list[str] = knob([], doc="the rows that show this cell (default: every row that records its columns)")


@dataclass
class TableSpec:
    id: str = knob("", doc="table name: docs block <!-- reproduce:<id> --> and <root>/<id>.md")
    sweep: str | None = knob(None, doc="sweep file (jobs.sweep) whose arms are the rows")
    dosfl: list[str] = knob([], doc="DOSFL configs compared with FedAvg (jobs.dosfl_compare), one row each")
    seeds: list[int] = knob([0, 1, 2], ge=0, doc="run seeds (the sweep file's own seeds are replaced)")
    compare: str = knob("best", doc="our score set against the paper's: best or final (sweeps), "
                                    "dosfl_best or dosfl_mean (DOSFL)")
    paper_title: str = knob("", doc="the paper the figures come from, as the table names it")
    paper: list[PaperFigure] = knob(factory=list)
    mechanism: list[MechanismCell] = knob(factory=list)
    quick: list[str] = knob([], doc="this table's own --quick overrides, after the manifest's")


@dataclass
class QuickSpec:
    rounds: int = knob(2, ge=1, doc="rounds of every --quick run")
    overrides: dict[str, list[str]] = knob({}, doc="--quick overrides per algorithm name ('*': every run), "
                                                    "applied after each arm's own")


@dataclass
class Manifest:
    quick: QuickSpec = knob(factory=QuickSpec)
    tables: list[TableSpec] = knob(factory=list)


def load_manifest(path: str | Path = MANIFEST) -> Manifest:
    """The manifest, with every table's rows, references and grid points checked against its sweep or configs."""
    m = read_manifest(path)
    check_manifest(m, path)
    return m


def read_manifest(path: str | Path = MANIFEST) -> Manifest:
    """The manifest's shape and its tables' ids, what `--only` and `--docs` need: no algorithm is loaded (torch),
    so a mistyped table id is refused at once."""
    from fedsim.config.schema import read_yaml

    data = read_yaml(path)  # its errors name the file already
    try:
        m = from_dict(Manifest, data)
    except ConfigError as exc:
        raise ConfigError(f"{path}: {exc}") from None
    if not m.tables:
        raise ConfigError(f"{path}: tables: list at least one table")
    seen = set()
    for i, t in enumerate(m.tables):
        where = f"{path}: tables[{i}]"
        if not ID_PATTERN.fullmatch(t.id):
            raise ConfigError(f"{where}.id: {t.id!r} must be lowercase letters, digits, '_' or '-'")
        if t.id in seen:
            raise ConfigError(f"{where}.id: {t.id!r} appears twice")
        seen.add(t.id)
    return m


def check_manifest(m: Manifest, path: str | Path) -> None:
    """The rest of load_manifest's checks: quick overrides name algorithms, and every table's rows, references and
    grid points fit its sweep or configs."""
    from fedsim.method.contract import get_algorithm

    for name in m.quick.overrides:
        if name != "*":
            try:
                get_algorithm(name)
            except ConfigError:
                raise ConfigError(f"{path}: quick.overrides.{name}: not an algorithm name (or '*')") from None
    for i, t in enumerate(m.tables):
        _check_table(t, f"{path}: tables[{i}] ({t.id})")


def _check_table(t: TableSpec, where: str) -> None:
    if (t.sweep is None) == (not t.dosfl):
        raise ConfigError(f"{where}: give exactly one of sweep and dosfl")
    if not t.seeds or len(set(t.seeds)) != len(t.seeds):
        raise ConfigError(f"{where}.seeds: list one or more distinct seeds")
    scores = SWEEP_SCORES if t.sweep is not None else DOSFL_SCORES
    if t.compare not in scores:
        raise ConfigError(f"{where}.compare: {t.compare!r} is not one of {list(scores)}")
    from fedsim.method import STEP_RATIO_COLUMNS
    from fedsim.method.asynchronous import ASYNC_COLUMNS
    from fedsim.method.contract import algorithm_names, get_algorithm
    from fedsim.transforms import CHAIN_COLUMNS

    documented = {c for n in algorithm_names() for c in get_algorithm(n).mechanism_columns} | CHAIN_COLUMNS | \
        set(STEP_RATIO_COLUMNS) | set(ASYNC_COLUMNS)
    for j, m in enumerate(t.mechanism):
        unknown = [c for c in m.columns if c not in documented]
        if not m.columns or unknown:
            raise ConfigError(f"{where}.mechanism[{j}].columns: {unknown or 'none given'}; each must be a "
                              "documented mechanism column (docs/mechanism.md)")
    arms, grid = table_rows(t)
    for j, m in enumerate(t.mechanism):
        if [a for a in m.arms if a not in arms]:
            raise ConfigError(f"{where}.mechanism[{j}].arms: {[a for a in m.arms if a not in arms]} are not rows "
                              f"of the table; rows: {arms}")
    keys = set()
    for j, f in enumerate(t.paper):
        at = f"{where}.paper[{j}]"
        if f.arm not in arms:
            raise ConfigError(f"{at}.arm: {f.arm!r} is not a row of the table; rows: {arms}")
        for k, v in f.grid.items():
            if k not in grid or v not in grid[k]:
                raise ConfigError(f"{at}.grid: {k}={v!r} is not a grid point of the sweep; grid: {grid}")
        if f.reference is not None and f.reference not in arms:
            raise ConfigError(f"{at}.reference: {f.reference!r} is not a row of the table; rows: {arms}")
        if f.reference == f.arm:
            raise ConfigError(f"{at}.reference: an arm is not its own reference (leave reference out instead)")
        for point in grid_points(grid, f.grid):
            key = (f.arm, tuple(sorted(point.items())))
            if key in keys:
                raise ConfigError(f"{at}: a second figure for {f.arm!r} at {point or 'the same point'}")
            keys.add(key)
            if f.reference is not None and f.reference_value is None and figure_for(t, f.reference, point) is None:
                raise ConfigError(f"{at}.reference_value: {f.reference!r} has no paper figure at "
                                  f"{point or 'this point'}; give the paper's figure for the reference setting")


def table_rows(t: TableSpec) -> tuple[list[str], dict[str, list[Any]]]:
    """The table's row labels and its sweep grid ({} for DOSFL); a missing file is a ConfigError."""
    from jobs.sweep import load_sweep

    if t.sweep is not None:
        sw = load_sweep(t.sweep)
        return [a.name for a in sw.arms], dict(sw.grid)
    for c in t.dosfl:
        if not Path(c).is_file():
            raise ConfigError(f"table {t.id}: dosfl config not found: {c}")
    return [Path(c).stem for c in t.dosfl], {}


def grid_points(grid: dict[str, list[Any]], fixed: dict[str, Any]) -> list[dict[str, Any]]:
    """Every grid point that agrees with `fixed`."""
    points: list[dict[str, Any]] = [{}]
    for k, values in grid.items():
        points = [{**p, k: v} for p in points for v in values if k not in fixed or fixed[k] == v]
    return points


def figure_for(t: TableSpec, arm: str, point: dict[str, Any]) -> PaperFigure | None:
    """The paper's figure for `arm` at a grid point, if the manifest gives one."""
    for f in t.paper:
        if f.arm == arm and all(point.get(k) == v for k, v in f.grid.items()):
            return f
    return None


def direction_holds(ours: float, ours_ref: float, paper: float, paper_ref: float) -> bool:
    """Whether our arm lies on the same side of the reference as the paper's: equal signs of the differences."""
    return bool(np.sign(ours - ours_ref) == np.sign(paper - paper_ref))


def paper_cells(t: TableSpec, arm: str, point: dict[str, Any], ours: dict[tuple, float]) -> list[str]:
    """The "paper" and "direction holds?" cells of one row; `ours` maps (grid values..., arm) to our score."""
    f = figure_for(t, arm, point)
    if f is None:
        return [NO_FIGURE, NO_FIGURE]
    paper = f"{f.value:g} ({f.source})"
    if f.reference is None:
        return [paper, "reference"]
    if f.reference_value is not None:
        paper_ref = f.reference_value
    else:
        ref_figure = figure_for(t, f.reference, point)
        assert ref_figure is not None  # load_manifest requires a reference figure or a reference_value
        paper_ref = ref_figure.value
    mine, ref = ours.get((*point.values(), arm), np.nan), ours.get((*point.values(), f.reference), np.nan)
    if not (np.isfinite(mine) and np.isfinite(ref)):
        return [paper, NO_FIGURE]
    cell = "yes" if direction_holds(mine, ref, f.value, paper_ref) else "no"
    if len({g.reference for g in t.paper if g.reference is not None}) > 1:
        cell += f" (vs {f.reference})"
    return [paper, cell]


def quick_overrides(quick: QuickSpec, config: str, overrides: list[str]) -> list[str]:
    """The --quick overrides for one run: the round cap, then '*' and those of the run's algorithm."""
    from fedsim.config.schema import apply_overrides, read_yaml

    name = (apply_overrides(read_yaml(config), overrides).get("algorithm") or {}).get("name", "fedavg")
    return [f"rounds={quick.rounds}", *quick.overrides.get("*", []), *quick.overrides.get(name, [])]


@dataclass
class Result:
    """One reproduced table: its markdown rows, per-seed raw rows and the run configs behind them."""

    head: list[str]
    rows: list[list[str]]
    raw: pd.DataFrame
    configs: list
    budget: str


def run_sweep_table(t: TableSpec, seeds: list[int], root: Path, quick: QuickSpec | None, fresh: bool,
                    jobs: int = 1) -> Result:
    """Run (or reuse) the sweep's runs and build its rows, with the paper columns."""
    from fedsim.configure import load_config
    from jobs.sweep import execute, load_sweep, plan, summary

    assert t.sweep is not None  # only tables with a sweep come here
    sw = load_sweep(t.sweep)
    sw.seeds = seeds
    runs = plan(sw, Path(t.sweep))
    for r in runs:
        extra = [*quick_overrides(quick, r["config"], r["overrides"]), *t.quick] if quick else []
        r["overrides"] = [*r["overrides"], *extra, f"results.root={root / 'runs'}"]
    configs = [load_config(r["config"], r["overrides"]) for r in runs]
    df = execute(runs, configs, sw, fresh, jobs)
    grid_cols = list(sw.grid)
    ours = {k if isinstance(k, tuple) else (k,): v
            for k, v in df.groupby([*grid_cols, "arm"], sort=False)[t.compare].mean().items()}
    head, rows = summary(df, sw)
    mech_head, mech = mechanism_cells(t, df, [*grid_cols, "arm"])
    paper = ["paper (%)", "direction holds?"] if t.paper else []  # a table of our own findings has no paper cells
    out = [cells + mech.get(keys, ["—"] * len(mech_head))
           + (paper_cells(t, keys[-1], dict(zip(grid_cols, keys[:-1])), ours) if paper else [])
           for keys, cells in rows]
    budget = ", ".join(str(r) for r in sorted({c.rounds for c in configs})) + " rounds"
    return Result([*head, *mech_head, *paper], out, df, configs, budget)


def run_dosfl_table(t: TableSpec, seeds: list[int], root: Path, quick: QuickSpec | None, fresh: bool,
                    jobs: int = 1) -> Result:
    """Run (or reuse) DOSFL and FedAvg for each config and build its rows, with the paper columns."""
    from fedsim.configure import load_config
    from jobs.dosfl_compare import compare, summary

    over = [f"results.root={root / 'runs'}"]
    fed_over: list[str] = []
    if quick:
        over += [*quick.overrides.get("*", []), *quick.overrides.get("dosfl", [])]
        fed_over = list(quick.overrides.get("fedavg", []))
    stat = "best" if t.compare == "dosfl_best" else "mean"
    rows = [compare(c, seeds, stat, quick.rounds if quick else None, fed_over, over, fresh, jobs) for c in t.dosfl]
    raw = pd.DataFrame([{"arm": Path(r["config"]).stem, **s} for r in rows for s in r["per_seed"]])
    ours = {(Path(r["config"]).stem,): r[t.compare] for r in rows}
    head, out = summary(rows, stat)
    mech_head, mech = mechanism_cells(t, raw, ["arm"])
    cells = [c + mech.get((name,), ["—"] * len(mech_head)) + paper_cells(t, name, {}, ours) for name, c in out]
    head = [*head, *mech_head]
    configs = [load_config(c, over) for c in t.dosfl]
    fed_rounds = sorted({int(r["fedavg_rounds"]) for r in rows})
    budget = f"DOSFL 1 round, FedAvg {', '.join(map(str, fed_rounds))} rounds"
    return Result([*head, "paper (%)", "direction holds?"], cells, raw, configs, budget)


def run_mechanism(run_dir: str | Path, columns: list[str], final: frozenset[str] = frozenset()) -> dict[str, float]:
    """Each column's mean over a run's rounds, or for those in `final` its last round's value (NaN where the run
    does not record it)."""
    import math

    from fedsim.results.tables import load

    rounds = load(run_dir)["rounds"].drop_duplicates("round").sort_values("round")
    return {c: (float(rounds[c].iloc[-1]) if c in final else float(rounds[c].mean())) if c in rounds else math.nan
            for c in columns}


def mechanism_cells(t: TableSpec, raw: pd.DataFrame, keys: list[str]) -> tuple[list[str], dict[tuple, list[str]]]:
    """Head and per-row cells of the table's mechanism columns; adds each run's values to `raw`."""
    import math

    wanted = list(dict.fromkeys(c for m in t.mechanism for c in m.columns))
    if not wanted:
        return [], {}
    run_col = "run" if "run" in raw else "dosfl_run"
    final = frozenset(c for m in t.mechanism if m.final for c in m.columns)
    values = pd.DataFrame([run_mechanism(r, wanted, final) for r in raw[run_col]], index=raw.index)
    for c in wanted:
        raw[c] = values[c]
    cells: dict[tuple, list[str]] = {}
    for k, g in raw.groupby(keys, sort=False):
        k = k if isinstance(k, tuple) else (k,)
        row = []
        for m in t.mechanism:
            means = [g[c].mean() for c in m.columns]
            if m.arms and k[-1] not in m.arms:
                means = [math.nan] * len(means)
            row.append("—" if all(math.isnan(v) for v in means) else m.sep.join(
                "—" if math.isnan(v) else (f"{100 * v:.1f}" if m.percent else f"{v:.3g}") for v in means))
        cells[k] = row
    return [m.label for m in t.mechanism], cells


def describe_data(configs: list) -> str:
    """Dataset, clients and partition of the runs, each distinct description once."""
    out = []
    for c in configs:
        p = c.data.partition
        split = {"iid": "IID", "dirichlet": f"Dirichlet α={p.alpha:g}",
                 "shards": f"{p.shards_per_client} label shards each"}[p.kind]
        text = f"{c.data.name}, {c.data.num_clients} clients, {split}"
        if text not in out:
            out.append(text)
    return "; ".join(out)


def run_folders(raw: pd.DataFrame) -> list[str]:
    """Every run folder a table's raw rows name."""
    cols = [c for c in ("run", "dosfl_run", "fedavg_run") if c in raw]
    return list(dict.fromkeys(v for c in cols for v in raw[c]))


def render(t: TableSpec, res: Result, seeds: list[int], command: str) -> str:
    """The table file: a generated-file note, the table, then what it was measured on and how to remake it."""
    from jobs.cached_runs import finished_info
    from jobs.sweep import markdown

    infos = [finished_info(f) for f in run_folders(res.raw)]
    wall = sum(i["wall_s"] for i in infos)
    hardware = "; ".join(dict.fromkeys(i["hardware"] for i in infos))
    refs = list(dict.fromkeys(f.reference for f in t.paper if f.reference is not None))
    return "\n".join([
        f"<!-- generated by `python -m jobs.reproduce` from configs/reproduce.yaml ({t.id}); do not edit -->",
        markdown(res.head, res.rows), "",
        f"Data: {describe_data(res.configs)}. Budget: {res.budget}. Seeds: {', '.join(map(str, seeds))}; "
        "mean ± std (population) over seeds, accuracies in %"
        + ("; an empty cell is a budget past the rounds run." if t.sweep is not None else "."),
        (f"Paper: {t.paper_title}, its figure for the closest setting (source in brackets). Direction holds? = "
         f"sign(ours − ours(reference)) equals sign(paper − paper(reference)), on our "
         f"{t.compare.replace('_', ' ')} accuracy; reference: {', '.join(refs) or 'none'}." if t.paper else
         f"The papers' claims it tests: {t.paper_title}."),
        f"Hardware: {hardware}. Date: {datetime.now().strftime('%Y-%m-%d')}. Wall time: {wall:.0f} s "
        f"(the runs' own, summed). Command: `{command}`.", ""])


def reproduce(t: TableSpec, seeds: list[int], root: Path, quick: QuickSpec | None, fresh: bool, command: str,
              jobs: int = 1) -> Path:
    """Run one table and write <root>/<id>.md and <root>/<id>.parquet; returns the markdown path."""
    from fedsim.persist.io import atomic_write, atomic_write_text

    run = run_sweep_table if t.sweep is not None else run_dosfl_table
    res = run(t, seeds, root, quick, fresh, jobs)
    dest = root / f"{t.id}.md"
    atomic_write(dest.with_suffix(".parquet"), lambda tmp: res.raw.to_parquet(tmp, index=False))
    atomic_write_text(dest, render(t, res, seeds, command))
    return dest


def page_blocks(pages: list[Path]) -> dict[str, str]:
    """The pages' reproduce blocks: id -> the text between its markers."""
    for page in pages:
        try:
            page.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{page}: cannot be read as text "
                              f"({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
    return read_page_blocks(pages, "reproduce")


def paste(pages: list[Path], root: Path, ids: list[str]) -> list[str]:
    """Put <root>/<id>.md between the markers of the page that holds each id whose file exists; returns the ids
    pasted."""
    missing = [i for i in ids if i not in page_blocks(pages)]
    if missing:
        where = str(pages[0]) if len(pages) == 1 else "README.md or docs/"
        raise ConfigError(f"{where}: no <!-- reproduce:{missing[0]} --> ... <!-- /reproduce:{missing[0]} --> block")
    if not root.is_dir():
        raise ConfigError(f"--root {root}: no such folder of tables")
    pasted = [i for i in ids if (root / f"{i}.md").is_file()]
    tables = {}
    for i in pasted:
        try:
            tables[i] = (root / f"{i}.md").read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{root / f'{i}.md'}: cannot be read as text "
                              f"({getattr(exc, 'strerror', None) or type(exc).__name__})") from None
    paste_blocks(pages, "reproduce", tables)
    return pasted


def _positive(text: str) -> int:
    if not text.isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = OneLineParser(prog="python -m jobs.reproduce", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="1 seed, a few rounds, smaller sizes; results/reproduce-quick")
    p.add_argument("--only", default=None, metavar="ID,...", help="these tables only")
    p.add_argument("--seeds", type=_positive, default=None, metavar="N", help="seeds 0..N-1 instead of the manifest's")
    p.add_argument("--root", default=None, help=f"output folder (default {ROOT}, or {QUICK_ROOT} with --quick)")
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    p.add_argument("--jobs", type=_positive, default=1, metavar="N",
                   help="runs at a time, each in its own process (numbers do not depend on it)")
    p.add_argument("--docs", action="store_true", help="paste <root>/<id>.md into the method pages; runs nothing")
    p.add_argument("--manifest", default=str(MANIFEST), help=argparse.SUPPRESS)
    p.add_argument("--page", action="append", default=None, help=argparse.SUPPRESS)  # pages to paste into
    args = p.parse_args(argv)
    if args.docs and args.quick:
        p.error("--docs pastes the full tables; --quick tables never go into the docs")
    if args.root == "":
        p.error("argument --root: give a folder, not an empty string")
    root = Path(args.root or (QUICK_ROOT if args.quick else ROOT))
    try:
        manifest = read_manifest(args.manifest)  # the rest is checked before anything runs, not to paste
        tables = manifest.tables
        if args.only is not None:
            wanted = [i.strip() for i in args.only.split(",") if i.strip()]
            unknown = [i for i in wanted if i not in {t.id for t in tables}]
            if unknown or not wanted:
                raise ConfigError(f"--only: unknown table {unknown[0] if unknown else args.only!r}; "
                                  f"tables: {[t.id for t in tables]}")
            tables = [t for t in tables if t.id in wanted]
        if args.docs:
            pages = [Path(p) for p in args.page] if args.page else doc_pages(Path("."))
            pasted = paste(pages, root, [t.id for t in tables])
            skipped = [t.id for t in tables if t.id not in pasted]
            print(f"pasted into the docs: {', '.join(pasted) or 'nothing'}"
                  + (f"; no {root}/<id>.md yet for: {', '.join(skipped)}" if skipped else ""))
            return 0
        check_manifest(manifest, args.manifest)
        command = " ".join(["python -m jobs.reproduce", *argv])
        t0 = time.perf_counter()
        for t in tables:
            seeds = list(range(args.seeds)) if args.seeds else list(t.seeds)
            seeds = seeds[:1] if args.quick else seeds
            print(f"== {t.id}: seeds {seeds}", file=sys.stderr, flush=True)
            dest = reproduce(t, seeds, root, manifest.quick if args.quick else None, args.fresh, command, args.jobs)
            print(f"{t.id}: {dest}", flush=True)
        print(f"done in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
    except FedsimError as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except OSError as exc:  # a table's file that cannot be written (the runs are kept: the command resumes)
        where = f"{exc.filename}: " if exc.filename else ""
        print(f"fedsim: error: {where}{exc.strerror or type(exc).__name__}; the same command resumes once it can be "
              "written (finished runs are reused)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("fedsim: interrupted; the same command resumes (finished runs are reused)", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    # the importable module's main, whose manifest classes resolve their annotations wherever this file runs as
    # __main__ (under `python -m cProfile -m jobs.reproduce`, sys.modules["__main__"] is the profiler's)
    from jobs.reproduce import main as entry

    sys.exit(entry())
