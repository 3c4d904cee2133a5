"""Figures of many runs, as a paper shows them: a panel per metric against round, virtual time or bytes sent, one
curve per setting (the mean over its seeds, with a ± std band) and one legend beside the panels, never over them.

Runs are one setting when their configs differ in `seed` alone, keys that leave the experiment unchanged aside
(name, rounds, results, runtime, eval, tracking, where the data lives); a plugin counts by its module name,
never by the folder its file was in. Two runs of a setting with the same seed are duplicates: the newest is kept
and a DuplicateRuns warning names the others. `round` is the tables' own numbering (0 is the first round).
"""

from __future__ import annotations

import json
import math
import numbers
import re
import textwrap
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePath
from typing import TYPE_CHECKING, Any

import pandas as pd

from fedsim.config.schema import RESUME_SAFE
from fedsim.errors import CheckpointError, FedsimError
from fedsim.results.tables import model_metric

if TYPE_CHECKING:
    from matplotlib.figure import Figure

    from fedsim.persist.storage import Location

CURVE_COLUMNS = ["setting", "model", "round", "x", "y", "y_std", "runs"]
X_AXES = {"round": "round (0 = first)", "virtual_time": "virtual time (s)", "bytes_up": "bytes uploaded (total)",
          "bytes_down": "bytes downloaded (total)"}
"""What the x axis can be, and its label: a run's clock, and bytes sent (summed over its rounds so far)."""
CUMULATIVE = frozenset({"bytes_up", "bytes_down"})
PANEL_INCHES = (4.8, 3.6)


class DuplicateRuns(UserWarning):
    """Runs with the same config and seed: only the newest of each is drawn; the warning names the rest."""


def metric_columns(df: pd.DataFrame) -> list[str]:
    """The numeric columns of a rounds table (as `fedsim.collect` returns it) that can go on an axis."""
    return [c for c in df.columns if c not in ("run", "model") and not c.startswith("config.")
            and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]


def _check_metric(df: pd.DataFrame, axis: str, name: str) -> None:
    available = metric_columns(df)
    if axis == "x" and name not in X_AXES:
        raise FedsimError(f"--x {name}: not an x axis; choose one of {', '.join(X_AXES)}")
    if name not in available:
        raise FedsimError(f"--{axis} {name}: not a numeric column of these runs' rounds tables; available: "
                          f"{', '.join(available)}")


def value_text(value: Any) -> str:
    """A config value as a label shows it and as settings are told apart by: a number in its shortest form that
    reads back the same (1 and 1.0 alike), a missing one (null, or a key that run's config lacks) as "None"."""
    if value is None or value is pd.NA or (isinstance(value, float) and math.isnan(value)):
        return "None"
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return str(value)
    if isinstance(value, numbers.Integral):
        return str(int(value))
    number = float(value)
    if number.is_integer() and abs(number) < 2**53:
        return str(int(number))
    short = f"{number:g}"
    return short if float(short) == number else repr(number)


def plugin_names(value: Any) -> str:
    """A run's `plugins` (the JSON list `collect` flattens it to) by module name: a file's stem or a package
    folder's name, an installed module's own name; so one plugin submitted from two folders reads the same."""
    try:
        entries = json.loads(value) if isinstance(value, str) else value
    except ValueError:
        return value_text(value)
    if not isinstance(entries, list):
        return value_text(value)
    path = lambda e: e.endswith(".py") or "/" in e or "\\" in e  # noqa: E731  (as fedsim.plugins tells them)
    return "+".join(PurePath(e).stem if path(e) else e for e in map(str, entries)) or "none"


def _texts(column: str, values: pd.Series) -> pd.Series:
    return values.map(plugin_names if column == "config.plugins" else value_text)


def experiment_columns(df: pd.DataFrame) -> list[str]:
    """The config columns of what a run computes: all but the seed and the keys that leave it unchanged."""
    def experiment_key(col: str) -> bool:
        key = col.removeprefix("config.")
        return col.startswith("config.") and key != "seed" and not any(key == s or key.startswith(s + ".")
                                                                      for s in RESUME_SAFE)

    return [c for c in df.columns if experiment_key(c)]


