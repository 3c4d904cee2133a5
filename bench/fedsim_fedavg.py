"""The prepared FedAvg workload run by fedsim, printing the same RESULT_JSON fields as the plain loop and Flower.

    python -m bench.fedsim_fedavg --workload <folder from bench.prepare> [--workers 2] [--backend ray] [-o KEY=VALUE]
        [--profile-rounds FIRST:LAST --profile-out FILE]

`--profile-rounds 2:4` (local backend, where the clients train in this process) records those rounds with
torch.profiler, imports and start-up left out: its table of operators goes to `--profile-out` and its totals (device
busy time, kernel launches, waits for the device, host-to-device copies) into RESULT_JSON as `profile_*`. The
recorded rounds run slower than the others by the profiler's own cost.

Total seconds count from before the heavy imports, so imports and Ray's start are included, as for the other
programs. A round's time runs from the end of the previous one to the end of this one, as Flower's does (a
round ends with its rows handed to fedsim's writer thread, which writes the tables and checkpoint while the next
round trains; the last round's are written within the shutdown time); peak RSS is summed over this process and
all its descendants (Ray's daemons and workers included).
"""

from __future__ import annotations

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import math  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

from bench.cli import OneLineParser  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from collections.abc import Callable  # noqa: E402
from typing import TYPE_CHECKING, Any  # noqa: E402

from fedsim.config.limits import MAX_CPUS, MAX_WORKERS  # noqa: E402
from fedsim.config.schema import apply_overrides  # noqa: E402
from fedsim.errors import ConfigError  # noqa: E402
from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo  # noqa: E402

