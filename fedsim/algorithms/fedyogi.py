"""FedYogi (Reddi et al. 2021, "Adaptive Federated Optimization", https://arxiv.org/abs/2003.00295, Algorithm 2):
FedAvg's clients; the server takes a Yogi step along the round's mean update.

    server: x ← init, m ← 0, v ← v_init
    each round: Δ ← mean over the sampled clients of (x_k − x)   (FedAvg's weighting: samples or uniform)
                m ← β1·m + (1−β1)·Δ;  v ← v − (1−β2)·Δ²·sign(v − Δ²);  x ← x + η·m/(√v + τ)

No bias correction (Algorithm 2, and Flower's FedYogi). The step is fedsim.method.server_opt's.
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
class FedYogiParams(FedAvgParams):
    server_lr: float = knob(0.01, gt=0, doc="server step size η (0.01: Flower's default; the paper tunes it)")
    beta1: float = knob(0.9, ge=0, lt=1, doc="first-moment decay β1 (0.9: the paper's and Flower's)")
    beta2: float = knob(0.99, ge=0, lt=1, doc="second-moment decay β2 (0.99: the paper's and Flower's)")
    tau: float = knob(1e-3, gt=0, doc="adaptivity τ added to √v (1e-3: the paper's recommendation and Flower's)")
    v_init: float = knob(0.0, ge=0, doc="initial v (0: the reference implementation's; Algorithm 2 asks v ≥ τ²)")


@register_algorithm
class FedYogi(FedAvg):
    """FedAvg's clients; a Yogi step on the server along the mean client update."""

    name = "fedyogi"
    Params = FedYogiParams

    def server_optimizer(self) -> ServerOptimizer:
        p = self.params
        return ServerOptimizer("yogi", p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau, v_init=p.v_init)
