"""`python -m jobs.demo_summary`: the getting-started guide's account of `make run`, measured.

Runs `fedsim run configs/demo.yaml` in a fresh process, timed from its start to its exit (Ray's start and stop
included), reads the run's tables, keeps the figures in `results/bench/demo.json` and writes the
`<!-- demo:headline -->` block of docs/getting-started.md from that file. `--check` only says whether the block
matches the file (exit 1 when not), as the test suite does; `--from RUN_DIR` summarises a run already made (its
wall time unmeasured).
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path
from typing import Any

import pandas as pd

from fedsim.errors import ConfigError, FedsimError
from jobs.args import OneLineParser
from jobs.readme_blocks import paste_blocks, read_blocks

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "getting-started.md"
SAVED = ROOT / "results" / "bench" / "demo.json"
CONFIG = "configs/demo.yaml"
TARGETS = (0.90, 0.95)


def rounds_to(accuracy: pd.Series, target: float) -> int | None:
    """How many rounds the run took to first reach `target` test accuracy (None: never)."""
    hit = accuracy.to_numpy() >= target - 1e-6  # 342 of 360 right is 95%, though float32 keeps it as 0.9499999
    return int(hit.argmax()) + 1 if hit.any() else None


def summarise(run_dir: Path) -> dict[str, Any]:
    """The figures the page quotes, from one run folder's tables and config."""
    from fedsim.results.tables import load

    tables = load(run_dir)  # one line naming the file for anything unreadable
    cfg, meta = tables["config"], tables["meta"]
    counts = [cfg.get(section, {}).get(key) if isinstance(cfg, dict) and isinstance(cfg.get(section), dict) else None
              for section, key in (("data", "num_clients"), ("participation", "clients_per_round"))]
    if not all(isinstance(c, int) and not isinstance(c, bool) for c in counts):
        raise ConfigError(f"{run_dir / 'config.yaml'}: not a run's config (no whole data.num_clients and "
                          "participation.clients_per_round)")
    rounds = tables["rounds"].sort_values("round")
    if "accuracy" not in rounds or "stragglers" not in rounds or not rounds["accuracy"].notna().all() \
            or not len(rounds):
        raise ConfigError(f"{run_dir / 'rounds.parquet'}: not the demo's table (it needs an accuracy for every "
                          "round, and the stragglers column)")
    acc = rounds["accuracy"]
    # the round's stragglers, as the virtual clock scheduled them: a late client whose training also failed is
    # recorded "failed" in clients.parquet, and is still an update that came too late
    late = rounds.groupby("round")["stragglers"].first()
    return {
        "rounds": len(rounds), "clients": counts[0], "per_round": counts[1],
        "best_accuracy": round(float(acc.max()), 4), "best_after_rounds": int(acc.to_numpy().argmax()) + 1,
        "final_accuracy": round(float(acc.iloc[-1]), 4),
        "rounds_to": {f"{t:.2f}": rounds_to(acc, t) for t in TARGETS},
        "late_per_round": [int(late.min()), int(late.max())],
        "backend": meta.get("backend"),
    }


def measure(out_root: Path) -> tuple[dict[str, Any], Path]:
    """Run the demo config in a fresh process under `out_root`; its figures and wall seconds, and its folder."""
    out_root.mkdir(parents=True, exist_ok=True)
    before = set(out_root.iterdir())
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", "run", CONFIG, "--quiet", "-o",
                           f"results.root={out_root}"], cwd=ROOT, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise FedsimError(f"fedsim run {CONFIG} failed (exit {proc.returncode}): {last}")
    made = sorted(set(out_root.iterdir()) - before)
    if len(made) != 1:
        raise FedsimError(f"{out_root}: expected one new run folder, found {len(made)}")
    return {**summarise(made[0]), "wall_s": round(wall, 1)}, made[0]


def render(s: dict[str, Any]) -> str:
    """The page's sentences from the saved figures."""
    to90, to95 = s["rounds_to"]["0.90"], s["rounds_to"]["0.95"]
    reach = ", ".join(f"{int(t * 100)}% after {n} rounds" if n else f"never {int(t * 100)}%"
                      for t, n in ((0.90, to90), (0.95, to95)))
    lo, hi = s["late_per_round"]
    late = f"{lo}" if lo == hi else f"{lo}–{hi}"
    wall = (f" `fedsim run` took {s['wall_s']:.0f} s of wall time, Ray's start and stop included, on "
            f"{s['cpus']} CPUs.") if s.get("wall_s") is not None else ""
    text = (f"It reaches **{100 * s['best_accuracy']:.1f}% best (after {s['best_after_rounds']} rounds) / "
            f"{100 * s['final_accuracy']:.1f}% final test accuracy** ({reach}), with {late} of the "
            f"{s['per_round']} updates of every round late and dropped.{wall} Measured {s['date']} by "
            f"`{s['command']}`.")
    return textwrap.fill(text, width=115, break_long_words=False, break_on_hyphens=False) + "\n"


def stale() -> bool:
    """Whether the page's block differs from the saved figures."""
    block = read_blocks(PAGE.read_text(encoding="utf-8"), "demo").get("headline")
    return block != render(json.loads(SAVED.read_text(encoding="utf-8")))


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m jobs.demo_summary", description=__doc__.splitlines()[0])
    ap.add_argument("--from", dest="run_dir", help="summarise this run folder instead of running the demo")
    ap.add_argument("--out", default="results", help="where the measured run's folder goes (default: results)")
    ap.add_argument("--check", action="store_true", help="only check the page's block against the saved file")
    args = ap.parse_args(argv)
    try:
        if args.check:
            if stale():
                print(f"{PAGE.name}'s demo:headline block differs from results/bench/demo.json: run "
                      "`python -m jobs.demo_summary`", file=sys.stderr)
                return 1
            return 0
        command = "python -m jobs.demo_summary"
        if not args.out:
            raise ConfigError("--out: give a folder, not an empty string")
        if read_blocks(PAGE.read_text(encoding="utf-8"), "demo").get("headline") is None:
            raise ConfigError(f"{PAGE}: no <!-- demo:headline --> block to write into")  # before a minute's run
        if args.run_dir is not None:
            if not args.run_dir:
                raise ConfigError("--from: give a run folder, not an empty string")
            run_dir = Path(args.run_dir)
            if not (run_dir / "rounds.parquet").is_file():
                raise ConfigError(f"--from {run_dir}: not a run folder (no rounds.parquet)")
            figures, command = {**summarise(run_dir), "wall_s": None}, f"{command} --from {run_dir}"
        else:
            figures, run_dir = measure(Path(args.out).resolve())  # the run's process starts in the checkout
        figures.update(date=datetime.datetime.now().strftime("%Y-%m-%d"), command=command,
                       cpus=len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
                       run=run_dir.name)
        SAVED.parent.mkdir(parents=True, exist_ok=True)
        SAVED.write_text(json.dumps(figures, indent=1) + "\n", encoding="utf-8")
        paste_blocks(PAGE, "demo", {"headline": render(figures)})
        print(render(figures), end="")
        return 0
    except (FedsimError, OSError, KeyError, ValueError) as exc:
        print(f"demo_summary: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
