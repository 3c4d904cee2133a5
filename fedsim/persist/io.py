"""Atomic file writes: a killed run never leaves a half-written table, config or checkpoint.

Files get the mode a plain open() would give them (0o666 less the umask), so a team can share a results folder.
A file in a store (fedsim.persist.storage.StorePath) is written to a local temporary file, then uploaded in one put.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fedsim.persist.storage import Location, StorePath


def atomic_write(path: Location, write: Callable[[str], Any], ready: Callable[[str], Any] | None = None) -> None:
    """Call `write(tmp_path)`, fsync, then rename over `path` (same folder, so the rename is atomic); `ready(tmp_path)`
    runs just before the rename (or the upload), once the file is complete."""
    if isinstance(path, StorePath):
        _upload(path, write, ready)
        return
    path = Path(path)
    tmp = None
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = _create_temporary(path)
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        if ready is not None:
            ready(tmp)
        os.replace(tmp, path)
    except BaseException as exc:
        if tmp is not None and os.path.exists(tmp):
            os.unlink(tmp)
        if isinstance(exc, OSError) and exc.errno is not None and exc.filename in (None, tmp):
            raise OSError(exc.errno, exc.strerror, str(path)) from exc  # the file meant, not the temporary
        raise


def _upload(path: StorePath, write: Callable[[str], Any], ready: Callable[[str], Any] | None = None) -> None:
    """Write a local temporary file, then put it at `path` in one transfer (a store shows it whole or not at all)."""
    import tempfile

    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        write(tmp)
        if ready is not None:
            ready(tmp)
        path.upload(tmp)
    finally:
        os.unlink(tmp)


def _create_temporary(path: Path) -> str:
    """A new empty file next to `path`, created as open() would create it (the umask applies)."""
    while True:
        tmp = str(path.parent / f".{path.name}.{secrets.token_hex(6)}.tmp")
        try:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666))
            return tmp
        except FileExistsError:
            continue


def write_new(path: Location, data: bytes) -> bool:
    """Create `path` holding `data`, unless it exists (False then): O_EXCL on a local disk, a conditional put in a
    store, so of two processes creating the same file exactly one succeeds."""
    if isinstance(path, StorePath):
        return path.create(data)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
    return True


def atomic_write_text(path: Location, text: str) -> None:
    """Write text atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_write_bytes(path: Location, data: bytes | memoryview) -> None:
    """Write bytes atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_bytes(data))


def atomic_torch_save(obj: Any, path: Location) -> None:
    """torch.save atomically."""
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))
