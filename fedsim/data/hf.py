"""A Hugging Face dataset from a local copy, read with pyarrow: no `datasets` library, nothing in the files runs.

`data.options.path` is one of (the layout is recognised in this order):
  - a `save_to_disk` folder: `dataset_dict.json` naming the splits, each `<split>/state.json` listing its Arrow files
    (`data-00000-of-00001.arrow`, Arrow IPC streams); or one saved split (`state.json` in the folder itself);
  - any folder holding `.parquet`, `.arrow` or `.csv` files, searched recursively: the Hub's layout
    (`data/train-00000-of-00001.parquet`, as `huggingface-cli download` writes it, also under its
    `hub/datasets--<owner>--<name>/snapshots/<revision>`), the parquet converter's `default/train/0000.parquet`,
    the `datasets` cache (`<owner>___<name>/default/0.0.0/<hash>/<name>-train[-00000-of-00002].arrow`), or a
    single CSV such as flwrlabs/shakespeare's `shakespeare.csv`. A file belongs to the split whose name it contains
    as a word (`train`, `femnist-train-00000`, `default/train/`); when no file names a split, all are `train_split`
    (the Hub's rule); one split's files must lie in one folder (two cache versions are refused, not mixed);
  - one such file.

Columns: `x_column` holds images (a Hugging Face `Image`: a struct of PNG/JPEG `bytes` and `path`, or raw bytes),
decoded with PIL, all of one size: 8-bit gray (H×W) or RGB; or text, encoded through LEAF's 80-symbol table
(fedsim.data.letters, shared with the LEAF loader), every row the same length. `label_column` holds integer class
ids (a `ClassLabel`: its names, from the files' metadata, give the class count) or, beside text, the next character
(a one-character string, one of the 80 classes). `id_column` names each sample's natural client (`Dataset.train_ids`,
codes in sorted id order, as Flower's `NaturalIdPartitioner`); without it the set is pooled.

Test set: the `test_split` split. The Flower sets have only `train`: then each client's samples are split as LEAF's
`split_data.py --by_sample` does, `test_fraction` of them (LEAF's default 0.1) held out: n_train = max(1, int((1 -
test_fraction)·n)) (1 when n = 2; clients with one sample keep it for training), drawn with numpy's generator
seeded `split_seed`, client by client in code order (LEAF's sizes, not LEAF's draws); with `temporal` the first
n_train samples train and the test starts L - 1 samples after them (L the text length, 80), LEAF's rule for
Shakespeare, whose overlapping windows would otherwise leak test text into training.

Presets (`preset:`) fill the columns; options given beside a preset win:
  - `flwrlabs/femnist`: image, character (62 classes), writer_id; test_fraction 0.1.
  - `flwrlabs/shakespeare`: x, y, character_id; test_fraction 0.1, temporal.
"""

from __future__ import annotations

import io
import json
import re
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedsim.config.limits import MAX_CLASSES
from fedsim.data.datasets import _finish, _one_line
from fedsim.data.letters import NUM_LETTERS, letter_ids
from fedsim.data.natural import natural_codes
from fedsim.data.registry import Dataset, register_dataset
from fedsim.errors import ConfigError, DataError, FedsimError
from fedsim.memory import check_arrays
from fedsim.persist.storage import instead_of_a_file

PRESETS: dict[str, dict[str, Any]] = {
    "flwrlabs/femnist": {"x_column": "image", "label_column": "character", "id_column": "writer_id",
                         "test_fraction": 0.1, "temporal": False},
    "flwrlabs/shakespeare": {"x_column": "x", "label_column": "y", "id_column": "character_id",
                             "test_fraction": 0.1, "temporal": True},
}
SUFFIXES = (".arrow", ".parquet", ".csv")
MAX_PIXELS = 4096 * 4096  # one decoded image; a larger one is refused before decoding (decompression bombs)


# ---------------------------------------------------------------- finding the files


def _check(options: dict) -> None:
    """The options a config must give, checked when it loads: the path, and the input column or a preset."""
    if not options.get("path"):
        raise ConfigError("data.options.path: dataset 'hf' needs path: <a save_to_disk folder, a folder of parquet, "
                          "arrow or csv files, or one such file>")
    if not options.get("x_column") and not options.get("preset"):
        raise ConfigError("data.options.x_column: dataset 'hf' needs the name of its image or text column "
                          f"(or a preset: {sorted(PRESETS)})")


