"""`fedsim stress CONFIG --clients 100,1000,10000,100000`: round time and memory as the client count grows.

Each point (client count × participants × skip_late) runs the config for a few rounds in a fresh process
(so start-up counts imports and Ray start, and one point's memory never leaks into the next), and becomes
one row of a DataFrame, written as parquet and markdown with a log-log plot of time and memory:

- registered clients, participants per round (kept, arrived, late, computed);
- steady-state wall seconds per round (rounds after the first) and start-up seconds (process start to the
  first round: imports, data, partition, Ray and its workers);
- peak RSS summed over the driver and every process under it (Ray's daemons, workers and server actor),
  sampled by a thread; with `ray job submit` the cluster's daemons are not the driver's children, so the
  workers and the server are found by pid instead;
- peak Ray object-store bytes in use; peak GPU memory per worker (nvidia-smi) where there is a GPU;
- personal-state cache: the most states (and their bytes) spilled to disk at a round's end, in the spill folder
  the driver sees (on several nodes: every worker's when `runtime.spill_dir` is a folder they share, else only
  the driver node's).

`--repeat N` runs the whole sweep N times, interleaved, so a busy machine slows every point alike; `--save NAME`
also writes the table as `results/bench/stress_NAME.csv` and `.md`, from which `python -m jobs.stress_readme`
writes the scale tables of docs/scale.md.

Also `python -m jobs.stress ...`, and as a Ray job: `ray job submit --working-dir . -- python -m jobs.stress ...`.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import contextlib  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
from datetime import datetime  # noqa: E402
from pathlib import Path  # noqa: E402

from fedsim.config.limits import MAX_CLIENTS, MAX_ROUNDS, MAX_SECONDS, MAX_WORKERS  # noqa: E402
from fedsim.errors import ConfigError, FedsimError  # noqa: E402
from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo, RunStatus  # noqa: E402

RESULT = "STRESS_JSON "
MAX_REPEAT = 1000  # interleaved repeats of every point
ROOT = Path(__file__).resolve().parents[1]  # this checkout
BENCH = ROOT / "results" / "bench"  # where --save writes
# a point's process runs in the caller's folder (its relative paths are the caller's) and imports this checkout's
# jobs.stress (`python -m` would look in that folder first)
POINT = f"import sys; sys.path[0] = {str(ROOT)!r}; from jobs.stress import main; sys.exit(main())"
COLUMNS = ["registered", "participants", "skip_late", "repeat", "rounds", "s_per_round", "ms_per_participant",
           "startup_s",
           "round0_s", "peak_rss_gb", "peak_rss_driver_gb", "peak_rss_workers_gb", "peak_rss_server_gb",
           "object_store_mb", "gpu_mb_per_worker", "arrived", "late", "computed", "spilled_mb", "spilled_states",
           "workers", "processes", "total_s", "run_dir", "status"]


# ------------------------------------------------------------------------------------------- measuring
class MemorySampler(threading.Thread):
    """Peak of the summed RSS over this process, its descendants and any extra pids; object store; GPU."""

    def __init__(self, interval: float = 0.2) -> None:
        super().__init__(daemon=True)
        import psutil

        self.psutil, self.interval = psutil, interval
        self.root = psutil.Process()
        self.roles: dict[int, str] = {}  # pid -> worker | server (found after the backend starts)
        self.peak = {"total": 0, "driver": 0, "worker": 0, "server": 0}
        self.processes = 0
        self.object_store = 0
        self.gpu: dict[int, int] = {}
        self._stop_ev = threading.Event()
        self._procs: list = []
        self._n = 0

    def _scan(self) -> None:
        ps = self.psutil
        try:
            procs = [self.root] + self.root.children(recursive=True)
        except ps.NoSuchProcess:
            procs = []
        known = {p.pid for p in procs}
        for pid in self.roles:
            if pid not in known:
                try:
                    procs.append(ps.Process(pid))
                except ps.NoSuchProcess:
                    pass
        self._procs = procs
        self.processes = max(self.processes, len(procs))

    def sample(self) -> None:
        if self._n % 5 == 0 or not self._procs:
            self._scan()
        by_role = {"total": 0, "driver": 0, "worker": 0, "server": 0}
        for p in self._procs:
            try:
                rss = p.memory_info().rss
            except (self.psutil.NoSuchProcess, self.psutil.AccessDenied, self.psutil.ZombieProcess):
                continue
            by_role["total"] += rss
            role = "driver" if p.pid == self.root.pid else self.roles.get(p.pid)
            if role:
                by_role[role] += rss
        for k, v in by_role.items():
            self.peak[k] = max(self.peak[k], v)
        if self._n % 5 == 0:
            self.object_store = max(self.object_store, object_store_bytes())
            for pid, mb in gpu_memory_by_pid().items():
                if self.roles.get(pid) == "worker":
                    self.gpu[pid] = max(self.gpu.get(pid, 0), mb)
        self._n += 1

    def run(self) -> None:
        while not self._stop_ev.is_set():
            self.sample()
            self._stop_ev.wait(self.interval)

    def stop(self) -> None:
        self._stop_ev.set()
        self.join(timeout=5)


def object_store_bytes() -> int:
    """Bytes in use in the Ray object store (cluster-wide), 0 without Ray."""
    try:
        import ray

        if not ray.is_initialized():
            return 0
        total = ray.cluster_resources().get("object_store_memory", 0.0)
        free = ray.available_resources().get("object_store_memory", total)
        return int(max(total - free, 0))
    except Exception:  # the cluster is going down between two samples
        return 0


def gpu_memory_by_pid() -> dict[int, int]:
    """MiB of GPU memory used by each process on this node's GPUs (empty without nvidia-smi)."""
    if not shutil.which("nvidia-smi"):
        return {}
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    rows = [line.split(",") for line in out.strip().splitlines() if "," in line]
    return {int(pid): int(float(mb)) for pid, mb in rows if pid.strip().isdigit()}


