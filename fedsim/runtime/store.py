"""Per-worker storage of personal client state: an LRU cache bounded in bytes, spilling to a disk folder.

A client without personal state costs nothing here, a spilled one a byte of the index (IdSet). States are dicts
of tensors (and plain values); spilled ones are packed like checkpoints and read back bit for bit with
torch.load(weights_only=True), so a spill file is data, never code. Every TRIM_EVERY bytes of states stored,
freed heap pages go back to the OS: long-lived states between a phase's short-lived tensors otherwise fragment
glibc's heap, and a worker's RSS grew to ~3x its cache.
"""

from __future__ import annotations

import functools
import shutil
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from fedsim.persist.checkpoint import load_packed, pack
from fedsim.persist.io import atomic_torch_save


def state_nbytes(obj: Any) -> int:
    """Bytes held by the tensors and arrays inside a nested structure (what would travel or be stored)."""
    import numpy as np

    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, dict):
        return sum(state_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(state_nbytes(v) for v in obj)
    if hasattr(obj, "__dataclass_fields__"):
        return sum(state_nbytes(getattr(obj, f)) for f in obj.__dataclass_fields__)
    if isinstance(obj, (int, float)):
        return 8
    return 0


TRIM_EVERY = 64 * 2**20


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Any:
    """glibc's malloc_trim, or None where there is none."""
    try:
        import ctypes
        import ctypes.util

        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
    except (OSError, AttributeError):
        return None


def release_free_heap() -> None:
    """Give free heap pages back to the OS (a no-op without glibc)."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


class IdSet:
    """A set of client ids as one byte each below the largest id (a bool array, grown by doubling): 1 MB for a
    million clients, where a Python set of ints costs about 60 bytes an id."""

    def __init__(self) -> None:
        self._has = np.zeros(0, dtype=bool)
        self._count = 0

    def add(self, cid: int) -> None:
        if cid >= len(self._has):
            grown = np.zeros(max(2 * len(self._has), cid + 1, 1024), dtype=bool)
            grown[:len(self._has)] = self._has
            self._has = grown
        if not self._has[cid]:
            self._has[cid] = True
            self._count += 1

    def discard(self, cid: int) -> None:
        if cid in self:
            self._has[cid] = False
            self._count -= 1

    def __contains__(self, cid: object) -> bool:
        return bool(isinstance(cid, (int, np.integer)) and 0 <= cid < len(self._has) and self._has[cid])

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[int]:
        return iter(np.flatnonzero(self._has).tolist())

    def clear(self) -> None:
        self._has = np.zeros(0, dtype=bool)
        self._count = 0


def _to_cpu(obj: Any) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


class ClientStateStore:
    """LRU cache of client states; beyond `capacity_bytes` the least recently used spill to `spill_dir`."""

    def __init__(self, capacity_bytes: int | None = None, spill_dir: str | Path | None = None) -> None:
        self.capacity = capacity_bytes
        self.spill_dir = Path(spill_dir) if spill_dir else None
        self._mem: OrderedDict[int, tuple[Any, int]] = OrderedDict()
        self._bytes = 0
        self._spilled = IdSet()  # ids whose state is on disk
        self.spills = 0
        self.loads = 0
        self._since_trim = 0

    def __contains__(self, cid: int) -> bool:
        return cid in self._mem or cid in self._spilled

    def __len__(self) -> int:
        return len(self._mem) + len(self._spilled)

    @property
    def memory_bytes(self) -> int:
        return self._bytes

    def _path(self, cid: int) -> Path:
        assert self.spill_dir is not None
        return self.spill_dir / f"{cid}.pt"

    def _read(self, cid: int) -> Any:
        return load_packed(self._path(cid), f"spilled state of client {cid}")

    def get(self, cid: int) -> Any | None:
        """The client's state, or None if it has none yet; reloads spilled states into the cache."""
        if cid in self._mem:
            self._mem.move_to_end(cid)
            return self._mem[cid][0]
        if cid in self._spilled:
            state = self._read(cid)
            self._spilled.discard(cid)
            self._path(cid).unlink(missing_ok=True)
            self.loads += 1
            self._insert(cid, state)
            return state
        return None

    def put(self, cid: int, state: Any) -> None:
        """Store (replace) a client's state; states are kept on the CPU."""
        self.discard(cid)
        self._insert(cid, _to_cpu(state))

    def discard(self, cid: int) -> None:
        if cid in self._mem:
            self._bytes -= self._mem.pop(cid)[1]
        if cid in self._spilled:
            self._spilled.discard(cid)
            self._path(cid).unlink(missing_ok=True)

    def _insert(self, cid: int, state: Any) -> None:
        size = state_nbytes(state)
        self._mem[cid] = (state, size)
        self._bytes += size
        self._evict(keep=cid)
        self._since_trim += size
        if self._since_trim >= TRIM_EVERY:
            self._since_trim = 0
            release_free_heap()

    def _evict(self, keep: int) -> None:
        if self.capacity is None:
            return
        if self.spill_dir is None:
            raise ValueError("runtime.cache_bytes is set but there is no spill folder")
        self.spill_dir.mkdir(parents=True, exist_ok=True)
        while self._bytes > self.capacity and len(self._mem) > 1:
            cid, (state, size) = next(iter(self._mem.items()))
            if cid == keep:
                self._mem.move_to_end(cid)
                continue
            atomic_torch_save(pack(state), self._path(cid))
            del self._mem[cid]
            self._bytes -= size
            self._spilled.add(cid)
            self.spills += 1

    def items(self) -> Iterator[tuple[int, Any]]:
        """Every (client id, state), spilled ones read from disk without disturbing the cache."""
        for cid in sorted(set(self._mem).union(self._spilled)):
            if cid in self._mem:
                yield cid, self._mem[cid][0]
            else:
                yield cid, self._read(cid)

    def export(self) -> dict[int, Any]:
        """All states, for a checkpoint."""
        return dict(self.items())

    def load(self, states: dict[int, Any]) -> None:
        """Replace the contents with `states` (from a checkpoint)."""
        self.clear()
        for cid, st in sorted(states.items()):
            self.put(int(cid), st)

    def clear(self) -> None:
        self._mem.clear()
        self._bytes = 0
        if self.spill_dir is not None and self.spill_dir.exists():
            shutil.rmtree(self.spill_dir, ignore_errors=True)
        self._spilled.clear()
