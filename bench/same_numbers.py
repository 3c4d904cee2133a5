"""Whether the fedsim runs of one bench.gpu_bench invocation that must agree gave the same numbers.

    python -m bench.same_numbers GPU_JSON

For each config, one process against Ray (one client after another): every column of `rounds.parquet` and
`clients.parquet` but the wall-clock ones and the worker's, compared value for value, row for row. One line per
config, pair and table: IDENTICAL, or the columns that differ. Exit 0 when all agree, 1 when some differ, 2 on bad
input (one line). It reads the run folders that GPU_JSON names, so it runs where the bench ran.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from bench.cli import OneLineParser
from bench.common import BenchError

PAIRS = [("fedsim_seq", "fedsim_ray_seq")]
TABLES = ("rounds.parquet", "clients.parquet")
SKIPPED = ("wall", "worker", "clients_batched")  # wall-clock seconds, the worker a client ran on, and a count of them


def run_folders(gpu_json: Path) -> dict[tuple[str, str], Path]:
    """(config, system) -> run folder of each fedsim run that ended well, as GPU_JSON names them."""
    try:
        runs = json.loads(gpu_json.read_text())["runs"]
        found = {(r["config"], r["system"]): Path(r["run_dir"]) for r in runs
                 if r.get("status") == "ok" and r.get("run_dir")}
    except OSError as exc:
        raise BenchError(f"{gpu_json}: cannot be read ({exc.strerror or type(exc).__name__})") from None
    except (ValueError, KeyError, TypeError, UnicodeDecodeError):
        raise BenchError(f"{gpu_json}: not a gpu.json of bench.gpu_bench") from None
    return found


def compare(gpu_json: Path) -> tuple[list[str], bool]:
    """The report's lines, and whether every compared pair agreed."""
    import pandas as pd

    folders = run_folders(gpu_json)
    lines, same = [], True
    for config in sorted({c for c, _ in folders}):
        for a, b in PAIRS:
            if (config, a) not in folders or (config, b) not in folders:
                continue
            for table in TABLES:
                try:
                    left = pd.read_parquet(folders[config, a] / table)
                    right = pd.read_parquet(folders[config, b] / table)
                except (OSError, ValueError) as exc:
                    raise BenchError(f"{config} {a}/{b}: {table} cannot be read ({type(exc).__name__})") from None
                head = f"{config} {a} vs {b} {table}:"
                if len(left) != len(right) or list(left.columns) != list(right.columns):
                    lines.append(f"{head} DIFFER in shape ({len(left)} and {len(right)} rows)")
                    same = False
                    continue
                cols = [c for c in left.columns if not any(s in c for s in SKIPPED)]
                differ = [c for c in cols if not left[c].reset_index(drop=True).equals(right[c].reset_index(drop=True))]
                lines.append(f"{head} {len(left)} rows, {len(cols)} columns: "
                             + ("IDENTICAL" if not differ else f"DIFFER in {', '.join(differ)}"))
                same = same and not differ
    if not lines:
        raise BenchError(f"{gpu_json}: no pair of runs to compare (needs two of {', '.join(sorted({*sum(PAIRS, ())}))} "
                         "on one config)")
    return lines, same


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.same_numbers", description=__doc__.splitlines()[0])
    ap.add_argument("gpu_json", type=Path, help="the gpu.json a bench.gpu_bench run wrote")
    args = ap.parse_args(argv)
    try:
        lines, same = compare(args.gpu_json)
    except BenchError as exc:
        print(f"python -m bench.same_numbers: error: {exc}", file=sys.stderr)
        return 2
    print("\n".join(lines))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
