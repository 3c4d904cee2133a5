"""Where a program's memory is at its peak: each process's private, library and shared-memory pages.

    python -m bench.proc_memory [--every 0.5] [--maps N] -- COMMAND [ARG ...]

Runs COMMAND, reads /proc/<pid>/status (RssAnon, RssFile, RssShmem) of it and every descendant every `--every`
seconds, and prints the processes at the moment their summed RSS was highest: what the bench's peak RSS column is
made of (Ray's daemons, the workers, the object store's pages a process touched). `--maps N` adds, under each
process, the N mappings that held most of it (a library or data file, the object store, [heap], [anon]), read
from /proc/<pid>/smaps at that moment. Linux only.
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


def mappings_mb(pid: int) -> dict[str, float]:
    """A process's RSS in MB by what is mapped: a file's path, or [heap], [stack], [anon] ({} once it is gone)."""
    out: dict[str, float] = {}
    name = "[anon]"
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for line in f:
                head = line.split(maxsplit=5)
                if not head:
                    continue
                if head[0] == "Rss:":
                    out[name] = out.get(name, 0.0) + int(head[1]) / 1024
                elif "-" in head[0] and not head[0].endswith(":"):  # a mapping's first line: range, perms, ...
                    name = head[5].strip() if len(head) > 5 else "[anon]"
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
    ap.add_argument("--maps", type=int, default=0, help="the largest mappings of each process to list (0: none)")
    ap.add_argument("command", nargs="+", help="the program to run, after --")
    args = ap.parse_args(argv)
    if not args.every > 0:
        ap.error(f"--every: must be > 0, got {args.every}")
    if args.maps < 0:
        ap.error(f"--maps: must be >= 0, got {args.maps}")
    try:
        proc = subprocess.Popen(args.command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    except OSError as exc:
        ap.error(f"{args.command[0]}: cannot start ({exc.strerror or exc})")
    root = psutil.Process(proc.pid)
    peak, at_peak, maps = 0, [], {}
    while proc.poll() is None:
        rows = sample(root)
        total = sum(sum(parts.values()) for _, _, parts in rows)
        if total > peak:
            peak, at_peak = total, rows
            maps = {pid: mappings_mb(pid) for pid, _, _ in rows} if args.maps else {}
        time.sleep(args.every)
    print(f"exit {proc.returncode}; peak RSS {peak} MB summed over {len(at_peak)} processes")
    print(f"{'RSS':>6} {'private':>8} {'library':>8} {'shared':>7}  command")
    for pid, cmd, parts in sorted(at_peak, key=lambda r: -sum(r[2].values())):
        print(f"{sum(parts.values()):6d} {parts.get('RssAnon', 0):8d} {parts.get('RssFile', 0):8d} "
              f"{parts.get('RssShmem', 0):7d}  {cmd[:90]}")
        largest = sorted(maps.get(pid, {}).items(), key=lambda kv: -kv[1])[:args.maps]
        for name, mb in largest:
            print(f"{'':6} {mb:8.1f}  {name}")
        if args.maps and not largest:  # read after the sample: a process that ended meanwhile has none to show
            print(f"{'':6} {'':8}  (its mappings could not be read: the process ended first)")
    return 0 if proc.returncode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
