"""Analysis of many runs: fedsim.run as the public entry point, fedsim.collect keyed by config values and naming
the runs it skips, the plot's mean ± std bands over seeds (the data it draws, not its pixels), any column on
either axis, and one round numbering in rounds.parquet, `fedsim results show` and the plots."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

import fedsim
from fedsim.errors import ConfigError
from fedsim.results.plots import curves, figure
from fedsim.runtime.callbacks import Callback, RoundRows
from tests.conftest import ROOT, small_config


class Interrupt(Callback):
    """Ctrl-C after round 0."""

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        if round == 0:
            raise KeyboardInterrupt


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    """results/ with two seeds of lr 0.05, one of lr 0.1 (2 rounds each), and a run interrupted after round 0."""
    tmp = tmp_path_factory.mktemp("analysis")
    for run_id, extra in (("a0", ["seed=0"]), ("a1", ["seed=1"]), ("b0", ["seed=0", "train.lr=0.1"])):
        fedsim.run(small_config(tmp, f"results.run_id={run_id}", *extra, rounds=2), backend="local")
    with pytest.raises(KeyboardInterrupt):
        fedsim.run(small_config(tmp, "results.run_id=cut", "seed=2", rounds=2), backend="local",
                   callbacks=[Interrupt()])
    return tmp / "results"


def test_collect_keys_runs_by_flattened_config_and_names_the_runs_it_skips(root, tmp_path):
    with pytest.warns(UserWarning, match=r"skipped 1 folder.*cut: incomplete \(interrupted after 1 of 2 rounds\)"):
        df = fedsim.collect(root)
    assert sorted(df["run"].unique()) == ["a0", "a1", "b0"] and len(df) == 6
    for col in ("config.seed", "config.train.lr", "config.data.partition.alpha", "config.algorithm.name"):
        assert col in df, col
    assert df.groupby("run")["config.train.lr"].first().to_dict() == {"a0": 0.05, "a1": 0.05, "b0": 0.1}
    assert df.groupby("run")["config.seed"].first().to_dict() == {"a0": 0, "a1": 1, "b0": 0}
    assert df.attrs["skipped"] == [f"{root / 'cut'}: incomplete (interrupted after 1 of 2 rounds)"]
    kept = fedsim.collect(root, incomplete=True)
    assert sorted(kept["run"].unique()) == ["a0", "a1", "b0", "cut"] and (kept["run"] == "cut").sum() == 1

    killed = tmp_path / "killed"  # a run killed outright never recorded how it ended
    shutil.copytree(root / "cut", killed)
    meta = json.loads((killed / "meta.json").read_text())
    (killed / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "status"}))
    with pytest.warns(UserWarning, match="killed: incomplete"):
        assert fedsim.collect([killed, root / "a0"]).attrs["skipped"] == \
            [f"{killed}: incomplete (1 of 2 rounds; running, or killed)"]


def test_runs_in_folders_of_one_name_stay_apart_and_one_folder_named_twice_counts_once(root, tmp_path):
    shutil.copytree(root / "a1", tmp_path / "other" / "a0")  # another run, in a folder named like a0
    df = fedsim.collect([root / "a0", tmp_path / "other" / "a0", root / "b0"])
    assert list(df["run"].unique()) == ["results/a0", "other/a0", "b0"] and len(df) == 6
    assert df.groupby("run")["config.seed"].first().to_dict() == {"results/a0": 0, "other/a0": 1, "b0": 0}
    assert set(curves(df, "round", "accuracy")["runs"]) == {1, 2}  # a0's two seeds make one band
    twice = fedsim.collect([root / "a0", root / ".." / root.name / "a0"])
    assert list(twice["run"].unique()) == ["a0"] and len(twice) == 2


def test_plot_bands_are_mean_and_std_over_the_seeds_of_one_setting(root):
    df = fedsim.collect([root / "a0", root / "a1", root / "b0"])
    data = curves(df, "round", "accuracy")
    assert set(data["setting"]) == {"lr=0.05", "lr=0.1"}  # the seed tells no settings apart
    acc = {r: pd.read_parquet(root / r / "rounds.parquet")["accuracy"].to_numpy() for r in ("a0", "a1", "b0")}
    a = data[data["setting"] == "lr=0.05"]
    assert list(a["round"]) == list(a["x"]) == [0, 1] and list(a["runs"]) == [2, 2] and set(a["model"]) == {"cnn"}
    both = np.stack([acc["a0"], acc["a1"]])
    np.testing.assert_allclose(a["y"], both.mean(axis=0))
    np.testing.assert_allclose(a["y_std"], both.std(axis=0))  # population std, as in the sweep tables
    assert (a["y_std"] > 0).any()  # two seeds really differ, so the band is drawn
    b = data[data["setting"] == "lr=0.1"]
    np.testing.assert_allclose(b["y"], acc["b0"])
    assert list(b["y_std"]) == [0, 0] and list(b["runs"]) == [1, 1]

    vt = curves(df, "virtual_time", "loss")  # any column on either axis
    a = vt[vt["setting"] == "lr=0.05"]
    tables = [pd.read_parquet(root / r / "rounds.parquet") for r in ("a0", "a1")]
    np.testing.assert_allclose(a["x"], np.mean([t["virtual_time"] for t in tables], axis=0))
    np.testing.assert_allclose(a["y"], np.mean([t["loss"] for t in tables], axis=0))
    by = curves(df, "round", "bytes_up")  # the round's own column: one curve per setting, not per model
    assert set(by["model"]) == {""} and len(by) == 4


def test_a_key_set_in_one_run_and_unset_or_absent_in_another_tells_settings_apart(root):
    """train.steps: null in one run and 5 in another, or algorithm.mu absent from one run's config: two settings, each
    drawn alone, never averaged together as seeds."""
    df = fedsim.collect([root / "a0", root / "a1"])
    for column, values in (("config.train.steps", {"a0": None, "a1": 5}),
                           ("config.algorithm.mu", {"a0": np.nan, "a1": 0.01})):
        edited = df.assign(**{column: df["run"].map(values).astype(object if column.endswith("steps") else float)})
        data = curves(edited, "round", "accuracy")
        key = column.rpartition(".")[2]  # the label names a key by its last part
        assert len(set(data["setting"])) == 2 and all(s.startswith(key + "=") for s in data["setting"]), data
        assert list(data["runs"]) == [1, 1, 1, 1]


def test_round_numbering_is_the_same_in_the_table_results_show_and_the_plot(root, capsys):
    from jobs.cli import main

    table = pd.read_parquet(root / "a0" / "rounds.parquet")
    assert list(table["round"]) == [0, 1]
    assert main(["results", "show", str(root / "a0")]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0].split()[0] == "round" and [int(line.split()[0]) for line in shown[1:]] == [0, 1]
    data = curves(fedsim.collect(root / "a0"), "round", "accuracy")
    assert list(data["round"]) == list(data["x"]) == [0, 1]
    fig = figure({"accuracy": data}, "round", "a0")
    ticks = [t for t in fig.axes[0].get_xticks() if -0.5 <= t <= 1.5]
    assert ticks == [0, 1] and fig.axes[0].get_xlabel() == "round (0 = first)"


def test_fedsim_plot_draws_several_runs_and_names_the_columns_of_a_bad_metric(root, tmp_path, capsys):
    from jobs.cli import main

    out = tmp_path / "acc.png"
    assert main(["plot", str(root / "a*"), str(root / "b0"), "--out", str(out)]) == 0
    assert capsys.readouterr().out.strip() == str(out) and out.read_bytes()[:4] == b"\x89PNG"
    assert main(["plot", str(root / "a0"), "--x", "virtual_time", "--y", "bytes_down"]) == 0
    assert (root / "a0" / "bytes_down-vs-virtual_time.png").is_file()
    capsys.readouterr()
    assert main(["plot", str(root), "--y", "acuracy"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and err.startswith("fedsim: error: --metric acuracy: ")
    assert "available: round, accuracy, loss" in err and "virtual_time" in err and "wall_round_s" in err


@pytest.mark.parametrize("name, fragment", [
    ("rounds.parquet", "name a .png file"),     # a run's own table
    ("config.yaml", "name a .png file"),
    ("folder.png", "not a plain file"),         # a folder
    ("note.png", "is not a PNG"),               # a file of the user's that only has the name
    ("nowhere/acc.png", "does not exist"),      # its folder is missing
])
def test_plot_out_never_replaces_what_is_not_a_plot(root, tmp_path, capsys, name, fragment):
    from jobs.cli import main

    run = tmp_path / "run"
    shutil.copytree(root / "a0", run)
    (run / "folder.png").mkdir()
    (run / "note.png").write_text("my notes")
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert main(["plot", str(run), "--out", str(run / name)]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and fragment in err, err
    assert {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()} == before
    assert main(["plot", str(run), "--out", str(run / "accuracy.png")]) == 0  # a new PNG, then a re-plot over it
    assert main(["plot", str(run), "--out", str(run / "accuracy.png")]) == 0


def test_a_rounds_table_without_a_model_column_plots(root, tmp_path):
    from jobs.cli import main

    run = tmp_path / "run"
    shutil.copytree(root / "a0", run)
    table = pd.read_parquet(run / "rounds.parquet").drop(columns=["model"])
    table.to_parquet(run / "rounds.parquet")
    assert main(["plot", str(run)]) == 0 and (run / "accuracy.png").is_file()


def test_plot_prints_the_folders_it_skipped_and_nothing_of_numpys(root, tmp_path, capsys):
    """An infinite value makes numpy warn while the ± std band is computed: that is not a line for the user."""
    from jobs.cli import main

    for name in ("a0", "a1"):
        shutil.copytree(root / name, tmp_path / name)
    table = pd.read_parquet(tmp_path / "a0" / "rounds.parquet")
    table.loc[table["round"] == 1, "accuracy"] = float("inf")
    table.to_parquet(tmp_path / "a0" / "rounds.parquet")
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "rounds.parquet").write_bytes(b"not parquet")
    assert main(["plot", str(tmp_path / "a0"), str(tmp_path / "a1"), str(tmp_path / "broken"),
                 "--out", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("fedsim: plot skipped 1 folder(s): ") and "broken" in err[0], err


def test_fedsim_run_takes_a_yaml_path_a_dict_or_a_run_config(tmp_path):
    rows: list[list[str]] = []

    class Seen(Callback):
        def on_round_end(self, round: int, r: RoundRows) -> None:
            rows.append([row["model"] for row in r.rounds])

    tiny = ["rounds=1", "data.num_clients=10", "participation.clients_per_round=4", "stragglers.enabled=false",
            f"results.root={tmp_path}"]
    run_dir = fedsim.run(Path(ROOT) / "configs" / "demo.yaml", tiny + ["results.run_id=yaml"], backend="local",
                         callbacks=[Seen()])
    assert run_dir == tmp_path / "yaml" and rows == [["cnn"]]
    assert fedsim.load(run_dir)["config"]["data"]["num_clients"] == 10
    as_dict = {"rounds": 1, "data": {"num_clients": 10}, "participation": {"clients_per_round": 4},
               "results": {"root": str(tmp_path), "run_id": "dict"}}
    assert fedsim.run(as_dict, ["train.lr=0.1"], backend="local") == tmp_path / "dict"
    assert fedsim.load(tmp_path / "dict")["config"]["train"]["lr"] == 0.1
    with pytest.raises(ConfigError, match="keeps the run's saved config"):
        fedsim.run(as_dict, resume=run_dir)
    with pytest.raises(ConfigError, match="backend must be 'local', 'ray' or a Backend"):
        fedsim.run(as_dict, backend="cluster")
    assert "run" in fedsim.__all__


@pytest.mark.ray
@pytest.mark.slow
def test_fedsim_run_builds_a_ray_backend_and_its_callbacks_and_trackers_run_in_the_driver(ray_local, tmp_path):
    from tests.runtime.test_tracking import read_scalars

    rounds: list[int] = []

    class Seen(Callback):
        def on_round_end(self, round: int, rows: RoundRows) -> None:
            rounds.append(round)

    cfg = small_config(tmp_path, "tracking.tensorboard=true", "runtime.client_cpus=0.5", rounds=2)
    run_dir = fedsim.run(cfg, backend="ray", workers=1, callbacks=[Seen()])  # 4 would fit: `workers` decides
    res = fedsim.load(run_dir)
    assert res["meta"]["backend"] == "RayBackend" and res["meta"]["num_workers"] == 1 and res["meta"]["status"] == \
        "completed"
    assert rounds == list(res["rounds"]["round"]) == [0, 1]
    scalars = read_scalars(run_dir / "tensorboard")
    assert [scalars["accuracy/cnn"][r] for r in rounds] == pytest.approx(list(res["rounds"]["accuracy"]), rel=1e-6)
