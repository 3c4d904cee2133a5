"""LEAF's 80-symbol character table for Shakespeare next-character prediction, shared by every loader of it.

The LEAF loader (`leaf_shakespeare`) and the Hugging Face loader (`hf` with the flwrlabs/shakespeare preset) both
encode text through this one table, so a character has the same id (its position in `LETTERS`) in either, and a
model trained on one reads the other. The table is LEAF's `ALL_LETTERS` (models/utils/language_utils.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from fedsim.errors import DataError

LETTERS = "\n !\"&'(),-.0123456789:;>?ABCDEFGHIJKLMNOPQRSTUVWXYZ[]abcdefghijklmnopqrstuvwxyz}"
NUM_LETTERS = len(LETTERS)  # 80

_CODES = np.full(128, -1, dtype=np.int64)  # every symbol is ASCII; any other code point is unknown
_CODES[[ord(c) for c in LETTERS]] = np.arange(NUM_LETTERS)


def letter_ids(texts: Sequence[str], where: str, length: int | None = None) -> np.ndarray:
    """N×L int64 ids of `texts` in `LETTERS` (L = `length`, or the texts' common length). A text of another length
    or a character outside the table is a one-line DataError naming `where` and the row: LEAF's own lookup
    (`str.find`) would turn it into -1, which no embedding can take."""
    n = len(texts)
    if n == 0:
        return np.zeros((0, length or 0), dtype=np.int64)
    width = len(texts[0]) if length is None else length
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or len(t) != width), None)
    if bad is not None:
        got = texts[bad]
        what = f"{len(got)} characters" if isinstance(got, str) else type(got).__name__
        raise DataError(f"{where}: row {bad} is {what}, expected a string of {width} characters (as every row)")
    joined = np.frombuffer("".join(texts).encode("utf-32-le"), dtype=np.uint32).astype(np.int64)
    ids = np.where(joined < 128, _CODES[np.minimum(joined, 127)], -1).reshape(n, width)
    if (ids < 0).any():
        flat = int(np.flatnonzero(ids.reshape(-1) < 0)[0])
        row, col = divmod(flat, width)
        raise DataError(f"{where}: row {row} has character {texts[row][col]!r}, which is not in LEAF's "
                        f"{NUM_LETTERS}-symbol table")
    return ids
