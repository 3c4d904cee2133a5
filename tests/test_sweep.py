"""Sweeps as Ray Tune trials: search spaces from YAML, each run's share of the cluster, trials side by side with
the numbers of runs made one by one, a failed trial recorded, a sweep in a bucket resumed after its driver was
killed and its working folder moved, a killed run's status, and two runs sharing one Ray."""

from __future__ import annotations

import contextlib
import json
import math
import os
import pickle
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import yaml

from fedsim.errors import ConfigError, ResourceError
from fedsim.runtime.callbacks import Callback
from jobs.cached_runs import run_key
from jobs.sweep import load_sweep, plan
from jobs.sweep_tune import trial_bundles
from tests.conftest import ROOT, small_config
from tests.forked import run_module, start_module
from tests.runtime.test_loop import deterministic

BASE = {"name": "t", "rounds": 2, "model": {"name": "cnn"}, "participation": {"clients_per_round": 4},
        "data": {"name": "digits", "num_clients": 10, "partition": {"alpha": 0.5, "min_samples": 5}},
        "train": {"epochs": 1, "batch_size": 32}, "runtime": {"backend": "local", "threads": 1}}

PLUGIN = "from fedsim.models.registry import register_model\nregister_model('sweep_net')(lambda **kw: None)\n"
STORE_ENV = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION", "AWS_ENDPOINT_URL")


def write_sweep(folder: Path, **sweep) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "base.yaml").write_text(yaml.safe_dump(BASE))
    path = folder / "sweep.yaml"
    path.write_text(yaml.safe_dump({"title": "t", "base": "base.yaml", **sweep}))
    return path


# ---- search spaces ----

def test_grid_and_random_spaces_from_yaml(tmp_path) -> None:
    from fedsim.configure import load_config

    space = {"train.lr": {"loguniform": [0.01, 0.1]}, "train.epochs": {"randint": [1, 3]},
             "model.name": {"choice": ["cnn", "mlp"]}}
    path = write_sweep(tmp_path, seeds=[0, 1], grid={"data.partition.alpha": [0.1, 1.0]}, space=space, samples=3)
    runs = plan(load_sweep(path), path)
    assert len(runs) == 2 * 3 * 2  # grid points × draws × seeds (one arm: the base)
    assert {r["arm"] for r in runs} == {"base"}
    assert [r["grid"]["data.partition.alpha"] for r in runs[::6]] == [0.1, 1.0]
    draws = [r["space"] for r in runs]
    assert draws[0::2] == draws[1::2]  # both seeds of a setting train the same values
    assert len({d["train.lr"] for d in draws[:6]}) == 3 and draws[:6] == draws[6:]  # the grid repeats the draws
    for r in runs:
        d = r["space"]
        assert 0.01 <= d["train.lr"] <= 0.1 and d["train.epochs"] in (1, 2) and d["model.name"] in ("cnn", "mlp")
        cfg = load_config(r["config"], r["overrides"])
        assert (cfg.train.lr, cfg.train.epochs, cfg.model.name) == (d["train.lr"], d["train.epochs"], d["model.name"])
        assert cfg.seed == r["seed"] and cfg.data.partition.alpha == r["grid"]["data.partition.alpha"]
    assert [r["space"] for r in plan(load_sweep(path), path)] == draws  # the same draws every time
    other = write_sweep(tmp_path / "other", seeds=[0], space=space, samples=3, space_seed=1)
    assert [r["space"]["train.lr"] for r in plan(load_sweep(other), other)] != [d["train.lr"] for d in draws[:6:2]]


@pytest.mark.parametrize("sweep, message", [
    ({"space": {"train.lr": {"loguniform": [0, 0.1]}}}, r"space.train.lr.loguniform: low must be > 0"),
    ({"space": {"train.lr": {"normal": [0, 1]}}}, r"space.train.lr: expected one of \{choice"),
    ({"space": {"train.epochs": {"randint": [3, 1]}}}, r"space.train.epochs.randint: low must be below high"),
    ({"space": {"train.epochs": {"randint": [0, 10**20]}}}, r"randint: bounds must lie within 64-bit integers"),
    ({"space": {"train.lr": {"uniform": [-1e308, 1e308]}}}, r"uniform: high - low must be a finite number"),
    ({"space": {"train.lr": {"loguniform": [1e-320, 1]}}}, r"loguniform: low must be > 0 on a log scale"),
    ({"space": {"model.name": {"choice": []}}}, r"space.model.name.choice: expected a non-empty list"),
    ({"samples": 4}, r"samples: 4 draws need a space"),
    ({"grid": {"train.lr": [0.1]}, "space": {"train.lr": {"uniform": [0.1, 0.2]}}}, r"also in grid"),
    ({"early_stop": {"mode": "up"}}, r"early_stop.mode: must be one of \['max', 'min'\]"),
])
def test_a_bad_space_names_its_key(tmp_path, sweep, message) -> None:
    path = write_sweep(tmp_path, **sweep)
    with pytest.raises(ConfigError, match=message):
        plan(load_sweep(path), path)


