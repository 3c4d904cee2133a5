"""A run's lifecycle under hostile conditions, through the real CLI: bad arguments, resumes with changed
configs, damaged tables, runs that cannot start, SIGTERM and killed drivers. Each must end in one line (exit 2,
or 143 for SIGTERM), never a traceback, and leave no folder behind."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedsim.errors import FedsimError
from fedsim.runtime.rundir import STARTED_CONFIG as STARTED
from tests.conftest import ROOT, reseal
from tests.forked import run_module, start_module
from tests.runtime.test_loop import deterministic

ENV = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "PYTHONPATH": ROOT}


def write_config(path: Path, results: Path, run_id: str | None = None, **top) -> Path:
    """A tiny digits config (4 clients, 2 per round, local backend, 1 thread) writing into `results`."""
    cfg = {"name": "tiny", "rounds": 2, "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
           "participation": {"clients_per_round": 2}, "train": {"epochs": 1},
           "runtime": {"backend": "local", "threads": 1}, "results": {"root": str(results), "run_id": run_id},
           **top}
    path.write_text(yaml.safe_dump(cfg))
    return path


def fedsim(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m jobs.cli ARGS`, forked from a process that has done the imports (tests/forked.py)."""
    return run_module("jobs.cli", args, cwd=ROOT, env=ENV, timeout=timeout)


def fedsim_process(*args: str, timeout: float = 300) -> subprocess.CompletedProcess:
    """`python -m jobs.cli ARGS` in a process of its own, imports and all."""
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], cwd=ROOT, env=ENV, capture_output=True,
                          text=True, timeout=timeout)


