"""A run's files written on a thread of their own, in order, while the next round trains.

A round's tables and checkpoint cost the driver milliseconds (far more on a network file system or a store), during
which every worker would idle. The driver takes what the files must hold (copies of the new rows, the checkpoint
serialized) and queues the writes; `start()`, called once the next phase's work is handed out to workers in other
processes, lets one thread write them while the driver only waits (so they do not hold up the dispatch, as a thread
competing for the interpreter would). Where the driver trains the clients itself (the local backend) they start as
the phase does: written beside the training, they cost C's round 2 less than after the phase, where they would
compete with the two-thread evaluation and hold up the round's end (0.070-0.077 s against 0.075-0.083 s in five
pairs of `python -m bench.fedsim_fedavg --backend local` on C).

They are written in the order queued, each atomically, so the files are never inconsistent: a round's checkpoint is
never written before its rows. After a failed write nothing queued later is written, and the failure is raised on
the driver by its next `submit` or `wait`. The run waits for every queued write before it ends, and before it reads
its own checkpoint back.
"""

from __future__ import annotations

import os
import sys
import threading
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor


class BackgroundWrites:
    """One writer thread and its queue; `background=False` writes at once on the calling thread (same order)."""

    def __init__(self, background: bool = True) -> None:
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fedsim-writes",
                                        initializer=_yield_the_cpu) if background else None
        self._queued: list[Callable[[], None]] = []  # not yet handed to the thread
        self._pending: deque[Future] = deque()  # handed to the thread
        self._failed = False

    def submit(self, write: Callable[[], None]) -> None:
        """Queue `write` after everything queued before; first raises an earlier write's failure, if one is known."""
        self._settle(block=False)
        if self._pool is None:
            self._run(write)
        else:
            self._queued.append(write)

    def start(self) -> None:
        """Let the thread write everything queued so far (the driver is about to wait on its workers)."""
        if self._pool is not None:
            self._pending.extend(self._pool.submit(self._run, w) for w in self._queued)
        self._queued = []

    def wait(self) -> None:
        """Return once every queued write is done; raises the first failure among them."""
        self.start()
        self._settle(block=True)

    def close(self) -> None:
        """Finish the queued writes (their failures are not raised here: `wait` first to see them); end the thread."""
        self.start()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
        self._pending.clear()

    def _run(self, write: Callable[[], None]) -> None:
        if self._failed:  # an earlier write failed: a later file must not get ahead of it
            return
        try:
            write()
        except BaseException:
            self._failed = True
            raise

    def _settle(self, block: bool) -> None:
        while self._pending and (block or self._pending[0].done()):
            exc = self._pending.popleft().exception()
            if exc is not None:
                self._pending.clear()  # they are skipped: see _run
                raise exc


def _yield_the_cpu() -> None:
    """Give the writer thread the lowest CPU priority (Linux: a thread's own nice value), so that on a machine whose
    cores the workers fill it writes in their idle moments instead of slowing them."""
    if sys.platform.startswith("linux"):
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        except OSError:  # not allowed here: the writes just share the CPU
            pass
