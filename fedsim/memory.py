"""Memory a run is about to take, estimated before it is allocated and refused in one line when this machine has
less available (psutil): a model's parameters (built on the meta device, which allocates nothing) and a data
file's arrays (from their headers). And an out-of-memory error in training, recognised whatever raised it."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsim.errors import ConfigError, DataError

MODEL_COPIES_DRIVER = 2  # the global model and the sum of the clients' uploads
MODEL_COPIES_TRAINING = 2  # where clients train too (the local backend): a client's copy and its gradients
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


def model_parameter_bytes(arch: str, input_shape: tuple[int, ...], num_classes: int,
                          options: Mapping[str, Any]) -> tuple[int, int] | None:
    """(parameters, bytes of parameters and buffers) of `arch` for this input, from an instance built on the meta
    device; None when the builder cannot build there (the real build then speaks for itself)."""
    import torch

    from fedsim.errors import FedsimError
    from fedsim.models import build_model

    channels = input_shape[0] if len(input_shape) == 3 else 1
    size = input_shape[-1] if len(input_shape) == 3 else 0
    try:
        with torch.device("meta"):
            model = build_model(arch, channels, num_classes, size, **options)
    except FedsimError:
        raise
    except Exception:  # a builder that computes with real values (meta tensors hold none)
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return sum(p.numel() for p in model.parameters()), sum(t.numel() * t.element_size() for t in tensors)


def check_models(cfg: Any, input_shape: tuple[int, ...], num_classes: int, trains_here: bool) -> None:
    """Refuse, in one line naming the model and its options, a run whose models this machine cannot hold: the
    driver keeps MODEL_COPIES_DRIVER copies of each (and, where the clients train in this process,
    MODEL_COPIES_TRAINING more)."""
    copies = MODEL_COPIES_DRIVER + (MODEL_COPIES_TRAINING if trains_here else 0)
    have = available_bytes()
    for arch in dict.fromkeys(cfg.model.mix or [cfg.model.name]):
        found = model_parameter_bytes(arch, input_shape, num_classes, cfg.model.options)
        if found is None or found[1] * copies <= have:
            continue
        params, nbytes = found
        key = (f"model.options {cfg.model.options}" if cfg.model.options else
               "model.mix" if cfg.model.mix else "model.name")
        raise ConfigError(f"{key}: model {arch!r} for inputs {'×'.join(map(str, input_shape))} has {params:,} "
                          f"parameters ({human(nbytes)}); a run holds about {copies} copies "
                          f"({human(nbytes * copies)}), more than the {human(have)} of memory available here")


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
