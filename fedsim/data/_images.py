"""Array helpers shared by the loaders: layout, scaling, per-channel statistics, resizing."""

from __future__ import annotations

import numpy as np

_CHUNK = 8192  # samples per chunk, keeps float64 temporaries small for 100k+ image sets


def to_nchw(x: np.ndarray, channels_last: bool) -> np.ndarray:
    """Return a C-contiguous N×C×H×W view/copy of N×H×W or N×H×W×C (or N×C×H×W) images."""
    if x.ndim == 3:
        return np.ascontiguousarray(x[:, None])
    if x.ndim != 4:
        raise ValueError(f"expected N×H×W or 4-d images, got shape {x.shape}")
    return np.ascontiguousarray(x.transpose(0, 3, 1, 2) if channels_last else x)


def as_unit_float(x: np.ndarray, scale: float) -> np.ndarray:
    """Convert to float32 and divide by `scale` (255 for uint8 pixels, 1 for float inputs)."""
    out = x.astype(np.float32)
    if scale != 1:
        out /= np.float32(scale)
    return out


def channel_stats(x: np.ndarray) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """Per-channel mean and (population) std of an N×C×H×W array, accumulated in float64 chunks."""
    c = x.shape[1]
    total = np.zeros(c)
    total_sq = np.zeros(c)
    for i in range(0, len(x), _CHUNK):
        part = x[i : i + _CHUNK].astype(np.float64)
        total += part.sum(axis=(0, 2, 3))
        total_sq += np.square(part).sum(axis=(0, 2, 3))
    count = max(x.shape[0] * x.shape[2] * x.shape[3], 1)
    mean = total / count
    std = np.sqrt(np.maximum(total_sq / count - mean**2, 0.0))
    std = np.where(std < 1e-8, 1.0, std)  # a constant channel is left unscaled rather than divided by ~0
    return tuple(float(m) for m in mean), tuple(float(s) for s in std)


def normalise_(x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """(x - mean) / std per channel, in place on a float32 N×C×H×W array."""
    m = np.asarray(mean, dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std, dtype=np.float32).reshape(1, -1, 1, 1)
    x -= m
    x /= s
    return x


def resize(x: np.ndarray, size: int) -> np.ndarray:
    """Bilinear resize (align_corners=False) of float32 N×C×H×W images to size×size."""
    if x.shape[-1] == size and x.shape[-2] == size:
        return x
    import torch
    import torch.nn.functional as F

    out = np.empty((x.shape[0], x.shape[1], size, size), dtype=np.float32)
    for i in range(0, len(x), _CHUNK):
        t = torch.from_numpy(np.ascontiguousarray(x[i : i + _CHUNK]))
        out[i : i + _CHUNK] = F.interpolate(t, size=(size, size), mode="bilinear", align_corners=False).numpy()
    return out
