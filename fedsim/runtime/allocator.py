"""glibc's malloc told to keep a round's freed blocks, in the processes fedsim owns: its Ray workers and the `fedsim`
command's own process (where the local backend trains). Not in a process that merely imports fedsim (a notebook):
the setting is the whole process's."""

from __future__ import annotations

import os

MMAP_THRESHOLD = 32 * 2**20  # glibc's largest: blocks below it come from the heap, not a fresh mmap
TRIM_THRESHOLD = 256 * 2**20  # free memory at the heap's top kept for the next round, up to this


def keep_freed_blocks() -> bool:
    """Let glibc's malloc reuse a round's freed blocks in this process: each client allocates and frees the same
    few-hundred-KB tensors (its upload, gradients, optimizer buffers), and by default glibc maps blocks over 128 KB
    afresh and gives the heap's top back, so every client pays page faults for them again (until glibc's own
    threshold has grown, some rounds in). Skipped where the user tuned glibc's malloc (MALLOC_ variables,
    GLIBC_TUNABLES) or the C library has no mallopt; returns whether it was set."""
    import ctypes

    if any(k.startswith("MALLOC_") for k in os.environ) or "glibc.malloc" in os.environ.get("GLIBC_TUNABLES", ""):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, MMAP_THRESHOLD)) and bool(mallopt(m_trim_threshold, TRIM_THRESHOLD))
