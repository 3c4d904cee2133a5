"""FedAdam (Reddi et al. 2021, "Adaptive Federated Optimization", https://arxiv.org/abs/2003.00295, Algorithm 2):
FedAvg's clients; the server takes an Adam step along the round's mean update.

    server: x ← init, m ← 0, v ← v_init
    each round: Δ ← mean over the sampled clients of (x_k − x)   (FedAvg's weighting: samples or uniform)
                m ← β1·m + (1−β1)·Δ;  v ← β2·v + (1−β2)·Δ²;  x ← x + η·m/(√v + τ)

No bias correction, as Algorithm 2; `bias_correction: true` takes Flower's form η·√(1−β2^t)/(1−β1^t) with t the
server step (1, 2, ...). The step is fedsim.method.server_opt's, shared with FedYogi and FedAdagrad.
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
class FedAdamParams(FedAvgParams):
    server_lr: float = knob(0.1, gt=0, doc="server step size η (0.1: Flower's default; the paper tunes it)")
    beta1: float = knob(0.9, ge=0, lt=1, doc="first-moment decay β1 (0.9: the paper's and Flower's)")
    beta2: float = knob(0.99, ge=0, lt=1, doc="second-moment decay β2 (0.99: the paper's and Flower's)")
    tau: float = knob(1e-3, gt=0, doc="adaptivity τ added to √v (1e-3: the paper's recommendation, Flower's "
                                      "new API; its legacy strategy has 1e-9)")
    v_init: float = knob(0.0, ge=0, doc="initial v (0: the reference implementation's; Algorithm 2 asks v ≥ τ²)")
    bias_correction: bool = knob(False, doc="scale η by √(1−β2^t)/(1−β1^t), t the server step from 1 "
                                            "(Flower's FedAdam; Algorithm 2 has none)")


@register_algorithm
class FedAdam(FedAvg):
    """FedAvg's clients; an Adam step on the server along the mean client update."""

    name = "fedadam"
    Params = FedAdamParams

    def server_optimizer(self) -> ServerOptimizer:
        p = self.params
        return ServerOptimizer("adam", p.server_lr, beta1=p.beta1, beta2=p.beta2, tau=p.tau, v_init=p.v_init,
                               bias_correction=p.bias_correction)
