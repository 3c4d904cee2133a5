"""The prepared FedAvg workload run by fedsim, printing the same RESULT_JSON fields as the plain loop and Flower.

    python -m bench.fedsim_fedavg --workload <folder from bench.prepare> [--workers 2] [--backend ray] [-o KEY=VALUE]

Total seconds count from before the heavy imports, so imports and Ray's start are included, as for the other
programs. A round's time runs from the end of the previous one (tables and checkpoint written) to the end of
this one, as Flower's does; peak RSS is summed over this process and all its descendants (Ray's daemons and
workers included).
"""

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

from bench.common import (  # noqa: E402
    BenchError,
    TreeMemSampler,
    Workload,
    emit_result,
    load_prepared,
    pss_interval_from_env,
    round_summary,
)


def parse(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.fedsim_fedavg", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--backend", choices=["ray", "local"], default="ray")
    ap.add_argument("--workers", type=int, default=None, help="client workers (default: what the CPUs allow)")
    ap.add_argument("--client-cpus", type=float, default=None, help="runtime.client_cpus")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="any fedsim config override, e.g. -o results.checkpoint_every=0")
    ap.add_argument("--tag", default="")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from fedsim.errors import FedsimError

    args = parse(argv)
    try:
        sampler = TreeMemSampler(pss_interval=pss_interval_from_env())
        sampler.start()
        w = load_prepared(args.workload).workload
        return _run(args, w, sampler)
    except (BenchError, FedsimError) as exc:
        print(f"fedsim_fedavg: error: {exc}", file=sys.stderr)
        return 2


def _run(args: argparse.Namespace, w: Workload, sampler: TreeMemSampler) -> int:
    """Set up the engine on the prepared folder, run every round, print RESULT_JSON."""
    from bench.workload import BenchSimulation, make_config
    from fedsim.config import save_config
    from fedsim.results import write_meta
    from fedsim.runtime.loop import new_run_dir
    from jobs.cli import make_backend

    overrides = [f"runtime.backend={args.backend}"] + (
        [f"runtime.client_cpus={args.client_cpus}"] if args.client_cpus else []) + args.override
    cfg = make_config(w, overrides)
    print(f"[fedsim] N={w.num_clients} K={w.clients_per_round} R={w.rounds} model={w.model} "
          f"backend={cfg.runtime.backend} client_cpus={cfg.runtime.client_cpus}", flush=True)
    backend = make_backend(cfg, args.workers)
    run_dir = new_run_dir(cfg)
    save_config(cfg, run_dir / "config.yaml")
    marks: list[float] = []
    rows: list[dict] = []
    t_loop = time.perf_counter()

    def progress(r: int, row: dict) -> None:
        marks.append(time.perf_counter())
        rows.append(row)
        print(f"[fedsim] round {r + 1}: {marks[-1] - (marks[-2] if len(marks) > 1 else t_loop):.3f}s "
              f"(clients {row.get('wall_clients_s', 0):.3f}s, server {row.get('wall_server_s', 0):.3f}s, "
              f"eval {row.get('wall_eval_s', 0):.3f}s) acc={row.get('accuracy', float('nan')):.4f}", flush=True)

    sim = BenchSimulation(cfg, backend, run_dir, args.workload, progress)
    try:
        sim.setup()
        write_meta(run_dir, {"backend": type(backend).__name__, "num_workers": backend.num_workers,
                             "startup_s": sim.startup_s, **getattr(backend, "describe", lambda: {})()})
        t_loop = time.perf_counter()
        sim.run()
    finally:
        backend.shutdown()
    t_done = time.perf_counter()
    sampler.stop()
    starts = [t_loop] + marks[:-1]
    round_times = [b - a for a, b in zip(starts, marks, strict=True)]
    sizes = sim.part.train.lengths()
    samples = [int(sizes[d].sum()) for d in sim.draws[:len(rows)]]
    emit_result({
        "system": "fedsim", "tag": args.tag, "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds,
        "E": w.local_epochs, "model": w.model, "backend": cfg.runtime.backend,
        "workers": backend.num_workers or None, "client_cpus": cfg.runtime.client_cpus,
        "startup_seconds": round(t_loop - T_START, 3),
        "backend_start_seconds": round(sim.startup_s, 3),
        "shutdown_seconds": round(t_done - marks[-1], 3) if marks else None,
        **round_summary(round_times, samples, T_START, t_done),
        "client_compute_seconds": [round(float(r.get("wall_clients_s", 0)), 3) for r in rows],
        "eval_seconds": [round(float(r.get("wall_eval_s", 0)), 3) for r in rows],
        **sampler.fields(),
        "final_accuracy": round(float(rows[-1].get("accuracy", float("nan"))), 4) if rows else None,
        "final_loss": round(float(rows[-1].get("loss", float("nan"))), 4) if rows else None,
        "run_dir": str(run_dir), "pid": os.getpid(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
