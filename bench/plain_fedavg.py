"""FedAvg as a plain single-process PyTorch loop, no framework: the compute floor of the bench.

    python -m bench.plain_fedavg --workload <folder from bench.prepare> [--threads 2] [--device cuda] [--tag T]

Per round: for each drawn client (in id order) load the global weights into ONE reused model, train it on the
client's shard, add its state (BatchNorm buffers included) to the sample-weighted sum; the mean is the new
global state, evaluated on the test set. Prints a line per round and a final `RESULT_JSON {...}`; total
seconds count from before the heavy imports.
"""

import time

T_START = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402
from collections.abc import Callable  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402

import torch  # noqa: E402

from bench.cli import OneLineParser  # noqa: E402
from bench.common import (  # noqa: E402
    BenchError,
    GpuSampler,
    Prepared,
    TreeMemSampler,
    WeightedMean,
    build_model,
    client_update,
    emit_result,
    evaluate,
    load_prepared,
    pss_interval_from_env,
    round_summary,
    steady_window,
)


@dataclass
class PlainRun:
    """What the loop produced: the final global state, per-round accuracy and loss, and timings."""

    state: dict[str, torch.Tensor]
    accuracy: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)
    round_seconds: list[float] = field(default_factory=list)
    compute_seconds: list[float] = field(default_factory=list)
    samples: list[int] = field(default_factory=list)
    loop_start: float = 0.0
    round_end_wall: list[float] = field(default_factory=list)


def run(p: Prepared, threads: int, log: Callable[[str], None] = print, device: str = "cpu") -> PlainRun:
    """All rounds of the prepared workload in this process with `threads` torch threads, on `device`."""
    torch.set_num_threads(threads)
    w = p.workload
    model = build_model(w.model).to(device)
    out = PlainRun(state=p.initial_state())
    x_test, y_test = (t.to(device) for t in p.test_data())
    out.loop_start = time.perf_counter()
    for rnd in range(w.rounds):
        t0 = time.perf_counter()
        mean, compute = WeightedMean(), 0.0
        for cid, seed in p.round_clients(rnd):
            t_c = time.perf_counter()
            state, n, _ = client_update(model, out.state, p, cid, seed, device)
            mean.add(state, n)
            compute += time.perf_counter() - t_c
        out.state = mean.result(out.state)
        t_agg = time.perf_counter()
        model.load_state_dict(out.state)
        acc, loss = evaluate(model, x_test, y_test, w.eval_batch_size)
        t1 = time.perf_counter()
        out.round_end_wall.append(time.time())
        out.accuracy.append(acc)
        out.loss.append(loss)
        out.round_seconds.append(t1 - t0)
        out.compute_seconds.append(compute)
        out.samples.append(int(mean.total))
        log(f"[plain] round {rnd + 1}: {t1 - t0:.3f}s (clients {compute:.3f}s, aggregate {t_agg - t0 - compute:.3f}s, "
            f"eval {t1 - t_agg:.3f}s) samples={int(mean.total)} acc={acc:.4f} loss={loss:.4f}")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.plain_fedavg", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"], help="where the model trains")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"argument --threads: must be >= 1, got {args.threads}")
    if args.device == "cuda" and not torch.cuda.is_available():
        print("plain_fedavg: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2
    try:
        sampler = TreeMemSampler(pss_interval=pss_interval_from_env())
        sampler.start()
        gpu = GpuSampler()
        gpu.start()
        p = load_prepared(args.workload)
    except BenchError as exc:
        print(f"plain_fedavg: error: {exc}", file=sys.stderr)
        return 2
    w = p.workload
    sizes = p.shard_sizes()
    print(f"[plain] N={w.num_clients} K={w.clients_per_round} R={w.rounds} model={w.model} threads={args.threads} "
          f"shard sizes min={sizes.min()} median={int(sorted(sizes)[len(sizes) // 2])} max={sizes.max()}", flush=True)
    try:
        res = run(p, args.threads, log=lambda m: print(m, flush=True), device=args.device)
    except BenchError as exc:  # a damaged file of the workload, met when the loop reads it
        print(f"plain_fedavg: error: {exc}", file=sys.stderr)
        return 2
    t_done = time.perf_counter()
    sampler.stop()
    gpu.stop()
    emit_result({
        "system": "plain", "tag": args.tag, "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds,
        "E": w.local_epochs, "model": w.model, "threads": args.threads, "device": args.device,
        "startup_seconds": round(res.loop_start - T_START, 3),
        "loop_seconds": round(t_done - res.loop_start, 3),
        **round_summary(res.round_seconds, res.samples, T_START, t_done),
        "client_compute_seconds": [round(t, 3) for t in res.compute_seconds],
        **sampler.fields(), **gpu.fields(*steady_window(res.round_end_wall)),
        "final_accuracy": round(res.accuracy[-1], 4), "final_loss": round(res.loss[-1], 4),
        "pid": os.getpid(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
