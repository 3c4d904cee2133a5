"""FedProx (Li et al. 2020, https://arxiv.org/abs/1812.06127): FedAvg with a proximal term mu/2·||w - w_global||²."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from fedsim.algorithms.base import ClientContext, register_algorithm
from fedsim.algorithms.fedavg import FedAvg, FedAvgParams
from fedsim.configtools import knob
from fedsim.train import make_optimizer, train_classifier


@dataclass
class FedProxParams(FedAvgParams):
    mu: float = knob(0.01, ge=0, doc="proximal weight mu")


def proximal_term(mu: float, anchor: dict[str, torch.Tensor]):
    """A loss term mu/2·Σ||w - anchor||² over the model's trainable parameters."""

    def term(model: torch.nn.Module) -> torch.Tensor:
        total = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        return 0.5 * mu * total

    return term


@register_algorithm
class FedProx(FedAvg):
    """FedAvg whose local objective keeps the model near the round's global model."""

    name = "fedprox"
    Params = FedProxParams

    def local_train(self, model, global_state, ctx: ClientContext, personal):
        anchor = {n: p.detach().clone() for n, p in model.named_parameters()}
        opt = make_optimizer(model.parameters(), ctx.env.config.train)
        extra = proximal_term(self.params.mu, anchor) if self.params.mu > 0 else None
        metrics = train_classifier(model, ctx.data.x, ctx.data.y, ctx.env.config.train, ctx.generator(),
                                   extra_loss=extra, optimizer=opt)
        return metrics, None
