"""Every leaf of a resolved config, mutated to a hostile value, through `fedsim run`: each case must exit 0 (a
legal value), 2 with one line, or 1 with the one line of a run whose every client failed in a round (a legal but
useless value, such as a learning rate that makes every client diverge), with no traceback, no hang and no folder
left behind.

The cases run through `jobs.cli.main` in one warmed-up runner (imports done, one run made), so a case costs its own
work only: those that the config refuses in the runner itself, the others each in a fork of it, with a time limit
and a memory limit so that a value that asks for terabytes fails in its process rather than on the machine. One
case also runs as a real `fedsim` subprocess and must print the same line.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.conftest import ROOT

pytestmark = pytest.mark.slow

CASE_TIMEOUT_S = 60
PARALLEL = 2
UNKNOWN = "fuzz_unknown_key"
BASE = {"name": "fuzz", "rounds": 1, "algorithm": {"name": "fedavg"},
        "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
        "participation": {"clients_per_round": 2}, "train": {"epochs": 1},
        "runtime": {"backend": "local", "threads": 1}, "results": {"root": "results"}}

# From a process that has already made a run: the cases the config refuses run in it, each other case in a fork of
# it; prints one JSON line per case.
RUNNER = r"""
import io, json, os, resource, signal, sys, time, traceback
root, base, warm_dir, timeout, parallel = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4]), int(sys.argv[5])
sys.path.insert(0, root)
from fedsim.configure import load_config
from fedsim.errors import FedsimError
from jobs.cli import main

os.chdir(warm_dir)
sys.stdout = io.StringIO()
assert main(["run", base, "--quiet"]) == 0, "the base config must run"
sys.stdout = sys.__stdout__
status = dict(line.split(":", 1) for line in open("/proc/self/status").read().splitlines() if ":" in line)
data_limit = int(status["VmData"].split()[0]) * 1024 + 4 * 2**30  # 4 GiB more than a whole run needed


def call(case):  # main(argv) in this process, its output caught: the exit code, stderr and any traceback
    code, tb = None, ""
    sys.stdout, sys.stderr = io.StringIO(), io.StringIO()
    try:
        code = main(case["argv"])
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        tb = traceback.format_exc()
    err = sys.stderr.getvalue()
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    return {"code": code, "stderr": err, "traceback": tb}


# Whether the config alone refuses the case (a FedsimError from load_config, before anything runs or is written):
# such a case runs here, in 6 ms, instead of in a fork of this 700 MB process (40 ms).
def refused_by_the_config(case):
    signal.alarm(int(timeout))  # a hang in the check is a failure of the whole runner, not a silent pass
    try:
        load_config(base, case["argv"][4::2])
    except FedsimError:
        return True
    except BaseException:
        return False  # a bug: the fork reports its traceback
    finally:
        signal.alarm(0)
    return False


def child(case):
    signal.alarm(int(timeout))  # a case past its time limit ends by SIGALRM's default action, even in C code
    os.chdir(case["cwd"])
    resource.setrlimit(resource.RLIMIT_DATA, (data_limit, data_limit))
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 1)
    os.dup2(null, 2)
    result = call(case)
    with open(case["out"], "w") as fh:
        json.dump(result, fh)
    os._exit(0)


cases, running = [], {}
for case in map(json.loads, sys.stdin):
    if not refused_by_the_config(case):
        cases.append(case)
        continue
    os.chdir(case["cwd"])
    t0 = time.monotonic()
    result = call(case)
    print(json.dumps({**result, "id": case["id"], "hung": False, "seconds": time.monotonic() - t0}), flush=True)
while cases or running:
    while cases and len(running) < parallel:
        case = cases.pop(0)
        pid = os.fork()
        if pid == 0:
            child(case)
        running[pid] = (case, time.monotonic())
    pid, status = os.waitpid(-1, 0)  # blocking: a case's own alarm bounds its time
    case, t0 = running.pop(pid)
    hung = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM
    try:
        with open(case["out"]) as fh:
            result = json.load(fh)
    except (OSError, ValueError):
        result = {"code": None, "stderr": "", "traceback": f"process ended without a result (status {status})"}
    result.update(id=case["id"], hung=hung, seconds=time.monotonic() - t0)
    print(json.dumps(result), flush=True)
"""

# keys that the base config leaves unused get the context that makes the run read them
CONTEXT = {"stragglers.": ["stragglers.enabled=true"],
           "participation.fraction": ["participation.clients_per_round=null"]}


def leaves(d: dict, prefix: str = ""):
    """(dotted key, value) of every leaf; an empty mapping is a leaf."""
    for k, v in d.items():
        if isinstance(v, dict) and v:
            yield from leaves(v, f"{prefix}{k}.")
        else:
            yield f"{prefix}{k}", v


def hostile_values(value):
    """Wrong types, negative, huge, NaN and infinities, chosen by the leaf's current value."""
    if isinstance(value, bool):
        return [1, "maybe", [True]]
    if isinstance(value, (int, float)):
        return ["abc", [value], -abs(value) - 1, 10**12 if isinstance(value, int) else 1e12, math.nan, math.inf,
                -math.inf]
    if isinstance(value, str):
        return [123, 1.5, [value]]
    if isinstance(value, dict):
        return ["abc", 7, [1], {UNKNOWN: 1}]
    if isinstance(value, list):
        return ["abc", 7, [[1]]]
    return ["abc", [1], -1, 10**12, 1e12, math.nan, math.inf]  # None: an optional knob of any type


