"""Files fedsim did not write itself (checkpoints, spilled client states) are data: loading one never runs code,
and a crafted one is a one-line error. Written files get the user's umask; the cluster config stays private."""

from __future__ import annotations

import dataclasses
import os
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from fedsim.algorithms._personal import PersonalScores
from fedsim.algorithms.dafkd import DaFKDState
from fedsim.algorithms.feddf import FedDFState
from fedsim.algorithms.feddyn import FedDynState
from fedsim.algorithms.fedgdkd import FedGDKDState, Prev
from fedsim.algorithms.local_only import PoolState
from fedsim.algorithms.scaffold import ScaffoldState
from fedsim.configure import load_config
from fedsim.errors import CheckpointError
from fedsim.method.personal import PersonalServer
from fedsim.method.toolkit import GlobalModels
from fedsim.persist.checkpoint import (
    load_checkpoint,
    pack,
    register_state,
    registered_states,
    save_checkpoint,
    unpack,
)
from fedsim.persist.io import atomic_write_text
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.store import ClientStateStore
from tests.conftest import reseal
from tests.forked import run_module

ROOT = Path(__file__).resolve().parents[1]


def _weights(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"conv.weight": torch.randn(4, 1, 3, 3, generator=g), "bn.num_batches_tracked": torch.tensor(7),
            "half": torch.randn(5, generator=g).to(torch.bfloat16)}


def _example_states() -> list:
    """One instance of every built-in state class, each field away from its default."""
    scores = PersonalScores({0: (0.5, 1.25, 30.0), 3: (0.75, 0.5, 28.0)})
    prev = Prev([0, 3], 11, _weights(1), torch.randn(6, 10))
    return [
        GlobalModels({"cnn": _weights(0)}, {"init_seed": 5, "done": [0, 1], "snapshots": [np.arange(3.0)]}),
        FedDFState({"cnn": _weights(2), "mlp": _weights(3)}, {"k": 1}, np.array([4, 1, 9], np.int64), "mlp",
                   {"cnn": 0.25, "mlp": 0.5}, 40, {"kept": 3.0}),
        DaFKDState({"resnet11": _weights(4)}, _weights(5), {"seed": 3, "models": {0: _weights(6)}}),
        prev,
        FedGDKDState({"generator": _weights(7)}, 2, 9, {0: torch.randn(6, 10)}, torch.randn(6, 10), prev, scores),
        scores,
        PoolState({"x": torch.randn(3, 8, 8), "y": torch.arange(3)}, [0, 2], scores, {"rounds": 2}),
        ScaffoldState({"cnn": _weights(8)}, {"cnn": _weights(9)}),
        FedDynState({"cnn": _weights(10)}, {"cnn": {"conv.weight": _weights(11)["conv.weight"].double()}}),
        PersonalServer({"mlp": _weights(12)}, {0: (0.5, 1.25, 30.0), 7: (1.0, 0.1, 4.0)}, {"k": 1}),
    ]


