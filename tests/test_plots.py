"""`fedsim plot` as a paper's figure: short legend labels from the keys that differ (a plugin by its module name,
the method first), the legend beside the panels and never over them (read from the drawn figure's geometry),
settings that differ in the seed alone averaged into a band, same-seed duplicates warned and the newest kept, a
plugin submitted from two folders one setting, `--x`, a panel per `--metric`, and one line for each bad flag.

The runs are written here directly (config.yaml and rounds.parquet), not simulated."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

import fedsim
import fedsim.results.plots as plots
from fedsim.errors import FedsimError
from fedsim.results.plots import DuplicateRuns, curves, settings
from jobs.cli import main

ROUNDS = 4
ADAM = {"name": "fedadam", "server_lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 0.001}
NOVA = {"name": "fednova", "momentum": 0.0}
AVG = {"name": "fedavg"}


def write_run(folder: Path, algorithm: dict, seed: int, plugins: list[str] | None = None, *, lr: float = 0.05,
              alpha: float = 0.5, shift: float = 0.0, started: float | None = None) -> Path:
    """A finished run's folder: its resolved config and a rounds table of one model, accuracy rising by round and
    `shift`, a different wobble per seed; `started` sets when its config was written (its modification time)."""
    folder.mkdir(parents=True)
    config = {"name": folder.name, "seed": seed, "rounds": ROUNDS, "plugins": plugins or [], "algorithm": algorithm,
              "data": {"name": "digits", "root": str(folder.parent / "data"), "partition": {"alpha": alpha}},
              "train": {"lr": lr}, "results": {"root": str(folder.parent), "run_id": folder.name}}
    (folder / "config.yaml").write_text(yaml.safe_dump(config))
    r = np.arange(ROUNDS)
    wobble = np.random.default_rng(seed).normal(0, 0.02, ROUNDS)
    pd.DataFrame({"round": r, "model": "cnn", "accuracy": 0.5 + 0.1 * r + shift + wobble, "loss": 2.0 - 0.3 * r,
                  "bytes_up": 1000 * (r + 1), "bytes_down": 4000, "virtual_time": 3.0 * (r + 1)}
                 ).to_parquet(folder / "rounds.parquet")
    if started is not None:
        os.utime(folder / "config.yaml", (started, started))
    return folder


@pytest.fixture
def methods(tmp_path) -> Path:
    """FedAdam and FedNova from plugin files (FedAdam's from two folders), FedAvg built in; three seeds each."""
    root = tmp_path / "results"
    for seed in range(3):
        where = "home/me/experiments" if seed < 2 else "scratch/me/copy"  # one plugin file, submitted from two folders
        write_run(root / f"fedadam-s{seed}", ADAM, seed, [str(tmp_path / where / "fedadam.py")], shift=0.1)
        write_run(root / f"fednova-s{seed}", NOVA, seed, [str(tmp_path / "home/me/experiments/fednova.py")])
        write_run(root / f"fedavg-s{seed}", AVG, seed, shift=-0.1)
    return root


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures `fedsim plot` draws, kept for their geometry."""
    figures: list = []
    figure = plots.figure

    def keep(*args, **kwargs):
        figures.append(figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(plots, "figure", keep)
    return figures


def legend_labels(fig) -> list[str]:
    return [t.get_text() for t in fig.legends[0].get_texts()]


def test_methods_are_labelled_by_name_alone_and_seeds_make_one_band(methods, tmp_path, drawn, capsys):
    assert main(["plot", str(methods), "--out", str(tmp_path / "methods.png")]) == 0
    assert capsys.readouterr().err == ""
    (fig,) = drawn
    assert legend_labels(fig) == ["fedadam (3 seeds)", "fedavg (3 seeds)", "fednova (3 seeds)"]  # no path, no params
    data = curves(fedsim.collect(methods), "round", "accuracy")
    adam = data[data["setting"] == "fedadam"]
    assert list(adam["runs"]) == [3] * ROUNDS  # the plugin from two folders is one setting
    tables = [pd.read_parquet(methods / f"fedadam-s{s}" / "rounds.parquet")["accuracy"] for s in range(3)]
    np.testing.assert_allclose(adam["y"], np.mean(tables, axis=0))
    np.testing.assert_allclose(adam["y_std"], np.std(tables, axis=0))
    assert (adam["y_std"] > 0).all()


def test_the_legend_lies_beside_the_panels_never_over_them(methods, tmp_path, drawn):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    assert main(["plot", str(methods), "--label", "algorithm.name", "plugins", "algorithm.server_lr",
                 "--metric", "accuracy", "loss", "--logx", "--out", str(tmp_path / "p.png")]) == 0
    (fig,) = drawn
    FigureCanvasAgg(fig).draw()
    legend = fig.legends[0].get_window_extent()
    whole = fig.bbox
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and whole.y0 <= legend.y0 and legend.y1 <= whole.y1
    assert len(fig.axes) == 2 and all(ax.get_xscale() == "log" for ax in fig.axes)
    for ax in fig.axes:  # the panel with its tick labels and axis labels
        panel = ax.get_tightbbox()
        assert panel.x1 < legend.x0, (panel, legend)
    assert legend_labels(fig)[0] == "fedadam, plugins=fedadam, server_lr=0.01 (3 seeds)"
    assert "fedavg, plugins=none, server_lr=None (3 seeds)" in legend_labels(fig)


def test_a_long_title_over_one_panel_clears_the_legend(methods, tmp_path, drawn):
    """The title is centred over the panels: centred over the whole figure, it ran under the legend's corner."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    assert main(["plot", str(methods), "--label", "algorithm.name", "plugins", "algorithm.server_lr", "--title",
                 "Accuracy of FedAdam, FedAvg and FedNova on non-IID digits", "--out", str(tmp_path / "t.png")]) == 0
    (fig,) = drawn
    FigureCanvasAgg(fig).draw()
    title, legend = fig._suptitle.get_window_extent(), fig.legends[0].get_window_extent()
    assert title.x1 < legend.x0 or title.y0 > legend.y1, (title, legend)
    assert fig.bbox.x0 <= title.x0


