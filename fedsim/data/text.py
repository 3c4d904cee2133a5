"""Text datasets as fixed-length token ids over a pre-trained word-embedding table (GloVe format).

The vocabulary IS the embedding file: id 0 is padding, id 1 unknown, id 2+i the i-th word of the file (the
first `max_vocab` words; GloVe files are sorted by frequency). The model builders (fedsim.models.text) read
the same file with the same `max_vocab`, so ids and table always agree. Embedding files:
  - GloVe text: one word per line followed by its D floats, space-separated (an optional word2vec-style
    "<count> <dim>" header line is skipped);
  - .npy: a V×D float table whose rows are ids (0 = padding);
  - .npz: the same table under the key `embedding`.

Datasets:
  - `text_tsv`: options train, test (TSV files with lines `label<TAB>text`; labels are class ids 0..C-1, or
    names, numbered in sorted order), embedding (a GloVe .txt), max_len (default 200, DOSFL's IMDB length;
    30 for TREC-6), max_vocab, lowercase (default true). Tokens: runs of letters/digits/apostrophes and
    single punctuation marks; sentences are truncated or padded at the end to max_len.
  - `text_npz`: option path; an .npz with x_train, x_test (N×L int token ids), y_train, y_test and
    `embedding` (the table). Point model.options.embedding at the same file.
"""

from __future__ import annotations

import functools
import re
import zipfile
from pathlib import Path

import numpy as np

from fedsim.config.limits import MAX_CLASSES
from fedsim.data.labels import checked_labels
from fedsim.data.registry import Dataset, register_dataset
from fedsim.data.safe_npy import check_archive, npy_array, npz_array
from fedsim.errors import ConfigError, DataError
from fedsim.persist.storage import instead_of_a_file

PAD, UNK = 0, 1
TOKEN = re.compile(r"[\w']+|[^\w\s]")


def load_embedding_table(path: str, max_vocab: int | None = None) -> tuple[dict[str, int], np.ndarray]:
    """(word -> id, float32 table) from a GloVe .txt, .npy or .npz; rows 0/1 are padding/unknown (zeros)."""
    file = Path(path).expanduser()
    if not file.is_file():
        what = instead_of_a_file(file)
        raise DataError(f"embedding file {file}: {what}" if what else f"embedding file not found: {file}")
    if max_vocab is not None and max_vocab < 1:
        raise ConfigError(f"max_vocab: must be >= 1, got {max_vocab}")
    return _load(str(file.resolve()), file.stat().st_mtime_ns, max_vocab)


def _checked_table(file: Path, table: np.ndarray) -> np.ndarray:
    """`table` once it is a 2-d float V×D table with finite values (NaN rows would silently poison training)."""
    if table.ndim != 2 or not np.issubdtype(table.dtype, np.floating):
        raise DataError(f"{file}: the embedding must be a 2-d float table, got {table.dtype} {table.shape}")
    if not np.isfinite(table).all():
        raise DataError(f"{file}: the embedding contains NaN or infinite values")
    return table


