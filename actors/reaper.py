"""Stops the local Ray a driver started once that driver is gone, however it went (kill -9 and OOM included).

Ray's daemons outlive a killed driver: gcs_server and raylet stop, but DashboardAgent and RuntimeEnvAgent
linger for minutes. When fedsim starts a local Ray it starts this watcher (`python reaper.py`, standard
library only) and sends it the Ray session folder. The watcher blocks on a pipe that only the driver holds;
at end-of-file it stops every process with a file open in a watched session folder (each Ray process keeps
its logs open there): SIGTERM, then SIGKILL after a grace period. Process titles cannot be used: Ray renames
its agents (`ray::DashboardAgent`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

GRACE_S = 5.0

_watcher: subprocess.Popen | None = None


def session_pids(session_dir: str, exclude: set[int]) -> list[int]:
    """Processes (of this user) with a file open inside `session_dir`, but those in `exclude`."""
    prefix = session_dir.rstrip("/") + "/"
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) in exclude:
            continue
        try:
            fds = os.listdir(f"/proc/{name}/fd")
            if any(os.readlink(f"/proc/{name}/fd/{fd}").startswith(prefix) for fd in fds):
                out.append(int(name))
        except OSError:  # gone, or another user's
            continue
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b") ", 1)[1][:1] != b"Z"
    except (OSError, IndexError):
        return False


def stop(pids: list[int], grace_s: float = GRACE_S) -> None:
    """SIGTERM, then SIGKILL whatever is still running after `grace_s`."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            try:
                os.kill(pid, sig)
            except OSError:
                continue
        end = time.monotonic() + grace_s
        while sig == signal.SIGTERM and time.monotonic() < end and any(_alive(p) for p in pids):
            time.sleep(0.1)
        pids = [p for p in pids if _alive(p)]


def watch(session_dir: str) -> None:
    """Have this driver's watcher (started on first use) stop `session_dir`'s processes when the driver ends."""
    global _watcher
    if not sys.platform.startswith("linux"):
        return
    if _watcher is None or _watcher.poll() is not None:
        _watcher = subprocess.Popen([sys.executable, "-S", os.path.abspath(__file__), str(os.getpid())],
                                    stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                    start_new_session=True)
    try:
        assert _watcher.stdin is not None
        _watcher.stdin.write(session_dir.encode() + b"\n")
        _watcher.stdin.flush()
    except OSError:  # the watcher was killed: Ray still stops on a normal exit
        _watcher = None


if __name__ == "__main__":
    if len(sys.argv) != 2 or not sys.argv[1].isdigit():  # started by `watch`, never by hand
        print(f"{os.path.basename(sys.argv[0])}: fedsim's watcher of a local Ray takes one argument, the pid of the "
              f"driver that started it (then Ray session folders on standard input); got {sys.argv[1:]}",
              file=sys.stderr)
        sys.exit(2)
    sessions = [line.strip() for line in sys.stdin.buffer if line.strip()]  # until the driver's end closes
    spare = {os.getpid(), int(sys.argv[1])}  # the driver may still be exiting, with its own Ray log open
    stop(sorted({pid for s in sessions for pid in session_pids(s.decode(), spare)}))
