"""The bench reports' common part: every system on every prepared workload, repeated; medians; markdown tables; the
speed summary `results/bench/fedavg.json` and the table rendered from it.

    python -m bench.report [results/bench/fedavg.json]   # prints the speed table docs/performance.md shows
"""

from __future__ import annotations

import json
import math
import os
import platform
import re
import shlex
import sys
from collections.abc import Callable
from datetime import datetime
from pathlib import Path

import pandas as pd

from bench.cli import OneLineParser
from bench.measure import BenchError, Workload  # not bench.common: rendering a summary needs no torch
from bench.runner import (
    FLOWER_VENV,
    PFL_VENV,
    REPO,
    drop_cached_libraries,
    flower_python,
    load_average,
    out_of_range,
    package_version,
    pfl_python,
    run_program,
    unwritable,
)
from fedsim.config.limits import MAX_ROUNDS, MAX_SECONDS
from jobs.readme_blocks import doc_pages

OUT = REPO / "results" / "bench"
COLUMNS = ["config", "system", "repeat", "status", "N", "K", "R", "model", "total_seconds", "startup_seconds",
           "seconds_per_round", "round_seconds", "peak_rss_mb", "final_accuracy", "load_before", "log"]
SYSTEMS = ("plain", "plain_t1", "fedsim", "fedsim_ray", "fedsim_local", "fedsim_dp", "fedsim_fedadam", "fedsim_1w",
           "flower", "flower_2c", "pfl", "pfl_multiprocess", "ray_floor")
MAX_REPEAT = 1000  # interleaved repeats of a whole matrix: each takes minutes, so far above any real bench
STEM = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")  # a plain file name in results/bench: no folder, not hidden


def check_run_args(repeat: int, rounds: int | None, timeout: float, stem: str, suffixes: list[str]) -> None:
    """The knobs shared by the matrix programs (fedavg_bench, scale_bench) and every file they write, checked
    before anything is prepared or run: a bad --stem or output folder would otherwise fail after the whole matrix.
    (bench.prepare checks --cache before it writes there.)"""
    problems = [out_of_range("--repeat", repeat, 1, MAX_REPEAT),
                None if rounds is None else out_of_range("--rounds", rounds, 1, MAX_ROUNDS)]
    if not 0 < timeout <= MAX_SECONDS:  # NaN too
        problems.append(f"--timeout: must be a number of seconds above 0 and at most {MAX_SECONDS:g}, got {timeout:g}")
    if not STEM.fullmatch(stem):
        problems.append(f"--stem: {stem[:60]!r} is not a plain file name (up to 100 letters, digits, '.', '_' and "
                        "'-', starting with a letter or digit)")
    for problem in problems:
        if problem:
            raise BenchError(problem)
    places = [(OUT / f"{stem}{s}", False) for s in suffixes] + [(OUT / "logs", True)]
    for path, folder in places:
        problem = unwritable(path, folder)
        if problem:
            raise BenchError(problem)


def all_failed(df: pd.DataFrame) -> str | None:
    """The one line saying that no run finished (where their logs are), or None when one did."""
    if (df["status"] == "ok").any():
        return None
    return f"every run failed ({len(df)} of {len(df)}); nothing written; their logs are in {OUT / 'logs'}"