@dataclass(frozen=True)
class Settings:
    """The runs to draw grouped into settings: each kept run's setting label, the labels in legend order (by the
    labelled keys' values, numbers as numbers), and whether one numeric key tells them apart (a sweep)."""

    of_run: dict[str, str]
    order: list[str]
    sweep: bool = False


def settings(df: pd.DataFrame, label: Sequence[str] | None = None,
             started: Mapping[str, float] | None = None) -> Settings:
    """Group the runs of `df` (fedsim.collect's table) into settings and label each.

    `label`: the config keys whose values make the labels (default: those that differ between settings,
    `algorithm.name` first; a method's own parameter is left out of the other methods' labels). `started`: when
    each run started, to keep the newest of runs with one config and seed (default: the later in `df`)."""
    per_run = df.drop_duplicates("run").set_index("run")
    columns = experiment_columns(per_run)
    text = pd.DataFrame({c: _texts(c, per_run[c]) for c in columns}, index=per_run.index)
    setting = text.agg("\x1f".join, axis=1) if columns else pd.Series("", index=per_run.index)
    seed = per_run["config.seed"].map(value_text) if "config.seed" in per_run else "None"
    keep = _newest(list(per_run.index), setting + "\x1f" + seed, started or {})
    text, setting = text.loc[keep], setting.loc[keep]
    differing = [c for c in columns if text[c].nunique() > 1]
    by_method = "config.algorithm.name" in differing
    keys = _label_keys(per_run, text, differing, label, by_method)
    shown = pd.DataFrame({k: _texts(k, per_run.loc[keep, k]) for k in keys}, index=keep)
    for k in keys:
        mixed = shown[k].groupby(setting).nunique()
        if (mixed > 1).any():
            runs = setting.index[setting == mixed.idxmax()]
            raise FedsimError(f"--label {k.removeprefix('config.')}: runs of one setting differ in it "
                              f"({', '.join(runs)}: {', '.join(shown.loc[runs, k])}); label by keys that tell "
                              f"settings apart: {_listed(differing)}")
    method = per_run.loc[keep, "config.algorithm.name"].map(value_text) if "config.algorithm.name" in per_run \
        else pd.Series("all runs", index=keep)
    hide = by_method and label is None  # a method's parameter missing from another method's config
    labels = _labels(keys, shown, method, hide)
    if label is None and "config.plugins" in keys and len(keys) > 1:  # the plugins, unless all that tells apart
        fewer = [k for k in keys if k != "config.plugins"]
        trial = _labels(fewer, shown, method, hide)
        if _clash(trial, setting) is None:
            keys, labels = fewer, trial
    clash = _clash(labels, setting)
    if clash is not None:
        one, two = clash
        apart = [c.removeprefix("config.") for c in differing if text.at[one, c] != text.at[two, c]]
        raise FedsimError(f"--label {' '.join(k.removeprefix('config.') for k in keys)}: runs {one} and {two} get "
                          f"one label ({labels[one]!r}) but differ in {', '.join(apart)}; add a key that tells "
                          "them apart")
    first = {lab: run for run, lab in reversed(labels.items())}
    order = sorted(first, key=lambda lab: tuple(_sort_key(per_run.at[first[lab], k]) for k in keys))
    sweep = len(keys) == 1 and len(order) > 2 and all(_sort_key(per_run.at[first[lab], keys[0]])[0] == 0
                                                       for lab in order)
    return Settings(labels, order, sweep)


