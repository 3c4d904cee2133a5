"""Embedded and generated datasets (digits, synthetic), the npz user format and option checking."""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import Dataset, dataset_names, load_dataset
from fedsim.data.synthetic import make_synthetic
from fedsim.errors import ConfigError, DataError


def _assert_images(ds: Dataset, shape: tuple[int, ...], classes: int) -> None:
    assert ds.x_train.dtype == np.float32 and ds.x_test.dtype == np.float32
    assert ds.y_train.dtype == np.int64 and ds.y_test.dtype == np.int64
    assert ds.input_shape == shape and ds.x_test.shape[1:] == shape
    assert ds.num_classes == classes and len(ds.mean) == len(ds.std) == shape[0]
    assert len(ds.x_train) == len(ds.y_train) and len(ds.x_test) == len(ds.y_test)


def test_registry_lists_every_builtin() -> None:
    names = set(dataset_names())
    assert {"digits", "synthetic", "npz", "cifar10", "cifar100", "mnist", "fashionmnist", "emnist", "svhn"} <= names
    assert {"pathmnist", "bloodmnist", "dermamnist", "octmnist", "organamnist"} <= names
    assert "chestmnist" not in names and "organmnist3d" not in names  # multi-label / 3D


def test_digits_shapes_normalisation_and_split(tmp_path: Path) -> None:
    ds = load_dataset("digits", tmp_path)
    _assert_images(ds, (1, 8, 8), 10)
    assert (len(ds.x_train), len(ds.x_test)) == (1437, 360)
    assert abs(float(ds.x_train.mean())) < 1e-4 and abs(float(ds.x_train.std()) - 1) < 1e-4
    again = load_dataset("digits", tmp_path)  # the same split, sample for sample
    assert np.array_equal(ds.x_test, again.x_test) and np.array_equal(ds.y_test, again.y_test)
    assert np.bincount(ds.y_test).min() >= 35  # stratified
    big = load_dataset("digits", tmp_path, size=32)
    _assert_images(big, (1, 32, 32), 10)
    np.testing.assert_allclose(big.x_train.mean(axis=(2, 3)), ds.x_train.mean(axis=(2, 3)), atol=1e-4)


def test_unknown_option_is_a_config_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="data.options.colour"):
        load_dataset("digits", tmp_path, colour=True)
    with pytest.raises(ConfigError, match="data.name"):
        load_dataset("imagenet", tmp_path)


