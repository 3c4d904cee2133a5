"""Local training of many same-architecture clients together: one vmapped SGD step for all of them.

On a GPU one small client's step leaves the device mostly idle; stacking the clients' weights, computing their
losses with torch.func.vmap over functional_call and their gradients by one backward pass of the losses' sum
gives it one large step instead.
The update is the sequential one (fedsim.training.local.LocalTraining.run) to float rounding: every client
keeps its own batch order (drawn from its own generator by batch_indices), momentum, weight decay, proximal
term and BatchNorm statistics. Every batch is padded to the batch size (not to the group's longest batch, so a
client's shapes are its own) and the padding masked out of its loss and batch statistics. Clients are sorted by
step count, so those still training at a step are a prefix.
Dropout draws each client's masks from its own seed (`LocalTraining.dropout_seed`), so a client's masks do
not depend on which clients it trains with (they differ from the sequential path's, which draws them from
torch's global stream seeded with the same seed).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.batchnorm import _BatchNorm
from torch.nn.modules.instancenorm import _InstanceNorm

from fedsim.training.local import LocalTraining
from fedsim.training.train import batch_indices, clip_logits

_CHANNEL_DROPOUT = (nn.Dropout1d, nn.Dropout2d, nn.Dropout3d, nn.AlphaDropout, nn.FeatureAlphaDropout)


class Unbatchable(Exception):
    """These clients cannot be trained together; the message says why (the worker trains them one by one)."""


def unbatchable_reason(model: nn.Module) -> str | None:
    """Why `model` cannot be trained batched (a layer this trainer does not vectorise), or None."""
    for name, m in model.named_modules():
        kind = type(m).__name__
        if isinstance(m, nn.RNNBase):
            return f"model layer {name!r} ({kind}) is a recurrent layer"
        if isinstance(m, _CHANNEL_DROPOUT):
            return f"model layer {name!r} ({kind}) is a dropout that is not element-wise"
        if isinstance(m, _InstanceNorm) and m.track_running_stats:
            return f"model layer {name!r} ({kind}) keeps running statistics"
    names = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
    tied = sorted(set(model.state_dict()) - names)
    if tied:
        return f"model entry {tied[0]!r} is shared with another layer"
    return None


@dataclass
class Trained:
    """One client's outcome of training in a group : its weights
    and buffers (views into the stacks, or copies), metrics in train_classifier's form per stage, its SGD momentum
    buffers (None when there are none), and the samples it processed (its share of the group's time). `error` is
    set when the client cannot be trained this way."""

    state: dict[str, torch.Tensor]
    metrics: dict[str, float]
    momentum: dict[str, torch.Tensor] | None
    samples: int
    error: Exception | None = None
    finite: bool = False  # every floating entry of `state` is known to be finite (checked for the group at once)


@dataclass
class _StepInputs:
    """What the patched BatchNorm and dropout layers read during one vmapped forward (one client's slice)."""

    mask: torch.Tensor | None = None
    noise: list[torch.Tensor] = field(default_factory=list)
    new_buffers: dict[str, torch.Tensor] = field(default_factory=dict)
    min_count: torch.Tensor | None = None


class _Patched:
    """Inside: the model's BatchNorm layers use masked batch statistics and return their new running buffers
    through `io`; its dropout layers multiply by masks made from `io.noise`."""

    def __init__(self, model: nn.Module, io: _StepInputs) -> None:
        self.model, self.io = model, io
        self.patched: list[nn.Module] = []

    def __enter__(self) -> _Patched:
        for name, m in self.model.named_modules():
            prefix = f"{name}." if name else ""
            if isinstance(m, _BatchNorm):
                vars(m)["forward"] = _masked_batchnorm(m, prefix, self.io)  # an instance attribute shadows the method
                self.patched.append(m)
            elif isinstance(m, nn.Dropout) and m.p > 0:
                vars(m)["forward"] = _noise_dropout(m.p, self.io)
                self.patched.append(m)
        return self

    def __exit__(self, *exc: object) -> None:
        for m in self.patched:
            del vars(m)["forward"]


def _masked_batchnorm(m: _BatchNorm, prefix: str, io: _StepInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        assert io.mask is not None
        shape = [1, -1] + [1] * (x.dim() - 2)
        dims = [0, *range(2, x.dim())]
        rows = io.mask.to(x.dtype).view(-1, *[1] * (x.dim() - 1))
        count = io.mask.sum() * (x[0, 0].numel())
        mean = (x * rows).sum(dims) / count
        centred = x - mean.view(shape)
        var = (centred * centred * rows).sum(dims) / count
        out = centred * torch.rsqrt(var + m.eps).view(shape)
        if m.weight is not None:
            out = out * m.weight.view(shape) + m.bias.view(shape)
        io.min_count = count if io.min_count is None else torch.minimum(io.min_count, count)
        if m.running_mean is not None and m.running_var is not None and m.num_batches_tracked is not None:
            keys = (prefix + "running_mean", prefix + "running_var", prefix + "num_batches_tracked")
            mean_old = io.new_buffers.get(keys[0], m.running_mean)
            var_old = io.new_buffers.get(keys[1], m.running_var)
            tracked = io.new_buffers.get(keys[2], m.num_batches_tracked) + 1
            factor: Any = m.momentum if m.momentum is not None else 1.0 / tracked
            unbiased = var.detach() * count / (count - 1)
            io.new_buffers[keys[0]] = mean_old * (1 - factor) + mean.detach() * factor
            io.new_buffers[keys[1]] = var_old * (1 - factor) + unbiased * factor
            io.new_buffers[keys[2]] = tracked
        return out

    return forward


def _noise_dropout(p: float, io: _StepInputs) -> Callable[[torch.Tensor], torch.Tensor]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        noise = io.noise.pop(0)
        return x * (noise >= p).to(x.dtype) / (1 - p) if p < 1 else x * 0

    return forward


def _dropout_shapes(model: nn.Module, sample: torch.Tensor) -> list[tuple[int, ...]]:
    """Per-sample input shapes of the model's active dropout layers, in call order (one eval-mode pass)."""
    shapes: list[tuple[int, ...]] = []
    hooks = [m.register_forward_pre_hook(lambda _, args: shapes.append(tuple(args[0].shape[1:])))
             for m in model.modules() if isinstance(m, nn.Dropout) and m.p > 0]
    if not hooks:
        return []
    was_training = model.training
    try:
        model.eval()
        with torch.no_grad():
            model(sample)
    finally:
        model.train(was_training)
        for h in hooks:
            h.remove()
    return shapes


@dataclass
class _Schedule:
    """One client's batches, drawn as the sequential path draws them, and where its stages begin."""

    batches: list[torch.Tensor]
    stage: list[int]
    fresh: list[bool]  # whether the optimizer starts afresh at this step (a stage's first, unless state was loaded)
    last_stage_steps: int
    sizes: list[int]  # each batch's length, read once (len() of a tensor is a Python call per batch)
    widest: int  # the largest batch size its stages ask for


def _schedule(plan: LocalTraining, loaded: bool) -> _Schedule:
    gen = torch.Generator()
    gen.set_state(plan.generator.get_state())  # a copy: a sequential retry must draw the same batches
    batches: list[torch.Tensor] = []
    stage: list[int] = []
    fresh: list[bool] = []
    last = widest = 0
    for s, st in enumerate(plan.stages):
        cfg = plan.stage_config(st)
        widest = max(widest, cfg.batch_size)
        last = 0
        for idx in batch_indices(len(plan.y), cfg.batch_size, gen, cfg.epochs, cfg.steps):
            fresh.append(last == 0 and not (s == 0 and loaded))
            batches.append(idx)
            stage.append(s)
            last += 1
    return _Schedule(batches, stage, fresh, last, [int(b.shape[0]) for b in batches], widest)


def _hyper(plan: LocalTraining) -> tuple:
    t = plan.train
    return (t.optimizer, t.lr, t.momentum, t.weight_decay, plan.mu, plan.clip)


def _loaded_momentum(plan: LocalTraining, trainable: list[str]) -> dict[str, torch.Tensor] | None:
    """The momentum buffers of a saved optimizer state, by parameter name (None when there is none)."""
    state = plan.optimizer_state
    if state is None:
        return None
    groups = state.get("param_groups", [])
    if len(groups) != 1:
        raise Unbatchable("the saved optimizer state has more than one parameter group")
    g = groups[0]
    if not plan.saved_sgd_matches():
        raise Unbatchable("the saved optimizer state has other SGD settings than the run's")
    ids = g.get("params", [])
    params = [n for n, p in plan.model.named_parameters()]
    if len(ids) != len(params):
        raise Unbatchable("the saved optimizer state is for another set of parameters")
    bufs = {name: state.get("state", {}).get(pid, {}).get("momentum_buffer") for pid, name in zip(ids, params)}
    found = {n: b for n, b in bufs.items() if b is not None and n in trainable}
    if not found:
        return None
    if len(found) != len(trainable):
        raise Unbatchable("the saved optimizer state has momentum for some parameters only")
    return found


def train_together(plans: Sequence[LocalTraining]) -> list[Trained]:
    """Train `plans` (one architecture: the same model instance, the same SGD settings) together; one Trained per
    plan, in order. Raises Unbatchable (or whatever torch.func raises) when they cannot be: nothing is changed
    then, so the caller may run each plan on its own."""
    if not plans:
        return []
    model = plans[0].model
    if any(p.model is not model for p in plans) or len({_hyper(p) for p in plans}) != 1:
        raise Unbatchable("the clients do not share one model instance and SGD settings")
    if any(p.dp is not None for p in plans):
        raise Unbatchable("sample-level DP-SGD trains one client at a time")
    if any(p.extra_loss is not None or p.batch_loss is not None for p in plans):
        raise Unbatchable("a method's own loss (extra_loss, batch_loss) trains one client at a time")
    if plans[0].train.optimizer != "sgd":
        raise Unbatchable(f"optimizer {plans[0].train.optimizer!r} (only SGD is batched)")
    reason = unbatchable_reason(model)
    if reason:
        raise Unbatchable(reason)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    keys = list(model.state_dict())
    for p in plans:
        if list(p.start) != keys:
            raise Unbatchable("a client's starting weights do not match the model's entries")
    loaded = [_loaded_momentum(p, trainable) for p in plans]
    scheds = [_schedule(p, m is not None) for p, m in zip(plans, loaded)]
    order = sorted(range(len(plans)), key=lambda i: -len(scheds[i].batches))
    return _run(plans, scheds, loaded, order, trainable, keys)


def _run(plans: Sequence[LocalTraining], scheds: list[_Schedule], loaded: list[dict[str, torch.Tensor] | None],
         order: list[int], trainable: list[str], keys: list[str]) -> list[Trained]:
    first = plans[0]
    model, device = first.model, first.x.device
    cfg = first.train
    lr, momentum, decay, mu, clip = cfg.lr, cfg.momentum, cfg.weight_decay, first.mu, first.clip
    n = len(plans)
    steps = len(scheds[order[0]].batches)
    stages = max(len(p.stages) for p in plans)

    # non_blocking: a blocking copy from the CPU to a GPU waits for the GPU's queue; these are staged at once
    def stack(name: str) -> torch.Tensor:
        starts = [plans[i].start[name] for i in order]
        if all(t is starts[0] for t in starts):  # one broadcast for all (FedAvg's global model): one copy to the device
            one = starts[0].detach().to(device, non_blocking=True)
            return one.unsqueeze(0).expand(n, *one.shape).clone(memory_format=torch.contiguous_format)
        return torch.stack([t.detach().to(device, non_blocking=True) for t in starts])

    params = {k: stack(k) for k in trainable}
    buffers = {k: stack(k) for k in keys if k not in params}
    anchor = {k: v.clone() for k, v in params.items()} if mu > 0 else {}
    mom = {k: torch.zeros_like(v) for k, v in params.items()} if momentum != 0 else {}
    for pos, i in enumerate(order):
        for k, b in (loaded[i] or {}).items():
            if mom:
                mom[k][pos].copy_(b.to(device))

    # data of the group, one copy, and every step's batch as indices into it (-1: padding)
    x_all = torch.cat([plans[i].x for i in order])
    y_all = torch.cat([plans[i].y for i in order])
    offsets = [0]
    for i in order:
        offsets.append(offsets[-1] + len(plans[i].y))
    # every step padded to the configured batch size, not to the group's longest batch: a client's shapes do not
    # depend on which clients share its group (what still rounds by the group: README, "Training clients together")
    width = max([1, *(s.widest for s in scheds)])  # batch_indices yields no batch longer than its batch size
    # filled in numpy: a torch call per client and step costs more than the group's steps on a GPU
    index_np = np.full((steps, n, width), -1, dtype=np.int64)
    fresh_np = np.zeros((steps, n), dtype=bool)
    stage_np = np.zeros((steps, n), dtype=np.int64)
    lengths_np = np.zeros((steps, n), dtype=np.int64)
    for pos, i in enumerate(order):
        s = scheds[i]
        fresh_np[:len(s.batches), pos] = s.fresh
        stage_np[:len(s.batches), pos] = s.stage
        lengths_np[:len(s.sizes), pos] = s.sizes
        for t, (b, size) in enumerate(zip(s.batches, s.sizes)):
            index_np[t, pos, :size] = b.numpy() + offsets[pos]
    active = (lengths_np > 0).sum(1).tolist()
    lengths = torch.from_numpy(lengths_np)
    index_d, fresh_d, stage_d = (torch.from_numpy(a).to(device, non_blocking=True)
                                 for a in (index_np, fresh_np, stage_np))
    lengths_d = lengths.to(device=device, dtype=torch.float64, non_blocking=True)

    io = _StepInputs()
    shapes = _dropout_shapes(model, x_all[:1]) if steps else []
    gens = [torch.Generator(device=device).manual_seed(plans[i].dropout_seed) for i in order] if shapes else []

    def client_loss(p: dict, b: dict, x: torch.Tensor, y: torch.Tensor, m: torch.Tensor, noise: list,
                    a: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor]:
        io.mask, io.noise, io.new_buffers, io.min_count = m, list(noise), {}, None
        logits = torch.func.functional_call(model, {**p, **b}, (x,))
        if clip is not None:
            logits = clip_logits(logits, clip)
        # cross-entropy as log-softmax and a gather (the same bits as F.cross_entropy): vmapped, F.cross_entropy goes
        # through a decomposition that imports sympy, 0.7 s of a worker's first batched phase
        nll = -torch.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
        loss = (nll * m).sum() / m.sum()
        if mu > 0:
            loss = loss + 0.5 * mu * sum(((p[k] - a[k]) ** 2).sum() for k in p)
        low = io.min_count if io.min_count is not None else m.sum() + 2
        return loss, dict(io.new_buffers), low

    # the clients' losses vmapped, their gradients by one backward pass of their sum: each client's weights reach
    # only its own loss, so that is every client's gradient (torch.func.grad would import PyTorch's compiler)
    forward = torch.func.vmap(client_loss, randomness="error")
    for v in params.values():
        v.requires_grad_(True)
    loss_sum = torch.zeros(n, stages, dtype=torch.float64, device=device)
    too_small = torch.zeros(n, dtype=torch.bool, device=device)
    model.train()
    with _Patched(model, io), torch.enable_grad():
        for t in range(steps):
            a = active[t]
            idx = index_d[t, :a]
            valid = idx >= 0
            flat = torch.where(valid, idx, idx[:, :1])
            xb, yb, mb = x_all[flat], y_all[flat], valid.to(x_all.dtype if x_all.is_floating_point() else torch.float32)
            noise = _noise(gens[:a], shapes, lengths[t, :a].tolist(), width, device) if shapes else []
            active_params = {n_: v[:a] for n_, v in params.items()}
            loss, new, low = forward(active_params, {n_: v[:a] for n_, v in buffers.items()}, xb, yb, mb, noise,
                                     {n_: v[:a] for n_, v in anchor.items()})
            grads = dict(zip(active_params, torch.autograd.grad(loss.sum(), list(active_params.values()))))
            loss = loss.detach()
            _sgd_step(params, grads, mom, fresh_d[t, :a], a, lr, momentum, decay)
            with torch.no_grad():
                for name, v in new.items():
                    buffers[name][:a].copy_(v)
                rows = torch.arange(a, device=device)
                loss_sum.index_put_((rows, stage_d[t, :a]), loss.double() * lengths_d[t, :a], accumulate=True)
                too_small[:a] |= low <= 1
    for v in params.values():
        v.requires_grad_(False)
    finite = _finite_rows([*params.values(), *buffers.values()], n)
    return _collect(plans, scheds, loaded, order, params, buffers, mom, loss_sum.cpu(), too_small.cpu(), finite)


def _finite_rows(stacks: list[torch.Tensor], n: int) -> list[bool]:
    """For each of the `n` clients, whether all its floating entries in `stacks` are finite: one float64 sum per
    client and stack (finite exactly when its entries are: float32 entries cannot overflow it), read in one go, so
    a GPU is waited for once per group rather than once per client."""
    sums = [s.detach().reshape(n, -1).sum(1, dtype=torch.float64) for s in stacks if s.is_floating_point()]
    if not sums:
        return [True] * n
    return torch.isfinite(torch.stack(sums).sum(0)).tolist()


def _noise(gens: list[torch.Generator], shapes: list[tuple[int, ...]], lengths: list[int], width: int,
           device: torch.device) -> list[torch.Tensor]:
    """Each active client's uniform noise for each dropout layer, from its own generator, padded to `width` rows."""
    out = []
    for shape in shapes:
        rows = []
        for g, length in zip(gens, lengths):
            r = torch.rand((length, *shape), generator=g, device=device)
            rows.append(F.pad(r, [0, 0] * len(shape) + [0, width - length], value=1.0))
        out.append(torch.stack(rows))
    return out


@torch.no_grad()
def _sgd_step(params: dict[str, torch.Tensor], grads: dict[str, torch.Tensor], mom: dict[str, torch.Tensor],
              fresh: torch.Tensor, a: int, lr: float, momentum: float, decay: float) -> None:
    """fedsim.training.optim.SGD's update on the first `a` clients' stacks; `fresh` clients start their momentum
    anew."""
    for name, g in grads.items():
        p = params[name][:a]
        d = g if decay == 0 else g.add(p, alpha=decay)
        if momentum != 0:
            buf = mom[name][:a]
            start = fresh.view(-1, *[1] * (d.dim() - 1))
            buf.copy_(torch.where(start, d, buf * momentum + d))
            d = buf
        p.add_(d, alpha=-lr)


def _collect(plans: Sequence[LocalTraining], scheds: list[_Schedule], loaded: list[dict[str, torch.Tensor] | None],
             order: list[int], params: dict[str, torch.Tensor], buffers: dict[str, torch.Tensor],
             mom: dict[str, torch.Tensor], loss_sum: torch.Tensor, too_small: torch.Tensor, finite: list[bool]
             ) -> list[Trained]:
    out: list[Trained | None] = [None] * len(plans)
    for pos, i in enumerate(order):
        plan, s = plans[i], scheds[i]
        state = {k: (params[k] if k in params else buffers[k])[pos] for k in plan.start}
        metrics: dict[str, float] = {}
        for st_i, st in enumerate(plan.stages):
            lens = [size for size, si in zip(s.sizes, s.stage) if si == st_i]
            total = float(loss_sum[pos, st_i])
            metrics.update({st.prefix + "train_loss": total / max(sum(lens), 1), st.prefix + "steps": float(len(lens))})
        # the last stage's buffers: stepped, or (one stage, no step) the loaded ones as they were
        held = s.last_stage_steps > 0 or (len(plan.stages) == 1 and loaded[i] is not None)
        momentum = {k: v[pos] for k, v in mom.items()} if mom and held else None
        error = None
        if bool(too_small[pos]):
            error = ValueError("Expected more than 1 value per channel when training: a batch of one sample "
                               "reached a BatchNorm layer")
        out[i] = Trained(state, metrics, momentum, sum(s.sizes), error, finite[pos])
    return [t for t in out if t is not None]
