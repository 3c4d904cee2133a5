"""Live experiment tracking: every round's metrics streamed to TensorBoard, MLflow or Weights & Biases.

Each tracker is a run callback (fedsim.runtime.callbacks) that `tracking:` in the config turns on; the run's
driver attaches them after the tables and checkpoints. Each logs, at step = the table's `round`, every number of
the round's rows of rounds.parquet: the round's own columns (participants, bytes, virtual time, wall seconds,
the method's `<phase>/<metric>`) under their names, and each global model's (accuracy, loss, ...) as
`<column>/<model>`. MLflow and W&B are optional installs, imported only when turned on; a missing one is a
one-line ConfigError before the run starts. A resumed run logs into the same MLflow or W&B run as before, whose
ids it keeps in `<run folder>/tracking.json`.
"""

from __future__ import annotations

import json
import math
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config.schema import RunConfig, config_to_dict
from fedsim.persist.io import atomic_write_bytes
from fedsim.results.tables import flatten, model_metric
from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo, RunStatus

if TYPE_CHECKING:
    from fedsim.persist.storage import Location

TRACKING_IDS = "tracking.json"
TENSORBOARD_DIR = "tensorboard"


def round_metrics(rows: RoundRows) -> dict[str, float]:
    """The round's finite numbers by tag: round-level columns by name, per-model ones as `<column>/<model>`."""
    out: dict[str, float] = {}
    for row in rows.rounds:
        model = str(row.get("model") or "")
        for key, value in row.items():
            if key in ("round", "model") or isinstance(value, (str, bytes)) or value is None:
                continue
            try:
                number = float(value)
            except (TypeError, ValueError):
                continue
            if not math.isfinite(number):
                continue
            if model_metric(key):
                out[f"{key}/{model}" if model else key] = number
            else:
                out.setdefault(key, number)
    return out


def _require(module: str, key: str) -> Any:
    """Import an optional tracking library, or one line naming the key and the extra that installs it."""
    from fedsim.extras import require

    return require(module, module, key)