def _given(root: Path, path: str) -> Path:
    """`path` as given, or under data.root when only there."""
    where = Path(path).expanduser()
    if not where.is_absolute() and not where.exists() and (root / where).exists():
        where = root / where
    return where


def _resolve(root: Path, path: str) -> Path:
    where = _given(root, path)
    if not where.exists():
        raise DataError(f"hf: {where} not found (data.options.path)")
    return where


def _fetch(where: Path, preset: str | None) -> None:
    """data.download: a preset's repository from the Hub into `where` (huggingface_hub), or one line saying how."""
    how = (f"`huggingface-cli download {preset or 'REPO'} --repo-type dataset --local-dir {where}`")
    if preset is None:
        raise DataError(f"hf: data.download fetches only a data.options.preset's repository; put your copy at {where} "
                        f"(e.g. {how})")
    try:
        from huggingface_hub import snapshot_download
    except ImportError:
        raise DataError(f"hf: data.download needs huggingface_hub (pip install huggingface_hub) to fetch {preset} "
                        f"into {where}; or fetch it with {how}") from None
    try:
        snapshot_download(repo_id=preset, repo_type="dataset", local_dir=str(where))
    except Exception as err:  # no network, no such repository, a full disk: the user's next step is the same
        raise DataError(f"hf: download of {preset} failed ({_one_line(err)}); fetch it into {where} with {how}") \
            from None


def _json(file: Path) -> Any:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, ValueError) as err:
        raise DataError(f"hf: could not read {file} ({_one_line(err)})") from None


def _state_files(folder: Path) -> list[Path]:
    """The Arrow files a saved split's `state.json` lists (plain names inside `folder`)."""
    state = _json(folder / "state.json")
    entries = state.get("_data_files") if isinstance(state, dict) else None
    names = [e.get("filename") for e in entries if isinstance(e, dict)] if isinstance(entries, list) else []
    plain = [n for n in names if isinstance(n, str) and n and Path(n).name == n]
    if not plain or len(plain) != len(entries or []):
        raise DataError(f"hf: {folder / 'state.json'} lists no data files ('_data_files' of plain file names)")
    return [folder / n for n in plain]


def _names_split(rel: str, split: str) -> bool:
    """Whether the relative path `rel` (without suffix) names `split` as a word, as the Hub's file patterns do."""
    return re.search(rf"(?:^|[-._ 0-9/]){re.escape(split)}(?:[-._ 0-9/]|$)", rel) is not None


def _layout(where: Path, splits: tuple[str, str]) -> dict[str, list[Path]]:
    """{split: its data files} for the two wanted splits (a split with no files is absent)."""
    if where.is_file():
        if where.suffix not in SUFFIXES:
            raise DataError(f"hf: {where} is not a .parquet, .arrow or .csv file (data.options.path)")
        return {splits[0]: [where]}
    if not where.is_dir():
        raise DataError(f"hf: {where}: {instead_of_a_file(where) or 'not a folder'} (data.options.path)")
    if (where / "dataset_dict.json").is_file():
        listed = _json(where / "dataset_dict.json")
        names = listed.get("splits") if isinstance(listed, dict) else None
        if not isinstance(names, list):
            raise DataError(f"hf: {where / 'dataset_dict.json'} has no 'splits' list")
        return {s: _state_files(where / s) for s in splits if s in names}
    if (where / "state.json").is_file():
        state = _json(where / "state.json")
        split = state.get("_split") if isinstance(state, dict) and isinstance(state.get("_split"), str) else None
        return {split or splits[0]: _state_files(where)}
    files = sorted(f for f in where.rglob("*") if f.suffix in SUFFIXES and f.is_file()
                   and not any(p.startswith(".") for p in f.relative_to(where).parts)
                   and not f.name.startswith(("cache-", "tmp")))  # `datasets`' map() caches and partial writes
    found = {s: [f for f in files if _names_split(f.relative_to(where).with_suffix("").as_posix(), s)]
             for s in splits}
    if not any(found.values()):
        found = {splits[0]: files}  # no file names a split: all are the training split, as on the Hub
    for split, group in found.items():
        folders = sorted({f.parent for f in group})
        if len(folders) > 1:
            raise DataError(f"hf: the {split!r} files of {where} lie in {len(folders)} folders ({folders[0]}, "
                            f"{folders[1]}{', ...' if len(folders) > 2 else ''}); point data.options.path at one copy")
    return {s: group for s, group in found.items() if group}


