"""FedProx (Li et al. 2020, https://arxiv.org/abs/1812.06127): FedAvg with a proximal term mu/2·||w - w_global||²."""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.algorithms.fedavg import FedAvg, FedAvgParams
from fedsim.method import knob, register_algorithm


@dataclass
class FedProxParams(FedAvgParams):
    mu: float = knob(0.01, ge=0, doc="proximal weight mu")


@register_algorithm
class FedProx(FedAvg):
    """FedAvg whose local objective keeps the model near the round's global model."""

    name = "fedprox"
    Params = FedProxParams

    def proximal_mu(self) -> float:
        return self.params.mu
