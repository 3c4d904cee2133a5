"""Class-id arrays read from user files: whole numbers in 0..MAX_CLASSES-1, or a one-line DataError."""

from __future__ import annotations

import numpy as np

from fedsim.config.limits import MAX_CLASSES
from fedsim.errors import DataError


def checked_labels(y: np.ndarray, where: str) -> np.ndarray:
    """Class ids as int64 after checking they are whole numbers in 0..MAX_CLASSES-1; `where` names file and key."""
    if len(y) == 0:
        return y.astype(np.int64)
    if np.issubdtype(y.dtype, np.floating):
        bad = np.flatnonzero(~np.isfinite(y) | (np.mod(y, 1) != 0))
        if len(bad):
            raise DataError(f"{where} must hold whole-number class ids; entry {bad[0]} is {y[bad[0]]}")
    low, high = y.min(), y.max()
    if low < 0:
        raise DataError(f"{where} has a negative class id ({int(low)})")
    if high >= MAX_CLASSES:
        raise DataError(f"{where} has class id {int(high)}; class ids must be below {MAX_CLASSES:,}")
    return y.astype(np.int64)