# ---------------------------------------------------------------- reading tables


def _read_table(file: Path, columns: list[str], text: set[str]) -> Any:
    """`columns` of one file as a pyarrow Table; a missing column is a DataError naming it and the file. CSV
    columns in `text` are read as strings (a CSV has no types: the next character '1' is not the number 1)."""
    import pyarrow as pa
    import pyarrow.csv as pcsv
    import pyarrow.parquet as pq

    try:
        if file.suffix == ".parquet":
            names = pq.ParquetFile(file).schema_arrow.names
            _check_columns(file, names, columns)
            return pq.read_table(file, columns=columns)
        if file.suffix == ".csv":
            table = pcsv.read_csv(file, parse_options=pcsv.ParseOptions(newlines_in_values=True),
                                  convert_options=pcsv.ConvertOptions(column_types={c: pa.string() for c in text}))
        else:
            with pa.memory_map(str(file)) as source:
                try:
                    table = pa.ipc.open_stream(source).read_all()  # what `datasets` writes
                except pa.ArrowInvalid:
                    source.seek(0)
                    table = pa.ipc.open_file(source).read_all()
        _check_columns(file, table.column_names, columns)
        return table.select(columns)
    except FedsimError:
        raise
    except (pa.ArrowException, OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"hf: could not read {file} ({_one_line(err)})") from None


def _check_columns(file: Path, names: list[str], columns: list[str]) -> None:
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(f"hf: {file} has no column {missing[0]!r} (its columns: {names}); set the data.options "
                        "x_column, label_column or id_column that names it")


def _class_names(files: list[Path], column: str) -> int | None:
    """How many classes the files' `ClassLabel` metadata names for `column` (parquet/arrow schema metadata, or a
    dataset_info.json beside them), or None if none does."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for file in files[:1]:
        infos = []
        try:
            if file.suffix == ".parquet":
                meta = pq.read_schema(file).metadata or {}
            elif file.suffix == ".arrow":
                with pa.memory_map(str(file)) as source:
                    meta = pa.ipc.open_stream(source).schema.metadata or {}
            else:
                meta = {}
            if b"huggingface" in meta:
                infos.append(json.loads(meta[b"huggingface"]).get("info", {}))
        except (pa.ArrowException, OSError, ValueError, AttributeError):
            pass  # the metadata is optional: the labels still give the count
        if (file.parent / "dataset_info.json").is_file():
            infos.append(_json(file.parent / "dataset_info.json"))
        for info in infos:
            feature = (info.get("features") or {}).get(column) if isinstance(info, dict) else None
            if isinstance(feature, dict) and feature.get("_type") == "ClassLabel":
                names = feature.get("names")
                if isinstance(names, list) and 0 < len(names) <= MAX_CLASSES:
                    return len(names)
    return None


# ---------------------------------------------------------------- decoding columns


def _images(column: Any, file: Path, name: str) -> np.ndarray:
    """N×H×W (gray) or N×H×W×3 (RGB) uint8 images from an `Image` struct column or a binary column, via PIL."""
    import pyarrow as pa
    import pyarrow.compute as pc
    from PIL import Image, UnidentifiedImageError

    where = f"hf: {file} column {name!r}"
    kind = column.type
    if pa.types.is_struct(kind) and kind.get_field_index("bytes") >= 0:
        blobs = pc.struct_field(column, "bytes").to_pylist()
        paths = (pc.struct_field(column, "path").to_pylist() if kind.get_field_index("path") >= 0
                 else [None] * len(blobs))
    elif pa.types.is_binary(kind) or pa.types.is_large_binary(kind):
        blobs, paths = column.to_pylist(), [None] * len(column)
    else:
        raise DataError(f"{where} is {kind}: expected a Hugging Face Image (a struct of bytes and path) or text")
    out: np.ndarray | None = None
    for i, (blob, path) in enumerate(zip(blobs, paths)):
        if blob is None:
            raise DataError(f"{where}: row {i} has no image bytes (path {path!r}); fedsim reads embedded images "
                            "only (save the dataset with its images embedded)")
        try:
            with Image.open(io.BytesIO(blob)) as img:
                if img.width * img.height > MAX_PIXELS:
                    raise DataError(f"{where}: row {i} is a {img.width}×{img.height} image, larger than fedsim "
                                    "reads")
                gray = img.mode in ("1", "L", "LA", "I", "I;16", "F")
                pixels = np.asarray(img.convert("L" if gray else "RGB"))
        except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as err:
            raise DataError(f"{where}: row {i} is not a readable image ({_one_line(err)})") from None
        if out is None:
            check_arrays({"x": ((len(blobs), *pixels.shape), np.dtype(np.uint8))}, where, "data.options.path")
            out = np.empty((len(blobs), *pixels.shape), dtype=np.uint8)
        elif pixels.shape != out.shape[1:]:
            raise DataError(f"{where}: row {i} is {'×'.join(map(str, pixels.shape))}, the first image is "
                            f"{'×'.join(map(str, out.shape[1:]))} (all images must have one size and mode)")
        out[i] = pixels
    return out if out is not None else np.zeros((0, 1, 1), dtype=np.uint8)


def _is_text(column: Any) -> bool:
    import pyarrow as pa

    return pa.types.is_string(column.type) or pa.types.is_large_string(column.type)


def _labels(column: Any, file: Path, name: str, letters: bool) -> np.ndarray:
    """Class ids: integers as they are, or (beside text) each one-character string's letter id."""
    import pyarrow as pa

    where = f"hf: {file} column {name!r}"
    if column.null_count:
        raise DataError(f"{where}: {column.null_count} rows have no label")
    if letters and _is_text(column):
        return letter_ids(column.to_pylist(), where, length=1)[:, 0]
    if not pa.types.is_integer(column.type):
        raise DataError(f"{where} is {column.type}: expected integer class ids"
                        + (" or one-character strings (next-character labels beside text)" if letters else ""))
    return column.to_numpy().astype(np.int64)


