"""`python -m jobs.stress_readme`: write the scale tables of docs/scale.md from the stress results they report.

Every `<!-- stress:NAME -->` ... `<!-- /stress:NAME -->` block of docs/scale.md is replaced by the table of
`results/bench/stress_NAME.csv` (written by `fedsim stress ... --save NAME`) and the command and date recorded in
`results/bench/stress_NAME.md`. Points measured more than once (`--repeat`) show their medians. `--check` only
says which blocks differ from their files (exit 1), as the test suite does.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pandas as pd

from fedsim.errors import ConfigError, FedsimError
from jobs.args import OneLineParser
from jobs.readme_blocks import paste_blocks, read_blocks

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "scale.md"
BENCH = ROOT / "results" / "bench"
KEY = ["participants", "skip_late", "registered"]
NUMBERS = ["s_per_round", "startup_s", "peak_rss_gb", "peak_rss_driver_gb", "peak_rss_workers_gb", "object_store_mb",
           "computed"]  # what the table shows, besides KEY and status (spilled_states may be missing: n/a)


def _num(value: float, digits: int) -> str:
    return "n/a" if value != value else f"{value:,.{digits}f}"


def medians(df: pd.DataFrame) -> pd.DataFrame:
    """One row per point (participants, skip_late, registered) in first-measured order: medians over repeats."""
    ok = df[df["status"] == "ok"].copy()
    if "repeat" not in ok:
        ok["repeat"] = 0
    numeric = [c for c in ok.columns if c not in KEY and c != "status" and pd.api.types.is_numeric_dtype(ok[c])]
    out = ok.groupby(KEY, sort=False)[numeric].median().reset_index()
    out["repeats"] = ok.groupby(KEY, sort=False)["repeat"].nunique().to_numpy()
    return out


def render(df: pd.DataFrame, header: str) -> str:
    """The table of one stress result: a row per point, the round time relative to the point with the
    fewest registered clients (same participants and skip_late), and the command and date of `header`."""
    rows = medians(df)
    lines = ["| registered | per round | skip_late | s / round | vs. fewest registered | start-up s | "
             "peak RSS GiB (driver / workers) | object store MB | updates computed | spilled states |",
             "|---:|---:|---|---:|---:|---:|---|---:|---:|---:|"]
    for _, r in rows.iterrows():
        same = rows[(rows["participants"] == r["participants"]) & (rows["skip_late"] == r["skip_late"])]
        base = same.loc[same["registered"].idxmin(), "s_per_round"]
        ratio = f"{r['s_per_round'] / base:.2f}×" if base > 0 else "n/a"
        lines.append(" | ".join([
            f"| {int(r['registered']):,}", f"{int(r['participants']):,}", "yes" if r["skip_late"] else "no",
            _num(r["s_per_round"], 3), ratio, _num(r["startup_s"], 1),
            f"{_num(r['peak_rss_gb'], 2)} ({_num(r['peak_rss_driver_gb'], 2)} / {_num(r['peak_rss_workers_gb'], 2)})",
            _num(r["object_store_mb"], 0), _num(r["computed"], 0),
            _num(r.get("spilled_states", float("nan")), 0)]) + " |")
    repeats = int(rows["repeats"].max()) if len(rows) else 0
    note = f" Medians of {repeats} interleaved repeats." if repeats > 1 else ""
    failed = int((df["status"] != "ok").sum())
    note += f" {failed} point(s) failed and are left out." if failed else ""
    return "\n".join(lines) + "\n\n" + header + note + "\n"


def read_points(csv: Path) -> pd.DataFrame:
    """A stress table written by `fedsim stress --save`, with the columns the page shows; anything else (an empty
    or binary file, missing columns, text where numbers belong) is a one-line ConfigError."""
    try:
        df = pd.read_csv(csv)
    except (ValueError, UnicodeDecodeError, pd.errors.ParserError) as exc:
        lines = str(exc).strip().splitlines() or [type(exc).__name__]
        raise ConfigError(f"{csv}: not a table written by `fedsim stress --save` ({lines[0][:200]})") from None
    missing = [c for c in [*KEY, "status", *NUMBERS] if c not in df.columns]
    if missing:
        raise ConfigError(f"{csv}: not a table written by `fedsim stress --save` (no column {missing[0]!r})")
    ok = df[df["status"] == "ok"]
    text = [c for c in ["registered", "participants", *NUMBERS, "spilled_states"] if c in ok.columns
            and not pd.api.types.is_numeric_dtype(ok[c])]
    if text:
        raise ConfigError(f"{csv}: column {text[0]!r} holds text where numbers belong")
    for c in ("registered", "participants"):  # counts: whole, finite, not negative
        bad = ok[c][~(ok[c].notna() & (ok[c] >= 0) & (ok[c] < 2**63) & (ok[c] % 1 == 0))]
        if len(bad):
            raise ConfigError(f"{csv}: column {c!r} holds {bad.iloc[0]!r}, not a count of clients")
    return df


def header_of(md: Path) -> str:
    """The command and measurement lines that `fedsim stress` wrote at the top of its markdown table."""
    try:
        text = md.read_text(encoding="utf-8")
    except UnicodeDecodeError:
        raise ConfigError(f"{md}: not text; write it with `fedsim stress ... --save NAME`") from None
    keep = [line.strip() for line in text.splitlines() if line.startswith(("Command:", "Measured"))]
    if not keep:
        raise ConfigError(f"{md}: no 'Command:' line; write it with `fedsim stress ... --save NAME`")
    return ". ".join(line.rstrip(". ") for line in keep) + "."


def block(name: str, bench: Path = BENCH) -> str:
    """The text between a block's markers, from results/bench/stress_NAME.csv and .md."""
    csv, md = bench / f"stress_{name}.csv", bench / f"stress_{name}.md"
    for f in (csv, md):
        if not f.is_file():
            raise ConfigError(f"docs block stress:{name}: {f} is missing; run `fedsim stress ... --save {name}`")
    body = render(read_points(csv), header_of(md))
    return f"<!-- generated by `python -m jobs.stress_readme` from results/bench/stress_{name}.csv; do not edit -->\n" \
           + body


def stale(page: Path = PAGE, bench: Path = BENCH) -> list[str]:
    """The names of the page's stress blocks that differ from their result files."""
    blocks = read_blocks(page.read_text(encoding="utf-8"), "stress")
    return [name for name, body in blocks.items() if body != block(name, bench)]


def paste(page: Path = PAGE, bench: Path = BENCH) -> list[str]:
    """Rewrite every stress block of `page` from its files; returns the names written."""
    names = list(read_blocks(page.read_text(encoding="utf-8"), "stress"))
    paste_blocks(page, "stress", {name: block(name, bench) for name in names})
    return names


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="python -m jobs.stress_readme", description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="only list the blocks that differ from their files")
    args = p.parse_args(argv)
    try:
        if args.check:
            names = stale()
            print("stale: " + ", ".join(names) if names else "docs/scale.md's stress tables are current")
            return 1 if names else 0
        print("wrote docs/scale.md blocks: " + (", ".join(paste()) or "none"))
        return 0
    except FedsimError as exc:
        print(f"fedsim: error: {exc}", file=sys.stderr)
        return exc.exit_code


if __name__ == "__main__":
    sys.exit(main())
