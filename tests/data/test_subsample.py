"""The `subsample` view (FedGDKD thesis pipeline: r of the training set, Resize(32), Normalize(0.5, 0.5))."""

from __future__ import annotations

import numpy as np
import pytest

from fedsim.data import load_dataset
from fedsim.data import subsample as _registers  # noqa: F401
from fedsim.errors import ConfigError


def test_fraction_resize_and_fixed_normalisation(tmp_path) -> None:
    base = load_dataset("digits", tmp_path)
    view = load_dataset("subsample", tmp_path, of="digits", fraction=0.25, seed=4, size=16, mean=0.5, std=0.5)
    assert len(view.y_train) == round(0.25 * len(base.y_train)) and len(view.y_test) == len(base.y_test)
    assert view.x_train.shape[1:] == (1, 16, 16) and view.mean == (0.5,) and view.std == (0.5,)
    assert view.x_train.min() >= -1 - 1e-6 and view.x_train.max() <= 1 + 1e-6  # [0, 1] pixels → [-1, 1]
    again = load_dataset("subsample", tmp_path, of="digits", fraction=0.25, seed=4, size=16, mean=0.5, std=0.5)
    assert np.array_equal(view.x_train, again.x_train) and np.array_equal(view.y_train, again.y_train)
    other = load_dataset("subsample", tmp_path, of="digits", fraction=0.25, seed=5)
    assert not np.array_equal(other.y_train, view.y_train)


def test_without_resize_rows_are_the_base_rows(tmp_path) -> None:
    base = load_dataset("digits", tmp_path)
    view = load_dataset("subsample", tmp_path, of="digits", fraction=0.1, seed=0)
    flat = base.x_train.reshape(len(base.x_train), -1)
    assert all((flat == row).all(1).any() for row in view.x_train.reshape(len(view.x_train), -1))
    assert view.mean == base.mean and np.array_equal(view.x_test, base.x_test)
    # renormalising only: (x·σ + μ − 0.5) / 0.5 of the same rows
    norm = load_dataset("subsample", tmp_path, of="digits", fraction=0.1, seed=0, mean=0.5, std=0.5)
    np.testing.assert_allclose(norm.x_train, (view.x_train * base.std[0] + base.mean[0] - 0.5) / 0.5, atol=1e-5)


@pytest.mark.parametrize("kw, key", [({}, "data.options.of"),
                                     ({"of": "digits", "fraction": 0}, "data.options.fraction"),
                                     ({"of": "digits", "mean": 0.5}, "data.options.mean"),
                                     ({"of": "digits", "frac": 0.5}, "data.options.frac"),
                                     ({"of": "digits", "options": {"size": "abc"}}, "data.options.options.size")])
def test_bad_options_name_the_key(tmp_path, kw, key) -> None:
    with pytest.raises(ConfigError, match=key):
        load_dataset("subsample", tmp_path, **kw)
