"""A view of another dataset: a seeded fraction of its training set, resized, renormalised.

It gives the FedGDKD thesis data pipeline (Banerjee 2022, §5.1: a uniform random r ∈ {10%, 25%} of the
MNIST / EMNIST-balanced training set, `Resize(32) → ToTensor → Normalize(0.5, 0.5)`) from the stock
loaders, e.g.

    data: {name: subsample, options: {of: mnist, fraction: 0.25, seed: 4, size: 32, mean: 0.5, std: 0.5}}

The test set is kept whole (only resized and renormalised).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config.limits import MAX_SEED
from fedsim.data._images import normalise_, resize
from fedsim.data.registry import Dataset, check_options, load_dataset, register_dataset
from fedsim.errors import ConfigError


def _unit(x: np.ndarray, mean: tuple[float, ...], std: tuple[float, ...]) -> np.ndarray:
    """Undo the base loader's normalisation: back to [0, 1] pixels."""
    m = np.asarray(mean or (0.0,), dtype=np.float32).reshape(1, -1, 1, 1)
    s = np.asarray(std or (1.0,), dtype=np.float32).reshape(1, -1, 1, 1)
    return x * s + m


def _check_base(options: dict) -> None:
    """The base dataset's own options, checked when the config loads."""
    if options.get("of") and options["of"] != "subsample":
        check_options(options["of"], options.get("options") or {}, prefix="data.options.options")


@register_dataset("subsample", limits={"fraction": {"gt": 0, "le": 1}, "seed": {"ge": 0, "le": MAX_SEED},
                                      "size": {"ge": 1, "le": 1024}}, check=_check_base)
def load_subsample(root: Path, download: bool, *, of: str | None = None, fraction: float = 1.0, seed: int = 0,
                   size: int | None = None, mean: float | None = None, std: float | None = None,
                   options: dict[str, Any] | None = None) -> Dataset:
    """`fraction` of dataset `of`'s training set (seeded), optionally resized to `size` and normalised with a
    fixed `mean`/`std` per channel (default: keep the base loader's statistics)."""
    if not of or of == "subsample":
        raise ConfigError("data.options.of: name the dataset to subsample, e.g. of: mnist")
    if (mean is None) != (std is None) or (std is not None and std <= 0):
        raise ConfigError(f"data.options.mean/std: give both, std > 0; got mean={mean}, std={std}")
    base_options = check_options(of, options or {}, prefix="data.options.options")
    base = load_dataset(of, root, download, **base_options)
    rng = np.random.default_rng(seed)
    n = len(base.y_train)
    keep = np.sort(rng.permutation(n)[:max(1, int(round(fraction * n)))])
    xs = [base.x_train[keep], base.x_test]
    m, s = tuple(base.mean), tuple(base.std)
    if size is not None or mean is not None:
        xs = [_unit(x, m, s) for x in xs]
        if size is not None:
            xs = [resize(np.ascontiguousarray(x, dtype=np.float32), size) for x in xs]
        if mean is not None and std is not None:  # given together (checked above)
            c = xs[0].shape[1]
            m, s = (float(mean),) * c, (float(std),) * c
        xs = [normalise_(np.ascontiguousarray(x, dtype=np.float32), m, s) for x in xs]
    return Dataset(name=f"{base.name}-{fraction:g}", x_train=xs[0], y_train=base.y_train[keep], x_test=xs[1],
                   y_test=base.y_test, num_classes=base.num_classes, mean=m, std=s, extras=dict(base.extras),
                   train_ids=None if base.train_ids is None else base.train_ids[keep], test_ids=base.test_ids,
                   client_names=base.client_names)
