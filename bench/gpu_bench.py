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
    fedsim_seq       fedsim, local backend, one worker, runtime.batch_clients=off (one client after another)
    fedsim_batched   the same with runtime.batch_clients=on
    fedsim_ray_seq   fedsim on Ray, four workers at runtime.client_gpus=0.25, batching off (P only)
    fedsim_ray_batched  the same with batching on (P only)

Each program samples the GPU's utilisation (NVML) and reports its mean over the steady rounds (after the first).
Writes <out>/gpu.json (every run), gpu.md (the table) and gpu.csv; the runs' logs go to <out>/gpu-logs/ and fedsim's
run folders to <out>/gpu-runs/. `--device cpu` runs the same programs on the CPU (to try the script; the tests do).
"""

from __future__ import annotations

import argparse
import csv
import io
import json
import os
import platform
import shlex
import shutil
import subprocess
import sys
from datetime import datetime
from pathlib import Path

from bench.cli import OneLineParser
from bench.common import BenchError, Workload, check_out_dir, check_out_file, name_list
from bench.prepare import DEFAULT_CACHE, check, prepare
from bench.report import fmt
from bench.runner import REPO, load_average, run_program
from bench.workload import BENCH_CONFIGS
from fedsim.config.limits import MAX_SECONDS
from fedsim.errors import FedsimError

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
# what the table and the CSV read of gpu.json (so --render checks them all before it writes anything)
META = {"command": str, "date": str, "machine": str, "gpu": str, "cpus": (int, type(None)), "versions": dict}
NUMBERS = ("total_seconds", "startup_seconds", "seconds_per_round", "gpu_util_mean", "gpu_util_raw_mean",
           "gpu_mem_peak_mb", "peak_rss_mb", "final_accuracy")


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
    """--rounds: one number for every config ({"": R}) or CONFIG=R pairs ({"P": 12, "B": 5}), each config once."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"{text!r}: no rounds given (R or CONFIG=R,...)")
    out: dict[str, int] = {}
    for part in parts:
        name, value = _round_pair(part)
        if name in out:
            raise argparse.ArgumentTypeError(f"{text!r}: config {name!r} is given twice" if name else
                                             f"{text!r}: give one number of rounds for every config, once")
        out[name] = value
    if "" in out and len(out) > 1:
        raise argparse.ArgumentTypeError(f"{text!r}: give one number or CONFIG=R pairs, not both")
    return out


def _round_pair(part: str) -> tuple[str, int]:
    """One entry of --rounds: (NAME upper-cased, rounds) of NAME=ROUNDS, or ("", rounds) of a bare number."""
    name, sep, value = part.partition("=")
    if "=" in value:
        raise argparse.ArgumentTypeError(f"{part!r} is not NAME=ROUNDS")
    if sep and not name.strip():
        raise argparse.ArgumentTypeError(f"{part!r}: no config name before '=' (NAME=ROUNDS)")
    try:
        return (name.strip().upper(), int(value)) if sep else ("", int(name))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{part!r} is not a number of rounds (R or CONFIG=R)") from None


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
    try:
        proc = subprocess.run([python, "-c", "import torch; print(torch.cuda.is_available())"], capture_output=True,
                              text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):  # no such interpreter, or one that hangs: no CUDA to run on
        return False
    return proc.stdout.strip() == "True"


def versions(python: str) -> dict:
    """The programs' torch, numpy, pfl and ray releases, asked of --python itself: so also the check, before anything
    is prepared, that it is an interpreter that runs."""
    code = ("import json, importlib.metadata as m\nout = {}\nfor p in ('torch', 'numpy', 'pfl', 'ray'):\n"
            "    try: out[p] = m.version(p)\n    except Exception: out[p] = None\nprint(json.dumps(out))")
    if not python.strip() or shutil.which(python) is None:
        raise BenchError(f"--python {python}: not an executable file")
    try:
        proc = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=120)
        found = json.loads(proc.stdout) if proc.returncode == 0 else None
    except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
        raise BenchError(f"--python {python}: does not run as Python ({type(exc).__name__})") from None
    if not isinstance(found, dict):
        raise BenchError(f"--python {python}: does not run as Python (exit code {proc.returncode})")
    return found


