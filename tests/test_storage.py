"""Runs kept in a store: results.root as a URI (file://, memory://, s3:// on a local S3 server). Each store gets a
2-round run through the CLI, a resume to 3 rounds, and fedsim.collect; the rounds must equal a plain local
3-round run, every file must land in the store and nowhere else, and a bad URI is one line, exit 2."""

from __future__ import annotations

import os
import pickle
import tempfile
import uuid

import fsspec
import pandas as pd
import pytest

import fedsim
from fedsim.configure import save_config
from fedsim.errors import CallbackError
from fedsim.persist.storage import StorePath, location
from fedsim.runtime.callbacks import Callback
from fedsim.runtime.loop import run
from jobs.cli import main
from tests.conftest import free_port, small_config
from tests.runtime.test_tracking import read_scalars

RUN_FILES = ["run.json", "config.yaml", "meta.json", "rounds.parquet", "clients.parquet", "checkpoints/config.yaml",
             "checkpoints/last.pt"]
COMPARED = ["round", "model", "accuracy", "loss", "participants", "arrived", "bytes_up", "bytes_down",
            "virtual_time"]


@pytest.fixture(scope="module")
def config_file(tmp_path_factory):
    """A tiny digits config (2 rounds, local backend), as a file the CLI runs."""
    folder = tmp_path_factory.mktemp("config")
    path = folder / "tiny.yaml"
    save_config(small_config(folder, rounds=2), path)
    return path


@pytest.fixture(scope="module")
def reference(config_file, tmp_path_factory):
    """The same config run for 3 rounds without a break, in a plain local folder."""
    root = tmp_path_factory.mktemp("reference")
    assert main(["run", str(config_file), "--quiet", "-o", "rounds=3", "-o", f"results.root={root}",
                 "-o", "results.run_id=ref"]) == 0
    return fedsim.load(root / "ref")["rounds"]


@pytest.fixture
def elsewhere(tmp_path, monkeypatch):
    """An empty working directory: a run kept in a store must write nothing here."""
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    return cwd


def _run_resume_collect(config_file, root: str, reference: pd.DataFrame, capsys) -> None:
    """2 rounds into `root`, rounds raised to 3 in the stored config.yaml, resumed from the URI, collected."""
    assert main(["run", str(config_file), "--quiet", "-o", f"results.root={root}", "-o", "results.run_id=r"]) == 0
    assert f"results: {location(root) / 'r'}" in capsys.readouterr().out
    run_dir = location(root) / "r"
    for name in RUN_FILES:
        assert (run_dir / name).is_file(), name
    assert len(fedsim.load(str(run_dir))["rounds"]) == 2
    config = run_dir / "config.yaml"
    text = config.read_text()
    assert "\nrounds: 2\n" in text
    with config.open("wb") as f:
        f.write(text.replace("\nrounds: 2\n", "\nrounds: 3\n").encode())

    assert main(["run", "--resume", str(run_dir), "--quiet"]) == 0
    df = fedsim.collect([root])
    assert df["run"].unique().tolist() == ["r"] and df.attrs["skipped"] == []
    assert (df["config.rounds"] == 3).all()
    pd.testing.assert_frame_equal(df[COMPARED].reset_index(drop=True), reference[COMPARED].reset_index(drop=True))
    pd.testing.assert_frame_equal(fedsim.load(str(run_dir))["rounds"], df.drop(
        columns=[c for c in df.columns if c == "run" or c.startswith("config.")]))
    names = [str(p) for p in _walk(run_dir)]
    assert not [n for n in names if n.endswith(".tmp")], names  # every write was one complete file


def _walk(folder):
    for child in folder.iterdir():
        yield child
        if child.is_dir():
            yield from _walk(child)


def test_file_uri_run_resumes_and_collects(config_file, reference, tmp_path, elsewhere, capsys):
    root = f"file://{tmp_path}/mount/runs"
    _run_resume_collect(config_file, root, reference, capsys)
    assert (tmp_path / "mount" / "runs" / "r" / "rounds.parquet").is_file()
    assert list(elsewhere.iterdir()) == []


@pytest.fixture
def memory_root():
    """A fresh folder in fsspec's in-memory filesystem, removed afterwards."""
    root = f"memory://fedsim-{uuid.uuid4().hex[:8]}/runs"
    yield root
    fs, top = fsspec.filesystem("memory"), root.replace("memory://", "/").rsplit("/", 1)[0]
    if fs.exists(top):
        fs.rm(top, recursive=True)


def test_memory_store_run_resumes_and_collects(config_file, reference, memory_root, elsewhere, capsys):
    _run_resume_collect(config_file, memory_root, reference, capsys)
    assert list(elsewhere.iterdir()) == []