def commands(system: str, folder: Path, fedsim_args: list[str]) -> list[str]:
    """The command line of one system on one prepared workload (run from the repository root)."""
    work = ["--workload", str(folder)]
    if system == "plain":
        return [sys.executable, "-m", "bench.plain_fedavg", *work, "--threads", "2"]
    if system == "plain_t1":
        return [sys.executable, "-m", "bench.plain_fedavg", *work, "--threads", "1"]
    if system == "flower":
        return [str(flower_python()), "-m", "bench.flower_fedavg", *work, "--client-cpus", "1"]
    if system in ("fedsim", "fedsim_ray"):  # the default runtime: one single-thread Ray worker per CPU (2 here)
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--backend", "ray", *fedsim_args]
    if system == "fedsim_local":  # one in-process worker with both CPUs' threads, as the plain loop and pfl use them
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--backend", "local", "-o", "runtime.threads=2",
                *fedsim_args]
    if system == "fedsim_dp":  # fedsim_local with client-level DP-FedAvg: clipping, noise, the RDP accountant
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--backend", "local", "-o", "runtime.threads=2",
                "-o", "algorithm.weighting=uniform", "-o", "privacy.level=client", "-o", "privacy.noise_multiplier=1",
                "-o", "privacy.clip=1", "-o", "privacy.accountant=rdp", *fedsim_args]
    if system == "fedsim_fedadam":  # fedsim_local with FedAdam's server step (float64 m, v, and the step itself)
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--backend", "local", "-o", "runtime.threads=2",
                "-o", "algorithm.name=fedadam", *fedsim_args]
    if system == "fedsim_1w":  # one worker with both CPUs, as the plain loop uses them
        return [sys.executable, "-m", "bench.fedsim_fedavg", *work, "--client-cpus", "2", "-o", "runtime.threads=2",
                *fedsim_args]
    if system == "flower_2c":  # Flower with one actor of 2 CPUs
        return [str(flower_python()), "-m", "bench.flower_fedavg", *work, "--client-cpus", "2"]
    if system == "pfl":  # one process, both CPUs' threads
        return [str(pfl_python()), "-m", "bench.pfl_fedavg", *work, "--processes", "1", "--threads", "2"]
    if system == "pfl_multiprocess":  # two torchrun workers, one thread each
        return [str(pfl_python()), "-m", "bench.pfl_fedavg", *work, "--processes", "2", "--threads", "1"]
    if system == "ray_floor":  # Ray's own start and stop with two torch actors, no fedsim (the workload is unused)
        return [sys.executable, "-m", "bench.ray_floor", "--workers", "2"]
    raise ValueError(f"unknown system {system!r}; choose one of {', '.join(SYSTEMS)}")


def run_matrix(workloads: dict[str, Workload], systems: list[str], repeat: int, fedsim_args: list[str], tag: str,
               timeout: float = 1800, log: Callable[[str], None] = print,
               cache: str | Path | None = None) -> pd.DataFrame:
    """Every system on every workload, `repeat` times, interleaved so machine noise hits all of them alike.

    Every workload is prepared (data, partition, draws, initial weights; under `cache`, by default bench.prepare's
    DEFAULT_CACHE) before the first timed run.
    """
    from bench.prepare import DEFAULT_CACHE, prepare

    cache = DEFAULT_CACHE if cache is None else cache
    unknown = [s for s in systems if s not in SYSTEMS]
    if unknown:
        raise BenchError(f"--systems: unknown system {unknown[0]!r}; choose from {', '.join(SYSTEMS)}")
    folders = {name: prepare(w, cache, log) for name, w in workloads.items()}
    if any(s.startswith("flower") for s in systems):
        flower_python(log)
    if any(s.startswith("pfl") for s in systems):
        pfl_python(log)
    drop_cached_libraries([Path(sys.prefix), FLOWER_VENV, PFL_VENV], log)
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
    keys = ["total_seconds", "startup_seconds", "shutdown_seconds", "seconds_per_round", "peak_rss_mb",
            "final_accuracy"]
    return ok.groupby(["config", "system"], sort=False)[[k for k in keys if k in ok]].median()


def fmt(x: float | None, nd: int = 2) -> str:
    return "n/a" if x is None or x != x else f"{x:.{nd}f}"


def header(title: str, argv: list[str]) -> list[str]:
    """Title, the command, the machine and when."""
    cmd = "python -m " + " ".join(shlex.quote(a) for a in argv)
    return [f"# {title}", "", f"Command: `{cmd}`  ", f"Measured {datetime.now():%Y-%m-%d %H:%M} on {platform.node()}: "
            f"{os.cpu_count()} CPUs, Python {platform.python_version()}; 1-min load average at the start of "
            "each run in the `load_before` column of the CSV.", ""]


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


# ---------------------------------------------------------------------------------------------------------
# results/bench/fedavg.json and the table rendered from it
# ---------------------------------------------------------------------------------------------------------

SUMMARY_FIELDS = ("s_per_round", "total_s", "startup_s", "shutdown_s", "peak_rss_mb", "final_accuracy")


def shutdown_seconds(row: dict) -> float | None:
    """End of the last round to exit: the program's own figure, else what is left of the total after start-up and
    the rounds."""
    own = row.get("shutdown_seconds")
    if own is not None and own == own:
        return float(own)
    rounds, total, start = row.get("round_seconds"), row.get("total_seconds"), row.get("startup_seconds")
    if not isinstance(rounds, list) or total is None or start is None or total != total or start != start:
        return None
    return round(float(total) - float(start) - sum(rounds), 3)