def plan(args: argparse.Namespace) -> tuple[dict[str, Workload], list[str]]:
    """The configs (with their overrides, each checked) and systems to run, or the BenchError of the first bad
    argument: all of it before anything is prepared."""
    configs = name_list(args.configs.upper(), "--configs", "config", list(CONFIGS))
    systems = name_list(args.systems, "--systems", "system", SYSTEMS)
    for c in args.rounds:
        if c and c not in configs:
            raise BenchError(f"--rounds: config {c!r} is not among --configs {','.join(configs)}")
    if all(s in P_ONLY for s in systems) and "P" not in configs:
        raise BenchError(f"--systems: {', '.join(systems)} run on config P only, and --configs is {','.join(configs)}")
    if not 0 < args.timeout <= MAX_SECONDS:  # NaN too
        raise BenchError(f"--timeout: must be a number of seconds above 0 and at most {MAX_SECONDS:g}, "
                         f"got {args.timeout:g}")
    over = {k: v for k, v in (("n_train", args.n_train), ("n_test", args.n_test),
                              ("clients_per_round", args.clients_per_round)) if v is not None}
    workloads = {c: CONFIGS[c].with_(**over, **_rounds_of(c, args.rounds)) for c in configs}
    for w in workloads.values():  # every config's knobs before anything is prepared
        check(w)
    return workloads, systems


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
    argv_list = list(argv if argv is not None else sys.argv[1:])
    try:
        configs, systems = plan(args)
        out = check_out_dir(args.out, "--out")
        meta = {"command": "python -m bench.gpu_bench " + " ".join(shlex.quote(a) for a in argv_list),
                "date": f"{datetime.now():%Y-%m-%d %H:%M}", "machine": platform.node(), "cpus": os.cpu_count(),
                "gpu": gpu_name(), "versions": versions(args.python)}
        if args.device == "cuda" and not _cuda(args.python):
            raise BenchError("--device cuda: no CUDA device here (--device cpu runs it on the CPU)")
        folders = {c: prepare(w, args.cache, log=print) for c, w in configs.items()}
    except (BenchError, FedsimError) as exc:
        print(f"bench.gpu_bench: error: {exc}", file=sys.stderr)
        return 2
    rows = run_all(configs, systems, folders, args, out, meta)
    print("\n".join(write(out, meta, rows, configs)))
    if all(r["status"] != "ok" for r in rows):
        print(f"bench.gpu_bench: error: every run failed ({len(rows)} of {len(rows)}); their logs are in "
              f"{out / 'gpu-logs'}", file=sys.stderr)
        return 1
    return 0


def run_all(configs: dict[str, Workload], systems: list[str], folders: dict[str, Path], args: argparse.Namespace,
            out: Path, meta: dict) -> list[dict]:
    """Every (config, system) run, each its own process; the results are written after every run, so a bench cut
    short still leaves the earlier ones."""
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for name in configs:
        for system in systems:
            if system in P_ONLY and name != "P":
                continue
            cmd = command(system, folders[name], args.python, args.device, out / "gpu-runs")
            log_path = out / "gpu-logs" / f"{name}-{system}.log"
            print(f"[gpu] {name} {system} (load {load_average():.1f}) ...", flush=True)
            res = run_program(cmd + ["--tag", f"{name}_{system}"], log_path, args.timeout, REPO)
            row = {**res, "config": name, "system": system, "log": str(log_path.relative_to(out))}
            rows.append(row)
            print(f"[gpu] {name} {system}: {res['status']}, {res.get('seconds_per_round')} s/round, total "
                  f"{res.get('total_seconds')} s, GPU {res.get('gpu_util_mean')} % (NVML's buffer: "
                  f"{res.get('gpu_util_raw_mean')} %), acc {res.get('final_accuracy')}",
                  flush=True)
            write(out, meta, rows, configs)  # after every run: a run cut short still leaves the earlier ones
    return rows


def render(path: Path) -> int:
    """The .md and .csv of a gpu.json (or a copy under another name) written again from its command, date and runs,
    as the run wrote them. Everything is checked before anything is written; the .json itself is left as it is."""
    try:
        if path.suffix != ".json":
            raise BenchError("name a .json file (its .md and .csv are written beside it)")
        try:
            meta, rows, configs = read_results(path)
        except BenchError as exc:
            raise BenchError(f"not a gpu.json written by this bench ({exc})") from None
        for suffix in (".csv", ".md"):
            check_out_file(path.with_suffix(suffix), "writing")
        csv_text, md = table_csv(rows), markdown(meta, rows, configs)
        path.with_suffix(".csv").write_text(csv_text)
        path.with_suffix(".md").write_text("\n".join(md) + "\n")
    except (BenchError, OSError) as exc:
        why = exc if isinstance(exc, BenchError) else f"cannot write ({exc.strerror or exc})"
        print(f"bench.gpu_bench: error: --render {path}: {why}", file=sys.stderr)
        return 2
    return 0


