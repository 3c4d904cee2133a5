"""LEAF's federated datasets (FEMNIST, Shakespeare, Sent140) from the JSON files LEAF's `preprocess.sh` writes.

`data.root` is the dataset's LEAF folder (e.g. `leaf/data/femnist`). Without `data.options.split` the loader reads
`data/train/*.json` and `data/test/*.json` as they are, each folder's files in sorted name order; with it, it
reads `data/all_data/*.json` and redoes LEAF's sample → remove users → split in memory (fedsim.data.leaf_sampling),
with LEAF's own `random.Random` use, so the users and samples equal what the scripts write from the same seeds.

Each file is {"users": [...], "num_samples": [...], "user_data": {user: {"x": [...], "y": [...]}}}. A user's id
gets one client code 0..K-1, the same in train and test and across files (a user in several files is merged):
codes number the sorted training user ids (fedsim.data.natural, as for TFF and Flower's natural-id partitioner), and
a test user with no training samples (LEAF's user split puts every user on one side) gets -1: central test only.
`client_names[code]` is the published id.

  - leaf_femnist: x 784 floats in [0, 1] → 1×28×28 float32, normalised with the training set's own mean/std;
    y in 0..61 (digits, upper case, lower case).
  - leaf_shakespeare: x 80-character strings → int64 ids in LEAF's 80-symbol table, y the next character's id;
    a character outside the table is refused (LEAF's `find` would give -1). LEAF's Shakespeare test files record
    num_samples without the 79 overlapping windows its split skips; that difference is accepted there.
  - leaf_sent140: x the tweet record ([id, date, query, user, text, set]); x[4] is split with LEAF's regex
    `[\\w']+|[.,!?;]` (case kept, as LEAF does, unless `lowercase`), the first 25 words kept and the rest padded,
    both with the unknown id. With `embedding` (a GloVe .txt) the vocabulary is the file's words in file order
    (id i) and the unknown id is V, as LEAF's embs.json; `extras["embedding"]` is then the (V+1)×D table whose last
    row is zeros. Without it, the vocabulary is the `vocab_size` most frequent words of the training tweets
    (ties in sorted order) and the unknown id is `vocab_size`: LEAF itself needs GloVe for its vocabulary.

Preprocessing options (LEAF flag in brackets), used only with `split`:
  sampling (-s niid|iid; unset: no sampling), sf (--sf, 0.1), iu (--iu, 0.01), min_samples (-k; unset: no
  removal), split (-t sample|user), train_fraction (--tf, 0.9), sample_seed (--smplseed) and split_seed
  (--spltseed), by default the seeds of LEAF's FEMNIST paper script (1549786595, 1549786796) since LEAF's default,
  the clock, cannot be reproduced. One RNG runs over all files of a step, so the file order matters: LEAF takes
  `os.listdir`'s, which depends on the file system. By default the sampling step takes the all_data files in
  sorted name order and the split the files it would find (e.g. all_data_3_niid_05_keep_100.json) in sorted name
  order; `sample_order` / `split_order` (lists of all_data file names) give the order `ls -U` showed where LEAF
  ran. With one all_data file (Shakespeare, Sent140) the order cannot matter.
"""

from __future__ import annotations

import json
import random
import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fedsim.config.limits import MAX_SEED
from fedsim.data._images import channel_stats, normalise_
from fedsim.data.leaf_sampling import (
    Part,
    Users,
    remove_users,
    sample_iid,
    sample_niid,
    split_by_sample,
    split_by_user,
)
from fedsim.data.letters import NUM_LETTERS, letter_ids
from fedsim.data.natural import natural_codes
from fedsim.data.registry import Dataset, register_dataset
from fedsim.errors import ConfigError, DataError

WORDS = re.compile(r"[\w']+|[.,!?;]")  # LEAF's split_line
SENT140_LEN = 25
SENT140_VOCAB = 10_000
FEMNIST_PIXELS = 784
SAMPLE_SEED, SPLIT_SEED = 1549786595, 1549786796  # LEAF's paper_experiments/femnist.sh
LIMITS: dict[str, dict[str, float]] = {"sf": {"gt": 0, "le": 1}, "iu": {"gt": 0, "le": 1}, "min_samples": {"ge": 0},
          "train_fraction": {"gt": 0, "lt": 1}, "sample_seed": {"ge": 0, "le": MAX_SEED},
          "split_seed": {"ge": 0, "le": MAX_SEED}, "vocab_size": {"ge": 1, "le": 100_000_000},
          "max_vocab": {"ge": 1, "le": 100_000_000}}
