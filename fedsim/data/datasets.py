"""Built-in dataset loaders, registered by name; each returns normalised float32 N×C×H×W images.

Third-party readers (torchvision, medmnist) are imported lazily so `import fedsim.data` stays fast, and
every failure of theirs becomes a one-line `DataError` that says which files are expected where.

Integrity: the md5 of CIFAR and SVHN files is checked when `download` is true (so a corrupt file is fetched
again) or when the option `verify=True` is given; otherwise files already on disk are taken as given
(re-hashing ~180 MB per run buys nothing, and it would reject legitimate re-packed or subset copies).
CIFAR's pickled batches are read as data (`fedsim.data.safe_pickle`): a file that names any code is refused.
A truncated file is reported as a DataError.
"""

from __future__ import annotations

import importlib.util
import pickle
import re
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.config.limits import MAX_CLASSES, MAX_SAMPLES, MAX_SEED
from fedsim.data._images import (
    as_unit_float,
    channel_stats,
    normalise_,
    resize,
    to_nchw,
)
from fedsim.data.labels import checked_labels
from fedsim.data.registry import Dataset, register_dataset
from fedsim.data.safe_npy import check_archive, npz_array, npz_header
from fedsim.data.safe_pickle import load_pickle_data
from fedsim.data.synthetic import make_synthetic
from fedsim.errors import ConfigError, DataError, FedsimError
from fedsim.extras import require
from fedsim.memory import check_arrays
from fedsim.persist.storage import instead_of_a_file

CIFAR10_STATS = ((0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616))
CIFAR100_STATS = ((0.5071, 0.4865, 0.4409), (0.2673, 0.2564, 0.2762))
MNIST_STATS = ((0.1307,), (0.3081,))
FASHIONMNIST_STATS = ((0.2860,), (0.3530,))
EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10, "mnist": 10}
# What torchvision, medmnist and numpy raise for absent, truncated or malformed files (and offline downloads).
_READ_ERRORS = (
    RuntimeError, OSError, ValueError, KeyError, IndexError, TypeError, EOFError, AssertionError,
    pickle.UnpicklingError, zipfile.BadZipFile,
)
DOWNLOAD_HINT = "or set data.download: true to fetch them when online"
REFETCH_HINT = "delete it and set data.download: true to fetch a fresh copy"


def _one_line(err: BaseException) -> str:
    text = re.sub(r"\s+", " ", str(err)).strip()
    return f"{type(err).__name__}: {text[:300]}" if text else type(err).__name__


def _guarded(name: str, folder: Path, files: list[str], download: bool, load: Callable[[], Any]) -> Any:
    """Run a third-party reader; turn its failure into a one-line DataError naming the expected files."""
    try:
        return load()
    except FedsimError:
        raise
    except _READ_ERRORS as err:
        reason = _one_line(err)
        missing = [f for f in files if not (folder / f).is_file()]
    if missing:
        shown = ", ".join(missing[:3]) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        where = f"files not found: expected {shown} in {folder}"
        if download:
            raise DataError(f"{name}: download failed ({reason}); {where}; put them there by hand") from None
        raise DataError(f"{name}: {where}; put them there, {DOWNLOAD_HINT}") from None
    if len(files) == 1:  # name the file itself
        raise DataError(f"{name}: could not read {folder / files[0]} ({reason}); {REFETCH_HINT}") from None
    raise DataError(
        f"{name}: could not read the files in {folder} ({reason}); delete them and set data.download: true "
        "to fetch fresh copies"
    ) from None


def _bad(where: str, problem: str) -> DataError:
    """A one-line DataError for a file that reads but holds the wrong thing; `where` names the set, file and entry."""
    return DataError(f"{where}: {problem}; {REFETCH_HINT}")


def _as_array(value: Any, where: str) -> np.ndarray:
    """`value` read from a file (an array or nested lists) as an ndarray; a ragged or cyclic list is a DataError."""
    try:
        return np.asarray(value)
    except (ValueError, TypeError, OverflowError, RecursionError) as err:
        raise _bad(where, f"not a rectangular array of numbers ({type(err).__name__})") from None