def dir_stats(path: Path) -> tuple[int, int]:
    """(bytes, files) under a folder."""
    if not path.exists():
        return 0, 0
    files = [p for p in path.rglob("*.pt") if p.is_file()]
    return sum(p.stat().st_size for p in files), len(files)


class StressProbe(Callback):
    """The callback that times a stress point: when its rounds start and end, its rows, which of the processes
    the sampler sees are workers and which the server, and the most client states its spill folder held at a
    round's end (the workers remove that folder when the run ends, so it is read while the run goes on)."""

    def __init__(self, sampler: MemorySampler) -> None:
        self.sampler = sampler
        self.t_loop = 0.0
        self.marks: list[float] = []
        self.rows: list[dict] = []
        self.clients: list[dict] = []
        self.spill: Path | None = None
        self.spilled_bytes = 0
        self.spilled_files = 0
        self.on_ray = False  # whether the run's workers are Ray actors (else no worker memory or object store)

    def on_setup_end(self, run: RunInfo) -> None:
        from fedsim.runtime.rundir import spill_folder

        self.spill = spill_folder(run.cfg, run.run_dir)
        self.on_ray = run.backend.get("backend") != "LocalBackend"
        roles = self.sampler.roles
        roles.update({int(p["pid"]): "worker" for p in run.backend.get("placement", []) if "pid" in p})
        server_pid = int(run.backend.get("server", {}).get("pid", os.getpid()))
        if server_pid != os.getpid():
            roles[server_pid] = "server"
        self.sampler._scan()
        self.t_loop = time.perf_counter()

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        self.marks.append(time.perf_counter())
        self.rows.append(rows.row)
        self.clients.extend(rows.clients)
        if self.spill is not None:
            size, files = dir_stats(self.spill)
            if files >= self.spilled_files:
                self.spilled_bytes, self.spilled_files = size, files

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        self.sampler.sample()  # the last round's memory, before the backend goes


