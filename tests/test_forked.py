"""tests/forked.py gives what a real `python -m` process gives: exit code, output, a traceback, a kill on timeout."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from tests.conftest import ROOT
from tests.forked import run_module, start_module


def real(module: str, *args: str, cwd: str = ROOT, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, capture_output=True, text=True,
                          timeout=timeout)


def test_a_config_error_is_the_same_line_and_exit_code_as_in_a_real_process(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: 2\nalgorithm: {name: fedavg}\ndata: {name: digits, num_clients: 0}\n")
    args = ["run", str(bad), "--quiet", "-o", f"results.root={tmp_path / 'results'}"]
    want, got = real("jobs.cli", *args), run_module("jobs.cli", args)
    assert want.returncode == 2 and "data.num_clients" in want.stderr
    assert (got.returncode, got.stdout, got.stderr) == (want.returncode, want.stdout, want.stderr)
    assert not (tmp_path / "results").exists()


def test_a_module_run_from_the_working_directory_exits_through_the_interpreter(tmp_path):
    """The working directory is on the path as with `python -m`; a thread still running holds the exit until it
    ends, its output comes after the main thread's, an atexit handler runs, a SystemExit's message is printed with
    exit code 1, and an exception is a traceback with exit code 1."""
    (tmp_path / "late.py").write_text(textwrap.dedent("""
        import sys, threading, time
        threading.Thread(target=lambda: (time.sleep(0.3), print("thread done", flush=True))).start()
        print("main done:", sys.argv[1:])
        sys.exit(3)
    """))
    (tmp_path / "bye.py").write_text(textwrap.dedent("""
        import atexit, sys
        atexit.register(lambda: print("atexit ran"))
        print("unflushed", end="")
        sys.exit("a message")
    """))
    (tmp_path / "broken.py").write_text("raise ValueError('boom')\n")
    for module, args in (("late", ["a", "b"]), ("bye", []), ("broken", [])):
        want, got = real(module, *args, cwd=str(tmp_path)), run_module(module, args, cwd=tmp_path)
        assert (got.returncode, got.stdout) == (want.returncode, want.stdout)
        assert got.stderr.splitlines()[-1:] == want.stderr.splitlines()[-1:]  # a traceback's frames differ
        if module == "bye":
            assert (got.returncode, got.stdout, got.stderr) == (1, "unflushedatexit ran\n", "a message\n")
    assert got.returncode == 1 and "Traceback" in got.stderr
    assert run_module("late", ["x"], cwd=tmp_path).stdout == "main done: ['x']\nthread done\n"


def test_a_child_past_its_time_is_killed_and_the_next_call_still_runs(tmp_path):
    (tmp_path / "sleepy.py").write_text("import time\ntime.sleep(60)\n")
    with pytest.raises(subprocess.TimeoutExpired):
        run_module("sleepy", [], cwd=tmp_path, timeout=0.5)
    assert run_module("jobs.cli", ["--help"]).returncode == 0


def test_a_started_command_takes_signals_as_a_real_process_does(tmp_path):
    """start_module: the pid is the command's own process (in a session of its own when asked), a signal reaches
    it there, and its exit code and output are a real process's; a kill is -9, and the next call still runs."""
    (tmp_path / "waits.py").write_text(textwrap.dedent("""
        import signal, sys, time
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
        print("ready", flush=True)
        time.sleep(60)
    """))
    want = subprocess.Popen([sys.executable, "-m", "waits"], cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    assert want.stdout.readline() == "ready\n"
    got = start_module("waits", [], cwd=tmp_path, new_session=True)
    deadline = time.monotonic() + 60
    while got.output()[0] != "ready\n" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert got.poll() is None and os.getpgid(got.pid) == got.pid
    for proc in (want, got):
        proc.send_signal(signal.SIGTERM)
    assert (got.wait(), got.output()) == (want.wait(), ("ready\n", "")) == (143, ("ready\n", ""))
    killed = start_module("waits", [], cwd=tmp_path)
    killed.kill()
    assert killed.wait() == -signal.SIGKILL
    assert run_module("jobs.cli", ["--help"]).returncode == 0
