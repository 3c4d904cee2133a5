"""A sweep's runs as Ray Tune trials: each trial one fedsim run with the share of the cluster its config asks for.

A trial's share is a placement group: for the Ray backend, one bundle per client worker (runtime.num_workers,
1 when unset; runtime.client_cpus and runtime.client_gpus each, fractions allowed) and one for a reserved
server (runtime.server_cpus/server_gpus), the trial itself reserving nothing, like `fedsim run`'s driver; for
the local backend, runtime.threads CPUs (default 1) for the trial that runs everything. Trials run side by
side as the cluster fits them; a failed trial is recorded and the others go on; ASHA stops weak trials early if
asked. Tune keeps its bookkeeping in OUTPUT_DIR/tune, beside the plan of the sweep's runs; OUTPUT_DIR may be a
URI (s3://, gs://, ...), which is Tune's storage_path then. A sweep whose driver died resumes from its runs' own
folders, never from Tune's pickled state (a sweep folder is data: nothing in it is unpickled or imported):
finished runs are reused, interrupted ones continue from their checkpoints (fedsim's own resume), runs stopped
early stay stopped, and the rest start. The plan is the runs' experiments (jobs.cached_runs.run_key: config
content, plugins by SHA-256), so a sweep resumes after its working folder moved.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from fedsim.errors import ConfigError
from fedsim.persist.io import atomic_write_text
from fedsim.persist.storage import Location, StorePath, check_reachable, remove_tree
from fedsim.runtime.callbacks import Callback, RoundRows

EXPERIMENT = "tune"  # the Tune experiment's folder inside the sweep's output folder
PLAN = "fedsim_plan.json"  # beside Tune's state: the runs the sweep was started with, checked by --resume


def trial_bundles(cfg: Any) -> list[dict[str, float]]:
    """The placement-group bundles of one run: first the trial's own (empty for the Ray backend), then its actors'."""
    rt = cfg.runtime
    if rt.backend == "local":
        return [{"CPU": float(rt.threads or 1)}]
    server = [{"CPU": rt.server_cpus, "GPU": rt.server_gpus}] if rt.server_cpus or rt.server_gpus else []
    worker = {"CPU": rt.client_cpus, "GPU": rt.client_gpus}
    return [{}, *server, *[dict(worker) for _ in range(rt.num_workers or 1)]]


def share(config: dict[str, Any]) -> Any:
    """The trial's resources (Tune calls this with the trial's config)."""
    from ray.tune import PlacementGroupFactory

    return PlacementGroupFactory(config["run"]["bundles"])


def trial_dirname(trial: Any) -> str:
    return f"trial_{trial.config['run']['index']:04d}"


class TuneReport(Callback):
    """Reports each evaluated round's metrics (the mean over the round's global models) to Tune, for its
    progress and for ASHA. When ASHA stops the trial inside a report, the run stops after that round, as a
    run stopped by a callback does (tables and checkpoint kept). The last round is reported by the trial
    once its run has returned, so that a stop there cannot cut the run's end short."""

    def __init__(self, metrics: list[str]) -> None:
        self.metrics = metrics
        self.rounds = 0
        self.stopped = False
        self.final: tuple[int, list[dict[str, Any]]] | None = None

    def on_round_end(self, round: int, rows: RoundRows) -> bool:
        self.rounds += 1
        if rows.last:
            self.final = (round, rows.rounds)
            return False
        try:
            report(round, rows.rounds, self.metrics)
        except SystemExit:  # Tune's way of ending a trial it stopped
            self.stopped = True
        return self.stopped


def report(round: int, rows: list[dict[str, Any]], metrics: list[str]) -> bool:
    """tune.report of one round's mean metrics, if the round has any of them (Tune needs them in each report)."""
    import math

    from ray import tune

    values = {}
    for m in metrics:
        seen = [float(r[m]) for r in rows if isinstance(r.get(m), (int, float)) and math.isfinite(r[m])]
        if seen:
            values[m] = sum(seen) / len(seen)
    if len(values) < len(metrics):
        return False
    tune.report({"round": round + 1, **values})
    return True


def trial(config: dict[str, Any]) -> None:
    """One trial: the planned run (reused if a run of the same config finished before), reporting its rounds."""
    spec = config["run"]
    if os.path.isdir(spec["cwd"]):  # Tune starts a trial in its own folder; the sweep's paths are the driver's
        os.chdir(spec["cwd"])
    from fedsim.configure import load_config
    from fedsim.results.tables import load
    from jobs.cached_runs import FINISHED, run_cached

    cfg = load_config(spec["config"], spec["overrides"])
    reporter = TuneReport(spec["metrics"])
    run_dir = run_cached(cfg, spec["fresh"], callbacks=[reporter], resume=spec.get("resume", False))
    if reporter.stopped:  # stopped early: not a finished run, so a later sweep runs it in full
        (run_dir / FINISHED).unlink(missing_ok=True)
    elif reporter.final is not None:
        report(*reporter.final, spec["metrics"])
    elif not reporter.rounds:  # a finished run reused: its rounds, so that Tune sees them as well
        rounds = load(run_dir)["rounds"]
        for r in sorted(rounds["round"].unique()):
            report(int(r), rounds[rounds["round"] == r].to_dict("records"), spec["metrics"])


def scheduler(early_stop: Any, max_rounds: int) -> Any:
    """ASHA on early_stop.metric (None when the sweep stops no trial early)."""
    if early_stop is None:
        return None
    from ray.tune.schedulers import ASHAScheduler

    return ASHAScheduler(time_attr="round", metric=early_stop.metric, mode=early_stop.mode, max_t=max_rounds,
                         grace_period=min(early_stop.grace_rounds, max_rounds),
                         reduction_factor=early_stop.reduction_factor)


