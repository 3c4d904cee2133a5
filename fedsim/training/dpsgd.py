"""Sample-level DP-SGD (Abadi et al. 2016) for a client's local training, as `train_classifier(..., dp=...)` runs it.

- Each step draws a Poisson batch: every sample joins with probability q = min(1, B / n), the sampling the
  accountant models (a shuffled fixed-size batch is not Poisson sampling, and accounting it as one under-reports).
- Per-sample gradients come from torch.func.vmap over functional_call and one backward pass of the per-sample
  losses' sum: each sample's copy of the weights reaches only its own loss.
- Each gradient is clipped over all parameters at once (flat clipping, Opacus's factor):
  ḡ_j = g_j · min(1, C / (‖g_j‖ + 1e-6)); the step's gradient is (Σ_j ḡ_j + N(0, z²C²·I)) / (q·n), divided by the
  *expected* batch size, so one sample moves it by at most C / (q·n) whatever the batch drawn.
- A loss term that does not read the data (FedProx's proximal term, SCAFFOLD's correction) adds its own gradient
  after the noise: it costs no privacy. Weight decay and momentum act on the noised gradient, as in Opacus.
- The noise comes from the named stream `privacy-sample-noise/<phase>` at (round, client): the same draws on any
  number of workers. BatchNorm mixes the samples of a batch and is refused (fedsim.transforms.sample_dp).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from fedsim.config.schema import TrainConfig
from fedsim.training.optim import SGD, Adam

NOISE_STREAM = "privacy-sample-noise"
"""The named stream of a client's DP-SGD noise, with its phase appended."""


@dataclass
class DPSGD:
    """A client's DP-SGD settings: per-sample clip C, noise multiplier z, and the generator its noise comes from."""

    clip: float
    noise_multiplier: float
    noise: torch.Generator


def sample_rate(num_samples: int, batch_size: int) -> float:
    """q: the probability that a sample joins a step's Poisson batch (the expected batch is the batch size)."""
    return min(1.0, batch_size / num_samples) if num_samples else 0.0


def steps_per_round(num_samples: int, train: TrainConfig) -> int:
    """The DP-SGD steps of one round's local training: `train.steps`, else epochs · ⌈n / B⌉ (an epoch of steps)."""
    if train.steps is not None:
        return int(train.steps)
    return int(train.epochs) * math.ceil(num_samples / train.batch_size) if num_samples else 0


def weighted_sum(weights: torch.Tensor, stacked: torch.Tensor) -> torch.Tensor:
    """Σ_j weights[j]·stacked[j] as one matrix-vector product over `stacked` in its own memory order (a per-sample
    gradient is often laid out transposed: tensordot's copy into row order took 10x the product, 180 ms a step of
    the CIFAR CNN's linear layer); the same bits as tensordot."""
    strides = stacked.stride()
    order = sorted(range(1, stacked.dim()), key=lambda d: -strides[d])
    laid = stacked.permute(0, *order)
    out = (weights @ laid.reshape(stacked.shape[0], -1)).view(laid.shape[1:])
    back = [0] * len(order)
    for i, d in enumerate(order):
        back[d - 1] = i
    return out.permute(*back)


def train_dp_sgd(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainConfig, generator: torch.Generator,
                 dp: DPSGD, optimizer: SGD | Adam,
                 extra_loss: Callable[[nn.Module], torch.Tensor | float] | None = None) -> dict[str, float]:
    """Run `steps_per_round` DP-SGD steps of `optimizer` on (x, y); the batches are drawn from `generator`, the
    noise from `dp.noise`. Returns train_classifier's metrics and the steps taken and samples clipped."""
    model.train()
    n = len(y)
    q = sample_rate(n, train.batch_size)
    expected = q * n
    steps = steps_per_round(n, train)
    trainable = {k: p for k, p in model.named_parameters() if p.requires_grad}
    fixed = {**{k: p.detach() for k, p in model.named_parameters() if not p.requires_grad},
             **dict(model.named_buffers())}

    def sample_loss(weights: dict[str, torch.Tensor], xi: torch.Tensor, yi: torch.Tensor) -> torch.Tensor:
        logits = torch.func.functional_call(model, {**weights, **fixed}, (xi.unsqueeze(0),))
        # log-softmax and a gather (F.cross_entropy's bits): vmapped, F.cross_entropy's decomposition imports sympy
        return -torch.log_softmax(logits, dim=-1)[0].gather(0, yi.reshape(1)).squeeze(0)

    per_sample = torch.func.vmap(sample_loss, randomness="different")
    std = dp.noise_multiplier * dp.clip
    loss_total, seen, clipped = 0.0, 0, 0
    for _ in range(steps):
        idx = (torch.rand(n, generator=generator) < q).nonzero().squeeze(1).to(x.device)
        b = len(idx)
        summed = {k: torch.zeros_like(p) for k, p in trainable.items()}
        if b:
            xb, yb = x.index_select(0, idx), y.index_select(0, idx)
            copies = {k: p.detach().unsqueeze(0).expand(b, *p.shape).requires_grad_() for k, p in trainable.items()}
            with torch.enable_grad():
                losses = per_sample(copies, xb, yb)
                grads = torch.autograd.grad(losses.sum(), list(copies.values()))
            norms = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g, dim=tuple(range(1, g.dim())))
                                                          for g in grads]), dim=0)
            factor = (dp.clip / (norms + 1e-6)).clamp(max=1.0)
            summed = {k: weighted_sum(factor, g) for k, g in zip(trainable, grads)}
            loss_total += float(losses.detach().double().sum())
            seen += b
            clipped += int((norms > dp.clip).sum())
        if std > 0:
            for s in summed.values():
                s.add_(torch.randn(s.shape, generator=dp.noise, dtype=s.dtype).to(s.device), alpha=std)
        extra = None
        if extra_loss is not None:
            term = extra_loss(model)
            if isinstance(term, torch.Tensor) and term.requires_grad:
                extra = dict(zip(trainable, torch.autograd.grad(term, list(trainable.values()), allow_unused=True)))
        for k, p in trainable.items():
            g = summed[k] / expected if expected else summed[k]
            if extra is not None and extra[k] is not None:
                g = g + extra[k]
            p.grad = g
        optimizer.step()
    return {"train_loss": loss_total / max(seen, 1), "steps": float(steps), "privacy/dp_steps": float(steps),
            "privacy/sample_rate": q, "privacy/samples_clipped": clipped / max(seen, 1)}
