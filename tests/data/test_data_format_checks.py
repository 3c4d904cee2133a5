"""Real on-disk formats holding the wrong thing: each is a one-line DataError naming the file and the problem."""

from __future__ import annotations

import pickle
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from fedsim.data import load_dataset
from fedsim.errors import DataError
from tests.data.test_data_formats import _idx, _pickle, _write_cifar10, _write_medmnist

RNG = np.random.default_rng(1)


def _refused(name: str, root: Path, file: Path, problem: str, **options) -> None:
    """Loading `name` from `root` fails with one line that names `file` and matches `problem`."""
    with pytest.raises(DataError) as err:
        load_dataset(name, root, **options)
    message = str(err.value)
    assert str(file) in message and re.search(problem, message) and "\n" not in message, message


def _cifar_batch(root: Path, batch: object) -> Path:
    """A valid cifar-10-batches-py whose data_batch_2 is replaced by `batch` (8 images, as _write_cifar10 writes)."""
    _write_cifar10(root)
    file = root / "cifar-10-batches-py" / "data_batch_2"
    _pickle(file, batch)
    return file


def _batch(**entries: object) -> dict:
    return {"batch_label": "b", "labels": [1] * 8, "data": RNG.integers(0, 256, (8, 3072), dtype=np.uint8), **entries}


@pytest.mark.parametrize("top", [[1, 2, 3], None, (_batch(),)])
def test_cifar_batch_that_is_not_a_dict(tmp_path: Path, top: object) -> None:
    file = _cifar_batch(tmp_path, top)
    _refused("cifar10", tmp_path, file, "expected a dict with 'data' and 'labels'")


def test_cifar_batch_without_its_labels(tmp_path: Path) -> None:
    file = _cifar_batch(tmp_path, {"data": _batch()["data"], "coarse_labels": [0] * 8})
    _refused("cifar10", tmp_path, file, "has no 'labels' entry")


@pytest.mark.parametrize("labels,problem", [
    ([1] * 3, "3 labels for 8 images"),
    ([1] * 9, "9 labels for 8 images"),
    ({1: 2}, "integer class ids, got object"),
    ([[1, 2]] * 8, r"integer class ids, got int64 of shape \(8, 2\)"),
    ([2**70] * 8, "integer class ids, got object"),
    ([1.7] * 8, "integer class ids, got float64"),
    ([1.0] * 8, "integer class ids, got float64"),  # real batches hold python ints
    ([1, 2, [3]] + [0] * 5, "not a rectangular array"),
    ([10] * 8, r"labels outside 0\.\.9"),
])
def test_cifar_labels_must_be_one_integer_class_id_per_image(tmp_path: Path, labels: object, problem: str) -> None:
    file = _cifar_batch(tmp_path, _batch(labels=labels))
    _refused("cifar10", tmp_path, file, f"'labels': .*{problem}")


@pytest.mark.parametrize("data,problem", [
    (np.full((8, 3072), 300.7), "got float64"),
    (np.full((8, 3072), np.nan), "got float64"),
    (np.ones((8, 3072), bool), "got bool"),
    (np.ones((8, 3072), complex), "got complex128"),
    (np.full((8, 3072), 1000, np.int64), r"pixel values must lie in 0\.\.255, found 1000\.\.1000"),
    (np.full((8, 3072), -5, np.int64), r"found -5\.\.-5"),
    ([[300] * 3072] * 8, r"found 300\.\.300"),
    (np.zeros((8, 3, 1024), np.uint8), r"expected N×3072 uint8 images, got uint8 of shape \(8, 3, 1024\)"),
    ("hello", "got <U5"),
])
def test_cifar_data_must_be_uint8_pixels(tmp_path: Path, data: object, problem: str) -> None:
    file = _cifar_batch(tmp_path, _batch(data=data))
    _refused("cifar10", tmp_path, file, f"'data': .*{problem}")


def test_cifar100_checks_fine_labels(tmp_path: Path) -> None:
    folder = tmp_path / "cifar-100-python"
    folder.mkdir()
    for split in ("train", "test"):
        _pickle(folder / split, {"data": np.zeros((6, 3072), np.uint8), "fine_labels": [99] * 6, "coarse_labels": [0]})
    _pickle(folder / "meta", {"fine_label_names": []})
    _pickle(folder / "train", {"data": np.zeros((6, 3072), np.uint8), "fine_labels": [99] * 5})
    _refused("cifar100", tmp_path, folder / "train", "'fine_labels': 5 labels for 6 images")


def test_cifar_batch_with_no_images_still_loads(tmp_path: Path) -> None:
    """Protocol 2 writes an empty array's buffer as `bytes()`: that is data, not code."""
    _cifar_batch(tmp_path, _batch(data=np.zeros((0, 3072), np.uint8), labels=[]))
    assert len(load_dataset("cifar10", tmp_path).x_train) == 32


