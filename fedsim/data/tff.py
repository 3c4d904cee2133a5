"""TensorFlow Federated's federated EMNIST and CIFAR-100 from the HDF5 files of TFF's archives, read with h5py.

Layout (TFF's `HDF5ClientData`): `<prefix>_{train,test}.h5` hold a group `examples` with one group per client,
`examples/<client_id>/<feature>`; clients are taken in sorted id order, and each client is one natural client
(`Dataset.train_ids`, `client_names`). Only the HDF5 datasets named below are read: nothing in the file runs.

- `tff_emnist`: `fed_emnist[_digitsonly]_{train,test}.h5` (archives fed_emnist.tar.bz2, fed_emnist_digitsonly.tar.bz2;
  3,400 writers and 62 classes, or 3,383 and 10 digits). `pixels` float32 28×28 in [0, 1], `label` int32.
  TFF's pixels are inverted relative to MNIST: the background is 1.0 (white) and the ink 0.0, as in LEAF's FEMNIST
  that TFF derived them from. They are kept as stored (TFF's character-recognition baselines feed them so);
  `invert: true` gives 1 - pixels, MNIST's dark background. Either way the images are then normalised with the
  training set's own mean/std. Writers are in both files, so a test sample's id is its writer's training code.
- `tff_cifar100`: `fed_cifar100_{train,test}.h5` (fed_cifar100.tar.bz2): 500 training clients "0".."499" built from
  CIFAR-100's training images and 100 test clients "0".."99" from its test images, 100 images each. `image` uint8
  32×32×3, `label` (fine, 100 classes) and `coarse_label` (20): option `label: fine|coarse`. A test client is not
  the training client of the same name (TFF drew them from other images), so every test id is -1: the test
  clients form the central test set only, which is all test samples.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedsim.data.datasets import CIFAR100_STATS, _bad, _class_ids, _finish, _guarded, _pixels
from fedsim.data.natural import natural_codes
from fedsim.data.registry import Dataset, register_dataset
from fedsim.extras import require
from fedsim.memory import check_arrays

TFF_ARCHIVES = "https://storage.googleapis.com/tff-datasets-public"


def _h5py(name: str) -> Any:
    """h5py, or one MissingExtraError naming the `tff` extra."""
    return require("h5py", "tff", f"data.name: {name}")


def _needs_h5py(name: str):
    def check(options: dict) -> None:
        _h5py(name)

    return check


def _client_arrays(h5py: Any, file: Path, name: str, image: str, label: str) -> tuple[list[str], list[dict]]:
    """Sorted client ids of `file` and each client's `image` and `label` arrays. A missing group or feature, or one
    that is not an array, is a DataError naming the file and the key; the total size is checked before reading."""
    where = f"{name}: {file}"
    with h5py.File(file, "r") as h5:
        examples = h5.get("examples")
        if not isinstance(examples, h5py.Group):
            raise _bad(where, "has no 'examples' group (TFF's layout is examples/<client_id>/<feature>)")
        clients = sorted(examples.keys())
        if not clients:
            raise _bad(where, "its 'examples' group holds no client")
        nodes = []
        for client in clients:
            group = examples[client]
            if not isinstance(group, h5py.Group):
                raise _bad(where, f"examples/{client} is not a group of features")
            row = {}
            for feature in (image, label):
                node = group.get(feature)
                if not isinstance(node, h5py.Dataset):
                    raise _bad(where, f"examples/{client} has no {feature!r} dataset (it has {sorted(group.keys())})")
                row[feature] = node
            nodes.append(row)
        if nodes:  # images count again as float32, as the loaders hold them
            check_arrays({f"{kind}_{f}": ((sum(row[f].size for row in nodes),), nodes[0][f].dtype)
                          for kind, f in (("x", image), ("y", label))}, where, "data.root")
        arrays = [{f: np.asarray(node[()]) for f, node in row.items()} for row in nodes]
    return clients, arrays


def _read(name: str, root: Path, download: bool, prefix: str, image: str, label: str) -> dict:
    """{split: (client ids, per-client feature arrays)} of `<root>/<prefix>_{train,test}.h5`, fetching TFF's archive
    when `download` is set and a file is missing (its checksum is not checked: TFF publishes sha256, torchvision
    checks md5)."""
    h5py = _h5py(name)
    out = {}
    for split in ("train", "test"):
        filename = f"{prefix}_{split}.h5"

        def load(filename: str = filename) -> tuple:
            if download and not (root / filename).is_file():
                from torchvision.datasets.utils import download_and_extract_archive

                download_and_extract_archive(f"{TFF_ARCHIVES}/{prefix}.tar.bz2", str(root))
            return _client_arrays(h5py, root / filename, name, image, label)

        out[split] = _guarded(name, root, [filename], download, load)
    return out


def _per_client(name: str, file: Path, clients: list[str], arrays: list[dict], feature: str, check) -> np.ndarray:
    """One feature over all clients, each client's array checked by `check(array, where)`, concatenated."""
    parts = [check(row[feature], f"{name}: {file} examples/{client}/{feature}") for client, row in zip(clients, arrays)]
    return np.concatenate(parts) if parts else np.zeros((0,), dtype=np.int64)


