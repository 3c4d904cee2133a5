"""How a batched group's convolutions should run: cuDNN's grouped convolution (what vmap makes of a convolution
over stacked client weights) against an unfold and one batched matrix product (`fedsim.train_batched.conv_mode`).

    python -m bench.batch_conv [--device cuda] [--shapes P,B] [--repeats 5] [--out FILE]

One worker in this process trains one FedAvg phase of 50 clients with `runtime.batch_clients: on`, each mode in
turn, `--repeats` interleaved times after a warm-up. Shapes: P = pfl-research's CIFAR-10 benchmark (the `cnn`,
50 samples of 3×32×32 per client, batch 10, lr 0.1); B = the CPU bench's config B (ResNet-8, batch 32, lr 0.01,
momentum 0.9). Prints RESULT_JSON: per shape and mode the median phase in ms, the device's peak memory in MiB,
and the largest difference of the worker's summed upload from the grouped mode's.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from bench.cli import OneLineParser

SHAPES = {
    "P": {"model": "cnn", "options": "{}", "batch": 10, "lr": 0.1, "momentum": 0.0},
    "B": {"model": "resnet8", "options": "{init: torch}", "batch": 32, "lr": 0.01, "momentum": 0.9},
}
MODES = ("grouped", "matmul")
CLIENTS, SAMPLES = 50, 50


def _worker(shape: dict[str, Any], device: str) -> tuple[Any, Any]:
    import numpy as np

    from fedsim.config import load_config
    from fedsim.runtime.server import Server
    from fedsim.runtime.setup import Partition, Ragged
    from fedsim.runtime.worker import ClientWorker

    rng = np.random.default_rng(0)
    n = CLIENTS * SAMPLES
    x = rng.normal(size=(n, 3, 32, 32)).astype(np.float32)
    y = rng.integers(0, 10, n).astype(np.int64)
    arrays = {"x_train": x, "y_train": y, "x_test": x[:100], "y_test": y[:100]}
    part = Partition(Ragged.from_list([np.arange(i * SAMPLES, (i + 1) * SAMPLES) for i in range(CLIENTS)]),
                     Ragged.from_list([np.array([], int)] * CLIENTS), None)
    meta = {"num_classes": 10, "mean": (0.0,) * 3, "std": (1.0,) * 3}
    cfg = load_config(None, [f"data.num_clients={CLIENTS}", f"train.batch_size={shape['batch']}",
                             f"train.lr={shape['lr']}", f"train.momentum={shape['momentum']}",
                             f"model.name={shape['model']}", f"model.options={shape['options']}",
                             "runtime.batch_clients=on", f"runtime.batch_clients_max={CLIENTS}"])
    return Server(cfg, arrays, part, meta, device=device), ClientWorker(cfg, arrays, part, meta, 0, device)


def _measure(name: str, device: str, repeats: int) -> dict[str, Any]:
    import torch

    from fedsim.algorithms.base import RoundInfo

    server, worker = _worker(SHAPES[name], device)
    ids = list(range(CLIENTS))
    phase = server.phases(0)[0]
    common = server.broadcast(phase, RoundInfo(0, phase.name, ids, ids, {i: 1 for i in ids})).broadcast.common
    cuda = device.startswith("cuda")

    def phase_once(mode: str) -> tuple[float, dict[str, torch.Tensor]]:
        worker.batcher.conv = mode
        if cuda:
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        reply = worker.run_phase(0, 0, phase, common, {}, ids)
        if cuda:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - t0
        assert reply.summed is not None and all(o.status == "ok" for o in reply.outcomes)
        return seconds, {k: v.clone() for k, v in reply.summed.hi.items()}

    out: dict[str, Any] = {}
    sums: dict[str, dict[str, torch.Tensor]] = {}
    for mode in MODES:  # warm-up, and each mode's peak memory on its own
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        _, sums[mode] = phase_once(mode)
        out[mode] = {"peak_mib": round(torch.cuda.max_memory_allocated() / 2**20, 1) if cuda else None}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for _ in range(repeats):
        for mode in MODES:
            times[mode].append(phase_once(mode)[0])
    for mode in MODES:
        diff = max(float((sums[mode][k].double() - sums["grouped"][k].double()).abs().max()) / CLIENTS
                   for k in sums[mode])
        out[mode].update(phase_ms=round(statistics.median(times[mode]) * 1e3, 2), mean_upload_diff=diff)
    out["matmul_vs_grouped"] = round(out["matmul"]["phase_ms"] / out["grouped"]["phase_ms"], 3)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.batch_conv", description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda")
    ap.add_argument("--shapes", default="P,B", help="comma-separated, of " + ", ".join(SHAPES))
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--out", type=Path, help="also write the result as JSON here")
    args = ap.parse_args(argv)
    shapes = [s for s in args.shapes.split(",") if s]
    bad = [s for s in shapes if s not in SHAPES]
    if bad or not shapes:
        print(f"batch_conv: error: --shapes takes {', '.join(SHAPES)}, got {args.shapes!r}", file=sys.stderr)
        return 2
    if args.repeats < 1:
        print("batch_conv: error: --repeats must be at least 1", file=sys.stderr)
        return 2
    import torch

    if args.device not in ("cpu", "cuda") or (args.device == "cuda" and not torch.cuda.is_available()):
        print(f"batch_conv: error: --device {args.device!r} is not available here (cpu or cuda)", file=sys.stderr)
        return 2
    from bench.common import emit_result

    result = {"device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
              "clients": CLIENTS, "samples": SAMPLES, "repeats": args.repeats,
              "shapes": {s: _measure(s, args.device, args.repeats) for s in shapes}}
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    emit_result(result)
    return 0


if __name__ == "__main__":
    sys.exit(main())
