"""`make bench-scale`: the bench's FedAvg workload through fedsim and Flower at 1,000 and 10,000 clients.

    python -m bench.scale_bench [--clients 1000,10000] [--per-round 100] [--rounds 3] [--repeat 1] [--pss]

The bench's workload (synthetic 3x32x32 data, Dirichlet(0.5) partition, prepared client draws and initial
weights; see bench.prepare) with the 3072-64-10 MLP, 100 clients per round. The plain loop runs too (1 thread),
as the compute floor. Writes results/bench/scale.md and scale.csv. Target: fedsim's total time at most half of
Flower's, and its peak memory (RSS summed over every process of the run) lower. `--pss` also samples PSS
(shared pages split between processes) once a second; it costs CPU, so its timings are not comparable with a
run without it.
"""

from __future__ import annotations

import os
import sys

from bench.cli import OneLineParser
from bench.common import BenchError, Workload, name_list
from bench.prepare import DEFAULT_CACHE
from bench.report import SYSTEMS as ALL_SYSTEMS
from bench.report import (
    all_failed,
    check_run_args,
    failed_runs,
    fmt,
    header,
    medians,
    run_matrix,
    write,
)
from bench.runner import out_of_range
from fedsim.config.limits import MAX_CLIENTS

SYSTEMS = ["plain_t1", "fedsim", "flower"]


def tables(df, names: list[str], workloads: dict) -> list[str]:
    med = medians(df)

    def get(name: str, system: str, key: str) -> float | None:
        try:
            v = float(med.loc[(name, system), key])
        except KeyError:
            return None
        return None if v != v else v

    pss = "peak_pss_mb" in df and df["peak_pss_mb"].notna().any()
    n_rep = int(df["repeat"].max()) + 1
    out = [f"Medians over {n_rep} interleaved repeat(s). Total = the program's first statement to its result, imports "
           "and Ray start included (the interpreter's own start and exit left out); peak RSS summed over the "
           "process and all its descendants (Ray daemons and workers).", "",
           "| clients (per round) | plain (1 thread) total s | fedsim total s (s/round) | Flower total s (s/round) | "
           "fedsim / Flower total | peak RSS MB fedsim / Flower | fedsim / Flower RSS |"
           + (" peak PSS MB fedsim / Flower |" if pss else "") + " target |",
           "|---|---:|---:|---:|---:|---:|---:|" + ("---:|" if pss else "") + "---|"]
    for name in names:
        w = workloads[name]
        ft, lt = get(name, "fedsim", "total_seconds"), get(name, "flower", "total_seconds")
        fr, lr = get(name, "fedsim", "peak_rss_mb"), get(name, "flower", "peak_rss_mb")
        goal = "n/a"
        if ft and lt and fr and lr:
            goal = (f"time ≤ 0.5x: {'met' if ft <= 0.5 * lt else 'NOT met'}; "
                    f"memory lower: {'met' if fr < lr else 'NOT met'}")
        row = (f"| {w.num_clients:,} ({w.clients_per_round}) | {fmt(get(name, 'plain_t1', 'total_seconds'), 1)} | "
               f"{fmt(ft, 1)} ({fmt(get(name, 'fedsim', 'seconds_per_round'))}) | "
               f"{fmt(lt, 1)} ({fmt(get(name, 'flower', 'seconds_per_round'))}) | "
               f"{'n/a' if not (ft and lt) else f'{ft / lt:.2f}x'} | {fmt(fr, 0)} / {fmt(lr, 0)} | "
               f"{'n/a' if not (fr and lr) else f'{fr / lr:.2f}x'} |")
        if pss:
            row += f" {fmt(get(name, 'fedsim', 'peak_pss_mb'), 0)} / {fmt(get(name, 'flower', 'peak_pss_mb'), 0)} |"
        out.append(row + f" {goal} |")
    return out + failed_runs(df)


def client_counts(text: str) -> list[int]:
    """--clients: comma-separated whole numbers from 1 to MAX_CLIENTS, each once (1e4 is 10000, as for `fedsim
    stress --clients`; 4.5 is refused, not rounded)."""
    try:
        values = [float(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise BenchError(f"--clients: expected comma-separated integers, got {text[:60]!r}") from None
    if not values or not all(1 <= v <= MAX_CLIENTS and v.is_integer() for v in values):
        raise BenchError(f"--clients: expected whole numbers from 1 to {MAX_CLIENTS}, got {text[:60]!r}")
    counts = [int(v) for v in values]
    twice = [n for n in counts if counts.count(n) > 1]
    if twice:
        raise BenchError(f"--clients: {twice[0]} is given twice")
    return counts


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.scale_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--clients", default="1000,10000", help="registered client counts")
    ap.add_argument("--per-round", type=int, default=100, help="clients per round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model", choices=["mlp", "resnet8"], default="mlp")
    ap.add_argument("--systems", default=",".join(SYSTEMS), help=", ".join(ALL_SYSTEMS))
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--pss", action="store_true", help="also sample PSS once a second (costs CPU)")
    ap.add_argument("--fedsim-arg", action="append", default=[], metavar="ARG")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per program run")
    ap.add_argument("--stem", default="scale", help="output name under results/bench/ (letters, digits, . _ -)")
    ap.add_argument("--cache", default=str(DEFAULT_CACHE), help="folder of prepared workloads")
    args = ap.parse_args(argv)
    try:
        counts = client_counts(args.clients)
        problem = out_of_range("--per-round", args.per_round, 1, MAX_CLIENTS)
        if problem:
            raise BenchError(problem)
        systems = name_list(args.systems, "--systems", "system", list(ALL_SYSTEMS))
        check_run_args(args.repeat, args.rounds, args.timeout, args.stem, [".csv", ".md"])
        workloads = {f"N{n}": Workload(num_clients=n, clients_per_round=min(args.per_round, n), rounds=args.rounds,
                                       model=args.model) for n in counts}
        if args.pss:
            os.environ["BENCH_PSS_INTERVAL"] = "1"
        df = run_matrix(workloads, systems, args.repeat, args.fedsim_arg, args.stem, args.timeout, cache=args.cache)
    except BenchError as exc:
        print(f"bench.scale_bench: error: {exc}", file=sys.stderr)
        return 2
    failed = all_failed(df)
    if failed:  # the previous report stays
        print(f"bench.scale_bench: error: {failed}", file=sys.stderr)
        return 1
    lines = header("fedsim vs Flower at scale on the bench's FedAvg workload",
                   ["bench.scale_bench", *(argv if argv is not None else sys.argv[1:])])
    lines += tables(df, list(workloads), workloads)
    csv, md = write(df, lines, args.stem)
    print("\n".join(lines))
    print(f"\nwrote {md} and {csv}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
