"""Config loading: defaults, overrides, and one-line errors that name the key or file (exit code 2)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import yaml

from fedsim.config.schema import RunConfig
from fedsim.configure import load_config
from fedsim.errors import ConfigError
from tests.conftest import ROOT


def test_defaults_and_overrides(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"rounds": 7, "algorithm": {"name": "fedprox", "mu": 0.5},
                                    "data": {"partition": {"alpha": 0.1}}}))
    cfg = load_config(path, ["train.lr=0.2", "algorithm.mu=0.25", "participation.clients_per_round=3"])
    assert isinstance(cfg, RunConfig)
    assert (cfg.rounds, cfg.train.lr, cfg.algorithm.name, cfg.algorithm.params.mu) == (7, 0.2, "fedprox", 0.25)
    assert cfg.data.partition.alpha == 0.1 and cfg.participation.clients_per_round == 3
    assert cfg.data.name == "digits" and cfg.train.batch_size == 32  # defaults kept


@pytest.mark.parametrize("overrides, message", [
    (["trian.lr=0.1"], r"trian: unknown key"),
    (["train.lr=fast"], r"train.lr: expected a number, got 'fast'"),
    (["train.lr=0"], r"train.lr: must be > 0"),
    (["data.partition.kind=zipf"], r"data.partition.kind: must be one of"),
    (["train.epochs=1.5"], r"train.epochs: expected an integer"),
    (["algorithm.mu=0.1"], r"algorithm.mu: unknown key"),
    (["algorithm.name=fedprox", "algorithm.mu=-1"], r"algorithm.mu: must be >= 0"),
    (["algorithm.name=nope"], r"algorithm.name: unknown algorithm 'nope'"),
    (["participation.clients_per_round=50"], r"clients_per_round: 50 exceeds data.num_clients=20"),
    (["participation.clients_per_round=5", "participation.fraction=0.5"], r"participation: set clients_per_round"),
    (["model.mix={cnn: 3, mlp: 3}"], r"model.mix: counts sum to 6"),
    (["rounds"], r"expected key=value"),
])
def test_bad_values_name_the_key(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, overrides)


def test_partial_nested_override_keeps_the_field_defaults():
    cfg = load_config(None, ["stragglers.bandwidth_mbps.sigma=0.25"])
    assert cfg.stragglers.bandwidth_mbps.mean == 20.0 and cfg.stragglers.bandwidth_mbps.sigma == 0.25
    with pytest.raises(ConfigError, match="stragglers.speed.sigmaa: unknown key"):
        load_config(None, ["stragglers.speed.sigmaa=1"])


def test_all_errors_reported_together():
    with pytest.raises(ConfigError) as info:
        load_config(None, ["train.lr=-1", "rounds=0", "bogus=1"])
    text = str(info.value)
    assert "train.lr" in text and "rounds" in text and "bogus" in text


def test_missing_and_malformed_files(tmp_path):
    with pytest.raises(ConfigError, match="config file not found: .*nope.yaml"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("rounds: [1, 2\n")
    with pytest.raises(ConfigError, match=r"bad.yaml line \d+: not valid YAML"):
        load_config(bad)
    scalar = tmp_path / "scalar.yaml"
    scalar.write_text("42\n")
    with pytest.raises(ConfigError, match="expected a mapping"):
        load_config(scalar)


@pytest.mark.parametrize("args, fragment", [
    (["run", "missing.yaml"], "config file not found: missing.yaml"),
    (["run", "configs"], "config file configs: a folder, not a file"),  # was "not found"
    (["run", "configs/demo.yaml", "-o", "train.lr=abc"], "train.lr: expected a number"),
    (["run", "--resume", "no/such/run"], "not a run folder"),
    (["results", "show", "no/such/run"], "not a fedsim run folder"),
    (["run", "--frobnicate"], "unrecognized arguments"),
])
def test_cli_errors_are_one_line_exit_2(args, fragment):
    proc = subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and fragment in lines[0], proc.stderr
    assert "Traceback" not in proc.stderr


FAST_ERROR = """
import sys
from jobs.cli import main
code = main(sys.argv[1:])
print(code, sorted(m for m in ("torch", "fedsim.algorithms") if m in sys.modules))
"""


@pytest.mark.parametrize("override", ["train.lr=abc", "rounds=0", "runtime.backend=nope"])
def test_a_typo_in_a_common_section_is_reported_before_torch_is_imported(override):
    """`fedsim run` with a bad common value answers at once (0.1 s, not the 3 s of importing torch and every method)."""
    proc = subprocess.run([sys.executable, "-c", FAST_ERROR, "run", "configs/demo.yaml", "-o", override], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip() == "2 []" and proc.stderr.startswith("fedsim: error: "), proc.stdout + proc.stderr


def test_resolved_config_round_trips(tmp_path, make_config):
    from fedsim.config.schema import config_to_dict
    from fedsim.configure import save_config

    cfg = make_config("algorithm.name=fedprox", "algorithm.mu=0.3")
    save_config(cfg, tmp_path / "config.yaml")
    again = load_config(tmp_path / "config.yaml")
    assert config_to_dict(again) == config_to_dict(cfg)


def test_a_retired_knob_still_loads_with_a_warning_so_older_run_folders_resume(caplog):
    """runtime.cuda_graphs and runtime.overlap_eval were deleted; an older run folder's saved config sets them."""
    with caplog.at_level("WARNING", logger="fedsim.config.schema"):
        cfg = load_config(None, ["runtime.cuda_graphs=on", "runtime.overlap_eval=auto", "rounds=2"])
    assert cfg.rounds == 2 and not hasattr(cfg.runtime, "cuda_graphs")
    assert [r.getMessage() for r in caplog.records] == [
        "runtime.cuda_graphs is retired (see the performance docs) and is ignored",
        "runtime.overlap_eval is retired (see the performance docs) and is ignored"]