def versions() -> dict[str, str | None]:
    """Python and the packages each system ran with (None for a system whose venv was never created)."""
    import numpy
    import ray
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "numpy": numpy.__version__,
            "ray": ray.__version__, "flwr": package_version(FLOWER_VENV / "bin" / "python", "flwr"),
            "pfl": package_version(PFL_VENV / "bin" / "python", "pfl")}


def summary(df: pd.DataFrame, workloads: dict[str, Workload], argv: list[str], versions: dict) -> dict:
    """The speed summary: per config and system, the medians over repeats of the successful runs."""
    configs: dict[str, dict] = {}
    for name, w in workloads.items():
        entry: dict = {"workload": {"N": w.num_clients, "K": w.clients_per_round, "R": w.rounds, "model": w.model}}
        for system, runs in df[df["config"] == name].groupby("system", sort=False):
            ok = runs[runs["status"] == "ok"]
            values = {
                "s_per_round": ok.get("seconds_per_round"), "total_s": ok.get("total_seconds"),
                "startup_s": ok.get("startup_seconds"),
                "shutdown_s": pd.Series([shutdown_seconds(r) for r in ok.to_dict("records")], dtype=float),
                "peak_rss_mb": ok.get("peak_rss_mb"), "final_accuracy": ok.get("final_accuracy")}
            entry[system] = {k: _median(v) for k, v in values.items()}
            entry[system].update(runs=len(runs), failed=int((runs["status"] != "ok").sum()),
                                 load_before=[float(x) for x in runs["load_before"]])
        configs[name] = entry
    floor = df[(df["system"] == "ray_floor") & (df["status"] == "ok")] if "system" in df else df.iloc[:0]
    return {"date": datetime.now().isoformat(timespec="seconds"), "command": "python -m " + " ".join(argv),
            "ray_floor_startup_s": _median(floor.get("startup_seconds")) if len(floor) else None,
            "ray_floor_shutdown_s": _median(floor.get("shutdown_seconds")) if len(floor) else None,
            "machine": {"host": platform.node(), "cpus": os.cpu_count(), "platform": platform.platform(),
                        "processor": platform.processor() or platform.machine()},
            "versions": versions, "configs": configs}


def _median(values) -> float | None:
    if values is None:
        return None
    v = pd.to_numeric(pd.Series(values), errors="coerce").dropna()
    return round(float(v.median()), 4) if len(v) else None


def write_summary(data: dict, stem: str) -> Path:
    """results/bench/<stem>.json."""
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / f"{stem}.json"
    path.write_text(json.dumps(data, indent=1) + "\n")
    return path