def _same(a, b) -> bool:
    """Equal in type, dtype and every bit."""
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):
        return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and np.array_equal(a, b)
    if dataclasses.is_dataclass(a):
        return all(_same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def test_every_builtin_state_class_round_trips_bit_for_bit(tmp_path):
    examples = _example_states()
    builtin = {tag: cls for tag, cls in registered_states().items() if tag.startswith("fedsim.")}
    assert {type(e) for e in examples} == set(builtin.values())  # a newly registered class needs an example here
    for old in ("fedsim.algorithms.fedavg", "fedsim.method.toolkit"):  # checkpoints from before the moves
        assert builtin[f"{old}:GlobalModels"] is GlobalModels
    packed = pack({"s": examples[0]})
    assert packed["s"]["__dataclass__"] == "fedsim.method.toolkit:GlobalModels"
    packed["s"]["__dataclass__"] = "fedsim.method.toolkit:GlobalModels"  # as a checkpoint written then says
    assert _same(unpack(packed)["s"], examples[0])
    save_checkpoint(tmp_path / "ck.pt", {"states": examples})
    back = load_checkpoint(tmp_path / "ck.pt")["states"]
    assert all(_same(a, b) for a, b in zip(examples, back, strict=True))
    assert not _same(examples[0], examples[1]) and not _same(examples[3], Prev([0], 11, _weights(1), torch.ones(1)))


def test_an_unregistered_dataclass_is_refused_when_saving(tmp_path):
    @dataclasses.dataclass
    class Plain:
        x: int = 1

    with pytest.raises(TypeError, match="register_state"):
        pack({"s": Plain()})
    registered = register_state(dataclasses.make_dataclass("PluginState", [("x", int)]))
    save_checkpoint(tmp_path / "ck.pt", {"s": registered(3)})
    assert load_checkpoint(tmp_path / "ck.pt")["s"] == registered(3)
    with pytest.raises(TypeError, match="dataclass"):
        register_state(dict)


def _crafted(path: Path, server_state) -> Path:
    torch.save({"round": 0, "virtual_time": 0.0, "server_state": server_state, "client_states": {}}, path)
    return path


@pytest.mark.parametrize("server_state, message", [
    ({"__dataclass__": "fedsim.persist.io:os.system", "command": "true"},
     "'fedsim.persist.io:os.system', which is not a registered"),
    ({"__dataclass__": "builtins:eval", "source": "1"}, "'builtins:eval', which is not a registered"),
    ({"__dataclass__": "fedsim.runtime.loop:RunState"}, "'fedsim.runtime.loop:RunState', which is not a registered"),
    ({"__dataclass__": 42}, "names 42, which is not a registered"),
    ({"__dataclass__": "fedsim.algorithms.fedavg:GlobalModels", "models": {}, "command": "true"},
     "unknown field(s) 'command'"),
    ({"__dataclass__": "fedsim.algorithms.fedgdkd:Prev", "participants": [1]}, "cannot rebuild"),
    ({"__ndarray__": "not a tensor"}, "malformed array entry"),
])
def test_a_crafted_checkpoint_is_one_line_naming_the_file(tmp_path, server_state, message):
    path = _crafted(tmp_path / "last.pt", server_state)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    text = str(err.value)
    assert text.startswith(f"{path}: ") and message in text and "\n" not in text


def test_a_foreign_file_is_one_line_naming_the_file(tmp_path):
    garbage = tmp_path / "last.pt"
    garbage.write_bytes(b"PK\x03\x04 not a checkpoint")
    with pytest.raises(CheckpointError, match="unreadable checkpoint") as err:
        load_checkpoint(garbage)
    assert str(err.value).startswith(f"{garbage}: ") and "\n" not in str(err.value)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A real two-round run folder with a checkpoint (digits, 2 clients, local backend)."""
    out = tmp_path_factory.mktemp("runs")
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["rounds=2", "data.num_clients=2", "train.epochs=1",
                                                       "participation.clients_per_round=2", "runtime.backend=local",
                                                       f"results.root={out}", "results.run_id=run"])
    run_dir = run(cfg, LocalBackend())
    assert (run_dir / "checkpoints" / "last.pt").is_file()
    return run_dir


@pytest.mark.slow
@pytest.mark.parametrize("tag", ["fedsim.persist.io:os.system", "os:system", "fedsim.runtime.loop:RunState"])
def test_resume_from_a_crafted_checkpoint_runs_nothing(finished_run, tmp_path, tag):
    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    marker = tmp_path / "pwned"
    ckpt = folder / "checkpoints" / "last.pt"
    real = torch.load(ckpt, weights_only=True)
    real["server_state"] = {"__dataclass__": tag, "command": f"touch {shlex.quote(str(marker))}"}
    torch.save(real, ckpt)
    reseal(folder)
    rounds = (folder / "rounds.parquet").read_bytes()
    proc = run_module("jobs.cli", ["run", "--resume", str(folder), "--quiet"], timeout=600)
    assert proc.returncode == 2, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedsim: error: {ckpt}: checkpoint names '{tag}'"), lines
    assert "Traceback" not in proc.stderr and not marker.exists()
    assert (folder / "rounds.parquet").read_bytes() == rounds and ckpt.is_file()  # nothing lost


@pytest.mark.parametrize("edit, message", [
    (lambda ck: ck.pop("server_state"), "not a run checkpoint ('server_state' missing"),
    (lambda ck: ck.update(round="3"), "not a run checkpoint ('round' missing or not a int)"),
    (lambda ck: ck.update(client_states={"a": {}}), "client_states keys must be client ids"),
    (lambda ck: ck.update(server_state=pack(FedDFState({"mlp": _weights(0)}, {}, np.zeros(2, np.int64), "mlp",
                                                       {}, 0, {}))),
     "does not fit this run (its server state is a FedDFState; fedavg keeps a GlobalModels)"),
    (lambda ck: _edit_weight(ck, lambda w: w[:1]), "does not fit this run (server_state.models['cnn']['"),
    (lambda ck: _edit_weight(ck, lambda w: w.double()), "is torch.float64"),
    (lambda ck: _edit_weight(ck, lambda w: None), "lacks '"),
    (lambda ck: ck["server_state"]["models"].clear(), "server_state.models lacks 'cnn'"),
    (lambda ck: ck.update(round=-1), "it is of round -1, and rounds.parquet ends at round 1"),
    (lambda ck: ck.update(round=7), "it is of round 7, and rounds.parquet ends at round 1"),
    (lambda ck: ck.update(virtual_time=float("nan")), "virtual_time nan"),
    (lambda ck: ck.update(client_states={99: {}}), "a state for client 99, and the run has 2 clients"),
])
def test_resume_from_a_checkpoint_that_does_not_fit_is_one_line(finished_run, tmp_path, capsys, edit, message):
    from jobs.cli import main

    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    ckpt = folder / "checkpoints" / "last.pt"
    payload = torch.load(ckpt, weights_only=True)
    edit(payload)
    torch.save(payload, ckpt)
    reseal(folder, payload["round"] if isinstance(payload.get("round"), int) else None)
    rounds = (folder / "rounds.parquet").read_bytes()
    assert main(["run", "--resume", str(folder), "--quiet"]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"fedsim: error: {ckpt}: ") and message in lines[0], lines
    assert (folder / "rounds.parquet").read_bytes() == rounds


def _edit_weight(payload: dict, change) -> None:
    """Replace the first weight of the saved global CNN by change(weight), or drop it where that gives None."""
    weights = payload["server_state"]["models"]["cnn"]
    key = next(iter(weights))
    changed = change(weights[key])
    if changed is None:
        del weights[key]
    else:
        weights[key] = changed


def _spilled_store(tmp_path: Path, states: dict[int, dict]) -> ClientStateStore:
    """A store that holds only the latest state in memory; the rest are on disk."""
    store = ClientStateStore(capacity_bytes=1, spill_dir=tmp_path / "spill")
    for cid, st in states.items():
        store.put(cid, st)
    assert store.spills == len(states) - 1
    return store


def test_spilled_states_round_trip_bit_for_bit_with_weights_only(tmp_path):
    states = {c: {"model": _weights(c), "opt": {"step": c, "m": torch.randn(4, dtype=torch.float64)},
                  "idx": np.arange(c + 2, dtype=np.int32), "scores": PersonalScores({c: (0.5, 0.25, 9.0)})}
              for c in range(3)}
    store = _spilled_store(tmp_path, states)
    for cid in (0, 1):  # spilled files load with weights_only=True as they are
        assert isinstance(torch.load(store.spill_dir / f"{cid}.pt", weights_only=True), dict)
    assert all(_same(st, states[cid]) for cid, st in store.items())
    assert _same(store.get(0), states[0]) and _same(store.get(1), states[1]) and store.loads == 2


class _RunsShell:
    """A pickle that runs a shell command when unpickled without weights_only."""

    def __init__(self, command: str) -> None:
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


def test_a_crafted_spill_file_is_never_executed(tmp_path):
    store = _spilled_store(tmp_path, {0: {"w": torch.ones(3)}, 1: {"w": torch.zeros(3)}})
    spilled = store.spill_dir / "0.pt"
    marker = tmp_path / "pwned"
    torch.save({"w": _RunsShell(f"touch {shlex.quote(str(marker))}")}, spilled)
    with pytest.raises(CheckpointError) as err:
        store.get(0)
    text = str(err.value)
    assert text.startswith(f"{spilled}: unreadable spilled state of client 0") and "\n" not in text
    assert not marker.exists()
    with pytest.raises(CheckpointError):
        store.export()
    assert not marker.exists()
    torch.load(spilled, weights_only=False)  # the payload is live: only weights_only kept it out
    assert marker.exists()


def test_a_corrupt_spill_file_is_one_line(tmp_path):
    store = _spilled_store(tmp_path, {0: {"w": torch.ones(3)}, 1: {"w": torch.zeros(3)}})
    (store.spill_dir / "0.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(CheckpointError, match="unreadable spilled state of client 0") as err:
        store.get(0)
    assert "\n" not in str(err.value) and 0 in store  # the state is still accounted for


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o077, 0o600), (0o002, 0o664)])
def test_written_files_get_the_mode_of_a_plain_open(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        atomic_write_text(tmp_path / "table.csv", "a,b\n")
        save_checkpoint(tmp_path / "checkpoints" / "last.pt", {"round": 0})
        with open(tmp_path / "plain.txt", "w") as fh:
            fh.write("x")
    finally:
        os.umask(old)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "table.csv", tmp_path / "checkpoints" / "last.pt",
                                                        tmp_path / "plain.txt")}
    assert modes == {"table.csv": mode, "last.pt": mode, "plain.txt": mode}
    assert not list(tmp_path.rglob(".*.tmp"))


def test_cluster_config_keeps_the_dashboard_private_and_requires_a_token():
    cfg = yaml.safe_load((ROOT / "ray_cluster.yaml").read_text())
    head = " ".join(cfg["head_start_ray_commands"])
    workers = " ".join(cfg["worker_start_ray_commands"])
    assert "0.0.0.0" not in head and "--dashboard-host=127.0.0.1" in head
    assert "RAY_AUTH_MODE=token ray start --head" in head and "RAY_AUTH_MODE=token ray start --address" in workers
    assert cfg["file_mounts"].get("~/.ray/auth_token") == "~/.ray/auth_token"


@pytest.mark.parametrize("payload", ["code", "protocol-4 pickle"])
def test_a_crafted_checkpoint_on_resume_is_one_stderr_line_that_names_what_was_refused(finished_run, tmp_path,
                                                                                        payload):
    """torch's own error advises loading with weights_only=False (which would run the file's code), and a plain
    pickle makes it warn over two lines first: neither reaches the user."""
    import pickle

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    checkpoint, marker = run_dir / "checkpoints" / "last.pt", tmp_path / "pwned"
    if payload == "code":
        torch.save({"w": _RunsShell(f"touch {shlex.quote(str(marker))}")}, checkpoint)
    else:
        checkpoint.write_bytes(pickle.dumps({"round": 1}, protocol=4))
    reseal(run_dir)
    # forked after the imports (tests/forked.py): the refusal happens while loading the file, not while importing
    proc = run_module("jobs.cli", ["run", "--resume", str(run_dir), "--quiet"], timeout=300,
                      env={**os.environ, "PYTHONPATH": str(ROOT), "RAY_USAGE_STATS_ENABLED": "0"})
    assert proc.returncode == 2 and len(proc.stderr.splitlines()) == 1, proc.stderr
    assert proc.stderr.startswith(f"fedsim: error: {checkpoint}: unreadable checkpoint: torch's weights-only reader "
                                  "refused it (")
    assert "weights_only" not in proc.stderr and not marker.exists()
    assert ("GLOBAL posix.system" in proc.stderr) if payload == "code" else ("Unsupported operand" in proc.stderr)


@pytest.mark.parametrize("payload, refused", [
    ({"a": np.ones(3)}, "(Unsupported global: GLOBAL numpy._core.multiarray._reconstruct)"),
    ({"a": slice(1, 2)}, "(Unsupported global: GLOBAL slice)"),
    ({"a": _RunsShell("true")}, "(unsupported GLOBAL posix.system)"),
])
def test_what_the_weights_only_reader_refused_is_named_without_its_advice(tmp_path, payload, refused):
    path = tmp_path / "last.pt"
    torch.save(payload, path)
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(path)
    assert str(err.value) == (f"{path}: unreadable checkpoint: torch's weights-only reader refused it {refused}, and "
                              "fedsim reads files no other way")


@pytest.fixture(scope="module")
def other_run(tmp_path_factory) -> Path:
    """Another run (another seed, its own run_id), whose files get copied into `finished_run`'s copies."""
    out = tmp_path_factory.mktemp("other")
    cfg = load_config(ROOT / "configs" / "demo.yaml", ["rounds=2", "data.num_clients=2", "train.epochs=1",
                                                       "participation.clients_per_round=2", "runtime.backend=local",
                                                       f"results.root={out}", "results.run_id=run", "seed=1"])
    return run(cfg, LocalBackend())