def measure(cfg, workers: int | None = None, t_start: float | None = None) -> dict:
    """Run `cfg` once and return its stress row (everything but the plot)."""
    import numpy as np

    from actors.backend import make_backend
    from fedsim.config.schema import clients_per_round
    from fedsim.runtime.loop import run

    t_start = T_START if t_start is None else t_start
    sampler = MemorySampler()
    sampler.start()
    probe = StressProbe(sampler)
    try:
        run_dir = run(cfg, make_backend(cfg, workers), callbacks=[probe])
    finally:
        sampler.stop()
    t_done = time.perf_counter()
    t_loop, marks, rows, clients = probe.t_loop, probe.marks, probe.rows, probe.clients
    times = np.diff([t_loop] + marks)
    steady = times[1:] if len(times) > 1 else times
    first_phase = {c["phase"] for c in clients[:1]}
    computed = [c for c in clients if c["phase"] in first_phase and c["wall_s"] and c["wall_s"] > 0]
    gb = 2 ** 30
    R = len(rows)
    return {
        "registered": cfg.data.num_clients, "participants": clients_per_round(cfg),
        "skip_late": bool(cfg.stragglers.skip_late), "rounds": R,
        "s_per_round": float(np.mean(steady)) if len(steady) else float("nan"),
        "ms_per_participant": 1000 * float(np.mean(steady)) / max(clients_per_round(cfg), 1) if len(steady)
        else float("nan"),
        "startup_s": t_loop - t_start, "round0_s": float(times[0]) if len(times) else float("nan"),
        "peak_rss_gb": sampler.peak["total"] / gb, "peak_rss_driver_gb": sampler.peak["driver"] / gb,
        # the local backend's workers are the driver process, and it has no object store: n/a, not 0
        "peak_rss_workers_gb": sampler.peak["worker"] / gb if probe.on_ray else float("nan"),
        "peak_rss_server_gb": sampler.peak["server"] / gb if "server" in sampler.roles.values() else float("nan"),
        "object_store_mb": sampler.object_store / 2 ** 20 if probe.on_ray else float("nan"),
        "gpu_mb_per_worker": max(sampler.gpu.values()) if sampler.gpu else float("nan"),
        "arrived": float(np.mean([r.get("arrived", np.nan) for r in rows])) if rows else float("nan"),
        "late": float(np.mean([r.get("stragglers", np.nan) for r in rows])) if rows else float("nan"),
        "computed": len(computed) / max(R, 1),
        "spilled_mb": probe.spilled_bytes / 2 ** 20, "spilled_states": probe.spilled_files,
        "workers": backend_workers(sampler), "processes": sampler.processes, "total_s": t_done - t_start,
        "run_dir": str(run_dir), "status": "ok",
    }


def backend_workers(sampler: MemorySampler) -> int:
    return sum(1 for r in sampler.roles.values() if r == "worker") or 1


