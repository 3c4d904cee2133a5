"""What Ray itself costs a phase, with no training: C's broadcast out to each worker and a partial sum back, as
ordinary actor tasks (what fedsim's Ray backend does) and as a Ray compiled graph, interleaved in one process.

    python -m bench.phase_latency [--workers 2] [--weights 197322] [--calls 40]

The broadcast is `--weights` float32 values (C's MLP 3072-64-10 by default), put once per call as the backend
puts a round's model; each worker answers with that many float64 values (a partial sum). Prints the median,
10th and 90th percentile of one call's round trip for each path.

Without training this favours the graph: a compiled graph's workers wait for their next input spinning (1.9 s of
CPU in 2 s idle, each), so on a machine with no spare cores they take CPU from training and the driver. Measured
on 2 cores, C over 30 rounds with the phase on a compiled graph took 0.19-0.26 s a round at the median against
0.13-0.16 s on actor tasks (three interleaved pairs), though this script gave 3.3 against 19-26 ms.
"""

from __future__ import annotations

import os
import statistics
import time

import numpy as np

from bench.cli import OneLineParser
from bench.runner import out_of_range
from fedsim.config.limits import MAX_ARRAY_BYTES, MAX_ROUNDS, MAX_WORKERS

MLP_WEIGHTS = 3072 * 64 + 64 + 64 * 10 + 10


def arguments_problem(workers: int, weights: int, calls: int) -> str | None:
    """What Ray would fail on (no workers) or the statistics could not summarise (one call has no deciles), named
    before Ray starts. Upper bounds are fedsim's: its largest array for the weights (each worker answers in
    float64), its most rounds for the calls (a call is one round's phase)."""
    return (out_of_range("--workers", workers, 1, MAX_WORKERS)
            or out_of_range("--weights", weights, 1, MAX_ARRAY_BYTES // 8)
            or out_of_range("--calls", calls, 2, MAX_ROUNDS))


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.phase_latency", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--weights", type=int, default=MLP_WEIGHTS, help="float32 values broadcast per call")
    ap.add_argument("--calls", type=int, default=40, help="timed calls per path (after 5 untimed; at least 2)")
    args = ap.parse_args(argv)
    problem = arguments_problem(args.workers, args.weights, args.calls)
    if problem:
        ap.error(problem)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    import ray
    from ray.dag import InputNode, MultiOutputNode

    ray.init(num_cpus=args.workers, include_dashboard=False, configure_logging=False)

    @ray.remote(num_cpus=1)
    class Worker:
        def __init__(self, n: int) -> None:
            self.partial = {"hi": np.ones(n, np.float64)}

        def phase(self, common: dict) -> dict:
            return self.partial if common["w"].size else {}

    workers = [Worker.remote(args.weights) for _ in range(args.workers)]
    common = {"w": np.random.default_rng(0).random(args.weights, dtype=np.float32)}

    def tasks() -> list:
        ref = ray.put(common)
        return ray.get([w.phase.remote(ref) for w in workers])

    with InputNode() as inp:
        dag = MultiOutputNode([w.phase.bind(inp) for w in workers])
    compiled = dag.experimental_compile()

    def graph() -> list:
        return ray.get(compiled.execute(common))

    paths = {"actor tasks": tasks, "compiled graph": graph}
    try:
        for call in paths.values():
            for _ in range(5):
                call()
        times: dict[str, list[float]] = {name: [] for name in paths}
        for _ in range(args.calls):
            for name, call in paths.items():
                t0 = time.perf_counter()
                call()
                times[name].append(time.perf_counter() - t0)
    finally:
        compiled.teardown()
        ray.shutdown()
    print(f"{args.workers} workers, {args.weights:,} float32 out and float64 back per worker, {args.calls} calls:")
    for name, ts in times.items():
        q = statistics.quantiles(ts, n=10)
        print(f"  {name}: median {statistics.median(ts) * 1e3:.2f} ms (10th {q[0] * 1e3:.2f}, 90th {q[-1] * 1e3:.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
