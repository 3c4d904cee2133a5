"""Reading a per-client CSV (a device trace, an availability trace) as data: every problem is one DataError naming
the config key, the file, the column and the first bad row (counted from 1 after the header)."""

from __future__ import annotations

import os

import numpy as np

from fedsim.errors import DataError


def read_csv(path: str, key: str, read: tuple[str, ...], required: tuple[str, ...]):
    """The CSV at `path` as a DataFrame of strings (columns stripped) and each row's number; the columns in `read`
    may appear once each (other columns are not read), those in `required` must be there."""
    import pandas as pd

    if os.path.isdir(path):
        raise DataError(f"{key}: {path} is a folder, not a file")
    if os.path.exists(path) and not os.path.isfile(path):  # a device or a pipe would be read forever
        raise DataError(f"{key}: {path} is not a regular file")
    try:
        header = _header(path)
        df = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True)
    except (OSError, ValueError) as exc:  # missing, unreadable, not UTF-8, malformed rows
        raise DataError(f"{key}: cannot read {path}: {' '.join(str(exc).split())[:200]}") from None
    twice = next((c for i, c in enumerate(header) if c in read and c in header[:i]), None)
    if twice is not None:  # pandas would rename the second one and read the first: which did the writer mean?
        raise DataError(f"{key}: {path} has the column {twice!r} twice")
    df.columns = [str(c).strip() for c in df.columns]
    missing = [c for c in required if c not in df.columns]
    if missing:
        raise DataError(f"{key}: {path} lacks columns {missing} (it has {list(df.columns)})")
    return df, np.arange(len(df)) + 1  # data rows, counted from 1 after the header (blank lines skipped)


def _header(path: str) -> list[str]:
    """The CSV's column names as written (stripped), duplicates kept."""
    import csv

    with open(path, newline="", encoding="utf-8") as f:
        return [c.strip() for c in next(csv.reader(f), [])]


def client_column(df, key: str, path: str, row_no: np.ndarray) -> np.ndarray:
    """The `client` column as int64 ids (0, 1, 2, ...); else a DataError naming the first bad row."""
    clients = number_column(df, "client", key, path, row_no)
    not_id = (clients % 1 != 0) | (clients < 0) | (clients > 2**53)
    if not_id.any():
        bad = int(np.flatnonzero(not_id)[0])
        raise DataError(f"{key}: {path} column client, row {row_no[bad]}: "
                        f"{df['client'].iloc[bad]!r} is not a client id (0, 1, 2, ...)")
    return clients.astype(np.int64)


def number_column(df, column: str, key: str, path: str, row_no: np.ndarray, rows: np.ndarray | None = None,
                  bounds: tuple[float, float] | None = None, low_included: bool = False) -> np.ndarray:
    """One column (at `rows`, else all of it) as finite floats within `bounds` ((low, high], or [low, high]
    with `low_included`); else a DataError naming the first bad row."""
    import pandas as pd

    text = df[column].to_numpy()
    if rows is not None:
        text, row_no = text[rows], row_no[rows]
    values = pd.to_numeric(pd.Series(text), errors="coerce").to_numpy(float)
    bad = ~np.isfinite(values)
    allowed = "a number"
    if bounds is not None:
        low, high = bounds
        bad |= ~((values >= low if low_included else values > low) & (values <= high))
        allowed = f"a number in {'[' if low_included else '('}{low:g}, {high:g}]"
    if bad.any():
        i = int(np.flatnonzero(bad)[0])
        raise DataError(f"{key}: {path} column {column}, row {row_no[i]}: {text[i]!r} is not {allowed}")
    return values
