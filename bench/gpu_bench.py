"""The bench on one GPU: batched against one-after-another client training, and pfl-research beside fedsim.

    python -m bench.gpu_bench [--configs P,A,B,C] [--systems ...] [--rounds R|P=12,B=5] [--out results/bench]
                               [--python PY]

Configs: P = the shape of pfl-research's CIFAR-10 benchmark (1,000 users × 50 images, iid, cohort 50, its small
CNN without dropout, batch 10, SGD lr 0.1 without momentum, one local epoch; synthetic 3×32×32 images in place of
CIFAR-10, which cannot be downloaded here), and the CPU bench's A, B and C (bench.workload.BENCH_CONFIGS). Systems,
each its own process on the same prepared folder, every program on the GPU:

    plain            the plain loop (bench.plain_fedavg --device cuda)
    pfl              pfl-research in one process (bench.pfl_fedavg --device cuda)
    pfl_2proc        pfl-research's torchrun mode with two processes on the one GPU (P only)
    fedsim_seq       fedsim, local backend, one worker, runtime.batch_clients=off
    fedsim_batched   the same with runtime.batch_clients=on
    fedsim_ray_seq   fedsim on Ray, four workers at runtime.client_gpus=0.25, batching off (P only)
    fedsim_ray_batched  the same with batching on (P only)

Each program samples the GPU's utilisation (NVML) and reports its mean over the steady rounds (after the first).
Writes <out>/gpu.json (every run), gpu.md (the table) and gpu.csv; the runs' logs go to <out>/gpu-logs/ and fedsim's
run folders to <out>/gpu-runs/. `--device cpu` runs the same programs on the CPU (to try the script; the tests do).
"""

from __future__ import annotations

import csv
import json
import os
import platform
import shlex
import sys
from datetime import datetime
from pathlib import Path

from bench.cli import OneLineParser
from bench.common import BenchError, Workload
from bench.prepare import DEFAULT_CACHE, check, prepare
from bench.report import fmt
from bench.runner import REPO, load_average, run_program
from bench.workload import BENCH_CONFIGS

PFL_SHAPE = Workload(num_clients=1000, clients_per_round=50, rounds=20, model="cnn", batch_size=10, lr=0.1,
                     momentum=0.0, partition="iid", n_train=50000, n_test=10000, eval_batch_size=1000)
CONFIGS = {"P": PFL_SHAPE, **BENCH_CONFIGS}
SYSTEMS = ["plain", "pfl", "pfl_2proc", "fedsim_seq", "fedsim_batched", "fedsim_ray_seq", "fedsim_ray_batched"]
P_ONLY = {"pfl_2proc", "fedsim_ray_seq", "fedsim_ray_batched"}
LABEL = {"plain": "plain loop", "pfl": "pfl, 1 process", "pfl_2proc": "pfl, 2 processes (torchrun)",
         "fedsim_seq": "fedsim local, one after another", "fedsim_batched": "fedsim local, batched",
         "fedsim_ray_seq": "fedsim Ray 4 × 0.25 GPU, one after another",
         "fedsim_ray_batched": "fedsim Ray 4 × 0.25 GPU, batched"}
KEYS = ["config", "system", "status", "total_seconds", "startup_seconds", "seconds_per_round", "first_round_s",
        "gpu_util_mean", "gpu_util_raw_mean", "gpu_mem_peak_mb", "peak_rss_mb", "final_accuracy", "log"]


def command(system: str, folder: Path, python: str, device: str, runs: Path) -> list[str]:
    """The program line of `system` on the prepared `folder` (fedsim's run folders go under `runs`)."""
    wl = ["--workload", str(folder)]
    fedsim = [python, "-m", "bench.fedsim_fedavg", *wl, "-o", "results.checkpoint_every=0", "-o",
              f"results.root={runs}"]
    return {
        "plain": [python, "-m", "bench.plain_fedavg", *wl, "--threads", "2", "--device", device],
        "pfl": [python, "-m", "bench.pfl_fedavg", *wl, "--processes", "1", "--threads", "2", "--device", device],
        "pfl_2proc": [python, "-m", "bench.pfl_fedavg", *wl, "--processes", "2", "--threads", "1", "--device", device],
        "fedsim_seq": [*fedsim, "--backend", "local", "--workers", "1", "-o", "runtime.batch_clients=off"],
        "fedsim_batched": [*fedsim, "--backend", "local", "--workers", "1", "-o", "runtime.batch_clients=on"],
        "fedsim_ray_seq": [*fedsim, "--backend", "ray", "--workers", "4", "-o", "runtime.client_gpus=0.25",
                           "-o", "runtime.batch_clients=off"],
        "fedsim_ray_batched": [*fedsim, "--backend", "ray", "--workers", "4", "-o", "runtime.client_gpus=0.25",
                               "-o", "runtime.batch_clients=on"],
    }[system]