def test_deep_or_self_referencing_pickles_are_data_errors(tmp_path: Path) -> None:
    depth = 100_000  # lists nested this deep: the pickle opcodes build them without recursion
    file = _cifar_batch(tmp_path, None)
    file.write_bytes(b"\x80\x02" + b"]" * depth + b"a" * (depth - 1) + b".")
    _refused("cifar10", tmp_path, file, "expected a dict .*got list")
    cycle: list = []
    cycle.append(cycle)
    _pickle(file, _batch(data=cycle))
    _refused("cifar10", tmp_path, file, "'data': not a rectangular array of numbers")


def _medmnist(root: Path, **changes: np.ndarray) -> Path:
    """A pathmnist.npz (RGB 28×28, 9 classes) with some of its arrays replaced."""
    arrays = _write_medmnist(root, "pathmnist", 3)
    np.savez(root / "pathmnist.npz", **{**arrays, **changes})
    return root / "pathmnist.npz"


@pytest.mark.parametrize("key,images,problem", [
    ("train_images", np.zeros((30, 784), np.uint8), r"expected N×28×28×3 uint8 images, got uint8 of shape \(30, 784\)"),
    ("train_images", np.zeros((30, 28, 28, 3, 1), np.uint8), r"shape \(30, 28, 28, 3, 1\)"),
    ("train_images", np.array(["x"] * 30), "got <U1"),
    ("train_images", np.zeros((30, 7, 7, 3), np.uint8), r"shape \(30, 7, 7, 3\)"),  # test images are 28×28
    ("test_images", np.zeros((10, 28, 28), np.uint8), r"shape \(10, 28, 28\)"),  # gray; train is RGB
    ("train_images", np.zeros((30, 28, 28, 5), np.uint8), r"shape \(30, 28, 28, 5\)"),
    ("train_images", np.full((30, 28, 28, 3), np.nan, np.float32), "got float32"),
    ("val_images", np.full((6, 28, 28, 3), 256, np.int64), r"pixel values must lie in 0\.\.255"),
])
def test_medmnist_images_must_be_uint8_of_the_sets_shape(tmp_path: Path, key: str, images: np.ndarray,
                                                         problem: str) -> None:
    file = _medmnist(tmp_path, **{key: images})
    _refused("pathmnist", tmp_path, file, f"{key}: .*{problem}", merge_val=key == "val_images")


@pytest.mark.parametrize("key,labels,problem", [
    ("train_labels", np.zeros((10, 1), np.uint8), "10 labels for 30 images"),
    ("train_labels", np.zeros((30, 2), np.uint8), r"N or N×1 integer class ids, got uint8 of shape \(30, 2\)"),
    ("test_labels", np.zeros(12, np.int64), "12 labels for 10 images"),
    ("train_labels", np.full((30, 1), 1.7), "got float64"),
    ("train_labels", np.full((30, 1), np.nan), "got float64"),
    ("train_labels", np.array([["a"]] * 30), "got <U1"),
    ("test_labels", np.full((10, 1), 9, np.uint8), r"labels outside 0\.\.8"),
])
def test_medmnist_labels_must_be_one_class_id_per_image(tmp_path: Path, key: str, labels: np.ndarray,
                                                        problem: str) -> None:
    file = _medmnist(tmp_path, **{key: labels})
    _refused("pathmnist", tmp_path, file, f"{key}: .*{problem}")


def test_unreadable_medmnist_file_is_named(tmp_path: Path) -> None:
    (tmp_path / "pathmnist.npz").write_bytes(b"PK\x03\x04 truncated")
    _refused("pathmnist", tmp_path, tmp_path / "pathmnist.npz", "could not read .*BadZipFile")


def _mnist(root: Path, **changes: np.ndarray) -> Path:
    """MNIST/raw with 20 train and 6 test images; `changes` replaces train_x, train_y, t10k_x or t10k_y."""
    raw = root / "MNIST" / "raw"
    arrays = {"train_x": RNG.integers(0, 256, (20, 28, 28)), "train_y": RNG.integers(0, 10, 20),
              "t10k_x": RNG.integers(0, 256, (6, 28, 28)), "t10k_y": RNG.integers(0, 10, 6), **changes}
    for split in ("train", "t10k"):
        _idx(raw / f"{split}-images-idx3-ubyte", arrays[f"{split}_x"])
        _idx(raw / f"{split}-labels-idx1-ubyte", arrays[f"{split}_y"])
    return raw


@pytest.mark.parametrize("change,file,problem", [
    ({"train_y": np.zeros(15)}, "train-labels-idx1-ubyte", "15 labels for 20 images"),
    ({"t10k_y": np.zeros(8)}, "t10k-labels-idx1-ubyte", "8 labels for 6 images"),
    ({"train_y": np.full(20, 200)}, "train-labels-idx1-ubyte", r"labels outside 0\.\.9 \(found 200\.\.200\)"),
    ({"t10k_x": np.zeros((6, 14, 14))}, "t10k-images-idx3-ubyte", r"expected N×28×28 uint8 images, .*\(6, 14, 14\)"),
    ({"train_x": np.zeros((20, 784))}, "train-images-idx3-ubyte", r"\(20, 784\)"),
    ({"train_y": np.zeros((20, 2))}, "train-labels-idx1-ubyte", r"integer class ids, got uint8 of shape \(20, 2\)"),
])
def test_mnist_idx_files_must_agree(tmp_path: Path, change: dict, file: str, problem: str) -> None:
    raw = _mnist(tmp_path, **change)
    _refused("mnist", tmp_path, raw / file, problem)


