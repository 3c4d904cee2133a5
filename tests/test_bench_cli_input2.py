"""Bad input to the bench's command-line tools: one line on stderr, `bench.<tool>: error: ` and the argument or file
it names, exit code 2, before anything is prepared, measured, started or written, and nothing left behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types
from pathlib import Path

import pandas as pd
import pytest

from bench import (
    dosfl_memory,
    fedavg_bench,
    multinode_traffic,
    phase_latency,
    ray_floor,
    report,
    scale_bench,
    selection_bench,
)
from bench.common import Workload
from bench.prepare import prepare
from tests.conftest import ROOT
from tests.test_bench_cli_input import outcome


def refused(main, tool: str, argv: list[str], flag: str, capsys) -> str:
    """Assert the one-line refusal of `argv`, naming `flag`; the line."""
    code, err = outcome(main, argv, capsys)
    assert code == 2 and len(err) == 1, (code, err)
    assert err[0].startswith(f"bench.{tool}: error: ") and flag in err[0], err
    return err[0]


def nothing_in(folder: Path) -> bool:
    return not folder.exists() or not any(folder.iterdir())


@pytest.fixture
def matrix(tmp_path, monkeypatch):
    """fedavg_bench and scale_bench with results/bench under tmp_path and the run matrix stubbed: a test may set
    `rows`; without rows, running at all fails the test."""
    monkeypatch.setattr(report, "OUT", tmp_path / "out")
    calls: dict = {}

    def run_matrix(workloads, systems, repeat, fedsim_args, tag, timeout, cache):
        if "rows" not in calls:
            raise AssertionError("the matrix ran")
        calls.update(workloads=workloads, systems=systems)
        return pd.DataFrame(calls["rows"])

    monkeypatch.setattr(fedavg_bench, "run_matrix", run_matrix)
    monkeypatch.setattr(scale_bench, "run_matrix", run_matrix)
    monkeypatch.setattr(fedavg_bench, "versions", lambda: {"python": "3"})
    return calls


def failed_row(config: str, system: str) -> dict:
    return {"config": config, "system": system, "repeat": 0, "status": "rc=1", "log": "x.log", "load_before": 0.1}


def ok_row(config: str, system: str) -> dict:
    return {**failed_row(config, system), "status": "ok", "total_seconds": 3.0, "startup_seconds": 1.0,
            "seconds_per_round": 1.0, "round_seconds": [1.0, 1.0], "peak_rss_mb": 100.0, "final_accuracy": 0.3}


# ---------------------------------------------------------------------------------------------------------
# fedavg_bench, scale_bench
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--configs", ""], "--configs"), (["--configs", ","], "--configs"), (["--configs", "A,a"], "--configs"),
    (["--configs", "Z"], "--configs"), (["--systems", ""], "--systems"), (["--systems", "plain,plain"], "--systems"),
    (["--systems", "fedsim"], "--systems"), (["--repeat", "0"], "--repeat"), (["--repeat", "-1"], "--repeat"),
    (["--repeat", "1001"], "--repeat"), (["--rounds", "1000001"], "--rounds"), (["--timeout", "0"], "--timeout"),
    (["--timeout", "nan"], "--timeout"), (["--timeout", "inf"], "--timeout"), (["--stem", ""], "--stem"),
    (["--stem", "../escape"], "--stem"), (["--stem", "/tmp/abs"], "--stem"), (["--stem", "sub/name"], "--stem"),
    (["--stem=.hidden"], "--stem"), (["--repeat", "x"], "argument --repeat"),
])
def test_fedavg_bench_refuses_bad_arguments_before_running(matrix, tmp_path, capsys, argv, flag):
    refused(fedavg_bench.main, "fedavg_bench", ["--configs", "C", "--systems", "plain",
                                                "--cache", str(tmp_path / "cache"), *argv], flag, capsys)
    assert nothing_in(tmp_path)


@pytest.mark.parametrize("place", ["out-under-a-file", "md-is-a-folder", "logs-is-a-file"])
def test_matrix_outputs_are_checked_before_running(matrix, tmp_path, monkeypatch, capsys, place):
    (tmp_path / "file").write_text("x")
    if place == "out-under-a-file":
        monkeypatch.setattr(report, "OUT", tmp_path / "file" / "bench")
    if place == "md-is-a-folder":
        (tmp_path / "out" / "fedavg.md").mkdir(parents=True)
    if place == "logs-is-a-file":
        monkeypatch.setattr(report, "OUT", tmp_path)
        (tmp_path / "logs").write_text("x")
    line = refused(fedavg_bench.main, "fedavg_bench", ["--configs", "C", "--cache", str(tmp_path / "cache")],
                   str(tmp_path), capsys)
    assert line.endswith({"out-under-a-file": "file is not a folder", "md-is-a-folder": "fedavg.md is a folder",
                          "logs-is-a-file": "logs is not a folder"}[place])
    assert sorted(p.name for p in tmp_path.rglob("*")) == sorted(["file"] + ["out", "fedavg.md"] * (
        place == "md-is-a-folder") + ["logs"] * (place == "logs-is-a-file"))


@pytest.mark.parametrize("argv, flag", [
    (["--clients", "abc"], "--clients"), (["--clients", ""], "--clients"), (["--clients", ","], "--clients"),
    (["--clients", "0"], "--clients"), (["--clients", "4.5"], "--clients"), (["--clients", "1e9"], "--clients"),
    (["--clients", "1000,1e3"], "--clients"), (["--per-round", "0"], "--per-round"), (["--repeat", "0"], "--repeat"),
    (["--rounds", "0"], "--rounds"), (["--timeout", "-1"], "--timeout"), (["--systems", ","], "--systems"),
    (["--systems", "fedsim,fedsim"], "--systems"), (["--stem", "../x"], "--stem"),
])
def test_scale_bench_refuses_bad_arguments_before_running(matrix, tmp_path, capsys, argv, flag):
    refused(scale_bench.main, "scale_bench", ["--cache", str(tmp_path / "cache"), *argv], flag, capsys)
    assert nothing_in(tmp_path)


@pytest.mark.parametrize("tool", [fedavg_bench, scale_bench])
def test_a_matrix_where_every_run_failed_exits_1_and_keeps_the_previous_results(matrix, tmp_path, capsys, tool):
    matrix["rows"] = [failed_row("C", "plain"), failed_row("N1000", "fedsim")]
    argv = ["--clients", "1e3"] if tool is scale_bench else ["--configs", "C"]
    code, err = outcome(tool.main, ["--cache", str(tmp_path / "cache"), *argv], capsys)
    assert code == 1 and len(err) == 1 and err[0].startswith(f"{tool.__name__}: error: every run failed"), err
    assert nothing_in(tmp_path / "out")
    if tool is scale_bench:  # 1e3 clients, as `fedsim stress --clients` reads it
        assert list(matrix["workloads"]) == ["N1000"]


def test_fedavg_bench_still_writes_its_results_when_a_run_finished(matrix, tmp_path, capsys):
    matrix["rows"] = [ok_row("C", "plain"), failed_row("C", "fedsim_ray")]
    argv = ["--configs", "c", "--systems", "plain,fedsim_ray", "--stem", "t.1", "--cache", str(tmp_path / "cache")]
    assert fedavg_bench.main(argv) == 0
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["t.1.csv", "t.1.json", "t.1.md"]
    assert matrix["systems"] == ["plain", "fedsim_ray"] and capsys.readouterr().err == ""


# ---------------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------------

SYSTEM = {"s_per_round": 1.0, "total_s": 5.0, "startup_s": 1.0, "shutdown_s": 0.1, "peak_rss_mb": 9.0,
          "final_accuracy": 0.5, "runs": 1, "failed": 0, "load_before": [0.5]}
WORKLOAD = {"N": 100, "K": 10, "R": 5, "model": "mlp"}


def summary_file(folder: Path, **change) -> Path:
    data = {"date": "2026-01-01T00:00:00", "command": "python -m bench.fedavg_bench", "machine": {"cpus": 2},
            "versions": {"torch": "2"}, "configs": {"A": {"workload": WORKLOAD, "plain": SYSTEM}}, **change}
    path = folder / "fedavg.json"
    path.write_text(json.dumps(data))
    return path


@pytest.mark.parametrize("change, names", [
    ({"configs": {}}, "configs"),
    ({"configs": {"A": {"workload": WORKLOAD}}}, "configs.A has no system"),
    ({"configs": {"A": {"workload": 5, "plain": SYSTEM}}}, "configs.A.workload"),
    ({"configs": {"A": {"workload": {**WORKLOAD, "N": "x"}, "plain": SYSTEM}}}, "configs.A.workload: N"),
    ({"configs": {"A": {"plain": {**SYSTEM, "s_per_round": True}}}}, "configs.A.plain: s_per_round"),
    ({"configs": {"A": {"plain": {**SYSTEM, "total_s": float("nan")}}}}, "configs.A.plain: total_s"),
    ({"configs": {"A": {"plain": {**SYSTEM, "load_before": "x"}}}}, "configs.A.plain: load_before"),
    ({"configs": {"A": {"plain": {**SYSTEM, "runs": 1.5}}}}, "configs.A.plain: runs"),
    ({"versions": [1, 2]}, "versions"), ({"machine": "m"}, "machine"), ({"date": 5}, "date"),
    ({"ray_floor_startup_s": False}, "ray_floor_startup_s"),
])
def test_report_refuses_a_summary_it_could_not_render(tmp_path, capsys, change, names):
    path = summary_file(tmp_path, **change)
    assert refused(report.main, "report", [str(path)], names, capsys).startswith(f"bench.report: error: {path}: ")


def test_report_renders_a_well_formed_summary(tmp_path, capsys):
    assert report.main([str(summary_file(tmp_path))]) == 0
    assert "| A: mlp, N=100, K=10, R=5 | plain | 1.00 |" in capsys.readouterr().out


def test_report_refuses_a_summary_that_is_not_a_regular_file_without_waiting(tmp_path, capsys):
    os.mkfifo(tmp_path / "fifo")  # reading it would wait for a writer forever
    refused(report.main, "report", [str(tmp_path / "fifo")], "is not a regular file", capsys)


@pytest.mark.parametrize("readme", ["", "missing.md", "folder", "bytes.md", "gpu-bytes"])
def test_report_docs_refusals_are_one_line_and_touch_nothing(tmp_path, capsys, readme):
    summary = summary_file(tmp_path)
    (tmp_path / "folder").mkdir()
    (tmp_path / "bytes.md").write_bytes(b"\xff\xfe\x00\x9c" * 64)
    good = "<!-- bench:fedavg -->\nold\n<!-- /bench:fedavg -->\n<!-- bench:gpu -->\nold\n<!-- /bench:gpu -->\n"
    (tmp_path / "README.md").write_text(good)
    if readme == "gpu-bytes":  # gpu.md beside the summary is pasted too
        (tmp_path / "gpu.md").write_bytes(b"# t\n\xff\xfe\x9c\n")
        readme = "README.md"
    target = str(tmp_path / readme) if readme else ""
    refused(report.main, "report", [str(summary), "--docs", target], "gpu.md" if readme == "README.md" else
            "--docs", capsys)
    assert (tmp_path / "README.md").read_text() == good and not (tmp_path / "missing.md").exists()
    assert (tmp_path / "bytes.md").read_bytes() == b"\xff\xfe\x00\x9c" * 64


# ---------------------------------------------------------------------------------------------------------
# dosfl_memory, phase_latency, ray_floor
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture
def no_ray(monkeypatch):
    """`import ray` gives a module whose every use fails the test: the checks come before Ray starts."""
    class Untouchable(types.ModuleType):
        def __getattr__(self, name: str):
            raise AssertionError(f"ray.{name} used before the arguments were checked")

    for name in ("ray", "ray.dag", "ray.cluster_utils"):
        monkeypatch.setitem(sys.modules, name, Untouchable(name))


@pytest.mark.parametrize("argv, flag", [
    (["--iterations", "0"], "--iterations"), (["--iterations", "-1"], "--iterations"),
    (["--iterations", "10000000"], "--iterations"), (["--one", "zz"], "--one"), (["--out", "{tmp}"], "--out"),
    (["--out", "{tmp}/file/x.md"], "--out"), (["--out", "/proc/x"], "--out"), (["--out", "/proc/x/y.md"], "--out"),
])
def test_dosfl_memory_refuses_bad_arguments_before_measuring(tmp_path, monkeypatch, capsys, argv, flag):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(dosfl_memory, "measure", lambda *a: pytest.fail("measured"))
    monkeypatch.setattr(dosfl_memory.subprocess, "run", lambda *a, **k: pytest.fail("measured"))
    line = refused(dosfl_memory.main, "dosfl_memory", [a.format(tmp=tmp_path) for a in argv], flag, capsys)
    assert flag != "--one" or "MNIST LeNet (S_d=10" in line  # names the known settings
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("argv, flag", [
    (["--workers", "-1"], "--workers"), (["--workers", "0"], "--workers"), (["--workers", "5000"], "--workers"),
    (["--calls", "1"], "--calls"), (["--calls", "0"], "--calls"), (["--weights", "0"], "--weights"),
    (["--weights", str(2**40)], "--weights"),
])
def test_phase_latency_refuses_bad_arguments_before_ray_starts(no_ray, capsys, argv, flag):
    refused(phase_latency.main, "phase_latency", argv, flag, capsys)


@pytest.mark.parametrize("workers", ["-1", "0", "4097"])
def test_ray_floor_refuses_bad_workers_before_importing_ray(no_ray, capsys, workers):
    refused(ray_floor.main, "ray_floor", ["--workers", workers], "--workers", capsys)


@pytest.mark.parametrize("argv, tool", [
    (["bench.ray_floor", "--workers", "-1"], "ray_floor"), (["bench.phase_latency", "--calls", "1"], "phase_latency"),
    (["bench.dosfl_memory", "--iterations", "0"], "dosfl_memory"),
    (["bench.fedavg_bench", "--repeat", "abc"], "fedavg_bench"),
    (["bench.async_bench", "--registered", "a"], "async_bench"),
])
def test_programs_say_their_module_name_when_run_with_python_m(argv, tool):
    proc = subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith(f"bench.{tool}: error: ")


def test_the_ray_floor_reads_fedsims_worker_limit():
    from fedsim.config.limits import MAX_WORKERS

    assert ray_floor.max_workers() == MAX_WORKERS


# ---------------------------------------------------------------------------------------------------------
# multinode_traffic
# ---------------------------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """A tiny prepared workload of 2 rounds."""
    w = Workload(num_clients=4, clients_per_round=2, rounds=2, model="mlp", n_train=200, n_test=40)
    return prepare(w, tmp_path_factory.mktemp("bench-cache"))


@pytest.fixture
def temp(tmp_path, monkeypatch) -> Path:
    """The folder tempfile makes its folders in, for this test alone."""
    import tempfile

    folder = tmp_path / "tmp"
    folder.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(folder))
    return folder


@pytest.mark.parametrize("argv, flag", [
    (["--workload", "{tmp}/none"], "--workload"), (["--workload", "{tmp}/file"], "--workload"),
    (["--nodes", "0"], "--nodes"), (["--nodes", "-1"], "--nodes"), (["--rounds", "-1"], "--rounds"),
    (["--rounds", "0"], "--rounds"), (["--rounds", "3"], "--rounds"),  # client draws for 2 rounds are prepared
])
def test_multinode_traffic_refuses_bad_arguments_before_ray_or_a_temporary_folder(
        no_ray, prepared, temp, tmp_path, monkeypatch, capsys, argv, flag):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(multinode_traffic, "traffic", lambda *a: pytest.fail("ran"), raising=False)
    refused(multinode_traffic.main, "multinode_traffic",
            ["--workload", str(prepared), *[a.format(tmp=tmp_path) for a in argv]], flag, capsys)
    assert nothing_in(temp)


@pytest.mark.parametrize("fails", [False, True])
def test_multinode_traffic_removes_its_temporary_folder(prepared, temp, monkeypatch, fails):
    seen = []

    def traffic(args, w, rounds, out):
        assert Path(out).parent == temp and Path(out).is_dir() and rounds == 2
        (Path(out) / "run").mkdir()
        seen.append(out)
        if fails:
            raise RuntimeError("the cluster failed")

    monkeypatch.setattr(multinode_traffic, "traffic", traffic)
    if fails:
        with pytest.raises(RuntimeError):
            multinode_traffic.main(["--workload", str(prepared)])
    else:
        assert multinode_traffic.main(["--workload", str(prepared)]) == 0
    assert len(seen) == 1 and nothing_in(temp)


# ---------------------------------------------------------------------------------------------------------
# selection_bench
# ---------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("argv, flag", [
    (["--n", "0"], "--n"), (["--n", "-5"], "--n"), (["--threads", "0"], "--threads"),
    (["--threads", "1", "1"], "--threads"), (["--k", "0"], "--k"), (["--k", "-3"], "--k"),
    (["--k", "1000", "--n", "200"], "--k"), (["--niter", "0"], "--niter"), (["--out", "/proc/x/sel.md"], "--out"),
    (["--out", "{tmp}/file/sel.md"], "--out"), (["--out", "{tmp}"], "--out"),
])
def test_selection_bench_refuses_bad_arguments_before_measuring(tmp_path, monkeypatch, capsys, argv, flag):
    (tmp_path / "file").write_text("x")
    monkeypatch.setattr(selection_bench, "measure", lambda *a: pytest.fail("measured"))
    refused(selection_bench.main, "selection_bench",
            ["--n", "50", "--k", "5", "--niter", "1", "--threads", "1", "--out", str(tmp_path / "sel.md"),
             *[a.format(tmp=tmp_path) for a in argv]], flag, capsys)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_plain_loop_refuses_bad_threads_and_a_damaged_initial_model_in_one_line(prepared, tmp_path, capsys):
    import shutil

    import torch

    from bench import plain_fedavg

    code, err = outcome(plain_fedavg.main, ["--workload", str(prepared), "--threads", "0"], capsys)
    assert code == 2 and err == ["python -m bench.plain_fedavg: error: argument --threads: must be >= 1, got 0"]
    shutil.copytree(prepared.parent, tmp_path / "cache")  # the workload and the data folder it names
    damaged = tmp_path / "cache" / prepared.name
    torch.save({"w": slice(1, 2)}, damaged / "init.pt")  # a pickle the weights-only reader refuses
    code, err = outcome(plain_fedavg.main, ["--workload", str(damaged)], capsys)
    assert code == 2 and err[-1] == (f"plain_fedavg: error: {damaged / 'init.pt'}: not a weights file (torch's "
                                     "weights-only reader refused what it holds)"), err
