"""Bad input to the GPU bench, bench.prepare, bench.fedsim_fedavg, bench.gpu_util_probe and bench.batch_host_cost:
one line on stderr naming the argument or file, exit code 2, found before anything is prepared, measured or
written, and nothing left behind. The heavy steps are stubbed to fail the test, so a check that lets bad input
through fails at once instead of running (or hanging on) the work."""

from __future__ import annotations

import json
import re
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fedsim.data.synthetic
from bench import gpu_bench, gpu_util_probe
from bench import prepare as prepare_mod
from bench.common import BenchError
from bench.prepare import prepare
from bench.workload import make_config, prepared_inputs
from tests.conftest import ROOT
from tests.forked import run_module
from tests.test_bench import TINY

pytestmark = pytest.mark.timeout(120)


def outcome(main, argv: list[str], capsys) -> tuple[int, list[str]]:
    """A tool's exit code (returned, or raised by its parser) and its stderr lines."""
    try:
        code = main(argv)
    except SystemExit as exc:
        code = exc.code
    return code, capsys.readouterr().err.strip().splitlines()


def assert_refused(code: int, err: list[str], tool: str, needle: str) -> None:
    """Exit 2 and exactly one stderr line: `[python -m ][bench.]tool: error: ...` that contains `needle`."""
    assert code == 2 and len(err) == 1, (code, err)
    assert re.match(rf"(python -m )?(bench\.)?{tool}: error: ", err[0]), err
    assert needle in err[0], err


def snapshot(folder: Path) -> list[Path]:
    return sorted(folder.rglob("*"))


def fill(args: list[str], tmp_path: Path) -> list[str]:
    """The arguments with {tmp} put in: tmp_path holds `file` (a regular file), `script` (an executable that is
    no Python) and `dir` (an empty folder)."""
    return [a.replace("{tmp}", str(tmp_path)) for a in args]


@pytest.fixture
def places(tmp_path):
    (tmp_path / "file").write_text("not a folder\n")
    script = tmp_path / "script"
    script.write_text("#!/bin/sh\nexit 0\n")
    script.chmod(script.stat().st_mode | stat.S_IXUSR)
    (tmp_path / "dir").mkdir()
    return tmp_path


@pytest.fixture
def no_work(monkeypatch):
    """Making images, drawing clients or running a program fails the test: bad input must stop before them."""
    def reached(*args, **kwargs):
        raise AssertionError("bad input reached the work")

    monkeypatch.setattr(fedsim.data.synthetic, "make_synthetic", reached)
    monkeypatch.setattr(prepare_mod, "draws_and_seeds", reached)
    monkeypatch.setattr(gpu_bench, "run_program", reached)


# ---------------------------------------------------------------------------------------------------------
# bench.gpu_bench
# ---------------------------------------------------------------------------------------------------------

GPU_CASES = [
    (["--configs", ""], "--configs: no config given"),
    (["--configs", ","], "--configs: no config given"),
    (["--systems", ""], "--systems: no system given"),
    (["--systems", ","], "--systems: no system given"),
    (["--python", "/nonexistent/python"], "--python /nonexistent/python"),
    (["--python", "{tmp}/file"], "--python"),  # not executable
    (["--python", "{tmp}/script"], "does not run as Python"),
    (["--out", "{tmp}/file/out"], "--out"),
    (["--out", "/proc/fedsim-bench-out"], "--out"),
    (["--out", ""], "--out"),
    (["--cache", "{tmp}/file/cache"], "--cache"),
    (["--cache", "/proc/fedsim-bench-cache"], "--cache"),
    (["--n-train", "1000000000000"], "--n-train"),
    (["--rounds", "1000000000000"], "--rounds"),
    (["--rounds", "P=5,P=6"], "--rounds"),
    (["--configs", "A", "--rounds", "A=2,a=3"], "given twice"),
    (["--rounds", "=5"], "--rounds"),
    (["--rounds", ""], "--rounds"),
    (["--rounds", ","], "--rounds"),
    (["--rounds", "P=5=6"], "is not NAME=ROUNDS"),
    (["--configs", "P,P"], "--configs: config 'P' is given twice"),
    (["--configs", "A,a"], "--configs: config 'A' is given twice"),
    (["--systems", "plain,plain"], "--systems: system 'plain' is given twice"),
    (["--configs", "A", "--systems", "pfl_2proc"], "--systems"),  # no run at all
    (["--timeout", "0"], "--timeout"),
    (["--timeout", "-1"], "--timeout"),
    (["--timeout", "nan"], "--timeout"),
]