@pytest.fixture
def nothing_runs(monkeypatch):
    """A sweep that gets as far as starting Ray fails the test: its checks must come first."""
    import jobs.sweep

    def started(configs, always=False):
        raise AssertionError("the sweep started its trials")

    monkeypatch.setattr(jobs.sweep, "ray_session", started)


@pytest.mark.parametrize("sweep, message", [
    ({"seeds": []}, r"sweep.yaml: seeds: expected at least one seed"),
    ({"budgets": [-1, 0]}, r"budgets\[0\]: must be >= 1, got -1"),
    ({"grid": {"train.lr": []}}, r"sweep.yaml: grid.train.lr: expected a non-empty list of values"),
    ({"grid": {"seed": [1, 2]}}, r"sweep.yaml: grid.seed: a sweep sets each run's seed from seeds:"),
    ({"space": {"seed": {"randint": [0, 9]}}}, r"sweep.yaml: space.seed: a sweep sets each run's seed from seeds:"),
    ({"overrides": ["seed=3"]}, r"sweep.yaml: overrides: seed=3: a sweep sets each run's seed from seeds:"),
    ({"metric": "nope"}, r"metric: 'nope' is not a column of rounds.parquet that fedavg records; scores: accuracy"),
    ({"early_stop": {"metric": "nope"}}, r"early_stop.metric: 'nope' is not a column of rounds.parquet"),
    ({"model": "nope"}, r"model: 'nope' is not best, macro or a global model the runs evaluate \(cnn\)"),
    ({"seeds": [0, 1, 0]}, r"sweep.yaml: seeds: 0 is listed twice"),
    ({"arms": [{"name": "a"}, {"name": "a", "overrides": ["train.lr=0.1"]}]}, r"sweep.yaml: arms: 'a' is listed twice"),
    ({"grid": {"train.lr": [0.1, 0.2, 0.1]}}, r"sweep.yaml: grid.train.lr: 0.1 is listed twice"),
    ({"grid": {"name": [{1, 2}]}}, r"sweep.yaml: grid.name: expected plain values \(text, numbers, true/false, null, "
                                   r"lists, mappings\), got \[\{1, 2\}\]"),
    ({"grid": {"train.lr": list(range(1, 101)), "train.epochs": list(range(1, 101))}},
     r"sweep.yaml: 100 grid.train.epochs x 100 grid.train.lr x 2 seeds is 20,000 runs, more than a sweep may plan "
     r"\(10,000\); split it"),
])
def test_a_bad_sweep_file_is_refused_before_any_trial(tmp_path, nothing_runs, sweep, message) -> None:
    from jobs.sweep import run_sweep

    with pytest.raises(ConfigError, match=message):
        run_sweep(write_sweep(tmp_path, **sweep), out_dir=str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_grid_values_reach_the_runs_with_their_type(tmp_path) -> None:
    """A grid value is spelled as JSON in its override, so the run reads back exactly what the sweep file says: a
    quoted "1e-3" stays text, null stays null, and a name with '#' is not cut at a YAML comment."""
    from fedsim.configure import load_config
    from jobs.sweep_space import override

    path = write_sweep(tmp_path, seeds=[0], grid={"name": ["exp #1", "exp #2"], "results.run_id": [None],
                                                  "train.optimizer": ["sgd"]})
    runs = plan(load_sweep(path), path)
    assert [r["overrides"][-4:-1] for r in runs] == [
        [override("name", n), "results.run_id=null", 'train.optimizer="sgd"'] for n in ("exp #1", "exp #2")]
    cfgs = [load_config(r["config"], r["overrides"]) for r in runs]
    assert [(c.name, c.results.run_id) for c in cfgs] == [("exp #1", None), ("exp #2", None)]


def test_a_tune_folder_that_is_no_sweeps_state_is_refused_and_kept(tmp_path, nothing_runs) -> None:
    """A sweep replaces <output-dir>/tune; a folder of that name holding anything else is the user's, never removed."""
    from jobs.sweep import run_sweep

    mine = tmp_path / "out" / "tune" / "mythesis"
    mine.mkdir(parents=True)
    (mine / "chapter1.tex").write_text("kept")
    with pytest.raises(ConfigError, match=r"tune holds no sweep's state \(fedsim_plan.json is missing\)"):
        run_sweep(write_sweep(tmp_path, seeds=[0]), out_dir=str(tmp_path / "out"))
    assert (mine / "chapter1.tex").read_text() == "kept"


def test_an_output_dir_that_cannot_be_made_is_refused_before_ray_starts(tmp_path, nothing_runs) -> None:
    from jobs.sweep import run_sweep

    afile = tmp_path / "afile"
    afile.write_text("kept")
    for out_dir, reason in (("/proc/fedsim-sweep", "No such file or directory"), (afile / "out", "Not a directory")):
        with pytest.raises(ConfigError, match=f"^--output-dir {out_dir}: cannot write there \\({reason}\\)$"):
            run_sweep(write_sweep(tmp_path, seeds=[0]), out_dir=str(out_dir))
    assert afile.read_text() == "kept"


def test_a_table_path_that_cannot_be_written_is_refused_before_any_trial(tmp_path, nothing_runs) -> None:
    from jobs.sweep import run_sweep

    path, out = write_sweep(tmp_path, seeds=[0]), str(tmp_path / "out")
    with pytest.raises(ConfigError, match=f"--out {tmp_path}: is a folder; give the path of the markdown file"):
        run_sweep(path, out=str(tmp_path), out_dir=out)
    with pytest.raises(ConfigError, match=f"--out {tmp_path}/no/t.md: the folder {tmp_path}/no does not exist"):
        run_sweep(path, out=str(tmp_path / "no" / "t.md"), out_dir=out)
    with pytest.raises(ConfigError, match="out: /: is a folder"):
        run_sweep(write_sweep(tmp_path / "in_file", seeds=[0], out="/"), out_dir=out)
    with pytest.raises(ConfigError, match=r"-o seed=5: a sweep sets each run's seed from seeds: in"):
        run_sweep(path, out_dir=out, overrides=["seed=5"])
    assert not (tmp_path / "out").exists()


# ---- a run's share of the cluster ----

def test_a_sweep_folder_may_be_a_uri(tmp_path) -> None:
    """As Tune's storage_path may: the runs go under <uri>/runs, and nothing is written locally."""
    from jobs.sweep import run_sweep

    plan_text = run_sweep(write_sweep(tmp_path, seeds=[0, 1]), dry_run=True, out_dir="memory://bucket/sweep")
    assert plan_text.count("results.root=memory://bucket/sweep/runs") == 2
    assert not (tmp_path / "results").exists()


def test_the_run_key_ignores_where_a_run_goes_but_not_what_it_computes(make_config) -> None:
    base = run_key(make_config())
    where = ("runtime.ray_address=10.0.0.1:6379", "runtime.spill_dir=/tmp/elsewhere", "runtime.startup_timeout_s=9",
             "runtime.autoscale_timeout_s=0", "results.root=/tmp/other", "data.root=/tmp/data")
    assert all(run_key(make_config(o)) == base for o in where)
    assert all(run_key(make_config(o)) != base for o in ("seed=1", "train.lr=0.5", "runtime.exact_sum=false"))


def test_the_run_key_knows_a_plugin_by_its_content_not_its_path(make_config, isolated, tmp_path) -> None:
    here, there, edited = (tmp_path / d / "my_plugin.py" for d in ("here", "there", "edited"))
    for path, text in ((here, PLUGIN), (there, PLUGIN), (edited, PLUGIN + "# edited\n")):
        path.parent.mkdir()
        path.write_text(text)
    cfg = make_config(f"plugins=[{here}]")
    keys = []
    for path in (here, there, edited):
        cfg.plugins = [str(path)]  # a config naming the file there (imported once: one module name)
        keys.append(run_key(cfg))
    assert keys[0] == keys[1] != keys[2]


def test_a_trial_asks_for_what_its_config_reserves(make_config) -> None:
    cfg = make_config("runtime.backend=ray", "runtime.num_workers=2", "runtime.client_gpus=0.5",
                      "runtime.server_cpus=0.5")
    assert trial_bundles(cfg) == [{}, {"CPU": 0.5, "GPU": 0.0}, {"CPU": 1.0, "GPU": 0.5}, {"CPU": 1.0, "GPU": 0.5}]
    assert trial_bundles(make_config("runtime.backend=ray")) == [{}, {"CPU": 1.0, "GPU": 0.0}]  # one worker if unset
    assert trial_bundles(make_config("runtime.threads=2")) == [{"CPU": 2.0}]  # the local backend runs in the trial


def test_a_run_takes_no_more_than_its_config_asks(make_config, monkeypatch) -> None:
    import actors.pool as pool

    cluster, free, group = [{"CPU": 4.0}], [{"CPU": 4.0}], None
    monkeypatch.setattr(pool, "cluster_nodes", lambda: cluster)
    monkeypatch.setattr(pool, "free_nodes", lambda: free)
    monkeypatch.setattr(pool, "group_bundles", lambda: group)
    assert pool.pool_size(make_config()) == 4
    free = [{"CPU": 1.5}]  # another run holds the rest: take what is free
    assert pool.pool_size(make_config()) == 1
    free = [{"CPU": 0.0}]  # nothing free: one worker, which waits for room
    assert pool.pool_size(make_config()) == 1
    assert pool.pool_size(make_config("runtime.num_workers=3")) == 3  # asked: taken as asked, free or not
    with pytest.raises(ResourceError, match="runtime.num_workers=5 but only 4"):
        pool.pool_size(make_config("runtime.num_workers=5"))
    group = [{"CPU": 1.0}, {"CPU": 1.0}]  # a Tune trial's placement group: the group is the share
    assert pool.pool_size(make_config()) == 2
    assert pool.pool_size(make_config("runtime.num_workers=1")) == 1
    with pytest.raises(ResourceError, match="placement group this run is in .* holds 2 workers"):
        pool.pool_size(make_config("runtime.num_workers=3"))


@pytest.mark.ray
@pytest.mark.slow
def test_two_runs_at_once_share_one_ray(ray_local, tmp_path) -> None:
    """A run with a pool of one holds one CPU of two; a run started beside it with no worker count takes the one
    that is free (not the whole cluster, which would wait on the first run), and both finish."""
    from actors.backend import make_backend
    from fedsim.results.tables import load
    from fedsim.runtime.callbacks import Callback
    from fedsim.runtime.loop import run

    started = {"a": threading.Event(), "b": threading.Event()}
    done: dict[str, Path | BaseException] = {}

    class Hold(Callback):
        def __init__(self, me: str, other: str) -> None:
            self.me, self.other = me, other

        def on_setup_end(self, run_info) -> None:
            started[self.me].set()

        def on_round_end(self, round, rows) -> None:
            assert started[self.other].wait(120), f"run {self.other} did not start beside run {self.me}"

    def go(name: str, *overrides: str) -> None:
        cfg = small_config(tmp_path / name, "runtime.backend=ray", "runtime.client_cpus=1",
                           "runtime.startup_timeout_s=120", *overrides, rounds=2)
        try:
            done[name] = Path(run(cfg, make_backend(cfg), callbacks=[Hold(name, "b" if name == "a" else "a")]))
        except BaseException as exc:  # handed to the test's thread
            done[name] = exc
            started[name].set()

    a = threading.Thread(target=go, args=("a", "runtime.num_workers=1"))
    a.start()
    assert started["a"].wait(180)
    b = threading.Thread(target=go, args=("b",))
    b.start()
    a.join(300)
    b.join(300)
    for name in "ab":
        assert isinstance(done[name], Path), done[name]
        assert load(done[name])["rounds"]["round"].max() == 1
    assert load(done["a"])["meta"]["num_workers"] == 1 and load(done["b"])["meta"]["num_workers"] == 1


# ---- sweeps as Tune trials ----

@pytest.fixture(scope="module")
def swept(ray_local, tmp_path_factory):
    """A 6-trial sweep, 2 at a time: two arms that finish (one on each backend) over two seeds, one that fails
    (second, so that its trials reuse the first arm's processes)."""
    from jobs.sweep import run_sweep

    where = tmp_path_factory.mktemp("sweep")
    path = write_sweep(where, seeds=[0, 1], budgets=[1, 2, 5], arms=[
        {"name": "local"},
        {"name": "broken", "overrides": ["data.num_clients=1000"]},
        {"name": "ray", "overrides": ["runtime.backend=ray", "runtime.num_workers=1", "runtime.client_cpus=1",
                                      "runtime.startup_timeout_s=120"]}])
    md = run_sweep(path, out_dir=str(where / "out"), parallel=2)
    return where, path, md


def _trial_spans(out: Path) -> list[tuple[float, float]]:
    """(start, end) of each trial that reported, from Tune's result.json files, each shortened by a second at
    both ends (Tune's timestamps are whole seconds)."""
    spans = []
    for f in sorted((out / "tune").glob("trial_*/result.json")):
        lines = f.read_text().strip().splitlines()
        if lines:
            last = json.loads(lines[-1])
            spans.append((last["timestamp"] - last["time_total_s"] + 1, last["timestamp"] - 1))
    return spans


@pytest.mark.ray
@pytest.mark.slow
def test_one_sweep_runs_trials_side_by_side_records_its_failures_and_leaves_budgets_past_its_rounds_empty(
        swept, tmp_path) -> None:
    """One sweep (the `swept` fixture, a minute of trials) and three checks of it, in one test: a module fixture is
    built again on each pytest-xdist worker that runs a test of it."""
    _trials_side_by_side_give_the_numbers_of_runs_one_by_one(swept, tmp_path)
    _a_failed_trial_is_recorded_and_the_others_finish(swept)
    _budgets_past_the_rounds_run_are_empty(swept)


def _trials_side_by_side_give_the_numbers_of_runs_one_by_one(swept, tmp_path) -> None:
    from fedsim.configure import load_config
    from fedsim.results.tables import load
    from jobs.cached_runs import run_cached

    where, path, _ = swept
    runs = pd.read_parquet(where / "out" / "runs.parquet")
    good = runs[runs["arm"] != "broken"]
    assert len(good) == 4 and (good["status"] == "finished").all()
    spans = _trial_spans(where / "out")
    overlap = max(sum(s < t_end and e > t_start for s, e in spans) for t_start, t_end in spans)
    assert overlap == 2  # two trials at once, never more
    ray_meta = [load(r)["meta"] for r in good[good["arm"] == "ray"]["run"]]
    assert all(m["num_workers"] == 1 for m in ray_meta)  # the pool took the trial's one bundle
    for r in plan(load_sweep(path), path):
        if r["arm"] != "local":  # the ray arm's runs give the local backend's numbers (tests/test_ray.py), so each
            continue  # seed's run on the local backend, alone, is what both its trials must give
        cfg = load_config(r["config"], [*r["overrides"], f"results.root={tmp_path / 'one_by_one'}"])
        alone = load(run_cached(cfg))["rounds"]
        for arm in ("local", "ray"):
            trial = good[(good["arm"] == arm) & (good["seed"] == r["seed"])]["run"].item()
            pd.testing.assert_frame_equal(deterministic(load(trial)["rounds"]), deterministic(alone), obj=arm)


def _a_failed_trial_is_recorded_and_the_others_finish(swept) -> None:
    where, _, md = swept
    runs = pd.read_parquet(where / "out" / "runs.parquet")
    broken = runs[runs["arm"] == "broken"]
    assert (broken["status"] == "failed").all() and broken["best"].isna().all()
    assert broken["error"].str.startswith("ConfigError: data.partition.min_samples: 1000 clients").all()
    assert (runs[runs["arm"] != "broken"]["status"] == "finished").all()
    row = next(line for line in md.splitlines() if line.startswith("| broken |"))
    assert row.endswith("| 0/2 finished, 2 failed |")
    assert "Failed runs:" in md and (where / "out" / "table.md").read_text() == md


def _budgets_past_the_rounds_run_are_empty(swept) -> None:
    where, _, md = swept
    table = pd.read_parquet(where / "out" / "table.parquet").set_index("arm")
    assert table.loc["local", "at_2_mean"] == table.loc["local", "final_mean"]
    assert table.loc["local", "at_2_n"] == 2 and table.loc["local", "at_5_n"] == 0
    assert math.isnan(table.loc["local", "at_5_mean"]) and math.isnan(table.loc["ray", "at_5_mean"])
    head = next(line for line in md.splitlines() if line.startswith("| method |"))
    row = next(line for line in md.splitlines() if line.startswith("| local |"))
    cells = dict(zip(head.strip("|").split("|"), row.strip("|").split("|")))
    assert cells[" acc @ 5 rounds (%) "].strip() == "" and cells[" acc @ 2 rounds (%) "].strip() != ""


@pytest.mark.ray
@pytest.mark.slow
def test_a_sweep_in_a_bucket_killed_mid_trial_resumes_from_its_moved_folder(ray_local, s3_server, isolated,
                                                                          tmp_path) -> None:
    """`fedsim sweep` as a job runs it (the CLI joins the cluster; the store's settings come in the job's runtime env,
    as `ray job submit --runtime-env-json` gives them), its folder in a bucket. Killed mid-trial, it resumes after
    its working folder (sweep file, config, plugin) moved: the finished run is not run again, the killed one goes on
    from its checkpoint, and a changed plan (or plugin) is refused. The method is a plugin's (examples/my_method.py,
    FedAvgM with its server state): its trials import it, and the killed one resumes its state from the checkpoint."""
    import s3fs

    import fedsim
    from jobs.sweep import run_sweep

    # the second run trains 15x longer (seconds a round): the kill comes after its first checkpoint, mid-run
    work = tmp_path / "work"
    write_sweep(work, seeds=[0], grid={"train.epochs": [1, 15]}, overrides=["rounds=2"])
    method = (Path(ROOT) / "examples" / "my_method.py").read_text()
    (work / "my_plugin.py").write_text(method)
    (work / "base.yaml").write_text(yaml.safe_dump({**BASE, "plugins": ["my_plugin.py"],
                                                    "algorithm": {"name": "my_fedavgm", "beta": 0.5}}))
    out = f"{s3_server}/sweep"
    store = s3fs.S3FileSystem(skip_instance_cache=True, use_listings_cache=False)
    runs = f"{out.removeprefix('s3://')}/runs"
    job_env = {"env_vars": {**{k: os.environ[k] for k in STORE_ENV}, "PYTHONPATH": ROOT}}
    env = {**os.environ, "RAY_ADDRESS": ray_local.get_runtime_context().gcs_address, "PYTHONPATH": ROOT,
           "OMP_NUM_THREADS": "1", "RAY_JOB_CONFIG_JSON_ENV_VAR": json.dumps({"runtime_env": job_env})}

    # the first driver: forked after the imports (tests/forked.py), with the job's environment and working folder
    driver = start_module("jobs.cli", ["sweep", "sweep.yaml", "--output-dir", out, "--parallel", "1"], cwd=work,
                          env=env)
    try:
        deadline = time.monotonic() + 240
        while time.monotonic() < deadline and driver.poll() is None:
            done, saved = store.glob(f"{runs}/*/finished.json"), store.glob(f"{runs}/*/checkpoints/last.pt")
            if len(done) == 1 and len(saved) == 2:
                break
            time.sleep(0.1)
        mid_trial = driver.poll() is None and len(done) == 1 and len(saved) == 2
        assert mid_trial, "".join(driver.output())[-3000:]
    finally:
        driver.kill()
        driver.wait()
    finished = Path(done[0]).parent.name
    killed = next(Path(f).parent.parent.name for f in saved if Path(f).parent.parent.name != finished)
    before = {name: store.cat(f"{runs}/{name}/run.json") for name in (finished, killed)}
    stamp = store.cat(f"{runs}/{finished}/finished.json")
    with store.open(f"{runs}/{killed}/rounds.parquet") as f:
        first_round = pd.read_parquet(f).query("round == 0")
    assert not store.exists(f"{runs}/{killed}/finished.json")

    moved = tmp_path / "elsewhere" / "work"
    moved.parent.mkdir()
    work.rename(moved)
    with pytest.raises(ConfigError, match="ran other runs than this sweep file plans now"):
        run_sweep(moved / "sweep.yaml", out_dir=out, resume=True, overrides=["rounds=4"])
    (moved / "my_plugin.py").write_text(method + "# edited\n")
    with pytest.raises(ConfigError, match="ran other runs than this sweep file plans now"):
        run_sweep(moved / "sweep.yaml", out_dir=out, resume=True)
    (moved / "my_plugin.py").write_text(method)
    marker = tmp_path / "pwned"
    store.pipe(f"{out}/tune/tuner.pkl", pickle.dumps(_Touch(marker)))  # crafted: a resume never loads it
    # the resumed driver: forked after the imports (tests/forked.py), with the job's environment and working folder
    resumed = run_module("jobs.cli", ["sweep", "sweep.yaml", "--output-dir", out, "--parallel", "1", "--resume"],
                         cwd=moved, env=env, timeout=300)
    log = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0, log[-3000:]
    assert f"reusing {out}/runs/{finished}" in log and f"resuming {out}/runs/{killed} (killed)" in log
    with store.open(f"{out}/runs.parquet") as f:
        table = pd.read_parquet(f)
    assert (table["status"] == "finished").all() and len(table) == 2 and table["best"].notna().all()
    assert store.cat(f"{runs}/{finished}/finished.json") == stamp  # the finished run was not run again
    assert all(store.cat(f"{runs}/{name}/run.json") == before[name] for name in before)  # nor the killed one anew
    with store.open(f"{runs}/{killed}/rounds.parquet") as f:
        rounds = pd.read_parquet(f)
    assert sorted(rounds["round"].unique()) == [0, 1]
    assert (rounds["train/velocity_norm"] > 0).all()  # the plugin's server step, before the kill and after
    pd.testing.assert_frame_equal(rounds.query("round == 0").reset_index(drop=True),
                                  first_round.reset_index(drop=True))  # kept from before the kill, not trained again
    reported = store.cat(f"{out}/tune/trial_0001/result.json").decode().splitlines()  # Tune's state: in the bucket
    rounds_reported = [json.loads(line)["round"] for line in reported]
    assert rounds_reported[0] > 1 and rounds_reported[-1] == 2  # resumed after round 1 (Tune's rounds count from 1)
    assert not marker.exists()
    assert sorted(fedsim.collect(out)["run"].unique()) == sorted([finished, killed])


class _Touch:
    """Unpickled, it creates a file: a stand-in for a crafted pickle that runs code."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self):
        return Path.touch, (self.path,)


@pytest.fixture
def no_trials(monkeypatch) -> list[dict]:
    """Tune's fit stubbed (no trial runs, nor Ray): one entry per fit."""
    from ray import tune

    import jobs.sweep

    monkeypatch.setattr(jobs.sweep, "ray_session", lambda configs, always=False: contextlib.nullcontext())
    fits: list[dict] = []
    monkeypatch.setattr(tune.Tuner, "fit", lambda self: fits.append({}) or [])
    return fits


def test_resuming_a_sweep_never_unpickles_what_its_folder_holds(tmp_path, no_trials) -> None:
    """Tune's saved state is pickles: a resume reads the sweep's plan (JSON) and its runs' folders instead, so a
    crafted tuner.pkl is never loaded; Tune starts afresh (its fit stubbed here: no trial runs)."""
    import jobs.sweep

    fits = no_trials
    path, out = write_sweep(tmp_path, seeds=[0, 1]), tmp_path / "out"
    jobs.sweep.run_sweep(path, out_dir=str(out))
    marker = tmp_path / "pwned"
    crafted = pickle.dumps(_Touch(marker))
    (out / "tune" / "tuner.pkl").write_bytes(crafted)
    md = jobs.sweep.run_sweep(path, out_dir=str(out), resume=True)
    assert not marker.exists() and (out / "tune" / "tuner.pkl").read_bytes() != crafted and len(fits) == 2
    assert "2 runs did not run" in md and json.loads((out / "tune" / "fedsim_plan.json").read_text())
    for damaged in ("[[", "[" * 100_000 + "]" * 100_000):  # truncated, or nested past Python's stack
        (out / "tune" / "fedsim_plan.json").write_text(damaged)  # one line, before anything starts
        with pytest.raises(ConfigError, match=r"--resume: .*fedsim_plan.json is not a sweep plan \(unreadable\)"):
            jobs.sweep.run_sweep(path, out_dir=str(out), resume=True)
    assert len(fits) == 2


def test_a_killed_run_is_recorded_as_killed_and_collected_from_the_sweep_folder(tmp_path, no_trials) -> None:
    """A run whose process was killed records no status; the sweep, once no trial runs, records 'killed' in its
    meta.json and runs.parquet, and says how to go on. fedsim.collect on the sweep's folder reads its runs/."""
    import fsspec

    import fedsim
    from fedsim.configure import load_config
    from jobs.cached_runs import FINISHED, run_cached
    from jobs.sweep import run_sweep

    path, out = write_sweep(tmp_path, seeds=[0, 1]), tmp_path / "out"
    r = plan(load_sweep(path), path)[0]
    folder = run_cached(load_config(r["config"], [*r["overrides"], f"results.root={(out / 'runs').resolve()}"]),
                        callbacks=[StopAfterFirstRound()])
    (folder / FINISHED).unlink()  # as a trial killed after its first round leaves its run
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({k: v for k, v in meta.items() if k != "status"}))
    md = run_sweep(path, out_dir=str(out))
    assert json.loads((folder / "meta.json").read_text())["status"] == "killed"
    assert pd.read_parquet(out / "runs.parquet")["status"].tolist() == ["killed", "not run"]
    assert "1 runs did not run (the sweep was stopped) and 1 runs were killed: continue with" in md
    assert fedsim.collect(out, incomplete=True)["run"].unique().tolist() == [folder.name]
    store = fsspec.filesystem("memory")
    store.put(str(out), "/sweeps/out", recursive=True)  # the same sweep folder in a store
    try:
        assert fedsim.collect("memory://sweeps/out", incomplete=True)["run"].unique().tolist() == [folder.name]
    finally:
        store.rm("/sweeps", recursive=True)


