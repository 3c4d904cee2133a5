"""Where a program's memory is at its peak: each process's private, library and shared-memory pages.

    python -m bench.proc_memory [--every 0.5] -- COMMAND [ARG ...]

Runs COMMAND, reads /proc/<pid>/status (RssAnon, RssFile, RssShmem) of it and every descendant every `--every`
seconds, and prints the processes at the moment their summed RSS was highest: what the bench's peak RSS column is
made of (Ray's daemons, the workers, the object store's pages a process touched). Linux only.
"""

from __future__ import annotations

import subprocess
import sys
import time

from bench.cli import OneLineParser

FIELDS = ("RssAnon", "RssFile", "RssShmem")


def status_mb(pid: int) -> dict[str, int]:
    """The RSS parts of one process, in MB ({} once it is gone)."""
    out: dict[str, int] = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key in FIELDS:
                    out[key] = int(value.split()[0]) // 1024
    except OSError:
        return {}
    return out


def sample(root) -> list[tuple[int, str, dict[str, int]]]:
    """(pid, command line, RSS parts) of `root` (a psutil.Process) and its descendants now."""
    import psutil

    rows = []
    for p in [root, *root.children(recursive=True)]:
        try:
            cmd = " ".join(p.cmdline()) or p.name()
        except psutil.Error:
            continue
        parts = status_mb(p.pid)
        if parts:
            rows.append((p.pid, cmd, parts))
    return rows


def main(argv: list[str] | None = None) -> int:
    import psutil

    ap = OneLineParser(prog="bench.proc_memory", description=__doc__.splitlines()[0])
    ap.add_argument("--every", type=float, default=0.5, help="seconds between samples")
    ap.add_argument("command", nargs="+", help="the program to run, after --")
    args = ap.parse_args(argv)
    if not args.every > 0:
        ap.error(f"--every: must be > 0, got {args.every}")
    try:
        proc = subprocess.Popen(args.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as exc:
        ap.error(f"{args.command[0]}: cannot start ({exc.strerror or exc})")
    root = psutil.Process(proc.pid)
    peak, at_peak = 0, []
    while proc.poll() is None:
        rows = sample(root)
        total = sum(sum(parts.values()) for _, _, parts in rows)
        if total > peak:
            peak, at_peak = total, rows
        time.sleep(args.every)
    print(f"exit {proc.returncode}; peak RSS {peak} MB summed over {len(at_peak)} processes")
    print(f"{'RSS':>6} {'private':>8} {'library':>8} {'shared':>7}  command")
    for _, cmd, parts in sorted(at_peak, key=lambda r: -sum(r[2].values())):
        print(f"{sum(parts.values()):6d} {parts.get('RssAnon', 0):8d} {parts.get('RssFile', 0):8d} "
              f"{parts.get('RssShmem', 0):7d}  {cmd[:90]}")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