def read_results(path: Path) -> tuple[dict, list[dict], dict[str, Workload]]:
    """(meta, runs, the configs as they ran) of a gpu.json, every field the table and CSV read checked."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise BenchError(f"{type(exc).__name__}: {exc}") from None
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list) or not data["runs"]:
        raise BenchError("no list of runs under 'runs'")
    meta = {k: v for k, v in data.items() if k != "runs"}
    for key, kind in META.items():
        if not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise BenchError(f"{key!r} is missing or not a {getattr(kind, '__name__', 'number')}")
    configs: dict[str, Workload] = {}
    for i, r in enumerate(data["runs"]):
        w = _run_config(i, r, configs)
        configs[r["config"]] = w
    return meta, data["runs"], configs


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def _run_config(i: int, r: object, configs: dict[str, Workload]) -> Workload:
    """The checked run `r` (the i-th)'s config, with the rounds and cohort it ran (a failed run may not say)."""
    if not isinstance(r, dict):
        raise BenchError(f"runs[{i}] is not a mapping")
    if not isinstance(r.get("config"), str) or r["config"] not in CONFIGS:
        raise BenchError(f"runs[{i}]: unknown config {r.get('config')!r}")
    if not isinstance(r.get("system"), str) or r["system"] not in LABEL:
        raise BenchError(f"runs[{i}]: unknown system {r.get('system')!r}")
    if not isinstance(r.get("status"), str) or (r["status"] != "ok" and not isinstance(r.get("log"), str)):
        raise BenchError(f"runs[{i}]: no status, or a failed run without its log")
    for key in NUMBERS:
        if r.get(key) is not None and not _number(r[key]):
            raise BenchError(f"runs[{i}]: {key} must be a number, got {r[key]!r}")
    if r.get("round_seconds") is not None and not (isinstance(r["round_seconds"], list)
                                                   and all(x is None or _number(x) for x in r["round_seconds"])):
        raise BenchError(f"runs[{i}]: round_seconds must be a list of numbers")
    ran = {}
    for knob, key in (("rounds", "R"), ("clients_per_round", "K")):
        if r.get(key) is not None:
            if not (isinstance(r[key], int) and not isinstance(r[key], bool) and r[key] >= 1):
                raise BenchError(f"runs[{i}]: {key} must be a whole number >= 1, got {r[key]!r}")
            ran[knob] = r[key]
    w = configs.get(r["config"], CONFIGS[r["config"]]).with_(**ran)
    try:
        check(w)
    except BenchError as exc:
        raise BenchError(f"runs[{i}]: R and K make no workload of config {r['config']}: {exc}") from None
    return w


def write(out: Path, meta: dict, rows: list[dict], configs: dict[str, Workload], stem: str = "gpu") -> list[str]:
    """gpu.json (every run's RESULT_JSON), gpu.csv (the table's columns) and gpu.md; returns the markdown lines."""
    lines = markdown(meta, rows, configs)
    (out / f"{stem}.json").write_text(json.dumps({**meta, "runs": rows}, indent=1) + "\n")
    (out / f"{stem}.csv").write_text(table_csv(rows))
    (out / f"{stem}.md").write_text("\n".join(lines) + "\n")
    return lines


def table_csv(rows: list[dict]) -> str:
    """The CSV of the table's columns, one line per run."""
    buf = io.StringIO(newline="")
    wr = csv.DictWriter(buf, fieldnames=KEYS, extrasaction="ignore")
    wr.writeheader()
    wr.writerows({**r, "first_round_s": (r.get("round_seconds") or [None])[0]} for r in rows)
    return buf.getvalue()


def markdown(meta: dict, rows: list[dict], configs: dict[str, Workload]) -> list[str]:
    """gpu.md's lines: the command, the machine and versions, how to read the columns, the table."""
    v = meta["versions"]
    return ["# fedsim, pfl-research and the plain loop on one GPU", "", f"Command: `{meta['command']}`  ",
            f"Measured {meta['date']} on {meta['machine']}: {meta['gpu']}, {meta['cpus']} CPUs; "
            f"torch {v.get('torch')}, pfl {v.get('pfl')}, ray {v.get('ray')}.", "",
            "s/round = mean of the rounds after the first (each round's time holds its central evaluation); "
            "total = the program's first statement to its result; GPU "
            "util = NVML's share of time a kernel ran, averaged over "
            "those rounds: the "
            "readings polled every 50 ms, and NVML's own buffered samples where the run read them (`python -m "
            "bench.gpu_util_probe` sets both beside a known busy share). fedsim "
            "computes in full float32 (its default `runtime.tf32: false`); the plain loop and pfl keep PyTorch's "
            "default, TF32 tensor cores for convolutions, so their accuracies may part from fedsim's.", "",
            *table(rows, configs)]


if __name__ == "__main__":
    sys.exit(main())
