"""DOSFL's one round against FedAvg: the FedAvg rounds needed to match DOSFL's accuracy, with both runs' bytes.

    python -m jobs.dosfl_compare CONFIG [CONFIG ...] [--seeds 0 1 2 3 4] [--stat best|mean]
                                 [--fedavg-rounds R] [--fedavg KEY=VALUE ...] [-o KEY=VALUE ...] [--out FILE]

For each DOSFL config (algorithm: dosfl) and seed, one DOSFL run; the target is DOSFL's accuracy over seeds,
by default the best of them (the paper reports the best of 5 runs), or their mean. Then the same config
with `algorithm: {name: fedavg}` (local training from its `train:` section, `--fedavg` overrides on top)
runs for R rounds per seed; for each FedAvg seed we report the first round whose accuracy reaches the
target and the bytes (up + down) spent until then. The break-even round is DOSFL's total bytes divided by
FedAvg's bytes per round, rounded up (the paper's Table 3 quantity, from measured bytes). Output: a
markdown table (printed, and written to --out, default results/dosfl/<config names>.md) and a CSV.
Runs are named by a hash of their resolved config (jobs.sweep.run_cached), so a rerun reuses finished runs
(--fresh to redo them).
"""

from __future__ import annotations

import contextlib
import copy
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd

from fedsim.config.limits import MAX_ROUNDS
from fedsim.persist.storage import Location
from jobs.args import OneLineParser, count

COMMAND = "python -m jobs.dosfl_compare"


def _runs(raw: dict, seeds: list[int], overrides: list[str], fresh: bool = False,
          jobs: int = 1) -> list[tuple[Location, pd.DataFrame]]:
    """Run (or reuse) `raw` once per seed; returns each run's folder and rounds (best-accuracy model per round)."""
    from fedsim.config.schema import apply_overrides
    from fedsim.configure import build_config
    from fedsim.results.tables import load
    from jobs.sweep import run_all

    configs = [build_config(apply_overrides(raw, [*overrides, f"seed={seed}"])) for seed in seeds]
    labels = [f"  {cfg.algorithm.name} seed={cfg.seed} ..." for cfg in configs]
    return [(d, _best_rows(load(d)["rounds"])) for d in run_all(configs, labels, fresh, jobs)]


def _best_rows(rounds: pd.DataFrame) -> pd.DataFrame:
    """One row per evaluated round: the best global model's accuracy, with that round's bytes."""
    ev = rounds.dropna(subset=["accuracy"])
    ev = ev.loc[ev.groupby("round")["accuracy"].idxmax()].sort_values("round")
    by_round = rounds.groupby("round")[["bytes_up", "bytes_down"]].first()  # one row per model and round
    ev = ev.drop(columns=["bytes_up", "bytes_down"]).join(by_round, on="round")
    return ev.reset_index(drop=True)


def compare(path: str, seeds: list[int], stat: str, fedavg_rounds: int | None, fedavg_over: list[str],
            overrides: list[str], fresh: bool = False, jobs: int = 1) -> dict:
    """One row of the comparison table for one DOSFL config; `per_seed` holds each seed's runs and scores."""
    from fedsim.config.schema import apply_overrides, read_yaml
    from fedsim.configure import build_config
    from fedsim.errors import ConfigError

    raw = apply_overrides(read_yaml(path), overrides)
    algorithm = raw.get("algorithm") or {}
    if not isinstance(algorithm, dict) or algorithm.get("name") != "dosfl":
        raise ConfigError(f"{path}: algorithm.name must be dosfl for a DOSFL/FedAvg comparison")
    fed_raw = copy.deepcopy(raw)
    fed_raw["algorithm"] = {"name": "fedavg"}
    if fedavg_rounds:
        fed_raw["rounds"] = fedavg_rounds
    build_config(apply_overrides(fed_raw, fedavg_over))  # a bad --fedavg override fails before the DOSFL runs
    print(f"{path}: DOSFL", file=sys.stderr)
    dosfl_runs = _runs(raw, seeds, [], fresh, jobs)
    dosfl = [d for _, d in dosfl_runs]
    acc = np.array([d["accuracy"].iloc[0] for d in dosfl])
    d_bytes = np.array([d["bytes_up"].iloc[0] + d["bytes_down"].iloc[0] for d in dosfl])
    target = float(acc.max() if stat == "best" else acc.mean())
    print(f"{path}: FedAvg for {fed_raw.get('rounds', 30)} rounds, target {target:.4f}", file=sys.stderr)
    fed_runs = _runs(fed_raw, seeds, fedavg_over, fresh, jobs)
    fed = [f for _, f in fed_runs]
    match, match_bytes = [], []
    for f in fed:
        hit = f[f["accuracy"] >= target]
        cum = (f["bytes_up"] + f["bytes_down"]).cumsum()
        match.append(int(hit["round"].iloc[0]) + 1 if len(hit) else math.nan)
        match_bytes.append(float(cum[hit.index[0]]) if len(hit) else math.nan)
    per_round = float(np.mean([(f["bytes_up"] + f["bytes_down"]).iloc[0] for f in fed]))
    per_seed = []
    for i, seed in enumerate(seeds):
        (d_run, _), (f_run, f) = dosfl_runs[i], fed_runs[i]
        per_seed.append({"seed": seed, "dosfl_run": str(d_run), "fedavg_run": str(f_run),
                         "dosfl_acc": float(acc[i]), "dosfl_bytes": float(d_bytes[i]),
                         "fedavg_match_round": match[i], "fedavg_match_bytes": match_bytes[i],
                         "fedavg_final": float(f["accuracy"].iloc[-1]), "fedavg_rounds": len(f)})
    return {"config": path, "seeds": len(seeds), "dosfl_best": float(acc.max()), "dosfl_mean": float(acc.mean()),
            "dosfl_std": float(acc.std()), "dosfl_bytes": float(d_bytes.mean()),
            "dosfl_up": float(np.mean([d["bytes_up"].iloc[0] for d in dosfl])), "target": target,
            "fedavg_rounds": len(fed[0]), "fedavg_final_mean": float(np.mean([f["accuracy"].iloc[-1] for f in fed])),
            "match_rounds": match, "match_bytes": match_bytes, "fedavg_bytes_per_round": per_round,
            "break_even_round": math.ceil(d_bytes.mean() / per_round) if per_round > 0 else math.nan,
            "per_seed": per_seed}


