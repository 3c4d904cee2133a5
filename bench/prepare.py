"""Prepare a FedAvg bench workload once, before any timed run: every file the three programs load.

    python -m bench.prepare [-N 100] [-K 10] [-R 5] [--model resnet8] [--cache results/bench/cache]

Prints the workload folder. Everything is derived from the seeds with fedsim's own pieces: the synthetic
images (`fedsim.data.synthetic`), the partition (`fedsim.data.partition`: Dirichlet with at least one sample
per client, or iid), the initial weights (fedsim's model, seeded by the run seed) and each drawn client's shuffle
seed (`fedsim.runtime.setup.client_seed`, what fedsim's workers use). Per round, K of the N clients are
drawn without replacement from `default_rng([seed, round])`. Files:

    <cache>/data-.../{x_train,y_train,x_test,y_test}.npy        the images, shared by workloads on the same data
    <cache>/<workload>/workload.json                           the knobs and the data folder's name
    <cache>/<workload>/partition.npz                           offsets (N+1) and flat sample indices
    <cache>/<workload>/draws.npy, seeds.npy                    rounds × K client ids and their shuffle seeds
    <cache>/<workload>/init.pt                                 the initial state dict (torch.load weights_only)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import asdict, fields
from pathlib import Path

import numpy as np
import torch

from bench.cli import OneLineParser
from bench.common import IMAGE_SHAPE, MODELS, PARTITIONS, BenchError, Workload, check_out_dir
from fedsim.config.limits import MAX_ARRAY_BYTES, MAX_BATCH, MAX_CLIENTS, MAX_EPOCHS, MAX_ROUNDS, MAX_SAMPLES, MAX_SEED
from fedsim.errors import FedsimError

REPO = Path(__file__).resolve().parents[1]
DEFAULT_CACHE = REPO / "results" / "bench" / "cache"
MIN_SAMPLES = 1  # 10,000 clients share 20,000 images: every client gets at least one
# fedsim's options that give the workload's models: ResNet-8 with PyTorch's default layer init, a 3072-64-10 MLP
MODEL_OPTIONS: dict[str, dict] = {"resnet8": {"init": "torch"}, "mlp": {"hidden": 64, "layers": 1}, "cnn": {}}
# each whole-number knob's range: fedsim's own limits, so a typo (-R 1000000000000) is refused, not run for ever
RANGES = {"num_clients": (1, MAX_CLIENTS), "clients_per_round": (1, MAX_CLIENTS), "rounds": (1, MAX_ROUNDS),
          "local_epochs": (1, MAX_EPOCHS), "batch_size": (1, MAX_BATCH), "n_train": (1, MAX_SAMPLES),
          "n_test": (1, MAX_SAMPLES), "eval_batch_size": (1, MAX_BATCH), "seed": (0, MAX_SEED),
          "data_seed": (0, MAX_SEED)}


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    """One flag per Workload knob (`--num-clients`/`-N`, `--clients-per-round`/`-K`, `--rounds`/`-R`, ...)."""
    short = {"num_clients": "-N", "clients_per_round": "-K", "rounds": "-R", "local_epochs": "-E"}
    for f in fields(Workload):
        flags = [f"--{f.name.replace('_', '-')}"] + ([short[f.name]] if f.name in short else [])
        kind = {"int": int, "float": float, "str": str}[f.type if isinstance(f.type, str) else f.type.__name__]
        extra = {"choices": list(MODELS)} if f.name == "model" else {"choices": list(PARTITIONS)} \
            if f.name == "partition" else {}
        ap.add_argument(*flags, type=kind, default=f.default, **extra)


def workload_from_args(ns: argparse.Namespace) -> Workload:
    return Workload(**{f.name: getattr(ns, f.name) for f in fields(Workload)})


def check(w: Workload) -> None:
    """Knobs that cannot make a workload, named: out of range (fedsim's limits), not finite, or at odds with each
    other. gpu_bench and fedavg_bench check their configs here too, before anything is prepared."""
    if w.model not in MODELS:
        raise BenchError(f"--model: unknown model {w.model!r}; choose one of {list(MODELS)}")
    for name, (low, high) in RANGES.items():
        value = getattr(w, name)
        if value < low:
            raise BenchError(f"{flag(name)}: must be >= {low}, got {value}")
        if value > high:
            raise BenchError(f"{flag(name)}: must be <= {high}, got {value}")
    if w.clients_per_round > w.num_clients:
        raise BenchError(f"--clients-per-round: {w.clients_per_round} is more than the {w.num_clients} clients")
    if w.num_clients * MIN_SAMPLES > w.n_train:
        raise BenchError(f"--num-clients: {w.num_clients} clients need at least {w.num_clients} training images, "
                         f"--n-train is {w.n_train}")
    if w.rounds * w.clients_per_round > MAX_SAMPLES:
        raise BenchError(f"--rounds: {w.rounds} rounds of {w.clients_per_round} clients are more than "
                         f"{MAX_SAMPLES} client draws")
    nbytes = (w.n_train + w.n_test) * math.prod(IMAGE_SHAPE) * 4
    if nbytes > MAX_ARRAY_BYTES:
        raise BenchError(f"--n-train: {w.n_train} + {w.n_test} images would take {nbytes / 2**30:,.0f} GiB "
                         f"(the limit is {MAX_ARRAY_BYTES / 2**30:,.0f} GiB)")
    if w.partition not in PARTITIONS:
        raise BenchError(f"--partition: unknown partition {w.partition!r}; choose one of {list(PARTITIONS)}")
    _check_reals(w)


def _check_reals(w: Workload) -> None:
    """The real-valued knobs: finite (a NaN passes every `<=` test and trains on NaN) and in their sensible range."""
    rules = [("lr", w.lr > 0, "> 0"), ("momentum", 0 <= w.momentum < 1, ">= 0 and < 1"),
             ("alpha", w.alpha > 0, "> 0"), ("amp", w.amp >= 0, ">= 0")]
    for name, ok, want in rules:
        if not (ok and math.isfinite(getattr(w, name))):
            raise BenchError(f"{flag(name)}: must be a finite number {want}, got {getattr(w, name)}")


def flag(knob: str) -> str:
    """The command-line flag of a Workload knob (`n_train` -> `--n-train`)."""
    return f"--{knob.replace('_', '-')}"


def draws_and_seeds(w: Workload) -> tuple[np.ndarray, np.ndarray]:
    """Each round's sorted client draw and, per drawn client, the shuffle seed fedsim's worker gives it."""
    from fedsim.runtime.setup import client_seed

    draws = np.stack([np.sort(np.random.default_rng([w.seed, r]).choice(w.num_clients, w.clients_per_round,
                                                                        replace=False)) for r in range(w.rounds)])
    seeds = np.array([[client_seed(w.seed, r, int(c), 0) for c in draws[r]] for r in range(w.rounds)], np.int64)
    return draws.astype(np.int64), seeds


def initial_state(w: Workload) -> dict[str, torch.Tensor]:
    """fedsim's model of the workload, initialised under torch.manual_seed(seed)."""
    from fedsim.models import build_model

    torch.manual_seed(w.seed)
    model = build_model(w.model, 3, 10, 32, **MODEL_OPTIONS[w.model])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _same_seeds(folder: Path, seeds: np.ndarray) -> bool:
    """Whether a prepared folder's client seeds are the ones this fedsim derives."""
    try:
        return bool(np.array_equal(np.load(folder / "seeds.npy", allow_pickle=False), seeds))
    except (OSError, ValueError):
        return False


def _publish(build: Callable[[Path], None], final: Path) -> None:
    """Write into a private temporary folder, then rename it into place: a reader sees all the files or none."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        build(tmp)
        try:
            os.rename(tmp, final)
        except OSError:  # another process published it first: theirs is the same
            if not final.is_dir():
                raise
    except OSError as exc:  # a cache under a file, in /proc, read-only or full: one line, no half-written folder
        raise BenchError(f"--cache {final.parent}: cannot write {final.name} there ({exc.strerror or exc})") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def prepare(w: Workload, cache: str | Path = DEFAULT_CACHE, log: Callable[[str], None] | None = None) -> Path:
    """The workload's folder under `cache`, created (with its data folder) when missing; deterministic."""
    from fedsim.data.partition import partition
    from fedsim.data.synthetic import make_synthetic

    check(w)
    if not str(cache).strip():  # Path("") is the working directory
        raise BenchError("--cache: empty path")
    cache = Path(cache)
    data_dir, folder = cache / w.data_key(), cache / w.key()
    if not (data_dir / "y_test.npy").is_file() or not (folder / "workload.json").is_file():
        check_out_dir(cache, "--cache")  # before the first file is made (a read-only cache of ready folders is fine)
    if not (data_dir / "y_test.npy").is_file():
        if log:
            log(f"preparing {data_dir}")
        arrays = dict(zip(("x_train", "y_train", "x_test", "y_test"),
                          make_synthetic(w.n_train, w.n_test, seed=w.data_seed, amp=w.amp), strict=True))
        _publish(lambda d: [np.save(d / f"{k}.npy", np.ascontiguousarray(v)) for k, v in arrays.items()], data_dir)
    draws, seeds = draws_and_seeds(w)
    if (folder / "workload.json").is_file():
        if _same_seeds(folder, seeds):
            return folder
        if log:  # prepared by a fedsim whose workers derive other seeds: the programs would refuse it
            log(f"{folder} was prepared with other client seeds: preparing it again")
        shutil.rmtree(folder)
    if log:
        log(f"preparing {folder}")
    y_train = np.load(data_dir / "y_train.npy", allow_pickle=False)
    parts = partition(y_train, w.num_clients, w.partition, w.seed, alpha=w.alpha, min_samples=MIN_SAMPLES)
    offsets = np.zeros(w.num_clients + 1, np.int64)
    np.cumsum([len(p) for p in parts], out=offsets[1:])
    state = initial_state(w)

    def write(d: Path) -> None:
        np.savez(d / "partition.npz", offsets=offsets, flat=np.concatenate(parts).astype(np.int64))
        np.save(d / "draws.npy", draws)
        np.save(d / "seeds.npy", seeds)
        torch.save(state, d / "init.pt")
        (d / "workload.json").write_text(json.dumps({"workload": asdict(w), "data": w.data_key()}, indent=1) + "\n")

    _publish(write, folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.prepare", description=__doc__.splitlines()[0])
    add_workload_args(ap)
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder of prepared workloads")
    args = ap.parse_args(argv)
    try:
        print(prepare(workload_from_args(args), args.cache, log=lambda m: print(m, file=sys.stderr)))
    except (BenchError, FedsimError) as exc:
        print(f"bench.prepare: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