@functools.lru_cache(maxsize=4)
def _load(path: str, mtime: int, max_vocab: int | None) -> tuple[dict[str, int], np.ndarray]:
    file = Path(path)
    if file.suffix in (".npy", ".npz"):
        try:
            if file.suffix == ".npy":
                table = npy_array(file)
            else:
                with np.load(file, allow_pickle=False) as data:
                    table = npz_array(data, "embedding", str(file))
        except (OSError, ValueError, KeyError, MemoryError) as err:
            raise DataError(f"{file}: could not read an embedding table ({type(err).__name__}: {err})") from None
        table = _checked_table(file, table)
        table = table[: max_vocab + 2] if max_vocab else table
        return {}, np.ascontiguousarray(table, dtype=np.float32)
    words: dict[str, int] = {}
    rows: list[np.ndarray] = []
    dim = None
    with open(file, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            parts = line.rstrip("\n").rstrip(" ").split(" ")
            if lineno == 1 and len(parts) == 2 and all(p.isdigit() for p in parts):
                continue  # word2vec header
            if len(parts) < 2:
                continue
            try:
                with np.errstate(over="ignore"):  # a number past float32's range becomes inf, refused below
                    vec = np.asarray(parts[1:], dtype=np.float32)
            except ValueError:
                raise DataError(f"{file} line {lineno}: expected a word then numbers") from None
            if not np.isfinite(vec).all():  # 'nan', 'inf', or past float32's range
                raise DataError(f"{file} line {lineno}: NaN or infinite values (or numbers past float32's range)")
            if dim is None:
                dim = len(vec)
            elif len(vec) != dim:
                raise DataError(f"{file} line {lineno}: {len(vec)} numbers, earlier lines have {dim}")
            if parts[0] in words:
                continue
            words[parts[0]] = len(rows) + 2
            rows.append(vec)
            if max_vocab is not None and len(rows) >= max_vocab:
                break
    if dim is None:
        raise DataError(f"{file}: no embedding vectors found")
    table = np.zeros((len(rows) + 2, dim), dtype=np.float32)
    table[2:] = np.stack(rows)
    return words, table


def tokenize(text: str, lowercase: bool = True) -> list[str]:
    """Words (letters, digits, apostrophes) and single punctuation marks."""
    return TOKEN.findall(text.lower() if lowercase else text)


def encode(texts: list[str], vocab: dict[str, int], max_len: int, lowercase: bool = True) -> np.ndarray:
    """N×max_len int64 ids: truncated or padded (0) at the end; unknown words are 1."""
    out = np.zeros((len(texts), max_len), dtype=np.int64)
    for i, t in enumerate(texts):
        ids = [vocab.get(w, UNK) for w in tokenize(t, lowercase)[:max_len]]
        out[i, : len(ids)] = ids
    return out


def read_tsv(path: Path) -> tuple[list[str], list[str]]:
    """(labels, texts) of a `label<TAB>text` file; blank lines are skipped."""
    if not path.is_file():
        what = instead_of_a_file(path)
        raise DataError(f"text_tsv: {path}: {what}" if what else f"text_tsv: file not found: {path}")
    labels, texts = [], []
    with open(path, encoding="utf-8", errors="replace") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            if "\t" not in line:
                raise DataError(f"text_tsv: {path} line {lineno}: expected 'label<TAB>text'")
            label, text = line.rstrip("\n").split("\t", 1)
            labels.append(label.strip())
            texts.append(text)
    if not labels:
        raise DataError(f"text_tsv: {path} has no examples")
    return labels, texts


def _resolve(root: Path, path: str | None, key: str, name: str) -> Path:
    if not path:
        raise ConfigError(f"data.options.{key}: dataset {name!r} needs {key}: <file>")
    file = Path(path).expanduser()
    return root / file if not file.is_absolute() and not file.exists() and (root / file).exists() else file


@register_dataset("text_tsv", limits={"max_len": {"ge": 1, "le": 100_000}, "max_vocab": {"ge": 1, "le": 100_000_000}})
def load_text_tsv(root: Path, download: bool, *, train: str | None = None, test: str | None = None,
                  embedding: str | None = None, max_len: int = 200, max_vocab: int | None = None,
                  lowercase: bool = True) -> Dataset:
    """Tokenised TSV text classification over a GloVe vocabulary (see the module docstring)."""
    if max_len < 1:
        raise ConfigError(f"data.options.max_len: must be >= 1, got {max_len}")
    tr_labels, tr_texts = read_tsv(_resolve(root, train, "train", "text_tsv"))
    te_labels, te_texts = read_tsv(_resolve(root, test, "test", "text_tsv"))
    vocab, table = load_embedding_table(str(_resolve(root, embedding, "embedding", "text_tsv")), max_vocab)
    if not vocab:
        raise ConfigError("data.options.embedding: text_tsv needs a GloVe-format .txt file (words give the ids)")
    if all(s.isascii() and s.isdigit() for s in tr_labels + te_labels):
        for key, labels in (("train", tr_labels), ("test", te_labels)):
            big = next((i for i, s in enumerate(labels) if int(s) >= MAX_CLASSES), None)
            if big is not None:
                raise DataError(f"text_tsv: {_resolve(root, train if key == 'train' else test, key, 'text_tsv')}: "
                                f"example {big + 1} has class id {labels[big]}; class ids must be below "
                                f"{MAX_CLASSES:,}")
        y_tr, y_te = (np.asarray([int(s) for s in ls], dtype=np.int64) for ls in (tr_labels, te_labels))
        classes = int(max(y_tr.max(), y_te.max())) + 1
    else:
        names = sorted(set(tr_labels))
        unseen = sorted(set(te_labels) - set(names))
        if unseen:
            raise DataError(f"text_tsv: test label {unseen[0]!r} does not occur in the training file")
        index = {n: i for i, n in enumerate(names)}
        y_tr, y_te = (np.asarray([index[s] for s in ls], dtype=np.int64) for ls in (tr_labels, te_labels))
        classes = len(names)
    return Dataset(name="text_tsv", x_train=encode(tr_texts, vocab, max_len, lowercase), y_train=y_tr,
                   x_test=encode(te_texts, vocab, max_len, lowercase), y_test=y_te, num_classes=classes,
                   extras={"embedding": table})


@register_dataset("text_npz")
def load_text_npz(root: Path, download: bool, *, path: str | None = None) -> Dataset:
    """Pre-tokenised text: x_train/x_test token ids, y_train/y_test, and the `embedding` table."""
    file = _resolve(root, path, "path", "text_npz")
    if not file.is_file():
        what = instead_of_a_file(file)
        raise DataError(f"text_npz: {file}: {what}" if what else f"text_npz: file not found: {file}")
    check_archive(file, "text_npz", "data.options.path")
    try:
        with np.load(file, allow_pickle=False) as data:
            needed = ("x_train", "y_train", "x_test", "y_test", "embedding")
            missing = [k for k in needed if k not in data.files]
            if missing:
                raise DataError(f"text_npz: {file} has no key {missing[0]!r}")
            arrays = {k: npz_array(data, k, f"text_npz: {file}") for k in needed}  # other members stay unread
    except (OSError, ValueError, TypeError, AttributeError, EOFError, zipfile.BadZipFile, MemoryError) as err:
        raise DataError(f"text_npz: could not read {file} ({type(err).__name__}: {' '.join(str(err).split())})") \
            from None
    embedding = _checked_table(file, arrays["embedding"])
    for k in ("x_train", "x_test"):
        x = arrays[k]
        if x.ndim != 2 or not np.issubdtype(x.dtype, np.integer):
            raise DataError(f"text_npz: {file}: {k} must be N×L integer token ids, got {x.dtype} {x.shape}")
        if len(x) and (x.min() < 0 or x.max() >= len(embedding)):
            raise DataError(f"text_npz: {file}: {k} has ids outside the {len(embedding)}-row embedding")
    ys = []
    for k in ("y_train", "y_test"):
        y = np.asarray(arrays[k]).reshape(-1)
        if not (np.issubdtype(y.dtype, np.integer) or np.issubdtype(y.dtype, np.floating)):
            raise DataError(f"text_npz: {file}: {k} must hold integer class ids, got {y.dtype}")
        ys.append(checked_labels(y, f"text_npz: {file}: {k}"))
    if len(ys[0]) != len(arrays["x_train"]) or len(ys[1]) != len(arrays["x_test"]):
        raise DataError(f"text_npz: {file}: x_train/y_train or x_test/y_test have different lengths")
    if len(ys[0]) == 0:
        raise DataError(f"text_npz: {file}: x_train is empty")
    return Dataset(name="text_npz", x_train=arrays["x_train"].astype(np.int64), y_train=ys[0],
                   x_test=arrays["x_test"].astype(np.int64), y_test=ys[1],
                   num_classes=int(max(ys[0].max(), ys[1].max(initial=0))) + 1,
                   extras={"embedding": embedding.astype(np.float32)})
