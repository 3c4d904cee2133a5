"""Knowledge distillation, written once for every method that distils (FedDF, single-image FL, DaFKD, FedGDKD...).

Teachers are built from client logits stacked as `[K, N, C]` (K clients, N shared samples, C classes):
uniform or sample-weighted averages (FedDF, Lin et al. 2020), per-sample domain weights (DaFKD, Wang et
al. 2023) and leave-one-out means (FedGDKD). `distill` is the one server/client KD loop: KL at temperature
T (Hinton et al. 2015) plus an optional hard-label CE term, optional logit clipping (Soni et al. 2024),
and best-on-validation checkpointing every `eval_every` steps (FedDF's `return best model on val`).
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from fedsim.config.knobs import knob
from fedsim.config.limits import MAX_BATCH, MAX_EPOCHS, MAX_STEPS
from fedsim.training.optim import SGD, Adam, CosineAnnealing
from fedsim.training.train import batch_indices, clip_logits

Mix = Literal["logits", "probs"]


def soften(logits: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """softmax(logits / T) over the last dimension."""
    return F.softmax(logits / T, dim=-1)


def kd_loss(student_logits: torch.Tensor, teacher_probs: torch.Tensor, T: float = 1.0) -> torch.Tensor:
    """T²·KL(teacher ‖ softmax(student/T)), averaged over the batch (`batchmean`); 0 where teacher is 0."""
    log_p = F.log_softmax(student_logits / T, dim=-1)
    return (T * T) * F.kl_div(log_p, teacher_probs, reduction="batchmean")


def _normalised_weights(weights: torch.Tensor | None, k: int, n: int, like: torch.Tensor) -> torch.Tensor:
    """Weights as a [K, N, 1] tensor summing to 1 over k; all-zero columns fall back to uniform."""
    if weights is None:
        return torch.full((k, n, 1), 1.0 / k, dtype=like.dtype, device=like.device)
    w = torch.as_tensor(weights, dtype=like.dtype, device=like.device)
    if w.dim() == 1:
        if w.shape[0] != k:
            raise ValueError(f"ensemble_teacher: {w.shape[0]} weights for {k} teachers")
        w = w[:, None].expand(k, n)
    elif w.shape != (k, n):
        raise ValueError(f"ensemble_teacher: weights of shape {tuple(w.shape)}, expected ({k},) or ({k}, {n})")
    if (w < 0).any() or not torch.isfinite(w).all():
        raise ValueError("ensemble_teacher: weights must be finite and >= 0")
    total = w.sum(0, keepdim=True)
    w = torch.where(total > 0, w / total.clamp_min(torch.finfo(w.dtype).tiny), torch.full_like(w, 1.0 / k))
    return w[..., None]


def ensemble_teacher(logits: torch.Tensor, weights: torch.Tensor | None = None, T: float = 1.0,
                     mix: Mix = "logits") -> torch.Tensor:
    """Teacher probabilities [N, C] from K members' logits [K, N, C].

    mix="logits": softmax(Σ_k w_k·logits_k / T) (FedDF `avg_logits`); mix="probs": Σ_k w_k·softmax(logits_k / T).
    `weights` ([K], or [K, N] per sample) are normalised over k; None means uniform.
    """
    if logits.dim() != 3:
        raise ValueError(f"ensemble_teacher: expected logits [K, N, C], got shape {tuple(logits.shape)}")
    k, n, _ = logits.shape
    if k == 0:
        raise ValueError("ensemble_teacher: no teacher logits (K = 0)")
    w = _normalised_weights(weights, k, n, logits)
    if mix == "logits":
        return soften((w * logits).sum(0), T)
    if mix == "probs":
        return (w * soften(logits, T)).sum(0)
    raise ValueError(f"ensemble_teacher: mix must be 'logits' or 'probs', got {mix!r}")


def leave_one_out(logits: torch.Tensor) -> torch.Tensor:
    """For each member k, the mean logits of the other K-1 members: [K, N, C] -> [K, N, C]."""
    k = logits.shape[0]
    if k < 2:
        raise ValueError(f"leave_one_out: needs at least 2 members, got {k}")
    return (logits.sum(0, keepdim=True) - logits) / (k - 1)


def domain_weights(scores: torch.Tensor, eps: float = 1e-8) -> torch.Tensor:
    """DaFKD's per-sample weights α̂_{k,i} = f_k(x_i) / (Σ_k' f_k'(x_i) + eps) over the K rows given."""
    if scores.dim() != 2:
        raise ValueError(f"domain_weights: expected scores [K, N], got shape {tuple(scores.shape)}")
    return scores / (scores.sum(0, keepdim=True) + eps)


