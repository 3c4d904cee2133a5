"""The partition report: per-client counts, label histograms and heterogeneity numbers against a hand computation
with plain loops, written once as a run starts (a resume neither recomputes nor rewrites it), present for every
kind of split (counts only for generated shards), drawn by `fedsim plot --partition` with its panels and legend
beside them, and one line for a folder that is no run or has no report."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import numpy as np
import pytest

import fedsim
import fedsim.results.partition_plot as partition_plot
import fedsim.results.partition_report as report_module
from fedsim.data.partition import label_histograms
from fedsim.errors import CheckpointError
from fedsim.results.partition_report import LABELS_FILE, PARTITION_FILE, partition_report, write_once
from fedsim.runtime.setup import Partition, Ragged, load_data, make_partition
from jobs.cli import main

# a hand-made split of 12 training samples (labels 0..3; class 3 only in client 2's validation) and 6 test ones
Y_TRAIN = np.array([0, 0, 1, 2, 1, 1, 1, 2, 3, 0, 0, 0])
Y_TEST = np.array([0, 1, 2, 3, 0, 1])
TRAIN = [[0, 1, 2, 3], [5, 6, 7], [], [9, 10, 11]]
VAL = [[4], [], [8], []]
TEST = [[0, 1], [2], [3, 4, 5], [0]]


def hand_made() -> Partition:
    ragged = [Ragged.from_list([np.array(p, dtype=np.int64) for p in parts]) for parts in (TRAIN, VAL, TEST)]
    return Partition(*ragged)


def run_folder(tmp_path: Path, part, y_train=Y_TRAIN, y_test=Y_TEST, classes: int = 4) -> Path:
    """A folder holding only a report (and a config, so it reads as a run's)."""
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "config.yaml").write_text("name: t\n")
    write_once(folder, part, y_train, y_test, classes)
    return folder


@pytest.mark.parametrize("classes, dense_bins", [(4, None), (100, 0)], ids=["one bincount", "sorted keys"])
def test_the_report_equals_a_hand_computation(tmp_path, monkeypatch, classes, dense_bins):
    sorted_keys = []
    if dense_bins is not None:  # more bins than samples: counted by sorting the keys
        monkeypatch.setattr(report_module, "_DENSE_BINS", dense_bins)
        unique = np.unique
        monkeypatch.setattr(np, "unique", lambda *a, **k: sorted_keys.append(1) or unique(*a, **k))
    report = partition_report(run_folder(tmp_path, hand_made(), classes=classes))
    assert bool(sorted_keys) == (dense_bins is not None)

    sizes = [[len(t), len(v), len(s)] for t, v, s in zip(TRAIN, VAL, TEST)]
    assert report.clients.values.tolist() == [[c, *n] for c, n in enumerate(sizes)]
    expected = []  # (client, split, label, count) of every nonzero count, by split, client, label
    for split, parts, y in (("train", TRAIN, Y_TRAIN), ("val", VAL, Y_TRAIN), ("test", TEST, Y_TEST)):
        for c, idx in enumerate(parts):
            for label in range(4):
                n = sum(1 for i in idx if y[i] == label)
                if n:
                    expected.append((c, split, label, n))
    got = [(int(c), str(s), int(lab), int(n)) for c, s, lab, n in report.labels.itertuples(index=False)]
    assert got == expected
    assert report.histogram("train")[:, :4].tolist() == [[sum(1 for i in p if Y_TRAIN[i] == lab) for lab in range(4)]
                                                          for p in TRAIN]

    pooled = [sum(1 for p in TRAIN for i in p if Y_TRAIN[i] == lab) for lab in range(4)]
    q = [n / sum(pooled) for n in pooled]
    tv, kinds = [], []
    for p in TRAIN:
        if not p:
            continue  # no training samples: no distribution
        share = [sum(1 for i in p if Y_TRAIN[i] == lab) / len(p) for lab in range(4)]
        tv.append(0.5 * sum(abs(a - b) for a, b in zip(share, q)))
        kinds.append(sum(1 for s in share if s > 0))
    n = [len(p) for p in TRAIN]
    gini = sum(abs(a - b) for a in n for b in n) / (2 * len(n) ** 2 * statistics.mean(n))
    s = report.stats
    assert (s["clients"], s["classes"], s["labels"]) == (4, classes, "recorded")
    assert (s["train_samples"], s["val_samples"], s["test_samples"], s["empty_clients"]) == (10, 2, 7, 1)
    assert (s["size_min"], s["size_max"], s["size_mean"]) == (0, 4, 2.5)
    assert s["size_cv"] == pytest.approx(statistics.pstdev(n) / statistics.mean(n))
    assert s["size_gini"] == pytest.approx(gini)
    assert s["tv_mean"] == pytest.approx(statistics.mean(tv))
    assert [s["tv_p10"], s["tv_median"], s["tv_p90"]] == pytest.approx(list(np.percentile(tv, [10, 50, 90])))
    assert s["classes_per_client_mean"] == pytest.approx(statistics.mean(kinds))
    assert (s["classes_per_client_min"], s["classes_per_client_max"]) == (min(kinds), max(kinds))


