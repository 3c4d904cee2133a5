"""The real on-disk formats, written small into tmp_path and read back through torchvision / medmnist."""

from __future__ import annotations

import pickle
import struct
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import Dataset, load_dataset
from fedsim.data.datasets import CIFAR10_STATS, CIFAR100_STATS, MNIST_STATS
from fedsim.errors import DataError

RNG = np.random.default_rng(0)


def _denormalise(ds: Dataset, x: np.ndarray) -> np.ndarray:
    """Back to 0..255 pixel units."""
    shape = (1, -1, 1, 1)
    return (x * np.array(ds.std).reshape(shape) + np.array(ds.mean).reshape(shape)) * 255


def _pickle(path: Path, obj: dict) -> None:
    with open(path, "wb") as f:
        pickle.dump(obj, f, protocol=2)


def _write_cifar10(root: Path, per_batch: int = 8) -> tuple[np.ndarray, np.ndarray]:
    """cifar-10-batches-py exactly as the tarball extracts it: 5 train batches, test_batch, batches.meta."""
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rows, labels = [], []
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        data = RNG.integers(0, 256, (per_batch, 3072), dtype=np.uint8)  # R, G, B planes of 32×32, row-major
        y = RNG.integers(0, 10, per_batch).tolist()
        _pickle(folder / name, {"batch_label": name, "labels": y, "data": data,
                                "filenames": [f"{name}_{i}.png" for i in range(per_batch)]})
        rows.append(data)
        labels.append(y)
    _pickle(folder / "batches.meta", {"label_names": [f"c{i}" for i in range(10)], "num_cases_per_batch": per_batch,
                                      "num_vis": 3072})
    return np.concatenate(rows), np.concatenate(labels)


def test_cifar10_pickle_batches(tmp_path: Path) -> None:
    rows, labels = _write_cifar10(tmp_path)
    ds = load_dataset("cifar10", tmp_path)
    assert ds.x_train.shape == (40, 3, 32, 32) and ds.x_test.shape == (8, 3, 32, 32)
    assert (ds.mean, ds.std) == CIFAR10_STATS and ds.num_classes == 10
    np.testing.assert_allclose(_denormalise(ds, ds.x_train), rows[:40].reshape(-1, 3, 32, 32), atol=1e-3)
    np.testing.assert_array_equal(ds.y_train, labels[:40])
    np.testing.assert_array_equal(ds.y_test, labels[40:])