def _pixels(x: Any, shape: tuple[int | None, ...], where: str) -> np.ndarray:
    """Images as uint8 once they have `shape` (None: the sample count) and whole-number pixels in 0..255, as the
    real files store them: other values would wrap around when cast, other shapes break training later."""
    x = _as_array(x, where)
    fits = x.ndim == len(shape) and all(want in (None, got) for want, got in zip(shape, x.shape))
    if not fits or not np.issubdtype(x.dtype, np.integer):
        dims = "×".join("N" if d is None else str(d) for d in shape)
        raise _bad(where, f"expected {dims} uint8 images, got {x.dtype} of shape {x.shape}")
    if x.dtype != np.uint8 and x.size and (x.min() < 0 or x.max() > 255):  # skips two passes over big uint8 sets
        raise _bad(where, f"pixel values must lie in 0..255, found {x.min()}..{x.max()}")
    return x.astype(np.uint8, copy=False)


def _class_ids(y: Any, images: int, num_classes: int, where: str, first: int = 0) -> np.ndarray:
    """One integer class id in first..first+num_classes-1 per image (1-d, or N×1 as MedMNIST stores them), as
    int64 shifted to start at 0."""
    y = _as_array(y, where)
    ids = y[:, 0] if y.ndim == 2 and y.shape[1] == 1 else y
    if ids.ndim != 1 or not (np.issubdtype(ids.dtype, np.integer) or ids.size == 0):  # [] reads as float64
        raise _bad(where, f"expected N or N×1 integer class ids, got {y.dtype} of shape {y.shape}")
    if len(ids) != images:
        raise _bad(where, f"{len(ids)} labels for {images} images (one per image expected)")
    if len(ids) and (ids.min() < first or ids.max() >= first + num_classes):
        raise _bad(where, f"labels outside {first}..{first + num_classes - 1} (found {ids.min()}..{ids.max()})")
    return ids.astype(np.int64) - first


def _entry(mapping: dict, key: str, where: str) -> Any:
    """`mapping[key]`, or a DataError naming the file and the missing entry."""
    if key not in mapping:
        raise _bad(where, f"has no {key!r} entry")
    return mapping[key]


def _finish(
    name: str,
    x_train: np.ndarray,
    y_train: np.ndarray,
    x_test: np.ndarray,
    y_test: np.ndarray,
    num_classes: int,
    stats: tuple[tuple[float, ...], tuple[float, ...]] | None = None,
    scale: float = 255.0,
    channels_last: bool = False,
    **extras: Any,
) -> Dataset:
    """Lay out, scale and normalise images (with `stats`, or the train set's own per-channel statistics)."""
    xs = [as_unit_float(to_nchw(x, channels_last), scale) for x in (x_train, x_test)]
    mean, std = stats if stats is not None else channel_stats(xs[0])
    ys = [np.asarray(y).reshape(-1).astype(np.int64) for y in (y_train, y_test)]
    for y in ys:
        if len(y) and (y.min() < 0 or y.max() >= num_classes):
            raise DataError(f"{name}: labels outside 0..{num_classes - 1} (found {y.min()}..{y.max()})")
    return Dataset(
        name=name,
        x_train=normalise_(xs[0], mean, std),
        y_train=ys[0],
        x_test=normalise_(xs[1], mean, std),
        y_test=ys[1],
        num_classes=num_classes,
        mean=tuple(mean),
        std=tuple(std),
        extras=dict(extras),
    )


# ---------------------------------------------------------------- embedded / generated


@register_dataset("digits", limits={"size": {"ge": 1, "le": 256}})
def load_digits(root: Path, download: bool, *, size: int = 8) -> Dataset:
    """scikit-learn's 1,797 8×8 digits (embedded, no download), stratified 80/20 split with seed 0.

    `size` > 8 upsamples bilinearly (align_corners=False), e.g. 32 so CNNs with several 2× poolings
    still have spatial extent; the default keeps the native 1×8×8.
    """
    from sklearn.datasets import load_digits as sk_digits
    from sklearn.model_selection import train_test_split

    bunch = sk_digits()
    images, labels = bunch.images.astype(np.float32), bunch.target.astype(np.int64)
    x_tr, x_te, y_tr, y_te = train_test_split(images, labels, test_size=0.2, stratify=labels, random_state=0)
    ds = _finish("digits", x_tr, y_tr, x_te, y_te, 10, scale=16.0)
    ds.x_train, ds.x_test = resize(ds.x_train, size), resize(ds.x_test, size)
    return ds


