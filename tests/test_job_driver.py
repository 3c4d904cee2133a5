"""What a submitted Ray job's driver says about itself: a head whose Python lacks fedsim, and where a relative
results.root puts a job's results."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from actors.plugins import JOB_CONFIG_VAR
from jobs.cli import say_where_a_job_writes
from tests.conftest import ROOT


@pytest.mark.parametrize("module", ["torch", "ray"])
def test_a_head_without_fedsims_dependencies_gets_one_line_naming_the_fix(module, tmp_path):
    code = (f"import sys, runpy; sys.modules[{module!r}] = None; sys.argv = ['jobs.run', 'configs/demo.yaml']; "
            "runpy.run_module('jobs.run', run_name='__main__')")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
                          env={"PYTHONPATH": ROOT, "PATH": "/usr/bin:/bin"})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.splitlines() == [
        f"fedsim: error: this Python ({sys.executable}) cannot import {module}: a job's driver runs on the head with "
        "the head's Python; install fedsim there (`pip install fedsim-ray`, as ray_cluster.yaml's setup_commands do), "
        "or add it to the job: --runtime-env-json '{\"pip\": [\"fedsim-ray\"]}'"]


def test_a_job_says_at_start_where_a_relative_results_root_puts_its_runs(monkeypatch, tmp_path, capsys):
    monkeypatch.chdir(tmp_path)
    say_where_a_job_writes("results")
    assert capsys.readouterr().err == ""  # not in a job: the user's own folder
    monkeypatch.setenv(JOB_CONFIG_VAR, "{}")
    for root in ("s3://bucket/fedsim", "/mnt/shared/results", str(tmp_path / "abs")):
        say_where_a_job_writes(root)
        assert capsys.readouterr().err == ""
    say_where_a_job_writes("results")
    assert capsys.readouterr().err.splitlines() == [
        "fedsim: in a Ray job, results.root 'results' is inside Ray's copy of the working folder on the head: results "
        f"go to {Path(tmp_path).resolve() / 'results'}, which Ray deletes when it trims its cache; set results.root to "
        "a folder every node mounts or a bucket (s3://...)"]
