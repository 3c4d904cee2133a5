"""Local training and evaluation loops shared by every algorithm: index-batched, seeded, no DataLoader."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from fedsim.config.schema import TrainConfig
from fedsim.training.dpsgd import DPSGD, train_dp_sgd
from fedsim.training.optim import SGD, Adam

LossTerm = Callable[[nn.Module], torch.Tensor | float]
"""A term added to the training loss, given the model (a plain 0 when nothing contributes)."""

BatchLoss = Callable[[nn.Module, torch.Tensor, torch.Tensor], torch.Tensor]
"""A batch's whole loss given (model, inputs, labels), in place of CE on the model's logits: for a loss that needs the
batch itself, such as MOON's contrastive term on the batch's representations."""


def make_optimizer(params, train: TrainConfig, lr: float | None = None) -> SGD | Adam:
    """The optimizer the config names, over `params` (fedsim's equals of torch.optim's: see fedsim.training.optim)."""
    lr = train.lr if lr is None else lr
    params = list(params)
    if train.optimizer == "adam":
        return Adam(params, lr=lr, weight_decay=train.weight_decay)
    return SGD(params, lr=lr, momentum=train.momentum, weight_decay=train.weight_decay)


@contextmanager
def batchnorm_stats_kept(module: nn.Module) -> Iterator[None]:
    """Forward passes inside leave BatchNorm running statistics as they were; train-mode batches still
    normalise by their own statistics. For inputs that are not the client's data (generated samples), whose
    statistics must not leak into the ones used at evaluation."""
    bns = [m for m in module.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.track_running_stats]
    saved = [(m.momentum, None if m.num_batches_tracked is None else m.num_batches_tracked.clone()) for m in bns]
    for m in bns:
        m.momentum = 0.0  # running = (1 - 0)·running + 0·batch
    try:
        yield
    finally:
        for m, (momentum, tracked) in zip(bns, saved):
            m.momentum = momentum
            if tracked is not None and m.num_batches_tracked is not None:
                m.num_batches_tracked.copy_(tracked)


def batch_indices(n: int, batch_size: int, generator: torch.Generator, epochs: int = 1,
                  steps: int | None = None, device: torch.device | str = "cpu") -> Iterator[torch.Tensor]:
    """Shuffled minibatch index tensors: `epochs` passes (none for 0), or exactly `steps` batches when given."""
    if n == 0 or (steps is None and epochs <= 0):
        return
    done = 0
    while True:
        # non_blocking: a blocking copy to a GPU waits for the GPU's queue; this one waits only for the staging
        perm = torch.randperm(n, generator=generator).to(device, non_blocking=True)
        for start in range(0, n, batch_size):
            yield perm[start:start + batch_size]
            done += 1
            if steps is not None and done >= steps:
                return
        if steps is None:
            epochs -= 1
            if epochs <= 0:
                return


def train_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainConfig,
                     generator: torch.Generator,
                     extra_loss: LossTerm | None = None,
                     optimizer: SGD | Adam | None = None, dp: DPSGD | None = None,
                     batch_loss: BatchLoss | None = None) -> dict[str, float]:
    """Minimise CE (or `batch_loss(model, xb, yb)`) + `extra_loss(model)` (e.g. a proximal term) over the client's
    data; returns loss/steps. `dp`: with sample-level DP-SGD instead (ClientContext.dp_sgd; fedsim.training.dpsgd),
    which clips each sample's CE gradient and so takes no `batch_loss`."""
    model.train()
    opt = optimizer or make_optimizer(model.parameters(), train)
    if dp is not None:
        if batch_loss is not None:
            raise ValueError("sample-level DP-SGD clips each sample's CE gradient; it cannot train a batch_loss")
        return train_dp_sgd(model, x, y, train, generator, dp, opt, extra_loss)
    total, count, steps = LossTotal(x.device), 0, 0
    for idx in batch_indices(len(y), train.batch_size, generator, train.epochs, train.steps, x.device):
        xb, yb = x.index_select(0, idx), y.index_select(0, idx)  # x[idx]'s rows at a third of its overhead
        loss = F.cross_entropy(model(xb), yb) if batch_loss is None else batch_loss(model, xb, yb)
        if extra_loss is not None:
            loss = loss + extra_loss(model)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        total.add(loss, len(idx))
        count += len(idx)
        steps += 1
    return {"train_loss": total.value() / max(count, 1), "steps": float(steps)}


class LossTotal:
    """Σ loss·samples over a client's steps, in float64. On a GPU it is kept there, so no step waits for the GPU
    to finish the last one before queueing the next (`float(loss)` would); the arithmetic is the same float64
    either way (a float32 loss widens exactly), so the total has the same bits on every device."""

    def __init__(self, device: torch.device, on_device: bool | None = None) -> None:
        self.on_device = device.type != "cpu" if on_device is None else on_device
        self._sum: torch.Tensor | float = torch.zeros((), dtype=torch.float64, device=device) if self.on_device \
            else 0.0

    def add(self, loss: torch.Tensor, samples: int) -> None:
        if isinstance(self._sum, torch.Tensor):
            self._sum = self._sum + loss.detach().double() * samples
        else:
            self._sum += float(loss.detach()) * samples

    def value(self) -> float:
        return float(self._sum)


@torch.no_grad()
def predict_logits(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Logits of `model` on `x`, in eval mode, batched."""
    model.eval()
    return torch.cat([model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)]) if len(x) else \
        torch.empty(0)


@torch.no_grad()
def evaluate_classifier(model: nn.Module, x: torch.Tensor, y: torch.Tensor,
                        batch_size: int = 512) -> dict[str, float]:
    """Accuracy and mean CE loss of `model` on (x, y)."""
    if len(y) == 0:
        return {"accuracy": float("nan"), "loss": float("nan")}
    logits = predict_logits(model, x, batch_size)
    loss = F.cross_entropy(logits, y).item()
    acc = (logits.argmax(1) == y).float().mean().item()
    return {"accuracy": acc, "loss": loss}


def clip_logits(logits: torch.Tensor, c: float) -> torch.Tensor:
    """Single-image FL's logit clipping: rows with L2 norm >= 1/c are rescaled to norm c (reference code)."""
    norms = logits.norm(p=2, dim=-1, keepdim=True)
    return torch.where(norms >= 1.0 / c, logits / norms.clamp_min(1e-12) * c, logits)
