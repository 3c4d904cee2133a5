"""Curves of many runs on one figure: any two numeric columns of rounds.parquet, mean ± std over seeds.

Runs whose configs differ only in `seed` (and in keys that do not change the experiment: name, rounds,
results, runtime, eval, tracking, where the data lives) are one setting: its curve is the mean over its runs at
each round, the band ± their standard deviation (population, as in the sweep tables). A metric of each global
model (accuracy, loss, ...) gives one curve per setting and model. `round` is the tables' own numbering
(0 is the first round), here as in `fedsim results show`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pandas as pd

from fedsim.config.schema import RESUME_SAFE
from fedsim.errors import CheckpointError, FedsimError
from fedsim.results.tables import model_metric

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CURVE_COLUMNS = ["setting", "model", "round", "x", "y", "y_std", "runs"]


def metric_columns(df: pd.DataFrame) -> list[str]:
    """The numeric columns of a rounds table (as `fedsim.collect` returns it) that can go on an axis."""
    return [c for c in df.columns if c not in ("run", "model") and not c.startswith("config.")
            and pd.api.types.is_numeric_dtype(df[c]) and not pd.api.types.is_bool_dtype(df[c])]


def _check_metric(df: pd.DataFrame, axis: str, name: str) -> None:
    available = metric_columns(df)
    if name not in available:
        raise FedsimError(f"--{axis} {name}: not a numeric column of these runs' rounds tables; available: "
                          f"{', '.join(available)}")


def setting_columns(df: pd.DataFrame) -> list[str]:
    """The config columns that tell settings apart: those whose value differs between runs, except the seed and
    the keys that leave the experiment unchanged."""
    def experiment_key(col: str) -> bool:
        key = col.removeprefix("config.")
        return col.startswith("config.") and key != "seed" and not any(key == s or key.startswith(s + ".")
                                                                      for s in RESUME_SAFE)

    per_run = df.drop_duplicates("run")
    return [c for c in df.columns if experiment_key(c) and as_text(per_run[c]).nunique() > 1]


def as_text(values: pd.Series) -> pd.Series:
    """Each value as the text a setting's label shows; a missing one (a null in the config, or a key that run's
    config lacks) as "None", so that it is a setting of its own rather than no value at all."""
    return values.map(lambda v: "None" if v is None or v is pd.NA or (isinstance(v, float) and v != v) else str(v))


def curves(df: pd.DataFrame, x: str = "round", y: str = "accuracy") -> pd.DataFrame:
    """What `plot_runs` draws: one row per setting, model and round with the mean of `x` and of `y` over the
    setting's runs, `y`'s standard deviation (ddof 0) and how many runs the point averages."""
    _check_metric(df, "x", x)
    _check_metric(df, "y", y)
    keys = setting_columns(df)
    rows = df.dropna(subset=list({x, y}))
    if model_metric(x) or model_metric(y):
        rows = rows[rows["model"].astype(str) != ""] if "model" in rows else rows
    else:  # round-level metrics: every model's row of a round repeats them
        rows = rows.drop_duplicates(["run", "round"]).assign(model="")
    if "model" not in rows:  # a table from elsewhere without it: one model per run
        rows = rows.assign(model="")
    if rows.empty:
        return pd.DataFrame(columns=CURVE_COLUMNS)
    label = pd.Series("", index=rows.index)
    for k in keys:
        label += ("" if k == keys[0] else ", ") + f"{k.removeprefix('config.')}=" + as_text(rows[k])
    data = pd.DataFrame({"setting": label, "model": rows["model"].astype(str), "round": rows["round"],
                         "x": rows[x].astype(float), "y": rows[y].astype(float), "run": rows["run"]})
    grouped = data.groupby(["setting", "model", "round"], sort=False)
    out = grouped.agg(x=("x", "mean"), y=("y", "mean"), y_std=("y", lambda v: float(v.std(ddof=0))),
                      runs=("run", "nunique")).reset_index()
    return out.sort_values(["setting", "model", "round"], kind="stable").reset_index(drop=True)[CURVE_COLUMNS]


def default_out(runs: Sequence[Any], x: str, y: str) -> Any:
    """RUN/<y>.png for one run (accuracy.png by default), else the same name in the runs' common folder (in the
    current folder for runs kept in a store, or with no common folder but the root)."""
    name = re.sub(r"[^A-Za-z0-9_.-]", "_", y if x == "round" else f"{y}-vs-{x}") + ".png"
    if len(runs) == 1:
        return runs[0] / name
    if all(isinstance(p, Path) for p in runs):
        import os

        common = Path(os.path.commonpath([p.resolve() for p in runs]))
        if common != Path(common.anchor):  # runs in different trees share only "/": the current folder instead
            return common / name
    return Path(name)


def plot_runs(paths: str | Path | Iterable[str | Path], x: str = "round", y: str = "accuracy",
              out: str | Path | None = None) -> Path:
    """Draw `y` against `x` for the runs `paths` names (folders, folders of runs, globs; unfinished runs too, as
    far as they got), one curve per setting and model with a ± std band over seeds; returns the PNG's path.

    Folders without a readable table are skipped with a warning (fedsim.collect); none left is a one-line error."""
    import warnings

    from fedsim.results.tables import SkippedRuns, collect, find_runs, path_items

    items = path_items(paths)
    if out is not None:
        if not isinstance(out, (str, Path)):
            raise FedsimError(f"out: expected the path of a .png file, got {type(out).__name__} {str(out)[:60]!r}")
        check_out(Path(out))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        df = collect(items, incomplete=True)
    skipped: list[str] = df.attrs.get("skipped", [])
    if df.empty:
        raise CheckpointError("no run to plot" + (f": {'; '.join(skipped)}" if skipped else ""))
    if skipped:
        warnings.warn(f"plot skipped {len(skipped)} folder(s): " + "; ".join(skipped), SkippedRuns,
                      stacklevel=2)
    data = curves(df, x, y)
    if data.empty:
        raise CheckpointError(f"{', '.join(sorted(df['run'].unique()))}: no rounds with both {x} and {y} to plot")
    import matplotlib.pyplot as plt

    from fedsim.persist.io import atomic_write

    runs = find_runs(items)[0]
    target = Path(out) if out else default_out(runs, x, y)  # a folder, or a run's (a Path or a store's path)
    fig = figure(data, x, y, runs[0].name if len(runs) == 1 else f"{df['run'].nunique()} runs")
    try:
        atomic_write(target, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"))
    except OSError as exc:  # a folder that refuses new files (read-only, /proc, full): nothing was written
        raise FedsimError(f"{'--out ' if out else ''}{target}: cannot write the plot there "
                          f"({exc.strerror or type(exc).__name__})") from None
    finally:
        plt.close(fig)
    return target


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


def figure(data: pd.DataFrame, x: str, y: str, title: str) -> Figure:
    """The figure of `curves(...)`'s rows: a line per setting and model, its ± std band when it averages seeds."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for (setting, model), g in data.groupby(["setting", "model"], sort=False):
        parts = [p for p in (str(setting), str(model)) if p]
        runs = int(g["runs"].max())
        label = " · ".join(parts) or y
        label += f" ({runs} runs)" if runs > 1 else ""
        line, = ax.plot(g["x"], g["y"], marker=".", label=label)
        if runs > 1:
            ax.fill_between(g["x"], g["y"] - g["y_std"], g["y"] + g["y_std"], color=line.get_color(), alpha=0.2,
                            linewidth=0)
    for axis, name in ((ax.xaxis, x), (ax.yaxis, y)):
        if name == "round":
            axis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel(x if x != "round" else "round (0 = first)")
    ax.set_ylabel(y if y != "round" else "round (0 = first)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small")
    return fig


def plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Accuracy vs round of one run, one line per global model, as PNG next to the tables by default
    (fedsim.results.plots.plot_runs draws many runs, any metric)."""
    return plot_runs([path], out=out)