def read_summary(path: str | Path) -> dict:
    """A speed summary written by `write_summary`, its whole shape checked, so that rendering it cannot fail
    (bad files: BenchError, one line)."""
    path = Path(path)
    if not path.is_file():  # a FIFO would block the read forever
        raise BenchError(f"{path}: {not_a_file(path)}")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: arrays nested thousands deep
        raise BenchError(f"{path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("configs"), dict):
        raise BenchError(f"{path}: not a bench summary (no 'configs' mapping)")
    if not data["configs"]:
        raise BenchError(f"{path}: 'configs' is empty: no config was measured")
    problem = _summary_problem(data)
    if problem:
        raise BenchError(f"{path}: {problem}")
    return data


def not_a_file(path: Path) -> str:
    """Why `path`, which is not a regular file, cannot be read as one."""
    return "is a folder" if path.is_dir() else "is not a regular file" if path.exists() else "no such file"


def _number(value: object) -> bool:
    """A finite JSON number (true and false are not numbers here, though Python counts them as ints)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: object, low: int) -> bool:
    """A whole number of at least `low` (not a boolean)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


def _scalar(value: object) -> bool:
    return value is None or isinstance(value, str) or _number(value)


def _summary_problem(data: dict) -> str | None:
    """What in a summary's shape `render_table` and `render_targets` could not render, or None."""
    for key in ("date", "command"):
        if data.get(key) is not None and not isinstance(data[key], str):
            return f"{key} must be a string"
    for key in ("ray_floor_startup_s", "ray_floor_shutdown_s"):
        if data.get(key) is not None and not _number(data[key]):
            return f"{key} must be a number or null, got {str(data[key])[:40]!r}"
    for key in ("machine", "versions"):
        if data.get(key) is not None and not (isinstance(data[key], dict) and all(map(_scalar, data[key].values()))):
            return f"{key} must map names to strings or numbers"
    for name, entry in data["configs"].items():
        if not isinstance(entry, dict):
            return f"configs.{name} must be a mapping"
        if not set(entry) - {"workload"}:
            return f"configs.{name} has no system"
        for system, fields in entry.items():
            problem = _workload_problem(fields) if system == "workload" else _fields_problem(fields)
            if problem:
                return f"configs.{name}.{system}: {problem}"
    return None


def _workload_problem(w: object) -> str | None:
    """A config's workload: N, K and R counts and the model's name."""
    if not isinstance(w, dict):
        return "must be a mapping of N, K, R and model"
    for key in ("N", "K", "R"):
        if w.get(key) is not None and not _count(w[key], 1):
            return f"{key} must be a count of at least 1, got {str(w[key])[:40]!r}"
    if w.get("model") is not None and not isinstance(w["model"], str):
        return f"model must be a name, got {str(w['model'])[:40]!r}"
    return None


def _fields_problem(fields: object) -> str | None:
    """One system's figures: numbers or null, the run counts whole, the loads a list of numbers."""
    if not isinstance(fields, dict):
        return f"must map {', '.join(SUMMARY_FIELDS)} to numbers"
    for key in SUMMARY_FIELDS:
        if fields.get(key) is not None and not _number(fields[key]):
            return f"{key} must be a number or null, got {str(fields[key])[:40]!r}"
    for key in ("runs", "failed"):
        if fields.get(key) is not None and not _count(fields[key], 0):
            return f"{key} must be a count, got {str(fields[key])[:40]!r}"
    loads = fields.get("load_before")
    if loads is not None and not (isinstance(loads, list) and all(map(_number, loads))):
        return "load_before must be a list of numbers"
    return None


def render_table(data: dict) -> list[str]:
    """The speed table: one row per config and system, in the summary's order."""
    versions = data.get("versions") or {}
    machine = data.get("machine") or {}
    out = [f"Measured {data.get('date', '?')} on {machine.get('cpus', '?')} CPUs ({machine.get('processor', '?')}); "
           + ", ".join(f"{k} {v}" for k, v in versions.items() if v) + f"; `{data.get('command', '')}`.", "",
           "| config | system | s/round | total s | start-up s | shutdown s | peak RSS MB | final accuracy |",
           "|---|---|---:|---:|---:|---:|---:|---:|"]
    for name, entry in data["configs"].items():
        w = entry.get("workload") or {}
        label = f"{name}: {w.get('model', '?')}, N={w.get('N', '?')}, K={w.get('K', '?')}, R={w.get('R', '?')}"
        for system, f in entry.items():
            if system == "workload":
                continue
            out.append(f"| {label} | {system} | {fmt(f.get('s_per_round'))} | {fmt(f.get('total_s'), 1)} | "
                       f"{fmt(f.get('startup_s'), 1)} | {fmt(f.get('shutdown_s'), 1)} | "
                       f"{fmt(f.get('peak_rss_mb'), 0)} | {fmt(f.get('final_accuracy'), 4)} |")
    return out


def _plain(entry: dict, key: str) -> float | None:
    """The plain loop's figure: the faster of its 2-thread and 1-thread runs (the compute floor on this machine)."""
    values = [entry.get(s, {}).get(key) for s in ("plain", "plain_t1")]
    values = [v for v in values if v]
    return min(values) if values else None


# (config ids, label, numerator system, denominator system or "plain", field, target ratio)
TARGETS = [
    ("ABC", "fedsim local / pfl, s/round", "fedsim_local", "pfl", "s_per_round", 1.0),
    ("ABC", "fedsim local / pfl, total", "fedsim_local", "pfl", "total_s", 1.0),
    ("ABC", "fedsim local / pfl, peak RSS", "fedsim_local", "pfl", "peak_rss_mb", 1.0),
    ("ABC", "fedsim Ray / pfl 2 processes, s/round", "fedsim_ray", "pfl_multiprocess", "s_per_round", 1.0),
    ("AB", "fedsim Ray / pfl 2 processes, total", "fedsim_ray", "pfl_multiprocess", "total_s", 1.0),
    ("ABC", "fedsim Ray / pfl 2 processes, peak RSS", "fedsim_ray", "pfl_multiprocess", "peak_rss_mb", 1.0),
    ("AB", "fedsim local / plain, s/round", "fedsim_local", "plain", "s_per_round", 1.05),
    ("AB", "fedsim with client-level DP / without, s/round", "fedsim_dp", "fedsim_local", "s_per_round", 1.05),
    ("AB", "fedsim FedAdam / FedAvg, s/round", "fedsim_fedadam", "fedsim_local", "s_per_round", 1.05),
    ("AB", "fedsim Ray / plain, s/round", "fedsim_ray", "plain", "s_per_round", 1.05),
    ("C", "fedsim local / plain, s/round", "fedsim_local", "plain", "s_per_round", 1.5),
    ("C", "fedsim Ray / plain, s/round", "fedsim_ray", "plain", "s_per_round", 1.5),
    ("BC", "fedsim local / Flower, total", "fedsim_local", "flower", "total_s", 0.4),
    ("BC", "fedsim Ray / Flower, total", "fedsim_ray", "flower", "total_s", 0.4),
]


def render_targets(data: dict) -> list[str]:
    """The speed targets as ratios of one invocation's medians, each marked met or not (n/a: a system missing)."""
    configs = data["configs"]
    names = list(configs)
    out = ["| ratio (target) | " + " | ".join(names) + " |", "|---|" + "---:|" * len(names)]
    for ids, label, num, den, key, goal in TARGETS:
        cells = []
        for name in names:
            entry = configs[name]
            a = (entry.get(num) or {}).get(key)
            b = _plain(entry, key) if den == "plain" else (entry.get(den) or {}).get(key)
            if name not in ids:
                cells.append("")
            elif not a or not b:
                cells.append("n/a")
            else:
                r = a / b
                cells.append(f"{r:.2f}x {'met' if r <= goal else '**not met**'}")
        out.append(f"| {label} (≤ {goal:g}x) | " + " | ".join(cells) + " |")
    floors = (("start-up", "startup_s", data.get("ray_floor_startup_s"), 1.0),
              ("shutdown", "shutdown_s", data.get("ray_floor_shutdown_s"), 0.2))
    for label, key, floor, slack in floors:
        if floor is None:
            continue
        cells = []
        for name in names:
            value = (configs[name].get("fedsim_ray") or {}).get(key)
            over = None if value is None else value - floor
            cells.append("n/a" if over is None else f"{over:+.2f} s {'met' if over <= slack else '**not met**'}")
        out.append(f"| fedsim Ray {label} over Ray's own, {floor:.2f} s (≤ +{slack:g} s) | " + " | ".join(cells) + " |")
    return out


# the README's headline rows: (system, label)
HEADLINE = [("plain", "plain PyTorch loop, 2 threads"), ("fedsim_local", "fedsim, one process"),
            ("fedsim_ray", "fedsim on Ray, 2 workers"), ("pfl", "pfl-research, one process"),
            ("pfl_multiprocess", "pfl-research, 2 processes"), ("flower", "Flower, 2 actors")]


def render_headline(data: dict) -> list[str]:
    """README.md's headline: one row per system, each config's seconds per round and total seconds."""
    machine = data.get("machine") or {}
    configs = data["configs"]
    heads = []
    for name, entry in configs.items():
        w = entry.get("workload") or {}
        n, k = (f"{w[x]:,}" if isinstance(w.get(x), int) else "?" for x in ("N", "K"))
        heads.append(f"{name}: {w.get('model', '?')}, {n} clients, {k} a round")
    out = [f"Seconds per round (total seconds, start-up included); medians of `{data.get('command', '')}`, measured "
           f"{str(data.get('date', '?'))[:10]} on {machine.get('cpus', '?')} CPUs.", "",
           "| system | " + " | ".join(heads) + " |", "|---|" + "---:|" * len(heads)]
    for system, label in HEADLINE:
        cells = [(configs[name].get(system) or {}) for name in configs]
        if not any(cells):
            continue
        out.append(f"| {label} | " + " | ".join(
            f"{fmt(c.get('s_per_round'))} ({fmt(c.get('total_s'), 1)})" if c else "n/a" for c in cells) + " |")
    return out


def markdown_block(md: Path) -> str:
    """The docs' block for a bench report written as markdown (`make bench-scale`): the file without its title."""
    try:
        lines = md.read_text(encoding="utf-8").splitlines()
    except (OSError, ValueError) as exc:
        raise BenchError(f"{md}: unreadable ({type(exc).__name__}: {exc})") from None
    while lines and (lines[0].startswith("# ") or not lines[0].strip()):
        lines.pop(0)
    rel = md.resolve().relative_to(REPO) if md.resolve().is_relative_to(REPO) else md
    head = f"<!-- generated by `python -m bench.report --docs` from {rel}; do not edit -->"
    return "\n".join([head, *lines]) + "\n"


def speed_block(data: dict, source: str) -> str:
    """docs/performance.md's speed block: where it comes from, the table of every system, then the targets."""
    return "\n".join([f"<!-- generated by `python -m bench.report {source} --docs` from that file; do not edit -->",
                      *render_table(data), "", *render_targets(data)]) + "\n"


def headline_block(data: dict, source: str) -> str:
    """README.md's headline block: where it comes from, then a row per system."""
    return "\n".join([f"<!-- generated by `python -m bench.report {source} --docs` from that file; do not edit -->",
                      *render_headline(data)]) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.report", description="print the speed table of a summary")
    ap.add_argument("summary", nargs="?", default=str(OUT / "fedavg.json"), help="a file written by `make bench`")
    ap.add_argument("--docs", nargs="*", default=None, metavar="PAGE",
                    help="write the <!-- bench:fedavg --> and <!-- bench:headline --> blocks from the summary, and "
                         "<!-- bench:scale -->, <!-- bench:gpu -->, <!-- bench:robust_aggregation -->, "
                         "<!-- bench:dpsgd -->, <!-- bench:secagg -->, <!-- bench:dp_overhead -->, "
                         "<!-- bench:fedopt_overhead --> and <!-- bench:async_overhead --> from the .md "
                         "files of those names beside it, on whichever "
                         "PAGE holds them (default: README.md and docs/**/*.md)")
    args = ap.parse_args(argv)
    try:
        data = read_summary(args.summary)
        if args.docs is not None:
            pages = args.docs or [str(p) for p in doc_pages(REPO)]
            blocks = paste_docs(data, args.summary, pages)
            print(f"wrote the bench blocks {', '.join(blocks)}")
        else:
            print("\n".join(render_table(data) + [""] + render_targets(data)))
    except BenchError as exc:
        print(f"bench.report: error: {exc}", file=sys.stderr)
        return 2
    return 0


def paste_docs(data: dict, summary: str, pages: list[str]) -> list[str]:
    """Write the bench blocks (returned by name) on the pages that hold them: the speed table and the headline from
    `data`, and scale.md's and gpu.md's reports when they are beside the summary (and a page holds their block).
    Every block is read before a page is touched; a bad file is a BenchError."""
    from fedsim.errors import FedsimError
    from jobs.readme_blocks import paste_blocks, read_page_blocks

    for page in pages:
        if not page:
            raise BenchError("--docs: expected a file name, got ''")
        if not Path(page).is_file():
            raise BenchError(f"--docs: {page}: {not_a_file(Path(page))}")
    targets = [Path(p) for p in pages]
    path = Path(summary).resolve()
    source = str(path.relative_to(REPO)) if path.is_relative_to(REPO) else summary
    try:
        present = read_page_blocks(targets, "bench")
    except (OSError, ValueError) as exc:  # not UTF-8 text
        raise BenchError(f"--docs: {type(exc).__name__}: {exc}") from None
    blocks = {"fedavg": speed_block(data, source)}
    if "headline" in present:
        blocks["headline"] = headline_block(data, source)
    # make bench-scale's, bench.gpu_bench's and bench.robust_bench's reports, when beside it
    for name in ("scale", "gpu", "robust_aggregation", "dpsgd", "secagg", "dp_overhead", "fedopt_overhead",
                 "async_overhead"):
        md = path.parent / f"{name}.md"
        if md.is_file():
            blocks[name] = markdown_block(md)
    try:
        paste_blocks(targets, "bench", blocks)
    except FedsimError as exc:
        raise BenchError(str(exc)) from None
    except (OSError, ValueError) as exc:  # not writable
        raise BenchError(f"--docs: {type(exc).__name__}: {exc}") from None
    return list(blocks)


if __name__ == "__main__":
    sys.exit(main())
