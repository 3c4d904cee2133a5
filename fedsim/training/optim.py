"""Plain SGD and Adam with torch.optim's exact updates, for the clients' local training and every method's own.

torch.optim wraps its methods to keep the compiler out, and the first call in a process imports
its compiler stack (dynamo, inductor, and Triton where it is installed): 0.7 to 2.8 s and 160 MB of RSS in every
worker, paid in round 0 (measured: torch.optim.SGD's first three steps 1.50-2.46 s and +165 MB of RSS, these
0.07 s and +18 MB: `python -m bench.first_step`). fedsim's optimizers are these
instead, stepping parameter by parameter with public tensor operations.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch


class _Optimizer:
    """What fedsim's optimizers share with torch.optim's: the parameters they step, and clearing their gradients."""

    params: list[torch.Tensor]

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()


class SGD(_Optimizer):
    """SGD with momentum, dampening, Nesterov and L2 weight decay, step for step equal to torch.optim.SGD."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False) -> None:
        if lr < 0 or momentum < 0 or weight_decay < 0:
            raise ValueError(f"SGD: lr={lr}, momentum={momentum} and weight_decay={weight_decay} must be >= 0")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError("SGD: Nesterov momentum needs momentum > 0 and dampening = 0")
        self.params = [p for p in params if p.requires_grad]
        # one group in torch.optim's shape, so code that reads or sets the lr works unchanged
        self.param_groups: list[dict[str, Any]] = [{"params": self.params, "lr": lr, "momentum": momentum,
                                                   "dampening": dampening, "weight_decay": weight_decay,
                                                   "nesterov": nesterov}]
        self._buffers: list[torch.Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self) -> None:
        g = self.param_groups[0]
        lr, momentum, dampening, decay = g["lr"], g["momentum"], g["dampening"], g["weight_decay"]
        for i, p in enumerate(self.params):
            if p.grad is None:
                continue
            d = p.grad if decay == 0 else p.grad.add(p, alpha=decay)
            if momentum != 0:
                buf = self._buffers[i]
                if buf is None:
                    buf = self._buffers[i] = torch.clone(d).detach()
                else:
                    buf.mul_(momentum).add_(d, alpha=1 - dampening)
                d = d.add(buf, alpha=momentum) if g["nesterov"] else buf
            p.add_(d, alpha=-lr)

    def state_dict(self) -> dict:
        """torch.optim.SGD's layout, so either optimizer can resume from the other's saved state."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        return {"state": {i: {"momentum_buffer": b} for i, b in enumerate(self._buffers) if b is not None},
                "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: dict) -> None:
        """Momentum buffers (copied, so the saved state is never stepped in place) and the saved group's
        hyper-parameters, as torch.optim does."""
        groups = state.get("param_groups", [])
        if len(groups) != 1 or len(groups[0].get("params", [])) != len(self.params):
            raise ValueError("SGD.load_state_dict: the saved state is for a different set of parameters")
        ids = groups[0]["params"]
        for pos, (pid, p) in enumerate(zip(ids, self.params, strict=True)):
            buf = state.get("state", {}).get(pid, {}).get("momentum_buffer")
            self._buffers[pos] = None if buf is None else buf.to(device=p.device, dtype=p.dtype, copy=True)
        mine = self.param_groups[0]
        mine.update({k: v for k, v in groups[0].items() if k in mine and k != "params"})


class Adam(_Optimizer):
    """Adam with L2 weight decay and optional AMSGrad, step for step equal to torch.optim.Adam (its defaults: not
    decoupled, not maximising), and its state_dict in torch's layout."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float = 1e-3, betas: tuple[float, float] = (0.9, 0.999),
                 eps: float = 1e-8, weight_decay: float = 0.0, amsgrad: bool = False) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0 or not all(0 <= b < 1 for b in betas):
            raise ValueError(f"Adam: lr={lr}, eps={eps} and weight_decay={weight_decay} must be >= 0 and betas={betas}"
                             " in [0, 1)")
        self.params = [p for p in params if p.requires_grad]
        self.param_groups: list[dict[str, Any]] = [{"params": self.params, "lr": lr, "betas": tuple(betas),
                                                   "eps": eps, "weight_decay": weight_decay, "amsgrad": amsgrad}]
        n = len(self.params)
        self._steps = [0] * n
        self._moments: list[tuple[torch.Tensor, ...] | None] = [None] * n  # exp_avg, exp_avg_sq[, max_exp_avg_sq]

    def _moments_of(self, i: int) -> tuple[torch.Tensor, ...]:
        m = self._moments[i]
        if m is None:
            p = self.params[i]
            count = 3 if self.param_groups[0]["amsgrad"] else 2
            m = self._moments[i] = tuple(torch.zeros_like(p, memory_format=torch.preserve_format)
                                         for _ in range(count))
        return m

    @torch.no_grad()
    def step(self) -> None:
        g = self.param_groups[0]
        lr, (beta1, beta2), eps, decay, amsgrad = g["lr"], g["betas"], g["eps"], g["weight_decay"], g["amsgrad"]
        ids = [i for i, p in enumerate(self.params) if p.grad is not None]
        for i in ids:
            self._steps[i] += 1
        for i in ids:
            p, grad = self.params[i], self.params[i].grad
            assert grad is not None  # ids holds the parameters that have one
            moments = self._moments_of(i)
            exp_avg, exp_avg_sq = moments[0], moments[1]
            if decay != 0:
                grad = grad.add(p, alpha=decay)
            exp_avg.lerp_(grad, 1 - beta1)
            exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            step = float(self._steps[i])
            step_size = lr / (1 - beta1 ** step)
            bias_correction2_sqrt = (1 - beta2 ** step) ** 0.5
            if amsgrad:
                torch.maximum(moments[2], exp_avg_sq, out=moments[2])
                denom = (moments[2].sqrt() / bias_correction2_sqrt).add_(eps)
            else:
                denom = (exp_avg_sq.sqrt() / bias_correction2_sqrt).add_(eps)
            p.addcdiv_(exp_avg, denom, value=-step_size)

    def state_dict(self) -> dict:
        """torch.optim.Adam's layout, so either optimizer can resume from the other's saved state."""
        group = {k: v for k, v in self.param_groups[0].items() if k != "params"}
        names = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")
        state = {i: {"step": torch.tensor(float(self._steps[i])), **dict(zip(names, m, strict=False))}
                 for i, m in enumerate(self._moments) if m is not None}
        return {"state": state, "param_groups": [{**group, "params": list(range(len(self.params)))}]}

    def load_state_dict(self, state: dict) -> None:
        """Moments and step counts (copied, so the saved state is never stepped in place) and the saved group's
        hyper-parameters, as torch.optim does."""
        groups = state.get("param_groups", [])
        if len(groups) != 1 or len(groups[0].get("params", [])) != len(self.params):
            raise ValueError("Adam.load_state_dict: the saved state is for a different set of parameters")
        mine = self.param_groups[0]
        mine.update({k: (tuple(v) if k == "betas" else v) for k, v in groups[0].items()
                     if k in mine and k != "params"})
        names = ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if mine["amsgrad"] else ())
        for pos, (pid, p) in enumerate(zip(groups[0]["params"], self.params, strict=True)):
            saved = state.get("state", {}).get(pid)
            if not saved:
                self._moments[pos], self._steps[pos] = None, 0
                continue
            self._steps[pos] = int(float(saved["step"]))
            self._moments[pos] = tuple(saved[k].to(device=p.device, dtype=p.dtype, copy=True) for k in names)


class CosineAnnealing:
    """torch.optim.lr_scheduler.CosineAnnealingLR for one of these optimizers (from step 0): the same learning
    rates bit for bit, by torch's recursive form rather than the closed one."""

    def __init__(self, optimizer: SGD | Adam, T_max: int, eta_min: float = 0.0) -> None:
        self.optimizer, self.T_max, self.eta_min = optimizer, T_max, eta_min
        self.base_lr: float = optimizer.param_groups[0]["lr"]
        self.last_epoch = 0

    def step(self) -> None:
        self.last_epoch += 1
        group, e, T, low = self.optimizer.param_groups[0], self.last_epoch, self.T_max, self.eta_min
        if (e - 1 - T) % (2 * T) == 0:  # past the end: the period restarts upwards
            group["lr"] = group["lr"] + (self.base_lr - low) * (1 - math.cos(math.pi / T)) / 2
        else:
            group["lr"] = (1 + math.cos(math.pi * e / T)) / (1 + math.cos(math.pi * (e - 1) / T)) \
                * (group["lr"] - low) + low