def test_a_sweep_is_labelled_by_its_key_in_numeric_order(tmp_path, drawn):
    for alpha in (10, 0.1, 1, 0.5):
        for seed in (0, 1):
            write_run(tmp_path / "sweep" / f"a{alpha}-s{seed}", AVG, seed, alpha=alpha, shift=alpha / 100)
    assert main(["plot", str(tmp_path / "sweep"), "--title", "Dirichlet α"]) == 0
    (fig,) = drawn
    assert legend_labels(fig) == [f"alpha={a} (2 seeds)" for a in ("0.1", "0.5", "1", "10")]
    assert fig.get_suptitle() == "Dirichlet α"
    colors = [tuple(line.get_color()) for line in fig.legends[0].get_lines()]
    assert len(set(colors)) == 4  # a colormap's, one per value
    assert (tmp_path / "sweep" / "accuracy.png").read_bytes()[:4] == b"\x89PNG"


def test_runs_with_one_config_and_seed_are_duplicates_and_the_newest_is_kept(tmp_path, capsys):
    root = tmp_path / "results"
    write_run(root / "old", AVG, 0, started=1_000_000, shift=-0.3)
    write_run(root / "new", AVG, 0, started=2_000_000)
    write_run(root / "other-seed", AVG, 1, started=1_500_000)
    assert main(["plot", str(root), "--out", str(tmp_path / "p.png")]) == 0
    err = capsys.readouterr().err.splitlines()
    assert err == ["fedsim: plot left out 1 run(s) with the config and seed of a newer one: old (kept new)"]
    with pytest.warns(DuplicateRuns, match=r"old \(kept new\)"):
        groups = settings(fedsim.collect(root), started={"old": 1.0, "new": 2.0, "other-seed": 1.5})
    assert groups.of_run == {"new": "fedavg", "other-seed": "fedavg"}
    data = curves(fedsim.collect(root), "round", "accuracy", groups)
    kept = [pd.read_parquet(root / r / "rounds.parquet")["accuracy"] for r in ("new", "other-seed")]
    np.testing.assert_allclose(data["y"], np.mean(kept, axis=0))  # the old run's numbers are in no mean
    assert list(data["runs"]) == [2] * ROUNDS


def test_settings_that_differ_in_more_than_the_seed_stay_apart(tmp_path):
    root = tmp_path / "results"
    write_run(root / "a", AVG, 0, lr=0.05)
    write_run(root / "b", AVG, 1, lr=0.1)
    write_run(root / "c", {"name": "fedprox", "mu": 0.01}, 0, lr=0.05)
    write_run(root / "d", {"name": "fedprox", "mu": 0.1}, 0, lr=0.05)
    groups = settings(fedsim.collect(root))
    assert groups.of_run == {"a": "fedavg, lr=0.05", "b": "fedavg, lr=0.1", "c": "fedprox, lr=0.05, mu=0.01",
                             "d": "fedprox, lr=0.05, mu=0.1"}
    assert set(curves(fedsim.collect(root))["runs"]) == {1}