def experiment_dir(out_dir: Location) -> Location:
    """out_dir/tune, refused if something other than a folder is there (it is removed and made again)."""
    path = (out_dir.resolve() if isinstance(out_dir, Path) else out_dir) / EXPERIMENT
    if (isinstance(path, Path) and path.is_symlink()) or (path.exists() and not path.is_dir()):
        raise ConfigError(f"--output-dir {out_dir}: {path} is not a folder of a sweep's state")
    return path


def check_replaceable(out_dir: Location) -> None:
    """Refuse, before Ray starts, an out_dir/tune that is not a sweep's bookkeeping: run_trials replaces it."""
    path = experiment_dir(out_dir)
    if path.exists() and not (path / PLAN).is_file():
        raise ConfigError(f"--output-dir {out_dir}: {path} holds no sweep's state ({PLAN} is missing) and a sweep "
                          "replaces that folder; move it or choose another --output-dir")


def make_output_dir(out_dir: Location) -> None:
    """Create the sweep's folder before Ray starts, so a place that refuses it (read-only, /proc, a file's name, a
    bucket out of reach) is one line naming --output-dir rather than a failure inside Tune."""
    if isinstance(out_dir, StorePath):
        check_reachable(out_dir, "--output-dir")
        out_dir.mkdir(parents=True, exist_ok=True)
        return
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
        probe = out_dir / f".fedsim-probe-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as exc:
        raise ConfigError(f"--output-dir {out_dir}: cannot write there ({exc.strerror or type(exc).__name__})") \
            from None


def check_resume(out_dir: Location, specs: list[dict[str, Any]]) -> None:
    """--resume: out_dir must hold the plan of the runs this sweep file gives now (read as JSON, nothing else)."""
    path = experiment_dir(out_dir)
    if not (path / PLAN).is_file():
        raise ConfigError(f"--resume: {path} holds no sweep to resume; start it without --resume")
    runs = planned(path)
    if runs is None:
        raise ConfigError(f"--resume: {path / PLAN} is not a sweep plan (unreadable); start the sweep again without "
                          "--resume (finished runs are reused)")
    if runs != runs_of(specs):
        raise ConfigError(f"--resume: the sweep in {path} ran other runs than this sweep file plans now (or another "
                          "fedsim version planned them); start it again without --resume (finished runs are reused)")


def run_trials(specs: list[dict[str, Any]], out_dir: Location, resume: bool, max_parallel: int | None,
               early_stop: Any, max_rounds: int) -> dict[int, str]:
    """Run every spec as a trial, its run resumed from its folder if `resume` (check_resume first); each trial's
    error line, by index. Tune starts afresh either way: its saved state is pickles, never loaded."""
    from ray import tune

    path = experiment_dir(out_dir)
    remove_tree(path)  # Tune's bookkeeping only: the runs themselves are kept, and reused or resumed
    path.mkdir(parents=True)
    atomic_write_text(path / PLAN, json.dumps(runs_of(specs)) + "\n")
    trials = [{**s, "resume": resume} for s in specs]
    tuner = tune.Tuner(
        tune.with_resources(trial, share), param_space={"run": tune.grid_search(trials)},
        tune_config=tune.TuneConfig(scheduler=scheduler(early_stop, max_rounds),
                                    max_concurrent_trials=max_parallel, trial_dirname_creator=trial_dirname,
                                    reuse_actors=True),  # a trial after another skips the process start
        run_config=tune.RunConfig(name=EXPERIMENT, verbose=1, **tune_storage(out_dir),
                                  failure_config=tune.FailureConfig(max_failures=0, fail_fast=False)))
    results = tuner.fit()
    errors = {}
    for i in range(len(results)):
        r = results[i]
        if r.error is not None:  # the trial's folder names it (its config is not kept when it never reported)
            errors[int(Path(r.path).name.removeprefix("trial_"))] = error_line(r.error)
    return errors


def tune_storage(out_dir: Location) -> dict[str, Any]:
    """The sweep's folder as Tune's storage: an absolute path, or a URI's path on the fsspec filesystem that fedsim
    writes the runs with (any scheme fsspec knows, with the same settings, e.g. AWS_ENDPOINT_URL), through pyarrow."""
    if isinstance(out_dir, Path):
        return {"storage_path": str(out_dir.resolve())}
    from pyarrow.fs import FSSpecHandler, PyFileSystem

    return {"storage_path": out_dir.path, "storage_filesystem": PyFileSystem(FSSpecHandler(out_dir.fs))}


def runs_of(specs: list[dict[str, Any]]) -> list[str]:
    """What identifies a sweep's runs: each one's experiment (jobs.cached_runs.run_key), in order; not the paths of
    its files, so a sweep whose working folder moved is the same sweep."""
    return [s["key"] for s in specs]


def planned(path: Location) -> list[Any] | None:
    """The runs the sweep in `path` was started with (None if it holds no readable plan)."""
    try:
        return json.loads((path / PLAN).read_text())
    except (OSError, ValueError, RecursionError):  # RecursionError: JSON nested past Python's stack
        return None


def error_line(error: BaseException) -> str:
    """'Type: first line' of what a trial raised (the run's own exception, not Ray's wrapping of it)."""
    cause: Any = error
    while getattr(cause, "cause", None) is not None and cause.cause is not cause:
        cause = cause.cause
    text = (str(cause).strip().splitlines() or [""])[0][:300]
    return f"{type(cause).__name__}: {text}"