def rounds_arg(text: str) -> dict[str, int]:
    """--rounds: one number for every config ({"": R}) or CONFIG=R pairs ({"P": 12, "B": 5})."""
    import argparse

    out: dict[str, int] = {}
    for part in (p.strip() for p in text.split(",") if p.strip()):
        name, _, value = part.rpartition("=")
        try:
            out[name.strip().upper()] = int(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{part!r} is not a number of rounds (R or CONFIG=R)") from None
    if "" in out and len(out) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one number or CONFIG=R pairs, not both")
    return out


def _rounds_of(config: str, rounds: dict[str, int]) -> dict[str, int]:
    """The rounds override of `config`, as Workload.with_ keywords (none: the config's own rounds)."""
    value = rounds.get(config, rounds.get(""))
    return {} if value is None else {"rounds": value}


def table(rows: list[dict], configs: dict[str, Workload]) -> list[str]:
    """One row per (config, system): s/round, the first round, total, GPU utilisation (polled, and NVML's own
    buffer where the run read it), memory, accuracy, and s/round against pfl's."""
    out = ["| config | system | s/round | first round s | total s | GPU util % (steady rounds) | "
           "GPU util %, NVML's buffer | GPU MiB peak | final acc | s/round vs pfl (1 process) |",
           "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for name, w in configs.items():
        here = [r for r in rows if r["config"] == name]
        pfl = next((r.get("seconds_per_round") for r in here if r["system"] == "pfl" and r["status"] == "ok"), None)
        shape = f"{name}: N={w.num_clients}, K={w.clients_per_round}, R={w.rounds}, {w.model}, batch {w.batch_size}"
        for r in here:
            if r["status"] != "ok":
                out.append(f"| {shape} | {LABEL[r['system']]} | failed ({r['status']}; log `{r['log']}`) |"
                           " | | | | | | |")
                continue
            spr = r.get("seconds_per_round")
            ratio = f"{spr / pfl:.2f}x" if spr and pfl else "n/a"
            first = (r.get("round_seconds") or [None])[0]
            out.append(f"| {shape} | {LABEL[r['system']]} | {fmt(spr, 3)} | {fmt(first, 2)} | "
                       f"{fmt(r.get('total_seconds'), 1)} | {fmt(r.get('gpu_util_mean'), 1)} | "
                       f"{fmt(r.get('gpu_util_raw_mean'), 1)} | {fmt(r.get('gpu_mem_peak_mb'), 0)} | "
                       f"{fmt(r.get('final_accuracy'), 3)} | {ratio} |")
    return out


def gpu_name() -> str:
    try:
        import torch

        return torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    except Exception as exc:  # the table still says which machine it is
        return f"unknown ({type(exc).__name__})"


def _cuda(python: str) -> bool:
    """Whether the programs' interpreter sees a CUDA device."""
    import subprocess

    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):  # no such interpreter, or one that hangs: no CUDA to run on
        return False
    return proc.stdout.strip() == "True"


def versions(python: str) -> dict:
    import subprocess

    code = ("import json, importlib.metadata as m\nout = {}\nfor p in ('torch', 'numpy', 'pfl', 'ray'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: out[p] = None\nprint(json.dumps(out))")
    proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
    return json.loads(proc.stdout) if proc.returncode == 0 else {}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.gpu_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="P,A,B,C", help="comma-separated: P (pfl's CIFAR-10 shape), A, B, C")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=", ".join(SYSTEMS))
    ap.add_argument("--rounds", type=rounds_arg, default={}, metavar="R|CONFIG=R,...",
                    help="override the rounds: of every config (12), or of some (P=12,B=5)")
    ap.add_argument("--n-train", type=int, default=None, help="override every config's training images (smoke runs)")
    ap.add_argument("--n-test", type=int, default=None, help="override every config's test images (smoke runs)")
    ap.add_argument("--clients-per-round", type=int, default=None,
                    help="override every config's cohort (how much work a round gives the GPU)")
    ap.add_argument("--device", default="cuda", choices=["cuda", "cpu"], help="cpu only to try the script itself")
    ap.add_argument("--python", default=sys.executable, help="the interpreter of every program")
    ap.add_argument("--out", default=str(REPO / "results" / "bench"), help="folder of gpu.json, gpu.md, gpu.csv")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder of prepared workloads")
    ap.add_argument("--timeout", type=float, default=300, help="seconds per program")
    ap.add_argument("--render", type=Path, metavar="GPU_JSON",
                    help="run nothing: write the .md and .csv of GPU_JSON (beside it, same name) again from its runs")
    args = ap.parse_args(argv)
    if args.render is not None:
        return render(args.render)
    names = [c.strip().upper() for c in args.configs.split(",") if c.strip()]
    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    bad = [f"--configs: unknown config {c!r}; choose from {', '.join(CONFIGS)}" for c in names if c not in CONFIGS] + [
        f"--systems: unknown system {s!r}; choose from {', '.join(SYSTEMS)}" for s in systems if s not in SYSTEMS]
    if bad:
        print(f"bench.gpu_bench: error: {bad[0]}", file=sys.stderr)
        return 2
    bad = [f"--rounds: config {c!r} is not among --configs {','.join(names)}" for c in args.rounds if c
           and c not in names]
    if bad:
        print(f"bench.gpu_bench: error: {bad[0]}", file=sys.stderr)
        return 2
    over = {k: v for k, v in (("n_train", args.n_train), ("n_test", args.n_test),
                              ("clients_per_round", args.clients_per_round)) if v is not None}
    configs = {c: CONFIGS[c].with_(**over, **_rounds_of(c, args.rounds)) for c in names}
    try:
        for w in configs.values():  # every config's knobs before anything is prepared
            check(w)
    except BenchError as exc:
        print(f"bench.gpu_bench: error: {exc}", file=sys.stderr)
        return 2
    if args.device == "cuda" and not _cuda(args.python):
        print("bench.gpu_bench: error: --device cuda: no CUDA device here (--device cpu runs it on the CPU)",
              file=sys.stderr)
        return 2
    out = Path(args.out)
    logs = out / "gpu-logs"
    argv_list = list(argv if argv is not None else sys.argv[1:])
    meta = {"command": "python -m bench.gpu_bench " + " ".join(shlex.quote(a) for a in argv_list),
            "date": f"{datetime.now():%Y-%m-%d %H:%M}", "machine": platform.node(), "cpus": os.cpu_count(),
            "gpu": gpu_name(), "versions": versions(args.python)}
    rows: list[dict] = []
    try:
        folders = {c: prepare(w, args.cache, log=print) for c, w in configs.items()}
    except BenchError as exc:
        print(f"bench.gpu_bench: error: {exc}", file=sys.stderr)
        return 2
    out.mkdir(parents=True, exist_ok=True)
    for name in configs:
        for system in systems:
            if system in P_ONLY and name != "P":
                continue
            cmd = command(system, folders[name], args.python, args.device, out / "gpu-runs")
            log_path = logs / f"{name}-{system}.log"
            print(f"[gpu] {name} {system} (load {load_average():.1f}) ...", flush=True)
            res = run_program(cmd + ["--tag", f"{name}_{system}"], log_path, args.timeout, REPO)
            row = {**res, "config": name, "system": system, "log": str(log_path.relative_to(out))}
            rows.append(row)
            print(f"[gpu] {name} {system}: {res['status']}, {res.get('seconds_per_round')} s/round, total "
                  f"{res.get('total_seconds')} s, GPU {res.get('gpu_util_mean')} % (NVML's buffer: "
                  f"{res.get('gpu_util_raw_mean')} %), acc {res.get('final_accuracy')}",
                  flush=True)
            write(out, meta, rows, configs)  # after every run: a run cut short still leaves the earlier ones
    lines = write(out, meta, rows, configs)
    print("\n".join(lines))
    return 0


