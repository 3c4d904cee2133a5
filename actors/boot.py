"""Ray's start in the background: `ray.init` runs in a thread while the driver imports torch and loads the data,
so a run's start-up costs about what Ray's own does rather than the sum of the two.

This module imports nothing heavy, so that importing it delays nothing; `RayBoot` imports Ray itself in the
calling thread before the background start (see there).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from fedsim.errors import ConfigError, FedsimError

PROBE_TIMEOUT_S = 5.0
NODE_POLL_S = 0.02  # how often a local start asks the GCS whether its raylet has registered
# how long it asks before Ray's own wait (raylet_start_wait_time_s, 30 s) takes over: a raylet that never registers
# delays Ray's error by this, not by another 30 s
NODE_WAIT_S = 5.0

_THREAD_WARNING = "SIGTERM handler is not set"


def drop_client_timeout_warning() -> None:
    """Ray Client warns over two lines when a ray:// cluster does not answer in time, just before ray.init raises;
    that failure is reported in one line ("starting Ray failed: ..."), so the warning would only repeat it."""
    warnings.filterwarnings("ignore", message="Ray Client connection timed out", category=UserWarning,
                            module="ray.util.client")


class _DropThreadWarning(logging.Filter):
    """Ray warns that a `ray.init` outside the main thread leaves SIGTERM alone: that is what fedsim wants."""

    def filter(self, record: logging.LogRecord) -> bool:
        return _THREAD_WARNING not in record.getMessage()


def check_reachable(address: str | None) -> None:
    """A cluster named as host:port (runtime.ray_address, or RAY_ADDRESS when that is unset) must accept a TCP
    connection: Ray itself retries an address where nothing listens for many minutes before it gives up."""
    import os
    import socket

    knob = "runtime.ray_address"
    if address is None:
        address, knob = os.environ.get("RAY_ADDRESS"), "RAY_ADDRESS"
    if not address or address in ("auto", "local"):
        return
    scheme, _, target = address.rpartition("://")
    if scheme not in ("", "ray"):  # Ray's own address forms (anyscale://, ...) are Ray's to check
        return
    host, _, port = target.rpartition(":")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address, [::1]:6379
        host = host[1:-1]
    if not host or not port.isdigit():
        raise ConfigError(f"{knob}={address}: expected host:port (the head's GCS address), ray://host:port (its "
                          "Ray Client server), 'auto' or 'local'")
    try:
        socket.create_connection((host, int(port)), timeout=PROBE_TIMEOUT_S).close()
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise ConfigError(f"{knob}={address}: no Ray cluster answers there ({reason})") from None


def registered_first(get_node: Callable[..., Any], connect: Callable[[str], Callable[[], list[dict]]]
                     ) -> Callable[..., Any]:
    """`get_node(gcs_address, node_id)` that first waits, polling the node table (`connect(gcs_address)()`) every
    NODE_POLL_S, until it lists the node alive: Ray's own wait for a starting raylet asks the GCS once a second (a
    fixed sleep in its C++), so `ray.init` returned up to a second after the raylet had registered. Anything
    unexpected in the polling hands over to Ray's own wait, so the result is always what `get_node` returns."""

    def wait_then_get(*args: Any, **kwargs: Any) -> Any:
        with contextlib.suppress(Exception):
            node_table, node_id = connect(args[0]), args[1]
            deadline = time.monotonic() + NODE_WAIT_S
            while time.monotonic() < deadline and not any(
                    n.get("NodeID") == node_id and n.get("Alive") for n in node_table()):
                time.sleep(NODE_POLL_S)
        return get_node(*args, **kwargs)

    return wait_then_get


def _node_table(gcs_address: str) -> Callable[[], list[dict]]:
    """The GCS's node table, read as `ray._private.services.get_node` reads it (one connection, many reads)."""
    from ray._private import services, state

    nodes = state.GlobalState()
    nodes._initialize_global_state(services._get_gcs_client_options(gcs_address))
    return nodes.node_table


@contextlib.contextmanager
def prompt_local_start() -> Iterator[None]:
    """While Ray starts a local node, its wait for the raylet polls every NODE_POLL_S instead of every second:
    `ray.init` on 2 cores took 2.16-2.17 s, and 1.63-1.73 s with this, in runs where the raylet registered within
    1.1 s (3.16 s against 2.61 s where it took longer). Ray's internals are left as they are where they are not
    the expected ones."""
    try:
        from ray._private import services
    except ImportError:
        yield
        return
    original = getattr(services, "get_node", None)
    if not callable(original):
        yield
        return
    services.get_node = registered_first(original, _node_table)
    try:
        yield
    finally:
        services.get_node = original


def _skip(self: Any, *args: Any, **kwargs: Any) -> None:
    """Stands in for a daemon's start that a run's own Ray does without."""


def _usage_stats_on() -> bool:
    """Whether Ray reports usage stats (where it keeps that answer has moved between releases; unknown: yes)."""
    import importlib

    for where in ("ray._common.usage.usage_lib", "ray._private.usage.usage_lib"):
        with contextlib.suppress(Exception):
            return bool(importlib.import_module(where).usage_stats_enabled())
    return True


