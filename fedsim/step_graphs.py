"""One client's plain SGD steps replayed from a captured CUDA graph (`runtime.cuda_graphs`).

A small client's step on a GPU is a few dozen tiny kernels, and the host takes longer to launch them than the GPU
takes to run them, so the GPU waits. A worker captures its model's step (forward, cross-entropy, backward, the
SGD update and the loss total) once per batch shape and SGD setting, then replays it for every full batch of
every client it trains one after another: one launch a step. The captured kernels are those the step launches
when run directly, so the numbers are the same. A step that cannot be replayed (a short last batch, a fresh
momentum buffer, a setting not captured) runs directly, into the same tensors.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from fedsim.config import TrainConfig
from fedsim.optim import SGD
from fedsim.train import batch_indices

log = logging.getLogger("fedsim.step_graphs")

_RANDOM = (nn.Dropout, nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout, nn.RReLU)
MAX_SHAPES = 4  # graphs kept per model (batch shapes × SGD settings); each holds its step's activations
_said: set[str] = set()


def graphs_on(mode: Any, device: torch.device) -> bool:
    """Whether `runtime.cuda_graphs` (true/"on", false/"off" or "auto") replays captured steps on `device`: only
    CUDA has graphs, and auto means on there."""
    if device.type != "cuda":
        return False
    return mode == "auto" or mode is True or mode == "on"


def note(reason: str) -> None:
    """Log once per process and reason that some clients' steps run directly."""
    if reason not in _said:
        _said.add(reason)
        log.info("training steps run directly, not replayed from CUDA graphs: %s", reason)


def graph_reason(model: nn.Module) -> str | None:
    """Why `model`'s training step cannot be captured once and replayed, or None."""
    for name, m in model.named_modules():
        if isinstance(m, _RANDOM) and (not isinstance(m, nn.modules.dropout._DropoutNd) or m.p > 0):
            return f"model layer {name!r} ({type(m).__name__}) draws random numbers"
        if isinstance(m, nn.modules.batchnorm._BatchNorm) and m.momentum is None and m.track_running_stats:
            return f"model layer {name!r} ({type(m).__name__}) reads its batch count on the host at every step"
    return None


class Graph(Protocol):
    """What a captured step offers: run a step directly where captures run, record `body` once (without running
    it), and run what was recorded."""

    def warm_up(self, step: Callable[[], None]) -> None: ...

    def capture(self, body: Callable[[], None]) -> None: ...

    def replay(self) -> None: ...


_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


class CudaGraph:
    """A CUDA graph captured on a side stream of the device (one per process and device), after the work queued
    so far: PyTorch asks for the step to have run once on that stream before it is captured there."""

    def __init__(self, device: torch.device) -> None:
        self.graph = torch.cuda.CUDAGraph()
        stream = _STREAMS.get(device)
        if stream is None:
            stream = _STREAMS[device] = torch.cuda.Stream(device=device)
        self.stream = stream

    def warm_up(self, step: Callable[[], None]) -> None:
        queue = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(queue)
        with torch.cuda.stream(self.stream):
            step()
        queue.wait_stream(self.stream)

    def capture(self, body: Callable[[], None]) -> None:
        queue = torch.cuda.current_stream(self.stream.device)
        self.stream.wait_stream(queue)
        with torch.cuda.graph(self.graph, stream=self.stream, capture_error_mode="thread_local"):
            body()
        queue.wait_stream(self.stream)

    def replay(self) -> None:
        self.graph.replay()


