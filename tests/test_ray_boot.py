"""Ray's background start (actors/boot.py): an address where no cluster listens is refused in one line at once,
where Ray itself would retry it for many minutes."""

import os
import socket
import subprocess
import sys

import pytest

from actors.boot import check_reachable
from fedsim.errors import ConfigError
from tests.conftest import ROOT
from tests.forked import run_module


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # free once the socket closes: nothing listens there


def test_an_address_where_nothing_listens_is_refused_naming_the_knob(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = _closed_port()
    with pytest.raises(ConfigError, match=rf"runtime.ray_address=127.0.0.1:{port}: no Ray cluster answers there"):
        check_reachable(f"127.0.0.1:{port}")
    monkeypatch.setenv("RAY_ADDRESS", f"127.0.0.1:{port}")
    with pytest.raises(ConfigError, match=rf"^RAY_ADDRESS=127.0.0.1:{port}: no Ray cluster"):
        check_reachable(None)


@pytest.mark.parametrize("address", ["nohost", "127.0.0.1:", ":6379", "host:port"])
def test_a_malformed_address_is_refused(monkeypatch, address):
    with pytest.raises(ConfigError, match="expected host:port"):
        check_reachable(address)


def _probed(server: socket.socket) -> bool:
    """Whether a connection reached `server` (the probe connects and closes at once)."""
    try:
        server.accept()[0].close()
        return True
    except TimeoutError:
        return False


def test_a_listening_address_and_the_keywords_pass(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(5)
        check_reachable(f"127.0.0.1:{server.getsockname()[1]}")
        assert _probed(server)
        check_reachable(f"ray://127.0.0.1:{server.getsockname()[1]}")
        assert _probed(server)
        server.settimeout(0.2)
        for address in (None, "auto", "local", "anyscale://head"):
            check_reachable(address)  # Ray's own forms are left to Ray: nothing is probed
        assert not _probed(server)


def test_an_ipv6_address_is_probed_without_its_brackets(monkeypatch):
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        server.settimeout(5)
        port = server.getsockname()[1]
        check_reachable(f"[::1]:{port}")
        assert _probed(server)
        check_reachable(f"ray://[::1]:{port}")
        assert _probed(server)
    with socket.socket(socket.AF_INET6) as closed:
        closed.bind(("::1", 0))
        port = closed.getsockname()[1]  # free once the socket closes: nothing listens there
    with pytest.raises(ConfigError, match=rf"runtime.ray_address=\[::1\]:{port}: no Ray cluster answers there"):
        check_reachable(f"[::1]:{port}")


def test_a_ray_client_address_where_nothing_listens_is_refused_at_once(monkeypatch):
    """Ray Client waits about 30 s for an address where nothing listens, then warns over several lines."""
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    port = _closed_port()
    with pytest.raises(ConfigError, match=rf"runtime.ray_address=ray://127.0.0.1:{port}: no Ray cluster answers"):
        check_reachable(f"ray://127.0.0.1:{port}")
    with pytest.raises(ConfigError, match="expected host:port"):
        check_reachable("ray://head")


def test_fedsim_run_with_an_unreachable_cluster_fails_in_one_line(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text(f"data: {{name: digits, num_clients: 4}}\nrounds: 1\nresults: {{root: {tmp_path / 'r'}}}\n")
    port = _closed_port()
    out = run_module("jobs.cli", ["run", str(cfg), "--quiet", "-o", "runtime.backend=ray",
                                  "-o", f"runtime.ray_address=127.0.0.1:{port}"],
                     env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT, "RAY_USAGE_STATS_ENABLED": "0"})
    assert out.returncode == 2, out.stderr[-2000:]
    assert out.stderr.strip().splitlines() == [
        f"fedsim: error: runtime.ray_address=127.0.0.1:{port}: no Ray cluster answers there (Connection refused)"]
    assert not (tmp_path / "r").exists()


def test_a_failure_inside_ray_init_reaches_the_waiting_thread_as_one_line(monkeypatch):
    import actors.boot as boot

    def broken(address, runtime_env=None):
        raise RuntimeError("the runtime_env's py_modules package is over the 100 MiB limit\n  (details)")

    import ray

    shutdowns: list[bool] = []
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(boot, "init_ray", broken)
    monkeypatch.setattr(ray, "is_initialized", lambda: False)  # as in a fresh driver, whatever Ray this session runs
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(True))  # and this session's Ray left alone
    started = boot.RayBoot(None)
    line = "starting Ray failed: RuntimeError: the runtime_env's py_modules package is over the 100 MiB limit"
    with pytest.raises(boot.FedsimError, match=f"^{line}$"):
        started.wait(60)
    started.stop(60)
    started.stop(60)  # again: nothing left to stop
    assert shutdowns == [True]  # the half-started Ray is shut down once


OWN_START = """
import ray
from actors.boot import RayBoot, started_here
boot = RayBoot(None)
boot.wait(300)
print(started_here(), ray.is_initialized())
boot.stop(300)
print(started_here(), ray.is_initialized())
"""


@pytest.mark.ray
def test_a_runs_own_local_ray_starts_and_stops_without_rays_start_up_notices(tmp_path):
    """Ray 2.60 says on every local start that it turned token authentication on, and (started outside the main
    thread) that it left SIGTERM alone: neither concerns a run, whose output is its own lines. The start is known
    as the run's own while it lasts."""
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    env |= {"RAY_USAGE_STATS_ENABLED": "0", "HOME": str(tmp_path), "PYTHONPATH": ROOT}  # Ray's token: written there
    out = subprocess.run([sys.executable, "-c", OWN_START], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.splitlines() == ["True True", "False False"]
    assert out.stderr == ""


def test_only_the_ray_that_init_ray_started_counts_as_started_here(monkeypatch):
    """A Ray started by someone else, or a cluster joined after the run's own Ray was shut down, is not the run's:
    there the autoscaler is waited for (actors/autoscale.py)."""
    from types import SimpleNamespace

    import ray

    from actors import boot

    gcs = {"address": "10.0.0.1:6379"}
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(gcs_address=gcs["address"]))
    monkeypatch.setattr(boot, "_own_gcs", None)
    assert not boot.started_here()
    monkeypatch.setattr(boot, "_own_gcs", "10.0.0.1:6379")
    assert boot.started_here()
    gcs["address"] = "10.0.0.2:6379"
    assert not boot.started_here()


def test_ray_clients_timeout_warning_does_not_repeat_the_one_line_error():
    """`ray://` to a server that accepts but never answers: ray.init raises after ~30 s (reported in one line), and
    Ray Client's two-line warning just before it is dropped; other warnings from there still show."""
    import warnings

    from actors.boot import drop_client_timeout_warning

    with warnings.catch_warnings(record=True) as shown:
        drop_client_timeout_warning()  # as Ray's start does
        for message in ("Ray Client connection timed out. Ensure that the Ray Client port on the head node is "
                        "reachable", "something else"):
            warnings.warn_explicit(message, UserWarning, "worker.py", 335, module="ray.util.client.worker",
                                   registry={})
    assert [str(w.message) for w in shown] == ["something else"]