@contextlib.contextmanager
def lean_local_start() -> Iterator[None]:
    """While Ray starts a node of this run's own, it starts neither the autoscaler's monitor (a local node has a
    fixed size and nothing to scale) nor, with usage stats off, the headless dashboard process, which then loads
    only the usage-stats module and which `ray.init` waits on until it has published its address. On 2 cores, two
    torch actors were ready 6.81 s after process start instead of 8.79 s (medians of 5 interleaved pairs of `python
    -m bench.ray_floor --start fedsim|ray`). A cluster joined by address is not touched: these start only on a new
    head. Ray's internals are left as they are where they are not the expected ones."""
    try:
        from ray._private.node import Node
    except ImportError:
        yield
        return
    skipped = ["start_monitor"]
    if not _usage_stats_on():
        skipped.append("start_api_server")
    originals = {name: Node.__dict__[name] for name in skipped if callable(Node.__dict__.get(name))}
    for name in originals:
        setattr(Node, name, _skip)
    try:
        yield
    finally:
        for name, original in originals.items():
            setattr(Node, name, original)


def init_ray(address: str | None, runtime_env: dict | None = None) -> None:
    """ray.init with the job's `runtime_env` (the run's plugins, actors/plugins.py), keeping the CLI's SIGTERM
    handler: Ray's own exits the driver mid-round with a crash dump, while the CLI's unwinds like Ctrl-C (tables
    kept, Ray shut down). A local Ray that this call starts is watched by actors/reaper.py, so not even a kill -9
    of the driver leaves its daemons running."""
    import signal

    import ray

    from actors.reaper import watch
    from fedsim.runtime.signals import is_sigterm_handler

    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    ours = in_main and is_sigterm_handler(previous)
    drop_client_timeout_warning()  # here, not at import: a caller's warnings.catch_warnings would undo it
    try:
        with prompt_local_start(), lean_local_start():
            ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False,
                     runtime_env=runtime_env)
    except SystemExit as exc:  # Ray's handler caught a SIGTERM during start-up
        if ours and callable(previous) and exc.code == signal.SIGTERM:
            previous(signal.SIGTERM, None)
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, previous)
    node = getattr(ray._private.worker, "_global_node", None)
    if node is not None and getattr(node, "head", False):  # a local Ray of our own, not a cluster joined
        watch(node.get_session_dir_path())


def shutdown_ray() -> None:
    """`ray.shutdown()`, less the second it spent on the autoscaler's monitor of a node this process started: Ray
    stops the GCS before the monitor, whose SIGTERM handler then reports to the stopped GCS until Ray kills it a
    second later (1.01 s of a 1.34 s shutdown). On a node that is going away the monitor has nothing to hand over,
    so it is killed first."""
    import ray

    with contextlib.suppress(Exception):  # Ray's internals are not the expected ones: its own shutdown, unchanged
        from ray._private import ray_constants

        node = ray._private.worker._global_node
        if node is not None and node.head:
            for info in node.all_processes.get(ray_constants.PROCESS_TYPE_MONITOR, []):
                info.process.kill()
                info.process.wait(timeout=1.0)
    ray.shutdown()


class RayBoot:
    """Starts (or joins) Ray in a background thread as soon as it is made; `wait` hands over when it is up.

    The thread stays parked until `stop`: Ray's daemons are started with PR_SET_PDEATHSIG, which Linux ties to
    the starting *thread*, so they would be killed the moment it ended."""

    def __init__(self, address: str | None, runtime_env: dict | None = None) -> None:
        # Ray's start is the longest path to the first round, so its import (0.3-0.4 s) goes first, alone: done in
        # the thread, it would interleave with the driver's torch import under the GIL and begin `ray.init` about a
        # second later (measured on 2 cores, 8 interleaved pairs: Ray up after 6.26 s against 6.73 s on average)
        try:
            import ray  # noqa: F401
        except ImportError:
            pass  # the thread meets the same error, and `wait` reports it as a failed start
        self.address, self.runtime_env = address, runtime_env
        self.started_ray = False  # set before ray.init: a start interrupted half-way is still shut down
        self.error: BaseException | None = None
        self._up = threading.Event()
        self._release = threading.Event()
        self._thread = threading.Thread(target=self._boot, name="fedsim-ray-boot", daemon=True)
        self._thread.start()

    def _boot(self) -> None:
        worker_log = logging.getLogger("ray._private.worker")
        quiet = _DropThreadWarning()
        worker_log.addFilter(quiet)
        try:
            import ray

            if not ray.is_initialized():
                check_reachable(self.address)
                self.started_ray = True
                init_ray(self.address, self.runtime_env)
        except BaseException as exc:  # handed to the thread that waits
            self.error = exc
        finally:
            worker_log.removeFilter(quiet)
            self._up.set()
        self._release.wait()

    def wait(self, limit: float) -> None:
        """Block until Ray is up (at most `limit` s, runtime.startup_timeout_s); re-raise what stopped it."""
        if not self._up.wait(limit):
            raise FedsimError(f"starting Ray: not up within runtime.startup_timeout_s={limit}")
        if self.error is not None:
            error, self.error = self.error, None
            if isinstance(error, (FedsimError, KeyboardInterrupt, SystemExit)):
                raise error
            lines = str(error).strip().splitlines() or [""]
            raise FedsimError(f"starting Ray failed: {type(error).__name__}: {lines[0].strip()[:300]}") from None

    def stop(self, limit: float) -> None:
        """Shut down the Ray this boot started (after letting a start still under way finish, at most `limit` s);
        a cluster it only joined is left running. Calling it again does nothing."""
        self._up.wait(limit)
        if self.started_ray:
            self.started_ray = False
            shutdown_ray()
        self._release.set()
        self._thread.join(limit)