def test_cifar100_pickle_files(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    data = {s: RNG.integers(0, 256, (n, 3072), dtype=np.uint8) for s, n in (("train", 30), ("test", 10))}
    fine = {s: RNG.integers(0, 100, len(d)).tolist() for s, d in data.items()}
    for s, rows in data.items():
        _pickle(folder / s, {"filenames": ["x.png"] * len(rows), "batch_label": s, "fine_labels": fine[s],
                             "coarse_labels": [f // 5 for f in fine[s]], "data": rows})
    _pickle(folder / "meta", {"fine_label_names": [f"f{i}" for i in range(100)],
                              "coarse_label_names": [f"c{i}" for i in range(20)]})
    ds = load_dataset("cifar100", tmp_path)
    assert ds.num_classes == 100 and (ds.mean, ds.std) == CIFAR100_STATS
    np.testing.assert_array_equal(ds.y_train, fine["train"])
    np.testing.assert_allclose(_denormalise(ds, ds.x_test), data["test"].reshape(-1, 3, 32, 32), atol=1e-3)


def test_cifar_missing_and_corrupt_files_are_data_errors(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=str(tmp_path / "cifar-10-batches-py")) as err:
        load_dataset("cifar10", tmp_path)
    message = str(err.value)
    assert "data.download: true" in message and "\n" not in message
    assert err.value.__cause__ is None and err.value.__suppress_context__
    _write_cifar10(tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").unlink()
    with pytest.raises(DataError, match="data_batch_3"):
        load_dataset("cifar10", tmp_path)
    (tmp_path / "cifar-10-batches-py" / "data_batch_3").write_bytes(b"\x80\x02}q")  # truncated pickle
    with pytest.raises(DataError, match="could not read"):
        load_dataset("cifar10", tmp_path)


def test_cifar_verify_keeps_the_md5_check(tmp_path: Path) -> None:
    _write_cifar10(tmp_path)
    with pytest.raises(DataError, match="data_batch_1 fails its md5 check"):  # our files are not the published ones
        load_dataset("cifar10", tmp_path, verify=True)


def _idx(path: Path, array: np.ndarray) -> None:
    """IDX (LeCun) file: magic 0x08 (ubyte) + ndim, big-endian dims, raw bytes."""
    path.parent.mkdir(parents=True, exist_ok=True)
    header = struct.pack(">I", 0x0800 + array.ndim) + struct.pack(f">{array.ndim}I", *array.shape)
    path.write_bytes(header + array.astype(np.uint8).tobytes())


@pytest.mark.parametrize("name,folder", [("mnist", "MNIST"), ("fashionmnist", "FashionMNIST")])
def test_mnist_idx_files(tmp_path: Path, name: str, folder: str) -> None:
    raw = tmp_path / folder / "raw"
    sets = {s: (RNG.integers(0, 256, (n, 28, 28)), RNG.integers(0, 10, n)) for s, n in (("train", 20), ("t10k", 6))}
    for s, (x, y) in sets.items():
        _idx(raw / f"{s}-images-idx3-ubyte", x)
        _idx(raw / f"{s}-labels-idx1-ubyte", y)
    ds = load_dataset(name, tmp_path)
    assert ds.input_shape == (1, 28, 28) and len(ds.x_test) == 6
    if name == "mnist":
        assert (ds.mean, ds.std) == MNIST_STATS
    np.testing.assert_allclose(_denormalise(ds, ds.x_train)[:, 0], sets["train"][0], atol=1e-3)
    np.testing.assert_array_equal(ds.y_test, sets["t10k"][1])


def test_mnist_missing_names_raw_folder(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=str(tmp_path / "MNIST" / "raw")):
        load_dataset("mnist", tmp_path)


def test_emnist_split_is_transposed_upright(tmp_path: Path) -> None:
    raw = tmp_path / "EMNIST" / "raw"
    x = {s: RNG.integers(0, 256, (n, 28, 28)) for s, n in (("train", 12), ("test", 4))}
    for s, images in x.items():
        _idx(raw / f"emnist-letters-{s}-images-idx3-ubyte", images)
        _idx(raw / f"emnist-letters-{s}-labels-idx1-ubyte", np.arange(1, len(images) + 1))
    ds = load_dataset("emnist", tmp_path, split="letters")
    assert ds.num_classes == 26 and ds.y_train.min() == 0
    np.testing.assert_allclose(_denormalise(ds, ds.x_train)[:, 0], x["train"].transpose(0, 2, 1), atol=1e-3)
    with pytest.raises(DataError, match="emnist-balanced-train-images-idx3-ubyte"):
        load_dataset("emnist", tmp_path)  # default split 'balanced' is not there


def test_svhn_mat_files(tmp_path: Path) -> None:
    from scipy.io import savemat

    train_y = np.array([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 10, 1, 2, 3, 4])  # SVHN stores digit 0 as label 10
    for s, n in (("train", 15), ("test", 5)):
        y = train_y if s == "train" else RNG.integers(1, 11, n)
        savemat(tmp_path / f"{s}_32x32.mat", {"X": RNG.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                                              "y": y.astype(np.uint8)[:, None]})
    ds = load_dataset("svhn", tmp_path)
    assert ds.x_train.shape == (15, 3, 32, 32)
    assert ds.y_train.tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9, 0, 0, 1, 2, 3, 4]  # the digit each image shows
    np.testing.assert_allclose(ds.x_train.mean(axis=(0, 2, 3)), 0, atol=1e-4)


def _write_medmnist(root: Path, flag: str, channels: int, size: int = 28, classes: int = 9) -> dict:
    shape = (size, size) if channels == 1 else (size, size, channels)
    arrays = {}
    for s, n in (("train", 30), ("val", 6), ("test", 10)):
        arrays[f"{s}_images"] = RNG.integers(0, 256, (n, *shape), dtype=np.uint8)
        arrays[f"{s}_labels"] = RNG.integers(0, classes, (n, 1)).astype(np.uint8)
    np.savez(root / f"{flag}{'' if size == 28 else f'_{size}'}.npz", **arrays)
    return arrays


def test_medmnist_npz(tmp_path: Path) -> None:
    arrays = _write_medmnist(tmp_path, "pathmnist", 3)
    ds = load_dataset("pathmnist", tmp_path)
    assert ds.input_shape == (3, 28, 28) and ds.num_classes == 9 and len(ds.x_train) == 30
    np.testing.assert_array_equal(ds.y_train, arrays["train_labels"][:, 0])
    np.testing.assert_allclose(_denormalise(ds, ds.x_test), arrays["test_images"].transpose(0, 3, 1, 2), atol=1e-3)
    assert len(load_dataset("pathmnist", tmp_path, merge_val=True).x_train) == 36
    _write_medmnist(tmp_path, "octmnist", 1, size=64, classes=4)
    gray = load_dataset("octmnist", tmp_path, size=64, as_rgb=True)
    assert gray.input_shape == (3, 64, 64) and gray.num_classes == 4


def test_medmnist_missing_file_names_expected_path(tmp_path: Path) -> None:
    with pytest.raises(DataError, match=r"bloodmnist_64\.npz") as err:
        load_dataset("bloodmnist", tmp_path / "nowhere", size=64)
    assert str(tmp_path / "nowhere") in str(err.value) and "data.download: true" in str(err.value)


class _RunsCode:
    """A pickle payload that runs a shell command when unpickled by plain pickle.load."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        import os

        return (os.system, (f"touch {self.marker}",))


def test_a_crafted_cifar_batch_is_refused_without_running_it(tmp_path: Path) -> None:
    _write_cifar10(tmp_path)
    marker = tmp_path / "ran"
    _pickle(tmp_path / "cifar-10-batches-py" / "data_batch_2", {"labels": [0], "data": _RunsCode(marker)})
    with pytest.raises(DataError, match="data_batch_2.*refusing to load") as err:
        load_dataset("cifar10", tmp_path)
    assert "\n" not in str(err.value) and not marker.exists()
    with open(tmp_path / "cifar-10-batches-py" / "data_batch_2", "rb") as fh:  # the control: plain pickle runs it
        pickle.load(fh)
    assert marker.exists()
