"""Running the bench programs: Flower's and pfl-research's own venvs (created on first use), one program run with
its log, and its RESULT_JSON line read back; the checks every program makes of its arguments before it runs.
Only the standard library, so a program's start-up timing does not change by importing it.
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
FLOWER_PINS = ["flwr[simulation]==1.41.*", "flwr-datasets==0.6.*", "psutil"]  # flwr-datasets: the partitioners
PFL_VENV = REPO / ".venv-pfl"
PFL_PINS = ["pfl[pytorch]==0.6.0", "psutil"]
OPACUS_VENV = REPO / ".venv-opacus"
OPACUS_PINS = ["opacus==1.6.*", "pyyaml", "psutil"]  # pyyaml: the program builds fedsim's own models
QUIET_ENV = {"FLWR_TELEMETRY_ENABLED": "0", "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}


def torch_pin() -> str:
    """The torch release of this venv, so Flower's venv computes with the same kernels."""
    import torch

    return f"torch=={torch.__version__.split('+')[0]}"


def flower_python(log=print) -> Path:
    """Python of `.venv-flower` (flwr[simulation] pins its own Ray), created on first use."""
    return bench_venv(FLOWER_VENV, FLOWER_PINS, log)


def pfl_python(log=print) -> Path:
    """Python of `.venv-pfl` (pfl-research with its PyTorch extra), created on first use."""
    return bench_venv(PFL_VENV, PFL_PINS, log)


def opacus_python(log=print) -> Path:
    """Python of `.venv-opacus` (Opacus, the DP-SGD library users would otherwise take), created on first use."""
    return bench_venv(OPACUS_VENV, OPACUS_PINS, log)


def bench_venv(venv: Path, pins: list[str], log=print) -> Path:
    """Python of a system's own venv with `pins` and this venv's torch release, created when missing or unfinished."""
    py = venv / "bin" / "python"
    stamp = venv / ".installed"
    if stamp.is_file() and py.is_file():
        return py
    t0 = time.perf_counter()
    log(f"creating {venv} ({', '.join(pins)}, {torch_pin()}; a few minutes, once)")
    subprocess.run([_base_python(), "-m", "venv", str(venv)], check=True)
    subprocess.run([str(py), "-m", "pip", "install", "-q", *pins, torch_pin()], check=True)
    stamp.write_text(f"installed in {time.perf_counter() - t0:.0f} s\n")
    log(f"{venv} ready in {time.perf_counter() - t0:.0f} s")
    return py


def drop_cached_libraries(venvs: list[Path], log=print) -> int:
    """Drop every shared library of `venvs` from the page cache, so each system maps its libraries alike.

    Peak RSS counts the library pages a process maps, and how many a fault maps depends on how the file came into
    the cache: torch's libraries, still cached from pip's install, counted 725 MB in a bare `import torch` against
    510 MB once dropped and read back by faults (same wheel, two venvs). Returns how many files were advised."""
    count = 0
    for venv in venvs:
        for lib in sorted(Path(venv).glob("lib/python*/site-packages/**/*.so*")):
            if not lib.is_file() or not (lib.name.endswith(".so") or ".so." in lib.name):
                continue
            try:
                fd = os.open(lib, os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    log(f"dropped {count} shared libraries of {len(venvs)} venvs from the page cache")
    return count


def package_version(python: Path, package: str) -> str | None:
    """The installed version of `package` in the venv of `python` (None when the venv or the package is missing)."""
    if not Path(python).is_file():
        return None
    proc = subprocess.run([str(python), "-c", f"import importlib.metadata as m; print(m.version({package!r}))"],
                          capture_output=True, text=True, timeout=120)
    return proc.stdout.strip() or None if proc.returncode == 0 else None


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


def out_of_range(flag: str, value: float, low: float, high: float) -> str | None:
    """The error for a numeric argument outside [low, high] (NaN included), or None when it is inside."""
    if low <= value <= high:
        return None

    def show(x: float) -> str:
        return str(x) if isinstance(x, int) else f"{x:g}"

    return f"{flag}: must be from {show(low)} to {show(high)}, got {show(value)}"


def unwritable(path: str | Path, folder: bool = False) -> str | None:
    """Why a file (or, with `folder`, a folder) cannot be written at `path`, or None when it can: checked before a
    long measurement, so a bad output place fails at once. Creating is tried for real and undone, so nothing is
    left behind (a root user passes every permission check, a /proc path fails only when written)."""
    import tempfile

    path = Path(path)
    try:
        if path.is_dir() and not folder:
            return f"{path} is a folder"
        if path.exists() and folder and not path.is_dir():
            return f"{path} is not a folder"
        parent = path if folder else path.parent
        missing = None  # the top-most folder to create
        while not parent.is_dir():
            if parent.exists() or parent.is_symlink():
                return f"{parent} is not a folder"
            missing, parent = parent, parent.parent
        if missing is not None:
            missing.mkdir()
            missing.rmdir()
        else:
            with tempfile.NamedTemporaryFile(dir=parent, prefix=".write-probe-"):
                pass
    except (OSError, ValueError) as exc:
        return f"{path}: cannot write there ({getattr(exc, 'strerror', None) or exc})"
    return None
