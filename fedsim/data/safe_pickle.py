"""Reading pickled dataset files (CIFAR's python batches) as data: only plain values and numpy arrays come back.

A downloaded file is data, never code: `pickle.load` would call any function the file names. This
unpickler resolves only the few numpy names that rebuild an array, so a crafted file fails to load instead.
"""

from __future__ import annotations

import pickle
from pathlib import Path
from typing import Any

import numpy as np

from fedsim.errors import DataError

# What numpy pickles an ndarray as (numpy 1.x and 2.x module paths), and how protocol 2 writes bytes
# (`_codecs.encode` of a latin-1 string; b"" as `bytes()`, see `_empty_bytes`); nothing else is resolvable.
_ARRAY_GLOBALS = {
    ("numpy.core.multiarray", "_reconstruct"), ("numpy._core.multiarray", "_reconstruct"),
    ("numpy", "ndarray"), ("numpy", "dtype"), ("_codecs", "encode"),
}


def _empty_bytes(*args: Any) -> bytes:
    """`bytes()`, as protocol 2 writes b"" (an empty array's buffer); arguments are refused (bytes(n) allocates n)."""
    if args:
        raise pickle.UnpicklingError("refusing to call bytes() with arguments")
    return b""


class _ArrayOnlyUnpickler(pickle.Unpickler):
    arrays = True  # whether numpy arrays may be rebuilt; without, only plain values (no global resolves)

    def find_class(self, module: str, name: str) -> Any:
        if not self.arrays:
            raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only plain values: dicts, lists, "
                                         "numbers, strings)")
        if (module, name) in _ARRAY_GLOBALS:
            return super().find_class(module, name)
        if (module, name) in (("__builtin__", "bytes"), ("builtins", "bytes")):
            return _empty_bytes
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} (only numpy arrays and plain values)")


def _check(obj: Any, path: Path) -> Any:
    """Refuse object arrays anywhere in `obj`; iterative, with each container visited once, so deep or
    self-referencing containers (which a pickle can build) cannot exhaust the recursion limit."""
    pending, seen = [obj], set()
    while pending:
        item = pending.pop()
        if id(item) in seen:
            continue
        seen.add(id(item))
        if isinstance(item, np.ndarray) and item.dtype.hasobject:
            raise DataError(f"{path}: holds an object array; expected numbers")
        if isinstance(item, dict):
            pending.extend(item.values())
        elif isinstance(item, (list, tuple)):
            pending.extend(item)
    return obj


def load_pickle_data(path: str | Path, arrays: bool = True) -> Any:
    """Unpickle `path` allowing only numbers, strings, bytes, containers and numeric numpy arrays (without `arrays`:
    no numpy array either, only plain values).

    A malformed or crafted file is a one-line DataError; a missing or unreadable one raises OSError, so
    the caller can say which files it expected where."""
    path = Path(path)
    try:
        with open(path, "rb") as fh:
            unpickler = _ArrayOnlyUnpickler(fh, encoding="latin1")
            unpickler.arrays = arrays
            obj = unpickler.load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError, IndexError,
            OverflowError, UnicodeDecodeError, MemoryError) as exc:
        raise DataError(f"{path}: not a readable data pickle ({type(exc).__name__}: {exc})") from None
    return _check(obj, path)