if TYPE_CHECKING:
    from bench.common import GpuSampler, TreeMemSampler, Workload


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = OneLineParser(prog="python -m bench.fedsim_fedavg", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--backend", choices=["ray", "local"], default="ray")
    ap.add_argument("--workers", type=int, default=None, help="client workers (default: what the CPUs allow)")
    ap.add_argument("--client-cpus", type=float, default=None, help="runtime.client_cpus")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="any fedsim config override, e.g. -o results.checkpoint_every=0")
    ap.add_argument("--profile-rounds", type=round_span, default=None, metavar="FIRST:LAST",
                    help="record rounds FIRST to LAST (1-based, inclusive) with torch.profiler; --backend local")
    ap.add_argument("--profile-out", default=None, help="where the profile's operator table goes (default: stdout)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.profile_rounds is not None and args.backend != "local":
        ap.error("--profile-rounds needs --backend local (Ray's workers train in other processes)")
    problem = numbers_problem(args) or profile_out_problem(args) or workload_problem(args.workload, args.override)
    if problem:
        ap.error(problem)
    return args


def numbers_problem(args: argparse.Namespace) -> str | None:
    """--workers and --client-cpus outside fedsim's limits (0 is no default, and NaN no number of CPUs)."""
    if args.workers is not None and not 1 <= args.workers <= MAX_WORKERS:
        return f"--workers: must be from 1 to {MAX_WORKERS}, got {args.workers}"
    if args.client_cpus is not None and not (0 < args.client_cpus <= MAX_CPUS and math.isfinite(args.client_cpus)):
        return f"--client-cpus: must be a number above 0 and at most {MAX_CPUS}, got {args.client_cpus}"
    return None


def profile_out_problem(args: argparse.Namespace) -> str | None:
    """--profile-out: only with --profile-rounds, and a file that can be written, found out before the run rather
    than after it. --profile-rounds means --backend local, so importing torch here delays no Ray start."""
    if args.profile_out is None:
        return None
    if args.profile_rounds is None:
        return "--profile-out: needs --profile-rounds (there is no profile to write)"
    from bench.common import BenchError, check_out_file

    try:
        check_out_file(args.profile_out, "--profile-out")
    except BenchError as exc:
        return str(exc)
    return None


# the config keys a prepared folder's files fix, and the workload.json knob of each
FIXED = {"rounds": "rounds", "seed": "seed", "data.num_clients": "num_clients",
         "participation.clients_per_round": "clients_per_round", "model.name": "model"}


def workload_problem(folder: str, overrides: list[str]) -> str | None:
    """Before Ray starts (which takes seconds and writes to stderr): `folder` holds a workload.json, and no -o
    changes a knob its files fix. The standard library only, not torch: load_prepared checks the rest while Ray
    starts, and bench.workload.check_matches the resolved config."""
    meta_path = Path(folder) / "workload.json"
    if not meta_path.is_file():
        return (f"{folder}: not a prepared bench workload (no workload.json); create it with "
                "`python -m bench.prepare`")
    try:
        knobs = json.loads(meta_path.read_text())["workload"]
        raw = apply_overrides({}, overrides)
    except ConfigError as exc:
        return str(exc)
    except (OSError, ValueError, KeyError, TypeError) as exc:
        return f"{meta_path}: unreadable ({type(exc).__name__}: {exc})"
    for key, knob in FIXED.items():
        node: object = raw
        for part in key.split("."):
            node = node.get(part, _UNSET) if isinstance(node, dict) else _UNSET
        if node is not _UNSET and isinstance(knobs, dict) and node != knobs.get(knob):
            return (f"{key}={node}: the workload {folder} was prepared with {knobs.get(knob)}; prepare another "
                    "(`python -m bench.prepare`) rather than override it")
    return None


_UNSET = object()  # a key no -o sets


def round_span(text: str) -> tuple[int, int]:
    """FIRST:LAST, two round numbers with 1 <= FIRST <= LAST (argparse's type for --profile-rounds)."""
    first, sep, last = text.partition(":")
    try:
        span = (int(first), int(last if sep else first))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST:LAST, two round numbers") from None
    if not 1 <= span[0] <= span[1]:
        raise argparse.ArgumentTypeError(f"{text!r}: expected 1 <= FIRST <= LAST")
    return span


def main(argv: list[str] | None = None) -> int:
    from fedsim.errors import FedsimError

    args = parse(argv)
    from fedsim.runtime.allocator import keep_freed_blocks

    keep_freed_blocks()  # as the `fedsim` command does in its own process
    boot = None
    if args.backend == "ray":  # as `fedsim run` does: Ray starts while torch imports and the workload loads
        from actors.boot import RayBoot

        boot = RayBoot(None)
    from bench.common import BenchError, GpuSampler, TreeMemSampler, load_prepared, pss_interval_from_env

    try:
        sampler = TreeMemSampler(pss_interval=pss_interval_from_env())
        sampler.start()
        gpu = GpuSampler()
        gpu.start()
        w = load_prepared(args.workload).workload
        return _run(args, w, sampler, gpu, boot)
    except (BenchError, FedsimError) as exc:
        print(f"fedsim_fedavg: error: {exc}", file=sys.stderr)
        return 2
    finally:
        if boot is not None:
            boot.stop(60.0)  # the run has shut Ray down already, unless it failed before it began


class BenchClock(Callback):
    """The callback that timestamps each round's start (its draw) and end (its files written) and prints its line. A
    round's time runs from its start to the next one's."""

    def __init__(self) -> None:
        self.t_loop = time.perf_counter()
        self.starts: list[float] = []
        self.starts_wall: list[float] = []
        self.marks: list[float] = []
        self.marks_wall: list[float] = []
        self.rows: list[dict] = []
        self.backend: dict = {}

    def timed(self, draw: Callable) -> Callable:
        """`draw` (Inputs.draw, called as each round starts), noting when it is called."""
        def noted(*args: Any) -> Any:
            self.starts.append(time.perf_counter())
            self.starts_wall.append(time.time())
            return draw(*args)
        return noted

    def on_setup_end(self, run: RunInfo) -> None:
        self.backend = run.backend
        self.t_loop = time.perf_counter()

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        since = self.starts[round] if round < len(self.starts) else self.t_loop
        self.marks.append(time.perf_counter())
        self.marks_wall.append(time.time())
        row = rows.row
        self.rows.append(row)
        print(f"[fedsim] round {round + 1}: {self.marks[-1] - since:.3f}s since it started "
              f"(clients {row.get('wall_clients_s', 0):.3f}s, "
              f"server {row.get('wall_server_s', 0):.3f}s, eval {row.get('wall_eval_s', 0):.3f}s) "
              f"acc={row.get('accuracy', float('nan')):.4f}", flush=True)


class RoundProfiler(Callback):
    """torch.profiler over rounds FIRST..LAST: started when round FIRST-1 ends (or the set-up does), stopped when
    round LAST ends; `fields` are its totals for RESULT_JSON, `table` its operators by self time."""

    SYNCS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")

    def __init__(self, first: int, last: int) -> None:
        self.first, self.last = first, last
        self.prof: Any = None
        self.t0 = self.wall = 0.0
        self.table = ""
        self.fields: dict[str, Any] = {}

    def _start(self) -> None:
        import torch
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
        self.prof = profile(activities=acts)
        self.prof.__enter__()
        self.t0 = time.perf_counter()

    def on_setup_end(self, run: RunInfo) -> None:
        if self.first == 1:
            self._start()

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        number = round + 1
        if number == self.first - 1:
            self._start()
        elif number == self.last:
            self.stop()

    def stop(self) -> None:
        """End the recording (when the run stopped before round LAST, at its end) and summarise it."""
        if self.prof is None:
            return
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        self.wall = time.perf_counter() - self.t0
        self.prof.__exit__(None, None, None)
        self._summarise()
        self.prof = None

    def _summarise(self) -> None:
        events = self.prof.key_averages()
        device = any(e.self_device_time_total > 0 for e in events)
        self.table = events.table(sort_by="self_device_time_total" if device else "self_cpu_time_total", row_limit=30)
        self.fields = profile_fields(events, self.wall, self.first, self.last)


def profile_fields(events: Any, wall: float, first: int, last: int) -> dict[str, Any]:
    """RESULT_JSON's `profile_*` totals of profiler `events` (key_averages rows) over `wall` seconds of rounds
    FIRST to LAST: device busy time and share, aten operators, kernel launches, waits for the device, copies to it."""
    count = {e.key: e.count for e in events}
    busy_s = device_busy_seconds(events)
    return {
        "profile_rounds": [first, last], "profile_wall_s": round(wall, 4),
        "profile_device_busy_s": round(busy_s, 4),
        "profile_device_busy": round(busy_s / wall, 4) if wall > 0 else None,
        "profile_aten_ops": sum(e.count for e in events if e.key.startswith("aten::")),
        "profile_kernel_launches": count.get("cudaLaunchKernel", 0) + count.get("cuLaunchKernel", 0),
        "profile_device_waits": sum(count.get(k, 0) for k in RoundProfiler.SYNCS),
        "profile_host_to_device_copies": sum(c for k, c in count.items() if k.startswith("Memcpy HtoD")),
    }


def device_busy_seconds(events: Any) -> float:
    """The device's busy time in profiler `events`: the kernels' and copies' own rows only (an operator's self device
    time is its kernels' time again, so adding both would count each kernel twice)."""
    from torch.autograd import DeviceType

    return sum(e.self_device_time_total for e in events if e.device_type not in (DeviceType.CPU, None)) / 1e6


def _run(args: argparse.Namespace, w: Workload, sampler: TreeMemSampler, gpu: GpuSampler, boot: Any) -> int:
    """Run the prepared workload through fedsim's driver, every round, and print RESULT_JSON."""
    from actors.backend import make_backend
    from bench.common import BenchError, emit_result, load_prepared, round_summary, steady_window
    from bench.workload import make_config, prepared_inputs
    from fedsim.runtime.loop import run

    overrides = [f"runtime.backend={args.backend}"] + (
        [f"runtime.client_cpus={args.client_cpus}"] if args.client_cpus is not None else []) + args.override
    cfg = make_config(w, overrides)
    print(f"[fedsim] N={w.num_clients} K={w.clients_per_round} R={w.rounds} model={w.model} "
          f"backend={cfg.runtime.backend} client_cpus={cfg.runtime.client_cpus}", flush=True)
    p = load_prepared(args.workload)
    sizes, draws = p.shard_sizes(), p.draws
    del p
    profiler = None
    if args.profile_rounds:
        if args.profile_rounds[1] > w.rounds:
            raise BenchError(f"--profile-rounds {args.profile_rounds[0]}:{args.profile_rounds[1]}: the workload has "
                             f"{w.rounds} rounds")
        profiler = RoundProfiler(*args.profile_rounds)
    inputs = prepared_inputs(cfg, args.workload)  # checks the config against the folder before anything starts
    clock = BenchClock()
    inputs = dataclasses.replace(inputs, draw=clock.timed(inputs.draw))
    run_dir = run(cfg, make_backend(cfg, args.workers, boot), callbacks=[clock, *([profiler] if profiler else [])],
                  inputs=inputs)
    t_done = time.perf_counter()
    sampler.stop()
    gpu.stop()
    if profiler is not None:
        profiler.stop()  # a run that stopped early ends the recording with it
        if args.profile_out:
            Path(args.profile_out).write_text(profiler.table + "\n")
        else:
            print(profiler.table, flush=True)
    marks, rows = clock.marks, clock.rows
    starts = clock.starts[:len(rows)]  # each round's start; the next one's, and the last round's end, close it
    round_times = [b - a for a, b in zip(starts, starts[1:] + marks[-1:], strict=True)]
    t_loop = clock.t_loop
    samples = [int(sizes[d].sum()) for d in draws[:len(rows)]]
    emit_result({
        "system": "fedsim", "tag": args.tag, "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds,
        "E": w.local_epochs, "model": w.model, "backend": cfg.runtime.backend,
        "workers": clock.backend.get("num_workers") or None, "client_cpus": cfg.runtime.client_cpus,
        "startup_seconds": round(t_loop - T_START, 3),
        "backend_start_seconds": round(clock.backend.get("startup_s", float("nan")), 3),
        "shutdown_seconds": round(t_done - marks[-1], 3) if marks else None,
        **round_summary(round_times, samples, T_START, t_done),
        "client_compute_seconds": [round(float(r.get("wall_clients_s", 0)), 3) for r in rows],
        "eval_seconds": [round(float(r.get("wall_eval_s", 0)), 3) for r in rows],
        **sampler.fields(), **gpu.fields(*steady_window(clock.starts_wall[1:len(rows)] + clock.marks_wall[-1:])),
        **(profiler.fields if profiler is not None else {}),
        "batch_clients": str(cfg.runtime.batch_clients), "client_gpus": cfg.runtime.client_gpus,
        "clients_batched": int(sum(r.get("clients_batched", 0) for r in rows)),  # trained together, all rounds
        "final_accuracy": round(float(rows[-1].get("accuracy", float("nan"))), 4) if rows else None,
        "final_loss": round(float(rows[-1].get("loss", float("nan"))), 4) if rows else None,
        "run_dir": str(run_dir), "pid": os.getpid(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