@register_dataset("synthetic", limits={
    "n_train": {"ge": 1, "le": MAX_SAMPLES}, "n_test": {"ge": 0, "le": MAX_SAMPLES}, "channels": {"ge": 1, "le": 64},
    "size": {"ge": 4, "le": 1024}, "num_classes": {"ge": 1, "le": MAX_CLASSES}, "seed": {"ge": 0, "le": MAX_SEED}})
def load_synthetic(
    root: Path,
    download: bool,
    *,
    n_train: int = 20000,
    n_test: int = 2000,
    channels: int = 3,
    size: int = 32,
    num_classes: int = 10,
    seed: int = 0,
    amp: float = 3.0,
) -> Dataset:
    """Shifted class prototypes in Gaussian noise (see fedsim.data.synthetic); identity normalisation."""
    x_tr, y_tr, x_te, y_te = make_synthetic(n_train, n_test, channels, size, num_classes, seed, amp)
    return Dataset("synthetic", x_tr, y_tr, x_te, y_te, num_classes, (0.0,) * channels, (1.0,) * channels)


# ---------------------------------------------------------------- torchvision


def _cifar_batch(raw: Any, label_key: str, num_classes: int, where: str) -> tuple[np.ndarray, np.ndarray]:
    """A python batch's N×3072 uint8 images and their N class ids; any other structure is refused."""
    if not isinstance(raw, dict):
        raise _bad(where, f"expected a dict with 'data' and {label_key!r}, got {type(raw).__name__}")
    batch = {k.decode("latin1") if isinstance(k, bytes) else k: v for k, v in raw.items()}
    images = _pixels(_entry(batch, "data", where), (None, 3072), f"{where} 'data'")
    return images, _class_ids(_entry(batch, label_key, where), len(images), num_classes, f"{where} {label_key!r}")


def _cifar(name: str, root: Path, download: bool, verify: bool, hundred: bool) -> Dataset:
    """CIFAR's python batches, read as data (`load_pickle_data`): torchvision's reader would unpickle any code."""
    from torchvision import datasets as tvd
    from torchvision.datasets.utils import check_integrity, download_and_extract_archive

    stock = tvd.CIFAR100 if hundred else tvd.CIFAR10
    folder = root / stock.base_folder
    files = [f for f, _ in stock.train_list + stock.test_list] + [stock.meta["filename"]]
    label_key = "fine_labels" if hundred else "labels"
    classes = 100 if hundred else 10

    def read(entries: list[list[str]]) -> tuple[np.ndarray, np.ndarray]:
        xs: list[np.ndarray] = []
        ys: list[np.ndarray] = []
        for filename, md5 in entries:
            if (download or verify) and not check_integrity(str(folder / filename), md5):
                raise ValueError(f"{filename} fails its md5 check")
            try:
                raw = load_pickle_data(folder / filename)
            except DataError as exc:  # reported with the folder and the fix, like any unreadable file
                raise ValueError(str(exc).replace(str(folder) + "/", "")) from None
            x, y = _cifar_batch(raw, label_key, classes, f"{name}: {folder / filename}")
            xs.append(x.reshape(-1, 3, 32, 32))
            ys.append(y)
        return np.concatenate(xs).transpose(0, 2, 3, 1), np.concatenate(ys)

    def load() -> tuple:
        if download and not all((folder / f).is_file() for f in files):
            download_and_extract_archive(stock.url, str(root), filename=stock.filename, md5=stock.tgz_md5)
        return (*read(stock.train_list), *read(stock.test_list))

    x_tr, y_tr, x_te, y_te = _guarded(name, folder, files, download, load)
    stats = CIFAR100_STATS if hundred else CIFAR10_STATS
    return _finish(name, x_tr, y_tr, x_te, y_te, classes, stats, channels_last=True)


@register_dataset("cifar10")
def load_cifar10(root: Path, download: bool, *, verify: bool = False) -> Dataset:
    """CIFAR-10 from `<root>/cifar-10-batches-py` (python pickle batches); standard CIFAR-10 mean/std."""
    return _cifar("cifar10", root, download, verify, hundred=False)


