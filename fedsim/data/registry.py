"""The dataset registry: a name maps to a loader that returns a `Dataset` of in-memory arrays."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from fedsim.errors import ConfigError


@dataclass
class Dataset:
    """Train and test arrays, normalised float32 N×C×H×W (images) or int64 N×L (token ids), int64 labels.

    `mean`/`std` are the per-channel statistics the images were normalised with, so that other inputs
    (single-image patches, generator samples) can be put on the same scale.
    """

    name: str
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    num_classes: int
    mean: tuple[float, ...] = ()
    std: tuple[float, ...] = ()
    extras: dict = field(default_factory=dict)  # e.g. an embedding table for text datasets

    @property
    def input_shape(self) -> tuple[int, ...]:
        return tuple(self.x_train.shape[1:])

    @property
    def channels(self) -> int:
        return int(self.x_train.shape[1]) if self.x_train.ndim == 4 else 1

    @property
    def image_size(self) -> int:
        return int(self.x_train.shape[-1]) if self.x_train.ndim == 4 else 0


Loader = Callable[..., Dataset]
_LOADERS: dict[str, Loader] = {}


def register_dataset(name: str) -> Callable[[Loader], Loader]:
    """Register `fn(root: Path, download: bool, **options) -> Dataset` under `name`."""

    def wrap(fn: Loader) -> Loader:
        _LOADERS[name] = fn
        return fn

    return wrap


def dataset_names() -> list[str]:
    return sorted(_LOADERS)


def load_dataset(name: str, root: str | Path = "data", download: bool = False, **options) -> Dataset:
    """Load a registered dataset; an unknown name lists the valid ones."""
    if name not in _LOADERS:
        raise ConfigError(f"data.name: unknown dataset {name!r}; choose one of {dataset_names()}")
    return _LOADERS[name](Path(root).expanduser(), download, **options)
