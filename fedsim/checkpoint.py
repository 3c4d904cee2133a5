"""Checkpoints that load with `torch.load(weights_only=True)`: dataclasses and arrays packed as plain data."""

from __future__ import annotations

import dataclasses
import importlib
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsim.errors import CheckpointError
from fedsim.io import atomic_torch_save

_CLS, _ND = "__dataclass__", "__ndarray__"


def pack(obj: Any) -> Any:
    """Dataclasses -> tagged dicts, numpy arrays -> tagged tensors, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        return {_CLS: f"{cls.__module__}:{cls.__qualname__}",
                **{f.name: pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, np.ndarray):
        return {_ND: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any) -> Any:
    """Inverse of pack; only fedsim's own dataclasses are rebuilt."""
    if isinstance(obj, dict):
        if _ND in obj:
            return obj[_ND].numpy()
        if _CLS in obj:
            module, qual = obj[_CLS].split(":")
            if not module.startswith("fedsim."):
                raise CheckpointError(f"checkpoint names a class outside fedsim: {obj[_CLS]}")
            cls: Any = importlib.import_module(module)
            for part in qual.split("."):
                cls = getattr(cls, part)
            return cls(**{k: unpack(v) for k, v in obj.items() if k != _CLS})
        return {k: unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(unpack(v) for v in obj)
    return obj


def save_checkpoint(path: Path, payload: dict) -> None:
    """Write a checkpoint atomically."""
    atomic_torch_save(pack(payload), path)


def load_checkpoint(path: Path) -> dict:
    """Read a checkpoint, with a one-line error when it is missing or corrupt."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    try:
        return unpack(torch.load(path, weights_only=True, map_location="cpu"))
    except CheckpointError:
        raise
    except Exception as exc:  # corrupt or foreign file: name it, no traceback
        raise CheckpointError(f"{path}: unreadable checkpoint ({type(exc).__name__}: {exc})") from None