@register_dataset("cifar100")
def load_cifar100(root: Path, download: bool, *, verify: bool = False) -> Dataset:
    """CIFAR-100 (fine labels) from `<root>/cifar-100-python`; standard CIFAR-100 mean/std."""
    return _cifar("cifar100", root, download, verify, hundred=True)


def _idx(name: str, root: Path, download: bool, cls_name: str, files: list[str], num_classes: int,
         first_label: int = 0, **kwargs: Any) -> tuple:
    """An MNIST-family set from raw IDX `files` (train images, labels, test images, labels) in <root>/<Class>/raw:
    28×28 uint8 images and one class id per image (`first_label`.. shifted to 0..). Read file by file, so an
    error names its file; torchvision's class only downloads them."""
    from torchvision import datasets as tvd
    from torchvision.datasets.mnist import read_sn3_pascalvincent_tensor

    folder = root / cls_name / "raw"

    def read(filename: str) -> np.ndarray:
        try:
            return read_sn3_pascalvincent_tensor(str(folder / filename), strict=False).numpy()
        except _READ_ERRORS as err:  # reported with the folder and the fix, like any unreadable file
            raise ValueError(f"{filename}: not a readable IDX file ({_one_line(err)})") from None

    def load() -> list[np.ndarray]:
        if download and not all((folder / f).is_file() for f in files):
            getattr(tvd, cls_name)(str(root), train=True, download=True, **kwargs)
        return [read(f) for f in files]

    arrays = _guarded(name, folder, files, download, load)
    checked = []
    for x, y, image_file, label_file in zip(arrays[::2], arrays[1::2], files[::2], files[1::2]):
        images = _pixels(x, (None, 28, 28), f"{name}: {folder / image_file}")
        labels = _class_ids(y, len(images), num_classes, f"{name}: {folder / label_file}", first_label)
        checked += [images, labels]
    return tuple(checked)


_MNIST_FILES = [f"{s}-{k}-ubyte" for s in ("train", "t10k") for k in ("images-idx3", "labels-idx1")]


@register_dataset("mnist")
def load_mnist(root: Path, download: bool) -> Dataset:
    """MNIST from raw IDX files in `<root>/MNIST/raw`; the usual mean 0.1307, std 0.3081."""
    x_tr, y_tr, x_te, y_te = _idx("mnist", root, download, "MNIST", _MNIST_FILES, 10)
    return _finish("mnist", x_tr, y_tr, x_te, y_te, 10, MNIST_STATS)


@register_dataset("fashionmnist")
def load_fashionmnist(root: Path, download: bool) -> Dataset:
    """Fashion-MNIST from raw IDX files in `<root>/FashionMNIST/raw`; mean 0.2860, std 0.3530."""
    x_tr, y_tr, x_te, y_te = _idx("fashionmnist", root, download, "FashionMNIST", _MNIST_FILES, 10)
    return _finish("fashionmnist", x_tr, y_tr, x_te, y_te, 10, FASHIONMNIST_STATS)


@register_dataset("emnist")
def load_emnist(root: Path, download: bool, *, split: str = "balanced") -> Dataset:
    """EMNIST `split` from `<root>/EMNIST/raw`, images transposed upright; `letters` labels shifted to 0..25."""
    if split not in EMNIST_CLASSES:
        raise ConfigError(f"data.options.split: unknown EMNIST split {split!r}; choose one of {list(EMNIST_CLASSES)}")
    files = [f"emnist-{split}-{s}-{k}-ubyte" for s in ("train", "test") for k in ("images-idx3", "labels-idx1")]
    first_label = 1 if split == "letters" else 0  # the raw letters are 1..26 (torchvision keeps an unused 0, 'N/A')
    x_tr, y_tr, x_te, y_te = _idx("emnist", root, download, "EMNIST", files, EMNIST_CLASSES[split], first_label,
                                  split=split)
    x_tr, x_te = x_tr.transpose(0, 2, 1), x_te.transpose(0, 2, 1)  # the raw EMNIST files are column-major
    return _finish("emnist", x_tr, y_tr, x_te, y_te, EMNIST_CLASSES[split], split=split)


