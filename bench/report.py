"""Shared bits of the bench reports: repeated runs of several systems, medians, ratio tables in markdown."""

from __future__ import annotations

import os
import platform
import shlex
import sys
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd

from bench.peer import REPO, fl_common, flower_python, load_average, peer_dir, run_program

OUT = REPO / "results" / "bench"
COLUMNS = ["config", "system", "repeat", "status", "N", "K", "R", "model", "total_seconds", "startup_seconds",
           "seconds_per_round", "round_seconds", "peak_rss_mb", "final_accuracy", "load_before", "log"]


def commands(system: str, args: list[str], fedsim_args: list[str]) -> tuple[list[str], Path]:
    """The command line and working folder of one system on one workload."""
    peer = peer_dir()
    if system == "plain":
        return [sys.executable, str(peer / "plain_fedavg.py"), *args, "--threads", "2"], peer
    if system == "plain_t1":
        return [sys.executable, str(peer / "plain_fedavg.py"), *args, "--threads", "1"], peer
    if system == "flower":
        return [str(flower_python()), str(peer / "flower_fedavg.py"), *args, "--client-cpus", "1"], peer
    if system == "fedsim":  # the default runtime: one single-thread worker per CPU (2 here)
        return [sys.executable, "-m", "bench.fedsim_fedavg", *args, *fedsim_args], REPO
    if system == "fedsim_1w":  # one worker with both CPUs, as the plain loop uses them
        return [sys.executable, "-m", "bench.fedsim_fedavg", *args, "--client-cpus", "2", "-o", "runtime.threads=2",
                *fedsim_args], REPO
    if system == "flower_2c":  # Flower with one actor of 2 CPUs (the harness's other setting)
        return [str(flower_python()), str(peer / "flower_fedavg.py"), *args, "--client-cpus", "2"], peer
    raise ValueError(f"unknown system {system!r}; choose plain, plain_t1, fedsim, fedsim_1w, flower or flower_2c")


def run_matrix(workloads: dict, systems: list[str], repeat: int, fedsim_args: list[str], tag: str,
               timeout: float = 1800, log: Callable[[str], None] = print) -> pd.DataFrame:
    """Every system on every workload, `repeat` times, interleaved so machine noise hits all of them alike."""
    common = fl_common()
    common.generate_synthetic()  # the data is made once, before any timed run
    if any(s.startswith("flower") for s in systems):
        flower_python(log)
    rows = []
    stamp = datetime.now().strftime("%Y%m%d-%H%M%S")
    for rep in range(repeat):
        for name, w in workloads.items():
            for system in systems:
                cmd, cwd = commands(system, w.peer_args(), fedsim_args)
                log_path = OUT / "logs" / f"{tag}-{stamp}-{name}-{system}-{rep}.log"
                load = load_average()
                log(f"[{tag}] {name} {system} (repeat {rep + 1}/{repeat}, load {load:.1f}) ...")
                res = run_program(cmd + ["--tag", f"{name}_{system}_{rep}"], log_path, timeout, cwd)
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


def now() -> float:
    return time.perf_counter()


def failed_runs(df) -> list[str]:
    """A closing line naming every run that did not finish, with its log (empty when all did)."""
    bad = df[df["status"] != "ok"]
    if not len(bad):
        return []
    return ["", "Failed runs: " + "; ".join(f"{r.config} {r.system}: {r.status} ({r.log})" for r in bad.itertuples())]
