"""Shared pytest setup: make the repository root importable so `import fedsim` works without installing."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

ROOT = str(Path(__file__).resolve().parents[1])
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


import os  # noqa: E402

import pytest  # noqa: E402

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")


def _share_the_cores() -> None:
    """Under pytest-xdist, each test process (and what it starts: runs, Ray workers) gets its share of the cores
    as its torch threads: with two processes of two threads each on 2 cores, OpenMP's waiting threads spin on
    cores the other process needs (a DaFKD test took 33 CPU-s beside two busy processes, 13 with passive waits,
    14 alone)."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT", "")
    if workers.isdigit() and int(workers) > 1 and "OMP_NUM_THREADS" not in os.environ:
        os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(workers)))
        import torch

        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


_share_the_cores()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items) -> None:
    """The tests that start Ray come first, in their order. `make test`'s two test processes (pytest-xdist's
    worksteal) take the collection in halves and steal from the far end of a queue, so one process runs the Ray
    tests one after another, beside the other's tests that need no Ray: two Ray tests side by side (each with its
    raylet, agents and workers on 2 cores) slowed each other more, and a module's Ray cluster (test_multinode.py)
    split over both processes was started twice."""
    ray = [item for item in items if item.get_closest_marker("ray")]
    items[:] = ray + [item for item in items if not item.get_closest_marker("ray")]


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ray():
    """The session's local Ray: 2 CPUs and 2 logical GPUs (for placement tests), started unless Ray is up."""
    import ray
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, num_gpus=2, include_dashboard=False, configure_logging=False,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}})
    return ray


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray instance for the session (a test module that needs another Ray starts it again after)."""
    yield start_local_ray()
    import ray
    ray.shutdown()


@pytest.fixture(scope="module")
def s3_server():
    """A local S3-compatible server (moto) with one bucket of its own (moto keeps every server's buckets in one
    process-wide store); s3fs reaches it through AWS_ENDPOINT_URL."""
    server_mod = pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    s3fs = pytest.importorskip("s3fs", reason="s3fs is in the s3 and dev extras")
    port = free_port()
    server = server_mod.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    with pytest.MonkeyPatch.context() as env:
        for key, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                           "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}"}.items():
            env.setenv(key, value)
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(f"fedsim-bucket-{port}")
        yield f"s3://fedsim-bucket-{port}"
        s3fs.S3FileSystem.clear_instance_cache()
    server.stop()


def small_config(tmp_path, *overrides: str, rounds: int = 3):
    """A fast digits config writing into tmp_path."""
    from fedsim.configure import load_config

    base = [f"rounds={rounds}", "name=t", "data.name=digits", "data.num_clients=10",
            "data.partition.alpha=0.5", "data.partition.min_samples=5", "model.name=cnn",
            "participation.clients_per_round=4", "train.epochs=1", "train.batch_size=32",
            "runtime.backend=local", f"results.root={tmp_path / 'results'}"]
    return load_config(None, base + list(overrides))


@pytest.fixture
def make_config(tmp_path):
    return lambda *o, rounds=3: small_config(tmp_path, *o, rounds=rounds)


@pytest.fixture
def one_thread():
    """One torch thread for the test (batched and one-by-one training compared at the same thread count)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def together(monkeypatch) -> list[int]:
    """How many clients each successful call of the batched trainer trained (so a test knows batching really ran)."""
    import fedsim.runtime.batching as batching
    from fedsim.training.batched import train_together

    calls: list[int] = []

    def counted(plans):
        out = train_together(plans)
        calls.append(len(plans))
        return out

    monkeypatch.setattr(batching, "train_together", counted)
    return calls


@pytest.fixture
def isolated():
    """Registries and plugin modules as they were before the test, so a plugin (the example's, which a config
    naming it imports) never leaks into other tests."""
    from fedsim import registry

    for kind in registry.KINDS:
        registry.load_builtins(kind)
    before, modules = registry.snapshot(), set(sys.modules)
    yield
    registry.restore(before)
    for name in set(sys.modules) - modules:
        if name == "my_method" or _plugin_file(getattr(sys.modules[name], "__file__", None) or ""):
            del sys.modules[name]


def _plugin_file(file: str) -> bool:
    """A module a test loaded as a plugin: the example's, or one written under the temporary folder. A clone that
    itself lives under the temporary folder (as CI's does) keeps its own modules: removing them would leave the
    imported functions orphaned, so that Ray pickles them by value."""
    root = Path(ROOT).resolve()
    path = Path(file).resolve() if file else None
    if path is None:
        return False
    if path.is_relative_to(root / "examples"):
        return True
    return path.is_relative_to(Path(tempfile.gettempdir()).resolve()) and not path.is_relative_to(root)


def reseal(run_dir, round: int | None = None) -> None:
    """Make a run folder's checkpoints/manifest.json vouch for its files as they are now, as anyone who can edit the
    folder can (the manifest is a checksum, not a signature): the tests of what lies behind it (a forged checkpoint's
    layout, its fit, plugins named by both configs) reach those checks. `round`: the round recorded for last.pt
    (default: the one recorded before)."""
    import hashlib
    import json

    folder = Path(run_dir) / "checkpoints"
    manifest = json.loads((folder / "manifest.json").read_text())
    digest = {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in ("config.yaml", "last.pt")
              if (folder / name).is_file()}
    manifest["config"]["sha256"] = digest.get("config.yaml", "")
    recorded = manifest["checkpoints"][-1]["round"] if manifest["checkpoints"] else 0
    manifest["checkpoints"] = [{"file": "last.pt", "round": recorded if round is None else round,
                                "sha256": digest["last.pt"]}] if "last.pt" in digest else []
    (folder / "manifest.json").write_text(json.dumps(manifest))
