"""Local training of a worker's clients one after another on a GPU, with one wait for the GPU per group.

Trained alone (`LocalTraining.run`), a client ends by reading its loss and checking its weights on the host, so
the GPU idles while the host finishes that client and prepares the next. Here each client trains exactly as it
would alone (its steps replayed from CUDA graphs, fedsim.step_graphs) and its trained weights are copied aside;
the group's losses and finiteness are read at the end in one wait, and each client is then finished from its copy
(`LocalTraining.complete`, as after training together). The numbers are those of training each client alone.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from fedsim.local_training import LocalTraining, load_weights, weights_sum
from fedsim.optim import SGD
from fedsim.step_graphs import copies, cuda_graphs_of, replay_stage
from fedsim.train import make_optimizer
from fedsim.train_batched import Trained, Unbatchable


def in_turn_reason(plan: LocalTraining) -> str | None:
    """Why `plan` cannot be trained in turn (only what LocalTraining.run replays from graphs can, and a saved
    optimizer state only with the run's SGD settings, which finishing rebuilds it with), or None."""
    reason = plan.replay_reason()
    if reason is None and plan.optimizer_state is not None and not plan.saved_sgd_matches():
        return "the saved optimizer state has other SGD settings than the run's"
    return reason


@dataclass
class _Pending:
    """A trained client's figures still on the device: per stage its loss total, samples and steps, and the sum
    that says whether its weights are finite."""

    position: int
    totals: list[torch.Tensor]
    counts: list[int]
    steps: list[int]
    finite: torch.Tensor


def train_in_turn(plans: Sequence[LocalTraining]) -> list[Trained]:
    """Train `plans` one after another, each as alone; one Trained per plan, in order (a client whose training
    raises gets its error). Raises Unbatchable, before training any, when some plan cannot be trained this way;
    the plans' generators are left as they were, so the caller may then run each on its own."""
    for plan in plans:
        reason = in_turn_reason(plan)
        if reason is not None:
            raise Unbatchable(reason)
    out: list[Trained] = []
    pending: list[_Pending] = []
    for pos, plan in enumerate(plans):
        try:
            totals, counts, steps, state, momentum = _train(plan)
            finite = weights_sum(list(state.values()), plan.x.device)
        except Exception as exc:  # fails this client only, as its client step would
            out.append(Trained({}, {}, None, 0, error=exc))
            continue
        out.append(Trained(state, {}, momentum, sum(counts)))
        pending.append(_Pending(pos, totals, counts, steps, finite))
    if pending:  # every loss total and weight sum of the group, read in one wait
        values = iter(torch.stack([v.to(torch.float64) for p in pending for v in (*p.totals, p.finite)]).tolist())
        for p in pending:
            trained = out[p.position]
            for stage, total, count, n_steps in zip(plans[p.position].stages, values, p.counts, p.steps):
                trained.metrics[stage.prefix + "train_loss"] = total / max(count, 1)
                trained.metrics[stage.prefix + "steps"] = float(n_steps)
            trained.finite = math.isfinite(next(values))
    return out


def _train(plan: LocalTraining) -> tuple[list[torch.Tensor], list[int], list[int], dict[str, torch.Tensor],
                                         dict[str, torch.Tensor] | None]:
    """LocalTraining.run's training, without its reads: per stage the loss total (on the device), samples and
    steps; then a copy of the trained weights and buffers, and the last stage's momentum by parameter name. Batches
    come from a copy of the plan's generator (a retry on its own draws the same)."""
    model = plan.model
    load_weights(model, plan.start)
    generator = torch.Generator()
    generator.set_state(plan.generator.get_state())
    totals: list[torch.Tensor] = []
    counts: list[int] = []
    steps: list[int] = []
    opt: SGD | None = None
    for i, stage in enumerate(plan.stages):
        cfg = plan.stage_config(stage)
        made = make_optimizer(model.parameters(), cfg)
        assert isinstance(made, SGD)  # in_turn_reason let SGD only through
        opt = made
        if i == 0 and plan.optimizer_state is not None:
            opt.load_state_dict(plan.optimizer_state)
        graphs = cuda_graphs_of(model, opt)
        total, count, n_steps = replay_stage(model, plan.x, plan.y, cfg, generator, opt, graphs)
        totals.append(total)
        counts.append(count)
        steps.append(n_steps)
    own = model.state_dict()
    state = dict(zip(own, copies([v.detach() for v in own.values()]), strict=True))
    momentum = None
    if opt is not None:
        names = [n for n, p in model.named_parameters() if p.requires_grad]
        held = {n: b for n, b in zip(names, opt.momentum_buffers, strict=True) if b is not None}
        momentum = held or None
    return totals, counts, steps, state, momentum
