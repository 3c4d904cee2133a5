"""The raw fixed cost of Ray on this machine, with no fedsim in it: the floor fedsim's Ray start-up and shutdown
are held to.

    python -m bench.ray_floor [--workers 2] [--start ray|fedsim]

Times `import ray`, `ray.init()` (with fedsim's arguments), `--workers` one-CPU actors that import torch and answer a
call, and `ray.shutdown()`, and prints them as RESULT_JSON (startup_seconds = all but the shutdown, from
process start, as the other programs count it). `--start fedsim` starts Ray as a run does for itself
(actors/boot.py's `init_ray`: `ray.init` with Ray's start-up notices left out) and stops it with `ray.shutdown`.
"""

import time

T_START = time.perf_counter()

import os  # noqa: E402
import sys  # noqa: E402

from bench.cli import OneLineParser  # noqa: E402
from bench.runner import out_of_range  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def max_workers() -> int:
    """fedsim.config.limits.MAX_WORKERS, read from its file without importing the fedsim package: the package's config
    module would add 0.1 s to the start-up this floor measures."""
    import runpy

    limits = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "fedsim", "config", "limits.py")
    return runpy.run_path(limits)["MAX_WORKERS"]


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.ray_floor", description=__doc__.splitlines()[0])
    ap.add_argument("--workers", type=int, default=2, help="actors to start (one CPU each)")
    ap.add_argument("--start", choices=["ray", "fedsim"], default="ray",
                    help="Ray's own init and shutdown (the floor), or fedsim's (actors/boot.py)")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    problem = out_of_range("--workers", args.workers, 1, max_workers())
    if problem:
        ap.error(problem)
    t0 = time.perf_counter()
    import ray

    t_import = time.perf_counter()
    if args.start == "fedsim":
        from actors.boot import init_ray

        init_ray(None)
    else:
        ray.init(include_dashboard=False, log_to_driver=True, configure_logging=False)  # fedsim's arguments
    t_init = time.perf_counter()

    @ray.remote(num_cpus=1)
    class Probe:
        def ready(self) -> int:
            import torch

            return torch.get_num_threads()

    actors = [Probe.remote() for _ in range(args.workers)]
    ray.get([a.ready.remote() for a in actors])
    t_actors = time.perf_counter()
    ray.shutdown()
    t_end = time.perf_counter()
    from bench.common import emit_result

    emit_result({"tag": args.tag, "start": args.start, "import_ray_seconds": round(t_import - t0, 3),
                 "ray_init_seconds": round(t_init - t_import, 3), "actors_seconds": round(t_actors - t_init, 3),
                 "startup_seconds": round(t_actors - T_START, 3), "shutdown_seconds": round(t_end - t_actors, 3),
                 "total_seconds": round(t_end - T_START, 3)})
    return 0


if __name__ == "__main__":
    sys.exit(main())