def test_checkpoint_in_a_store_is_data_not_code(config_file, memory_root, elsewhere, capsys):
    """A crafted pickle put where the checkpoint was is refused in one line; the code it names never runs."""
    assert main(["run", str(config_file), "--quiet", "-o", f"results.root={memory_root}",
                 "-o", "results.run_id=r"]) == 0
    marker = elsewhere / "pwned"

    class Payload:
        def __reduce__(self):
            return (os.mkdir, (str(marker),))

    checkpoint = location(memory_root) / "r" / "checkpoints" / "last.pt"
    with checkpoint.open("wb") as f:
        f.write(pickle.dumps(Payload(), protocol=2))
    _reseal(checkpoint)
    capsys.readouterr()
    assert main(["run", "--resume", f"{memory_root}/r", "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedsim: error: {checkpoint}: unreadable checkpoint"), err
    assert not marker.exists()


def _reseal(checkpoint: StorePath) -> None:
    """List a replaced checkpoint in its manifest, as whoever replaced it can (tests.conftest.reseal, in a store)."""
    import hashlib
    import json

    manifest_path = checkpoint.parent / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["checkpoints"][0]["sha256"] = hashlib.sha256(checkpoint.read_bytes()).hexdigest()
    with manifest_path.open("wb") as f:
        f.write(json.dumps(manifest).encode())


def test_run_that_fails_before_its_first_round_leaves_nothing_in_the_store(memory_root, tmp_path):
    class Refuse(Callback):
        def on_setup_end(self, run):
            raise RuntimeError("no")

    cfg = small_config(tmp_path, f"results.root={memory_root}", "results.run_id=r", rounds=2)
    with pytest.raises(CallbackError):
        run(cfg, callbacks=[Refuse()])
    assert not location(memory_root).exists()
    assert not location(memory_root).parent.exists()


@pytest.mark.parametrize("root, message", [
    ("nope://bucket/runs", "results.root: nope://bucket/runs: unknown URI scheme nope://"),
    ("gs://bucket/runs", 'results.root: gs://bucket/runs: gs:// needs gcsfs, which is not installed: '
                         'pip install "fedsim-ray[gcs]"'),
])
def test_bad_uri_is_one_line_and_exit_2(root, message, config_file, elsewhere, monkeypatch, capsys):
    monkeypatch.setitem(__import__("sys").modules, "gcsfs", None)  # as if the gcs extra were not installed
    assert main(["run", str(config_file), "--quiet", "-o", f"results.root={root}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"fedsim: error: {message}"), err
    assert list(elsewhere.iterdir()) == []
    assert main(["run", "--resume", f"{root}/r", "--quiet"]) == 2
    assert capsys.readouterr().err.startswith(f"fedsim: error: --resume: {root}/r: ")


def test_s3_store_run_resumes_and_collects(s3_server, config_file, reference, elsewhere, capsys, tmp_path):
    root = f"{s3_server}/team/runs"
    _run_resume_collect(config_file, root, reference, capsys)
    assert isinstance(location(root), StorePath)
    assert list(elsewhere.iterdir()) == []
    # a run another machine writes meanwhile (its own S3 client) shows up in the next collect
    import s3fs

    other = s3fs.S3FileSystem(skip_instance_cache=True)
    other.copy(f"{root}/r", f"{root}/r2", recursive=True)
    assert sorted(fedsim.collect(root)["run"].unique()) == ["r", "r2"]
    # TensorBoard with a bucket root: the event files are uploaded beside the run's tables after every round
    assert main(["run", str(config_file), "--quiet", "-o", f"results.root={root}", "-o", "results.run_id=tb",
                 "-o", "tracking.tensorboard=true"]) == 0
    events = tmp_path / "events"
    events.mkdir()
    for f in (location(root) / "tb" / "tensorboard").iterdir():
        (events / f.name).write_bytes(f.read_bytes())
    rounds = fedsim.load(f"{root}/tb")["rounds"]
    accuracy = read_scalars(events)["accuracy/" + rounds["model"].iloc[0]]
    assert accuracy == pytest.approx(dict(zip(rounds["round"], rounds["accuracy"])), rel=1e-6)
    assert list(elsewhere.iterdir()) == []
    # a figure of a store run is the reader's: written in the current folder, never into the bucket
    assert main(["plot", f"{root}/tb"]) == 0
    assert [p.name for p in elsewhere.iterdir()] == ["tb-accuracy.png"]
    assert not (location(root) / "tb" / "accuracy.png").exists()


def test_s3_missing_bucket_is_one_line_and_exit_2(s3_server, config_file, elsewhere, capsys):
    assert main(["run", str(config_file), "--quiet", "-o", "results.root=s3://no-such-bucket/runs"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    endpoint = os.environ["AWS_ENDPOINT_URL"]
    assert err == [f"fedsim: error: results.root: s3://no-such-bucket/runs: no bucket 'no-such-bucket' at endpoint "
                   f"{endpoint}; create it first"], err
    assert list(elsewhere.iterdir()) == []


def test_s3_without_credentials_is_told_apart_from_a_missing_bucket(s3_server, config_file, elsewhere, capsys,
                                                                     monkeypatch):
    """The bucket exists, but the job's environment lacks the credentials: the line says what to set, not 'no
    bucket'."""
    import s3fs

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):
        monkeypatch.delenv(key)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(elsewhere / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(elsewhere / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    assert main(["run", str(config_file), "--quiet", "-o", f"results.root={s3_server}/runs"]) == 2
    (err,) = capsys.readouterr().err.strip().splitlines()
    assert err.startswith(f"fedsim: error: results.root: {s3_server}/runs: cannot reach the store at endpoint "
                          f"{os.environ['AWS_ENDPOINT_URL']} (NoCredentialsError: "), err
    assert err.endswith("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and AWS_ENDPOINT_URL for a store that is not "
                        "AWS (MinIO, Ceph, moto); in a Ray job, in the runtime env's env_vars"), err
    assert list(elsewhere.iterdir()) == []
    s3fs.S3FileSystem.clear_instance_cache()


def test_a_store_out_of_reach_is_one_line_naming_the_uri_once(monkeypatch, capsys):
    """Reading from a store that cannot be reached (no credentials, nothing listening) says so in one line: not a
    traceback from the store's client, and not "not a run folder", which would send the user looking for files."""
    pytest.importorskip("aiohttp", reason="fsspec's http:// needs aiohttp (in the dev extra)")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is in the s3 and dev extras")
    http = f"http://127.0.0.1:{free_port()}/team/run"
    assert str(location(http)) == http
    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_PROFILE", "AWS_ENDPOINT_URL"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", os.devnull)
    monkeypatch.setenv("AWS_CONFIG_FILE", os.devnull)
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    s3fs.S3FileSystem.clear_instance_cache()
    for uri, reason in ((http, "ClientConnectorError"), ("s3://fedsim-bucket/run", "NoCredentialsError")):
        for args in (["results", "show", uri], ["run", "--resume", uri, "--quiet"]):
            assert main(args) == 2
            err = capsys.readouterr().err.splitlines()
            assert len(err) == 1 and err[0].startswith(f"fedsim: error: {uri}: cannot reach the store ({reason}: "), err
    s3fs.S3FileSystem.clear_instance_cache()


@pytest.mark.parametrize("store", ["memory", "s3"])
def test_a_run_name_in_a_store_is_claimed_by_one_run(store, request, memory_root, tmp_path):
    """A conditional put of run.json (S3's If-None-Match): of two runs planned at once, the second is refused and
    writes nothing into the first's folder."""
    from fedsim.errors import ConfigError
    from fedsim.runtime.rundir import NewRunDir, planned_run_dir

    root = memory_root if store == "memory" else f"{request.getfixturevalue('s3_server')}/claim-{uuid.uuid4().hex}"
    cfg = small_config(tmp_path, f"results.root={root}", "results.run_id=r", rounds=1)
    plans = planned_run_dir(cfg), planned_run_dir(cfg)
    first = NewRunDir(plans[0], cfg)
    files = {str(p): p.read_bytes() for p in _walk(first.path) if p.is_file()}
    assert str(first.path / "run.json") in files
    with pytest.raises(ConfigError, match=f"results.run_id: {first.path} is taken by another run"):
        NewRunDir(plans[1], cfg)
    assert {str(p): p.read_bytes() for p in _walk(first.path) if p.is_file()} == files
    first.remove()


def test_a_run_in_a_store_resumes_with_its_own_plugin_copy_when_trusted(memory_root, tmp_path, isolated, capsys):
    """--trust-run-plugins imports the copy the run keeps in the store, downloaded once: the CLI reads the config
    twice (to start the backend, then to run), and a second download was another module file of the same name."""
    import sys

    from fedsim import registry

    before = registry.snapshot()
    plugin = tmp_path / "store_plug.py"
    plugin.write_text("from fedsim.models.registry import register_model\n"
                      "register_model('store_plug_model')(lambda **kw: None)\n")
    cfg = small_config(tmp_path, f"plugins=[{plugin}]", rounds=1)
    config = tmp_path / "c.yaml"
    save_config(cfg, config)
    assert main(["run", str(config), "--quiet", "-o", f"results.root={memory_root}", "-o", "results.run_id=r"]) == 0
    plugin.unlink()
    sys.modules.pop("store_plug")  # as in a new process
    registry.restore(before)
    run_dir = f"{memory_root}/r"
    capsys.readouterr()
    assert main(["run", "--resume", run_dir, "--quiet"]) == 2
    assert "store_plug.py': no such file here; to allow it, pass --plugins FILE" in capsys.readouterr().err
    assert main(["run", "--resume", run_dir, "--quiet", "--trust-run-plugins"]) == 0, capsys.readouterr().err
    assert sys.modules["store_plug"].__file__.startswith(tempfile.gettempdir())
