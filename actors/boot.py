"""Ray's start in the background: `ray.init` runs in a thread while the driver imports torch and loads the data,
so a run's start-up costs about what Ray's own does rather than the sum of the two.

Ray starts and stops through `ray.init` and `ray.shutdown` alone. fedsim adds a check that a cluster named by
address answers (Ray retries an address where nothing listens for minutes), a one-line error for a start that
fails, and silence for Ray's start-up notices that do not concern a run. This module imports nothing heavy, so
that importing it delays nothing; `RayBoot` imports Ray itself in the calling thread before the background start
(see there).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import warnings
from collections.abc import Iterator
from types import ModuleType

from fedsim.errors import ConfigError, FedsimError

PROBE_TIMEOUT_S = 5.0

# Ray's notices at a start that a run's user has no use for: that a `ray.init` outside the main thread leaves
# SIGTERM alone (what fedsim wants), and that a Ray started locally turned token authentication on by itself
# (Ray's default; the README's cluster section says how a shared cluster uses tokens)
START_NOTICES = ("SIGTERM handler is not set", "Token authentication is enabled for this Ray cluster")

_own_gcs: str | None = None  # the GCS address of the local Ray that init_ray started in this process


def import_ray() -> ModuleType:
    """`import ray` without Ray's native crash handler in this process (RAY_DISABLE_FAILURE_SIGNAL_HANDLER, read
    when Ray is imported): that handler also takes SIGTERM, printing a six-line stack dump and aborting the driver
    instead of letting it stop with fedsim's one line and exit 143. The processes Ray starts keep it: the variable
    is set only while Ray imports, unless the user set it. A Ray imported earlier is taken as it is."""
    key = "RAY_DISABLE_FAILURE_SIGNAL_HANDLER"
    mine = key not in os.environ
    if mine:
        os.environ[key] = "1"
    try:
        import ray
    finally:
        if mine:
            os.environ.pop(key, None)
    return ray


def drop_client_timeout_warning() -> None:
    """Ray Client warns over two lines when a ray:// cluster does not answer in time, just before ray.init raises;
    that failure is reported in one line ("starting Ray failed: ..."), so the warning would only repeat it."""
    warnings.filterwarnings("ignore", message="Ray Client connection timed out", category=UserWarning,
                            module="ray.util.client")


class _DropStartNotices(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith(START_NOTICES)


@contextlib.contextmanager
def quiet_start() -> Iterator[None]:
    """While Ray starts, Python's last-resort handler leaves out START_NOTICES: `ray.init(configure_logging=False)`
    takes the `ray` logger's own handler away, so that handler prints every warning of Ray's in the driver.
    Everything else it prints still shows."""
    handler = logging.lastResort
    if handler is None:  # the application turned it off: nothing of Ray's is printed anyway
        yield
        return
    quiet = _DropStartNotices()
    handler.addFilter(quiet)
    try:
        yield
    finally:
        handler.removeFilter(quiet)


def check_reachable(address: str | None) -> None:
    """A cluster named as host:port (runtime.ray_address, or RAY_ADDRESS when that is unset) must accept a TCP
    connection: Ray itself retries an address where nothing listens for many minutes before it gives up."""
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


def _children() -> set[int]:
    import psutil

    return {p.pid for p in psutil.Process().children()}


def init_ray(address: str | None, runtime_env: dict | None = None) -> None:
    """ray.init with the job's `runtime_env` (the run's plugins, actors/plugins.py), keeping the CLI's SIGTERM
    handler: Ray's own exits the driver mid-round with a crash dump, while the CLI's unwinds like Ctrl-C (tables
    kept, Ray shut down). Whether the call started a local Ray of its own (its daemons are this process's
    children; joining a cluster starts none) is kept for `started_here`."""
    import signal

    from fedsim.runtime.signals import is_sigterm_handler

    global _own_gcs
    ray = import_ray()
    in_main = threading.current_thread() is threading.main_thread()
    previous = signal.getsignal(signal.SIGTERM)
    ours = in_main and is_sigterm_handler(previous)
    drop_client_timeout_warning()  # here, not at import: a caller's warnings.catch_warnings would undo it
    before = _children()
    try:
        with quiet_start():
            ray.init(address=address, include_dashboard=False, log_to_driver=True, configure_logging=False,
                     runtime_env=runtime_env)
    except SystemExit as exc:  # Ray's handler caught a SIGTERM during start-up
        if ours and callable(previous) and exc.code == signal.SIGTERM:
            previous(signal.SIGTERM, None)
        raise
    finally:
        if ours:
            signal.signal(signal.SIGTERM, previous)
    _own_gcs = ray.get_runtime_context().gcs_address if _children() - before else None


def started_here() -> bool:
    """Whether the Ray this process is connected to is a local one that `init_ray` started (not a cluster it
    joined, nor a Ray that someone else started)."""
    import ray

    return _own_gcs is not None and ray.is_initialized() and ray.get_runtime_context().gcs_address == _own_gcs


class RayBoot:
    """Starts (or joins) Ray in a background thread as soon as it is made; `wait` hands over when it is up.

    The thread stays parked until `stop`: Ray's daemons are started with PR_SET_PDEATHSIG, which Linux ties to
    the starting *thread*, so they would be killed the moment it ended."""

    def __init__(self, address: str | None, runtime_env: dict | None = None) -> None:
        # Ray's start is the longest path to the first round, so its import (0.3-0.4 s) goes first, alone: done in
        # the thread, it would interleave with the driver's torch import under the GIL and begin `ray.init` about a
        # second later (measured on 2 cores, 8 interleaved pairs: Ray up after 6.26 s against 6.73 s on average)
        try:
            import_ray()
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
        try:
            import ray

            if not ray.is_initialized():
                check_reachable(self.address)
                self.started_ray = True
                init_ray(self.address, self.runtime_env)
        except BaseException as exc:  # handed to the thread that waits
            self.error = exc
        finally:
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
            import ray

            ray.shutdown()
        self._release.set()
        self._thread.join(limit)