@register_dataset("svhn")
def load_svhn(root: Path, download: bool, *, extra: bool = False, verify: bool = False) -> Dataset:
    """SVHN cropped digits from `<root>/{train,test}_32x32.mat` (+ extra_32x32.mat into train if `extra`).

    Read with scipy (X: 32×32×3×N uint8, y: N×1 labels 1..10, 10 for digit 0) rather than torchvision's SVHN,
    which casts whatever X and y hold; torchvision still downloads and checks md5s."""
    from scipy.io import loadmat
    from scipy.io.matlab import MatReadError
    from torchvision import datasets as tvd
    from torchvision.datasets.utils import check_integrity, download_url

    splits = ["train", "test"] + (["extra"] if extra else [])

    def read(split: str) -> dict:
        url, filename, md5 = tvd.SVHN.split_list[split]
        if download:
            download_url(url, str(root), filename, md5)  # skipped when the file is there with this md5
        elif verify and not check_integrity(str(root / filename), md5):
            raise ValueError(f"{filename} fails its md5 check")
        try:
            return loadmat(root / filename, variable_names=("X", "y"))
        except (MatReadError, *_READ_ERRORS) as err:  # scipy's MatReadError: e.g. an empty or truncated file
            raise ValueError(f"{filename}: {err}") from None

    mats = _guarded("svhn", root, [f"{s}_32x32.mat" for s in splits], download, lambda: {s: read(s) for s in splits})
    xs, ys = {}, {}
    for s in splits:
        where = f"svhn: {root / f'{s}_32x32.mat'}"
        xs[s] = _pixels(_entry(mats[s], "X", where), (32, 32, 3, None), f"{where} 'X'").transpose(3, 2, 0, 1)
        # 1..10 in the file, shifted to 0..9 (digit d at d - 1, digit 0 at 9); then digit d is class d again
        ys[s] = (_class_ids(_entry(mats[s], "y", where), len(xs[s]), 10, f"{where} 'y'", first=1) + 1) % 10
    train = [s for s in splits if s != "test"]
    x_tr, y_tr = np.concatenate([xs[s] for s in train]), np.concatenate([ys[s] for s in train])
    return _finish("svhn", x_tr, y_tr, xs["test"], ys["test"], 10)


# ---------------------------------------------------------------- MedMNIST


def _medmnist_info() -> dict:
    """medmnist.INFO without importing medmnist's torch-heavy dataset module."""
    spec = importlib.util.find_spec("medmnist")
    if spec is None or not spec.submodule_search_locations:
        return {}
    info_path = Path(next(iter(spec.submodule_search_locations))) / "info.py"
    info_spec = importlib.util.spec_from_file_location("_fedsim_medmnist_info", info_path)
    if info_spec is None or info_spec.loader is None:
        return {}
    module = importlib.util.module_from_spec(info_spec)
    try:
        info_spec.loader.exec_module(module)
    except (OSError, ImportError):  # a medmnist without info.py: offer no MedMNIST sets rather than fail import
        return {}
    return getattr(module, "INFO", {})


def _load_medmnist(flag: str, root: Path, download: bool, size: int, as_rgb: bool, merge_val: bool) -> Dataset:
    medmnist = require("medmnist", "medmnist", f"data.name: {flag}")
    from medmnist.dataset import MedMNIST2D

    info = medmnist.INFO[flag]
    cls = getattr(medmnist, info["python_class"])
    if not issubclass(cls, MedMNIST2D):
        raise ConfigError(f"data.name: {flag} is not a 2D MedMNIST set")
    if size not in cls.available_sizes:
        raise ConfigError(f"data.options.size: {flag} comes in sizes {cls.available_sizes}, not {size}")
    filename = f"{flag}{'' if size == 28 else f'_{size}'}.npz"
    splits = ["train", "val", "test"] if merge_val else ["train", "test"]

    def load() -> dict:
        return {s: cls(split=s, root=str(root), download=download and s == "train", size=size) for s in splits}

    if download:
        root.mkdir(parents=True, exist_ok=True)  # medmnist refuses a root that does not exist
    sets = _guarded(flag, root, [filename], download, load)
    channels, classes, where = info["n_channels"], len(info["label"]), f"{flag}: {root / filename}"
    shape = (None, size, size) if channels == 1 else (None, size, size, channels)  # so train and test agree
    xs = {s: _pixels(sets[s].imgs, shape, f"{where} {s}_images") for s in splits}
    ys = {s: _class_ids(sets[s].labels, len(xs[s]), classes, f"{where} {s}_labels") for s in splits}
    train = [s for s in splits if s != "test"]
    x_tr, y_tr = np.concatenate([xs[s] for s in train]), np.concatenate([ys[s] for s in train])
    x_te, y_te = xs["test"], ys["test"]
    if as_rgb and x_tr.ndim == 3:
        x_tr, x_te = np.repeat(x_tr[..., None], 3, axis=-1), np.repeat(x_te[..., None], 3, axis=-1)
    return _finish(flag, x_tr, y_tr, x_te, y_te, classes, channels_last=x_tr.ndim == 4)