@pytest.mark.parametrize("args, needle", GPU_CASES, ids=[" ".join(a) or "''" for a, _ in GPU_CASES])
def test_gpu_bench_refuses_bad_arguments_before_preparing_or_running(places, no_work, capsys, args, needle):
    tmp = places
    before = snapshot(tmp)
    base = ["--configs", "P", "--systems", "plain", "--device", "cpu", "--n-train", "1000", "--n-test", "100",
            "--clients-per-round", "5", "--rounds", "2", "--out", str(tmp / "out"), "--cache", str(tmp / "cache")]
    code, err = outcome(gpu_bench.main, base + fill(args, tmp), capsys)
    assert_refused(code, err, "gpu_bench", needle)
    assert snapshot(tmp) == before  # nothing prepared, no output folder


@pytest.mark.parametrize("ok", [False, True], ids=["every run failed", "one ran"])
def test_gpu_bench_exits_1_with_one_line_when_every_run_failed(tmp_path, monkeypatch, capsys, ok):
    def run_program(cmd, log, timeout, cwd):
        good = ok and "bench.plain_fedavg" in cmd
        return {"status": "ok", "seconds_per_round": 0.5, "R": 2} if good else {"status": "rc=1", "log": str(log)}

    monkeypatch.setattr(gpu_bench, "prepare", lambda w, cache, log=None: tmp_path / "prepared")
    monkeypatch.setattr(gpu_bench, "run_program", run_program)
    code = gpu_bench.main(["--configs", "P", "--systems", "plain,fedsim_seq", "--device", "cpu", "--rounds", "2",
                           "--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")])
    err = capsys.readouterr().err.strip().splitlines()
    runs = json.loads((tmp_path / "out" / "gpu.json").read_text())["runs"]
    assert [r["status"] for r in runs] == ["ok" if ok else "rc=1", "rc=1"]  # the results are kept either way
    assert "| P: N=1000, K=50, R=2, cnn, batch 10 | fedsim local, one after another | failed (rc=1" in \
        (tmp_path / "out" / "gpu.md").read_text()
    if ok:
        assert code == 0 and err == []
    else:
        assert code == 1 and len(err) == 1 and err[0].startswith("bench.gpu_bench: error: every run failed (2 of 2)")


RUN = {"config": "P", "system": "plain", "status": "ok", "R": 12, "seconds_per_round": 0.341,
       "round_seconds": [1.119, 0.3], "total_seconds": 25.93, "final_accuracy": 0.1966}
META = {"command": "python -m bench.gpu_bench --configs P", "date": "2026-11-27 13:59", "machine": "vm", "cpus": 16,
        "gpu": "NVIDIA H100 80GB HBM3", "versions": {"torch": "2.11.0", "pfl": "0.6.0", "ray": "2.60.0"}}
RENDER_CASES = {
    "no meta": {"runs": [RUN]},
    "no runs": {**META, "runs": []},
    "runs not a list": {**META, "runs": {"P": RUN}},
    "unknown system": {**META, "runs": [{**RUN, "system": "zzz"}]},
    "unknown config": {**META, "runs": [{**RUN, "config": "Z"}]},
    "text for a number": {**META, "runs": [{**RUN, "seconds_per_round": "1.5"}]},
    "round seconds not numbers": {**META, "runs": [{**RUN, "round_seconds": ["1.1"]}]},
    "zero rounds": {**META, "runs": [{**RUN, "R": 0}]},
    "negative rounds, cohort above the clients": {**META, "runs": [{**RUN, "R": -5, "K": 10000}]},
    "cohort above the clients": {**META, "runs": [{**RUN, "K": 10000}]},
    "failed run without its log": {**META, "runs": [{"config": "P", "system": "plain", "status": "rc=1"}]},
    "versions not a mapping": {**META, "versions": "2.11", "runs": [RUN]},
}


@pytest.mark.parametrize("name", list(RENDER_CASES))
def test_gpu_bench_render_checks_the_whole_file_before_writing_anything(tmp_path, capsys, name):
    saved = tmp_path / "gpu_old.json"
    saved.write_text(json.dumps(RENDER_CASES[name]))
    text = saved.read_bytes()
    code, err = outcome(gpu_bench.main, ["--render", str(saved)], capsys)
    assert_refused(code, err, "gpu_bench", f"--render {saved}: not a gpu.json written by this bench (")
    assert sorted(tmp_path.iterdir()) == [saved] and saved.read_bytes() == text  # no .csv or .md, the .json as it was