class StopAfterFirstRound(Callback):
    def on_round_end(self, round, rows) -> bool:
        return True


def test_a_resumed_sweep_continues_its_runs_from_their_folders(tmp_path, capsys) -> None:
    """With resume, a run stopped early stays so, an interrupted one continues from its checkpoint to the tables
    of an uninterrupted run, and one whose saved config is another experiment's is run again from scratch (the
    plugin its config.yaml names is never imported)."""
    from fedsim.results.tables import load
    from jobs.cached_runs import FINISHED, run_cached, run_folder

    whole = deterministic(load(run_cached(small_config(tmp_path / "whole")))["rounds"])
    cfg = small_config(tmp_path / "cut")
    folder = run_folder(cfg)
    run_cached(cfg, callbacks=[StopAfterFirstRound()])
    (folder / FINISHED).unlink()  # as a trial that ASHA stopped leaves it
    assert run_cached(small_config(tmp_path / "cut"), resume=True) == folder
    assert load(folder)["rounds"]["round"].max() == 0 and not (folder / FINISHED).exists()
    meta = json.loads((folder / "meta.json").read_text())
    (folder / "meta.json").write_text(json.dumps({**meta, "status": "interrupted"}))
    capsys.readouterr()
    run_cached(small_config(tmp_path / "cut"), resume=True)
    pd.testing.assert_frame_equal(deterministic(load(folder)["rounds"]), whole)
    assert (folder / FINISHED).is_file() and f"resuming {folder} (interrupted)" in capsys.readouterr().err
    marker, plugin = tmp_path / "pwned", tmp_path / "evil.py"
    plugin.write_text(f"open({str(marker)!r}, 'w').close()\n")
    (folder / FINISHED).unlink()
    saved = yaml.safe_load((folder / "config.yaml").read_text())
    (folder / "config.yaml").write_text(yaml.safe_dump({**saved, "plugins": [str(plugin)]}))
    run_cached(small_config(tmp_path / "cut"), resume=True)
    pd.testing.assert_frame_equal(deterministic(load(folder)["rounds"]), whole)
    assert not marker.exists() and "plugins: []" in (folder / "config.yaml").read_text()
    assert "resuming" not in capsys.readouterr().err


