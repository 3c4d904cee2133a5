"""FedBN (Li et al. 2021, https://arxiv.org/abs/2102.07623): local BatchNorm, everything else averaged.

    client k: model = (global non-BN entries, own BatchNorm weights, biases and running statistics); local SGD
    server:   non-BN entries ← Σ_k |D_k|·w_k / Σ_k |D_k|;   BatchNorm layers never leave their clients

A model without BatchNorm is refused (FedBN would be FedAvg). A client's BatchNorm layers start from the run's
initial model. The server model (shared entries with initial BatchNorm) is what a never-trained client is scored
with; the personal model, scored at each evaluation, is the server's current shared entries with the client's own
BatchNorm layers.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.algorithms.fedper import FedPer
from fedsim.method import Env, personal, register_algorithm


@dataclass
class FedBNParams:
    """No knobs of its own: the BatchNorm layers are the personal ones (FedPer's personal_layers does not apply)."""


@register_algorithm
class FedBN(FedPer):
    """FedAvg that keeps every BatchNorm layer (parameters and running statistics) at its client."""

    name = "fedbn"
    Params = FedBNParams

    def personal_keys(self, env: Env, arch: str) -> frozenset[str]:
        return personal.batchnorm_keys(env, arch, "model.mix" if env.config.model.mix else "model.name")
