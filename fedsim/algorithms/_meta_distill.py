"""Dataset distillation by differentiable unrolling (Wang et al. 2018, https://arxiv.org/abs/1811.10959),
with learnable soft labels (Sucholutsky & Schonlau 2019, https://arxiv.org/abs/1910.02551).

A synthetic sequence of S steps holds, per step j, a batch x̃_j of B inputs, its labels ỹ_j (fixed classes
or learnable label logits) and a learned learning rate. Training θ0 on it means T = S·E plain SGD steps
θ_{t+1} = θ_t − η̃_t ∇θ ℓ(x̃_{t mod S}, ỹ_{t mod S}; θ_t). `Distiller` learns (x̃, ỹ, η̃) by unrolling those
T steps with `create_graph=True` through `torch.func.functional_call` (parameters are plain tensors in
the graph), evaluating the result on a real batch and back-propagating through the whole chain: true
second-order meta-gradients, not a first-order shortcut. The meta-optimiser is Adam whose lr is
multiplied by `decay_factor` every `decay_every` epochs. `sgd_replay` is the graph-free counterpart the
server uses to train a model on uploaded sequences.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.func import functional_call

from fedsim.method import Adam

Params = dict[str, torch.Tensor]


def xavier_init_(model: nn.Module, seed: int, gain: float = 1.0) -> nn.Module:
    """Deterministic Xavier-normal weights, zero biases (the DOSFL/Wang et al. init), from one CPU generator.

    Drawn on the CPU in parameter order and copied in, so every process and device gets bitwise the same θ0.
    Frozen parameters (e.g. a pre-trained embedding) are left alone.
    """
    g = torch.Generator().manual_seed(int(seed))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if not p.requires_grad:
                continue
            if p.dim() >= 2:
                w = torch.empty(p.shape, dtype=torch.float32)
                nn.init.xavier_normal_(w, gain=gain, generator=g)
            elif name.endswith("weight"):  # norm-layer scales
                w = torch.ones(p.shape)
            else:
                w = torch.zeros(p.shape)
            p.copy_(w.to(p.dtype))
    return model


def trainable(model: nn.Module) -> tuple[Params, Params]:
    """(trainable parameters, everything else: frozen parameters and buffers) as detached tensors."""
    params = {n: p.detach() for n, p in model.named_parameters() if p.requires_grad}
    rest = {n: p.detach() for n, p in model.named_parameters() if not p.requires_grad}
    rest.update({n: b for n, b in model.named_buffers()})
    return params, rest


def label_loss(logits: torch.Tensor, y: torch.Tensor, form: str = "logits") -> torch.Tensor:
    """CE against hard classes (integer y), or against soft labels: softmax(ỹ) ("logits") or ỹ itself ("probs")."""
    if not y.is_floating_point():
        return F.cross_entropy(logits, y)
    target = torch.softmax(y, dim=-1) if form == "logits" else y
    return -(target * F.log_softmax(logits, dim=-1)).sum(-1).mean()


def sgd_unroll(model: nn.Module, params: Params, rest: Params, x: torch.Tensor, y: torch.Tensor,
               lrs: torch.Tensor, epochs: int, form: str = "logits", create_graph: bool = True) -> Params:
    """θ_T after `epochs` passes of plain SGD over the S steps (x[j], y[j]); step t uses lrs[t mod len(lrs)].

    With create_graph the result stays differentiable in x, y, lrs (and the starting params).
    """
    steps = x.shape[0]
    t = 0
    for _ in range(epochs):
        for j in range(steps):
            out = functional_call(model, (params, rest), (x[j],))
            loss = label_loss(out, y[j], form)
            names = list(params)
            grads = torch.autograd.grad(loss, [params[n] for n in names], create_graph=create_graph)
            lr = lrs[t % lrs.shape[0]]
            params = {n: params[n] - lr * g for n, g in zip(names, grads)}
            t += 1
    return params


def sgd_replay(model: nn.Module, params: Params, rest: Params,
               sequence: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], form: str = "logits") -> Params:
    """Plain SGD (no momentum, no graph) over a list of (x, y, lr) steps: the server's training pass."""
    params = {n: p.detach() for n, p in params.items()}
    for x, y, lr in sequence:
        leaf = {n: p.requires_grad_(True) for n, p in params.items()}
        loss = label_loss(functional_call(model, (leaf, rest), (x,)), y, form)
        grads = torch.autograd.grad(loss, list(leaf.values()))
        params = {n: (p - lr * g).detach() for (n, p), g in zip(leaf.items(), grads)}
    return params


def _inv_softplus(v: float) -> float:
    return v + math.log(-math.expm1(-v))


def class_balanced_labels(steps: int, batch: int, num_classes: int) -> torch.Tensor:
    """Fixed labels (S, B): example b of step j gets class (j·B + b) mod C, so every class appears in turn."""
    return (torch.arange(steps * batch) % num_classes).reshape(steps, batch)


@dataclass
class DistillSettings:
    """How one synthetic sequence is learned (see fedsim.algorithms.dosfl.DOSFLParams for the documentation)."""

    steps: int = 10
    batch: int = 10
    epochs: int = 3
    lr0: float = 0.02
    lr_per: str = "step"  # "step": S lrs, "unrolled": S·E lrs
    lr_param: str = "softplus"  # "softplus" or "raw"
    soft_labels: bool = False
    label_form: str = "logits"
    meta_lr: float = 0.01
    meta_beta1: float = 0.5
    decay_every: int = 40
    decay_factor: float = 0.5
    outer_epochs: int = 30
    real_batch: int = 512
    epoch_unit: str = "passes"  # "passes" over the data, or "iterations" with one random minibatch each
    mask_p: float = 0.0
    mask_unit: str = "example"  # "example" or "step"


