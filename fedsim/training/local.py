"""Plain local training of a classifier, described as data so that a worker may train one client or many at once.

A method whose client step is "train the classifier from given weights on the client's data, then report"
returns a LocalTraining from `Algorithm.local_training`. `run()` is that client step for one client
(train_classifier, stage by stage); fedsim.training.batched trains many clients of one architecture together
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
from fedsim.config.schema import TrainConfig
from fedsim.training.dpsgd import DPSGD
from fedsim.training.train import BatchLoss, LossTerm, clip_logits, make_optimizer, train_classifier

if TYPE_CHECKING:
    from fedsim.method.contract import ClientContext, ClientResult

Finish = Callable[[nn.Module, "dict[str, float]", "dict[str, Any] | None"], "ClientResult"]
"""(model holding the trained weights, training metrics, optimizer state or None) -> the client's result."""

DROPOUT_STREAM = "local/dropout"  # each client's dropout masks when trained together (fedsim.training.batched)


def load_weights(model: nn.Module, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`model.load_state_dict(state)`, and the model's state dict (views of its tensors) after it."""
    model.load_state_dict(state)
    return model.state_dict()


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


def sum_of(terms: list[LossTerm]) -> LossTerm | None:
    """One loss term adding `terms` in order (None for none)."""
    if len(terms) <= 1:
        return terms[0] if terms else None
    return lambda model: sum((t(model) for t in terms[1:]), terms[0](model))


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
    trained model into the ClientResult. A method's own loss, `extra_loss(model)` added to it (FedDyn's linear term)
    or `batch_loss(model, xb, yb)` in place of CE (MOON's contrastive term), trains one client at a time."""

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
    dropout_seed: int = 0  # per-client dropout masks when trained together (fedsim.training.batched)
    dp: DPSGD | None = None  # sample-level DP-SGD (ClientContext.dp_sgd): trained one client at a time
    extra_loss: LossTerm | None = None  # added to the loss after the proximal term: trained one client at a time
    batch_loss: BatchLoss | None = None  # the batch's loss in place of CE: trained one client at a time

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
                                         ctx.phase_index), dp=ctx.dp_sgd, **options)

    def stage_config(self, stage: Stage) -> TrainConfig:
        return dataclasses.replace(self.train, epochs=stage.epochs, steps=stage.steps)

    def run(self) -> ClientResult:
        """The client step for this one client: load `start`, train stage by stage, check, finish."""
        weights = load_weights(self.model, self.start)
        net = self.model if self.clip is None else ClippedLogits(self.model, self.clip)
        prox = proximal_term(self.mu, {n: p.detach().clone() for n, p in net.named_parameters()}) if self.mu > 0 \
            else None
        extra = sum_of([t for t in (prox, self.extra_loss) if t is not None])
        metrics: dict[str, float] = {}
        opt = None
        for i, stage in enumerate(self.stages):
            cfg = self.stage_config(stage)
            opt = make_optimizer(self.model.parameters(), cfg)
            if i == 0 and self.optimizer_state is not None:
                opt.load_state_dict(self.optimizer_state)
            done = train_classifier(net, self.x, self.y, cfg, self.generator, extra_loss=extra, optimizer=opt,
                                    dp=self.dp, batch_loss=self.batch_loss)
            metrics.update({stage.prefix + k: v for k, v in done.items()})
        check_finite(metrics, weights)
        return self.finish(self.model, metrics, opt.state_dict() if self.keep_optimizer and opt is not None else None)

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
        """The end of the client step after training elsewhere (fedsim.training.batched): the model takes the trained
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
    and no tensor's sum overflows its dtype (an inf or NaN entry makes its norm inf or NaN)."""
    total = torch.zeros((), dtype=torch.float64, device=device)
    for t in tensors:
        if t.is_floating_point():
            total = total + torch.linalg.vector_norm(t.detach(), 1).double()
    return total
