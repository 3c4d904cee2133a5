"""The dataset registry: a name maps to a loader that returns a `Dataset` of in-memory arrays."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fedsim import registry
from fedsim.config.knobs import check_kwargs
from fedsim.errors import ConfigError, DataError


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
    # natural splits (LEAF, TFF, Hugging Face): each sample's client (writer, speaker, user) as a code 0..K-1, and
    # the published id of each code; None for pooled datasets, which a partitioner splits. A test sample whose client
    # has no training samples (TFF CIFAR-100's test clients, built from other images) has test id -1: central only
    train_ids: np.ndarray | None = None
    test_ids: np.ndarray | None = None
    client_names: tuple[str, ...] = ()

    @classmethod
    def of_arrays(cls, name: str, arrays: Mapping[str, np.ndarray], meta: Mapping[str, Any]) -> Dataset:
        """The dataset a worker or the server actor rebuilds from the run's shared arrays and the driver's metadata."""
        return cls(name, arrays["x_train"], arrays["y_train"], arrays["x_test"], arrays["y_test"], meta["num_classes"],
                   tuple(meta["mean"]), tuple(meta["std"]), dict(meta.get("extras", {})))

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
Limits = dict[str, dict[str, float]]
_LOADERS: dict[str, Loader] = registry.table("dataset")
_LIMITS: dict[str, Limits] = {}
_CHECKS: dict[str, Callable[[dict], None]] = {}


def register_dataset(name: str, limits: Limits | None = None,
                     check: Callable[[dict], None] | None = None) -> Callable[[Loader], Loader]:
    """Register `fn(root: Path, download: bool, *, option=default, ...) -> Dataset` under `name`.

    The keyword parameters after `root` and `download` are the dataset's `data.options`: their annotations give
    the types, and `limits` maps an option to its numeric bounds, e.g. {"size": {"ge": 1, "le": 256}}. `check`,
    if given, further validates the converted options when the config is loaded (before any data is read)."""

    def wrap(fn: Loader) -> Loader:
        _LOADERS[name] = fn
        _LIMITS[name] = dict(limits or {})
        if check is not None:
            _CHECKS[name] = check
        return fn

    return wrap


def check_options(name: str, options: dict, prefix: str = "data.options") -> dict:
    """`options` of dataset `name` checked against its loader's signature and limits (converted, e.g. 1e3 -> 1000);
    an unknown dataset, option name, type or value is a one-line ConfigError naming the key."""
    if name not in _LOADERS:
        raise ConfigError(f"data.name: unknown dataset {name!r}; choose one of {dataset_names()}")
    out = check_kwargs(_LOADERS[name], options, prefix, f"dataset {name!r}", skip=("root", "download"),
                       limits=_LIMITS[name])
    if name in _CHECKS:
        _CHECKS[name](out)
    return out


def dataset_names() -> list[str]:
    return sorted(_LOADERS)


def load_dataset(name: str, root: str | Path = "data", download: bool = False, **options) -> Dataset:
    """Load a registered dataset; an unknown name lists the valid ones, and a split with no samples is refused here,
    naming the folder, rather than later as a partition that cannot be made."""
    options = check_options(name, options)
    ds = _LOADERS[name](Path(root).expanduser(), download, **options)
    for split, key, y in (("training", "x_train", ds.y_train), ("test", "x_test", ds.y_test)):
        if len(y) == 0:  # a file's loader: the file and its array; a folder's: the folder
            where = f"{key} of data.options.path={options['path']}" if options.get("path") else f"data.root={root}"
            raise DataError(f"{name}: no {split} samples ({where})")
    return ds
