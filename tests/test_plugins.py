"""User plugins: a config's `plugins` import the user's own module on the driver and on Ray workers, its state
checkpoints and resumes through its own registration, and bad plugin input is one line naming the entry."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import yaml

import fedsim
from fedsim import plugins, registry
from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from jobs.cli import main
from tests.conftest import ROOT, free_port
from tests.forked import run_module
from tests.runtime.test_loop import deterministic

EXAMPLE = Path(ROOT) / "examples" / "my_method.yaml"
FAST = ["rounds=2", "data.num_clients=8", "participation.clients_per_round=4"]


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    """`fedsim ...` in a process whose working directory is `cwd`, with nothing but fedsim on the path: forked after
    the imports (tests/forked.py), where no plugin is imported or registered, as in a fresh process."""
    env = {**os.environ, "PYTHONPATH": ROOT, "RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}
    return run_module("jobs.cli", args, cwd=cwd, env=env, timeout=600)


def _run_args(results: Path, *overrides: str) -> list[str]:
    return [str(EXAMPLE), "--quiet", *(a for o in [*FAST, f"results.root={results}", *overrides] for a in ("-o", o))]


def test_example_plugin_runs_on_the_local_backend(isolated, tmp_path, capsys):
    assert "my_method" not in sys.modules
    assert main(["run", *_run_args(tmp_path, "results.run_id=local"), "--backend", "local"]) == 0
    res = load(tmp_path / "local")
    rounds = res["rounds"]
    assert list(rounds["round"]) == [0, 1] and rounds["accuracy"].notna().all()
    assert (rounds["train/velocity_norm"] > 0).all()  # the plugin's own server step ran
    saved = yaml.safe_load((tmp_path / "local" / "config.yaml").read_text())
    assert saved["plugins"] == [str(EXAMPLE.with_suffix(".py"))] and saved["algorithm"]["name"] == "my_fedavgm"


def test_resume_rebuilds_plugin_state_through_its_registration(isolated, tmp_path):
    run_dir = tmp_path / "res" / "resumed"
    first = _cli("run", *_run_args(tmp_path / "res", "results.run_id=resumed", "runtime.backend=local"), cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoint = run_dir / "checkpoints" / "last.pt"
    # Loading the checkpoint where the plugin is not registered (this process, its registries as `isolated` keeps
    # them: the run was another process's) imports nothing: the class is refused by name.
    from fedsim.errors import CheckpointError

    assert "my_method" not in sys.modules
    with pytest.raises(CheckpointError, match="my_method:MomentumState") as refused:
        load_run_checkpoint(checkpoint)
    assert "plugins" in str(refused.value) and "my_method" not in sys.modules
    config = run_dir / "config.yaml"
    config.write_text(config.read_text().replace("rounds: 2", "rounds: 3"))
    resumed = _cli("run", "--resume", str(run_dir), "--quiet", cwd=tmp_path)
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    rounds = load(run_dir)["rounds"]
    assert list(rounds["round"]) == [0, 1, 2]
    fresh = _cli("run", *_run_args(tmp_path / "res", "results.run_id=straight", "runtime.backend=local",
                                   "rounds=3"), cwd=tmp_path)
    assert fresh.returncode == 0, fresh.stderr[-2000:]
    pd_equal(deterministic(rounds), deterministic(load(tmp_path / "res" / "straight")["rounds"]))


def pd_equal(a, b) -> None:
    import pandas as pd

    pd.testing.assert_frame_equal(a, b)


def test_checkpointed_plugin_state_names_its_class(isolated, tmp_path):
    """The checkpoint of a plugin's run holds its registered dataclass, and loads where the plugin is registered."""
    cfg = load_config(EXAMPLE, [*FAST, "runtime.backend=local", f"results.root={tmp_path}", "results.run_id=c"])
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import run

    run(cfg, LocalBackend())
    state = load_run_checkpoint(tmp_path / "c" / "checkpoints" / "last.pt")["server_state"]
    assert type(state).__module__ == "my_method" and type(state).__name__ == "MomentumState"
    assert set(state.velocity) == {"cnn"}


def _write(folder: Path, name: str, text: str) -> Path:
    path = folder / name
    path.write_text(text)
    return path