def _flip_a_bit_in_a_tensor(path: Path) -> None:
    """Flip one bit in the middle of the checkpoint's largest tensor, where torch.load does not look (the zip's CRCs
    go unchecked): the file still loads."""
    import zipfile

    with zipfile.ZipFile(path) as z:
        info = max((i for i in z.infolist() if "/data/" in i.filename), key=lambda i: i.file_size)
        raw = path.read_bytes()
        name_len, extra_len = (int.from_bytes(raw[info.header_offset + k:info.header_offset + k + 2], "little")
                               for k in (26, 28))
    at = info.header_offset + 30 + name_len + extra_len + info.file_size // 2
    path.write_bytes(raw[:at] + bytes([raw[at] ^ 0x10]) + raw[at + 1:])
    torch.load(path, weights_only=True)  # the damage is silent to torch


def _edit_config(path: Path, **changes) -> None:
    raw = yaml.safe_load(path.read_text())
    raw.update(changes)
    path.write_text(yaml.safe_dump(raw, sort_keys=False))


@pytest.mark.parametrize("damage, culprit, message", [
    ("one flipped bit", "checkpoints/last.pt", "its SHA-256 is not the one in manifest.json (damaged, or replaced"),
    ("another run's checkpoint", "checkpoints/last.pt", "its SHA-256 is not the one in manifest.json"),
    ("another run's checkpoints folder", "checkpoints/manifest.json", "of another run (run_id "),
    ("the started config deleted, the config edited", "checkpoints/config.yaml",
     "missing (the config the run started with, which a resume is checked against); the resume is refused"),
    ("both configs edited", "checkpoints/config.yaml", "its SHA-256 differs from the one in manifest.json"),
    ("no manifest", "checkpoints/manifest.json", "missing, so the run's checkpoints cannot be verified"),
    ("no run.json", "run.json", "missing (the run's identity"),
    ("the manifest lists another round", "checkpoints/last.pt", "holds round 1, and manifest.json records round 0"),
])
def test_a_damaged_or_foreign_checkpoint_is_refused_in_one_line_before_it_loads(finished_run, other_run, tmp_path,
                                                                               capsys, monkeypatch, damage, culprit,
                                                                               message):
    from jobs.cli import main

    folder = tmp_path / "run"
    shutil.copytree(finished_run, folder)
    ckpt = folder / "checkpoints" / "last.pt"
    if damage == "one flipped bit":
        _flip_a_bit_in_a_tensor(ckpt)
    elif damage == "another run's checkpoint":
        shutil.copy(other_run / "checkpoints" / "last.pt", ckpt)
    elif damage == "another run's checkpoints folder":
        shutil.rmtree(folder / "checkpoints")
        shutil.copytree(other_run / "checkpoints", folder / "checkpoints")
    elif damage == "the started config deleted, the config edited":
        (folder / "checkpoints" / "config.yaml").unlink()
        _edit_config(folder / "config.yaml", seed=7)
    elif damage == "both configs edited":
        for name in ("config.yaml", "checkpoints/config.yaml"):
            _edit_config(folder / name, seed=7)
    elif damage == "no manifest":
        (folder / "checkpoints" / "manifest.json").unlink()
    elif damage == "no run.json":
        (folder / "run.json").unlink()
    else:
        reseal(folder, round=0)
    before = {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    loads = []
    real_load = torch.load
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a) or real_load(*a, **k))
    assert main(["run", "--resume", str(folder), "--quiet"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"fedsim: error: {folder / culprit}: ") and message in err and err.count("\n") == 1, err
    assert loads == ([] if "round" not in damage else [(ckpt,)])  # nothing loaded before the manifest said yes
    assert {p: p.read_bytes() for p in folder.rglob("*") if p.is_file()} == before


def test_a_save_killed_before_its_rename_leaves_a_checkpoint_the_manifest_vouches_for(tmp_path, monkeypatch):
    """The manifest lists the new file beside the old before the rename, and alone after: a run killed between the
    two writes, or in the rename, is still resumable."""
    import fedsim.persist.io
    from fedsim.persist.checkpoint import read_manifest, save_run_checkpoint, start_manifest, verify_checkpoint

    folder = tmp_path / "checkpoints"
    folder.mkdir()
    (folder / "config.yaml").write_text("seed: 0\n")
    start_manifest(folder, "id", 0, "config.yaml")
    assert verify_checkpoint(folder, read_manifest(folder)) is None
    save_run_checkpoint(folder / "last.pt", {"round": 0, "w": torch.zeros(3)}, 0)
    assert verify_checkpoint(folder, read_manifest(folder)) == 0

    real_replace = os.replace

    def killed(src, dst):  # the checkpoint's rename, after the manifest listed it; the manifest's own renames go on
        if str(dst).endswith("last.pt"):
            raise KeyboardInterrupt
        real_replace(src, dst)

    monkeypatch.setattr(fedsim.persist.io.os, "replace", killed)
    with pytest.raises(KeyboardInterrupt):
        save_run_checkpoint(folder / "last.pt", {"round": 1, "w": torch.ones(3)}, 1)
    monkeypatch.undo()
    assert [e["round"] for e in read_manifest(folder)["checkpoints"]] == [0, 1]
    assert verify_checkpoint(folder, read_manifest(folder)) == 0  # the old file, still vouched for
    save_run_checkpoint(folder / "last.pt", {"round": 1, "w": torch.ones(3)}, 1)
    assert [e["round"] for e in read_manifest(folder)["checkpoints"]] == [1]
    assert verify_checkpoint(folder, read_manifest(folder)) == 1