# ------------------------------------------------------------------------------------------- the sweep
def parse_counts(text: str, flag: str) -> list[int]:
    """Comma-separated whole numbers from 1 to MAX_CLIENTS (1e5 is 100000; 4.5 is refused, not rounded)."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ConfigError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not values or not all(1 <= v <= MAX_CLIENTS for v in values):
        raise ConfigError(f"{flag}: expected integers from 1 to {MAX_CLIENTS:,}, got {text!r}")
    if not all(v.is_integer() for v in values):
        raise ConfigError(f"{flag}: expected whole numbers, got {text!r}")
    return [int(v) for v in values]


def point_overrides(n: int, k: int | None, skip: bool | None, rounds: int, root: Path) -> list[str]:
    """The overrides of one point: client count, participants (capped at the count), rounds, output."""
    out = [f"data.num_clients={n}", f"rounds={rounds}", f"results.root={root}", "results.run_id=null"]
    if k is not None:
        out += [f"participation.clients_per_round={min(k, n)}", "participation.fraction=null"]
    if skip is not None:
        out.append(f"stragglers.skip_late={str(skip).lower()}")
    return out


def configured_participants(config: str, overrides: list[str]) -> int | None:
    """participation.clients_per_round of the config as given (before a point sets the client count)."""
    from fedsim.configure import load_config

    return load_config(config, [o for o in overrides if not o.startswith("data.num_clients=")]) \
        .participation.clients_per_round


def load_point(config: str, overrides: list[str], n: int):
    """The config of one point; participants above the count are capped to it."""
    from fedsim.configure import load_config

    k = configured_participants(config, overrides)
    return load_config(config, overrides + ([f"participation.clients_per_round={n}"] if k and k > n else []))


def capped_note(ks: list[int | None], configured: int | None, counts: list[int]) -> str | None:
    """One line saying which points run fewer participants than asked (all their clients), or None."""
    capped = sorted({(k or configured, n) for k in ks for n in counts if (k or configured or 0) > n})
    if not capped:
        return None
    return "[stress] participants above the client count are capped to it: " + \
        ", ".join(f"{k} per round with {n} clients runs {n}" for k, n in capped)


def run_point(args: argparse.Namespace, overrides: list[str], n: int) -> dict:
    """One point, in a fresh process (default) or in this one (--in-process, for tests); a point that fails or
    runs past --timeout is a failed row."""
    if args.in_process:
        return measure(load_point(args.config, overrides, n), args.workers, time.perf_counter())
    cmd = [sys.executable, "-c", POINT, "--point", args.config, "--clients", str(n)]
    cmd += [a for o in overrides for a in ("-o", o)]
    cmd += ["--workers", str(args.workers)] if args.workers else []
    code, out, err = run_child(cmd, args.timeout)
    if code is None:
        return {"registered": n, "status": f"failed: timed out after {args.timeout:g} s (--timeout)"}
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    tail = (err or out).strip().splitlines()[-1:] or [f"exit code {code}"]
    return {"registered": n, "status": f"failed: {tail[0][:200]}"}


def run_child(cmd: list[str], timeout: float) -> tuple[int | None, str, str]:
    """(exit code, stdout, stderr) of a point's process, run in this process's folder with this checkout on the path
    of it and its Ray workers; exit code None when it ran past `timeout`, after it and every process under it
    (Ray's) were killed."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_tree(proc.pid)
        proc.communicate()
        return None, "", ""
    except BaseException:  # Ctrl-C or SIGTERM here: the point goes too
        kill_tree(proc.pid)
        proc.communicate()
        raise
    return proc.returncode, out, err


def kill_tree(pid: int) -> None:
    """Kill process `pid` and every process under it."""
    import psutil

    try:
        root = psutil.Process(pid)
        procs = [*root.children(recursive=True), root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        with contextlib.suppress(psutil.NoSuchProcess):  # it ended on its own meanwhile
            p.kill()
    psutil.wait_procs(procs, timeout=10)


def table(df) -> str:
    """The stress DataFrame as a markdown table (the columns a reader needs)."""
    cols = ["registered", "participants", "skip_late", "s_per_round", "ms_per_participant", "startup_s", "peak_rss_gb",
            "peak_rss_driver_gb", "peak_rss_workers_gb", "peak_rss_server_gb", "object_store_mb",
            "gpu_mb_per_worker", "arrived", "late", "computed", "spilled_mb", "spilled_states", "status"]
    if "repeat" in df and df["repeat"].nunique() > 1:
        cols.insert(3, "repeat")
    show = df[[c for c in cols if c in df]].copy()
    head = "| " + " | ".join(show.columns) + " |"
    lines = [head, "|" + "---|" * len(show.columns)]
    for _, row in show.iterrows():
        cells = []
        for c in show.columns:
            v = row[c]
            if isinstance(v, float):
                cells.append("n/a" if v != v else (f"{v:.3f}" if abs(v) < 10 else f"{v:.1f}"))
            else:
                cells.append(str(v))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(df, path: Path) -> None:
    """Seconds per round and peak RSS against registered clients, log-log, one line per (participants, skip)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from fedsim.persist.io import atomic_write

    ok = df[df["status"] == "ok"]
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    for (k, skip), g in ok.groupby(["participants", "skip_late"]):
        g = g.sort_values("registered")
        label = f"{k} per round" + (", skip late" if skip else "")
        axes[0].plot(g["registered"], g["s_per_round"], marker="o", label=label)
        axes[1].plot(g["registered"], g["peak_rss_gb"], marker="o", label=label)
    for ax, col, ylabel in zip(axes, ["s_per_round", "peak_rss_gb"],
                               ["wall seconds per round (steady state)", "peak RSS, all processes (GiB)"], strict=True):
        ax.set_xscale("log")
        ax.set_yscale("log")
        lo, hi = ok[col].min(), ok[col].max()
        if lo > 0:
            ax.set_ylim(lo / 3, hi * 3)  # at least a decade, so flat looks flat
        ax.set_xlabel("registered clients")
        ax.set_ylabel(ylabel)
        ax.grid(alpha=0.3, which="both")
        ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, dpi=120, format="png"))
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    from jobs.args import OneLineParser

    p = OneLineParser(prog="fedsim stress", description="Run a config at several client counts; time and memory.")
    p.add_argument("config", help="run config (YAML)")
    p.add_argument("--clients", required=True, help="registered client counts, e.g. 100,1000,10000,100000")
    p.add_argument("--participants", help="clients per round to try (default: the config's), e.g. 10,100,1000")
    p.add_argument("--skip-late", choices=["config", "both"], default="config",
                   help="'both' runs every point with stragglers.skip_late false and true")
    p.add_argument("--rounds", type=int, default=4, help="rounds per point (the first is warm-up)")
    p.add_argument("--repeat", type=int, default=1, help="run the sweep this many times, interleaved")
    p.add_argument("--out", help="output folder (default results/stress/<config>-<time>)")
    p.add_argument("--save", metavar="NAME", help="also write results/bench/stress_NAME.csv and .md (the files "
                   "`python -m jobs.stress_readme` puts into docs/scale.md)")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--workers", type=int, help="client workers")
    p.add_argument("--in-process", action="store_true", help="run every point in this process (tests)")
    p.add_argument("--timeout", type=seconds, default=3600, help="seconds per point (a point past it fails)")
    p.add_argument("--point", action="store_true", help=argparse.SUPPRESS)  # one point, as a child process
    return p


def seconds(text: str) -> float:
    """argparse type: seconds, > 0 and at most MAX_SECONDS."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {text!r}") from None
    if not 0 < value <= MAX_SECONDS:
        raise argparse.ArgumentTypeError(f"must be > 0 and <= {MAX_SECONDS:g}, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    args = build_parser().parse_args(argv)
    try:
        return _main(args)
    except FedsimError as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code


def _main(args: argparse.Namespace) -> int:
    import pandas as pd

    from fedsim.persist.io import atomic_write, atomic_write_text

    counts = parse_counts(args.clients, "--clients")
    if not 1 <= args.rounds <= MAX_ROUNDS:  # before the output folder and the first point's process
        raise ConfigError(f"--rounds: must be from 1 to {MAX_ROUNDS}, got {args.rounds}")
    if not 1 <= args.repeat <= MAX_REPEAT:
        raise ConfigError(f"--repeat: must be from 1 to {MAX_REPEAT}, got {args.repeat}")
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        raise ConfigError(f"--workers: must be from 1 to {MAX_WORKERS}, got {args.workers}")
    if args.save is not None and not re.fullmatch(r"[a-z0-9_]+", args.save):
        raise ConfigError(f"--save: {args.save[:60]!r} is not a name of lowercase letters, digits and _")
    if args.point:  # a child process: one point, one line of JSON
        cfg = load_point(args.config, args.override, counts[0])
        print(RESULT + json.dumps(measure(cfg, args.workers)), flush=True)
        return 0
    base = load_point(args.config, args.override, max(counts))  # fail early on a bad config
    ks: list[int | None] = list(parse_counts(args.participants, "--participants")) if args.participants else [None]
    skips: list[bool | None] = [None]
    if args.skip_late == "both":
        if not base.stragglers.enabled:
            raise ConfigError("--skip-late both: the config has stragglers.enabled: false, so nobody is late")
        skips = [False, True]
    out = Path(args.out or Path("results") / "stress" / f"{Path(args.config).stem}-{datetime.now():%Y%m%d-%H%M%S}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"--out: cannot make the folder {out} ({exc.strerror or type(exc).__name__})") from None
    note = capped_note(ks, configured_participants(args.config, args.override), counts)
    if note:
        print(note, file=sys.stderr, flush=True)
    rows = []
    for rep in range(args.repeat):
        for k in ks:
            for n in counts:
                for skip in skips:
                    ov = args.override + point_overrides(n, k, skip, args.rounds, out / "runs")
                    print(f"[stress] {n} clients, {min(k, n) if k else 'config'} per round"
                          + ("" if skip is None else f", skip_late={skip}")
                          + (f", repeat {rep + 1}/{args.repeat}" if args.repeat > 1 else "") + " ...",
                          file=sys.stderr, flush=True)
                    row = {**run_point(args, ov, n), "repeat": rep}
                    rows.append(row)
                    print(f"[stress] {row.get('status')}: {row.get('s_per_round', float('nan')):.3f} s/round, "
                          f"start-up {row.get('startup_s', float('nan')):.1f} s, peak RSS "
                          f"{row.get('peak_rss_gb', float('nan')):.2f} GiB", file=sys.stderr, flush=True)
    df = pd.DataFrame(rows)
    df = df[[c for c in COLUMNS if c in df] + [c for c in df if c not in COLUMNS]]
    atomic_write(out / "stress.parquet", lambda tmp: df.to_parquet(tmp, index=False))
    cmd = "fedsim stress " + " ".join(_argv_text(args))
    text = (f"# Stress: {args.config}\n\nCommand: `{cmd}`  \nMeasured {datetime.now():%Y-%m-%d %H:%M} on "
            f"{os.cpu_count()} CPUs; load average {os.getloadavg()[0]:.1f} at the end.\n\n{table(df)}\n")
    atomic_write_text(out / "stress.md", text)
    if args.save:
        saved = BENCH / f"stress_{args.save}"
        atomic_write_text(saved.with_suffix(".csv"), df.drop(columns=["run_dir"], errors="ignore").to_csv(index=False))
        atomic_write_text(saved.with_suffix(".md"), text)
    if (df["status"] == "ok").any():
        plot(df, out / "stress.png")
    print(table(df))
    print(f"wrote {out / 'stress.parquet'}, {out / 'stress.md'}" + (", stress.png" if (df["status"] == "ok").any()
                                                                     else ""))
    return 0 if (df["status"] == "ok").all() else 1


def _argv_text(args: argparse.Namespace) -> list[str]:
    """The command line that reproduces this sweep."""
    out = [args.config, "--clients", args.clients]
    if args.participants:
        out += ["--participants", args.participants]
    if args.skip_late != "config":
        out += ["--skip-late", args.skip_late]
    out += ["--rounds", str(args.rounds)]
    if args.repeat > 1:
        out += ["--repeat", str(args.repeat)]
    if args.out:
        out += ["--out", args.out]
    for o in args.override:
        out += ["-o", o]
    if args.workers:
        out += ["--workers", str(args.workers)]
    if args.save:
        out += ["--save", args.save]
    return out


if __name__ == "__main__":
    sys.exit(main())
