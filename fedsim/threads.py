"""How many torch threads client steps and the server get, the same on every backend: PyTorch's CPU kernels may
sum in an order that depends on the thread count (a convolution's backward does), so a run's numbers match across
backends and worker counts only at the same count."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig


def client_threads(cfg: RunConfig) -> int:
    """A worker's threads for its clients: runtime.threads, else its CPU share (runtime.client_cpus, at least 1)."""
    return cfg.runtime.threads or max(1, int(cfg.runtime.client_cpus))


def process_cpus() -> int:
    """The CPUs this process may use: OMP_NUM_THREADS where set (Ray sets it to a task's CPUs, e.g. a sweep's
    trial), else its affinity, else the machine's count."""
    omp = os.environ.get("OMP_NUM_THREADS", "")
    if omp.isdigit() and int(omp) > 0:
        return int(omp)
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return max(1, os.cpu_count() or 1)


def server_threads(cfg: RunConfig) -> int:
    """The server's threads: runtime.threads; else, when it reserves CPUs or GPUs (a Ray server actor), its CPU
    share (at least 1); else every CPU of the driver's process, which it shares with idle workers."""
    rt = cfg.runtime
    if rt.threads:
        return rt.threads
    if rt.server_cpus > 0 or rt.server_gpus > 0:
        return max(1, int(rt.server_cpus))
    return process_cpus()


@contextlib.contextmanager
def torch_threads(n: int) -> Iterator[None]:
    """torch's intra-op thread count set to `n` inside, and put back after (it is per process)."""
    before = torch.get_num_threads()
    if n != before:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != before:
            torch.set_num_threads(before)