def copies(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Copies of `tensors` made with one multi-tensor copy (a clone each would be a launch each)."""
    out = [torch.empty_like(t) for t in tensors]
    if out:
        torch._foreach_copy_(out, tensors)
    return out


class _Step:
    """One captured step: its static batch and the graph that trains on it."""

    def __init__(self, graph: Graph, x: torch.Tensor, y: torch.Tensor) -> None:
        self.graph, self.x, self.y = graph, x, y

    def run(self, x: torch.Tensor, y: torch.Tensor, idx: torch.Tensor) -> None:
        torch.index_select(x, 0, idx, out=self.x)
        torch.index_select(y, 0, idx, out=self.y)
        self.graph.replay()


class StepGraphs:
    """A worker's captured steps for one model instance: its parameters, the momentum buffers and loss total every
    graph steps in place, and one graph per batch shape and SGD setting (None: capturing it failed). A graph reads
    the model's tensors where they were at capture, and its modules' settings (BatchNorm's momentum) as they were."""

    def __init__(self, model: nn.Module, make_graph: Callable[[], Graph]) -> None:
        self.name = type(model).__name__
        self.params = [p for p in model.parameters() if p.requires_grad]
        self.pointers = _pointers(model)
        self.make_graph = make_graph
        self.total = torch.zeros((), dtype=torch.float64, device=self.params[0].device if self.params else "cpu")
        self.buffers: list[torch.Tensor] = []  # made at the first capture with momentum
        self.steps: dict[tuple, _Step | None] = {}
        self.failed: str | None = None  # the first capture failed: no other is tried

    def holds(self, model: nn.Module, opt: SGD) -> bool:
        """Whether the graphs step `model`'s parameters and buffers where they are now, and `opt` steps the same
        parameters."""
        params = [p for p in model.parameters() if p.requires_grad]
        return len(params) == len(self.params) == len(opt.params) and all(
            p is q is o for p, q, o in zip(params, self.params, opt.params)) and _pointers(model) == self.pointers

    @staticmethod
    def _key(opt: SGD, x: torch.Tensor, y: torch.Tensor, rows: int) -> tuple:
        g = opt.param_groups[0]
        return (rows, tuple(x.shape[1:]), x.dtype, tuple(y.shape[1:]), y.dtype,
                (g["lr"], g["momentum"], g["dampening"], g["weight_decay"], g["nesterov"], opt.foreach))

    def ready(self, opt: SGD, x: torch.Tensor, y: torch.Tensor, rows: int) -> _Step | None:
        """The captured step for this batch shape and setting, when there is one and it can step `opt` now (its
        momentum buffers exist, or it keeps none)."""
        step = self.steps.get(self._key(opt, x, y, rows))
        if step is None or opt.param_groups[0]["momentum"] == 0:
            return step
        return step if all(b is not None for b in opt.momentum_buffers) else None

    def wanted(self, opt: SGD, x: torch.Tensor, y: torch.Tensor, rows: int) -> bool:
        """Whether to capture this shape and setting now (not tried yet, and room left)."""
        return self.failed is None and self._key(opt, x, y, rows) not in self.steps and len(self.steps) < MAX_SHAPES

    def capture(self, net: nn.Module, opt: SGD, x: torch.Tensor, y: torch.Tensor, rows: int,
                step: Callable[[], None]) -> None:
        """Run `step` (the direct step this batch takes) where captures run, then capture the step of this shape and
        setting without running it. A capture that fails leaves direct steps in use, with one log line."""
        key = self._key(opt, x, y, rows)
        lr, momentum, dampening, decay, nesterov, foreach = key[-1]
        try:
            graph = self.make_graph()
        except Exception as exc:  # no graph to be had here (say, no CUDA stream): the step runs directly
            self._failed(key, exc)
            step()
            return
        graph.warm_up(step)
        if momentum != 0 and not self.buffers:
            self.buffers = [torch.zeros_like(p) for p in self.params]
        inner = SGD(self.params, lr=lr, momentum=momentum, dampening=dampening, weight_decay=decay,
                    nesterov=nesterov, foreach=foreach)
        if momentum != 0:
            inner.momentum_buffers = list(self.buffers)  # present, so the update is the one a stepped buffer gets
        xs = torch.empty((rows, *x.shape[1:]), dtype=x.dtype, device=x.device)
        ys = torch.empty((rows, *y.shape[1:]), dtype=y.dtype, device=y.device)

        def body() -> None:
            inner.zero_grad(set_to_none=True)  # the backward writes gradients the graph owns
            loss = F.cross_entropy(net(xs), ys)
            loss.backward()
            inner.step()
            self.total.add_(loss.detach().double() * rows)

        for p in self.params:
            p.grad = None
        try:
            graph.capture(body)
        except Exception as exc:
            self._failed(key, exc)
        else:
            self.steps[key] = _Step(graph, xs, ys)
        finally:
            for p in self.params:
                p.grad = None  # the graph's gradients are its own; a direct step starts without any

    def _failed(self, key: tuple, exc: Exception) -> None:
        """Remember that this step cannot be captured (after the model's first such failure, none is tried)."""
        self.steps[key] = None
        reason = f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}"
        note(f"capturing a step of {self.name} failed ({reason})")
        if len(self.steps) == 1:
            self.failed = reason

    def adopt(self, opt: SGD) -> None:
        """Let the graphs step `opt`'s momentum buffers: their values move into the shared buffers, which `opt`
        then holds (so a direct step updates them in place too). Once held, nothing is done (a step each)."""
        theirs = opt.momentum_buffers
        if theirs and theirs[0] is self.buffers[0] and theirs[-1] is self.buffers[-1]:
            return  # held since an earlier step: adopt and release swap the whole list
        torch._foreach_copy_(self.buffers, [b for b in theirs if b is not None])  # one copy, not one per buffer
        opt.momentum_buffers = list(self.buffers)

    def release(self, opt: SGD) -> None:
        """Give `opt` its own copies of the shared momentum buffers (the next client's steps overwrite them)."""
        held = opt.momentum_buffers
        if any(b is s for b, s in zip(held, self.buffers)):
            made = iter(copies([b for b in held if b is not None]))
            opt.momentum_buffers = [None if b is None else next(made) for b in held]


def _pointers(model: nn.Module) -> list[int]:
    """Where the model's parameters and buffers are (a captured graph reads and writes them there)."""
    return [t.data_ptr() for t in (*model.parameters(), *model.buffers())]


_GRAPHS: weakref.WeakKeyDictionary[nn.Module, StepGraphs] = weakref.WeakKeyDictionary()


def cuda_graphs_of(model: nn.Module, opt: SGD) -> StepGraphs:
    """This process's captured steps of `model` (one set per model instance, dropped with it; made anew when its
    parameters or buffers are no longer where they were captured)."""
    graphs = _GRAPHS.get(model)
    if graphs is None or not graphs.holds(model, opt):
        device = opt.params[0].device
        graphs = _GRAPHS[model] = StepGraphs(model, lambda: CudaGraph(device))
    return graphs


def train_replayed(net: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainConfig, generator: torch.Generator,
                   optimizer: SGD, graphs: StepGraphs) -> dict[str, float]:
    """fedsim.train.train_classifier (cross-entropy, no extra loss term) with full batches replayed from `graphs`:
    the same batches, updates and loss total, so the same numbers and metrics."""
    total, count, steps = replay_stage(net, x, y, train, generator, optimizer, graphs)
    return {"train_loss": total.item() / max(count, 1), "steps": float(steps)}


def replay_stage(net: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainConfig, generator: torch.Generator,
                 optimizer: SGD, graphs: StepGraphs) -> tuple[torch.Tensor, int, int]:
    """One stage of train_replayed without waiting for the GPU: the loss total (Σ loss·samples, float64, a tensor on
    the device of its own), the samples and the steps."""
    net.train()
    opt = optimizer
    graphs.total.zero_()
    count = steps = 0
    try:
        for idx in batch_indices(len(y), train.batch_size, generator, train.epochs, train.steps, x.device):
            rows = len(idx)
            full = rows == train.batch_size
            step = graphs.ready(opt, x, y, rows) if full else None
            if step is not None:
                if opt.param_groups[0]["momentum"] != 0:
                    graphs.adopt(opt)
                step.run(x, y, idx)
            else:
                def direct(idx: torch.Tensor = idx, rows: int = rows) -> None:
                    xb, yb = x.index_select(0, idx), y.index_select(0, idx)
                    loss = F.cross_entropy(net(xb), yb)
                    opt.zero_grad(set_to_none=True)
                    loss.backward()
                    opt.step()
                    graphs.total.add_(loss.detach().double() * rows)

                if full and graphs.wanted(opt, x, y, rows):
                    graphs.capture(net, opt, x, y, rows, direct)
                else:
                    direct()
            count += rows
            steps += 1
    finally:
        graphs.release(opt)
    return graphs.total.clone(), count, steps
