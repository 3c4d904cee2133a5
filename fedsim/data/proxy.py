"""Proxy (public) sets for distillation-based FL, rebuilt identically in every process from the config.

Like the single-image patch pool, a proxy set is never shipped: the server and every worker load it from
the same source with the same seed and cache it, so a round only sends indices into it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedsim.errors import ConfigError

PROXY_KINDS = ("dataset", "test_half", "extras")


class TensorPool:
    """A proxy set held as normalised float32 tensors, with PatchPool's `take` interface."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def take(self, indices: Any = None, device: torch.device | str = "cpu") -> torch.Tensor:
        """Samples at `indices` (all when None), on `device`."""
        x = self.x if indices is None else self.x[torch.as_tensor(indices, dtype=torch.long)]
        return x.to(device)


_CACHE: dict[tuple, TensorPool] = {}


def split_test_halves(n: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """A fixed split of n test samples into (proxy half, evaluation half), each sorted."""
    perm = np.random.default_rng(seed).permutation(n)
    return np.sort(perm[: n // 2]), np.sort(perm[n // 2:])


def to_target(x: np.ndarray, mean, std, shape: tuple[int, ...], t_mean, t_std) -> torch.Tensor:
    """Images normalised with (mean, std) re-expressed in the target's channels, size and normalisation."""
    from fedsim.data._images import normalise_, resize

    raw = x * np.asarray(std, np.float32).reshape(1, -1, 1, 1) + np.asarray(mean, np.float32).reshape(1, -1, 1, 1)
    if raw.shape[1] == 3 and shape[0] == 1:
        raw = (raw * np.array([0.2989, 0.587, 0.114], np.float32).reshape(1, 3, 1, 1)).sum(1, keepdims=True)
    elif raw.shape[1] == 1 and shape[0] == 3:
        raw = np.repeat(raw, 3, axis=1)
    raw = resize(np.ascontiguousarray(raw, dtype=np.float32), shape[-1])
    return torch.from_numpy(normalise_(raw, t_mean, t_std))


def proxy_pool(kind: str, env, dataset: str = "", size: int = 500, seed: int = 0) -> TensorPool:
    """The proxy set of a run (cached per process).

    dataset: `size` random train inputs of another registered dataset (e.g. CIFAR-100 for CIFAR-10);
    test_half: up to `size` inputs of a fixed half of this dataset's test set (the reference's same-dataset
    proxy; score models on the other half); extras: `env.extras["proxy"]`, for loaders that provide one.
    """
    data_cfg = env.config.data
    key = (kind, dataset, size, seed, data_cfg.name, tuple(sorted(data_cfg.options.items())), env.input_shape,
           env.mean, env.std)
    if key in _CACHE:
        return _CACHE[key]
    from fedsim.data import load_dataset

    if kind == "extras":
        if "proxy" not in env.extras:
            raise ConfigError("algorithm.proxy: 'extras' needs the dataset loader to provide extras['proxy']")
        pool = TensorPool(torch.as_tensor(np.asarray(env.extras["proxy"]), dtype=torch.float32))
    elif kind == "test_half":
        ds = load_dataset(data_cfg.name, data_cfg.root, data_cfg.download, **data_cfg.options)
        half, _ = split_test_halves(len(ds.y_test), seed)
        pool = TensorPool(torch.from_numpy(np.ascontiguousarray(ds.x_test[half[:size]], dtype=np.float32)))
    elif kind == "dataset":
        ds = load_dataset(dataset, data_cfg.root, data_cfg.download)
        pick = np.sort(np.random.default_rng(seed).permutation(len(ds.y_train))[:size])
        pool = TensorPool(to_target(ds.x_train[pick], ds.mean, ds.std, env.input_shape, env.mean, env.std))
    else:
        raise ConfigError(f"algorithm.proxy: unknown proxy {kind!r}; choose one of {list(PROXY_KINDS)}")
    _CACHE[key] = pool
    return pool
