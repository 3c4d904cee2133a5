"""Natural clients of a dataset (a writer, a speaker, a user): per-sample names turned into the codes `Dataset` keeps.

Codes number the distinct training client names in sorted order (TFF's sorted client ids, Flower's
`NaturalIdPartitioner`: integer ids sort as numbers, others as strings), so client k is the k-th name and the same
name has the same code in train and test. A test sample whose client has no training samples gets -1: it belongs to
the central test set only.
"""

from __future__ import annotations

import numpy as np


def natural_codes(train_names: np.ndarray, test_names: np.ndarray) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    """(train codes, test codes, client names) for per-sample client names: int64 ranks of each name among the
    sorted distinct training names; a test sample whose client is not among them gets -1."""
    train, test = np.asarray(train_names), np.asarray(test_names)
    if train.dtype.kind in "iu" and (test.dtype.kind in "iu" or test.size == 0):  # integer ids sort as numbers
        test = test.astype(train.dtype)
    else:
        train, test = train.astype(str), test.astype(str)
    names, train_ids = np.unique(train, return_inverse=True)
    if len(names) == 0:
        return train_ids.astype(np.int64), np.full(len(test), -1, dtype=np.int64), ()
    at = np.minimum(np.searchsorted(names, test), len(names) - 1)
    test_ids = np.where(names[at] == test, at, -1).astype(np.int64)
    return train_ids.astype(np.int64).reshape(-1), test_ids, tuple(str(n) for n in names)
