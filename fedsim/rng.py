"""Named random streams: every draw of a run comes from (run seed, stream name, round, client, phase).

A stream's name says what it feeds ("client", "init/<arch>", "feddf/selection", ...). Distinct names give
independent streams, and a stream's numbers depend only on its key, never on worker count, call order or
process, which is what makes runs reproducible across backends. Seeds are < 2^31: every library takes them
(FAISS and scikit-learn want a C int), and a seed recorded as a float metric is exact.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

UNSET = -1  # a key part that does not apply to the stream (no round, no client, no phase)


def _name_key(name: str) -> int:
    return int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")


def seed(run_seed: int, name: str, round: int = UNSET, client: int = UNSET, phase: int = UNSET) -> int:
    """The seed of stream `name` at (round, client, phase)."""
    if not name:
        raise ValueError("a random stream needs a name")
    key = [int(run_seed), _name_key(name), int(round) + 1, int(client) + 1, int(phase) + 1]
    if min(key) < 0:
        raise ValueError(f"stream {name!r}: round, client and phase must be >= {UNSET}, got {key[2:]}")
    return int(np.random.SeedSequence(key).generate_state(1, dtype=np.uint32)[0] >> 1)  # 31 bits: fits C ints


def torch_generator(run_seed: int, name: str, round: int = UNSET, client: int = UNSET, phase: int = UNSET,
                    device: torch.device | str = "cpu") -> torch.Generator:
    """A torch generator on stream `name`."""
    return torch.Generator(device=device).manual_seed(seed(run_seed, name, round, client, phase))


def numpy_generator(run_seed: int, name: str, round: int = UNSET, client: int = UNSET,
                    phase: int = UNSET) -> np.random.Generator:
    """A numpy generator on stream `name`."""
    return np.random.default_rng(seed(run_seed, name, round, client, phase))