def _labels(keys: list[str], shown: pd.DataFrame, method: pd.Series, hide_missing: bool) -> dict[str, str]:
    """Each run's label: `algorithm.name`'s value, then `key=value` by the keys' last parts (train.lr: lr);
    without `hide_missing`, a missing value reads None. No key, or no value left: the method's name."""
    names = dict(zip(keys, _short_names([k.removeprefix("config.") for k in keys])))

    def part(key: str, value: str) -> str:
        if value == "None" and hide_missing and key.startswith("config.algorithm."):
            return ""
        return value if key == "config.algorithm.name" else f"{names[key]}={value}"

    return {run: ", ".join(p for p in (part(k, str(shown.at[run, k])) for k in keys) if p) or method[run]
            for run in shown.index}


def _clash(labels: dict[str, str], setting: pd.Series) -> tuple[str, str] | None:
    """Two runs of different settings that got one label, or None."""
    first: dict[str, str] = {}
    for run, lab in labels.items():
        other = first.setdefault(lab, run)
        if setting[other] != setting[run]:
            return other, run
    return None


def _newest(runs: list[str], identity: pd.Series, started: Mapping[str, float]) -> list[str]:
    """The newest of the `runs` that share an identity (config and seed), by `started`, the later in `runs` on a
    tie; the others are named in one DuplicateRuns warning."""
    import warnings

    newest: dict[str, str] = {}
    for run in sorted(runs, key=lambda r: started.get(r, 0.0)):  # stable: later runs overwrite earlier ones
        newest[identity[run]] = run
    dropped = [r for r in runs if newest[identity[r]] != r]
    if dropped:
        warnings.warn(f"plot left out {len(dropped)} run(s) with the config and seed of a newer one: "
                      + "; ".join(f"{r} (kept {newest[identity[r]]})" for r in dropped), DuplicateRuns,
                      stacklevel=3)
    return [r for r in runs if newest[identity[r]] == r]


def _label_keys(per_run: pd.DataFrame, text: pd.DataFrame, differing: list[str], label: Sequence[str] | None,
                by_method: bool) -> list[str]:
    """The config columns a label shows: `label`'s (checked), else the differing ones, `algorithm.name` first;
    when methods are compared, a method's own parameter only where it takes two values among the runs that have
    it."""
    if label is not None:
        keys = list(dict.fromkeys(k if k.startswith("config.") else f"config.{k}" for k in label))
        for k in keys:
            if k not in per_run:
                raise FedsimError(f"--label {k.removeprefix('config.')}: not a config key of these runs; the keys "
                                  f"that differ between them: {_listed(differing)}")
        return keys

    def shown(c: str) -> bool:
        return not (by_method and c.startswith("config.algorithm.")) or text[c][text[c] != "None"].nunique() > 1

    return sorted((c for c in differing if shown(c)), key=lambda c: c != "config.algorithm.name")


def _listed(columns: list[str]) -> str:
    return ", ".join(c.removeprefix("config.") for c in columns) or "none (the runs differ in seed alone)"


def _short_names(keys: list[str]) -> list[str]:
    """Each dotted key by its last part (train.lr: lr), with as many parts before it as it takes to stay apart."""
    depth = [1] * len(keys)
    while True:
        names = [".".join(k.split(".")[-d:]) for k, d in zip(keys, depth)]
        grow = [i for i, n in enumerate(names) if names.count(n) > 1 and depth[i] < len(keys[i].split("."))]
        if not grow:
            return names
        for i in grow:
            depth[i] += 1


def _sort_key(value: Any) -> tuple[int, float, str]:
    if isinstance(value, numbers.Real) and not isinstance(value, bool) and not math.isnan(value):
        return (0, float(value), "")
    return (1, 0.0, value_text(value))