def tree(root: Path) -> dict[str, bytes | None]:
    """Every folder (None) and file (its bytes) under root, by relative path."""
    if not root.exists():
        return {}
    return {str(p.relative_to(root)): (p.read_bytes() if p.is_file() else None) for p in sorted(root.rglob("*"))}


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = [ln for ln in proc.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(("fedsim: error: ", "fedsim run: error: ")), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """One finished 2-round run, copied by the tests that damage it."""
    base = tmp_path_factory.mktemp("finished")
    cfg = write_config(base / "tiny.yaml", base / "results", run_id="done")
    proc = fedsim("run", str(cfg), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "results" / "done"


@pytest.fixture
def run_copy(finished, tmp_path) -> Path:
    dst = tmp_path / "results" / "copy"
    shutil.copytree(finished, dst)
    return dst


@pytest.mark.parametrize("workers", ["-3", "0", "two", "99999999"])  # above fedsim.config.limits.MAX_WORKERS
def test_workers_must_be_a_positive_integer(tmp_path, workers):
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results")
    proc = fedsim_process("run", str(cfg), "--workers", workers)
    assert_one_line_error(proc, "--workers", workers)
    assert not (tmp_path / "results").exists()


@pytest.mark.parametrize("args, message", [
    (["--plugins", "mine.py"], "--plugins mine.py goes with --resume RUN; a new run names its plugins in its config"),
    (["--trust-run-plugins"], "--trust-run-plugins goes with --resume RUN"),
])
def test_run_arguments_that_do_not_fit_are_one_line_naming_the_flag(tmp_path, capsys, args, message):
    from jobs.cli import main

    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results")
    assert main(["run", str(cfg), "--quiet", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("fedsim: error: ") and message in err and err.count("\n") == 1, err
    assert not (tmp_path / "results").exists()


def test_a_worker_count_that_does_not_fit_names_the_flag_the_user_typed(tmp_path, monkeypatch):
    """--workers 100 with 8 clients was refused as "runtime.num_workers=8", a key the user never set."""
    import actors.autoscale as autoscale
    import actors.pool as pool
    from fedsim.configure import load_config
    from fedsim.errors import ResourceError

    cfg = load_config(write_config(tmp_path / "c.yaml", tmp_path / "results"),
                      ["runtime.backend=ray", "runtime.client_cpus=1", "data.num_clients=8"])
    monkeypatch.setattr(autoscale, "fitting_workers", lambda cfg: (2, ""))
    monkeypatch.setattr(autoscale, "joined_cluster", lambda: False)
    monkeypatch.setattr(autoscale.ray.util, "get_current_placement_group", lambda: None)
    fit = "but only 2 workers fit with runtime.client_cpus=1.0 and runtime.client_gpus=0.0"
    for wanted, asked in ((100, "--workers 100 (8 of them used: one per client, data.num_clients=8)"),
                          (None, "one client worker")):
        if wanted is None:
            monkeypatch.setattr(autoscale, "fitting_workers", lambda cfg: (0, ""))
            fit = fit.replace("only 2", "only 0")
        with pytest.raises(ResourceError) as err:
            autoscale.await_workers(cfg, wanted)
        assert str(err.value) == f"{asked} {fit}"
    monkeypatch.setattr(pool, "cluster_nodes", lambda: [{"CPU": 2.0}])
    monkeypatch.setattr(pool, "group_bundles", lambda: None)
    with pytest.raises(ResourceError, match=r"^--workers 100 but only 2 workers fit"):
        pool.pool_size(cfg, 100)
    cfg.runtime.num_workers = 5
    with pytest.raises(ResourceError, match=r"^runtime.num_workers=5 but only 2 workers fit"):
        pool.pool_size(cfg)


def test_resume_refuses_overrides_and_a_config_instead_of_ignoring_them(run_copy, tmp_path):
    before = tree(run_copy)
    line = assert_one_line_error(fedsim("run", "--resume", str(run_copy), "-o", "rounds=5", "-o", "train.lr=0.1"),
                                 "-o rounds=5", "-o train.lr=0.1", "keeps its saved config")
    assert str(run_copy / "config.yaml") in line  # says where to extend the run instead
    cfg = write_config(tmp_path / "other.yaml", tmp_path / "results")
    assert_one_line_error(fedsim("run", str(cfg), "--resume", str(run_copy)), str(cfg), "keeps its saved config")
    assert tree(run_copy) == before


@pytest.mark.parametrize("edits", [
    {"model.name": "mlp"},
    {"data.partition.kind": "dirichlet", "algorithm.name": "fedprox", "train.keep_optimizer_state": True, "seed": 7},
])
def test_resume_refuses_a_config_edited_into_another_experiment(run_copy, edits):
    raw = yaml.safe_load((run_copy / "config.yaml").read_text())
    for dotted, value in edits.items():
        *sections, key = dotted.split(".")
        node = raw
        for section in sections:
            node = node[section]
        node[key] = value
    (run_copy / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    before = tree(run_copy)
    line = assert_one_line_error(fedsim("run", "--resume", str(run_copy), "--quiet"), "changed since the run started",
                                 *edits)
    assert "algorithm.mu" in line if "algorithm.name" in edits else "rounds" in line  # what may change instead
    assert tree(run_copy) == before


PLUGIN = ("import os\nopen(os.environ['FEDSIM_TEST_MARKER'], 'a').write(__file__ + '\\n')\n"
          "from fedsim.models.registry import register_model\nregister_model('plug_model')(lambda **kw: None)\n")
EVIL = "import os\nopen(os.environ['FEDSIM_TEST_MARKER'], 'a').write('evil ' + __file__ + '\\n')\n"


@pytest.fixture(scope="module")
def plugged_origin(tmp_path_factory) -> tuple[Path, Path]:
    """(a finished 1-round run that started with the plugin src/plug.py, that plugin)."""
    base = tmp_path_factory.mktemp("plugged")
    plugin = base / "src" / "plug.py"
    plugin.parent.mkdir()
    plugin.write_text(PLUGIN)
    cfg = write_config(base / "plugged.yaml", base / "results", run_id="plugged", rounds=1, plugins=[str(plugin)])
    proc = run_module("jobs.cli", ["run", str(cfg), "--quiet"], env={**ENV, "FEDSIM_TEST_MARKER": os.devnull})
    assert proc.returncode == 0, proc.stderr[-3000:]
    return base / "results" / "plugged", plugin


@pytest.fixture
def plugged(plugged_origin, tmp_path):
    """A copy of `plugged_origin`'s run in tmp_path/results/plugged, and its plugin, put back as it was after."""
    run_dir, plugin = plugged_origin
    shutil.copytree(run_dir, tmp_path / "results" / "plugged")
    yield tmp_path / "results" / "plugged", plugin
    plugin.write_text(PLUGIN)


def _name_plugin(run_dir: Path, entry: str, recorded: bool = False) -> None:
    """Both configs name `entry` as the run's plugin; with `recorded`, the manifest records its SHA-256 too (all of
    it what anyone who can edit the folder can write)."""
    for name in ("config.yaml", str(STARTED)):
        raw = yaml.safe_load((run_dir / name).read_text())
        raw["plugins"] = [entry]
        (run_dir / name).write_text(yaml.safe_dump(raw, sort_keys=False))
    reseal(run_dir)
    if recorded:
        manifest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
        digest = hashlib.sha256(Path(entry).read_bytes()).hexdigest()
        manifest["plugins"] = {entry: {"module": Path(entry).stem, "sha256": digest, "copy": "plugins/plug.py"}}
        (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps(manifest))


@pytest.mark.parametrize("case, args, code, fragment, imported", [
    ("as it was", [], 0, None, "src/plug.py"),
    ("relative path", [], 2, "plugins: '../evil.py' is a relative path, which a run never records", None),
    ("absolute path, not recorded", [], 2, "/evil.py': the run recorded no SHA-256 for it", None),
    ("recorded inside the run folder", [], 2, "/plugged/evil.py' lies inside the run folder; a run's files are data",
     None),
    ("a name found inside the run folder", [], 2, "plugins: 'evil' would be imported from inside the run folder",
     None),
    ("plugin changed since", [], 2, "src/plug.py is not the file the run started with (SHA-256 CHANGED, the run "
                                    "recorded ORIGINAL)", None),
    ("plugin changed since", ["--plugins", "KEPT"], 0, None, "kept/plug.py"),
    ("plugin gone", [], 2, "src/plug.py': no such file here; to allow it, pass --plugins FILE (your copy of plug, as "
                           "the run started with it) or --trust-run-plugins (import the run folder's copy, "
                           "plugins/plug.py)", None),
    ("plugin gone", ["--plugins", "CHANGED_COPY"], 2,
     "plug.py': --plugins KEPT/changed/plug.py is not the file the run started with (SHA-256 CHANGED, the run "
     "recorded ORIGINAL)", None),
    ("plugin gone", ["--trust-run-plugins"], 0, None, "plugged/plugins/plug.py"),
    ("plugin gone, a copy in the current folder", [], 2, "src/plug.py': no such file here; to allow it", None),
    ("plugin gone", ["--plugins", "OTHER"], 2, "kept/other.py: names no plugin of this run (its plugins: ", None),
    ("plugin gone", ["--plugins", "MISSING"], 2, "kept/gone/plug.py: no such file or package folder", None),
    ("a copy recorded outside plugins/", ["--trust-run-plugins"], 2,
     "the manifest puts its copy at '../evil.py', outside the run folder's plugins/", None),
    ("the run folder's copy changed", ["--trust-run-plugins"], 2, "the run folder's copy", None),
])
def test_resume_imports_only_the_plugins_the_user_has(plugged, tmp_path, case, args, code, fragment, imported):
    """A run folder from elsewhere named ../evil.py or any absolute path in its configs, and that file was imported.
    Now a resumed run imports a plugin from its recorded path, the user's own file or (if asked) the folder's copy,
    each only with the SHA-256 the run recorded, or a module installed outside the run folder."""
    run_dir, plugin = plugged
    marker, kept = tmp_path / "imported", tmp_path / "kept"
    kept.mkdir()
    shutil.copy(plugin, kept / "plug.py")
    (kept / "other.py").write_text(PLUGIN)
    (tmp_path / "results" / "evil.py").write_text(EVIL)
    (run_dir / "evil.py").write_text(EVIL)
    cwd = ROOT
    if case == "relative path":
        _name_plugin(run_dir, "../evil.py")
    elif case == "absolute path, not recorded":
        _name_plugin(run_dir, str(tmp_path / "results" / "evil.py"))
    elif case == "recorded inside the run folder":
        _name_plugin(run_dir, str(run_dir / "evil.py"), recorded=True)
    elif case == "a name found inside the run folder":
        _name_plugin(run_dir, "evil")
        cwd = str(run_dir)  # where `python -m` would find it
    elif case == "plugin changed since":
        plugin.write_text(PLUGIN + "X = 1\n")
    elif case.startswith("plugin gone"):
        plugin.unlink()
        cwd = str(kept) if "current folder" in case else cwd  # a file in the current folder is not looked for
        (kept / "changed").mkdir()
        (kept / "changed" / "plug.py").write_text(PLUGIN + "X = 1\n")
    elif case == "the run folder's copy changed":
        plugin.unlink()
        (run_dir / "plugins" / "plug.py").write_text(EVIL)
    elif case == "a copy recorded outside plugins/":
        plugin.unlink()
        manifest = json.loads((run_dir / "checkpoints" / "manifest.json").read_text())
        manifest["plugins"][str(plugin)]["copy"] = "../evil.py"
        (run_dir / "checkpoints" / "manifest.json").write_text(json.dumps(manifest))
    args = [{"KEPT": str(kept / "plug.py"), "OTHER": str(kept / "other.py"),
             "CHANGED_COPY": str(kept / "changed" / "plug.py"),
             "MISSING": str(kept / "gone" / "plug.py")}.get(a, a) for a in args]
    digests = {"ORIGINAL": hashlib.sha256(PLUGIN.encode()).hexdigest()[:12], "KEPT": str(kept),
               "CHANGED": hashlib.sha256((PLUGIN + "X = 1\n").encode()).hexdigest()[:12]}
    for name, value in digests.items():
        fragment = fragment and fragment.replace(name, value)
    before = tree(run_dir)
    proc = run_module("jobs.cli", ["run", "--resume", str(run_dir), "--quiet", *args], cwd=cwd,
                      env={**ENV, "FEDSIM_TEST_MARKER": str(marker)})
    if code == 2:
        assert_one_line_error(proc, fragment)
        assert not marker.exists() and tree(run_dir) == before  # nothing imported, nothing written
    else:
        assert proc.returncode == 0, proc.stderr[-3000:]
        lines = marker.read_text().splitlines()
        assert len(lines) == 1 and lines[0].endswith(imported), lines


def test_reading_a_run_imports_none_of_the_plugins_it_names(run_copy, tmp_path, capsys, monkeypatch):
    """results show, plot and collect read tables and YAML: a run folder naming plugins never gets them imported."""
    import fedsim
    from jobs.cli import main

    marker = tmp_path / "imported"
    monkeypatch.setenv("FEDSIM_TEST_MARKER", str(marker))
    (tmp_path / "evil.py").write_text(EVIL)
    (run_copy / "evil.py").write_text(EVIL)
    for name in ("config.yaml", str(STARTED)):
        raw = yaml.safe_load((run_copy / name).read_text())
        raw["plugins"] = [str(tmp_path / "evil.py"), "../evil.py", "evil", "evil.py"]
        (run_copy / name).write_text(yaml.safe_dump(raw, sort_keys=False))
    monkeypatch.chdir(run_copy)
    assert main(["results", "show", str(run_copy)]) == 0
    assert main(["results", "show", str(run_copy), "--clients"]) == 0
    assert main(["plot", str(run_copy), "--out", str(tmp_path / "p.png")]) == 0
    assert len(fedsim.collect(run_copy)) == 2 and len(fedsim.load(run_copy)["rounds"]) == 2
    capsys.readouterr()
    assert not marker.exists() and "evil" not in sys.modules


def test_resume_extends_a_run_whose_rounds_were_raised(run_copy, tmp_path):
    raw = yaml.safe_load((run_copy / "config.yaml").read_text())
    raw["rounds"] = 3
    raw["eval"]["batch_size"] = 100  # harmless too
    (run_copy / "config.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    proc = fedsim("run", "--resume", str(run_copy), "--quiet")
    assert proc.returncode == 0, proc.stderr[-3000:]
    cfg = write_config(tmp_path / "three.yaml", tmp_path / "fresh", rounds=3)
    assert fedsim("run", str(cfg), "--quiet", "-o", "results.run_id=three").returncode == 0
    extended = pd.read_parquet(run_copy / "rounds.parquet")
    assert list(extended["round"]) == [0, 1, 2]
    fresh = pd.read_parquet(tmp_path / "fresh" / "three" / "rounds.parquet")
    pd.testing.assert_frame_equal(deterministic(extended), deterministic(fresh))


@pytest.mark.parametrize("table", ["rounds.parquet", "clients.parquet"])
@pytest.mark.parametrize("damage", ["no round column", "round as text", "a null round", "a negative round"])
def test_a_table_whose_rows_are_not_numbered_by_round_is_refused_on_resume_and_kept(run_copy, table, damage):
    """--resume keeps the rows up to the checkpoint's round: a round column that cannot say which would drop rows
    (a null round once lost round 0) or fail with a traceback."""
    target = run_copy / table
    df = pd.read_parquet(target)
    if damage == "no round column":
        df = df.drop(columns="round")
    elif damage == "round as text":
        df["round"] = df["round"].astype(str)
    elif damage == "a null round":
        df["round"] = df["round"].astype("float64").where(df.index > 0)
    else:
        df.loc[0, "round"] = -1
    df.to_parquet(target)
    before = tree(run_copy)
    assert_one_line_error(fedsim("run", "--resume", str(run_copy), "--quiet"), f"{table}: has ")
    assert tree(run_copy) == before


@pytest.mark.parametrize("table", ["rounds.parquet", "clients.parquet"])
@pytest.mark.parametrize("damage", ["missing", "corrupt"])
def test_damaged_tables_fail_in_one_line_naming_the_file(run_copy, capsys, table, damage):
    from jobs.cli import main

    target = run_copy / table
    if damage == "missing":
        target.unlink()
    else:
        target.write_bytes(target.read_bytes()[: len(target.read_bytes()) // 2])  # a truncated copy
    before = tree(run_copy)
    assert_one_line_error(fedsim("run", "--resume", str(run_copy), "--quiet"), table)
    readers = [["results", "show", str(run_copy), "--clients"]]
    if table == "rounds.parquet" or damage == "corrupt":
        readers += [["results", "show", str(run_copy)], ["plot", str(run_copy)]]
    for args in readers:  # in-process: the same entry point, without an interpreter start each
        code = main(args)
        err = capsys.readouterr().err
        assert code == 2 and len(err.strip().splitlines()) == 1 and err.startswith("fedsim: error: "), err
        assert table in err
    assert tree(run_copy) == before


def test_a_rounds_file_that_is_another_table_is_one_line(run_copy, capsys):
    """A parquet file that is not a rounds table (no 'round' column): one line naming it, not an empty frame."""
    from jobs.cli import main

    pd.DataFrame({"x": [1.0, 2.0]}).to_parquet(run_copy / "rounds.parquet")
    for args in (["results", "show", str(run_copy)], ["plot", str(run_copy)]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith("fedsim: error: ") and err.count("\n") == 1, err  # plot: "no run to plot: ..."
        assert err.endswith(f"{run_copy / 'rounds.parquet'}: not a fedsim rounds table (it has no 'round' column)\n")


def test_reading_a_table_leaves_arrows_threads_no_python_object(tmp_path, monkeypatch):
    """Arrow frees what a read used on its pool threads, after the read has returned. A Python object freed there
    needs the GIL, and a process that exits meanwhile aborts: CI saw SIGABRT (exit -6) after the one-line error of
    a resume that found clients.parquet missing. read_table must use its file on the calling thread alone and drop
    it before it returns."""
    import io
    import threading
    import weakref

    import numpy as np

    from fedsim.results.tables import read_table

    table = tmp_path / "rounds.parquet"
    expected = pd.DataFrame({"round": np.arange(5000), "loss": np.linspace(0, 1, 5000), "model": "global"})
    expected.to_parquet(table)
    used_on: set[int] = set()
    opened: list[weakref.ref] = []

    class Recorded(io.FileIO):  # the file read_table opens, noting each thread that reads it or frees it
        def read(self, *args):
            used_on.add(threading.get_ident())
            return super().read(*args)

        def readinto(self, buffer):
            used_on.add(threading.get_ident())
            return super().readinto(buffer)

        def seek(self, *args):
            used_on.add(threading.get_ident())
            return super().seek(*args)

        def __del__(self):
            used_on.add(threading.get_ident())

    def recorded_open(self, mode="r", *args, **kwargs):
        f = Recorded(self, mode.replace("b", ""))
        opened.append(weakref.ref(f))
        return f

    monkeypatch.setattr(Path, "open", recorded_open)
    got = read_table(table)
    monkeypatch.undo()
    pd.testing.assert_frame_equal(got, expected)
    assert len(opened) == 1 and opened[0]() is None, "the file outlived the read"
    assert used_on == {threading.get_ident()}, "arrow's threads used the Python file"


@pytest.mark.parametrize("override, fragment, into_existing", [
    ("data.name=nope", "data.name", False),                      # no such dataset
    ("model.name=nosuch", "model", True),                        # no such architecture
    ("stragglers.trace=/no/such/trace.csv", "trace.csv", False),  # no such device trace
    ("stragglers.trace=/dev/zero", "/dev/zero is not a regular file", False),  # read forever, filling memory
    ("stragglers.trace=/", "stragglers.trace: / is a folder, not a file", False),  # was "cannot read /: Is a dir..."
])
def test_a_run_that_cannot_start_leaves_no_folder(tmp_path, override, fragment, into_existing):
    results = tmp_path / "results"
    cfg = write_config(tmp_path / "tiny.yaml", results / "new", stragglers={"enabled": True})
    if not into_existing:
        assert_one_line_error(fedsim("run", str(cfg), "--quiet", "-o", override), fragment)
        assert not results.exists()  # not the run folder, nor the results root it would have created
        return
    (results / "mine").mkdir(parents=True)  # a run_id naming an existing empty folder: kept, nothing added
    assert_one_line_error(fedsim("run", str(cfg), "--quiet", "-o", override, "-o", f"results.root={results}",
                                 "-o", "results.run_id=mine"), fragment)
    assert tree(results) == {"mine": None}


def test_a_spill_dir_that_is_a_file_is_refused_before_the_run(tmp_path):
    results = tmp_path / "results"
    cfg = write_config(tmp_path / "tiny.yaml", results)
    assert_one_line_error(fedsim("run", str(cfg), "--quiet", "-o", f"runtime.spill_dir={cfg}"),
                          f"runtime.spill_dir: {cfg} exists and is not a folder")
    assert not results.exists()


def test_a_run_id_naming_a_folder_of_other_files_is_refused_and_the_files_kept(tmp_path):
    """A run would replace the folder's config.yaml, and a run stopped before its first round removes what it
    wrote there (config.yaml, checkpoints/): the user's own files of those names would go with it."""
    mine = tmp_path / "results" / "mine"
    (mine / "checkpoints").mkdir(parents=True)
    for name, text in (("config.yaml", "notes"), ("checkpoints/important.pt", "x"), ("notes.txt", "k")):
        (mine / name).write_text(text)
    before = tree(mine)
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results")
    assert_one_line_error(fedsim("run", str(cfg), "--quiet", "-o", "results.run_id=mine"),
                          "holds files that are not a run's")
    assert tree(mine) == before and (mine / "config.yaml").read_text() == "notes"


@pytest.mark.parametrize("stop", ["error", "interrupt"])
def test_a_run_stopped_during_its_first_round_leaves_no_folder(tmp_path, monkeypatch, capsys, stop):
    from fedsim.errors import AggregationError
    from fedsim.runtime.loop import Simulation
    from jobs.cli import main

    def first_round(self, r, before=None):
        raise AggregationError("server step failed") if stop == "error" else KeyboardInterrupt()

    monkeypatch.setattr(Simulation, "train_round", first_round)
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results")
    code = main(["run", str(cfg), "--quiet"])
    err = capsys.readouterr().err
    assert code == (2 if stop == "error" else 130), err
    assert len(err.strip().splitlines()) == 1 and "Traceback" not in err
    assert ("server step failed" in err) if stop == "error" else ("nothing was written" in err)
    assert not (tmp_path / "results").exists()


def test_collect_skips_and_names_incomplete_folders(finished, tmp_path):
    import fedsim

    root = tmp_path / "results"
    shutil.copytree(finished, root / "a")
    shutil.copytree(finished, root / "b")
    (root / "failed").mkdir()
    shutil.copy(finished / "config.yaml", root / "failed" / "config.yaml")  # what a failed start used to leave
    (root / "bench").mkdir()  # not a run at all: ignored
    with pytest.warns(UserWarning, match="failed"):
        df = fedsim.collect(str(root))  # one folder of runs, not its letters
    assert sorted(df["run"].unique()) == ["a", "b"] and len(df) == 4
    assert len(df.attrs["skipped"]) == 1 and "failed" in df.attrs["skipped"][0]
    with pytest.warns(UserWarning):
        assert sorted(fedsim.collect(root)["run"].unique()) == ["a", "b"]
    assert sorted(fedsim.collect(str(root / "[ab]"))["run"].unique()) == ["a", "b"]  # a glob pattern
    one = fedsim.collect(root / "a")
    assert set(one["run"]) == {"a"} and one.attrs["skipped"] == [] and "config.algorithm.name" in one
    with pytest.raises(fedsim.FedsimError, match="nope"):
        fedsim.collect(str(root / "nope"))


def test_collect_gives_a_config_key_missing_from_one_run_and_null_in_another_one_missing_value(finished, tmp_path):
    import fedsim

    root = tmp_path / "results"
    for name in ("null", "absent", "set"):
        shutil.copytree(finished, root / name)
    cfg = yaml.safe_load((finished / "config.yaml").read_text())
    assert cfg["stragglers"]["trace"] is None
    del cfg["stragglers"]["trace"]
    (root / "absent" / "config.yaml").write_text(yaml.safe_dump(cfg))
    cfg["stragglers"]["trace"] = "devices.csv"
    (root / "set" / "config.yaml").write_text(yaml.safe_dump(cfg))
    df = fedsim.collect(root)
    by_run = df.groupby("run")["config.stragglers.trace"].first().to_dict()
    assert by_run == {"absent": None, "null": None, "set": "devices.csv"}
    assert sorted(df["config.stragglers.trace"].unique(), key=str) == [None, "devices.csv"]


def test_results_show_says_on_stderr_when_a_run_did_not_finish(run_copy, capsys):
    import json

    from jobs.cli import main

    assert main(["results", "show", str(run_copy)]) == 0
    done = capsys.readouterr()
    assert done.err == "" and done.out.split()[0] == "round"
    meta = json.loads((run_copy / "meta.json").read_text())
    (run_copy / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    assert main(["results", "show", str(run_copy)]) == 0
    cut = capsys.readouterr()
    assert cut.out == done.out  # the table alone on stdout, as before
    assert cut.err == f"fedsim results show: {run_copy}: incomplete (interrupted after 2 of 2 rounds)\n"


def test_collect_and_plot_refuse_an_empty_list_of_runs(tmp_path):
    import fedsim
    from fedsim.results.plots import plot_runs

    for call in (fedsim.collect, plot_runs):
        with pytest.raises(fedsim.FedsimError, match=r"^run folders: none given \(an empty list\)$"):
            call([])
        with pytest.raises(fedsim.FedsimError, match="none given"):
            call(p for p in sorted(tmp_path.glob("nothing-*")))  # a generator that yields nothing
    assert not list(tmp_path.iterdir())


def _wait_for_rounds(run_dir: Path, proc, timeout: float = 400) -> int:
    end = time.time() + timeout
    while time.time() < end and proc.poll() is None:
        try:
            done = len(pd.read_parquet(run_dir / "rounds.parquet"))
            if done >= 1:
                return done
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    raise AssertionError(f"no round written (exit {proc.poll()}): {proc.output()[1][-3000:]}")


@pytest.mark.slow
def test_sigterm_keeps_the_finished_rounds_and_resume_completes_the_run(tmp_path):
    rounds = 12  # the signal follows the first round within a poll (0.1 s); 11 more rounds take seconds
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results", rounds=rounds, train={"epochs": 2})
    run_dir = tmp_path / "results" / "t"
    proc = start_module("jobs.cli", ["run", str(cfg), "--quiet", "-o", "results.run_id=t"], env=ENV)
    _wait_for_rounds(run_dir, proc)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=120)[1]
    assert proc.returncode == 143, err
    assert "Traceback" not in err and err.strip().splitlines() == [
        next(ln for ln in err.splitlines() if ln.startswith("fedsim: terminated after round"))]
    assert f"--resume {run_dir}" in err
    done = len(pd.read_parquet(run_dir / "rounds.parquet"))
    assert 1 <= done < rounds, "the run must stop part-way"
    assert not list(run_dir.rglob(".*.tmp"))
    resumed = fedsim("run", "--resume", str(run_dir), "--quiet")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert fedsim("run", str(cfg), "--quiet", "-o", "results.run_id=full").returncode == 0
    pd.testing.assert_frame_equal(deterministic(pd.read_parquet(run_dir / "rounds.parquet")),
                                  deterministic(pd.read_parquet(tmp_path / "results" / "full" / "rounds.parquet")))


def _ray_processes(driver: int) -> list:
    """The driver's descendants: Ray's daemons (gcs_server, raylet, agents) and its workers."""
    import psutil

    return psutil.Process(driver).children(recursive=True)


def _survivors(procs: list, wait_s: float = 30) -> list[str]:
    import psutil

    end = time.time() + wait_s
    while True:
        alive = []
        for p in procs:
            try:
                if p.is_running() and p.status() != psutil.STATUS_ZOMBIE:
                    alive.append(f"{p.pid} {' '.join(p.cmdline())[:80]}")
            except psutil.NoSuchProcess:
                continue
        if not alive or time.time() > end:
            return alive
        time.sleep(0.5)


def _session_log(procs: list) -> Path:
    """A log file of the Ray session the driver started (the GCS is started with --log_dir=<session>/logs)."""
    gcs = next(p.cmdline() for p in procs if "gcs_server" in " ".join(p.cmdline()))
    logs = next(a.split("=", 1)[1] for a in gcs if a.startswith("--log_dir="))
    return Path(logs) / "gcs_server.out"


# Ray's agents outlive a driver killed with SIGKILL by about a minute (61.5 s measured, 2 cores), then leave on
# their own: the driver's daemons die with it, and the agents when they no longer reach its GCS. (A SIGTERM, which
# stops every process of the run's Ray, agents included: test_sigterm_while_ray_starts_is_one_line_and_exit_143.)
@pytest.mark.slow
@pytest.mark.ray
def test_a_killed_ray_driver_leaves_no_ray_daemons_and_no_bystander_is_signalled(tmp_path):
    # one client worker: what must go with the driver (its GCS, raylet, monitors, a worker) is all there with one;
    # a second only cost a torch import before the first round
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results", rounds=200, train={"epochs": 2},
                       runtime={"backend": "ray", "num_workers": 1, "client_cpus": 0.5, "threads": 1})
    run_dir = tmp_path / "results" / "r"
    proc = start_module("jobs.cli", ["run", str(cfg), "--quiet", "-o", "results.run_id=r"], env=ENV)
    bystander = None
    try:
        _wait_for_rounds(run_dir, proc)
        started = _ray_processes(proc.pid)
        names = " ".join(" ".join(p.cmdline()) for p in started)
        assert "raylet" in names and "gcs_server" in names and "ray::DashboardAgent" in names, names
        agents = [p for p in started if "Agent" in " ".join(p.cmdline())]
        bystander = _bystander(started)
        proc.send_signal(signal.SIGKILL)
        proc.communicate(timeout=180)
        assert proc.returncode == -signal.SIGKILL
        # Ray's two agents leave on their own once the GCS is gone (measured: 62 s); the daemons that hold the node
        # (GCS, raylet, monitors, workers) must be gone at once
        assert _survivors([p for p in started if p not in agents], 30) == []
        assert bystander.poll() is None, "a process that only reads the session's log was signalled"
    finally:
        for p in (proc, bystander):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()
        for agent in locals().get("agents", []):  # not left to outlive the test
            with contextlib.suppress(Exception):
                agent.kill()


def _bystander(started: list) -> subprocess.Popen:
    """The user follows a log of the run's Ray: a process that is not the run's, and must outlive its stop."""
    return subprocess.Popen(["tail", "-f", str(_session_log(started))], stdout=subprocess.DEVNULL,
                            start_new_session=True)


def _ray_worker_started(driver: int) -> bool:
    """Whether the driver's Ray runs a worker process (`ray::IDLE` or an actor): the raylet starts them once the
    driver has connected, which is when Ray's native crash handler was installed in it."""
    import psutil

    try:
        return any(p.cmdline()[:1] and p.cmdline()[0].startswith("ray::") and "Agent" not in p.cmdline()[0]
                   for p in _ray_processes(driver))
    except psutil.Error:
        return False


@pytest.mark.slow
@pytest.mark.ray
def test_sigterm_while_ray_starts_is_one_line_and_exit_143(tmp_path):
    """SIGTERM once the driver has connected to its new Ray and before the first round (Ray's native handler took
    it once: a six-line stack dump, then an abort; and Ray said on its start that it turned on token authentication)
    is one line and exit 143, and every process of the run's Ray goes with the driver."""
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results", rounds=50,
                       runtime={"backend": "ray", "num_workers": 1, "client_cpus": 0.5, "threads": 1})
    env = {k: v for k, v in ENV.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    proc = start_module("jobs.cli", ["run", str(cfg), "--quiet", "-o", "results.run_id=s"], env=env)
    try:
        end = time.time() + 300
        while not _ray_worker_started(proc.pid) and proc.poll() is None and time.time() < end:
            time.sleep(0.05)
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        started = _ray_processes(proc.pid)
        bystander = _bystander(started)
        proc.send_signal(signal.SIGTERM)
        err = proc.communicate(timeout=180)[1]
        assert proc.returncode == 143, err[-3000:]
        assert len(err.strip().splitlines()) == 1 and err.startswith("fedsim: terminated"), err[-3000:]
        # every process of the run's Ray up by then (agents too) goes with the driver; a bystander stays
        assert _survivors(started, 30) == []
        assert bystander.poll() is None, "a process that only reads the session's log was signalled"
    finally:
        for p in (proc, locals().get("bystander")):
            if p is not None and p.poll() is None:
                p.kill()
                p.wait()


def test_the_stop_message_names_the_last_round_the_table_kept(tmp_path):
    """The signal may land after the table is written but before the progress callback: the table decides."""
    from jobs.cli import _after_last_round

    table = tmp_path / "rounds.parquet"
    pd.DataFrame({"round": [0, 1, 2], "accuracy": [0.1, 0.2, 0.3]}).to_parquet(table)
    assert _after_last_round(table) == " after round 2"
    table.write_bytes(b"not parquet")
    assert _after_last_round(table) == ""


def _without_root_overrides() -> list[str]:
    """A command prefix under which file permissions hold even for root (who reads a mode-000 folder otherwise)."""
    if os.geteuid() != 0:
        return []
    setpriv = shutil.which("setpriv")
    assert setpriv, "root needs setpriv (util-linux) to run a command that file permissions bind"
    return [setpriv, "--bounding-set=-dac_override,-dac_read_search", "--"]


def test_a_run_folder_that_cannot_be_read_is_one_line_naming_the_file(run_copy):
    run_copy.chmod(0)
    try:
        for args in (["results", "show", str(run_copy)], ["plot", str(run_copy)],
                     ["run", "--resume", str(run_copy), "--quiet"]):
            proc = subprocess.run([*_without_root_overrides(), sys.executable, "-m", "jobs.cli", *args], cwd=ROOT,
                                  env=ENV, capture_output=True, text=True, timeout=300)
            assert_one_line_error(proc, str(run_copy), "Permission denied")
    finally:
        run_copy.chmod(0o755)


@pytest.mark.parametrize("command", [["config-reference"], ["results", "show", "RUN"]])
def test_a_full_standard_output_is_one_line_not_a_traceback(finished, command):
    args = [str(finished) if a == "RUN" else a for a in command]
    proc = run_module("jobs.cli", args, env=ENV, stdout="/dev/full")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr == "fedsim: error: standard output: No space left on device\n"


def test_a_plot_into_a_folder_that_refuses_files_is_one_line(finished, capsys):
    from jobs.cli import main

    assert main(["plot", str(finished), "--out", "/proc/fedsim-test.png"]) == 2
    assert capsys.readouterr().err == ("fedsim: error: --out /proc/fedsim-test.png: cannot write the plot there "
                                       "(No such file or directory)\n")


def test_a_started_config_that_is_a_folder_is_refused_and_kept(run_copy):
    started = run_copy / STARTED
    started.unlink()
    started.mkdir()
    before = tree(run_copy)
    assert_one_line_error(fedsim("run", "--resume", str(run_copy), "--quiet"), f"{started}: not a file")
    assert tree(run_copy) == before


def test_a_checkpoint_whose_model_has_a_weight_more_is_refused_before_any_round(run_copy):
    """Extra weights would load only when the server first evaluates: after a resumed round had trained."""
    import torch

    ckpt = run_copy / "checkpoints" / "last.pt"
    state = torch.load(ckpt, weights_only=True)
    (arch, weights), = state["server_state"]["models"].items()
    weights["extra.weight"] = torch.zeros(3)
    torch.save(state, ckpt)
    reseal(run_copy)
    config = yaml.safe_load((run_copy / "config.yaml").read_text())
    config["rounds"] = 3
    (run_copy / "config.yaml").write_text(yaml.safe_dump(config))
    before = tree(run_copy)
    assert_one_line_error(fedsim("run", "--resume", str(run_copy), "--quiet"), "does not fit this run",
                          f"server_state.models['{arch}'] has 'extra.weight', which this run's model lacks")
    assert tree(run_copy) == before


def test_a_write_under_a_file_names_the_file_in_the_way_and_a_resume_of_a_file_says_so(tmp_path, capsys):
    from fedsim.persist.io import atomic_write_text
    from jobs.cli import main

    afile = tmp_path / "afile"
    afile.write_text("kept")
    with pytest.raises(OSError) as err:
        atomic_write_text(afile / "x.txt", "text")
    assert err.value.filename == str(afile)  # the file that is in the way, not the one that was never made
    assert main(["run", "--resume", str(afile), "--quiet"]) == 2
    assert capsys.readouterr().err == f"fedsim: error: --resume {afile}: not a run folder (a file, not a folder)\n"
    assert afile.read_text() == "kept"


def test_plot_takes_a_folder_named_like_a_pattern_as_it_is_and_names_a_file_given_as_a_run(finished, tmp_path, capsys):
    from jobs.cli import main

    odd = tmp_path / "run[1]"
    shutil.copytree(finished, odd)
    assert main(["plot", str(odd), "--out", str(tmp_path / "p.png")]) == 0 and (tmp_path / "p.png").is_file()
    capsys.readouterr()
    assert main(["plot", str(finished / "rounds.parquet")]) == 2
    assert capsys.readouterr().err == f"fedsim: error: {finished / 'rounds.parquet'}: a file, not a run folder\n"


def test_results_show_prints_exactly_the_rows_asked_for(finished, capsys):
    from jobs.cli import main

    assert main(["results", "show", str(finished), "--clients", "--rows", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()  # header, 2 first rows, the gap, 1 last row, the note
    assert len(lines) == 6 and lines[3].split() == ["..."] * len(lines[0].split())
    assert lines[-1] == "(1 of 4 rows not shown; --rows N shows more)"
    assert main(["results", "show", str(finished), "--clients", "--rows", "4"]) == 0
    assert len(capsys.readouterr().out.splitlines()) == 5  # all of them, no note
    with pytest.raises(SystemExit):
        main(["results", "show", str(finished), "--rows", "0"])
    assert "--rows: must be >= 1, got 0" in capsys.readouterr().err


def test_a_runs_checkpoints_folder_is_part_of_the_run_not_an_incomplete_one(finished):
    """checkpoints/ holds a config.yaml too; a glob that reaches it must not report it as a run that never ended."""
    from fedsim.results.tables import find_runs

    runs, skipped = find_runs([str(finished.parent / "*"), str(finished / "*")])
    assert runs == [finished] and skipped == []


def test_two_runs_started_with_the_same_name_leave_one_run_and_one_line(tmp_path):
    """Both used to pass the planning check, both exit 0 and print the same folder, which then held one run."""
    cfg = write_config(tmp_path / "tiny.yaml", tmp_path / "results", run_id="same")
    procs = [subprocess.Popen([sys.executable, "-m", "jobs.cli", "run", str(cfg), "--quiet"], cwd=ROOT, env=ENV,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    done = [(p, *p.communicate(timeout=600)) for p in procs]
    codes = sorted(p.returncode for p, _, _ in done)
    assert codes == [0, 2], [err[-2000:] for _, _, err in done]
    winner = next(p for p, _, _ in done if p.returncode == 0)
    loser = next(subprocess.CompletedProcess(p.args, p.returncode, out, err) for p, out, err in done
                 if p.returncode == 2)
    line = assert_one_line_error(loser, str(tmp_path / "results" / "same"))
    assert "is taken by another run" in line or "already holds a run" in line
    run_dir = tmp_path / "results" / "same"
    assert json.loads((run_dir / "run.json").read_text())["pid"] == winner.pid
    assert list(pd.read_parquet(run_dir / "rounds.parquet")["round"]) == [0, 1]
    assert len(pd.read_parquet(run_dir / "clients.parquet")) == 4


def test_a_claimed_name_is_refused_and_a_default_name_taken_moves_on(tmp_path):
    """The claim, not the planning check, decides: two runs planned before either wrote anything."""
    from fedsim.configure import load_config
    from fedsim.errors import ConfigError
    from fedsim.runtime.rundir import NewRunDir, planned_run_dir

    named = load_config(write_config(tmp_path / "named.yaml", tmp_path / "results", run_id="same"))
    first_plan, second_plan = planned_run_dir(named), planned_run_dir(named)
    first = NewRunDir(first_plan, named)
    before = tree(first.path)
    with pytest.raises(ConfigError, match=r"results.run_id: .*/same is taken by another run \(claimed .* by pid "):
        NewRunDir(second_plan, named)
    assert tree(first.path) == before
    with pytest.raises(ConfigError, match="already holds a run|is taken by another run"):
        planned_run_dir(named)
    default = load_config(write_config(tmp_path / "default.yaml", tmp_path / "results"))
    plan = planned_run_dir(default)
    a, b = NewRunDir(plan, default), NewRunDir(plan, default)
    assert (a.path, b.path) == (plan, plan.parent / f"{plan.name}-2")
    for claimed in (b, a, first):  # the first made results.root, and removes it once it is empty
        claimed.remove()
    assert not (tmp_path / "results").exists()


def test_a_run_another_process_writes_is_neither_resumed_nor_redone_by_a_sweep(run_copy, capsys):
    """A lock held on run.json while a process writes the run; run_cached used to remove such a folder."""
    from fedsim.configure import load_config
    from fedsim.runtime.rundir import RunLock
    from jobs.cli import main
    from jobs.sweep import run_cached, run_folder

    before = tree(run_copy)
    with RunLock(run_copy):
        assert main(["run", "--resume", str(run_copy), "--quiet"]) == 2
        assert capsys.readouterr().err == (f"fedsim: error: {run_copy}: in use by another fedsim process (it holds "
                                           f"{run_copy / 'run.json'}); wait until it ends\n")
    assert tree(run_copy) == before
    cfg = load_config(run_copy / "config.yaml", [f"results.root={run_copy.parent}"])
    folder = run_folder(cfg)
    shutil.copytree(run_copy, folder)  # an unfinished sweep run (no finished.json), being written elsewhere
    kept = tree(folder)
    with RunLock(folder), pytest.raises(FedsimError, match="in use by another fedsim process"):
        run_cached(cfg)
    assert tree(folder) == kept


def test_a_claim_whose_first_files_fail_is_given_back(tmp_path, monkeypatch):
    """Any failure after run.json is created (a store's client raising its own error type, Ctrl-C) removes the
    claim, or the name would stay taken by a run that never started."""
    import fedsim.plugins
    from fedsim.configure import load_config
    from fedsim.runtime.rundir import NewRunDir, planned_run_dir

    cfg = load_config(write_config(tmp_path / "c.yaml", tmp_path / "results", run_id="r"))
    monkeypatch.setattr(fedsim.plugins, "record", lambda *a: (_ for _ in ()).throw(KeyboardInterrupt()))
    with pytest.raises(KeyboardInterrupt):
        NewRunDir(planned_run_dir(cfg), cfg)
    assert not (tmp_path / "results").exists()