@dataclass
class DistillConfig:
    """How one distillation runs; methods embed it in their Params with their paper's defaults."""

    steps: int | None = knob(500, ge=1, le=MAX_STEPS, doc="optimizer steps (exclusive with epochs)")
    epochs: int | None = knob(None, ge=1, le=MAX_EPOCHS, doc="passes over the distillation set instead of steps")
    batch_size: int = knob(32, ge=1, le=MAX_BATCH, doc="distillation batch size")
    lr: float = knob(0.005, gt=0, doc="distillation learning rate")
    optimizer: Literal["adam", "sgd"] = knob("adam", doc="distillation optimizer")
    momentum: float = knob(0.0, ge=0, lt=1, doc="SGD momentum")
    weight_decay: float = knob(0.0, ge=0, doc="L2 weight decay of the student")
    schedule: Literal["constant", "cosine"] = knob("constant", doc="learning rate over the steps")
    T: float = knob(1.0, gt=0, doc="KD temperature (teacher probabilities must be softened at the same T)")
    kd_weight: float = knob(1.0, ge=0, doc="weight α of the KD term")
    ce_weight: float = knob(0.0, ge=0, doc="weight (1-α) of the hard-label CE term (needs hard labels)")
    shuffle: bool = knob(True, doc="reshuffle every pass (False: fixed order, cycled)")
    clip_logits: float | None = knob(None, gt=0, doc="rescale student logit rows with norm >= 1/c to norm c")
    grad_clip: float | None = knob(None, gt=0, doc="clip the gradient norm to this value")
    eval_every: int = knob(50, ge=1, le=MAX_STEPS,
                           doc="validate the student every this many steps (and after the last)")
    keep_best: bool = knob(True, doc="restore the best-on-validation student at the end (needs a validator)")
    patience: int | None = knob(None, ge=1, le=MAX_STEPS,
                                doc="stop after this many steps without a better validation score")

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.epochs is None):
            raise ValueError(f"set exactly one of steps and epochs; got steps={self.steps}, epochs={self.epochs}")
        if self.optimizer not in ("adam", "sgd"):
            raise ValueError(f"optimizer must be 'adam' or 'sgd', got {self.optimizer!r}")

    def total_steps(self, n: int) -> int:
        """Optimizer steps this config takes on a set of n samples."""
        if self.steps is not None:
            return self.steps
        assert self.epochs is not None  # exactly one of the two is set (__post_init__)
        return self.epochs * -(-n // self.batch_size)


def _batches(n: int, cfg: DistillConfig, generator: torch.Generator, device: torch.device):
    if cfg.shuffle:
        yield from batch_indices(n, cfg.batch_size, generator, steps=cfg.total_steps(n), device=device)
        return
    order = torch.arange(n, device=device)
    for step in range(cfg.total_steps(n)):
        start = (step * cfg.batch_size) % n
        idx = order[start:start + cfg.batch_size]
        if len(idx) < cfg.batch_size and n > cfg.batch_size:  # wrap around to keep full batches
            idx = torch.cat([idx, order[:cfg.batch_size - len(idx)]])
        yield idx


def distill(student: nn.Module, inputs: torch.Tensor, teacher_probs: torch.Tensor, cfg: DistillConfig,
            generator: torch.Generator, hard_labels: torch.Tensor | None = None,
            validate: Callable[[nn.Module], float] | None = None) -> dict[str, float]:
    """Train `student` in place to match `teacher_probs` on `inputs`; returns steps, loss, best_score.

    With `validate` (higher is better) the student is scored after the first step (as the single-image
    reference code does, so a distillation that only makes it worse keeps a near-start student), after every
    `eval_every`-th step and after the last; with `keep_best` the best-scoring weights (ties go to the later
    one) are restored.
    """
    n = len(inputs)
    if n == 0:
        return {"steps": 0.0, "loss": float("nan"), "best_score": float("nan"), "best_step": -1.0}
    if teacher_probs.shape[0] != n:
        raise ValueError(f"distill: {n} inputs but {teacher_probs.shape[0]} teacher rows")
    if cfg.ce_weight > 0 and hard_labels is None:
        raise ValueError("distill: ce_weight > 0 needs hard_labels")
    params = [p for p in student.parameters() if p.requires_grad]
    if cfg.optimizer == "adam":
        opt: SGD | Adam = Adam(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    else:
        opt = SGD(params, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)
    total = cfg.total_steps(n)
    sched = CosineAnnealing(opt, T_max=total) if cfg.schedule == "cosine" else None
    best_score, best_step, best_state, since_best = float("-inf"), -1, None, 0
    loss_sum, step = 0.0, 0
    student.train()
    for idx in _batches(n, cfg, generator, inputs.device):
        z = student(inputs[idx])
        if cfg.clip_logits is not None:
            z = clip_logits(z, cfg.clip_logits)
        loss = cfg.kd_weight * kd_loss(z, teacher_probs[idx], cfg.T)
        if cfg.ce_weight > 0 and hard_labels is not None:  # always given with ce_weight > 0 (checked above)
            loss = loss + cfg.ce_weight * F.cross_entropy(z, hard_labels[idx])
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if cfg.grad_clip is not None:
            torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
        opt.step()
        if sched is not None:
            sched.step()
        loss_sum += float(loss.detach())
        step += 1
        since_best += 1
        if validate is not None and (step == 1 or step % cfg.eval_every == 0 or step == total):
            score = float(validate(student))
            student.train()
            if score >= best_score:
                best_score, best_step, since_best = score, step, 0
                if cfg.keep_best:
                    best_state = copy.deepcopy(student.state_dict())
        if cfg.patience is not None and validate is not None and since_best >= cfg.patience:
            break
    if best_state is not None and best_step != step:
        student.load_state_dict(best_state)
    return {"steps": float(step), "loss": loss_sum / max(step, 1),
            "best_score": best_score if validate is not None else float("nan"), "best_step": float(best_step)}