def test_plugins_are_told_apart_by_module_and_sha256_never_by_path(tmp_path):
    """One plugin submitted from two folders (a job's temporary copy, the user's checkout) is one setting; a plugin
    of the same name whose file changed is another, though its path is the same."""
    root = tmp_path / "results"

    def run(name: str, seed: int, path: str, sha256: str) -> None:
        folder = write_run(root / name, {"name": "plugged"}, seed, [path])
        (folder / "checkpoints").mkdir()
        (folder / "checkpoints" / "manifest.json").write_text(json.dumps(
            {"plugins": {path: {"module": "plug", "sha256": sha256, "copy": "plugins/plug.py"}}}))

    run("job", 0, "/tmp/ray/session/_ray_pkg_1a/plug.py", "a" * 64)
    run("mine", 1, "/home/me/plug.py", "a" * 64)
    run("edited", 2, "/home/me/plug.py", "b" * 64)
    df = fedsim.collect(root)
    assert df.groupby("run")["config.plugins"].first().to_dict() == {
        "job": '["plug@aaaaaaaaaaaa"]', "mine": '["plug@aaaaaaaaaaaa"]', "edited": '["plug@bbbbbbbbbbbb"]'}
    groups = settings(df)
    assert groups.of_run == {"job": "plugins=plug@aaaaaaaaaaaa", "mine": "plugins=plug@aaaaaaaaaaaa",
                             "edited": "plugins=plug@bbbbbbbbbbbb"}


@pytest.mark.parametrize("x, expected", [
    ("round", [0, 1, 2, 3]),
    ("virtual_time", [3, 6, 9, 12]),
    ("bytes_up", [1000, 3000, 6000, 10000]),  # the bytes sent so far
    ("bytes_down", [4000, 8000, 12000, 16000]),
])
def test_x_is_the_round_the_virtual_clock_or_the_bytes_sent_so_far(methods, tmp_path, drawn, x, expected):
    data = curves(fedsim.collect(methods), x, "accuracy")
    assert list(data[data["setting"] == "fedavg"]["x"]) == expected
    assert main(["plot", str(methods / "fedavg-s0"), "--x", x]) == 0
    assert drawn[0].axes[0].get_xlabel() == plots.X_AXES[x]
    assert (methods / "fedavg-s0" / ("accuracy.png" if x == "round" else f"accuracy-vs-{x}.png")).is_file()


def test_each_metric_is_a_panel(methods, drawn, capsys):
    assert main(["plot", str(methods), "--metric", "accuracy", "loss", "bytes_up", "--x", "virtual_time"]) == 0
    out = Path(capsys.readouterr().out.strip())
    assert out == methods / "accuracy-loss-bytes_up-vs-virtual_time.png" and out.is_file()
    (fig,) = drawn
    assert [ax.get_ylabel() for ax in fig.axes] == ["accuracy", "loss", "bytes_up"]
    for ax in fig.axes:
        assert len(ax.get_lines()) == 3 and all(line.get_xdata()[0] == 3.0 for line in ax.get_lines())
    assert list(fig.axes[2].get_lines()[0].get_ydata()) == [1000, 2000, 3000, 4000]  # per round on the y axis


@pytest.mark.parametrize("flags, fragment", [
    (["--x", "loss"], "--x loss: not an x axis; choose one of round, virtual_time, bytes_up, bytes_down"),
    (["--metric", "acuracy"], "--metric acuracy: not a numeric column"),
    (["--metric", "loss", "loss"], "--metric loss loss: a metric named twice"),
    (["--metric"], "argument --metric/--y: expected at least one argument"),
    (["--label"], "argument --label: expected at least one argument"),
    (["--label", "train.lrr"], "--label train.lrr: not a config key of these runs; the keys that differ between "
                               "them: algorithm.beta1, algorithm.beta2, algorithm.name, "),
    (["--label", "seed"], "--label seed: runs of one setting differ in it"),
    (["--label", "train.lr"], "--label train.lr: runs fedadam-s0 and fedavg-s0 get one label ('lr=0.05') but "
                              "differ in algorithm.beta1, "),
    (["--title"], "argument --title: expected one argument"),
])
def test_a_bad_flag_is_one_line_and_writes_nothing(methods, capsys, flags, fragment):
    before = sorted(p.name for p in methods.rglob("*"))
    try:
        code = main(["plot", str(methods), *flags])
    except SystemExit as parser_exit:  # argparse's own errors exit from the parser
        code = parser_exit.code
    assert code == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim") and fragment in err, err
    assert sorted(p.name for p in methods.rglob("*")) == before


def test_the_python_api_checks_its_arguments(methods):
    with pytest.raises(FedsimError, match="--label: expected a list of names"):
        plots.plot_runs(methods, label="algorithm.name")
    with pytest.raises(FedsimError, match="title: expected text"):
        plots.plot_runs(methods, title=3)
