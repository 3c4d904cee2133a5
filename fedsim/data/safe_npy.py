"""Reading .npy and .npz arrays no larger than the file that holds them.

numpy allocates the shape an array's header claims before it reads a byte, so a damaged or forged header (a
user's file, or one from elsewhere) could ask for terabytes; here such a file is a one-line DataError instead.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import IO

import numpy as np

from fedsim.errors import DataError


def check_archive(file: Path, name: str, key: str) -> None:
    """Refuse a file that is not a zip archive before numpy opens it: numpy takes anything else for a pickle, and
    its error advises loading it with allow_pickle=True, which would run the file's code."""
    with open(file, "rb") as fh:
        if fh.read(4) not in (b"PK\x03\x04", b"PK\x05\x06"):
            raise DataError(f"{name}: {file}: not an .npz archive (a zip of .npy arrays, as numpy.savez writes it); "
                            f"fedsim reads no other format from {key}")


def npz_header(data: np.lib.npyio.NpzFile, key: str, where: str) -> tuple[tuple[int, ...], np.dtype]:
    """(shape, dtype) of `data[key]` from its header alone (what decoding it would allocate), refused when it holds
    Python objects or claims more bytes than its member of the archive holds."""
    archive = data.zip
    assert archive is not None, "an open NpzFile"
    name = f"{key}.npy" if f"{key}.npy" in archive.namelist() else key
    with archive.open(name) as f:
        return _check_claim(f, archive.getinfo(name).file_size, f"{where}: {key}")


def npz_array(data: np.lib.npyio.NpzFile, key: str, where: str) -> np.ndarray:
    """`data[key]`, refused as `npz_header` refuses it."""
    if data.zip is not None:  # a closed NpzFile: let numpy say so
        npz_header(data, key, where)
    return data[key]


def npy_array(file: Path) -> np.ndarray:
    """The array of a .npy file, refused when its header claims more bytes than the file holds."""
    with open(file, "rb") as f:
        _check_claim(f, os.fstat(f.fileno()).st_size, str(file))
    return np.load(file, allow_pickle=False)


def _check_claim(f: IO[bytes], holds: int, where: str) -> tuple[tuple[int, ...], np.dtype]:
    version = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
    shape, _, dtype = read(f)
    if dtype.hasobject:  # numpy would unpickle it (and its error advises allow_pickle=True, which runs its code)
        raise DataError(f"{where} holds Python objects (dtype {dtype}), not numbers: fedsim reads numeric arrays "
                        "only, and never unpickles a data file; save it with a numeric dtype")
    claimed = math.prod(shape) * dtype.itemsize
    if claimed > holds:
        raise DataError(f"{where} claims shape {tuple(shape)} of {dtype} ({claimed:,} bytes) but the file holds "
                        f"{holds:,} bytes: it is damaged or forged")
    return tuple(shape), dtype