Arrays = tuple[np.ndarray, np.ndarray, np.ndarray]  # x, y, each sample's client code
Convert = Callable[[list, list, str], tuple[np.ndarray, np.ndarray]]


@dataclass(frozen=True)
class Steps:
    """LEAF's preprocessing flags (see the module docstring); `split=None` reads data/train and data/test."""

    sampling: str | None = None
    sf: float = 0.1
    iu: float = 0.01
    min_samples: int | None = None
    split: str | None = None
    train_fraction: float = 0.9
    sample_seed: int = SAMPLE_SEED
    split_seed: int = SPLIT_SEED
    sample_order: list[str] | None = None
    split_order: list[str] | None = None


def check_steps(options: dict) -> None:
    """At config load: the steps run only with `split`, and the orders name each file once."""
    if options.get("split") is None:
        for key in ("sampling", "min_samples", "sample_order", "split_order"):
            if options.get(key) is not None:
                raise ConfigError(f"data.options.{key}: LEAF's preprocessing runs from data/all_data only with "
                                  "data.options.split (sample or user); without it data/train and data/test are read")
    for key in ("sample_order", "split_order"):
        names = options.get(key) or []
        if len(set(names)) != len(names):
            raise ConfigError(f"data.options.{key}: names a file twice")


# ---------------------------------------------------------------- one file


def _labels(y: list, classes: int, where: str) -> np.ndarray:
    ya = np.asarray(y)
    if len(ya) == 0:
        return np.zeros(0, dtype=np.int64)
    if ya.ndim != 1 or not np.issubdtype(ya.dtype, np.integer):
        raise DataError(f"{where}: y must be a list of whole-number labels, got {ya.dtype} of shape {ya.shape}")
    if ya.min() < 0 or ya.max() >= classes:
        bad = ya[(ya < 0) | (ya >= classes)][0]
        raise DataError(f"{where}: label {bad} outside the {classes} classes 0..{classes - 1}")
    return ya.astype(np.int64)


