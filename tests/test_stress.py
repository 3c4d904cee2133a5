"""Stress machinery: the stress command's table, and the bounded personal-state cache that spills to disk."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest
import torch
import yaml

from fedsim.persist.checkpoint import load_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback, RunInfo
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.store import ClientStateStore, state_nbytes
from jobs.cli import main as cli
from tests.conftest import ROOT

SMALL_DATA = "data.options={n_train: 3000, n_test: 200, channels: 1, size: 8}"


def test_stress_command_writes_its_table_for_10_and_100_clients(tmp_path, capsys):
    out = tmp_path / "stress"
    code = cli(["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--clients", "10,100", "--rounds", "2",
                "--participants", "20", "--skip-late", "both", "--in-process", "--out", str(out),
                "-o", "runtime.backend=local", "-o", "runtime.threads=1", "-o", SMALL_DATA])
    assert code == 0
    assert "[stress] participants above the client count are capped to it: 20 per round with 10 clients runs 10\n" \
        in capsys.readouterr().err
    df = pd.read_parquet(out / "stress.parquet")
    assert df["registered"].tolist() == [10, 10, 100, 100]
    assert df["participants"].tolist() == [10, 10, 20, 20]  # capped at the client count
    assert df["skip_late"].tolist() == [False, True, False, True]
    assert (df["status"] == "ok").all() and (df["rounds"] == 2).all()
    assert (df["s_per_round"] > 0).all() and (df["startup_s"] > 0).all() and (df["peak_rss_gb"] > 0.1).all()
    # the local backend trains in the driver and has no object store: n/a, not a measured 0
    assert df["peak_rss_workers_gb"].isna().all() and df["object_store_mb"].isna().all()
    # 80%-quantile deadline: the late fifth is computed (and dropped) unless skip_late says not to compute it
    assert (df["late"] > 0).all()
    assert (df["computed"] == df["participants"]).where(~df["skip_late"], True).all()
    assert (df["computed"] == df["participants"] - df["late"]).where(df["skip_late"], True).all()
    md = (out / "stress.md").read_text()
    assert "| registered | participants | skip_late | s_per_round |" in md and "fedsim stress" in md
    assert (out / "stress.png").stat().st_size > 1000
    for run_dir in map(Path, df["run_dir"]):  # each point is a whole run: tables, config, meta.json
        res = load(run_dir)
        assert res["rounds"]["round"].tolist() == [0, 1] and res["meta"]["backend"] == "LocalBackend"
        assert (run_dir / "checkpoints" / "config.yaml").is_file()


def test_stress_reports_the_states_a_point_spilled_though_the_run_removes_them(tmp_path):
    out = tmp_path / "stress"
    code = cli(["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--clients", "40", "--rounds", "3",
                "--participants", "10", "--in-process", "--out", str(out),
                "-o", "runtime.backend=local", "-o", "runtime.threads=1", "-o", SMALL_DATA,
                "-o", "train.keep_optimizer_state=true", "-o", "train.momentum=0.9", "-o", "runtime.cache_bytes=1"])
    assert code == 0
    row = pd.read_parquet(out / "stress.parquet").iloc[0]
    # a one-byte cache keeps no state in memory: every client that trained has its momentum on disk
    assert row["spilled_states"] >= 10 and row["spilled_mb"] > 0
    assert not (Path(row["run_dir"]) / "spill").exists()  # the run removed them at its end


def test_a_stress_point_that_cannot_start_leaves_no_run_folder(tmp_path, capsys):
    out = tmp_path / "stress"
    code = cli(["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--clients", "10", "--rounds", "1", "--in-process",
                "--out", str(out), "-o", "runtime.backend=local", "-o", SMALL_DATA,
                "-o", "stragglers.trace=/no/such/trace.csv"])  # found missing once data and workers are ready
    err = capsys.readouterr().err
    assert code == 2 and err.splitlines()[-1].startswith("fedsim: error: stragglers.trace: cannot read /no/such")
    assert not (out / "runs").exists()


def test_stress_command_rejects_bad_counts(tmp_path, capsys):
    assert cli(["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--clients", "ten", "--out", str(tmp_path)]) == 2
    assert "--clients: expected comma-separated integers" in capsys.readouterr().err


def _exit_code(argv: list[str]) -> int:
    """The stress command's exit code, argument errors (argparse exits) included."""
    try:
        return cli(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("args, message", [
    (["--timeout", "0"], "fedsim stress: error: argument --timeout: must be > 0"),
    (["--timeout", "-1"], "fedsim stress: error: argument --timeout: must be > 0"),
    (["--clients", "99999999999999999999"], "fedsim: error: --clients: expected integers from 1 to 100,000,000"),
    (["--clients", "4.5"], "fedsim: error: --clients: expected whole numbers, got '4.5'"),
    (["--participants", "2.5"], "fedsim: error: --participants: expected whole numbers, got '2.5'"),
    (["--workers", "0"], "fedsim: error: --workers: must be from 1 to 4096, got 0"),
])
def test_stress_command_refuses_bad_arguments_in_one_line(tmp_path, capsys, args, message):
    out = tmp_path / "stress"
    argv = ["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--out", str(out), *args]
    assert _exit_code(argv + (["--clients", "4"] if "--clients" not in args else [])) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(message), lines
    assert not out.exists()


def test_a_point_past_its_timeout_is_a_failed_row(tmp_path, capsys):
    import psutil

    out = tmp_path / "stress"
    code = cli(["stress", f"{ROOT}/configs/stress/fedavg.yaml", "--clients", "4", "--rounds", "1", "--timeout", "0.5",
                "--out", str(out), "-o", "runtime.backend=local", "-o", SMALL_DATA])
    df = pd.read_parquet(out / "stress.parquet")
    assert code == 1 and df["status"].tolist() == ["failed: timed out after 0.5 s (--timeout)"]
    assert not [p for p in psutil.Process().children(recursive=True) if "--point" in p.cmdline()]


def test_a_relative_config_path_means_the_callers_file(tmp_path, monkeypatch):
    """The point's process runs where the command was given: base.yaml is the caller's, not a file of the
    repository (nor missing there), and so are the output folder and the runs in it."""
    (tmp_path / "base.yaml").write_text(yaml.safe_dump({
        "name": "mine", "rounds": 1, "model": {"name": "mlp"}, "train": {"epochs": 1},
        "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
        "participation": {"clients_per_round": 2}, "runtime": {"backend": "local", "threads": 1},
        "eval": {"mechanism": False}}))
    monkeypatch.chdir(tmp_path)
    assert cli(["stress", "base.yaml", "--clients", "4", "--rounds", "1", "--out", "out"]) == 0
    df = pd.read_parquet(tmp_path / "out" / "stress.parquet")
    assert df["status"].tolist() == ["ok"]
    assert load(tmp_path / df["run_dir"].item())["config"]["name"] == "mine"


class SpilledFiles(Callback):
    """The most spilled state files the run's spill/ held at a round's end."""

    most = 0

    def on_setup_end(self, run: RunInfo) -> None:
        self.folder = Path(run.run_dir) / "spill"

    def on_round_end(self, round, rows) -> None:
        self.most = max(self.most, len(list(self.folder.rglob("*.pt"))))


def _personal_run(make_config, cache: int | None, workers: int = 2, spilled: SpilledFiles | None = None):
    """FedAvg whose clients keep their SGD momentum across rounds: personal state that must survive spills."""
    cfg = make_config("train.keep_optimizer_state=true", "runtime.threads=1", "results.checkpoint_every=1",
                      "participation.clients_per_round=6", f"runtime.cache_bytes={'null' if cache is None else cache}",
                      rounds=4)
    return run(cfg, LocalBackend(num_workers=workers), callbacks=[spilled] if spilled else ())


def test_a_tiny_cache_gives_the_numbers_of_an_unbounded_one(make_config):
    unbounded = _personal_run(make_config, None)
    spilled = SpilledFiles()
    tiny = _personal_run(make_config, 1, spilled=spilled)  # one byte: every state but the one in use lives on disk
    a, b = load(unbounded), load(tiny)
    keep = [c for c in a["rounds"].columns if not c.endswith("_s")]
    pd.testing.assert_frame_equal(a["rounds"][keep], b["rounds"][keep])
    keep = [c for c in a["clients"].columns if not c.endswith("_s")]
    pd.testing.assert_frame_equal(a["clients"][keep], b["clients"][keep])
    assert spilled.most >= 4 and not (tiny / "spill").exists()  # spilled while it ran, removed at its end
    assert not (unbounded / "spill").exists()
    # the checkpoint holds every client's state, spilled ones included, bit for bit
    ca, cb = (load_checkpoint(p / "checkpoints" / "last.pt")["client_states"] for p in (unbounded, tiny))
    assert sorted(ca) == sorted(cb) and len(ca) >= 6
    for cid in ca:
        for key, t in ca[cid]["optimizer"]["state"].items():
            assert torch.equal(t["momentum_buffer"], cb[cid]["optimizer"]["state"][key]["momentum_buffer"])


def test_a_personal_model_spills_and_reloads_bit_for_bit(tmp_path):
    from fedsim.models import build_model

    states = {}
    for cid in range(4):
        torch.manual_seed(cid)
        model = build_model("resnet8", 3, 10, 32)
        model(torch.randn(4, 3, 32, 32))  # BN running stats and num_batches_tracked (int64) move
        states[cid] = {"model": {k: v.detach().clone() for k, v in model.state_dict().items()}}
    store = ClientStateStore(capacity_bytes=state_nbytes(states[0]), spill_dir=tmp_path)
    for cid, st in states.items():
        store.put(cid, st)
    assert store.spills == 3 and len(list(tmp_path.glob("*.pt"))) == 3
    for cid in (0, 2, 1, 3):
        got = store.get(cid)["model"]
        for k, v in states[cid]["model"].items():
            assert got[k].dtype == v.dtype and torch.equal(got[k], v), (cid, k)
