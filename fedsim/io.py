"""Atomic file writes: a killed run never leaves a half-written table, config or checkpoint."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any


def atomic_write(path: Path, write: Callable[[str], Any]) -> None:
    """Call `write(tmp_path)`, fsync, then rename over `path` (same folder, so the rename is atomic)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    try:
        write(tmp)
        with open(tmp, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: Path, text: str) -> None:
    """Write text atomically."""
    atomic_write(path, lambda tmp: Path(tmp).write_text(text))


def atomic_torch_save(obj: Any, path: Path) -> None:
    """torch.save atomically."""
    import torch

    atomic_write(path, lambda tmp: torch.save(obj, tmp))
