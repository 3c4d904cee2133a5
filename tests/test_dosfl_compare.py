"""jobs.dosfl_compare: FedAvg rounds-to-match DOSFL's accuracy and the bytes both spend (on fake runs)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

import jobs.dosfl_compare as dc


def fake_runs(raw, seeds, overrides, fresh=False, jobs=1):
    name = raw["algorithm"]["name"]
    if name == "dosfl":
        accs = {0: 0.70, 1: 0.80}
        return [(Path(f"{name}-{s}"), pd.DataFrame({"round": [0], "accuracy": [accs[s]], "bytes_up": [1000],
                                                     "bytes_down": [16]})) for s in seeds]
    curves = {0: [0.5, 0.75, 0.85], 1: [0.6, 0.7, 0.78]}
    return [(Path(f"{name}-{s}"), pd.DataFrame({"round": [0, 1, 2], "accuracy": curves[s], "bytes_up": [300] * 3,
                                                 "bytes_down": [300] * 3})) for s in seeds]


@pytest.mark.parametrize("stat,target,match,match_bytes", [("best", 0.80, [3, float("nan")], [1800, float("nan")]),
                                                           ("mean", 0.75, [2, 3], [1200, 1800])])
def test_rounds_and_bytes_to_match(monkeypatch, tmp_path, stat, target, match, match_bytes) -> None:
    cfg = tmp_path / "d.yaml"
    cfg.write_text("algorithm: {name: dosfl}\nrounds: 3\n")
    monkeypatch.setattr(dc, "_runs", fake_runs)
    row = dc.compare(str(cfg), [0, 1], stat, None, [], [])
    assert row["target"] == pytest.approx(target)
    assert row["dosfl_best"] == 0.80 and row["dosfl_mean"] == pytest.approx(0.75)
    assert row["match_rounds"] == pytest.approx(match, nan_ok=True)
    assert row["match_bytes"] == pytest.approx(match_bytes, nan_ok=True)
    assert row["break_even_round"] == 2  # 1016 bytes / 600 bytes per FedAvg round, rounded up
    md = dc.markdown([row], stat)
    assert "| d |" in md and (">3" in md) == (stat == "best")
    per_seed = pd.DataFrame(row["per_seed"])
    assert list(per_seed["seed"]) == [0, 1] and list(per_seed["dosfl_run"]) == ["dosfl-0", "dosfl-1"]
    assert list(per_seed["fedavg_run"]) == ["fedavg-0", "fedavg-1"]
    assert list(per_seed["dosfl_acc"]) == [0.70, 0.80] and list(per_seed["fedavg_final"]) == [0.85, 0.78]
    assert list(per_seed["fedavg_match_round"]) == pytest.approx(match, nan_ok=True)


def test_rejects_a_non_dosfl_config(tmp_path) -> None:
    from fedsim.errors import ConfigError

    cfg = tmp_path / "f.yaml"
    cfg.write_text("algorithm: {name: fedavg}\n")
    with pytest.raises(ConfigError, match="algorithm.name must be dosfl"):
        dc.compare(str(cfg), [0], "best", None, [], [])


def test_real_runs_are_named_by_config_and_reused(tmp_path, monkeypatch) -> None:
    """A second call finds the finished run of the same (config, seed) and does not run it again."""
    import torch

    import fedsim.runtime.loop

    raw = {"data": {"name": "digits", "num_clients": 3, "partition": {"kind": "iid"}}, "model": {"name": "lenet"},
           "algorithm": {"name": "dosfl", "distill_steps": 2, "distill_batch": 3, "distill_epochs": 1, "epochs": 1},
           "runtime": {"backend": "local", "threads": 1}, "results": {"root": str(tmp_path)}}
    old = torch.get_num_threads()
    try:
        ((folder, first),) = dc._runs(raw, [3], [])
        monkeypatch.setattr(fedsim.runtime.loop, "run", lambda *a, **k: pytest.fail("ran again"))
        ((folder_again, again),) = dc._runs(raw, [3], [])
    finally:
        torch.set_num_threads(old)
    assert len(first) == 1 and first["bytes_up"].iloc[0] == 3 * (2 * 3 * 64 * 4 + 2 * 3 * 8 + 2 * 4)
    pd.testing.assert_frame_equal(first, again)
    assert folder == folder_again and list(tmp_path.iterdir()) == [folder]


def _code(argv: list[str]) -> int:
    try:
        return dc.main(argv)
    except SystemExit as exc:
        return int(exc.code or 0)


@pytest.mark.parametrize("extra, message", [
    (["--fedavg-rounds", "-1"], "argument --fedavg-rounds: must be >= 1, got -1"),
    (["--fedavg-rounds", "0"], "argument --fedavg-rounds: must be >= 1, got 0"),
    (["--fedavg-rounds", "10000000000"], "argument --fedavg-rounds: at most 1,000,000"),
    (["--nope"], "unrecognized arguments: --nope"),
    (["--out", "{tmp}/afile/out.md"], "argument --out: cannot write {tmp}/afile/out.md ({tmp}/afile is a file)"),
    (["--out", "{tmp}"], "argument --out: {tmp}: name a .md file"),
    (["--out", "{tmp}/d.yaml"], "argument --out: {tmp}/d.yaml: name a .md file"),
    (["--out", "{tmp}/notes.md"], "argument --out: {tmp}/notes.md exists and is not this command's earlier output"),
    (["--out", "{tmp}/data.md"], "argument --out: {tmp}/data.csv exists and is not this command's earlier output"),
    (["--out", "/proc/fedsim-table.md"], "argument --out: cannot write /proc/fedsim-table.md ("),
    (["--out", ""], "argument --out: give a path, not an empty string"),
    (["--fedavg", "train.lr=-1"], "train.lr: must be > 0, got -1"),
    (["-o", "algorithm=dosfl"], "algorithm.name must be dosfl"),
])
def test_bad_arguments_are_one_line_before_any_run(tmp_path, monkeypatch, capsys, extra, message) -> None:
    def no_runs(*args, **kwargs):
        raise AssertionError("a run started")

    monkeypatch.setattr(dc, "_runs", no_runs)
    (tmp_path / "afile").write_text("x")
    (tmp_path / "notes.md").write_text("my notes")  # a user's files: never replaced by the table
    (tmp_path / "data.csv").write_text("my,data")
    cfg = tmp_path / "d.yaml"
    cfg.write_text("algorithm: {name: dosfl}\nrounds: 3\n")
    before = sorted(tmp_path.iterdir())
    assert _code([str(cfg), *[a.replace("{tmp}", str(tmp_path)) for a in extra]]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message.replace("{tmp}", str(tmp_path)) in err[0], err
    assert err[0].startswith(("python -m jobs.dosfl_compare: error: ", "fedsim: error: "))
    assert sorted(tmp_path.iterdir()) == before
    assert (tmp_path / "notes.md").read_text() == "my notes" and (tmp_path / "data.csv").read_text() == "my,data"


def test_a_failed_comparison_leaves_no_folder_made_for_its_table(tmp_path, capsys) -> None:
    cfg = tmp_path / "f.yaml"
    cfg.write_text("algorithm: {name: fedavg}\n")
    out = tmp_path / "new" / "deeper" / "t.md"
    assert _code([str(cfg), "--out", str(out)]) == 2
    assert "algorithm.name must be dosfl" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()