def _ids(column: Any, file: Path, name: str) -> np.ndarray:
    if column.null_count:
        raise DataError(f"hf: {file} column {name!r}: {column.null_count} rows have no client id")
    return column.to_numpy(zero_copy_only=False)  # typed: integer ids sort as numbers, as Flower sorts them


def _read_split(files: list[Path], x: str, label: str, ident: str | None) -> tuple[np.ndarray, np.ndarray, Any, bool]:
    """(inputs, labels, client names or None, whether the labels are letters) of one split, file by file so that an
    error names its file."""
    columns = [x, label] + ([ident] if ident else [])
    xs, ys, ids, letters = [], [], [], []
    for file in files:
        table = _read_table(file, columns, {x, label} | ({ident} if ident else set()))
        col = table.column(x)
        if _is_text(col):
            if col.null_count:
                raise DataError(f"hf: {file} column {x!r}: {col.null_count} rows have no text")
            xs.append(letter_ids(col.to_pylist(), f"hf: {file} column {x!r}"))
        else:
            xs.append(_images(col, file, x))
        letters.append(_is_text(col) and _is_text(table.column(label)))
        ys.append(_labels(table.column(label), file, label, letters=_is_text(col)))
        if ident:
            ids.append(_ids(table.column(ident), file, ident))
    shapes = {a.shape[1:] for a in xs if len(a)}
    if len(shapes) > 1:
        raise DataError(f"hf: the files {files[0]} and {files[-1]} hold inputs of different shapes {sorted(shapes)}")
    if len(set(letters)) > 1:
        raise DataError(f"hf: the files {files[0]} and {files[-1]} hold labels of different types")
    return np.concatenate(xs), np.concatenate(ys), np.concatenate(ids) if ident else None, letters[0]


# ---------------------------------------------------------------- the held-out test set


