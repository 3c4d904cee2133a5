"""`python -m MODULE ARGS` for tests that check a command's exit code and output many times over: each command runs
in a process forked from one that has already imported torch, pandas and fedsim, so it costs its own work and not
an interpreter start and those imports (3-5 CPU-s each on a 2-core machine like CI's).

The forked child runs the module as `python -m` does (`runpy`, as `__main__`, with `sys.argv`, the working
directory, the environment and standard streams of the call) and leaves through the interpreter's own exit, so
a traceback, an exit code, a thread left running or a hang show as they would. What it cannot show is a failure
while importing: the tests that check a real process start (`tests/test_forked.py`, and every test that starts
`sys.executable` itself) cover that.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])

# Reads one JSON request per line, forks a child for it and answers with the child's exit status. The imports
# are those of a run's driver; nothing here runs a torch operation, so no thread pool exists to be forked.
SERVER = r"""
import gc, json, os, runpy, signal, sys, time, traceback
import numpy, pandas, pyarrow.parquet, torch, yaml
import fedsim.registry, fedsim.results.tables, fedsim.runtime.loop
for kind in fedsim.registry.KINDS:
    fedsim.registry.load_builtins(kind)
# not the commands' own modules: runpy runs those as __main__, and warns about one already imported

def child(req):
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)  # its SystemExit ends the process

gc.freeze()  # the imports' objects: no child collects them (their exit took 1.1 s, now 0.5)
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(req)
        except SystemExit:
            raise  # the command's own exit code, through the interpreter's exit
        except BaseException:
            traceback.print_exc()
            sys.exit(1)
        sys.exit(0)
    deadline, status = time.monotonic() + req["timeout"], None
    while status is None:
        done, raw = os.waitpid(pid, os.WNOHANG)
        if done:
            status = os.waitstatus_to_exitcode(raw)
        elif time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            status = "timeout"
        else:
            time.sleep(0.005)
    print(json.dumps({"status": status}), flush=True)
"""

_server: subprocess.Popen | None = None


def _start() -> subprocess.Popen:
    global _server
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        atexit.register(_server.kill)
    return _server


def run_module(module: str, args: Sequence[str], cwd: str | Path = ROOT, env: dict[str, str] | None = None,
               timeout: float = 300) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)` returns, from a forked child (raises subprocess.TimeoutExpired the same way)."""
    server = _start()
    with tempfile.TemporaryDirectory(prefix="fedsim-forked-") as out:
        streams = {name: os.path.join(out, name) for name in ("stdout", "stderr")}
        request = {"module": module, "args": [str(a) for a in args], "cwd": str(cwd), "timeout": timeout,
                   "env": dict(os.environ if env is None else env), **streams}
        assert server.stdin is not None and server.stdout is not None
        server.stdin.write(json.dumps(request) + "\n")
        server.stdin.flush()
        answer = server.stdout.readline()
        if not answer:
            raise RuntimeError(f"the forking server ended (exit {server.wait()})")
        status = json.loads(answer)["status"]
        out_text, err_text = (Path(streams[n]).read_text(errors="replace") for n in ("stdout", "stderr"))
    argv = [sys.executable, "-m", module, *map(str, args)]
    if status == "timeout":
        raise subprocess.TimeoutExpired(argv, timeout, out_text, err_text)
    return subprocess.CompletedProcess(argv, status, out_text, err_text)