def test_labels_that_are_not_one_class_per_sample_leave_the_counts(tmp_path):
    sequences = np.arange(3 * len(Y_TRAIN)).reshape(-1, 3)  # e.g. a label per token
    report = partition_report(run_folder(tmp_path, hand_made(), sequences, Y_TEST))
    assert report.labels is None and report.stats["labels"].startswith("counts only: the dataset's labels")
    assert report.clients["train"].tolist() == [len(p) for p in TRAIN] and report.stats["tv_mean"] is None


def test_it_is_written_once_and_a_resume_neither_recomputes_nor_rewrites_it(make_config, monkeypatch):
    from fedsim.runtime.loop import run
    from tests.runtime.test_resume_methods import StopAfter

    run_dir = run(make_config("model.name=mlp", "train.steps=1", rounds=2), callbacks=[StopAfter(0)])
    files = {name: ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mtime_ns)
             for name in (PARTITION_FILE, LABELS_FILE)}
    stats = json.loads((run_dir / "meta.json").read_text())["partition"]
    assert stats == partition_report(run_dir).stats and stats["labels"] == "recorded" and stats["clients"] == 10

    def computed_again(*args, **kwargs):
        raise AssertionError("a resumed run computed the report again")

    monkeypatch.setattr(report_module, "compute", computed_again)
    run(resume=run_dir)
    assert fedsim.load(run_dir)["rounds"]["round"].tolist() == [0, 1]
    assert {name: ((run_dir / name).read_bytes(), (run_dir / name).stat().st_mtime_ns) for name in files} == files
    assert sorted(p.name for p in run_dir.glob("partition*")) == sorted(files)  # no second copy beside it
    assert json.loads((run_dir / "meta.json").read_text())["partition"] == stats  # meta.json rewritten, numbers kept


@pytest.mark.parametrize("kind", ["iid", "shards", "dirichlet"])
def test_every_kind_of_split_gets_its_histograms(make_config, tmp_path, kind):
    cfg = make_config(f"data.partition.kind={kind}", "data.client_test=proportional")
    data = load_data(cfg)
    part = make_partition(cfg, data)
    report = partition_report(run_folder(tmp_path, part, data.y_train, data.y_test, data.num_classes))
    train = [part.train[c] for c in range(len(part.train))]
    assert report.clients["train"].tolist() == part.num_samples().tolist()
    assert report.clients["test"].tolist() == part.test.lengths().tolist()
    assert (report.histogram("train") == label_histograms(data.y_train, train, data.num_classes)).all()
    assert report.stats["train_samples"] == sum(len(t) for t in train)
    assert 0 <= report.stats["tv_p10"] <= report.stats["tv_mean"] <= report.stats["tv_p90"] <= 1


def test_generated_shards_record_exact_counts_only(tmp_path):
    from fedsim.configure import load_config

    cfg = load_config(None, ["data.name=synthetic", "data.partition.kind=generated", "data.num_clients=30",
                             "data.options={n_test: 200, channels: 1, size: 8}", "data.partition.samples_sigma=0.6",
                             "data.val_fraction=0.2", "data.client_test=proportional", "model.name=mlp",
                             "rounds=1", "participation.clients_per_round=3", "runtime.backend=local",
                             f"results.root={tmp_path / 'results'}"])
    run_dir = fedsim.run(cfg)
    report = partition_report(run_dir)
    shards = make_partition(cfg, load_data(cfg))
    drawn = [shards.shard(c) for c in range(30)]  # what each client trains, validates and tests on
    assert report.clients[["train", "val", "test"]].values.tolist() == [[len(d[1]), len(d[3]), len(d[5])]
                                                                        for d in drawn]
    assert report.labels is None and not (run_dir / LABELS_FILE).exists()
    assert report.stats["labels"].startswith("counts only") and report.stats["tv_mean"] is None
    with pytest.raises(CheckpointError, match="no label histograms"):
        report.histogram()


def test_a_run_that_fails_before_its_first_round_leaves_no_report(make_config, tmp_path):
    folder = tmp_path / "results" / "mine"
    folder.mkdir(parents=True)  # the user's empty folder: kept, but emptied of what the run wrote
    with pytest.raises(fedsim.FedsimError):
        fedsim.run(make_config("results.run_id=mine", f"clock.trace={tmp_path / 'missing.csv'}"))
    assert folder.is_dir() and list(folder.iterdir()) == []


@pytest.fixture
def drawn(monkeypatch) -> list:
    """The figures `fedsim plot --partition` draws."""
    figures: list = []
    figure = partition_plot.partition_figure

    def keep(*args, **kwargs):
        figures.append(figure(*args, **kwargs))
        return figures[-1]

    monkeypatch.setattr(partition_plot, "partition_figure", keep)
    return figures


def many_clients(tmp_path: Path, clients: int, classes: int) -> Path:
    rng = np.random.default_rng(0)
    y = rng.integers(0, classes, 20 * clients)
    owner = rng.integers(0, clients, len(y))
    parts = [np.flatnonzero(owner == c) for c in range(clients)]
    empty = Ragged.from_list([np.zeros(0, np.int64)] * clients)
    return run_folder(tmp_path, Partition(Ragged.from_list(parts), empty, None), y, y[:0], classes)


