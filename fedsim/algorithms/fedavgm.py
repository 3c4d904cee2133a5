"""FedAvgM (Hsu, Qi & Brown 2019, "Measuring the Effects of Non-Identical Data Distribution for Federated Visual
Classification", https://arxiv.org/abs/1909.06335): FedAvg's clients; momentum on the server.

    server: x ← init, u ← 0
    each round: x̄ ← FedAvg of the sampled clients' models   (FedAvg's weighting: samples or uniform)
                g ← x − x̄;  u ← β·u + g;  x ← x − η_s·u

β = 0 and η_s = 1 is FedAvg. The step is fedsim.method.server_opt's, shared with the FedOpt family.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.algorithms.fedavg import FedAvg, FedAvgParams
from fedsim.method import (
    ServerOptimizer,
    knob,
    register_algorithm,
)


@dataclass
class FedAvgMParams(FedAvgParams):
    server_lr: float = knob(1.0, gt=0, doc="server step size η_s on the momentum (1.0: the paper's and Flower's)")
    momentum: float = knob(0.9, ge=0, lt=1, doc="server momentum β (0.9: the paper's baseline value; Flower's "
                                                "default is 0.0, which with η_s = 1 is plain FedAvg)")


@register_algorithm
class FedAvgM(FedAvg):
    """FedAvg's clients; the server steps along a momentum of the rounds' pseudo-gradients."""

    name = "fedavgm"
    Params = FedAvgMParams

    def server_optimizer(self) -> ServerOptimizer:
        return ServerOptimizer("avgm", self.params.server_lr, momentum=self.params.momentum)
