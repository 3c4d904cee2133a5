"""The host's cost of training clients together, where the clients' compute is negligible: on a GPU a batched
phase of small clients waits on this Python side, not on the device (C's batched round kept an H100 8% busy).

    python -m bench.batch_host_cost [--clients 100] [--phases 8] [--model mlp|cnn|resnet8]

One worker in this process, on the CPU, with `--clients` clients of 2 to 19 samples and `runtime.batch_clients:
on`: by default an MLP with one hidden layer of 8 units on 1×4×4 inputs; `cnn` or `resnet8` on 3×8×8 inputs.
After a first phase (timed alone: it includes whatever the process imports or builds on first use) it runs
`--phases` FedAvg phases and prints RESULT_JSON with the first phase and the medians of the later phases and of
their `train_together` calls (the batched trainer: schedules, stacking, the vmapped steps, the clients' weights
handed back), in milliseconds, and `trained_together`, how many client trainings of all the phases (the first
included) the batched trainer did: clients × (phases + 1) when every phase was batched (a trainer call that raised
falls back to one by one, and neither its time nor its clients count).
"""

from __future__ import annotations

import statistics
import sys
import time
from typing import Any

from bench.cli import OneLineParser

MAX_CLIENTS = 100_000  # clients of one batched phase, all in this process: far above what C's rounds train together
MAX_PHASES = 100_000  # timed phases: a median needs dozens, not a run that never ends


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.batch_host_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=100)
    ap.add_argument("--phases", type=int, default=8)
    ap.add_argument("--model", choices=("mlp", "cnn", "resnet8"), default="mlp")
    args = ap.parse_args(argv)
    problem = bounds_problem(args.clients, args.phases)
    if problem:
        print(f"batch_host_cost: error: {problem}", file=sys.stderr)
        return 2
    import numpy as np
    import torch

    import fedsim.runtime.batching as batching
    from bench.common import emit_result
    from fedsim.configure import load_config
    from fedsim.method.contract import RoundInfo
    from fedsim.runtime.server import Server
    from fedsim.runtime.setup import Partition, Ragged
    from fedsim.runtime.worker import ClientWorker

    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    sizes = rng.integers(2, 20, args.clients)
    bounds = np.cumsum([0, *sizes])
    shape = (1, 4, 4) if args.model == "mlp" else (3, 8, 8)
    x = rng.normal(size=(int(bounds[-1]), *shape)).astype(np.float32)
    y = (np.arange(len(x)) % 10).astype(np.int64)
    arrays = {"x_train": x, "y_train": y, "x_test": x[:100], "y_test": y[:100]}
    part = Partition(Ragged.from_list([np.arange(bounds[i], bounds[i + 1]) for i in range(args.clients)]),
                     Ragged.from_list([np.array([], int)] * args.clients), None)
    meta = {"num_classes": 10, "mean": (0.0,) * shape[0], "std": (1.0,) * shape[0]}
    model = ["model.name=mlp", "model.options={hidden: 8, layers: 1}"] if args.model == "mlp" else [
        f"model.name={args.model}"]
    cfg = load_config(None, [f"data.num_clients={args.clients}", "train.batch_size=8", "train.lr=0.05",
                             *model, "runtime.batch_clients=on",
                             f"runtime.batch_clients_max={args.clients}"])
    server, worker = Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, "cpu")
    together: list[float] = []
    trained: list[int] = []  # clients trained together per call (a call that raised fell back to one by one)
    trainer = batching.train_together

    def timed(plans: Any) -> Any:
        t0 = time.perf_counter()
        out = trainer(plans)
        together.append(time.perf_counter() - t0)
        trained.append(len(plans))
        return out

    batching.train_together = timed
    ids = list(range(args.clients))
    phases: list[float] = []
    try:
        for r in range(args.phases + 1):  # the first is a warm-up
            phase = server.phases(r)[0]
            common = server.broadcast(phase, RoundInfo(r, phase.name, ids, ids, {i: 1 for i in ids})).broadcast.common
            t0 = time.perf_counter()
            worker.run_phase(r, 0, phase, common, {}, ids)
            phases.append(time.perf_counter() - t0)
    finally:
        batching.train_together = trainer
    emit_result({"clients": args.clients, "phases": args.phases, "model": args.model,
                 "first_phase_ms": round(phases[0] * 1e3, 2),
                 "phase_ms": round(statistics.median(phases[1:]) * 1e3, 2),
                 "train_together_ms": round(statistics.median(together[1:]) * 1e3, 2) if len(together) > 1 else None,
                 "trained_together": sum(trained)})
    return 0


def bounds_problem(clients: int, phases: int) -> str | None:
    """--clients and --phases outside 1..their bound (a typo's 10^12 clients is a MemoryError, its phases never end)."""
    if clients < 1 or phases < 1:
        return "--clients and --phases must be at least 1"
    for flag, value, high in (("--clients", clients, MAX_CLIENTS), ("--phases", phases, MAX_PHASES)):
        if value > high:
            return f"{flag}: must be at most {high}, got {value}"
    return None


if __name__ == "__main__":
    sys.exit(main())
