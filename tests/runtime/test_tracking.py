"""Live tracking: TensorBoard event files read back, MLflow and W&B through stand-in modules that record every call
(the real libraries are optional installs), a resumed run logging into the same tracking run, every global model's
row reaching the trackers and the user's callbacks, and a missing library failing in one line before the run starts."""

from __future__ import annotations

import json
import struct
import sys
import types
from collections import namedtuple
from pathlib import Path

import pandas as pd
import pytest

import fedsim
from fedsim.errors import MissingExtraError
from fedsim.runtime.callbacks import Callback, RoundRows
from tests.conftest import ROOT


def read_scalars(logdir: Path) -> dict[str, dict[int, float]]:
    """Every scalar of the TensorBoard event files in `logdir`, by tag and step (TFRecord framing, Event protos)."""
    from tensorboardX.proto import event_pb2

    out: dict[str, dict[int, float]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for f in files:
        data, i = f.read_bytes(), 0
        while i < len(data):
            (length,) = struct.unpack("<Q", data[i:i + 8])
            event = event_pb2.Event.FromString(data[i + 12:i + 12 + length])
            i += 12 + length + 4  # length, its crc, the record, its crc
            for value in event.summary.value:
                if value.HasField("simple_value"):
                    out.setdefault(value.tag, {})[event.step] = value.simple_value
    return out


def test_tensorboard_events_hold_every_rounds_metrics(make_config):
    run_dir = fedsim.run(make_config("tracking.tensorboard=true", rounds=2), backend="local")
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    scalars = read_scalars(run_dir / "tensorboard")
    assert list(rounds["round"]) == [0, 1]
    for _, row in rounds.iterrows():
        r = int(row["round"])
        assert scalars["accuracy/cnn"][r] == pytest.approx(row["accuracy"], rel=1e-6)  # float32 in the event
        assert scalars["loss/cnn"][r] == pytest.approx(row["loss"], rel=1e-6)
        assert scalars["participants"][r] == row["participants"] == 4
        assert scalars["bytes_up"][r] == pytest.approx(row["bytes_up"], rel=1e-6)
        assert scalars["virtual_time"][r] == pytest.approx(row["virtual_time"], rel=1e-6)
    assert "round" not in scalars and "model" not in scalars


def fake_mlflow(monkeypatch) -> list[tuple]:
    """A stand-in `mlflow` package (MlflowClient, entities) that records its calls."""
    calls: list[tuple] = []
    experiments: dict[str, str] = {}

    class MlflowClient:
        def __init__(self, tracking_uri=None):
            calls.append(("client", tracking_uri))

        def get_experiment_by_name(self, name):
            return types.SimpleNamespace(experiment_id=experiments[name]) if name in experiments else None

        def create_experiment(self, name):
            experiments[name] = f"exp-{len(experiments)}"
            calls.append(("create_experiment", name))
            return experiments[name]

        def create_run(self, experiment_id, run_name=None, tags=None):
            calls.append(("create_run", experiment_id, run_name))
            return types.SimpleNamespace(info=types.SimpleNamespace(run_id="run-1"))

        def log_batch(self, run_id, metrics=(), params=(), tags=()):
            calls.append(("log_batch", run_id, list(metrics), list(params)))

        def update_run(self, run_id, status=None):
            calls.append(("update_run", run_id, status))

        def set_terminated(self, run_id, status=None):
            calls.append(("set_terminated", run_id, status))

    mlflow, tracking, entities = (types.ModuleType(n) for n in ("mlflow", "mlflow.tracking", "mlflow.entities"))
    tracking.MlflowClient = MlflowClient  # type: ignore[attr-defined]
    entities.Metric = namedtuple("Metric", "key value timestamp step")  # type: ignore[attr-defined]
    entities.Param = namedtuple("Param", "key value")  # type: ignore[attr-defined]
    mlflow.tracking, mlflow.entities = tracking, entities  # type: ignore[attr-defined]
    for name, module in (("mlflow", mlflow), ("mlflow.tracking", tracking), ("mlflow.entities", entities)):
        monkeypatch.setitem(sys.modules, name, module)
    return calls


class StopAfter(Callback):
    def __init__(self, round: int) -> None:
        self.round = round

    def on_round_end(self, round: int, rows: RoundRows) -> bool:
        return round == self.round


def test_mlflow_gets_config_and_every_rounds_metrics_and_a_resume_continues_the_same_run(make_config, monkeypatch):
    calls = fake_mlflow(monkeypatch)
    cfg = make_config("tracking.mlflow.enabled=true", "tracking.mlflow.tracking_uri=file:///tmp/mlruns-test",
                      "tracking.mlflow.experiment=digits", rounds=2)
    run_dir = fedsim.run(cfg, backend="local", callbacks=[StopAfter(0)])
    assert calls[:3] == [("client", "file:///tmp/mlruns-test"), ("create_experiment", "digits"),
                         ("create_run", "exp-0", run_dir.name)]
    params = {p.key: p.value for c in calls if c[0] == "log_batch" for p in c[3]}
    assert params["seed"] == "0" and params["train.lr"] == "0.05" and params["algorithm.name"] == "fedavg"
    assert calls[-1] == ("set_terminated", "run-1", "FINISHED")  # stopped by a callback
    assert json.loads((run_dir / "tracking.json").read_text()) == {"mlflow_run_id": "run-1"}

    calls.clear()
    assert fedsim.run(resume=run_dir, backend="local") == run_dir
    assert ("update_run", "run-1", "RUNNING") in calls and not [c for c in calls if c[0] == "create_run"]
    assert calls[-1] == ("set_terminated", "run-1", "FINISHED")

    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    logged = {}
    for c in calls:
        if c[0] == "log_batch":
            assert c[1] == "run-1"
            logged.update({(m.key, m.step): m.value for m in c[2]})
    row = rounds.set_index("round").loc[1]
    assert logged[("accuracy/cnn", 1)] == row["accuracy"] and logged[("loss/cnn", 1)] == row["loss"]
    assert logged[("virtual_time", 1)] == row["virtual_time"] and logged[("failures", 1)] == 0
    assert {step for _, step in logged} == {1}  # the resumed run logged only the round it ran


def test_wandb_and_user_callbacks_get_every_global_models_row(make_config, monkeypatch):
    calls: list[tuple] = []

    class Run:
        id = "w-1"

        def log(self, data, step=None):
            calls.append(("log", dict(data), step))

        def finish(self, exit_code=None):
            calls.append(("finish", exit_code))

    wandb = types.ModuleType("wandb")
    wandb.init = lambda **kw: calls.append(("init", kw)) or Run()  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "wandb", wandb)

    class Models(Callback):
        seen: list[list[str]] = []

        def on_round_end(self, round: int, rows: RoundRows) -> None:
            self.seen.append([r["model"] for r in rows.rounds])

    cfg = make_config("model.mix={cnn: 5, mlp: 5}", "tracking.wandb.enabled=true", "tracking.wandb.project=p",
                      "tracking.wandb.mode=offline", rounds=2)
    run_dir = fedsim.run(cfg, backend="local", callbacks=[Models()])
    assert Models.seen == [["cnn", "mlp"], ["cnn", "mlp"]]
    (_, init), *logs, finish = calls
    assert init["project"] == "p" and init["mode"] == "offline" and init["name"] == run_dir.name
    assert init["dir"] == str(run_dir) and init["config"]["seed"] == 0 and init["config"]["model.mix.mlp"] == 5
    assert finish == ("finish", 0)
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    assert [step for _, _, step in logs] == [0, 1]
    for _, data, step in logs:
        for _, row in rounds[rounds["round"] == step].iterrows():
            assert data[f"accuracy/{row['model']}"] == row["accuracy"]
        assert data["participants"] == 4
    assert json.loads((run_dir / "tracking.json").read_text()) == {"wandb_run_id": "w-1"}


@pytest.mark.parametrize("library", ["mlflow", "wandb"])
def test_a_missing_tracking_library_is_one_line_naming_its_extra_and_nothing_is_left(library, make_config, tmp_path,
                                                                                       monkeypatch, capsys):
    from jobs.cli import main

    monkeypatch.setitem(sys.modules, library, None)  # `import mlflow` now raises ImportError
    with pytest.raises(MissingExtraError, match=rf'^tracking\.{library}\.enabled needs {library}, which is not '
                       rf'installed: pip install "fedsim-ray\[{library}\]"$'):
        fedsim.run(make_config(f"tracking.{library}.enabled=true"), backend="local")
    code = main(["run", str(Path(ROOT) / "configs" / "demo.yaml"), "--quiet", "--backend", "local",
                 "-o", f"tracking.{library}.enabled=true", "-o", f"results.root={tmp_path / 'results'}"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and f'pip install "fedsim-ray[{library}]"' in err, err
    assert not (tmp_path / "results").exists()
