"""FedProx (Li et al. 2020, https://arxiv.org/abs/1812.06127): FedAvg with a proximal term mu/2·||w - w_global||²."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsim.algorithms.base import register_algorithm
from fedsim.algorithms.fedavg import FedAvg, FedAvgParams
from fedsim.configtools import knob
from fedsim.train import LossTerm


@dataclass
class FedProxParams(FedAvgParams):
    mu: float = knob(0.01, ge=0, doc="proximal weight mu")


def proximal_term(mu: float, anchor: dict[str, torch.Tensor]) -> LossTerm:
    """A loss term mu/2·Σ||w - anchor||² over the model's trainable parameters."""

    def term(model: torch.nn.Module) -> torch.Tensor | float:
        total = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        return 0.5 * mu * total

    return term


@register_algorithm
class FedProx(FedAvg):
    """FedAvg whose local objective keeps the model near the round's global model."""

    name = "fedprox"
    Params = FedProxParams

    def extra_loss(self, model: torch.nn.Module) -> LossTerm | None:
        if self.params.mu == 0:
            return None
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}  # the round's global weights
        return proximal_term(self.params.mu, anchor)