def _reference_synthetic(n_train, n_test, c, size, classes, seed, amp):
    """The recipe written sample by sample, to pin the vectorised version to it."""
    rng = np.random.default_rng(seed)
    protos = rng.standard_normal((classes, c, size // 4, size // 4)).repeat(4, axis=2).repeat(4, axis=3)
    n = n_train + n_test
    y = rng.integers(0, classes, n)
    x = rng.standard_normal((n, c, size, size), dtype=np.float32)
    sx, sy = rng.integers(-4, 5, n), rng.integers(-4, 5, n)
    for i in range(n):
        x[i] += amp * np.roll(protos[y[i]], (sx[i], sy[i]), axis=(1, 2))
    return x[:n_train], y[:n_train], x[n_train:], y[n_train:]


def test_synthetic_matches_recipe_and_is_deterministic(tmp_path: Path) -> None:
    args = (300, 50, 2, 16, 5, 7, 2.5)
    for got, want in zip(make_synthetic(*args), _reference_synthetic(*args)):
        np.testing.assert_array_equal(got, want)
    ds = load_dataset("synthetic", tmp_path, n_train=400, n_test=100, channels=3, size=32, seed=1)
    _assert_images(ds, (3, 32, 32), 10)
    assert ds.mean == (0.0,) * 3 and ds.std == (1.0,) * 3
    same = load_dataset("synthetic", tmp_path, n_train=400, n_test=100, seed=1)
    other = load_dataset("synthetic", tmp_path, n_train=400, n_test=100, seed=2)
    assert np.array_equal(ds.x_train, same.x_train) and not np.array_equal(ds.x_train, other.x_train)
    with pytest.raises(ConfigError, match="data.options.size"):
        load_dataset("synthetic", tmp_path, size=30)


def test_synthetic_is_learnable(tmp_path: Path) -> None:
    """Nearest class-mean on the train set beats chance by far on the test set."""
    ds = load_dataset("synthetic", tmp_path, n_train=2000, n_test=500, channels=1, size=8, num_classes=4)
    means = np.stack([ds.x_train[ds.y_train == c].mean(axis=0).ravel() for c in range(4)])
    pred = np.argmin(((ds.x_test.reshape(len(ds.x_test), -1)[:, None] - means[None]) ** 2).sum(-1), axis=1)
    assert (pred == ds.y_test).mean() > 0.5


def _write_npz(path: Path, **arrays: np.ndarray) -> Path:
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize("layout", ["NHW", "NHWC", "NCHW"])
def test_npz_user_file(tmp_path: Path, layout: str) -> None:
    rng = np.random.default_rng(0)
    shape = {"NHW": (12, 12), "NHWC": (12, 12, 3), "NCHW": (3, 12, 12)}[layout]
    x_tr = rng.integers(0, 256, (40, *shape), dtype=np.uint8)
    x_te = rng.integers(0, 256, (10, *shape), dtype=np.uint8)
    file = _write_npz(tmp_path / "mine.npz", x_train=x_tr, y_train=np.arange(40) % 4, x_test=x_te,
                      y_test=(np.arange(10) % 4).reshape(-1, 1))
    ds = load_dataset("npz", tmp_path, path=str(file))
    c = 1 if layout == "NHW" else 3
    _assert_images(ds, (c, 12, 12), 4)
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-4)
    np.testing.assert_allclose(ds.x_train.std(axis=(0, 2, 3)), 1, atol=1e-3)
    nchw = x_tr if layout == "NCHW" else (x_tr[:, None] if layout == "NHW" else x_tr.transpose(0, 3, 1, 2))
    np.testing.assert_allclose(ds.x_train * np.array(ds.std).reshape(1, -1, 1, 1) * 255
                               + np.array(ds.mean).reshape(1, -1, 1, 1) * 255, nchw, atol=1e-3)
    assert load_dataset("npz", tmp_path, path="mine.npz").x_train.shape == ds.x_train.shape  # relative to root


def test_npz_errors_name_file_and_key(tmp_path: Path) -> None:
    x = np.zeros((4, 5, 5), np.float32)
    y = np.zeros(4, np.int64)
    with pytest.raises(ConfigError, match="data.options.path"):
        load_dataset("npz", tmp_path)
    with pytest.raises(DataError, match="not found"):
        load_dataset("npz", tmp_path, path=str(tmp_path / "absent.npz"))
    bad = _write_npz(tmp_path / "nokey.npz", x_train=x, y_train=y, x_test=x)
    with pytest.raises(DataError, match=r"nokey\.npz.*'y_test'"):
        load_dataset("npz", tmp_path, path=str(bad))
    bad = _write_npz(tmp_path / "len.npz", x_train=x, y_train=y[:3], x_test=x, y_test=y)
    with pytest.raises(DataError, match=r"len\.npz.*x_train.*y_train"):
        load_dataset("npz", tmp_path, path=str(bad))
    bad = _write_npz(tmp_path / "shape.npz", x_train=np.zeros((4, 5)), y_train=y, x_test=x, y_test=y)
    with pytest.raises(DataError, match=r"shape\.npz.*x_train"):
        load_dataset("npz", tmp_path, path=str(bad))
    bad = _write_npz(tmp_path / "size.npz", x_train=x, y_train=y, x_test=np.zeros((4, 6, 6), np.float32), y_test=y)
    with pytest.raises(DataError, match=r"size\.npz.*x_test"):
        load_dataset("npz", tmp_path, path=str(bad))
    (tmp_path / "junk.npz").write_bytes(b"not a zip")
    with pytest.raises(DataError, match=r"junk\.npz"):
        load_dataset("npz", tmp_path, path=str(tmp_path / "junk.npz"))
    for shape in ((4, 0, 5), (4, 1, 0, 0), (4, 0, 5, 5)):
        bad = _write_npz(tmp_path / "empty.npz", x_train=np.zeros(shape, np.float32), y_train=y, x_test=x, y_test=y)
        with pytest.raises(DataError, match=rf"empty\.npz: x_train images have no pixels \(shape \({shape[0]}, "):
            load_dataset("npz", tmp_path, path=str(bad))


def _forge_rows(file: Path, key: str, rows: int) -> None:
    """Rewrite `key`'s header in an .npz to claim `rows` rows (the data stays as small as it was)."""
    import zipfile

    with zipfile.ZipFile(file) as z:
        members = {name: z.read(name) for name in z.namelist()}
    raw = members[f"{key}.npy"]
    old_shape = str(np.load(io.BytesIO(raw)).shape[0])
    members[f"{key}.npy"] = raw.replace(f"({old_shape},".encode(), f"({rows},".encode(), 1)
    with zipfile.ZipFile(file, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)


@pytest.mark.parametrize("key", ["x_train", "y_test"])
def test_an_npz_whose_header_claims_terabytes_is_refused_before_numpy_allocates_them(tmp_path: Path, key) -> None:
    x, y = np.zeros((4, 5, 5), np.uint8), np.zeros(4, np.int64)
    bad = _write_npz(tmp_path / "forged.npz", x_train=x, y_train=y, x_test=x, y_test=y)
    _forge_rows(bad, key, 10**12)
    with pytest.raises(DataError, match=rf"forged\.npz: {key} claims shape \(1000000000000,.* it is damaged or forged"):
        load_dataset("npz", tmp_path, path=str(bad))


def test_valid_npz_files_of_every_layout_numpy_writes_pass_the_size_check(tmp_path: Path) -> None:
    """Compressed members, Fortran order and format 2.0/3.0 headers hold what they claim: none is refused."""
    x, y = np.asfortranarray(np.random.default_rng(0).random((6, 5, 5), dtype=np.float32)), np.arange(6) % 2
    path = tmp_path / "c.npz"
    np.savez_compressed(path, x_train=x, y_train=y, x_test=x[:2], y_test=y[:2])
    assert load_dataset("npz", tmp_path, path=str(path)).x_train.shape == (6, 1, 5, 5)
    import zipfile

    with zipfile.ZipFile(path, "w") as z:  # headers of format 2.0 (big) and 3.0 (utf-8 field names)
        for key, array, version in (("x_train", x, (2, 0)), ("y_train", y, (3, 0)), ("x_test", x[:2], (2, 0)),
                                    ("y_test", y[:2], (1, 0))):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, array, version=version)
            z.writestr(f"{key}.npy", buf.getvalue())
    assert load_dataset("npz", tmp_path, path=str(path)).x_train.shape == (6, 1, 5, 5)