def _femnist(x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not x:
        return np.zeros((0, FEMNIST_PIXELS), dtype=np.float32), _labels(y, 62, where)
    try:
        xa = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
    except (ValueError, TypeError):
        raise DataError(f"{where}: x must be lists of {FEMNIST_PIXELS} numbers") from None
    if xa.shape[1:] != (FEMNIST_PIXELS,):
        raise DataError(f"{where}: x must be lists of {FEMNIST_PIXELS} numbers, got {xa.shape[1]}")
    if not np.isfinite(xa).all():
        raise DataError(f"{where}: x holds NaN or infinite values")
    return xa, _labels(y, 62, where)


def _shakespeare(x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    return letter_ids(x, f"{where}: x", 80), letter_ids(y, f"{where}: y", 1).reshape(-1)


def _sent140(x: list, y: list, where: str) -> tuple[np.ndarray, np.ndarray]:
    texts = np.empty(len(x), dtype=object)
    for i, record in enumerate(x):
        if not (isinstance(record, list) and len(record) > 4 and isinstance(record[4], str)):
            raise DataError(f"{where}: x[{i}] must be a tweet record whose fifth field (x[4]) is its text")
        texts[i] = record[4]
    return texts, _labels(y, 2, where)


def read_part(name: str, file: Path, convert: Convert, test_window: int = 0, empty_ok: bool = False) -> Part:
    """One LEAF JSON file, checked: listed users unique and present, x and y as long as `num_samples` (or, with
    `test_window`, that many fewer: Shakespeare's test files), each user's samples converted."""
    where = f"{name}: {file}"
    try:
        with open(file, encoding="utf-8") as fh:
            raw = json.load(fh)
    except (OSError, ValueError, RecursionError, MemoryError) as err:
        text = " ".join(str(err).split())[:200]
        raise DataError(f"{where}: not a readable JSON file ({type(err).__name__}: {text})") from None
    if not isinstance(raw, dict) or not all(k in raw for k in ("users", "num_samples", "user_data")):
        raise DataError(f"{where}: expected a JSON object with 'users', 'num_samples' and 'user_data'")
    users, counts, user_data = raw["users"], raw["num_samples"], raw["user_data"]
    if not isinstance(users, list) or not all(isinstance(u, str) for u in users):
        raise DataError(f"{where}: 'users' must be a list of user ids (strings)")
    if not isinstance(counts, list) or len(counts) != len(users) or \
            not all(isinstance(n, int) and not isinstance(n, bool) for n in counts):
        raise DataError(f"{where}: 'num_samples' must be one whole number per user ({len(users)} users)")
    if not isinstance(user_data, dict):
        raise DataError(f"{where}: 'user_data' must be an object keyed by user id")
    if len(set(users)) != len(users):
        dup = next(u for u in users if users.count(u) > 1)
        raise DataError(f"{where}: user {dup!r} is listed twice in 'users'")
    listed = dict(zip(users, counts))
    for user, n in listed.items():
        record = user_data.get(user)
        if not isinstance(record, dict) or not isinstance(record.get("x"), list) or \
                not isinstance(record.get("y"), list):
            raise DataError(f"{where}: user {user!r} has no 'x' and 'y' lists in 'user_data'")
        have = len(record["y"])
        if len(record["x"]) != have:
            raise DataError(f"{where}: user {user!r} has {len(record['x'])} x but {have} y in 'user_data'")
        if have != n and not (test_window and have == n - test_window):
            raise DataError(f"{where}: user {user!r} has num_samples {n} but {have} samples in 'user_data'")
        if have == 0 and not empty_ok:
            raise DataError(f"{where}: user {user!r} has no samples (LEAF's split writes none such)")
    part = Part(file.name, list(users))
    for user, record in user_data.items():  # user_data's order: LEAF's iid sampling flattens in it
        if user in listed:
            part.data[user] = convert(record["x"], record["y"], f"{where}: user {user!r}")
    return part


# ---------------------------------------------------------------- the folders and the steps


def _json_files(folder: Path, name: str) -> list[Path]:
    if not folder.is_dir():
        raise DataError(f"{name}: folder not found: {folder} (set data.root to the LEAF dataset folder, e.g. "
                        "leaf/data/femnist, after its preprocess.sh)")
    files = sorted(p for p in folder.iterdir() if p.suffix == ".json" and p.is_file())
    if not files:
        raise DataError(f"{name}: no .json files in {folder}")
    return files


def _ordered(files: list[Path], order: list[str] | None, key: str) -> list[Path]:
    """`files` in `order` (file names; each exactly once), or as they are."""
    if order is None:
        return files
    by_name = {f.name: f for f in files}
    if sorted(order) != sorted(by_name):
        missing = sorted(set(by_name) - set(order)) or sorted(set(order) - set(by_name))
        raise ConfigError(f"data.options.{key}: must list each file of data/all_data once; {missing[0]!r} "
                          f"{'is missing' if missing[0] in by_name else 'is not there'}")
    return [by_name[n] for n in order]


def _digits(value: float) -> str:
    """LEAF's file-name tag of a fraction: str(0.05)[2:] == '05'."""
    return str(value)[2:]


def _derived_name(source: str, steps: Steps) -> str:
    """The name LEAF's split step finds for the all_data file `source`, which sets its default order."""
    stem = source[:-5]
    if steps.sampling == "iid":
        stem += f"_iid_{_digits(steps.iu)}_{_digits(steps.sf)}"
    elif steps.sampling == "niid":
        stem += f"_niid_{_digits(steps.sf)}"
    if steps.min_samples is not None:
        stem += f"_keep_{steps.min_samples}"
    return stem + ".json"


def preprocess(name: str, folder: Path, convert: Convert, steps: Steps, time_ordered: bool) -> tuple[Users, Users]:
    """LEAF's sample → remove users → split on the files of `folder` (data/all_data), in memory."""
    files = _ordered(_json_files(folder, name), steps.sample_order, "sample_order")
    rng = random.Random(steps.sample_seed)
    parts: dict[str, Part] = {}
    new_users = 0
    for file in files:
        part = read_part(name, file, convert, empty_ok=True)
        if steps.sampling == "niid":
            part = sample_niid(part, steps.sf, rng)
        elif steps.sampling == "iid":
            part = sample_iid(part, steps.sf, steps.iu, rng, new_users)
            new_users += len(part.users)
        if steps.min_samples is not None:
            part = remove_users(part, steps.min_samples)
        parts[file.name] = part
    if steps.min_samples is not None and not any(p.users for p in parts.values()):
        raise ConfigError(f"data.options.min_samples: {steps.min_samples} leaves no user in {folder}")
    if steps.split_order is not None:
        order = [f.name for f in _ordered(files, steps.split_order, "split_order")]
    else:
        order = sorted(parts, key=lambda n: _derived_name(n, steps))
    ordered = [parts[n] for n in order]
    split_rng = random.Random(steps.split_seed)
    if steps.split == "user":
        return split_by_user(ordered, steps.train_fraction, split_rng)
    return split_by_sample(ordered, steps.train_fraction, split_rng, time_ordered)


def read_split(name: str, data: Path, convert: Convert, test_window: int) -> tuple[Users, Users]:
    """data/train and data/test as LEAF wrote them, each folder's files in sorted name order."""
    out = []
    for sub, window in (("train", 0), ("test", test_window)):
        users: Users = []
        for file in _json_files(data / sub, name):
            part = read_part(name, file, convert, window)
            users.extend((u, *part.data[u]) for u in part.users)
        out.append(users)
    return out[0], out[1]


def _arrays(users: Users, empty: np.ndarray) -> Arrays:
    """Users' samples concatenated, with each sample's user id."""
    if not users:
        return empty, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=str)
    x = np.concatenate([x for _, x, _ in users])
    y = np.concatenate([y for _, _, y in users])
    return x, y, np.concatenate([np.full(len(yy), u) for u, _, yy in users])


def leaf_users(name: str, root: Path, convert: Convert, steps: Steps, time_ordered: bool = False,
               empty: np.ndarray | None = None, download: bool = False) -> tuple[Arrays, Arrays, tuple[str, ...]]:
    """((x, y, ids) of train, the same of test, client names): read or preprocessed, users merged by id."""
    data = Path(root) / "data"
    if download and not data.is_dir():
        leaf = name.removeprefix("leaf_")
        raise DataError(f"{name}: data.download: LEAF's data is built by LEAF's own scripts, not fetched by fedsim: "
                        f"git clone https://github.com/TalwalkarLab/leaf, run data/{leaf}/preprocess.sh there "
                        f"(docs/data/leaf.md), and set data.root to its data/{leaf} folder (not found: {root})")
    if steps.split is None:
        train, test = read_split(name, data, convert, 79 if time_ordered else 0)
    else:
        train, test = preprocess(name, data / "all_data", convert, steps, time_ordered)
    blank = empty if empty is not None else np.zeros(0)
    (x_tr, y_tr, users_tr), (x_te, y_te, users_te) = _arrays(train, blank), _arrays(test, blank)
    id_tr, id_te, names = natural_codes(users_tr, users_te)
    return (x_tr, y_tr, id_tr), (x_te, y_te, id_te), names


# ---------------------------------------------------------------- the datasets


def _steps(opts: dict[str, Any]) -> Steps:
    return Steps(**{k: opts[k] for k in Steps.__dataclass_fields__})


@register_dataset("leaf_femnist", limits=LIMITS, check=check_steps)
def load_leaf_femnist(root: Path, download: bool, *, sampling: Literal["niid", "iid"] | None = None,
                      sf: float = 0.1, iu: float = 0.01, min_samples: int | None = None,
                      split: Literal["sample", "user"] | None = None, train_fraction: float = 0.9,
                      sample_seed: int = SAMPLE_SEED, split_seed: int = SPLIT_SEED,
                      sample_order: list[str] | None = None, split_order: list[str] | None = None) -> Dataset:
    """LEAF's FEMNIST: 1×28×28 handwritten characters of 62 classes, one client per writer (see the module)."""
    steps = _steps(locals())
    (x_tr, y_tr, id_tr), (x_te, y_te, id_te), names = leaf_users(
        "leaf_femnist", root, _femnist, steps, empty=np.zeros((0, FEMNIST_PIXELS), dtype=np.float32),
        download=download)
    x_tr, x_te = (x.reshape(-1, 1, 28, 28).astype(np.float32, copy=False) for x in (x_tr, x_te))
    mean, std = channel_stats(x_tr)
    return Dataset("leaf_femnist", normalise_(x_tr, mean, std), y_tr, normalise_(x_te, mean, std), y_te, 62,
                   mean, std, train_ids=id_tr, test_ids=id_te, client_names=names)


@register_dataset("leaf_shakespeare", limits=LIMITS, check=check_steps)
def load_leaf_shakespeare(root: Path, download: bool, *, sampling: Literal["niid", "iid"] | None = None,
                          sf: float = 0.1, iu: float = 0.01, min_samples: int | None = None,
                          split: Literal["sample", "user"] | None = None, train_fraction: float = 0.9,
                          sample_seed: int = SAMPLE_SEED, split_seed: int = SPLIT_SEED,
                          sample_order: list[str] | None = None, split_order: list[str] | None = None) -> Dataset:
    """LEAF's Shakespeare: next-character prediction over 80-character windows, one client per speaking role."""
    steps = _steps(locals())
    (x_tr, y_tr, id_tr), (x_te, y_te, id_te), names = leaf_users(
        "leaf_shakespeare", root, _shakespeare, steps, time_ordered=True,
        empty=np.zeros((0, 80), dtype=np.int64), download=download)
    return Dataset("leaf_shakespeare", x_tr, y_tr, x_te, y_te, NUM_LETTERS, train_ids=id_tr, test_ids=id_te,
                   client_names=names)


def split_line(text: str) -> list[str]:
    """LEAF's tokenisation of a tweet: runs of word characters and apostrophes, and the marks . , ! ? ;"""
    return WORDS.findall(text)


def sent140_vocabulary(texts: np.ndarray, embedding: str | None, max_vocab: int | None,
                       vocab_size: int) -> tuple[dict[str, int], int, np.ndarray | None]:
    """(word -> id, the unknown id, the (V+1)×D table or None): a GloVe file's words in file order, or the
    `vocab_size` most frequent training words (ties in sorted order) with the unknown id `vocab_size`."""
    if embedding is not None:
        from fedsim.data.text import load_embedding_table

        words, table = load_embedding_table(embedding, max_vocab)
        if not words:
            raise ConfigError("data.options.embedding: leaf_sent140 needs a GloVe-format .txt file (its words "
                              "are the vocabulary)")
        word2id = {w: i - 2 for w, i in words.items()}  # text.py's rows 0/1 are padding/unknown
        return word2id, len(word2id), np.concatenate([table[2:], np.zeros((1, table.shape[1]), np.float32)])
    counts = Counter(w for t in texts for w in split_line(t))
    vocab = sorted(counts, key=lambda w: (-counts[w], w))[:vocab_size]
    return {w: i for i, w in enumerate(vocab)}, vocab_size, None


def encode_tweets(texts: np.ndarray, word2id: dict[str, int], unknown: int) -> np.ndarray:
    """N×25 ids as LEAF's line_to_indices: the first 25 words, unknown words and padding both `unknown`."""
    out = np.full((len(texts), SENT140_LEN), unknown, dtype=np.int64)
    for i, text in enumerate(texts):
        ids = [word2id.get(w, unknown) for w in split_line(text)[:SENT140_LEN]]
        out[i, : len(ids)] = ids
    return out


@register_dataset("leaf_sent140", limits=LIMITS, check=check_steps)
def load_leaf_sent140(root: Path, download: bool, *, embedding: str | None = None, max_vocab: int | None = None,
                      vocab_size: int = SENT140_VOCAB, lowercase: bool = False,
                      sampling: Literal["niid", "iid"] | None = None,
                      sf: float = 0.1, iu: float = 0.01, min_samples: int | None = None,
                      split: Literal["sample", "user"] | None = None, train_fraction: float = 0.9,
                      sample_seed: int = SAMPLE_SEED, split_seed: int = SPLIT_SEED,
                      sample_order: list[str] | None = None, split_order: list[str] | None = None) -> Dataset:
    """LEAF's Sent140: tweets as 25 word ids, 2 sentiment classes, one client per Twitter user (see the module).
    Give the model the same `embedding`/`max_vocab` (frozen table) or `vocab_size` (trainable table)."""
    steps = _steps(locals())
    (t_tr, y_tr, id_tr), (t_te, y_te, id_te), names = leaf_users(
        "leaf_sent140", root, _sent140, steps, empty=np.zeros(0, dtype=object), download=download)
    if lowercase:
        t_tr, t_te = (np.array([t.lower() for t in ts], dtype=object) for ts in (t_tr, t_te))
    if embedding is not None:
        file = Path(embedding).expanduser()
        embedding = str(root / file if not file.is_absolute() and not file.exists() and (root / file).exists()
                        else file)
    word2id, unknown, table = sent140_vocabulary(t_tr, embedding, max_vocab, vocab_size)
    extras: dict[str, Any] = {"vocab_size": unknown}
    if table is not None:
        extras["embedding"] = table
    return Dataset("leaf_sent140", encode_tweets(t_tr, word2id, unknown), y_tr, encode_tweets(t_te, word2id, unknown),
                   y_te, 2, extras=extras, train_ids=id_tr, test_ids=id_te, client_names=names)