def _fmt_bytes(b: float) -> str:
    return "—" if not np.isfinite(b) else (f"{b / 2**20:.2f} MiB" if b >= 2**20 else f"{b / 2**10:.1f} KiB")


def summary(rows: list[dict], stat: str) -> tuple[list[str], list[tuple[str, list[str]]]]:
    """Table head and one (config name, cells) row per compared config."""
    head = ["config", "DOSFL acc, 1 round (best / mean ± std, %)", "DOSFL bytes", "target",
            "FedAvg rounds to match (per seed)", "FedAvg bytes to match (mean)", "FedAvg acc after R (mean, %)",
            "break-even round"]
    out = []
    for r in rows:
        m = np.array(r["match_rounds"], dtype=float)
        reached = [str(int(v)) if np.isfinite(v) else f">{r['fedavg_rounds']}" for v in m]
        mb = np.array(r["match_bytes"], dtype=float)
        name = Path(r["config"]).stem
        out.append((name, [
            name, f"{100 * r['dosfl_best']:.2f} / {100 * r['dosfl_mean']:.2f} ± {100 * r['dosfl_std']:.2f}",
            _fmt_bytes(r["dosfl_bytes"]), f"{stat} = {100 * r['target']:.2f}", ", ".join(reached),
            _fmt_bytes(float(np.nanmean(mb))) if np.isfinite(mb).any() else "not reached",
            f"{100 * r['fedavg_final_mean']:.2f} (R = {r['fedavg_rounds']})", str(r["break_even_round"])]))
    return head, out


def markdown(rows: list[dict], stat: str) -> str:
    from jobs.sweep import markdown as md_table

    head, out = summary(rows, stat)
    return md_table(head, [cells for _, cells in out])


def _earlier_output(md: Path) -> bool:
    """Whether `md` is a table this command wrote (its command line is in it), so it and its CSV may be replaced."""
    try:
        return md.is_file() and not md.is_symlink() and COMMAND in md.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    from fedsim.errors import FedsimError
    from fedsim.persist.io import atomic_write, atomic_write_text

    p = OneLineParser(prog="python -m jobs.dosfl_compare", description=__doc__.splitlines()[0])
    p.add_argument("configs", nargs="+")
    p.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    p.add_argument("--stat", choices=["best", "mean"], default="best", help="DOSFL accuracy to match")
    p.add_argument("--fedavg-rounds", type=count(1), default=None, help="default: the config's rounds")
    p.add_argument("--fedavg", action="append", default=[], metavar="KEY=VALUE", help="FedAvg-only override")
    p.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE", help="override for both")
    p.add_argument("--out", default=None)
    p.add_argument("--fresh", action="store_true", help="rerun runs that already finished")
    args = p.parse_args(argv)
    if args.fedavg_rounds is not None and args.fedavg_rounds > MAX_ROUNDS:
        p.error(f"argument --fedavg-rounds: at most {MAX_ROUNDS:,}, got {args.fedavg_rounds}")
    if args.out == "":
        p.error("argument --out: give a path, not an empty string")
    dest = Path(args.out or Path("results") / "dosfl" / ("_".join(Path(c).stem for c in args.configs) + ".md"))
    if dest.suffix != ".md":
        p.error(f"argument --out: {dest}: name a .md file (the table's CSV goes beside it)")
    for mine in (dest, dest.with_suffix(".csv")):  # replaced only when they are this command's earlier output
        if (mine.exists() or mine.is_symlink()) and not _earlier_output(dest):
            p.error(f"argument --out: {mine} exists and is not this command's earlier output; not replaced")
    made = [d for d in (dest.parent, *dest.parent.parents) if not d.exists()]
    try:  # where the table goes is settled before the runs (minutes), not after them
        dest.parent.mkdir(parents=True, exist_ok=True)
        probe = dest.parent / f".{dest.name}.probe"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        in_the_way = next((d for d in dest.parents if d.exists() and not d.is_dir()), None)
        why = f"{in_the_way} is a file" if in_the_way is not None else exc.strerror or type(exc).__name__
        p.error(f"argument --out: cannot write {dest} ({why})")
    try:
        rows = [compare(c, args.seeds, args.stat, args.fedavg_rounds, args.fedavg, args.override, args.fresh)
                for c in args.configs]
    except FedsimError as exc:
        for d in made:  # the folders made for the table, when nothing went into them
            with contextlib.suppress(OSError):
                d.rmdir()
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code
    md = markdown(rows, args.stat)
    cmd = f"{COMMAND} " + " ".join(argv if argv is not None else sys.argv[1:])
    text = (f"{md}\n\nCommand: `{cmd}`. DOSFL: one round, seeds {args.seeds}; the target is DOSFL's {args.stat} "
            f"accuracy over seeds. FedAvg: same data, model and seeds; bytes = up + down until the matching "
            f"round, averaged over the seeds that reach it.\n")
    print(text)
    atomic_write_text(dest, text)
    table = pd.DataFrame([{k: v for k, v in r.items() if k != "per_seed"} for r in rows])
    atomic_write(dest.with_suffix(".csv"), lambda tmp: table.to_csv(tmp, index=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
