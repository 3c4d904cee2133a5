"""Plain local training of a classifier, described as data so that a worker may train one client or many at once.

A method whose client step is "train the classifier from given weights on the client's data, then report"
returns a LocalTraining from `Algorithm.local_training`. `run()` is that client step for one client
(train_classifier, stage by stage); fedsim.train_batched trains many clients of one architecture together
(`runtime.batch_clients`). Both end in the same `finish`, so the client's result means the same either way.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from fedsim import rng
from fedsim.config import TrainConfig
from fedsim.distill import clip_logits
from fedsim.optim import SGD
from fedsim.step_graphs import StepGraphs, cuda_graphs_of, graph_reason, graphs_on, note, train_replayed
from fedsim.train import LossTerm, make_optimizer, train_classifier

if TYPE_CHECKING:
    from fedsim.algorithms.base import ClientContext, ClientResult

Finish = Callable[[nn.Module, "dict[str, float]", "dict[str, Any] | None"], "ClientResult"]
"""(model holding the trained weights, training metrics, optimizer state or None) -> the client's result."""

DROPOUT_STREAM = "local/dropout"  # each client's dropout masks when trained together (fedsim.train_batched)
_PLAIN_LOADERS = (nn.Module._load_from_state_dict, nn.modules.batchnorm._NormBase._load_from_state_dict)


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.load_state_dict(state)`, and the model's state dict (views of its tensors) after it. When `state`
    has exactly the model's keys and shapes and no module saves or loads in its own way (hooks, extra state, a
    custom `_load_from_state_dict`), that load is a copy into each tensor, done here without load_state_dict's
    walk (a third of a small client's overhead)."""
    own = model.state_dict()
    plain = own.keys() == state.keys() and all(
        isinstance(v := state[k], torch.Tensor) and v.shape == t.shape for k, t in own.items()) and all(
        type(m)._load_from_state_dict in _PLAIN_LOADERS and type(m).get_extra_state is nn.Module.get_extra_state
        and not (m._load_state_dict_pre_hooks or m._load_state_dict_post_hooks or m._state_dict_hooks
                 or m._state_dict_pre_hooks) for m in model.modules())
    if not plain:
        model.load_state_dict(state)
        return model.state_dict()
    with torch.no_grad():
        dst, src = list(own.values()), [state[k] for k in own]
        if dst and all(v.device == t.device and v.dtype == t.dtype for v, t in zip(src, dst)):
            torch._foreach_copy_(dst, src)  # one multi-tensor copy, not a launch per tensor
            return own
        for t, v in zip(dst, src):  # CPU weights into a GPU model: staged at once, without waiting for the GPU
            t.copy_(v, non_blocking=t.device.type == "cuda" and v.device.type == "cpu")
    return own


class ClippedLogits(nn.Module):
    """Wraps a classifier so local CE sees clipped logits (single-image FL's `use_clipping`)."""

    def __init__(self, model: nn.Module, c: float) -> None:
        super().__init__()
        self.model, self.c = model, c

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return clip_logits(self.model(x), self.c)


def proximal_term(mu: float, anchor: dict[str, torch.Tensor]) -> LossTerm:
    """A loss term mu/2·Σ||w - anchor||² over the model's trainable parameters (FedProx)."""

    def term(model: nn.Module) -> torch.Tensor | float:
        total = sum(((p - anchor[n]) ** 2).sum() for n, p in model.named_parameters())
        return 0.5 * mu * total

    return term


@dataclass(frozen=True)
class Stage:
    """One call of local training with a fresh optimizer: `epochs` passes, or exactly `steps` batches when set.
    Its metrics are reported with `prefix` (the personal baselines' pre-training reports `pretrain_*`)."""

    epochs: int = 1
    steps: int | None = None
    prefix: str = ""


@dataclass
class LocalTraining:
    """One client's plain local training: `model` (the worker's instance of the client's architecture) starts from
    `start`, minimises CE on (x, y) through `stages` with the run's SGD settings, batches drawn from `generator`,
    optionally with a proximal term (`mu`, towards `start`) and clipped logits (`clip`); then `finish` turns the
    trained model into the ClientResult."""

    model: nn.Module
    start: Mapping[str, torch.Tensor]
    x: torch.Tensor
    y: torch.Tensor
    train: TrainConfig
    generator: torch.Generator
    finish: Finish
    stages: tuple[Stage, ...]
    mu: float = 0.0
    clip: float | None = None
    optimizer_state: dict[str, Any] | None = None  # loaded into the first stage's optimizer
    keep_optimizer: bool = False  # hand the last stage's optimizer state to `finish`
    dropout_seed: int = 0  # per-client dropout masks when trained together (fedsim.train_batched)
    cuda_graphs: bool = False  # full batches may be replayed from captured CUDA graphs (fedsim.step_graphs)

    @classmethod
    def of(cls, ctx: ClientContext, start: Mapping[str, torch.Tensor], finish: Finish,
           x: torch.Tensor | None = None, y: torch.Tensor | None = None, stages: tuple[Stage, ...] | None = None,
           **options: Any) -> LocalTraining:
        """The client's training in `ctx` (its model, data, train settings and generator) unless given otherwise."""
        train = ctx.env.config.train
        return cls(model=ctx.models.get(ctx.arch), start=start, x=ctx.data.x if x is None else x,
                   y=ctx.data.y if y is None else y, train=train, generator=ctx.generator(), finish=finish,
                   stages=(Stage(train.epochs, train.steps),) if stages is None else stages,
                   dropout_seed=rng.seed(ctx.env.config.seed, DROPOUT_STREAM, ctx.round, ctx.client_id,
                                         ctx.phase_index),
                   cuda_graphs=graphs_on(ctx.env.config.runtime.cuda_graphs, ctx.device), **options)

    def stage_config(self, stage: Stage) -> TrainConfig:
        return dataclasses.replace(self.train, epochs=stage.epochs, steps=stage.steps)

    def run(self) -> ClientResult:
        """The client step for this one client: load `start`, train stage by stage, check, finish."""
        weights = load_weights(self.model, self.start)
        net = self.model if self.clip is None else ClippedLogits(self.model, self.clip)
        extra = None
        if self.mu > 0:
            extra = proximal_term(self.mu, {n: p.detach().clone() for n, p in net.named_parameters()})
        metrics: dict[str, float] = {}
        opt = None
        for i, stage in enumerate(self.stages):
            cfg = self.stage_config(stage)
            opt = make_optimizer(self.model.parameters(), cfg)
            if i == 0 and self.optimizer_state is not None:
                opt.load_state_dict(self.optimizer_state)
            graphs = self._graphs(opt) if isinstance(opt, SGD) else None
            if graphs is not None and isinstance(opt, SGD):
                done = train_replayed(net, self.x, self.y, cfg, self.generator, opt, graphs)
            else:
                done = train_classifier(net, self.x, self.y, cfg, self.generator, extra_loss=extra, optimizer=opt)
            metrics.update({stage.prefix + k: v for k, v in done.items()})
        check_finite(metrics, weights)
        return self.finish(self.model, metrics, opt.state_dict() if self.keep_optimizer and opt is not None else None)

    def _graphs(self, opt: SGD) -> StepGraphs | None:
        """The captured steps this client's SGD training may replay (`cuda_graphs`, on a GPU), or None."""
        if not self.cuda_graphs or not opt.params:
            return None
        reason = self.replay_reason()
        if reason is not None:
            note(reason)
            return None
        return cuda_graphs_of(self.model, opt)

    def replay_reason(self) -> str | None:
        """Why this client's steps cannot be replayed from CUDA graphs (fedsim.step_graphs: cross-entropy alone,
        SGD, a model without random layers), or None."""
        if self.mu > 0:
            return "a proximal term (FedProx) is not replayed from CUDA graphs"
        if self.clip is not None:
            return "clipped logits are not replayed from CUDA graphs"
        if self.train.optimizer != "sgd":
            return f"optimizer {self.train.optimizer!r} (only SGD steps are replayed from CUDA graphs)"
        return graph_reason(self.model)

    def saved_sgd_matches(self) -> bool:
        """Whether the saved optimizer state is one parameter group with the run's SGD settings (what `complete`
        rebuilds the state with; a state saved with others keeps them only when trained by `run`)."""
        groups = (self.optimizer_state or {}).get("param_groups", [])
        t = self.train
        return len(groups) == 1 and (groups[0].get("lr"), groups[0].get("momentum"), groups[0].get("weight_decay"),
                                     groups[0].get("dampening", 0), groups[0].get("nesterov", False)) == \
            (t.lr, t.momentum, t.weight_decay, 0, False)

    def complete(self, state: Mapping[str, torch.Tensor], metrics: dict[str, float],
                 momentum: Mapping[str, torch.Tensor] | None, finite: bool = False) -> ClientResult:
        """The end of the client step after training elsewhere (fedsim.train_batched): the model takes the trained
        `state`, then it is checked and finished as in `run`; `momentum` holds the last stage's SGD buffers.
        `finite`: the trainer already found every entry of `state` finite, so only the metrics are checked (unless
        loading changed a dtype)."""
        weights = load_weights(self.model, state)
        known = finite and all(k in state and state[k].dtype == t.dtype for k, t in weights.items())
        check_finite(metrics, {} if known else weights)
        keep = self.keep_optimizer and bool(self.stages)
        return self.finish(self.model, metrics, self.optimizer_state_with(momentum) if keep else None)

    def optimizer_state_with(self, momentum: Mapping[str, torch.Tensor] | None) -> dict[str, Any]:
        """The state dict of the optimizer `run` would end with, given its momentum buffers by parameter name
        (in the layout of the optimizer this device gets, so either path resumes from the other's state)."""
        opt = make_optimizer(self.model.parameters(), self.stage_config(self.stages[-1]))
        group = opt.param_groups[0]
        names = {id(p): n for n, p in self.model.named_parameters()}
        held = list(group["params"])
        state = {i: {"momentum_buffer": momentum[names[id(p)]]} for i, p in enumerate(held)
                 if momentum is not None and names[id(p)] in momentum}
        opt.load_state_dict({"state": state, "param_groups": [
            {**{k: v for k, v in group.items() if k != "params"}, "params": list(range(len(held)))}]})
        return opt.state_dict()


def check_finite(metrics: Mapping[str, float], state: Mapping[str, torch.Tensor]) -> None:
    """Raise FloatingPointError when training diverged (a non-finite loss or weight), so the client fails alone
    instead of carrying NaNs into the aggregate."""
    for k, v in metrics.items():
        if k.endswith("train_loss") and not math.isfinite(v):
            raise FloatingPointError(f"diverged: non-finite {k} ({v})")
    floats = [(k, t) for k, t in state.items() if t.is_floating_point()]
    if floats and floats[0][1].device.type != "cpu" and all_finite_at_once([t for _, t in floats]):
        return  # on a GPU one wait for all tensors instead of one per tensor
    for k, t in floats:  # a finite sum means finite entries, and summing is far cheaper than isfinite
        if not math.isfinite(float(t.sum())) and not bool(torch.isfinite(t).all()):
            raise FloatingPointError(f"diverged: non-finite weight {k!r}")


def all_finite_at_once(tensors: list[torch.Tensor]) -> bool:
    """True when weights_sum of the tensors is finite, which means every entry is; False says only that some sum
    overflowed or some entry is not finite."""
    return math.isfinite(float(weights_sum(tensors, tensors[0].device)))


def weights_sum(tensors: list[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ over the floating tensors of Σ|entry| (float64, on `device`, not read): finite exactly when every entry is
    and no tensor's sum overflows its dtype (an inf or NaN entry makes its norm inf or NaN). One multi-tensor norm
    rather than a sum per tensor: on a GPU a launch per tensor costs more than the sums."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        if t.is_floating_point():
            by_dtype.setdefault(t.dtype, []).append(t.detach())
    total = torch.zeros((), dtype=torch.float64, device=device)
    for group in by_dtype.values():
        total = total + torch.stack(torch._foreach_norm(group, 1)).double().sum()
    return total
