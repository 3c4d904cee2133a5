"""FedAdagrad (Reddi et al. 2021, "Adaptive Federated Optimization", https://arxiv.org/abs/2003.00295,
Algorithm 2): FedAvg's clients; the server takes an Adagrad step along the round's mean update.

    server: x ← init, m ← 0, v ← v_init
    each round: Δ ← mean over the sampled clients of (x_k − x)   (FedAvg's weighting: samples or uniform)
                m ← β1·m + (1−β1)·Δ;  v ← v + Δ²;  x ← x + η·m/(√v + τ)

β1 = 0 (the default, Flower's) makes m the round's Δ. No bias correction. The step is fedsim.method.server_opt's.
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
class FedAdagradParams(FedAvgParams):
    server_lr: float = knob(0.1, gt=0, doc="server step size η (0.1: Flower's default; the paper tunes it)")
    beta1: float = knob(0.0, ge=0, lt=1, doc="first-moment decay β1 (0: Flower's, m is the round's update)")
    tau: float = knob(1e-3, gt=0, doc="adaptivity τ added to √v (1e-3: the paper's recommendation, Flower's "
                                      "new API; its legacy strategy has 1e-9)")
    v_init: float = knob(0.0, ge=0, doc="initial v (0: the reference implementation's; Algorithm 2 asks v ≥ τ²)")


@register_algorithm
class FedAdagrad(FedAvg):
    """FedAvg's clients; an Adagrad step on the server along the mean client update."""

    name = "fedadagrad"
    Params = FedAdagradParams

    def server_optimizer(self) -> ServerOptimizer:
        p = self.params
        return ServerOptimizer("adagrad", p.server_lr, beta1=p.beta1, tau=p.tau, v_init=p.v_init)