def test_gpu_bench_render_leaves_its_json_alone_and_refuses_other_names(tmp_path, capsys):
    saved = tmp_path / "gpu_old.json"
    saved.write_text(json.dumps({**META, "runs": [RUN]}))  # not the indented form the bench writes
    text = saved.read_bytes()
    assert gpu_bench.main(["--render", str(saved)]) == 0
    assert saved.read_bytes() == text
    assert (tmp_path / "gpu_old.md").is_file() and (tmp_path / "gpu_old.csv").is_file()
    csv_named = tmp_path / "runs.csv"  # its .csv would be the file itself
    csv_named.write_text(json.dumps({**META, "runs": [RUN]}))
    code, err = outcome(gpu_bench.main, ["--render", str(csv_named)], capsys)
    assert_refused(code, err, "gpu_bench", "name a .json file")
    assert json.loads(csv_named.read_text())["runs"] == [RUN]


# ---------------------------------------------------------------------------------------------------------
# bench.prepare
# ---------------------------------------------------------------------------------------------------------

PREPARE_CASES = [
    (["-R", "1000000000000"], "--rounds"),
    (["-N", "1000000000000"], "--num-clients"),
    (["-K", "1000000000000"], "--clients-per-round"),
    (["-E", "1000000000000"], "--local-epochs"),
    (["--batch-size", "1000000000000"], "--batch-size"),
    (["--eval-batch-size", "1000000000000"], "--eval-batch-size"),
    (["--n-train", "1000000000000"], "--n-train"),
    (["--n-test", "1000000000000"], "--n-test"),
    (["--n-train", "5000000", "--n-test", "1000000"], "--n-train"),  # 69 GiB of images
    (["-N", "1000", "-K", "1000", "-R", "100000", "--n-train", "1000"], "--rounds"),  # 10^8 client draws
    (["--seed", "-1"], "--seed"),
    (["--seed", str(2**32)], "--seed"),
    (["--data-seed", "-1"], "--data-seed"),
    (["--alpha", "nan"], "--alpha"),
    (["--alpha", "inf"], "--alpha"),
    (["--lr", "nan"], "--lr"),
    (["--lr", "inf"], "--lr"),
    (["--lr", "0"], "--lr"),
    (["--momentum", "5"], "--momentum"),
    (["--momentum", "1"], "--momentum"),
    (["--momentum", "nan"], "--momentum"),
    (["--amp", "nan"], "--amp"),
    (["--amp", "-1"], "--amp"),
    (["--cache", "{tmp}/file"], "--cache"),
    (["--cache", "{tmp}/file/cache"], "--cache"),
    (["--cache", "/proc/fedsim-bench-cache"], "--cache"),
    (["--cache", ""], "--cache"),
]


@pytest.mark.parametrize("args, needle", PREPARE_CASES, ids=[" ".join(a) or "''" for a, _ in PREPARE_CASES])
def test_prepare_refuses_bad_knobs_and_caches_in_one_line(places, no_work, capsys, args, needle):
    tmp = places
    before = snapshot(tmp)
    base = ["-N", "6", "-K", "3", "-R", "2", "--model", "mlp", "--n-train", "600", "--n-test", "100",
            "--cache", str(tmp / "cache")]
    code, err = outcome(prepare_mod.main, base + fill(args, tmp), capsys)
    assert_refused(code, err, "prepare", f"error: {needle}")
    assert snapshot(tmp) == before


def test_prepare_turns_fedsims_own_errors_into_one_line(tmp_path, monkeypatch, capsys):
    from fedsim.errors import ConfigError

    def refuse(*args, **kwargs):
        raise ConfigError("data.options: synthetic images would take too much")

    monkeypatch.setattr(fedsim.data.synthetic, "make_synthetic", refuse)
    code, err = outcome(prepare_mod.main, ["-N", "6", "-K", "3", "-R", "2", "--model", "mlp", "--n-train", "600",
                                           "--n-test", "100", "--cache", str(tmp_path / "cache")], capsys)
    progress = [line for line in err if line.startswith("preparing ")]  # prepare's own progress lines go to stderr
    assert_refused(code, [line for line in err if line not in progress], "prepare", "data.options")
    assert not (tmp_path / "cache").exists()  # nothing half-written


