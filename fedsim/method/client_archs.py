"""The architecture of every client id, held as runs of consecutive ids: its size grows with the number of
architectures, not of registered clients, so a million clients cost a few bytes here."""

from __future__ import annotations

import bisect
import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import overload


class ClientArchs(Sequence[str]):
    """`archs[cid]` is client `cid`'s architecture: `model.mix` in order (`{resnet8: 6, cnn: 4}` gives ids 0-5
    resnet8, 6-9 cnn), or one name for all. Lookup is a binary search over the runs."""

    def __init__(self, runs: Iterable[tuple[str, int]]) -> None:
        runs = [(name, int(count)) for name, count in runs if int(count) > 0]
        self.names: tuple[str, ...] = tuple(name for name, _ in runs)
        ends, total = [], 0
        for _, count in runs:
            total += count
            ends.append(total)
        self.ends: tuple[int, ...] = tuple(ends)  # one past the last id of each run

    @classmethod
    def uniform(cls, name: str, num_clients: int) -> ClientArchs:
        """Every client the same architecture."""
        return cls([(name, num_clients)])

    def __len__(self) -> int:
        return self.ends[-1] if self.ends else 0

    @overload
    def __getitem__(self, index: int) -> str: ...
    @overload
    def __getitem__(self, index: slice) -> list[str]: ...

    def __getitem__(self, index: int | slice) -> str | list[str]:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        n = len(self)
        if i < 0:
            i += n
        if not 0 <= i < n:
            raise IndexError(f"client {index} is not registered ({n} clients)")
        return self.names[bisect.bisect_right(self.ends, i)]

    def __contains__(self, arch: object) -> bool:
        return arch in self.names

    def __iter__(self) -> Iterator[str]:
        start = 0
        for name, end in zip(self.names, self.ends, strict=True):
            for _ in range(end - start):
                yield name
            start = end

    def count(self, arch: str) -> int:
        """Clients with architecture `arch`."""
        starts = (0, *self.ends[:-1])
        return sum(end - start for name, start, end in zip(self.names, starts, self.ends, strict=True)
                   if name == arch)

    def distinct(self) -> list[str]:
        """The architectures, in first-appearance order."""
        return list(dict.fromkeys(self.names))

    def __eq__(self, other: object) -> bool:
        if isinstance(other, ClientArchs):
            return (self.names, self.ends) == (other.names, other.ends)
        return isinstance(other, Sequence) and not isinstance(other, str) and list(self) == list(other)

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        starts = (0, *self.ends[:-1])
        return "ClientArchs(" + ", ".join(f"{n}: {e - s}" for n, s, e in zip(self.names, starts, self.ends,
                                                                           strict=True)) + ")"
