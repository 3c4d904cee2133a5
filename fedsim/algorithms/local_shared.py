"""Baseline (5% shared) of Banerjee 2022 (FedGDKD thesis, §5.1, Table 5.2): local training on private data
plus a pool made of a random 5% of every client's private data.

It measures what FedMD and FD + FAug (whose public/GAN data are the same shares) add beyond sharing the
data itself. [C] Shares stay in their owners' private sets; 15 pre-training epochs, then n per round.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.algorithms.local_only import LocalOnly, LocalOnlyParams
from fedsim.method import knob, register_algorithm


@dataclass
class LocalSharedParams(LocalOnlyParams):
    share_fraction: float = knob(0.05, gt=0, le=1, doc="fraction of each client's data pooled and shared")


@register_algorithm
class LocalShared(LocalOnly):
    """Local training on private data plus the shared pool (sent once per client after round 0's shares)."""

    name = "local_shared"
    Params = LocalSharedParams

    @property
    def share_fraction(self) -> float:
        return self.params.share_fraction
