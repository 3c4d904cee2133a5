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
    out = subprocess.run([sys.executable, "-m", "jobs.cli", "run", str(cfg), "--quiet", "-o", "runtime.backend=ray",
                          "-o", f"runtime.ray_address=127.0.0.1:{port}"], cwd=ROOT, capture_output=True, text=True,
                         timeout=300, env={"PATH": "/usr/bin:/bin", "PYTHONPATH": ROOT, "RAY_USAGE_STATS_ENABLED": "0"})
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


def test_a_local_start_asks_for_its_raylet_until_it_is_listed_then_hands_over_to_rays_own_wait(monkeypatch):
    """Ray's wait for a new raylet sleeps a whole second between questions; fedsim polls the node table first and
    lets Ray's call (now answered at once) return the node. A node table that cannot be read changes nothing."""
    from actors import boot

    monkeypatch.setattr(boot, "NODE_POLL_S", 0.0)
    reads, calls = [], []
    tables = [[], [{"NodeID": "other", "Alive": True}], [{"NodeID": "n1", "Alive": False}],
              [{"NodeID": "n1", "Alive": True}]]

    def connect(address: str):
        assert address == "gcs:1"

        def node_table() -> list[dict]:
            reads.append(1)
            return tables[min(len(reads), len(tables)) - 1]

        return node_table

    def get_node(address: str, node_id: str) -> dict:
        calls.append((address, node_id, len(reads)))
        return {"NodeID": node_id}

    assert boot.registered_first(get_node, connect)("gcs:1", "n1") == {"NodeID": "n1"}
    assert calls == [("gcs:1", "n1", 4)]  # asked Ray only once the fourth read listed the node alive

    def unreadable(address: str):
        raise RuntimeError("no GCS client here")

    calls.clear()
    assert boot.registered_first(get_node, unreadable)("gcs:1", "n1") == {"NodeID": "n1"}
    assert len(calls) == 1


def test_rays_own_wait_is_put_back_after_the_start_even_when_it_fails():
    from ray._private import services

    from actors.boot import prompt_local_start

    original = services.get_node
    with pytest.raises(KeyError), prompt_local_start():
        assert services.get_node is not original
        raise KeyError("ray.init failed")
    assert services.get_node is original


def test_a_local_start_skips_the_monitor_and_with_usage_stats_off_the_dashboard_process(monkeypatch):
    from ray._private.node import Node

    from actors.boot import lean_local_start

    monitor, api_server = Node.start_monitor, Node.start_api_server
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    with pytest.raises(KeyError), lean_local_start():
        assert Node.start_monitor is not monitor and Node.start_api_server is not api_server
        raise KeyError("ray.init failed")
    assert (Node.start_monitor, Node.start_api_server) == (monitor, api_server)
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # the dashboard process is what reports them
    with lean_local_start():
        assert Node.start_monitor is not monitor and Node.start_api_server is api_server
    assert Node.start_monitor is monitor


def test_where_usage_stats_cannot_be_read_the_dashboard_process_is_kept(monkeypatch):
    import importlib

    from actors import boot

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    real = importlib.import_module

    def moved(name, *args):
        if "usage" in name:
            raise ImportError(name)
        return real(name, *args)

    assert boot._usage_stats_on() is False  # read where this Ray keeps it
    monkeypatch.setattr(importlib, "import_module", moved)
    assert boot._usage_stats_on() is True


LEAN = """
import psutil, ray
from actors.boot import init_ray, shutdown_ray
init_ray(None)
from ray._private import ray_constants
node = ray._private.worker._global_node
kinds = sorted(node.all_processes)
daemons = [i.process.pid for infos in node.all_processes.values() for i in infos]
@ray.remote
def hello():
    print("hello from a worker")
    return 7
answer = ray.get(hello.remote())
import time; time.sleep(1.5)  # the log monitor's poll
shutdown_ray()
alive = [p for p in daemons if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
print(ray_constants.PROCESS_TYPE_MONITOR in kinds, ray_constants.PROCESS_TYPE_DASHBOARD in kinds,
      ray_constants.PROCESS_TYPE_LOG_MONITOR in kinds, answer, alive)
"""


def test_a_local_ray_of_a_run_runs_tasks_and_forwards_their_output_without_monitor_or_dashboard():
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"} | {"RAY_USAGE_STATS_ENABLED": "0"}
    out = subprocess.run([sys.executable, "-c", LEAN], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "False False True 7 []"
    assert "hello from a worker" in out.stdout + out.stderr


SHUTDOWN = """
import psutil, ray
from actors.boot import shutdown_ray
ray.init(include_dashboard=False, configure_logging=False)  # Ray's own start, monitor included
from ray._private import ray_constants
node = ray._private.worker._global_node
monitor = node.all_processes[ray_constants.PROCESS_TYPE_MONITOR][0].process.pid
daemons = [i.process.pid for infos in node.all_processes.values() for i in infos]
monitor_process = node.all_processes[ray_constants.PROCESS_TYPE_MONITOR][0].process
rays_own, seen = ray.shutdown, []
def shutdown():
    seen.append(monitor_process.poll() is not None)  # the monitor already gone when Ray's shutdown begins
    rays_own()
ray.shutdown = shutdown
shutdown_ray()
alive = [p for p in daemons if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
print(monitor in daemons, seen, ray.is_initialized(), alive)
"""


def test_a_local_ray_with_a_monitor_is_shut_down_whole_the_monitor_stopped_first(tmp_path):
    """Where a Ray was started with its monitor, the monitor is killed before Ray's own shutdown (which would wait
    a second on its SIGTERM handler); every daemon of the node is gone after, and nothing is said about it."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    out = subprocess.run([sys.executable, "-c", SHUTDOWN], capture_output=True, text=True, cwd=ROOT, env=env,
                         timeout=180)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[-2] == "True [True] False []"
    assert "monitor" not in out.stderr.lower() and "autoscaler" not in out.stderr.lower()


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
