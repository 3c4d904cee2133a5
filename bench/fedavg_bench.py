"""`make bench`: the bench's FedAvg workload through the plain loop, fedsim (local and Ray), Flower and pfl-research
(one process and two), in one invocation.

    python -m bench.fedavg_bench [--configs A,B,C] [--repeat 2] [--systems plain,fedsim_ray,pfl] [--cache DIR]

Configs (bench.workload.BENCH_CONFIGS): A = ResNet-8, N=100, K=10, R=5; B = ResNet-8, N=1000, K=50, R=3;
C = MLP, N=10000, K=100, R=2. Each is prepared once (bench.prepare) before any timed run, and every system
runs as its own process on the same prepared folder. The plain loop runs with 2 threads and with 1;
totals include imports and Ray start. Writes results/bench/fedavg.md (medians and ratios), fedavg.csv
(every run) and fedavg.json (per config and system: s_per_round, total_s, startup_s, shutdown_s, peak_rss_mb,
final_accuracy, with the date, the machine and the versions; `python -m bench.report` renders it).
`ray_floor` (bench.ray_floor) times Ray's own start and stop with two torch actors, the floor fedsim's Ray
start-up and shutdown are held to. The targets (bench.report.TARGETS) are ratios of this one invocation's medians.
"""

from __future__ import annotations

import sys

from bench.cli import OneLineParser
from bench.common import BenchError, name_list
from bench.prepare import DEFAULT_CACHE
from bench.report import (
    all_failed,
    check_run_args,
    failed_runs,
    fmt,
    header,
    medians,
    render_targets,
    run_matrix,
    summary,
    versions,
    write,
    write_summary,
)
from bench.workload import BENCH_CONFIGS

SYSTEMS = ["plain", "plain_t1", "fedsim_local", "fedsim_dp", "fedsim_ray", "flower", "pfl", "pfl_multiprocess",
           "ray_floor"]
# on request: FedAdam's server step, one 2-thread fedsim worker, one 2-CPU Flower actor
ALL = SYSTEMS + ["fedsim_fedadam", "fedsim_1w", "flower_2c"]
LABEL = {"plain": "plain (2 threads)", "plain_t1": "plain (1 thread)",
         "fedsim_ray": "fedsim (Ray, 2 workers × 1 thread)", "fedsim_local": "fedsim (local, 1 worker × 2 threads)",
         "fedsim_1w": "fedsim (Ray, 1 worker × 2 threads)", "fedsim_dp": "fedsim with client-level DP (local)",
         "fedsim_fedadam": "fedsim FedAdam (local)",
         "flower": "Flower (2 actors × 1 CPU)",
         "flower_2c": "Flower (1 actor × 2 CPUs)", "pfl": "pfl (1 process × 2 threads)",
         "pfl_multiprocess": "pfl (2 processes × 1 thread)", "ray_floor": "Ray alone (start, 2 actors, stop)"}


def tables(df, configs: list[str], workloads: dict) -> list[str]:
    """Medians per system."""
    med = medians(df)

    def get(cfg: str, system: str, key: str) -> float | None:
        try:
            return float(med.loc[(cfg, system), key])
        except KeyError:
            return None

    systems = [s for s in ALL if s in set(df["system"])]
    n_rep = int(df["repeat"].max()) + 1
    out = [f"Medians over {n_rep} interleaved repeat(s). Total = the program's first statement to its result "
           "(imports, Ray start, data loading, all rounds, shutdown; the interpreter's own start and exit are left out "
           "for every program); s/round = steady state (rounds after the first).", "",
           "| config | " + " | ".join(f"{LABEL[s]} total s (s/round)" for s in systems) +
           " | peak RSS MB " + " / ".join(LABEL[s] for s in systems) + " | final acc " + " / ".join(
               LABEL[s] for s in systems) + " |",
           "|---|" + "---:|" * (len(systems) + 2)]
    for c in configs:
        w = workloads[c]
        cells = [f"{fmt(get(c, s, 'total_seconds'), 1)} ({fmt(get(c, s, 'seconds_per_round'))})" for s in systems]
        rss = " / ".join(fmt(get(c, s, "peak_rss_mb"), 0) for s in systems)
        acc = " / ".join(fmt(get(c, s, "final_accuracy"), 3) for s in systems)
        out.append(f"| {c}: N={w.num_clients}, K={w.clients_per_round}, R={w.rounds}, {w.model} | "
                   + " | ".join(cells) + f" | {rss} | {acc} |")
    return out + failed_runs(df)


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.fedavg_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--configs", default="A,B,C", help="comma-separated configs (A, B, C)")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=", ".join(ALL))
    ap.add_argument("--repeat", type=int, default=1, help="interleaved repeats; the tables use medians")
    ap.add_argument("--rounds", type=int, default=None, help="override every config's rounds")
    ap.add_argument("--fedsim-arg", action="append", default=[], metavar="ARG",
                    help="extra argument for bench.fedsim_fedavg, e.g. --fedsim-arg=-o --fedsim-arg=runtime.threads=1")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per program run")
    ap.add_argument("--stem", default="fedavg", help="output name under results/bench/ (letters, digits, . _ -)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder of prepared workloads")
    args = ap.parse_args(argv)
    command = ["bench.fedavg_bench", *(argv if argv is not None else sys.argv[1:])]
    try:
        configs = name_list(args.configs.upper(), "--configs", "config", list(BENCH_CONFIGS))
        systems = name_list(args.systems, "--systems", "system", ALL)
        check_run_args(args.repeat, args.rounds, args.timeout, args.stem, [".csv", ".md", ".json"])
        rounds = {} if args.rounds is None else {"rounds": args.rounds}
        workloads = {c: BENCH_CONFIGS[c].with_(**rounds) for c in configs}
        df = run_matrix(workloads, systems, args.repeat, args.fedsim_arg, args.stem, args.timeout, cache=args.cache)
    except BenchError as exc:
        print(f"bench.fedavg_bench: error: {exc}", file=sys.stderr)
        return 2
    failed = all_failed(df)
    if failed:  # the previous results stay: a summary of no run would replace them with n/a
        print(f"bench.fedavg_bench: error: {failed}", file=sys.stderr)
        return 1
    lines = header("fedsim vs the plain loop vs Flower on the bench's FedAvg workload", command)
    data = summary(df, workloads, command, versions())
    lines += tables(df, configs, workloads)
    lines += ["", "Plain = the faster of the plain loop's 1- and 2-thread runs. Targets, as ratios of these medians:",
              "", *render_targets(data)]
    csv, md = write(df, lines, args.stem)
    js = write_summary(data, args.stem)
    print("\n".join(lines))
    print(f"\nwrote {md}, {csv} and {js}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
