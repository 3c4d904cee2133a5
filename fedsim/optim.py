"""Plain SGD with torch.optim.SGD's exact update, for the clients' local training.

torch.optim wraps its methods to keep the compiler out, and the first call in a process imports
torch._dynamo and torch._inductor (and Triton where it is installed): 0.7 to 2.8 s and 160 MB of RSS in every
worker, paid in round 0. `make_optimizer` gives every SGD client this one instead. On a GPU it steps all
parameters with the multi-tensor (`torch._foreach_*`) operations that torch.optim.SGD uses there by default,
so a step launches a few kernels rather than a few per parameter. Adam stays torch.optim's.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch


class SGD:
    """SGD with momentum, dampening, Nesterov and L2 weight decay, step for step equal to torch.optim.SGD."""

    def __init__(self, params: Iterable[torch.Tensor], lr: float, momentum: float = 0.0, dampening: float = 0.0,
                 weight_decay: float = 0.0, nesterov: bool = False, foreach: bool | None = None) -> None:
        """`foreach`: step with multi-tensor operations (None: when every parameter is on a GPU, as torch.optim)."""
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
        self.foreach = all(p.device.type == "cuda" for p in self.params) and bool(self.params) \
            if foreach is None else foreach

    @torch.no_grad()
    def step(self) -> None:
        if self.foreach:
            self._step_foreach()
            return
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

    def _step_foreach(self) -> None:
        """The same update with one multi-tensor operation per stage (the parameters that have a gradient, grouped
        by device and dtype as multi-tensor operations need); the gradients are left as they are."""
        g = self.param_groups[0]
        lr, momentum, dampening, decay = g["lr"], g["momentum"], g["dampening"], g["weight_decay"]
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, p in enumerate(self.params):
            if p.grad is not None:
                groups.setdefault((p.device, p.dtype), []).append(i)
        for ids in groups.values():
            params = [self.params[i] for i in ids]
            grads = [p.grad for p in params if p.grad is not None]  # all of them: grouped by having one
            d = list(torch._foreach_add(grads, params, alpha=decay)) if decay != 0 else grads
            if momentum != 0:
                bufs = [b for b in (self._buffers[i] for i in ids) if b is not None]
                if len(bufs) == len(ids):
                    torch._foreach_mul_(bufs, momentum)
                    torch._foreach_add_(bufs, d, alpha=1 - dampening)
                else:  # a buffer starts as a copy of its first step's direction
                    bufs = []
                    for i, di in zip(ids, d, strict=True):
                        buf = self._buffers[i]
                        if buf is None:
                            buf = self._buffers[i] = torch.clone(di).detach()
                        else:
                            buf.mul_(momentum).add_(di, alpha=1 - dampening)
                        bufs.append(buf)
                d = list(torch._foreach_add(d, bufs, alpha=momentum)) if g["nesterov"] else bufs
            torch._foreach_add_(params, d, alpha=-lr)

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

    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if p.grad is None:
                continue
            if set_to_none:
                p.grad = None
            else:
                p.grad.detach_()
                p.grad.zero_()
