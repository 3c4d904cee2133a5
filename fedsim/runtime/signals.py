"""SIGTERM handled like Ctrl-C, and a shield that holds both signals while a run writes its files.

Schedulers and `ray job stop` send SIGTERM. `catch_sigterm()` turns the first one into `Terminated`, a
KeyboardInterrupt, so a terminated run unwinds (tables kept, backend shut down) exactly as an interrupted
one does. `shielded()` defers SIGINT and SIGTERM while the tables and the checkpoint are written and while
the backend shuts down, so an interrupt never lands between a round's rows and its checkpoint, nor half-way
through stopping Ray; a second signal during the shield is delivered at once, so a hang can still be broken.
"""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

TERMINATED_EXIT_CODE = 128 + signal.SIGTERM
INTERRUPTED_EXIT_CODE = 128 + signal.SIGINT

_received = {"sigterm": False}


class Terminated(KeyboardInterrupt):
    """The process received SIGTERM; raised in the main thread where Python next checks for signals."""


def _on_sigterm(signum: int, frame: Any) -> None:
    if _received["sigterm"]:  # already unwinding: later SIGTERMs must not interrupt the clean-up
        return
    _received["sigterm"] = True
    raise Terminated()


def _main_thread() -> bool:
    return threading.current_thread() is threading.main_thread()


@contextmanager
def catch_sigterm() -> Iterator[None]:
    """Within the block, the first SIGTERM raises `Terminated`; the previous handler is restored on exit."""
    if not _main_thread():
        yield
        return
    _received["sigterm"] = False
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous if previous is not None else signal.SIG_DFL)


def sigterm_received() -> bool:
    """Whether a SIGTERM arrived under `catch_sigterm` (Ray may re-raise it as a plain KeyboardInterrupt)."""
    return _received["sigterm"]


def is_sigterm_handler(handler: Any) -> bool:
    """Whether `handler` is the one `catch_sigterm` installs (backends that replace it put it back)."""
    return handler is _on_sigterm


def _deliver(signum: int, handler: Callable | int | None) -> None:
    """Act on a deferred signal as its own handler would have."""
    if callable(handler):
        handler(signum, None)
    elif handler == signal.SIG_DFL:
        if signum == signal.SIGINT:
            raise KeyboardInterrupt()
        os.kill(os.getpid(), signum)  # the default action (terminate), now that the files are consistent


@contextmanager
def shielded() -> Iterator[None]:
    """Defer SIGINT and SIGTERM until the block ends; a second signal inside the block is delivered at once."""
    watched = [s for s in (signal.SIGINT, signal.SIGTERM) if signal.getsignal(s) is not None]
    if not _main_thread() or not watched:
        yield
        return
    previous: dict[int, Callable[..., Any] | int | None] = {s: signal.getsignal(s) for s in watched}
    pending: list[int] = []

    def defer(signum: int, frame: Any) -> None:
        if pending:  # asked twice: stop waiting for the block
            _restore()
            first = pending.pop()
            _deliver(first, previous[first])
            _deliver(signum, previous[signum])
            return
        pending.append(signum)

    def _restore() -> None:
        for s, h in previous.items():
            signal.signal(s, h)

    for s in watched:
        signal.signal(s, defer)
    try:
        yield
    finally:
        _restore()
        for signum in pending:
            _deliver(signum, previous[signum])