def test_the_plot_has_both_panels_the_sampled_clients_and_its_legend_beside_them(tmp_path, drawn, capsys):
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    run = many_clients(tmp_path, 120, 10)
    assert main(["plot", "--partition", str(run)]) == 0
    assert capsys.readouterr().out.strip() == str(run / "partition.png")
    with (run / "partition.png").open("rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    fig = drawn[0]
    sizes, bars = fig.axes
    assert sizes.get_xlabel().startswith("training samples per client") and sizes.get_ylabel() == "clients"
    assert sizes.patches[0].get_data().values.sum() == 120  # every client in the histogram
    shown = partition_plot.shown_clients(120)
    assert len(shown) == 50 and shown[0] == 0 and shown[-1] == 119
    assert bars.get_title() == "label proportions, 50 of 120 clients (evenly spaced ids)"
    report = partition_report(run)
    stacked: dict[int, list[tuple[float, float]]] = {}  # each bar's rectangles: (bottom, height), bottom up
    for path in bars.collections[0].get_paths():
        (x0, y0), (x1, y1) = path.vertices.min(axis=0), path.vertices.max(axis=0)
        stacked.setdefault(round((x0 + x1) / 2), []).append((y0, y1 - y0))
    counts = report.histogram()[shown]
    assert sorted(stacked) == list(range(50))
    for i, rects in stacked.items():  # the shown client's nonzero shares, classes in order, stacked from 0 to 1
        rects.sort()
        assert [h for _, h in rects] == pytest.approx(list(counts[i][counts[i] > 0] / counts[i].sum()))
        assert [b for b, _ in rects] == pytest.approx([0.0, *np.cumsum([h for _, h in rects])[:-1]])
    assert f"TV to pooled labels {report.stats['tv_mean']:.2f}" in fig._suptitle.get_text()
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [str(c) for c in range(10)]
    FigureCanvasAgg(fig).draw()
    legend, whole = fig.legends[0].get_window_extent(), fig.bbox
    assert whole.x0 <= legend.x0 and legend.x1 <= whole.x1 and whole.y0 <= legend.y0 and legend.y1 <= whole.y1
    for ax in fig.axes:
        assert ax.get_window_extent().x1 < legend.x0


def test_many_classes_get_a_colorbar_and_generated_shards_the_sizes_alone(tmp_path, drawn):
    run = many_clients(tmp_path, 8, 100)
    out = partition_plot.plot_partition(run, out=tmp_path / "p.png", title="α=0.1")
    assert out == tmp_path / "p.png" and out.is_file()
    fig = drawn[0]
    assert len(fig.axes) == 3 and fig.axes[2].get_ylabel() == "class" and not fig.legends  # the colorbar
    assert fig.axes[1].get_title() == "label proportions, all 8 clients"
    assert fig._suptitle.get_text().startswith("α=0.1: 8 clients")

    stats = dict(partition_report(run).stats, labels="counts only", tv_mean=None)
    generated = report_module.PartitionReport(partition_report(run).clients, None, stats)
    fig = partition_plot.partition_figure(generated)
    assert len(fig.axes) == 1 and "label histograms not recorded" in fig._suptitle.get_text()


@pytest.mark.parametrize("make, flags, fragment", [
    (lambda p: p, [], "not a fedsim run folder (no run.json, config.yaml or rounds.parquet)"),
    (lambda p: p / "nothing", [], "not a fedsim run folder (no such folder)"),
    (lambda p: (p / "config.yaml").write_text("name: t\n") and p, [], "no partition report (partition.parquet;"),
    (lambda p: (p / "config.yaml").write_text("name: t\n") and (p / PARTITION_FILE).write_bytes(b"junk") and p, [],
     "partition.parquet: unreadable table"),
    (lambda p: p, ["--metric", "loss"], "--partition draws the run's split; --metric belongs to a plot of metrics"),
    (lambda p: p, ["extra"], "--partition: name one run folder, got 2"),
])
def test_a_folder_without_a_report_is_one_line(tmp_path, capsys, make, flags, fragment):
    folder = tmp_path / "f"
    folder.mkdir()
    target = make(folder)
    assert main(["plot", "--partition", str(target), *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("fedsim: error: ") and fragment in err, err
    assert not (folder / "partition.png").exists()


def test_a_run_kept_in_a_store_has_its_report_and_its_plot_lands_here(make_config, tmp_path, monkeypatch):
    import uuid

    monkeypatch.chdir(tmp_path)
    root = f"memory://partition-{uuid.uuid4().hex}"
    run_dir = fedsim.run(make_config("model.name=mlp", "train.steps=1", f"results.root={root}", rounds=1))
    report = partition_report(str(run_dir))
    assert report.stats["clients"] == 10 and report.labels is not None
    assert partition_plot.plot_partition(str(run_dir)) == Path(f"{run_dir.name}-partition.png")
    assert (tmp_path / f"{run_dir.name}-partition.png").is_file()
