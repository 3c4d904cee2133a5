"""Running the bench programs: Flower's own venv (created on first use), one program run with its log, and its
RESULT_JSON line read back.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
FLOWER_VENV = REPO / ".venv-flower"
FLOWER_PINS = ["flwr[simulation]==1.41.*", "psutil"]
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def torch_pin() -> str:
    """The torch release of this venv, so Flower's venv computes with the same kernels."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def flower_python(log=print) -> Path:
    """Python of `.venv-flower` (flwr[simulation] pins its own Ray), created on first use."""
    py = FLOWER_VENV / "bin" / "python"
    stamp = FLOWER_VENV / ".installed"
    if stamp.is_file() and py.is_file():
        return py
    t0 = time.perf_counter()
    log(f"creating {FLOWER_VENV} (flwr[simulation], {torch_pin()}, psutil; a few minutes, once)")
    subprocess.run([_base_python(), "-m", "venv", str(FLOWER_VENV)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *FLOWER_PINS, torch_pin()], check=True)
    stamp.write_text(f"installed in {time.perf_counter() - t0:.0f} s\n")
    log(f"{FLOWER_VENV} ready in {time.perf_counter() - t0:.0f} s")
    return py


def _base_python() -> str:
    """The interpreter this venv was made from (a venv cannot be nested inside another's python)."""
    return getattr(sys, "_base_executable", None) or sys.executable


def run_program(cmd: list[str], log_path: Path, timeout: float = 1800, cwd: Path | None = None,
                env: dict[str, str] | None = None) -> dict:
    """Run one benchmark program, keep its output in `log_path`, return its RESULT_JSON (or the failure)."""
    log_path.parent.mkdir(parents=True, exist_ok=True)
    full_env = {**os.environ, **QUIET_ENV, **(env or {})}
    t0 = time.perf_counter()
    with open(log_path, "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        try:
            proc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=cwd, env=full_env,
                                  timeout=timeout)
            rc = proc.returncode
        except subprocess.TimeoutExpired:
            rc = 124
    wall = time.perf_counter() - t0
    result = None
    for line in log_path.read_text(errors="replace").splitlines():
        if line.startswith("RESULT_JSON "):
            result = json.loads(line[len("RESULT_JSON "):])
    if result is None or rc != 0:
        return {"status": f"rc={rc}" if rc != 124 else f">{timeout:.0f} s", "log": str(log_path),
                "outer_seconds": wall}
    return {**result, "status": "ok", "log": str(log_path), "outer_seconds": wall}


def load_average() -> float:
    """1-minute load average (the machine is shared; the tables record it)."""
    return os.getloadavg()[0]