def render(path: Path) -> int:
    """The .md and .csv of a gpu.json (or a copy under another name) written again from its command, date and runs,
    as the run wrote them."""
    try:
        data = json.loads(path.read_text())
        rows = data.pop("runs")
        configs: dict[str, Workload] = {}
        for r in rows:  # the rounds and cohort that the runs ran (a failed run may not say)
            w = configs.setdefault(r["config"], CONFIGS[r["config"]])
            ran = {k: int(r[key]) for k, key in (("rounds", "R"), ("clients_per_round", "K")) if r.get(key)}
            configs[r["config"]] = w.with_(**ran)
        write(path.parent, data, rows, configs, path.stem)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        print(f"bench.gpu_bench: error: --render {path}: not a gpu.json written by this bench "
              f"({type(exc).__name__}: {exc})", file=sys.stderr)
        return 2
    return 0


def write(out: Path, meta: dict, rows: list[dict], configs: dict[str, Workload], stem: str = "gpu") -> list[str]:
    """gpu.json (every run's RESULT_JSON), gpu.csv (the table's columns) and gpu.md; returns the markdown lines."""
    (out / f"{stem}.json").write_text(json.dumps({**meta, "runs": rows}, indent=1) + "\n")
    with open(out / f"{stem}.csv", "w", newline="") as fh:
        wr = csv.DictWriter(fh, fieldnames=KEYS, extrasaction="ignore")
        wr.writeheader()
        wr.writerows({**r, "first_round_s": (r.get("round_seconds") or [None])[0]} for r in rows)
    v = meta["versions"]
    lines = ["# fedsim, pfl-research and the plain loop on one GPU", "", f"Command: `{meta['command']}`  ",
             f"Measured {meta['date']} on {meta['machine']}: {meta['gpu']}, {meta['cpus']} CPUs; "
             f"torch {v.get('torch')}, pfl {v.get('pfl')}, ray {v.get('ray')}.", "",
             "s/round = mean of the rounds after the first (each round ends with the central evaluation); total = "
             "process start to exit; GPU util = NVML's share of time a kernel ran, averaged over those rounds: the "
             "readings polled every 50 ms, and NVML's own buffered samples where the run read them (`python -m "
             "bench.gpu_util_probe` sets both beside a known busy share). fedsim "
             "computes in full float32 (its default `runtime.tf32: false`); the plain loop and pfl keep PyTorch's "
             "default, TF32 tensor cores for convolutions, so their accuracies may part from fedsim's.", "",
             *table(rows, configs)]
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    sys.exit(main())