def _read_ids(run: RunInfo) -> dict[str, str]:
    """The tracking run ids the run's folder kept ({} when none); only plain strings are taken from the file."""
    try:
        data = json.loads((run.run_dir / TRACKING_IDS).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return {}
    return {k: v for k, v in data.items() if isinstance(k, str) and isinstance(v, str)} if isinstance(data, dict) \
        else {}


def _keep_id(run: RunInfo, key: str, value: str) -> None:
    from fedsim.persist.io import atomic_write_text

    atomic_write_text(run.run_dir / TRACKING_IDS, json.dumps({**_read_ids(run), key: value}, indent=2))


class TensorBoardLogger(Callback):
    """Event files in `<run folder>/tensorboard`, flushed every round (`tensorboard --logdir results`). A run kept in
    a store writes them to a local temporary folder and uploads them after every round (TensorBoard reads
    `s3://`/`gs://` log folders itself), so the events sit beside the run's tables wherever those are."""

    def __init__(self) -> None:
        from tensorboardX import SummaryWriter

        self._writer_class = SummaryWriter
        self.writer: Any = None
        self.local: Path | None = None  # where the writer writes
        self.upload_to: Location | None = None  # the store folder its files are copied to (None: a local run)

    def on_setup_end(self, run: RunInfo) -> None:
        import tempfile

        import yaml

        if isinstance(run.run_dir, Path):
            self.local = run.run_dir / TENSORBOARD_DIR
        else:
            self.local = Path(tempfile.mkdtemp(prefix="fedsim-tensorboard-"))
            self.upload_to = run.run_dir / TENSORBOARD_DIR
        # a resumed run drops the events of rounds it runs again (those after its last checkpoint): TensorBoard
        # applies the new event file's purge step to every file of the folder
        self.writer = self._writer_class(logdir=str(self.local), purge_step=run.first_round or None)
        if run.first_round == 0:
            self.writer.add_text("config", "```\n" + yaml.safe_dump(config_to_dict(run.cfg), sort_keys=False)
                                 + "```", 0)

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        for tag, value in round_metrics(rows).items():
            self.writer.add_scalar(tag, value, round)
        self.writer.flush()
        self._upload()

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        if self.writer is not None:
            self.writer.close()
            self._upload()
        if self.upload_to is not None and self.local is not None:
            import shutil

            shutil.rmtree(self.local, ignore_errors=True)

    def _upload(self) -> None:
        """Copy this run's event files (each written whole, atomically) to the store folder."""
        if self.upload_to is None or self.local is None:
            return
        for f in sorted(self.local.iterdir()):
            atomic_write_bytes(self.upload_to / f.name, f.read_bytes())


_MLFLOW_KEY = re.compile(r"[^A-Za-z0-9_\-. /]")
_MLFLOW_STATUS = {"completed": "FINISHED", "stopped": "FINISHED", "interrupted": "KILLED", "failed": "FAILED"}


class MlflowLogger(Callback):
    """One MLflow run per fedsim run: the flattened config as params, every round's metrics at step = round."""

    def __init__(self, tracking_uri: str | None, experiment: str) -> None:
        _require("mlflow", "tracking.mlflow.enabled")
        from mlflow.entities import Metric, Param
        from mlflow.tracking import MlflowClient

        self._metric, self._param = Metric, Param
        self.client = MlflowClient(tracking_uri=tracking_uri)
        self.experiment = experiment
        self.run_id: str | None = None

    def on_setup_end(self, run: RunInfo) -> None:
        self.run_id = _read_ids(run).get("mlflow_run_id")
        if self.run_id is not None:
            self.client.update_run(self.run_id, status="RUNNING")
            return
        found = self.client.get_experiment_by_name(self.experiment)
        experiment_id = found.experiment_id if found is not None else self.client.create_experiment(self.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=run.run_dir.name,
                                             tags={"fedsim.run_dir": str(run.run_dir)}).info.run_id
        _keep_id(run, "mlflow_run_id", self.run_id)
        config = flatten(config_to_dict(run.cfg))
        params = [self._param(_MLFLOW_KEY.sub("_", k), str(v)[:500]) for k, v in config.items()]
        for i in range(0, len(params), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=params[i:i + 100])

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        assert self.run_id is not None, "on_setup_end starts the MLflow run"
        now = int(time.time() * 1000)
        metrics = [self._metric(_MLFLOW_KEY.sub("_", k), v, now, round) for k, v in round_metrics(rows).items()]
        for i in range(0, len(metrics), 1000):  # and at most 1000 metrics
            self.client.log_batch(self.run_id, metrics=metrics[i:i + 1000])

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        if self.run_id is not None:
            self.client.set_terminated(self.run_id, status=_MLFLOW_STATUS[status])


class WandbLogger(Callback):
    """One W&B run per fedsim run: the flattened config, every round's metrics at step = round."""

    def __init__(self, project: str, entity: str | None, mode: str | None) -> None:
        self.wandb = _require("wandb", "tracking.wandb.enabled")
        self.project, self.entity, self.mode = project, entity, mode
        self.run: Any = None

    def on_setup_end(self, run: RunInfo) -> None:
        kept = _read_ids(run).get("wandb_run_id")
        local = str(run.run_dir) if isinstance(run.run_dir, Path) else None  # W&B's own files go beside the tables
        self.run = self.wandb.init(project=self.project, entity=self.entity, mode=self.mode, name=run.run_dir.name,
                                   dir=local, config=flatten(config_to_dict(run.cfg)), id=kept,
                                   resume="allow" if kept else None)
        if kept is None:
            _keep_id(run, "wandb_run_id", str(self.run.id))

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        self.run.log(round_metrics(rows), step=round)

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        if self.run is not None:
            self.run.finish(exit_code=0 if status in ("completed", "stopped") else 1)


def tracking_callbacks(cfg: RunConfig) -> list[Callback]:
    """The trackers `cfg.tracking` turns on; a missing optional library fails here, before the run starts."""
    t = cfg.tracking
    out: list[Callback] = []
    if t.tensorboard:
        out.append(TensorBoardLogger())
    if t.mlflow.enabled:
        out.append(MlflowLogger(t.mlflow.tracking_uri, t.mlflow.experiment))
    if t.wandb.enabled:
        out.append(WandbLogger(t.wandb.project, t.wandb.entity, t.wandb.mode))
    return out
