"""Memory a run is about to take, estimated before it is allocated and refused in one line when this machine has
less available (psutil): a data file's arrays (from their headers; a model's parameters: fedsim.models.size). And
an out-of-memory error in training, recognised whatever raised it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsim.errors import DataError

OOM_MESSAGES = ("can't allocate memory", "not enough memory", "out of memory")  # torch's CPU and CUDA allocators


def available_bytes() -> int:
    """Memory this machine can give now without swapping (psutil's `available`)."""
    import psutil

    return int(psutil.virtual_memory().available)


def human(n: float) -> str:
    """Bytes as people read them: 17.2 GB, 940 MB."""
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n / 1e3:.1f} kB"


def check_arrays(shapes: Mapping[str, tuple[tuple[int, ...], Any]], where: str, key: str) -> None:
    """Refuse data arrays (name -> (shape, numpy dtype), from their headers) that would not fit once decoded: each
    as stored, and images (x_*) again as float32, as the loaders hold them."""
    import math

    need = 0
    for name, (shape, dtype) in shapes.items():
        n = math.prod(shape)
        need += n * dtype.itemsize + (4 * n if name.startswith("x") else 8 * n)
    have = available_bytes()
    if need > have:
        shown = ", ".join(f"{name} {'×'.join(map(str, shape))} {dtype}" for name, (shape, dtype) in shapes.items()
                          if name.startswith("x"))
        raise DataError(f"{where}: its arrays take about {human(need)} once decoded ({shown}, as float32 images), "
                        f"more than the {human(have)} of memory available here ({key})")


def is_out_of_memory(exc: BaseException) -> bool:
    """Whether `exc` says an allocation failed: MemoryError (numpy), torch.OutOfMemoryError (CUDA), or torch's CPU
    allocator's RuntimeError."""
    if isinstance(exc, MemoryError):
        return True
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return True
    return isinstance(exc, RuntimeError) and any(m in str(exc) for m in OOM_MESSAGES)
