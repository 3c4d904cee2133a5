"""What adding one client's upload to a worker's partial sum costs, per client, on one thread: bench config C's
upload (the MLP 3072-64-10, 197k float32 weights), exact with torch's operations, exact with the compiled loop
that a process builds at its first exact add (llvmlite), and in plain float64
(`runtime.exact_sum: false`).

    python -m bench.sum_cost [--clients 50] [--repeat 7]

Prints one line: the fastest of `--repeat` (>= 2) sums of `--clients` uploads, per upload.
"""

from __future__ import annotations

import sys
import time

from bench.cli import OneLineParser


def per_upload(uploads: list, exact: bool, repeat: int) -> float:
    """Seconds per upload: the fastest of `repeat` sums over `uploads`."""
    from fedsim.runtime.reduce import WeightedSum

    best = float("inf")
    for _ in range(repeat):
        total = WeightedSum(exact=exact)
        start = time.perf_counter()
        for i, upload in enumerate(uploads):
            total.add(upload, 2.0 + i % 3, i)
        best = min(best, time.perf_counter() - start)
    return best / len(uploads)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.sum_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--repeat", type=int, default=7)
    args = ap.parse_args(argv)
    if args.clients < 1 or args.repeat < 2:
        print("sum_cost: error: --clients must be at least 1 and --repeat at least 2 (the first compiled sum "
              "includes building the loop)", file=sys.stderr)
        return 2
    import torch

    from fedsim.runtime import twosum

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    shapes = {"l1.weight": (64, 3072), "l1.bias": (64,), "l2.weight": (10, 64), "l2.bias": (10,)}
    uploads = [{k: torch.randn(s, generator=g) for k, s in shapes.items()} for _ in range(args.clients)]
    kernel = twosum._kernels
    twosum._kernels = lambda: None  # torch's operations, as where the loop cannot be built
    exact_torch = per_upload(uploads, True, args.repeat)
    twosum._kernels = kernel  # the compiled loop (built in the first sum, which the fastest leaves out)
    exact_compiled = per_upload(uploads, True, args.repeat)
    plain = per_upload(uploads, False, args.repeat)
    print(f"per upload of 197k weights, 1 thread: exact with torch {exact_torch * 1e3:.3f} ms, exact compiled "
          f"{exact_compiled * 1e3:.3f} ms, plain float64 {plain * 1e3:.3f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
