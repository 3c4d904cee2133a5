"""Run folders and their tables: writing them atomically, and loading them back as DataFrames.

results/<run_id>/ holds config.yaml (resolved), meta.json (versions, git sha, hardware), rounds.parquet
(one row per round and global model), clients.parquet (one row per client, phase and round) and
checkpoints/. Timing columns measured on the wall clock end in `_s`; `virtual_*` columns are the
deterministic virtual clock (seconds).
"""

from __future__ import annotations

import json
import platform
import subprocess
from collections.abc import Iterable
from pathlib import Path

import pandas as pd

from fedsim.errors import CheckpointError
from fedsim.io import atomic_write, atomic_write_text

ROUND_COLUMNS = ["round", "model", "accuracy", "loss", "participants", "arrived", "stragglers", "failures",
                 "bytes_up", "bytes_down", "virtual_time", "virtual_round", "wall_round_s"]
CLIENT_COLUMNS = ["round", "phase", "client", "worker", "arch", "samples", "status", "virtual_duration",
                  "bytes_up", "bytes_down", "wall_s"]


def write_table(rows: list[dict], path: Path, columns: list[str]) -> None:
    """Write rows as parquet atomically, with the known columns first."""
    df = pd.DataFrame(rows)
    if not df.empty:
        df = df[[c for c in columns if c in df.columns] + [c for c in df.columns if c not in columns]]
    atomic_write(path, lambda tmp: df.to_parquet(tmp, index=False))


def run_meta() -> dict:
    """Versions, git sha and hardware, for meta.json."""
    import numpy
    import torch

    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=5,
                             cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        sha = ""
    try:
        import ray

        ray_version = ray.__version__
    except ImportError:
        ray_version = ""
    import fedsim

    return {"fedsim": fedsim.__version__, "git_sha": sha, "python": platform.python_version(),
            "torch": torch.__version__, "numpy": numpy.__version__, "ray": ray_version,
            "platform": platform.platform(), "processor": platform.processor(),
            "cuda": torch.cuda.is_available(),
            "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]}


def write_meta(run_dir: Path, extra: dict) -> None:
    atomic_write_text(run_dir / "meta.json", json.dumps({**run_meta(), **extra}, indent=2, default=str))


def _run_dir(path: str | Path) -> Path:
    p = Path(path)
    if not p.exists() and not p.is_absolute() and (Path("results") / p).exists():
        p = Path("results") / p
    if not (p / "rounds.parquet").is_file():
        raise CheckpointError(f"{p}: not a fedsim run folder (no rounds.parquet)")
    return p


def load(path: str | Path) -> dict[str, pd.DataFrame | dict]:
    """A run's tables: {"rounds": DataFrame, "clients": DataFrame, "config": dict, "meta": dict}."""
    import yaml

    p = _run_dir(path)
    clients = pd.read_parquet(p / "clients.parquet") if (p / "clients.parquet").is_file() else pd.DataFrame()
    config = yaml.safe_load((p / "config.yaml").read_text()) if (p / "config.yaml").is_file() else {}
    meta = json.loads((p / "meta.json").read_text()) if (p / "meta.json").is_file() else {}
    return {"rounds": pd.read_parquet(p / "rounds.parquet"), "clients": clients, "config": config, "meta": meta}


def flatten(d: dict, prefix: str = "") -> dict:
    """Nested config dict -> {"a.b": value}."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, key + "."))
        else:
            out[key] = v if not isinstance(v, (list, dict)) else json.dumps(v)
    return out


def collect(paths: Iterable[str | Path], table: str = "rounds") -> pd.DataFrame:
    """Concatenate one table of many runs, with a `run` column and every config key as `config.<key>`."""
    frames = []
    for path in paths:
        res = load(path)
        df = res[table].copy()
        df.insert(0, "run", Path(path).name)
        for k, v in flatten(res["config"]).items():
            df[f"config.{k}"] = v
        frames.append(df)
    return pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()


def summary(rounds: pd.DataFrame) -> pd.DataFrame:
    """One line per evaluated round and model: the columns a person reads first."""
    cols = [c for c in ["round", "model", "accuracy", "loss", "participants", "arrived", "stragglers",
                        "failures", "bytes_up", "bytes_down", "virtual_time", "wall_round_s"] if c in rounds]
    return rounds[cols]


def plot(path: str | Path, out: str | Path | None = None) -> Path:
    """Accuracy vs round, one line per global model; written as PNG next to the tables by default."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    p = _run_dir(path)
    df = load(p)["rounds"].dropna(subset=["accuracy"]) if "accuracy" in load(p)["rounds"] else None
    if df is None or df.empty:
        raise CheckpointError(f"{p}: no evaluated rounds to plot")
    fig, ax = plt.subplots(figsize=(6, 4))
    for model, g in df.groupby("model", sort=False):
        ax.plot(g["round"] + 1, g["accuracy"] * 100, marker=".", label=str(model))
    ax.set_xlabel("round")
    ax.set_ylabel("test accuracy (%)")
    ax.set_title(p.name)
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out) if out else p / "accuracy.png"
    atomic_write(out, lambda tmp: fig.savefig(tmp, dpi=120, bbox_inches="tight", format="png"))
    plt.close(fig)
    return out