# ---- early stopping ----

def test_a_trial_that_asha_stops_keeps_its_rounds_and_is_not_marked_finished(tmp_path, monkeypatch) -> None:
    """Tune ends a stopped trial inside its report (SystemExit): the run stops after that round, its tables stay,
    and it is not taken for a finished run by a later sweep; an unstopped trial reports every round."""
    from ray import tune
    from ray.tune.schedulers import ASHAScheduler

    from fedsim.configure import load_config
    from fedsim.results.tables import load
    from jobs.cached_runs import FINISHED, run_folder
    from jobs.sweep import EarlyStop
    from jobs.sweep_tune import scheduler, trial

    reports: list[dict] = []

    def fake_report(metrics, stop_at):
        reports.append(metrics)
        if len(reports) == stop_at:
            raise SystemExit(0)

    def spec(*overrides):
        over = ["rounds=3", "name=t", "data.name=digits", "data.num_clients=10", "data.partition.min_samples=5",
                "participation.clients_per_round=4", "train.epochs=1", "runtime.backend=local",
                "runtime.threads=1", f"results.root={tmp_path / 'runs'}", *overrides]
        return {"config": None, "overrides": over, "cwd": str(tmp_path), "fresh": False, "metrics": ["accuracy"]}

    monkeypatch.setattr(tune, "report", lambda m: fake_report(m, stop_at=2))
    trial({"run": spec("seed=0")})
    folder = run_folder(load_config(None, spec("seed=0")["overrides"]))
    assert [r["round"] for r in reports] == [1, 2] and load(folder)["rounds"]["round"].max() == 1
    assert not (folder / FINISHED).exists()
    reports.clear()
    monkeypatch.setattr(tune, "report", lambda m: fake_report(m, stop_at=0))
    trial({"run": spec("seed=1")})
    assert [r["round"] for r in reports] == [1, 2, 3] and all(0 <= r["accuracy"] <= 1 for r in reports)
    assert (run_folder(load_config(None, spec("seed=1")["overrides"])) / FINISHED).is_file()
    assert scheduler(None, max_rounds=3) is None
    assert isinstance(scheduler(EarlyStop(metric="loss", mode="min"), max_rounds=3), ASHAScheduler)


def test_an_interrupted_run_is_continued_only_when_its_checkpoints_can_be_verified(make_config, tmp_path) -> None:
    """A folder without run.json or checkpoints/manifest.json (written before fedsim kept them) would fail its
    resume: the sweep runs it again instead."""
    from fedsim.configure import save_config
    from fedsim.persist.checkpoint import start_manifest
    from jobs.cached_runs import interrupted

    cfg = make_config()
    folder = tmp_path / "run"
    for name in ("config.yaml", "checkpoints/config.yaml"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        save_config(cfg, folder / name)
    for name in ("rounds.parquet", "run.json", "checkpoints/last.pt"):
        (folder / name).write_text("{}")
    start_manifest(folder / "checkpoints", "id", 0, "config.yaml")
    (folder / "meta.json").write_text(json.dumps({"status": "interrupted"}))
    assert interrupted(folder, cfg) == "interrupted"
    for name in ("checkpoints/manifest.json", "run.json"):
        kept = (folder / name).read_text()
        (folder / name).unlink()
        assert interrupted(folder, cfg) is None
        (folder / name).write_text(kept)
