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

_CODES = np.full(128, -1, dtype=np.int8)  # by ASCII code; every symbol is ASCII
_CODES[[ord(c) for c in LETTERS]] = np.arange(NUM_LETTERS)
_BLOCK = 65536  # rows encoded at a time


def letter_ids(texts: Sequence[str], where: str, length: int | None = None) -> np.ndarray:
    """N×L int64 ids of `texts` in `LETTERS` (L = `length`, or the texts' common length). A text of another length
    or a character outside the table is a one-line DataError naming `where` and the row: LEAF's own lookup
    (`str.find`) would turn it into -1, which no embedding can take. Encoded in blocks of rows, so that the
    temporaries stay small beside the N×L result (LEAF's Shakespeare has about 4 million rows)."""
    width = (len(texts[0]) if len(texts) and isinstance(texts[0], str) else 0) if length is None else length
    bad = next((i for i, t in enumerate(texts) if not isinstance(t, str) or len(t) != width), None)
    if bad is not None:
        got = texts[bad]
        what = f"{len(got)} characters" if isinstance(got, str) else type(got).__name__
        raise DataError(f"{where}: row {bad} is {what}, expected a string of {width} characters (as every row)")
    out = np.empty((len(texts), width), dtype=np.int64)
    for start in range(0, len(texts), _BLOCK):
        block = texts[start:start + _BLOCK]
        joined = "".join(block)
        ascii = joined.isascii()  # every symbol is ASCII: a block that is not holds an unknown character
        ids = _CODES[np.frombuffer(joined.encode("ascii"), dtype=np.uint8)] if ascii else np.full(len(joined), -1)
        if (ids < 0).any():
            first = int(np.flatnonzero(ids < 0)[0]) if ascii else next(i for i, c in enumerate(joined) if ord(c) > 127)
            row, col = divmod(first, width)
            raise DataError(f"{where}: row {start + row} has character {block[row][col]!r}, which is not in LEAF's "
                            f"{NUM_LETTERS}-symbol table")
        out[start:start + len(block)] = ids.reshape(len(block), width)
    return out