def _emnist_pixels(x: np.ndarray, where: str) -> np.ndarray:
    """28×28 float pixels in [0, 1] as TFF stores them."""
    if x.ndim != 3 or x.shape[1:] != (28, 28) or not np.issubdtype(x.dtype, np.floating):
        raise _bad(where, f"expected N×28×28 float pixels, got {x.dtype} of shape {x.shape}")
    if x.size and not (np.isfinite(x).all() and x.min() >= 0 and x.max() <= 1):
        raise _bad(where, f"pixels must lie in [0, 1], found {np.nanmin(x)}..{np.nanmax(x)} (or NaN)")
    return x.astype(np.float32, copy=False)


def _split_arrays(name: str, root: Path, prefix: str, read: dict, image: str, label: str, classes: int,
                  check_image) -> dict:
    """{split: (images, labels, per-sample client names)}, each client's labels one per image and in range."""
    out = {}
    for split, (clients, arrays) in read.items():
        file = root / f"{prefix}_{split}.h5"
        x = _per_client(name, file, clients, arrays, image, check_image)
        counts = []
        ys = []
        for client, row in zip(clients, arrays):
            where = f"{name}: {file} examples/{client}/{label}"
            ys.append(_class_ids(row[label], len(row[image]), classes, where))
            counts.append(len(row[image]))
        y = np.concatenate(ys) if ys else np.zeros(0, dtype=np.int64)
        out[split] = (x, y, np.repeat(np.asarray(clients, dtype=str), counts))
    return out


@register_dataset("tff_emnist", check=_needs_h5py("tff_emnist"))
def load_tff_emnist(root: Path, download: bool, *, only_digits: bool = True, invert: bool = False) -> Dataset:
    """TFF's federated EMNIST from `<root>/fed_emnist[_digitsonly]_{train,test}.h5` (see the module docstring):
    10 digit classes if `only_digits`, else 62; `invert` flips TFF's white background to MNIST's black."""
    prefix = "fed_emnist_digitsonly" if only_digits else "fed_emnist"
    classes = 10 if only_digits else 62
    read = _read("tff_emnist", root, download, prefix, "pixels", "label")
    splits = _split_arrays("tff_emnist", root, prefix, read, "pixels", "label", classes, _emnist_pixels)
    (x_tr, y_tr, n_tr), (x_te, y_te, n_te) = splits["train"], splits["test"]
    if invert:
        x_tr, x_te = 1.0 - x_tr, 1.0 - x_te
    ds = _finish("tff_emnist", x_tr, y_tr, x_te, y_te, classes, scale=1.0, only_digits=only_digits)
    ds.train_ids, ds.test_ids, ds.client_names = natural_codes(n_tr, n_te)
    return ds


@register_dataset("tff_cifar100", check=_needs_h5py("tff_cifar100"))
def load_tff_cifar100(root: Path, download: bool, *, label: Literal["fine", "coarse"] = "fine") -> Dataset:
    """TFF's federated CIFAR-100 from `<root>/fed_cifar100_{train,test}.h5` (see the module docstring): 100 fine
    classes, or the 20 superclasses with `label: coarse`; CIFAR-100's usual mean/std."""
    key, classes = ("label", 100) if label == "fine" else ("coarse_label", 20)
    read = _read("tff_cifar100", root, download, "fed_cifar100", "image", key)

    def images(x: Any, where: str) -> np.ndarray:
        return _pixels(x, (None, 32, 32, 3), where)

    splits = _split_arrays("tff_cifar100", root, "fed_cifar100", read, "image", key, classes, images)
    (x_tr, y_tr, n_tr), (x_te, y_te, _) = splits["train"], splits["test"]
    ds = _finish("tff_cifar100", x_tr, y_tr, x_te, y_te, classes, CIFAR100_STATS, channels_last=True, label=label)
    ds.train_ids, _, ds.client_names = natural_codes(n_tr, n_tr[:0])
    ds.test_ids = np.full(len(y_te), -1, dtype=np.int64)  # TFF's test clients are other people (module docstring)
    return ds