PLAIN = "rounds: 1\nalgorithm: {name: fedavg}\n"
REGISTERS = ("from fedsim.models.registry import register_model\n"
             "register_model('{name}')(lambda **kw: None)\n")


@pytest.mark.parametrize("entry, files, message", [
    ("nope", {}, "plugins: no module 'nope': not beside the config"),
    ("gone.py", {}, "plugins: 'gone.py': no such .py file or package folder"),
    ("broken", {"broken.py": "x = 1\ny = 1 / 0\n"},
     "plugins: '{d}/broken.py' failed to import: broken.py line 2: ZeroDivisionError: division by zero"),
    ("typo.py", {"typo.py": "def f(:\n"}, "plugins: '{d}/typo.py' failed to import: typo.py line 1: SyntaxError"),
    ("quiet", {"quiet.py": "X = 1\n"}, "plugins: '{d}/quiet.py' registers nothing; decorate"),
    ("clash", {"clash.py": "from fedsim.method import register_algorithm\n"
                           "from fedsim.algorithms.fedavg import FedAvg\n"
                           "@register_algorithm\nclass Mine(FedAvg):\n    name = 'fedavg'\n"},
     "plugins: '{d}/clash.py' registers algorithm 'fedavg', which fedsim already has"),
    ("json.py", {"json.py": REGISTERS.format(name="j")}, "module name 'json' is already taken by"),
    ("bad-name.py", {"bad-name.py": REGISTERS.format(name="b")}, "'bad-name' is not a valid Python module name"),
])
def test_bad_plugins_are_one_line_naming_the_entry(isolated, tmp_path, capsys, entry, files, message):
    for name, text in files.items():
        _write(tmp_path, name, text)
    config = _write(tmp_path, "c.yaml", PLAIN + f"plugins: [{entry}]\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert message.format(d=tmp_path) in str(err.value) and "\n" not in str(err.value)
    assert main(["run", str(config), "--backend", "local"]) == 2
    err_lines = capsys.readouterr().err.strip().splitlines()
    assert len(err_lines) == 1 and err_lines[0].startswith("fedsim: error: plugins:")
    from fedsim.method.contract import get_algorithm

    assert get_algorithm("fedavg").__module__ == "fedsim.algorithms.fedavg"  # a failed plugin leaves no trace


def test_plugins_key_shapes(isolated, tmp_path):
    with pytest.raises(ConfigError, match="plugins: expected a list"):
        load_config(_write(tmp_path, "c.yaml", PLAIN + "plugins: my_method\n"))
    package = tmp_path / "pkg_plugin"
    package.mkdir()
    _write(package, "__init__.py", REGISTERS.format(name="pkg_model"))
    cfg = load_config(_write(tmp_path, "p.yaml", PLAIN + "plugins: [pkg_plugin]\nmodel: {name: cnn}\n"))
    assert cfg.plugins == [str(package)] and "model pkg_model" in registry.registered_by("pkg_plugin")
    assert plugins.shipped_paths(cfg.plugins) == [str(package)]
    again = load_config(_write(tmp_path, "q.yaml", PLAIN + f"plugins: [{package}]\n"))  # loaded once, kept
    assert again.plugins == [str(package)]


def test_an_installed_module_is_a_plugin_by_name(isolated, tmp_path, monkeypatch):
    site = tmp_path / "site"
    site.mkdir()
    _write(site, "installed_plugin.py", REGISTERS.format(name="installed_model"))
    monkeypatch.syspath_prepend(str(site))
    configs = tmp_path / "configs"
    configs.mkdir()
    cfg = load_config(_write(configs, "c.yaml", PLAIN + "plugins: [installed_plugin]\n"))
    assert cfg.plugins == ["installed_plugin"] and plugins.shipped_paths(cfg.plugins) == []


SUBMIT = """
import sys, time
from ray.job_submission import JobStatus, JobSubmissionClient
address, root, entrypoint = sys.argv[1:]
end, job = time.time() + 500, None
while job is None:
    try:  # the dashboard and its job agent take a while to come up
        client = JobSubmissionClient(address)
        job = client.submit_job(entrypoint=entrypoint, runtime_env={
            "working_dir": root, "excludes": [".venv", "results", ".git", "*.pt", ".pytest_cache"],
            "env_vars": {"RAY_USAGE_STATS_ENABLED": "0", "OMP_NUM_THREADS": "1"}})
    except Exception:
        if time.time() > end:
            raise
        time.sleep(2)
status = client.get_job_status(job)
while status not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED} and time.time() < end:
    time.sleep(1)
    status = client.get_job_status(job)
print(status)
if status != JobStatus.SUCCEEDED:
    print(client.get_job_logs(job)[-3000:])
"""


def _listening(port: int, head: subprocess.Popen, timeout_s: float = 120) -> None:
    """Wait until something accepts on 127.0.0.1:port (the head's GCS), or fail if the head exits first."""
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        assert head.poll() is None, "ray start --head exited"
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
            return
        time.sleep(0.2)
    raise AssertionError(f"the head's GCS did not listen on port {port} within {timeout_s:g} s")


@pytest.mark.ray
@pytest.mark.slow
def test_a_submitted_job_ships_the_plugin_to_its_two_workers_and_gives_the_local_numbers(isolated, tmp_path):
    """On a Ray head with 2 CPUs, a job submitted with --working-dir (whose workers see the repository root, not
    examples/) gets the plugin to its two workers through the job's py_modules, and gives the local backend's
    numbers. (A driver that joins a running cluster itself: tests/test_sweep.py's bucket sweep.)"""
    ray_bin = Path(sys.executable).parent / "ray"
    temp = tempfile.mkdtemp(prefix="fsplug", dir="/tmp")  # Ray's socket paths must stay under 107 bytes
    env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled", "PYTHONPATH": ROOT}
    gcs, dash, agent, agent_grpc, metrics, env_agent, client_port = (free_port() for _ in range(7))
    head = subprocess.Popen([str(ray_bin), "start", "--head", "--block", f"--port={gcs}", "--num-cpus=2",
                             "--dashboard-host=127.0.0.1", f"--dashboard-port={dash}", "--include-dashboard=true",
                             f"--temp-dir={temp}",
                             f"--dashboard-agent-listen-port={agent}", f"--dashboard-agent-grpc-port={agent_grpc}",
                             f"--metrics-export-port={metrics}", f"--runtime-env-agent-port={env_agent}",
                             f"--ray-client-server-port={client_port}"], env=env, start_new_session=True,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        _listening(gcs, head)  # `ray start` returns at once: on a loaded machine the GCS listens seconds later
        entrypoint = " ".join([sys.executable, "-m", "jobs.run", "examples/my_method.yaml", "--quiet",
                               *(a for o in [*FAST, f"results.root={tmp_path}", "results.run_id=submitted",
                                             "runtime.startup_timeout_s=300"] for a in ("-o", o))])
        submitted = subprocess.run([sys.executable, "-c", SUBMIT, f"http://127.0.0.1:{dash}", ROOT, entrypoint],
                                   env={**env, "PYTHONPATH": ""}, capture_output=True, text=True, timeout=600,
                                   cwd=tmp_path)
        assert "SUCCEEDED" in submitted.stdout, (submitted.stdout + submitted.stderr)[-3000:]
    finally:
        # `ray start` alone gets the SIGTERM and stops its node in order (2.5 s); a SIGTERM to its whole process
        # group reached every daemon at once, and the node then took 33 s to go
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(timeout=60)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)  # whatever of the node outlived it
        shutil.rmtree(temp, ignore_errors=True)
    assert main(["run", *_run_args(tmp_path, "results.run_id=local"), "--backend", "local"]) == 0
    local = deterministic(load(tmp_path / "local")["rounds"])
    on_ray = load(tmp_path / "submitted")
    assert on_ray["meta"]["backend"] == "RayBackend" and len(on_ray["meta"]["placement"]) == 2
    assert len({p["pid"] for p in on_ray["meta"]["placement"]}) == 2
    pd_equal(deterministic(on_ray["rounds"]), local)
    # the job's plugin was Ray's temporary copy (…/_ray_pkg_<hash>/examples/my_method.py); one plugin from two
    # folders is one setting, compared by module and SHA-256
    submitted_path = load(tmp_path / "submitted")["config"]["plugins"][0]
    assert "_ray_pkg_" in submitted_path and not Path(submitted_path).exists()  # gone with the head's temp folder
    collected = fedsim.collect([tmp_path / r for r in ("submitted", "local")])
    assert collected["config.plugins"].nunique() == 1
    assert collected["config.plugins"].iloc[0].startswith('["my_method@')
    # resumed from another machine's view: the run folder moved, the user's own copy of the plugin named
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    shutil.copy(EXAMPLE.with_suffix(".py"), elsewhere)
    moved = shutil.move(tmp_path / "submitted", elsewhere / "submitted")
    config = yaml.safe_load((moved / "config.yaml").read_text())
    (moved / "config.yaml").write_text(yaml.safe_dump({**config, "rounds": 3}))  # resume-safe: one round more
    resumed = _cli("run", "--resume", str(moved), "--quiet", "--backend", "local", "--plugins", "my_method.py",
                   cwd=elsewhere)
    assert resumed.returncode == 0, (resumed.stdout + resumed.stderr)[-3000:]
    assert list(load(moved)["rounds"]["round"].unique()) == [0, 1, 2]


def test_the_job_runtime_env_carries_every_plugin_once_and_keeps_a_submitted_jobs_modules(isolated, tmp_path,
                                                                                            monkeypatch):
    from actors.plugins import JOB_CONFIG_VAR, OVERRIDE_VAR, job_runtime_env

    one = load_config(EXAMPLE, ["runtime.backend=local"])
    assert job_runtime_env(load_config(None, [])) is None  # nothing to ship
    assert job_runtime_env(one, one) == {"py_modules": [str(EXAMPLE.with_suffix(".py"))]}
    monkeypatch.setenv(OVERRIDE_VAR, "0")  # restored after the test, whatever the code sets
    monkeypatch.setenv(JOB_CONFIG_VAR, '{"runtime_env": {"working_dir": "gcs://a.zip", "py_modules": ["gcs://m.zip"]}}')
    assert job_runtime_env(one) == {"py_modules": ["gcs://m.zip", str(EXAMPLE.with_suffix(".py"))]}
    assert os.environ[OVERRIDE_VAR] == "1"  # Ray then takes our list, which holds the job's modules too


def test_a_resolved_path_missing_here_loads_rays_copy_of_the_module(isolated, tmp_path, monkeypatch):
    """On a Ray node the driver's absolute path does not exist, but the job's py_modules put a copy of the file on
    the path: the config loads with that copy; a module of that name that is no copy is still refused."""
    copy = tmp_path / "ray_copy"
    copy.mkdir()
    _write(copy, "shipped_plugin.py", REGISTERS.format(name="shipped_model"))
    monkeypatch.syspath_prepend(str(copy))
    gone = "/nonexistent/driver/folder/shipped_plugin.py"
    cfg = load_config(_write(tmp_path, "c.yaml", PLAIN + f"plugins: [{gone}]\n"))
    assert cfg.plugins == [gone] and sys.modules["shipped_plugin"].__file__ == str(copy / "shipped_plugin.py")
    with pytest.raises(ConfigError, match="no such .py file or package folder"):
        load_config(_write(tmp_path, "d.yaml", PLAIN + "plugins: [/nonexistent/driver/folder/json.py]\n"))


def test_fedsim_run_resolves_the_plugins_of_a_dict_config_from_the_working_directory(isolated, monkeypatch):
    """A dict (or a RunConfig with overrides) names its plugins as a YAML file does: by absolute path, so a Ray
    job ships them and a resume from elsewhere finds them."""
    from fedsim.api import resolve_config

    monkeypatch.chdir(Path(ROOT) / "examples")
    raw = yaml.safe_load(EXAMPLE.read_text())
    raw["plugins"] = ["my_method"]
    cfg = resolve_config(raw, FAST)
    assert cfg.plugins == [str(Path(ROOT) / "examples" / "my_method.py")]
    again = resolve_config(load_config(None), ["plugins=[my_method.py]", f"algorithm.name={raw['algorithm']['name']}"])
    assert again.plugins == cfg.plugins