def as_override(key: str, value) -> str:
    """`key=value` that the CLI's YAML parsing turns back into exactly `value`."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**6).strip()
    text = text[:-3].strip() if text.endswith("...") else text
    parsed = yaml.safe_load(text)
    assert parsed == value or (isinstance(value, float) and math.isnan(value) and math.isnan(parsed)), (value, text)
    return f"{key}={text}"


def fuzz_cases() -> list[list[str]]:
    """Override lists: every leaf of the fedavg config, fedprox's own parameters, and an unknown key per section."""
    from fedsim.config.schema import config_to_dict
    from fedsim.configure import build_config

    out: list[list[str]] = []
    for algorithm in ("fedavg", "fedprox"):
        base = {**BASE, "algorithm": {"name": algorithm}}
        resolved = config_to_dict(build_config(base))
        prefix = [f"algorithm.name={algorithm}"] if algorithm != "fedavg" else []  # its params follow
        sections = {""} if algorithm == "fedavg" else set()
        for key, value in leaves(resolved):
            if algorithm != "fedavg" and not key.startswith("algorithm."):
                continue  # the rest was covered with fedavg
            if key == "algorithm.name":
                values = hostile_values(value) + ["no_such_method"]
            else:
                values = hostile_values(value)
            context = [o for k, extra in CONTEXT.items() if key.startswith(k) for o in extra]
            out += [prefix + context + [as_override(key, v)] for v in values]
            sections.add(key.rsplit(".", 1)[0] + "." if "." in key else "")
        out += [prefix + [f"{s}{UNKNOWN}=1"] for s in sorted(sections)]
    return out


def test_every_config_leaf_survives_hostile_values(tmp_path, capsys):
    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(BASE))
    (tmp_path / "warm").mkdir()
    (tmp_path / "out").mkdir()
    cases = []
    for i, overrides in enumerate(fuzz_cases()):
        cwd = tmp_path / "cases" / str(i)
        cwd.mkdir(parents=True)
        argv = ["run", str(base), "--quiet"] + [a for o in overrides for a in ("-o", o)]
        cases.append({"id": i, "argv": argv, "cwd": str(cwd), "out": str(tmp_path / "out" / f"{i}.json")})
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0"}
    proc = subprocess.run([sys.executable, "-c", RUNNER, ROOT, str(base), str(tmp_path / "warm"),
                           str(CASE_TIMEOUT_S), str(PARALLEL)], input="\n".join(json.dumps(c) for c in cases),
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=3600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = {r["id"]: r for r in map(json.loads, proc.stdout.splitlines())}
    assert sorted(results) == [c["id"] for c in cases]

    failures = []
    for case in cases:
        r = results[case["id"]]
        overrides = " ".join(case["argv"][4::2])
        lines = [ln for ln in r["stderr"].splitlines() if ln.strip()]
        left = sorted(str(p.relative_to(case["cwd"])) for p in Path(case["cwd"]).rglob("*"))
        if r["hung"]:
            problem = f"no exit within {CASE_TIMEOUT_S} s"
        elif r["traceback"] or "Traceback" in r["stderr"]:
            problem = "traceback: " + (r["traceback"] or r["stderr"]).strip().splitlines()[-1][:200]
        elif r["code"] == 2 and not (len(lines) == 1 and lines[0].startswith(("fedsim: error: ",
                                                                                "fedsim run: error: "))):
            problem = f"exit 2 without one error line: {lines[:3]}"
        elif r["code"] == 2 and left:
            problem = f"exit 2 but left {left[:3]}"
        elif r["code"] == 1 and not (len(lines) == 1 and "every client failed" in lines[0] and lines[0].startswith(
                "fedsim: error: round ")):
            problem = f"exit 1 without the one line of a failed round: {lines[:3]}"
        elif r["code"] not in (0, 1, 2):
            problem = f"exit {r['code']}: {lines[-1:] if lines else ''}"
        else:
            continue
        failures.append(f"{overrides}: {problem}")

    exit0 = sum(results[c["id"]]["code"] == 0 for c in cases)
    exit2 = sum(results[c["id"]]["code"] == 2 for c in cases)
    tally = (f"config fuzz: {len(cases)} cases, {exit0} exit 0, {exit2} exit 2, {len(failures)} failures; "
             f"slowest case {max(r['seconds'] for r in results.values()):.1f} s")
    with capsys.disabled():
        print("\n" + tally + "".join(f"\n  FAIL {f}" for f in failures))

    # one case through the real command: same exit code, same line (the runner is the command's `main`, so one
    # case checks the runner; tests/test_forked.py compares forked and real processes as such)
    errors = [c for c in cases if results[c["id"]]["code"] == 2 and not results[c["id"]]["traceback"]]
    for case in errors[len(errors) // 2:][:1]:
        cwd = Path(case["cwd"])
        real = subprocess.run([sys.executable, "-m", "jobs.cli", *case["argv"]], cwd=cwd, env={
            **env, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=CASE_TIMEOUT_S * 3)
        expected = results[case["id"]]["stderr"].strip()
        assert (real.returncode, real.stderr.strip()) == (2, expected), (case["argv"], real.stderr[-2000:])
        assert not list(cwd.iterdir())

    assert not failures, tally + "".join(f"\n  {f}" for f in failures)