# ---------------------------------------------------------------------------------------------------------
# bench.fedsim_fedavg
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return prepare(TINY["mlp"], tmp_path_factory.mktemp("bench-input-cache"))


FEDSIM_CASES = [
    (["--workers", "-1"], "--workers"),
    (["--workers", "0"], "--workers"),
    (["--workers", "1000000000000"], "--workers"),
    (["--client-cpus", "0"], "--client-cpus"),
    (["--client-cpus", "-1"], "--client-cpus"),
    (["--client-cpus", "nan"], "--client-cpus"),
    (["-o", "rounds=5"], "rounds=5"),
    (["-o", "participation.clients_per_round=2"], "participation.clients_per_round=2"),
    (["-o", "data.num_clients=7"], "data.num_clients=7"),
    (["-o", "model.name=cnn"], "model.name=cnn"),
    (["-o", "seed=3"], "seed=3"),
    (["-o", "rounds"], "override 'rounds'"),
    (["--profile-out", "{tmp}/p.txt"], "--profile-out: needs --profile-rounds"),
    (["--profile-rounds", "1:2", "--profile-out", "{tmp}/dir"], "--profile-out"),
    (["--profile-rounds", "1:2", "--profile-out", ""], "--profile-out"),
]


@pytest.mark.parametrize("args, needle", FEDSIM_CASES, ids=[" ".join(a) for a, _ in FEDSIM_CASES])
def test_fedsim_program_refuses_bad_arguments_before_its_run(places, folder, args, needle):
    tmp = places
    before = snapshot(tmp)
    proc = run_module("bench.fedsim_fedavg", ["--workload", str(folder), "--backend", "local", "-o",
                                              f"results.root={tmp / 'runs'}", *fill(args, tmp)], timeout=90)
    assert_refused(proc.returncode, proc.stderr.strip().splitlines(), "fedsim_fedavg", needle)
    assert snapshot(tmp) == before  # no run folder, no profile


@pytest.mark.parametrize("args", [["--workload", "/nonexistent"], ["-o", "rounds=5"]], ids=["no folder", "rounds"])
def test_fedsim_program_on_ray_refuses_before_ray_starts(folder, tmp_path, args):
    """Ray takes seconds to start and writes its own line on stderr: a bad folder or override is refused first."""
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "bench.fedsim_fedavg", "--workload", str(folder),
                           "-o", f"results.root={tmp_path}", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=90)
    assert_refused(proc.returncode, proc.stderr.strip().splitlines(), "fedsim_fedavg", args[-1])
    assert time.perf_counter() - t0 < 10 and not any(tmp_path.iterdir())


@pytest.mark.parametrize("override", ["rounds=5", "participation.clients_per_round=2", "seed=1"])
def test_prepared_inputs_refuse_a_config_the_folder_was_not_prepared_for(folder, override):
    cfg = make_config(TINY["mlp"], [override, "runtime.backend=local"])
    with pytest.raises(BenchError, match=re.escape(override.split("=")[0] + "=")):
        prepared_inputs(cfg, folder)


# ---------------------------------------------------------------------------------------------------------
# bench.gpu_util_probe, bench.batch_host_cost
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("out", ["{tmp}/dir", "", "/proc/fedsim-probe.json", "{tmp}/no/probe.json",
                                 "{tmp}/file/probe.json"])
def test_gpu_util_probe_refuses_its_out_before_any_gpu_work(places, monkeypatch, capsys, out):
    import torch

    import bench.common

    def reached(*args, **kwargs):
        raise AssertionError("a bad --out reached the GPU phases")

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # as on a GPU machine
    monkeypatch.setattr(bench.common, "GpuSampler", reached)
    monkeypatch.setattr(gpu_util_probe, "_run_phase", reached)
    before = snapshot(places)
    code, err = outcome(gpu_util_probe.main, ["--out", *fill([out], places)], capsys)
    assert_refused(code, err, "gpu_util_probe", "--out")
    assert snapshot(places) == before


@pytest.mark.parametrize("args, needle", [
    (["--clients", "1000000000000"], "--clients"),
    (["--clients", "2", "--phases", "1000000000000"], "--phases"),
    (["--clients", "100001"], "--clients"),
], ids=["clients", "phases", "clients just above"])
def test_batch_host_cost_refuses_sizes_beyond_its_bounds(args, needle):
    proc = subprocess.run([sys.executable, "-m", "bench.batch_host_cost", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)
    assert_refused(proc.returncode, proc.stderr.strip().splitlines(), "batch_host_cost", needle)
