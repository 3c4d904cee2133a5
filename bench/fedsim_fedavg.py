"""The peer benchmark's FedAvg workload run by fedsim: same flags and same RESULT_JSON as the harness's programs.

    python -m bench.fedsim_fedavg -N 100 -K 10 -R 5 --model resnet8 [--workers 2] [--backend ray]

Total seconds count from before the heavy imports, so imports and Ray start are included, as for the plain
loop and Flower. A round's time runs from the end of the previous one (tables and checkpoint written) to
the end of this one, like Flower's; peak RSS is the harness's sampler over this process and all its
descendants (Ray's daemons and workers included).
"""

import time

T_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import sys  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def parse(argv: list[str] | None, common) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    common.add_common_args(ap)
    ap.add_argument("--backend", choices=["ray", "local"], default="ray")
    ap.add_argument("--workers", type=int, default=None, help="client workers (default: what the CPUs allow)")
    ap.add_argument("--client-cpus", type=float, default=None, help="runtime.client_cpus")
    ap.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE",
                    help="any fedsim config override, e.g. -o results.checkpoint_every=0")
    return ap.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from bench.peer import fl_common

    C = fl_common()
    args = parse(argv, C)
    sampler = C.TreeMemSampler()
    sampler.start()
    import numpy as np

    from bench.workload import PeerSimulation, PeerWorkload, make_config
    from fedsim.config import save_config
    from fedsim.results import write_meta
    from fedsim.runtime.loop import new_run_dir
    from jobs.cli import make_backend

    w = PeerWorkload.from_args(args)
    C.generate_synthetic(w.data_seed, w.n_train, w.n_test, w.amp)
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

    def progress(r: int, row: dict) -> None:
        marks.append(time.perf_counter())
        rows.append(row)
        print(f"[fedsim] round {r + 1}: {marks[-1] - (marks[-2] if len(marks) > 1 else t_loop):.3f}s "
              f"(clients {row.get('wall_clients_s', 0):.3f}s, server {row.get('wall_server_s', 0):.3f}s, "
              f"eval {row.get('wall_eval_s', 0):.3f}s) acc={row.get('accuracy', float('nan')):.4f}", flush=True)

    sim = PeerSimulation(cfg, backend, run_dir, w, progress)
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
    steady = round_times[1:] if len(round_times) > 1 else round_times
    samples = [int(sum(len(p) for p in [sim.part.train[c] for c in d])) for d in sim.draws]
    res = {
        "system": "fedsim", "tag": args.tag, "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds,
        "E": w.local_epochs, "model": w.model, "backend": cfg.runtime.backend, "workers": backend.num_workers
        if backend.num_workers else None, "client_cpus": cfg.runtime.client_cpus,
        "total_seconds": round(t_done - T_START, 3),
        "startup_seconds": round(t_loop - T_START, 3),
        "backend_start_seconds": round(sim.startup_s, 3),
        "shutdown_seconds": round(t_done - marks[-1], 3) if marks else None,
        "round_seconds": [round(t, 3) for t in round_times],
        "seconds_per_round": round(float(np.mean(steady)), 3),
        "seconds_per_round_all": round(float(np.mean(round_times)), 3),
        "client_compute_seconds": [round(float(r.get("wall_clients_s", 0)), 3) for r in rows],
        "eval_seconds": [round(float(r.get("wall_eval_s", 0)), 3) for r in rows],
        "round_train_samples": samples,
        "train_samples_per_second": round(sum(samples) / sum(round_times), 1),
        "train_samples_per_second_e2e": round(sum(samples) / (t_done - T_START), 1),
        "peak_rss_mb": round(sampler.peak_rss / 2**20, 1),
        "peak_pss_mb": round(sampler.peak_pss / 2**20, 1) if sampler.pss_interval > 0 else None,
        "peak_nproc": sampler.peak_nproc,
        "cpu_seconds": sampler.cpu_summary(),
        "peak_breakdown_mb": [[pid, lab, round(r / 2**20, 1)]
                              for pid, lab, r in sorted(sampler.peak_breakdown, key=lambda t: -t[2])][:8],
        "final_accuracy": round(float(rows[-1].get("accuracy", float("nan"))), 4) if rows else None,
        "final_loss": round(float(rows[-1].get("loss", float("nan"))), 4) if rows else None,
        "run_dir": str(run_dir), "pid": os.getpid(),
    }
    C.emit_result(res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
