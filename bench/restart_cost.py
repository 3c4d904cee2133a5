"""What starting failed Ray workers again costs: all of a pool's workers at once (`restart_workers`, as the loop
does after a phase in which they all failed), against one after another (as it did before).

    python -m bench.restart_cost [--workers 2] [--repeat 3]

Runs one round of a small digits config on a local Ray with `--workers` one-CPU workers, then, still inside the
run, restarts every worker `--repeat` times each way, interleaved. Prints RESULT_JSON with each timing in seconds.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.cli import OneLineParser

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.restart_cost", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args(argv)
    if args.workers < 2 or args.repeat < 1:
        print("restart_cost: error: --workers must be at least 2 and --repeat at least 1", file=sys.stderr)
        return 2
    from actors.pool import RayBackend
    from bench.common import emit_result
    from fedsim.configure import load_config
    from fedsim.runtime.callbacks import Callback, RoundRows
    from fedsim.runtime.loop import run

    backend = RayBackend(num_workers=args.workers)
    indices = list(range(args.workers))
    timings: dict[str, list[float]] = {"together_s": [], "one_by_one_s": []}

    class Restarts(Callback):
        """Times the restarts once the round has ended, while the pool is still up."""

        def on_round_end(self, round: int, rows: RoundRows) -> Any:
            for _ in range(args.repeat):
                start = time.perf_counter()
                backend.restart_workers(indices)
                timings["together_s"].append(round_3(time.perf_counter() - start))
                start = time.perf_counter()
                for i in indices:
                    backend.restart_workers([i])
                timings["one_by_one_s"].append(round_3(time.perf_counter() - start))

    with tempfile.TemporaryDirectory() as tmp:
        cfg = load_config(None, ["rounds=1", "name=restart-cost", "data.name=digits", "data.num_clients=10",
                                 "model.name=cnn", "participation.clients_per_round=4", "runtime.backend=ray",
                                 "runtime.client_cpus=1", f"results.root={Path(tmp) / 'results'}"])
        run(cfg, backend, callbacks=[Restarts()])
    emit_result({"workers": args.workers, **timings})
    return 0


def round_3(seconds: float) -> float:
    return round(seconds, 3)


if __name__ == "__main__":
    sys.exit(main())