def curves(df: pd.DataFrame, x: str = "round", y: str = "accuracy", groups: Settings | None = None) -> pd.DataFrame:
    """What a panel draws: one row per setting, model and round with the mean of `x` and of `y` over the setting's
    runs, `y`'s standard deviation (ddof 0) and how many runs the point averages. Bytes on the x axis are the
    run's total so far. `groups`: the settings (default: `settings(df)`)."""
    _check_metric(df, "x", x)
    _check_metric(df, "metric", y)
    groups = groups or settings(df)
    df = df[df["run"].isin(groups.of_run)]
    xs = df[x]
    if x in CUMULATIVE:  # a round's bytes repeat on each model's row: summed once per round
        per_round = df.drop_duplicates(["run", "round"]).sort_values("round", kind="stable")
        total = per_round[x].fillna(0).groupby(per_round["run"]).cumsum()
        xs = df.merge(per_round[["run", "round"]].assign(total=total), on=["run", "round"], how="left")["total"]
        xs.index = df.index
    rows = df.assign(_x=xs).dropna(subset=["_x", y])
    if model_metric(y):
        rows = rows[rows["model"].astype(str) != ""] if "model" in rows else rows
    else:  # round-level metrics: every model's row of a round repeats them
        rows = rows.drop_duplicates(["run", "round"]).assign(model="")
    if "model" not in rows:  # a table from elsewhere without it: one model per run
        rows = rows.assign(model="")
    if rows.empty:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    data = pd.DataFrame({"setting": rows["run"].map(groups.of_run), "model": rows["model"].astype(str),
                         "round": rows["round"], "x": rows["_x"].astype(float), "y": rows[y].astype(float),
                         "run": rows["run"]})
    grouped = data.groupby(["setting", "model", "round"], sort=False)
    out = grouped.agg(x=("x", "mean"), y=("y", "mean"), y_std=("y", lambda v: float(v.std(ddof=0))),
                      runs=("run", "nunique")).reset_index()
    rank = out["setting"].map({s: i for i, s in enumerate(groups.order)})
    out = out.assign(_rank=rank).sort_values(["_rank", "model", "round"], kind="stable")
    return out.reset_index(drop=True)[CURVE_COLUMNS]


def started_at(run: Location) -> float:
    """When a run started: the time its config was written (checkpoints/config.yaml, which fedsim never rewrites,
    else config.yaml); 0 for a run in a store, where the later named counts as the newer."""
    for config in (run / "checkpoints" / "config.yaml", run / "config.yaml"):
        if isinstance(config, Path) and config.is_file():
            return config.stat().st_mtime
    return 0.0


def default_out(runs: Sequence[Any], x: str, metrics: Sequence[str]) -> Any:
    """RUN/<metrics>.png for one local run (accuracy.png by default), else the same name in the runs' common folder;
    in the current folder for runs kept in a store (a figure is the reader's, never written into a bucket: one
    store run's is <run>-<metrics>.png) or with no common folder but the root."""
    name = "-".join(metrics) + ("" if x == "round" else f"-vs-{x}")
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", name) + ".png"
    if len(runs) == 1:
        return runs[0] / name if isinstance(runs[0], Path) else Path(f"{runs[0].name}-{name}")
    if all(isinstance(p, Path) for p in runs):
        import os

        common = Path(os.path.commonpath([p.resolve() for p in runs]))
        if common != Path(common.anchor):  # runs in different trees share only "/": the current folder instead
            return common / name
    return Path(name)


