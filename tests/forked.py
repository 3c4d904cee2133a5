"""`python -m MODULE ARGS` for tests that check a command's exit code and output many times over: each command runs
in a process forked from one that has already imported torch, pandas and fedsim, so it costs its own work and not
an interpreter start and those imports (3-5 CPU-s each on a 2-core machine like CI's).

The forked child runs the module as `python -m` does (`runpy`, as `__main__`, with `sys.argv`, the working
directory, the environment and standard streams of the call) and leaves as the interpreter's exit does: its
threads joined, its atexit handlers run, its standard streams flushed, the exit code of its SystemExit, so a
traceback, an exit code, a thread left running or a hang show as they would. It then ends without tearing the
interpreter down: in a forked copy of a process that imported torch and pandas, the teardown's reference counting
touched every shared page (0.32 CPU-s a command, against 0.03 for the command itself). What it cannot show is a
failure while importing or while tearing down: the tests that check a real process (`tests/test_forked.py`, and
every test that starts `sys.executable` itself) cover those.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])

# Reads one JSON request per line, forks a child for it and answers with the child's pid, then its exit status.
# The imports are those of a run's driver; nothing here runs a torch operation, so no thread pool exists to be
# forked.
SERVER = r"""
import atexit, gc, json, os, runpy, signal, sys, threading, time, traceback
import numpy, pandas, pyarrow.parquet, torch, yaml
import fedsim.registry, fedsim.results.tables, fedsim.runtime.loop
for kind in fedsim.registry.KINDS:
    fedsim.registry.load_builtins(kind)
# not the commands' own modules: runpy runs those as __main__, and warns about one already imported

def child(req):
    if req["session"]:
        os.setsid()  # as Popen's start_new_session: a test may signal the command's whole process group
    os.chdir(req["cwd"])
    os.environ.clear()
    os.environ.update(req["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600), fd)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    sys.argv = [req["module"], *req["args"]]
    runpy.run_module(req["module"], run_name="__main__", alter_sys=True)

def exit_code(exc):  # the interpreter's reading of a SystemExit: None is 0, an int itself, anything else printed, 1
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)
    return 1

def leave(code):  # what the interpreter's exit does that a command can see, in its order; then no teardown
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception as exc:  # as the interpreter reports a stream it cannot flush, with exit code 120
            os.write(2, f"Exception ignored in: {stream!r}\n{type(exc).__name__}: {exc}\n".encode())
            code = 120
    os._exit(code & 0xFF)

gc.freeze()  # the imports' objects: no child collects them
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        try:
            child(req)
            code = 0
        except SystemExit as exc:
            code = exit_code(exc)
        except BaseException:
            traceback.print_exc()
            code = 1
        try:
            leave(code)
        finally:
            os._exit(1)  # whatever leave() met, the child never returns to the server's loop
    print(json.dumps({"pid": pid}), flush=True)
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
_started: Forked | None = None  # a command started by start_module whose end the server has not yet told


def _start() -> subprocess.Popen:
    global _server
    if _started is not None:  # a test that failed before waiting for its command: end it, read its answer
        _started.kill()
        _started.wait()
    if _server is None or _server.poll() is not None:
        _server = subprocess.Popen([sys.executable, "-c", SERVER], cwd=ROOT, stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": ROOT})
        atexit.register(_server.kill)
    return _server


def _answer(server: subprocess.Popen, key: str) -> int | str:
    assert server.stdout is not None
    line = server.stdout.readline()
    if not line:
        raise RuntimeError(f"the forking server ended (exit {server.wait()})")
    return json.loads(line)[key]


class Forked:
    """`python -m MODULE ARGS` started in a forked child, for a test that signals it while it runs: what
    `subprocess.Popen(..., stdout=PIPE, stderr=PIPE, text=True)` offers such a test (pid, poll, send_signal, kill,
    wait, communicate). The test waits for it before its next command."""

    def __init__(self, module: str, args: Sequence[str], cwd: str | Path, env: dict[str, str] | None,
                 timeout: float, new_session: bool, stdout: str | None = None) -> None:
        global _started
        self.server = _start()
        self.args = [sys.executable, "-m", module, *map(str, args)]
        self.timeout = timeout
        self._folder = tempfile.TemporaryDirectory(prefix="fedsim-forked-")
        self.streams = {name: os.path.join(self._folder.name, name) for name in ("stdout", "stderr")}
        if stdout is not None:
            self.streams["stdout"] = stdout
        request = {"module": module, "args": [str(a) for a in args], "cwd": str(cwd), "timeout": timeout,
                   "env": dict(os.environ if env is None else env), "session": new_session, **self.streams}
        assert self.server.stdin is not None
        self.server.stdin.write(json.dumps(request) + "\n")
        self.server.stdin.flush()
        self.pid = int(_answer(self.server, "pid"))
        self.returncode: int | None = None
        self._status: int | str | None = None
        _started = self

    def poll(self) -> int | None:
        if self._status is None:
            try:
                os.kill(self.pid, 0)  # running, or ended and not yet reaped by the server (a few ms)
                return None
            except ProcessLookupError:
                pass
        return self.wait()

    def wait(self, timeout: float | None = None) -> int:
        """The exit code (the server ends a command past its request's time limit: TimeoutExpired)."""
        global _started
        if self._status is None:
            self._status = _answer(self.server, "status")
            _started = None
        if self._status == "timeout":
            raise subprocess.TimeoutExpired(self.args, self.timeout, *self.output())
        self.returncode = int(self._status)
        return self.returncode

    def output(self) -> tuple[str, str]:
        """The command's standard output and error (a stream sent to a device, such as /dev/full, reads as "")."""
        out, err = (Path(self.streams[n]) for n in ("stdout", "stderr"))
        return (out.read_text(errors="replace") if out.is_file() else "",
                err.read_text(errors="replace") if err.is_file() else "")

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.output()

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            with contextlib.suppress(ProcessLookupError):  # it ended since
                os.kill(self.pid, sig)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start_module(module: str, args: Sequence[str], cwd: str | Path = ROOT, env: dict[str, str] | None = None,
                 timeout: float = 600, new_session: bool = False) -> Forked:
    """`subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=env, stdout=PIPE, stderr=PIPE,
    text=True, start_new_session=new_session)`, from a forked child."""
    return Forked(module, args, cwd, env, timeout, new_session)


def run_module(module: str, args: Sequence[str], cwd: str | Path = ROOT, env: dict[str, str] | None = None,
               timeout: float = 300, stdout: str | None = None) -> subprocess.CompletedProcess:
    """What `subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=env, capture_output=True,
    text=True, timeout=timeout)` returns, from a forked child (raises subprocess.TimeoutExpired the same way).
    `stdout`: a file the command writes its standard output to instead (its text is then not returned)."""
    command = Forked(module, args, cwd, env, timeout, new_session=False, stdout=stdout)
    code = command.wait()
    out_text, err_text = command.output()
    return subprocess.CompletedProcess(command.args, code, "" if stdout else out_text, err_text)
