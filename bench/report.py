"""The bench reports' common part: every system on every prepared workload, repeated; medians; markdown tables."""

from __future__ import annotations

import os
import platform
import shlex
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd

from bench.common import BenchError, Workload
from bench.prepare import DEFAULT_CACHE, prepare
from bench.runner import REPO, flower_python, load_average, run_program

OUT = REPO / "results" / "bench"
COLUMNS = ["config", "system", "repeat", "status", "N", "K", "R", "model", "total_seconds", "startup_seconds",
           "seconds_per_round", "round_seconds", "peak_rss_mb", "final_accuracy", "load_before", "log"]
SYSTEMS = ("plain", "plain_t1", "fedsim", "fedsim_1w", "flower", "flower_2c")


def commands(system: str, folder: Path, fedsim_args: list[str]) -> list[str]:
    """The command line of one system on one prepared workload (run from the repository root)."""
    work = ["--workload", str(folder)]
    if system == "plain":
        return [sys.executable, "-m", "bench.plain_fedavg", *work, "--threads", "2"]
    if system == "plain_t1":
        return [sys.executable, "-m", "bench.plain_fedavg", *work, "--threads", "1"]
    if system == "flower":
        return [str(flower_python()), "-m", "bench.flower_fedavg", *work, "--client-cpus", "1"]
    if system == "fedsim":  # the default runtime: one single-thread worker per CPU (2 here)
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, *fedsim_args]
    if system == "fedsim_1w":  # one worker with both CPUs, as the plain loop uses them
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--client-cpus", "2", "-o", "runtime.threads=2",
                *fedsim_args]
    if system == "flower_2c":  # Flower with one actor of 2 CPUs
        return [str(flower_python()), "-m", "bench.flower_fedavg", *work, "--client-cpus", "2"]
    raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def run_matrix(workloads: dict[str, Workload], systems: list[str], repeat: int, fedsim_args: list[str], tag: str,
               timeout: float = 1800, log: Callable[[str], None] = print,
               cache: str | Path = DEFAULT_CACHE) -> pd.DataFrame:
    """Every system on every workload, `repeat` times, interleaved so machine noise hits all of them alike.

    Every workload is prepared (data, partition, draws, initial weights) before the first timed run.
    """
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"--systems: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    folders = {name: prepare(w, cache, log) for name, w in workloads.items()}
    if any(s.startswith("flower") for s in systems):
        flower_python(log)
    rows = []
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for rep in range(repeat):
        for name in workloads:
            for system in systems:
                cmd = commands(system, folders[name], fedsim_args)
                log_path = OUT / "logs" / f"{tag}-{stamp}-{name}-{system}-{rep}.log"
                load = load_average()
                log(f"[{tag}] {name} {system} (repeat {rep + 1}/{repeat}, load {load:.1f}) ...")
                res = run_program(cmd + ["--tag", f"{name}_{system}_{rep}"], log_path, timeout, REPO)
                row = {**res, "config": name, "system": system, "repeat": rep, "load_before": round(load, 2)}
                rows.append(row)
                log(f"[{tag}] {name} {system}: {res['status']}, total {res.get('total_seconds')} s, "
                    f"{res.get('seconds_per_round')} s/round, peak RSS {res.get('peak_rss_mb')} MB, "
                    f"acc {res.get('final_accuracy')}")
    df = pd.DataFrame(rows)
    return df[[c for c in COLUMNS if c in df] + [c for c in df if c not in COLUMNS]]


def medians(df: pd.DataFrame) -> pd.DataFrame:
    """Median over repeats of the successful runs, one row per (config, system)."""
    ok = df[df["status"] == "ok"]
    keys = ["total_seconds", "startup_seconds", "seconds_per_round", "peak_rss_mb", "final_accuracy"]
    return ok.groupby(["config", "system"], sort=False)[[k for k in keys if k in ok]].median()


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def header(title: str, argv: list[str]) -> list[str]:
    """Title, the command, the machine and when."""
    cmd = "python -m " + " ".join(shlex.quote(a) for a in argv)
    return [f"# {title}", "", f"Command: `{cmd}`  ", f"Measured {datetime.now():%Y-%m-%d %H:%M} on {platform.node()}: "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}; 1-min load average at the start of "
            "each run in the `load` column of the CSV.", ""]


def write(df: pd.DataFrame, lines: list[str], stem: str) -> tuple[Path, Path]:
    """results/bench/<stem>.csv (every run) and <stem>.md (the tables)."""
    OUT.mkdir(parents=True, exist_ok=True)
    csv, md = OUT / f"{stem}.csv", OUT / f"{stem}.md"
    flat = df.copy()
    for col in flat:
        if flat[col].map(lambda v: isinstance(v, (list, dict))).any():
            flat[col] = flat[col].map(str)
    flat.to_csv(csv, index=False)
    md.write_text("\n".join(lines) + "\n")
    return csv, md


def failed_runs(df) -> list[str]:
    """A closing line naming every run that did not finish, with its log (empty when all did)."""
    bad = df[df["status"] != "ok"]
    if not len(bad):
        return []
    return ["", "Failed runs: " + "; ".join(f"{r.config} {r.system}: {r.status} ({r.log})" for r in bad.itertuples())]
