"""A learnable synthetic image set: class prototypes, randomly shifted, buried in Gaussian noise.

The recipe is the one of the shared peer benchmark, re-implemented here so results stay comparable.
The order of draws from `np.random.default_rng(seed)` is part of the recipe:
  1. protos = standard_normal((classes, C, size/4, size/4)) (float64), each pixel repeated 4× on H and W;
  2. y  = integers(0, classes, n)            with n = n_train + n_test;
  3. x  = standard_normal((n, C, size, size), dtype=float32);
  4. sx = integers(-4, 5, n); 5. sy = integers(-4, 5, n);
  6. x[i] += amp * roll(protos[y[i]], (sx[i], sy[i]), axes=(H, W)); the first n_train samples are train.
Generated client shards (fedsim.data.generated) take steps 1 and 3-6 (`prototypes`, `render`) with labels drawn
from each client's own class mix.
"""

from __future__ import annotations

import numpy as np

from fedsim.config.limits import MAX_ARRAY_BYTES
from fedsim.errors import ConfigError

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
    for key, value in (("channels", channels), ("num_classes", num_classes)):
        if value < 1:
            raise ConfigError(f"data.options.{key}: synthetic data needs {key} >= 1, got {value}")
    for key, value in (("n_train", n_train), ("n_test", n_test)):  # n_train 0: a test set only (generated shards)
        if value < 0:
            raise ConfigError(f"data.options.{key}: must be >= 0, got {value}")
    nbytes = (n_train + n_test) * channels * size * size * 4
    if nbytes > MAX_ARRAY_BYTES:
        raise ConfigError(f"data.options: synthetic images of {n_train + n_test} × {channels}×{size}×{size} would "
                          f"take {nbytes / 2**30:,.0f} GiB (the limit is {MAX_ARRAY_BYTES / 2**30:,.0f} GiB); "
                          "lower n_train, n_test, channels or size")
    rng = np.random.default_rng(seed)
    n = n_train + n_test
    protos = prototypes(rng, num_classes, channels, size)
    y = rng.integers(0, num_classes, n)
    x = render(rng, protos, y, amp)
    y = y.astype(np.int64)
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def prototypes(rng: np.random.Generator, num_classes: int, channels: int, size: int) -> np.ndarray:
    """Step 1 of the recipe: one float64 C×size×size prototype per class, in 4×4 blocks."""
    protos = rng.standard_normal((num_classes, channels, size // 4, size // 4))
    return protos.repeat(4, axis=2).repeat(4, axis=3)


def render(rng: np.random.Generator, protos: np.ndarray, y: np.ndarray, amp: float,
           chunk: int = 2048) -> np.ndarray:
    """Steps 3-6 of the recipe: float32 noise plus amp × the label's prototype, rolled by a random shift.

    Rolling is a gather, x[i, c, h, w] += amp·protos[y_i, c, (h − sx_i) mod H, (w − sy_i) mod W], done in chunks
    of samples; the float64 term is added to float32 noise exactly as the per-sample loop of the recipe would."""
    n = len(y)
    _, channels, height, width = protos.shape
    x = rng.standard_normal((n, channels, height, width), dtype=np.float32)
    sx = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, n)
    sy = rng.integers(-MAX_SHIFT, MAX_SHIFT + 1, n)
    c = np.arange(channels)[None, :, None, None]
    for lo in range(0, n, chunk):
        s = slice(lo, lo + chunk)
        rows = (np.arange(height)[None, :] - sx[s, None]) % height
        cols = (np.arange(width)[None, :] - sy[s, None]) % width
        x[s] += amp * protos[y[s, None, None, None], c, rows[:, None, :, None], cols[:, None, None, :]]
    return x
