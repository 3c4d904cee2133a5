"""pfl-research's several-process mode of `python -m bench.pfl_fedavg` (`--processes 2`): this process starts
pfl's workers through `torchrun`, samples the memory of the whole tree and prints the RESULT_JSON; the workers do
the training (bench.pfl_fedavg). It imports no torch: it only waits, so it should weigh what a plain interpreter
does, as the process a user types `torchrun` into would, not the half gigabyte of a torch import, and start
`torchrun` without first spending a torch import's second."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from bench.cli import OneLineParser
from bench.measure import (
    BenchError,
    GpuSampler,
    TreeMemSampler,
    Workload,
    emit_result,
    pss_interval_from_env,
    read_workload,
    round_summary,
    steady_window,
)

REPO = Path(__file__).resolve().parents[1]
DESCRIPTION = "The prepared FedAvg workload on pfl-research (`pfl[pytorch]`): its FederatedAveraging algorithm, its " \
              "simulated aggregation backend and its PyTorchModel, doing the same math as the plain loop."


def parse(argv: list[str] | None) -> argparse.Namespace:
    """`python -m bench.pfl_fedavg`'s arguments (both modes)."""
    ap = OneLineParser(prog="python -m bench.pfl_fedavg", description=DESCRIPTION)
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--processes", type=int, default=1, choices=[1, 2, 4], help="1: one process; more: torchrun "
                                                                                 "workers")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="pfl's device (PFL_PYTORCH_DEVICE)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads per process (0: 2 for one process, 1 each "
                                                            "for two)")
    ap.add_argument("--worker-result", default=None, help=argparse.SUPPRESS)  # set by the launcher for its workers
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    args.threads = args.threads or (2 if args.processes == 1 else 1)
    return args


def launches(args: argparse.Namespace) -> bool:
    """Whether these arguments ask for the launcher (several processes), not a worker or the one-process mode."""
    return args.processes > 1 and not args.worker_result


def launch(args: argparse.Namespace) -> dict:
    """Start `torchrun` with `--processes` workers on this host and read the main worker's measurements back."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.is_file():
        raise BenchError(f"{torchrun}: not found; --processes 2 needs pfl's venv with torch")
    with tempfile.TemporaryDirectory(prefix="pfl-bench-") as tmp:
        out = Path(tmp) / "worker.json"
        cmd = [str(torchrun), "--standalone", "--nnodes", "1", "--nproc-per-node", str(args.processes), "-m",
               "bench.pfl_fedavg", "--workload", str(args.workload), "--threads", str(args.threads),
               "--worker-result", str(out)]
        path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
        env = {**os.environ, "PFL_PYTORCH_DEVICE": args.device, "OMP_NUM_THREADS": str(args.threads),
               "PYTHONPATH": path, **({"CUDA_VISIBLE_DEVICES": ""} if args.device == "cpu" else {})}
        rc = subprocess.run(cmd, cwd=REPO, env=env).returncode
        if rc != 0 or not out.is_file():
            raise BenchError(f"torchrun workers failed (exit {rc}); see the output above")
        return json.loads(out.read_text())


def announce(w: Workload, args: argparse.Namespace) -> None:
    """The run's first line of output: the workload and the mode."""
    print(f"[pfl] N={w.num_clients} K={w.clients_per_round} R={w.rounds} model={w.model} "
          f"processes={args.processes} threads={args.threads} device={args.device}", flush=True)


def measured(args: argparse.Namespace, t_start: float, t_start_wall: float,
             body: Callable[[], tuple[Workload, dict]]) -> int:
    """Run `body` (it returns the workload and what the training process measured) under the memory and GPU
    samplers and print the RESULT_JSON; times count from `t_start` (the program's first statement). A BenchError
    is one line, exit 2."""
    try:
        sampler = TreeMemSampler(pss_interval=pss_interval_from_env())
        sampler.start()
        gpu = GpuSampler()
        gpu.start()
        w, fields = body()
    except BenchError as exc:
        print(f"pfl_fedavg: error: {exc}", file=sys.stderr)
        return 2
    t_done, t_done_wall = time.perf_counter(), time.time()
    sampler.stop()
    gpu.stop()
    emit_result(result(args, w, fields, t_start, t_start_wall, t_done, t_done_wall, sampler, gpu))
    return 0


def launcher_main(args: argparse.Namespace, t_start: float, t_start_wall: float) -> int:
    """Run the workers through `torchrun` and print the RESULT_JSON."""

    def body() -> tuple[Workload, dict]:
        w = read_workload(Path(args.workload))
        announce(w, args)
        return w, launch(args)

    return measured(args, t_start, t_start_wall, body)


def result(args: argparse.Namespace, w: Workload, measured: dict, t_start: float, t_start_wall: float, t_done: float,
           t_done_wall: float, sampler: TreeMemSampler, gpu: GpuSampler) -> dict:
    """The RESULT_JSON of a pfl run (either mode) from what its training process measured."""
    return {
        "system": "pfl" if args.processes == 1 else "pfl_multiprocess", "tag": args.tag,
        "pfl": metadata.version("pfl"), "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds,
        "E": w.local_epochs, "model": w.model, "processes": args.processes, "threads": args.threads,
        "device": args.device, "startup_seconds": round(measured["loop_start"] - t_start_wall, 3),
        "shutdown_seconds": round(t_done_wall - measured["last_round_end"], 3) if measured["last_round_end"] else None,
        **round_summary(measured["round_times"], measured["samples"], t_start, t_done),
        **sampler.fields(), **gpu.fields(*steady_window(measured.get("round_end_wall", []))),
        "final_accuracy": measured["final_accuracy"], "final_loss": measured["final_loss"], "pid": os.getpid(),
    }