class Distiller:
    """The learnable tuples (x̃, ỹ, η̃) of one client and the meta-optimisation that fits them."""

    def __init__(self, s: DistillSettings, input_shape: tuple[int, ...], num_classes: int,
                 generator: torch.Generator, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32) -> None:
        self.s, self.num_classes, self.device = s, num_classes, torch.device(device)
        noise = torch.randn((s.steps, s.batch, *input_shape), generator=generator, dtype=dtype)
        self.x = noise.to(self.device).requires_grad_(True)
        hard = class_balanced_labels(s.steps, s.batch, num_classes).to(self.device)
        self.y = F.one_hot(hard, num_classes).to(dtype).requires_grad_(True) if s.soft_labels else hard
        n_lr = s.steps * (s.epochs if s.lr_per == "unrolled" else 1)
        raw0 = _inv_softplus(s.lr0) if s.lr_param == "softplus" else s.lr0
        self.raw_lr = torch.full((n_lr,), raw0, dtype=dtype, device=self.device, requires_grad=True)
        leaves = [self.x, self.raw_lr] + ([self.y] if s.soft_labels else [])
        self.opt = Adam(leaves, lr=s.meta_lr, betas=(s.meta_beta1, 0.999))

    def lrs(self) -> torch.Tensor:
        """The effective (positive for softplus) learning rates, differentiable in the raw ones."""
        return F.softplus(self.raw_lr) if self.s.lr_param == "softplus" else self.raw_lr

    def meta_loss(self, model: nn.Module, theta0: Params, rest: Params, x_real: torch.Tensor,
                  y_real: torch.Tensor, mask: torch.Tensor | None = None,
                  noise: torch.Tensor | None = None) -> torch.Tensor:
        """ℓ(real batch; θ_T), θ_T unrolled from θ0; masked examples are replaced by `noise` (no gradient)."""
        x, y = self.x, self.y
        if mask is not None:
            assert noise is not None, "a mask comes with its noise (sample_mask)"
            m = mask.reshape(*mask.shape, *([1] * (x.dim() - 2)))
            x = torch.where(m, noise, x)
            if self.s.soft_labels:
                y = torch.where(mask[..., None], y.detach(), y)
        start = {n: p.detach().requires_grad_(True) for n, p in theta0.items()}
        theta = sgd_unroll(model, start, rest, x, y, self.lrs(), self.s.epochs, self.s.label_form)
        return label_loss(functional_call(model, (theta, rest), (x_real,)), y_real)

    def sample_mask(self, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor] | tuple[None, None]:
        """Random masking: exactly round(p·units) examples (or steps) replaced by N(0, 1) noise this iteration."""
        s = self.s
        if s.mask_p <= 0:
            return None, None
        units = s.steps * s.batch if s.mask_unit == "example" else s.steps
        k = int(round(s.mask_p * units))
        flat = torch.zeros(units, dtype=torch.bool)
        flat[torch.randperm(units, generator=generator)[:k]] = True
        mask = flat.reshape(s.steps, s.batch) if s.mask_unit == "example" else flat[:, None].expand(s.steps, s.batch)
        noise = torch.randn(self.x.shape, generator=generator, dtype=self.x.dtype)
        return mask.to(self.device), noise.to(self.device)

    def batches(self, n: int, generator: torch.Generator) -> Iterator[tuple[int, torch.Tensor]]:
        """(epoch, real-batch indices): full shuffled passes, or one random minibatch per epoch."""
        for epoch in range(self.s.outer_epochs):
            perm = torch.randperm(n, generator=generator)
            if self.s.epoch_unit == "iterations":
                yield epoch, perm[:self.s.real_batch]
                continue
            for start in range(0, n, self.s.real_batch):
                yield epoch, perm[start:start + self.s.real_batch]

    def fit(self, model: nn.Module, start: Callable[[int], Params], rest: Params, x_real: torch.Tensor,
            y_real: torch.Tensor, generator: torch.Generator) -> dict[str, float]:
        """Learn the tuples on (x_real, y_real); `start(iteration)` gives θ0 of each iteration (resets)."""
        model.train()
        losses, it, bad = [], 0, 0
        for epoch, idx in self.batches(len(y_real), generator):
            for group in self.opt.param_groups:
                group["lr"] = self.s.meta_lr * self.s.decay_factor ** (epoch // self.s.decay_every)
            mask, noise = self.sample_mask(generator)
            idx = idx.to(x_real.device)
            loss = self.meta_loss(model, start(it), rest, x_real[idx], y_real[idx], mask, noise)
            self.opt.zero_grad(set_to_none=True)
            it += 1
            if not torch.isfinite(loss):  # the unrolled training diverged: keep the last finite tuples
                bad += 1
                continue
            loss.backward()
            self.opt.step()
            losses.append(float(loss.detach()))
        tail = losses[-max(1, len(losses) // 10):] if losses else [float("nan")]
        return {"meta_loss_first": losses[0] if losses else float("nan"),
                "meta_loss_last": sum(tail) / len(tail), "meta_iterations": float(it),
                "nonfinite_iterations": float(bad)}

    def export(self) -> dict[str, torch.Tensor]:
        """The uploaded tuples: inputs, labels (classes or label logits) and effective lrs, detached on the CPU."""
        y = self.y.detach().cpu()
        return {"x": self.x.detach().cpu().clone(), "y": y.clone(), "lr": self.lrs().detach().cpu().clone()}