def plot_runs(paths: str | Path | Iterable[str | Path], x: str = "round", metrics: str | Sequence[str] = "accuracy",
              out: str | Path | None = None, label: Sequence[str] | None = None, title: str | None = None,
              logx: bool = False) -> Path:
    """Draw each of `metrics` against `x` (round, virtual_time, bytes_up or bytes_down) for the runs `paths` names
    (folders, folders of runs, globs; unfinished runs too, as far as they got): a panel per metric, a curve per
    setting and model with a ± std band over seeds, labelled by the config keys `label` names (default: those
    that differ), on a logarithmic x axis with `logx` (bytes of compressed and float32 runs side by side); returns
    the PNG's path.

    Folders without a readable table are skipped with a SkippedRuns warning (fedsim.collect), runs with another's
    config and seed with a DuplicateRuns one; none left is a one-line error."""
    import warnings

    from fedsim.results.tables import SkippedRuns, collect, find_runs, path_items, run_names

    items = path_items(paths)
    metrics = [metrics] if isinstance(metrics, str) else list(_strings(metrics, "--metric"))
    label = None if label is None else _strings(label, "--label")
    if not metrics:
        raise FedsimError("--metric: name at least one column")
    if len(set(metrics)) < len(metrics):
        raise FedsimError(f"--metric {' '.join(metrics)}: a metric named twice")
    check_title_out(title, out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = collect(items, incomplete=True)
    skipped: list[str] = df.attrs.get("skipped", [])
    if df.empty:
        raise CheckpointError("no run to plot" + (f": {'; '.join(skipped)}" if skipped else ""))
    if skipped:
        warnings.warn(f"plot skipped {len(skipped)} folder(s): " + "; ".join(skipped), SkippedRuns,
                      stacklevel=2)
    for name in (x, *metrics):
        _check_metric(df, "x" if name == x else "metric", name)
    runs = find_runs(items)[0]
    groups = settings(df, label, {name: started_at(run) for run, name in zip(runs, run_names(runs))})
    panels = {y: curves(df, x, y, groups) for y in metrics}
    if all(data.empty for data in panels.values()):
        raise CheckpointError(f"{', '.join(sorted(df['run'].unique()))}: no rounds with both {x} and "
                              f"{' or '.join(metrics)} to plot")
    from fedsim.persist.io import atomic_write

    target = Path(out) if out else default_out(runs, x, metrics)  # a folder, or a run's (a Path or a store's path)
    if title is None:
        title = runs[0].name if len(runs) == 1 else f"{df['run'].nunique()} runs"
    fig = figure(panels, x, title, groups, logx)
    try:
        atomic_write(target, lambda tmp: fig.savefig(tmp, dpi=150, bbox_inches="tight", format="png"))
    except OSError as exc:  # a folder that refuses new files (read-only, /proc, full): nothing was written
        raise FedsimError(f"{'--out ' if out else ''}{target}: cannot write the plot there "
                          f"({exc.strerror or type(exc).__name__})") from None
    return target


def _strings(values: Any, flag: str) -> list[str]:
    if isinstance(values, str) or not isinstance(values, Iterable):
        raise FedsimError(f"{flag}: expected a list of names, got {type(values).__name__} {str(values)[:60]!r}")
    values = list(values)
    if not all(isinstance(v, str) and v for v in values):
        raise FedsimError(f"{flag}: expected names, got {values!r}"[:200])
    return values


def check_title_out(title: Any, out: Any) -> None:
    """A plot's title (text) and PNG path (a writable .png) as given from Python or the CLI; a one-line error else."""
    if title is not None and not isinstance(title, str):
        raise FedsimError(f"title: expected text, got {type(title).__name__}")
    if out is not None:
        if not isinstance(out, (str, Path)):
            raise FedsimError(f"out: expected the path of a .png file, got {type(out).__name__} {str(out)[:60]!r}")
        check_out(Path(out))


def check_out(out: Path) -> None:
    """A PNG path that may be written: its folder exists, and it is new or a PNG already (a re-plot), so no table,
    config or device file of the same name is ever replaced."""
    if out.suffix.lower() != ".png":
        raise FedsimError(f"--out {out}: name a .png file")
    if not out.parent.is_dir():
        raise FedsimError(f"--out {out}: its folder {out.parent} does not exist")
    if out.exists() or out.is_symlink():
        if not out.is_file() or out.is_symlink():
            raise FedsimError(f"--out {out}: exists and is not a plain file; not replaced")
        with out.open("rb") as f:
            if f.read(8) != b"\x89PNG\r\n\x1a\n":
                raise FedsimError(f"--out {out}: exists and is not a PNG; not replaced")


def figure(panels: Mapping[str, pd.DataFrame], x: str = "round", title: str | None = None,
           groups: Settings | None = None, logx: bool = False) -> Figure:
    """The figure of `curves(...)`'s rows, a panel per metric (up to three in a row): a line per setting (its
    color) and model (its dash), its ± std band where it averages seeds, and one legend to the right of the
    panels, the figure widened to hold it; a sweep's settings take colors along a colormap."""
    import matplotlib
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D
    from matplotlib.ticker import EngFormatter, MaxNLocator

    order = groups.order if groups else list(dict.fromkeys(s for d in panels.values() for s in d["setting"]))
    if groups and groups.sweep:
        cmap = matplotlib.colormaps["viridis"]
        colors = [cmap(0.9 * i / (len(order) - 1)) for i in range(len(order))]
    else:
        cycle = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
        colors = [cycle[i % len(cycle)] for i in range(len(order))]
    color = dict(zip(order, colors))
    models = list(dict.fromkeys(m for d in panels.values() for m in d["model"] if m))
    dash: dict[str, Any] = {m: ("-", "--", ":", "-.")[i % 4] for i, m in enumerate(models)} | {"": "-"}
    cols = min(len(panels), 3)
    rows = -(-len(panels) // cols)
    fig = Figure(figsize=(PANEL_INCHES[0] * cols, PANEL_INCHES[1] * rows), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False).ravel()
    seeds: dict[str, int] = {}
    for ax, (metric, data) in zip(axes, panels.items()):
        for (name, model), g in data.groupby(["setting", "model"], sort=False):
            setting, runs = str(name), int(g["runs"].max())
            seeds[setting] = max(seeds.get(setting, 0), runs)
            ax.plot(g["x"], g["y"], color=color[setting], linestyle=dash[str(model)],
                    marker="." if len(g) <= 30 else None)
            if runs > 1:
                ax.fill_between(g["x"], g["y"] - g["y_std"], g["y"] + g["y_std"], color=color[setting], alpha=0.2,
                                linewidth=0)
        for axis, name in ((ax.xaxis, x), (ax.yaxis, metric)):
            if name == "round":
                axis.set_major_locator(MaxNLocator(integer=True))
            if name.startswith("bytes_"):  # 2 MB, not 0.2 and a 1e7 at the end of the axis
                axis.set_major_formatter(EngFormatter(unit="B"))
        if logx:
            ax.set_xscale("log")
        ax.set_xlabel(X_AXES.get(x, x))
        ax.set_ylabel(metric if metric != "round" else X_AXES["round"])
        ax.grid(alpha=0.3)
    for ax in axes[len(panels):]:
        fig.delaxes(ax)
    handles = [Line2D([], [], color=color[s], label=s + (f" ({seeds[s]} seeds)" if seeds[s] > 1 else ""))
               for s in order if s in seeds]
    if len(models) > 1:
        handles += [Line2D([], [], color="0.3", linestyle=dash[m], label=m) for m in models]
    if handles:
        legend = fig.legend(handles=handles, loc="outside right upper", fontsize="small",
                            ncols=1 + (len(handles) - 1) // 20)
        fig.draw_without_rendering()
        width = legend.get_window_extent().width / fig.dpi
        fig.set_size_inches(PANEL_INCHES[0] * cols + width + 0.2, PANEL_INCHES[1] * rows)
    if title:  # centred over the panels, not the figure, and wrapped to their width: the legend keeps its corner
        fig.draw_without_rendering()
        boxes = [ax.get_position() for ax in axes[:len(panels)]]
        x0, x1 = min(b.x0 for b in boxes), max(b.x1 for b in boxes)
        text = fig.suptitle(title, x=(x0 + x1) / 2)
        fig.draw_without_rendering()
        span, width = (x1 - x0) * fig.bbox.width, text.get_window_extent().width
        if width > span:
            text.set_text("\n".join(textwrap.wrap(title, max(10, int(len(title) * span / width)))))
    return fig


def plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Accuracy vs round of one run, one line per global model, as PNG next to the tables by default
    (fedsim.results.plots.plot_runs draws many runs, any metric)."""
    return plot_runs([path], out=out)