def _medmnist_loader(flag: str) -> Callable[..., Dataset]:
    def load(root: Path, download: bool, *, size: int = 28, as_rgb: bool = False, merge_val: bool = False) -> Dataset:
        """MedMNIST 2D set from `<root>/<flag>[_<size>].npz` read by medmnist; the official val split is
        dropped unless `merge_val`; `as_rgb` repeats gray channels; train-set per-channel mean/std."""
        return _load_medmnist(flag, root, download, size, as_rgb, merge_val)

    load.__name__ = f"load_{flag}"
    return load


# The single-label 2D MedMNIST sets, known by name without medmnist installed, so that a config naming one is told
# which extra to install; with medmnist installed, its own INFO decides.
MEDMNIST_2D = ("pathmnist", "dermamnist", "octmnist", "pneumoniamnist", "retinamnist", "breastmnist", "bloodmnist",
               "tissuemnist", "organamnist", "organcmnist", "organsmnist")


def _needs_medmnist(flag: str) -> Callable[[dict], None]:
    """A config check for `flag` that fails, naming the extra, when medmnist is not installed."""
    def check(options: dict) -> None:
        require("medmnist", "medmnist", f"data.name: {flag}")

    return check


def _register_medmnist() -> list[str]:
    """Register every single-label 2D MedMNIST flag (ChestMNIST is multi-label and is left out)."""
    if importlib.util.find_spec("medmnist") is None:
        for flag in MEDMNIST_2D:
            register_dataset(flag, check=_needs_medmnist(flag))(_medmnist_loader(flag))
        return list(MEDMNIST_2D)
    flags = []
    for flag, info in _medmnist_info().items():
        if info["python_class"].endswith("3D") or info["task"].startswith("multi-label"):
            continue
        register_dataset(flag)(_medmnist_loader(flag))
        flags.append(flag)
    return flags


MEDMNIST_FLAGS = _register_medmnist()


# ---------------------------------------------------------------- user files

NPZ_KEYS = ("x_train", "y_train", "x_test", "y_test")