def test_unreadable_idx_file_is_named(tmp_path: Path) -> None:
    raw = _mnist(tmp_path)
    for header in (struct.pack(">IIII", 0x0803, 20, 28, 28) + b"\0" * 100, b""):  # truncated, empty
        (raw / "train-images-idx3-ubyte").write_bytes(header)
        _refused("mnist", tmp_path, raw, "train-images-idx3-ubyte: not a readable IDX file")


@pytest.mark.parametrize("label", [0, 27])
def test_emnist_letters_labels_are_1_to_26(tmp_path: Path, label: int) -> None:
    raw = tmp_path / "EMNIST" / "raw"
    for split, n in (("train", 12), ("test", 4)):
        _idx(raw / f"emnist-letters-{split}-images-idx3-ubyte", RNG.integers(0, 256, (n, 28, 28)))
        _idx(raw / f"emnist-letters-{split}-labels-idx1-ubyte", np.full(n, label))
    _refused("emnist", tmp_path, raw / "emnist-letters-train-labels-idx1-ubyte",
             rf"labels outside 1\.\.26 \(found {label}\.\.{label}\)", split="letters")


def _svhn(root: Path, **train: np.ndarray) -> Path:
    """train_32x32.mat (X: 32×32×3×N uint8, y: N×1 in 1..10) and test_32x32.mat; `train` replaces X or y."""
    from scipy.io import savemat

    for split, n in (("train", 15), ("test", 5)):
        arrays = {"X": RNG.integers(0, 256, (32, 32, 3, n), dtype=np.uint8),
                  "y": RNG.integers(1, 11, (n, 1)).astype(np.uint8)}
        savemat(root / f"{split}_32x32.mat", {**arrays, **(train if split == "train" else {})})
    return root / "train_32x32.mat"


@pytest.mark.parametrize("change,problem", [
    ({"X": np.full((32, 32, 3, 15), 300.5)}, "'X': expected 32×32×3×N uint8 images, got float64"),
    ({"X": np.zeros((15, 32, 32, 3), np.uint8)}, r"'X': .*shape \(15, 32, 32, 3\)"),
    ({"y": np.full((15, 1), 1.7)}, "'y': expected N or N×1 integer class ids, got float64"),
    ({"y": np.ones((10, 1), np.uint8)}, "'y': 10 labels for 15 images"),
    ({"y": np.ones((15, 2), np.uint8)}, r"'y': .*shape \(15, 2\)"),
    ({"y": np.zeros((15, 1), np.uint8)}, r"'y': labels outside 1\.\.10 \(found 0\.\.0\)"),  # SVHN has no label 0
])
def test_svhn_mat_arrays_are_checked(tmp_path: Path, change: dict, problem: str) -> None:
    file = _svhn(tmp_path, **change)
    _refused("svhn", tmp_path, file, problem)


def test_empty_svhn_file_is_a_data_error(tmp_path: Path) -> None:
    _svhn(tmp_path)
    (tmp_path / "train_32x32.mat").write_bytes(b"")
    _refused("svhn", tmp_path, tmp_path, "train_32x32.mat: Mat file appears to be truncated")


def test_a_pickle_still_cannot_call_bytes_with_an_argument(tmp_path: Path) -> None:
    file = _cifar_batch(tmp_path, None)
    file.write_bytes(b"\x80\x02c__builtin__\nbytes\nJ\x00\x00\x00\x40\x85R.")  # bytes(2**30)
    _refused("cifar10", tmp_path, tmp_path / "cifar-10-batches-py", "data_batch_2.*refusing to call bytes")
    assert pickle.loads(b"\x80\x02c__builtin__\nbytes\nK\x03\x85R.") == b"\0\0\0"  # the control: plain pickle does


@pytest.mark.parametrize("empty,split", [([f"data_batch_{i}" for i in range(1, 6)], "training"),
                                         (["test_batch"], "test")])
def test_a_split_with_no_images_is_refused_naming_the_folder(tmp_path: Path, empty: list[str], split: str) -> None:
    """Batches that are well formed but empty: refused at load, not later as '20 clients but only 0 samples'."""
    _write_cifar10(tmp_path)
    for name in empty:
        _pickle(tmp_path / "cifar-10-batches-py" / name, _batch(labels=[], data=np.zeros((0, 3072), np.uint8)))
    _refused("cifar10", tmp_path, tmp_path, rf"^cifar10: no {split} samples \(data\.root=")
