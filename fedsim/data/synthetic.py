"""A learnable synthetic image set: class prototypes, randomly shifted, buried in Gaussian noise.

The recipe is the one of the shared peer benchmark, re-implemented here so results stay comparable.
The order of draws from `np.random.default_rng(seed)` is part of the recipe:
  1. protos = standard_normal((classes, C, size/4, size/4)) (float64), each pixel repeated 4× on H and W;
  2. y  = integers(0, classes, n)            with n = n_train + n_test;
  3. x  = standard_normal((n, C, size, size), dtype=float32);
  4. sx = integers(-4, 5, n); 5. sy = integers(-4, 5, n);
  6. x[i] += amp * roll(protos[y[i]], (sx[i], sy[i]), axes=(H, W)); the first n_train samples are train.
"""

from __future__ import annotations

import numpy as np

from fedsim.errors import ConfigError
from fedsim.limits import MAX_ARRAY_BYTES

MAX_SHIFT = 4


def make_synthetic(
    n_train: int = 20000,
    n_test: int = 2000,
    channels: int = 3,
    size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
    amp: float = 3.0,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Return (x_train, y_train, x_test, y_test): float32 N×C×size×size and int64 labels."""
    if size <= 0 or size % 4:
        raise ConfigError(f"data.options.size: synthetic images need a positive multiple of 4, got {size}")
    for key, value in (("n_train", n_train), ("channels", channels), ("num_classes", num_classes)):
        if value < 1:
            raise ConfigError(f"data.options.{key}: synthetic data needs {key} >= 1, got {value}")
    if n_test < 0:
        raise ConfigError(f"data.options.n_test: must be >= 0, got {n_test}")
    nbytes = (n_train + n_test) * channels * size * size * 4
    if nbytes > MAX_ARRAY_BYTES:
        raise ConfigError(f"data.options: synthetic images of {n_train + n_test} × {channels}×{size}×{size} would "
                          f"take {nbytes / 2**30:,.0f} GiB (the limit is {MAX_ARRAY_BYTES / 2**30:,.0f} GiB); "
                          "lower n_train, n_test, channels or size")
    rng = np.random.default_rng(seed)
    n = n_train + n_test
    protos = rng.standard_normal((num_classes, channels, size // 4, size // 4))
    protos = protos.repeat(4, axis=2).repeat(4, axis=3)
    y = rng.integers(0, num_classes, n)
    x = rng.standard_normal((n, channels, size, size), dtype=np.float32)
    sx = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, n)
    sy = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, n)
    # Vectorised per shift group: all samples sharing (sx, sy) get one rolled prototype table.
    # x[i] += amp*p mixes float32 and float64 exactly as the per-sample loop would.
    group = (sx + MAX_SHIFT) * (2 * MAX_SHIFT + 1) + (sy + MAX_SHIFT)
    order = np.argsort(group, kind="stable")
    bounds = np.flatnonzero(np.diff(group[order])) + 1
    for idx in np.split(order, bounds):
        if len(idx) == 0:
            continue
        shifted = amp * np.roll(protos, (int(sx[idx[0]]), int(sy[idx[0]])), axis=(2, 3))
        x[idx] += shifted[y[idx]]
    y = y.astype(np.int64)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]