@register_dataset("npz", limits={"num_classes": {"ge": 1, "le": MAX_CLASSES}})
def load_npz(root: Path, download: bool, *, path: str | None = None, num_classes: int | None = None) -> Dataset:
    """A user's `.npz` with x_train, y_train, x_test, y_test; images N×H×W or N×H×W×C (N×C×H×W if C<=4<W).

    uint8 pixels are scaled to [0, 1], other numbers kept; both sets are normalised with the train set's
    per-channel mean/std. A relative `path` that does not exist is looked up under `root`.
    """
    if not path:
        raise ConfigError("data.options.path: dataset 'npz' needs path: <file.npz>")
    file = Path(path).expanduser()
    if not file.is_absolute() and not file.exists() and (root / file).exists():
        file = root / file
    if not file.is_file():
        what = instead_of_a_file(file)
        raise DataError(f"npz: {file}: {what} (data.options.path)" if what else f"npz: file not found: {file}")
    check_archive(file, "npz", "data.options.path")
    try:
        with np.load(file, allow_pickle=False) as data:
            missing = [k for k in NPZ_KEYS if k not in data.files]
            if missing:
                raise DataError(
                    f"npz: {file} has no key {missing[0]!r} (it has {sorted(data.files)}; needs {list(NPZ_KEYS)})"
                )
            check_arrays({k: npz_header(data, k, f"npz: {file}") for k in NPZ_KEYS}, f"npz: {file}",
                         "data.options.path")
            arrays = {k: npz_array(data, k, f"npz: {file}") for k in NPZ_KEYS}
    except FedsimError:
        raise
    except (*_READ_ERRORS, MemoryError) as err:
        raise DataError(f"npz: could not read {file} ({_one_line(err)})") from None
    images = {k: _npz_images(file, k, arrays[k]) for k in ("x_train", "x_test")}
    labels = {k: _npz_labels(file, k, arrays[k]) for k in ("y_train", "y_test")}
    for xk, yk in (("x_train", "y_train"), ("x_test", "y_test")):
        if len(images[xk]) != len(labels[yk]):
            raise DataError(f"npz: {file}: {xk} has {len(images[xk])} samples but {yk} has {len(labels[yk])}")
    for key in ("x_train", "x_test"):  # a run trains on one and is evaluated on the other
        if len(images[key]) == 0:
            raise DataError(f"npz: {file}: {key} holds no samples (shape {arrays[key].shape})")
    if images["x_test"].shape[1:] != images["x_train"].shape[1:]:
        raise DataError(
            f"npz: {file}: x_test images are {images['x_test'].shape[1:]} but x_train images are "
            f"{images['x_train'].shape[1:]} (C×H×W)"
        )
    found = int(max(labels["y_train"].max(), labels["y_test"].max(initial=0))) + 1
    samples = len(labels["y_train"]) + len(labels["y_test"])
    if found > samples:
        key = "y_train" if labels["y_train"].max() + 1 == found else "y_test"
        raise DataError(f"npz: {file}: {key} has class id {found - 1}, but there are only {samples} samples; "
                        "class ids must be 0..C-1 with C at most the number of samples")
    if num_classes is not None and num_classes < found:
        raise ConfigError(f"data.options.num_classes: {num_classes} but {file} has labels up to {found - 1}")
    scale = 255.0 if arrays["x_train"].dtype == np.uint8 else 1.0
    if arrays["x_test"].dtype != arrays["x_train"].dtype:
        raise DataError(f"npz: {file}: x_test is {arrays['x_test'].dtype} but x_train is {arrays['x_train'].dtype}")
    return _finish("npz", images["x_train"], labels["y_train"], images["x_test"], labels["y_test"],
                   num_classes or found, scale=scale, path=str(file))


def _npz_images(file: Path, key: str, x: np.ndarray) -> np.ndarray:
    """Validate one image array and return it N×C×H×W (not yet scaled)."""
    numeric = (np.issubdtype(x.dtype, np.integer) or np.issubdtype(x.dtype, np.floating)) or x.dtype == bool
    if x.ndim not in (3, 4) or not numeric:
        raise DataError(f"npz: {file}: {key} must be real numbers N×H×W or N×H×W×C, got {x.dtype} {x.shape}")
    if 0 in x.shape[1:]:
        raise DataError(f"npz: {file}: {key} images have no pixels (shape {x.shape})")
    if np.issubdtype(x.dtype, np.floating) and not np.isfinite(x).all():
        raise DataError(f"npz: {file}: {key} contains NaN or infinite values")
    if x.ndim == 4:
        channels_first = x.shape[1] <= 4 < x.shape[3]
        return to_nchw(x, channels_last=not channels_first)
    return to_nchw(x, channels_last=False)


def _npz_labels(file: Path, key: str, y: np.ndarray) -> np.ndarray:
    """Validate class ids: 1-d (or N×1) integers in 0..MAX_CLASSES-1 (integral floats are accepted)."""
    if y.ndim == 2 and y.shape[1] == 1:
        y = y[:, 0]
    if y.ndim != 1:
        raise DataError(f"npz: {file}: {key} must be 1-d class ids, got shape {y.shape}")
    if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
        raise DataError(f"npz: {file}: {key} must hold integer class ids, got {y.dtype}")
    return checked_labels(y, f"npz: {file}: {key}")