def holdout(codes: np.ndarray, fraction: float, seed: int, gap: int | None) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, test rows) after LEAF's per-client sample split (module docstring): each client's rows in
    dataset order, `fraction` of them to test; `gap` None draws them at random, else the first n_train train and
    the test starts `gap` rows after them."""
    rng = np.random.default_rng(seed)
    order = np.argsort(codes, kind="stable")
    bounds = np.flatnonzero(np.diff(codes[order])) + 1
    train, test = [], []
    for rows in np.split(order, bounds) if len(order) else []:
        n = len(rows)
        n_train = n if n < 2 else 1 if n == 2 else max(1, int((1.0 - fraction) * n))
        if gap is None:
            pick = np.sort(rng.permutation(n)[:n_train])
            held = np.setdiff1d(np.arange(n), pick)
        else:
            pick, held = np.arange(n_train), np.arange(min(n, n_train + gap), n)
        train.append(rows[pick])
        test.append(rows[held])
    joined = [np.sort(np.concatenate(p)) if p else np.zeros(0, dtype=np.int64) for p in (train, test)]
    return joined[0], joined[1]


# ---------------------------------------------------------------- the loader


@register_dataset("hf", check=_check, limits={"test_fraction": {"gt": 0, "lt": 1}, "split_seed": {"ge": 0},
                                              "num_classes": {"ge": 1, "le": MAX_CLASSES}})
def load_hf(root: Path, download: bool, *, path: str | None = None,
            preset: Literal["flwrlabs/femnist", "flwrlabs/shakespeare"] | None = None,
            x_column: str | None = None, label_column: str | None = None, id_column: str | None = None,
            train_split: str = "train", test_split: str = "test", test_fraction: float | None = None,
            temporal: bool | None = None, split_seed: int = 0, num_classes: int | None = None) -> Dataset:
    """A Hugging Face dataset from a local copy at `path` (see the module docstring for the layouts, columns,
    presets and the held-out test set when the data has no `test_split`)."""
    chosen: dict[str, Any] = dict(PRESETS.get(preset or "", {}))
    given = {"x_column": x_column, "label_column": label_column, "id_column": id_column, "temporal": temporal}
    chosen.update({k: v for k, v in given.items() if v is not None})
    x, label, ident = chosen["x_column"], chosen.get("label_column", "label"), chosen.get("id_column")
    if download and not _given(root, str(path)).exists():
        _fetch(_given(root, str(path)), preset)
    where = _resolve(root, str(path))
    files = _layout(where, (train_split, test_split))
    if train_split not in files:
        raise DataError(f"hf: no {train_split!r} split found in {where} (data.options.train_split)")
    x_tr, y_tr, n_tr, letters = _read_split(files[train_split], x, label, ident)
    if test_split in files:
        if test_fraction is not None:
            raise ConfigError(f"data.options.test_fraction: {where} has a {test_split!r} split; drop test_fraction "
                              "to use it, or name another data.options.test_split")
        x_te, y_te, n_te, test_letters = _read_split(files[test_split], x, label, ident)
        if test_letters != letters:
            raise DataError(f"hf: {where}: the {test_split!r} and {train_split!r} labels are of different types")
    else:
        fraction = test_fraction if test_fraction is not None else chosen.get("test_fraction")
        if fraction is None:
            raise DataError(f"hf: no {test_split!r} split in {where}; set data.options.test_fraction to hold out a "
                            "share of each client's samples, or name the split in data.options.test_split")
        codes = natural_codes(n_tr, n_tr[:0])[0] if ident else np.zeros(len(y_tr), dtype=np.int64)
        gap = (x_tr.shape[1] - 1 if x_tr.ndim == 2 else 0) if chosen.get("temporal") else None
        keep, held = holdout(codes, fraction, split_seed, gap)
        x_te, y_te, n_te = x_tr[held], y_tr[held], n_tr[held] if ident else None
        x_tr, y_tr, n_tr = x_tr[keep], y_tr[keep], n_tr[keep] if ident else None
    if x_tr.shape[1:] != x_te.shape[1:] and len(x_te):
        raise DataError(f"hf: {where}: {test_split} inputs are {x_te.shape[1:]}, {train_split} inputs {x_tr.shape[1:]}")
    text = x_tr.dtype == np.int64
    classes = NUM_LETTERS if letters else (num_classes or _class_names(files[train_split], label)
                                           or int(max(y_tr.max(initial=0), y_te.max(initial=0))) + 1)
    for split, y in ((train_split, y_tr), (test_split, y_te)):
        if len(y) and (y.min() < 0 or y.max() >= classes):
            raise DataError(f"hf: {where}: {split} labels ({label!r}) outside 0..{classes - 1} (found "
                            f"{y.min()}..{y.max()})")
    if text:
        ds = Dataset("hf", x_tr, y_tr, x_te, y_te, classes, extras={"path": str(where)})
    else:
        ds = _finish("hf", x_tr, y_tr, x_te, y_te, classes, channels_last=x_tr.ndim == 4, path=str(where))
    if ident:
        ds.train_ids, ds.test_ids, ds.client_names = natural_codes(n_tr, n_te)
    return ds

