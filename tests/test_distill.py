"""fedsim.method.distill on hand-computable problems: losses, teachers, clipping and the distillation loop."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from fedsim.config.knobs import from_dict
from fedsim.errors import ConfigError
from fedsim.method.distill import (
    DistillConfig,
    _batches,
    distill,
    domain_weights,
    ensemble_teacher,
    kd_loss,
    leave_one_out,
    soften,
)
from fedsim.training.train import clip_logits


def test_soften_and_temperature():
    p = soften(torch.tensor([0.0, math.log(3.0)]))
    torch.testing.assert_close(p, torch.tensor([0.25, 0.75]))
    p2 = soften(torch.tensor([0.0, 2 * math.log(3.0)]), T=2.0)  # same as T=1 on halved logits
    torch.testing.assert_close(p2, torch.tensor([0.25, 0.75]))


def test_kd_loss_exact_values():
    """KL([.5,.5] ‖ [.25,.75]) = .5·ln2 + .5·ln(2/3) = .5·ln(4/3); at T=2 it is scaled by T² = 4."""
    teacher = torch.tensor([[0.5, 0.5]])
    student = torch.tensor([[0.0, math.log(3.0)]])
    assert kd_loss(student, teacher).item() == pytest.approx(0.5 * math.log(4 / 3), rel=1e-6)
    q = 1 / (1 + math.sqrt(3))  # softmax([0, ln3/2]) = [1/(1+√3), √3/(1+√3)]
    kl_t2 = 0.5 * math.log(0.5 / q) + 0.5 * math.log(0.5 / (1 - q))
    assert kd_loss(student, teacher, T=2.0).item() == pytest.approx(4 * kl_t2, rel=1e-6)
    # batchmean: two rows, one with zero loss, halves the total; a zero teacher entry contributes 0
    both = kd_loss(torch.cat([student, torch.tensor([[0.0, 0.0]])]), torch.cat([teacher, teacher]))
    assert both.item() == pytest.approx(0.25 * math.log(4 / 3), rel=1e-6)
    onehot = kd_loss(torch.tensor([[0.0, math.log(3.0)]]), torch.tensor([[0.0, 1.0]]))
    assert onehot.item() == pytest.approx(-math.log(0.75), rel=1e-6)


def test_ensemble_teacher_logits_and_probs():
    logits = torch.tensor([[[4.0, 0.0]], [[0.0, 0.0]]])  # K=2, N=1, C=2
    w = torch.tensor([3.0, 1.0])  # normalised to .75/.25
    torch.testing.assert_close(ensemble_teacher(logits, w), soften(torch.tensor([[3.0, 0.0]])))
    expect = 0.75 * soften(torch.tensor([[4.0, 0.0]])) + 0.25 * torch.tensor([[0.5, 0.5]])
    torch.testing.assert_close(ensemble_teacher(logits, w, mix="probs"), expect)
    torch.testing.assert_close(ensemble_teacher(logits), soften(torch.tensor([[2.0, 0.0]])))
    torch.testing.assert_close(ensemble_teacher(logits, w, T=3.0), soften(torch.tensor([[1.0, 0.0]])))


def test_ensemble_teacher_per_sample_weights_and_zero_columns():
    logits = torch.tensor([[[2.0, 0.0], [2.0, 0.0]], [[0.0, 2.0], [0.0, 2.0]]])  # K=2, N=2
    w = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # sample 0: all member 0; sample 1: no weight -> uniform
    out = ensemble_teacher(logits, w)
    torch.testing.assert_close(out[0], soften(torch.tensor([2.0, 0.0])))
    torch.testing.assert_close(out[1], torch.tensor([0.5, 0.5]))
    with pytest.raises(ValueError, match="weights of shape"):
        ensemble_teacher(logits, torch.ones(3, 2))
    with pytest.raises(ValueError, match=">= 0"):
        ensemble_teacher(logits, torch.tensor([1.0, -1.0]))


def test_leave_one_out_means_of_others():
    logits = torch.tensor([1.0, 2.0, 6.0]).reshape(3, 1, 1)
    torch.testing.assert_close(leave_one_out(logits).flatten(), torch.tensor([4.0, 3.5, 1.5]))
    with pytest.raises(ValueError, match="at least 2"):
        leave_one_out(logits[:1])


def test_domain_weights_normalise_over_rows():
    w = domain_weights(torch.tensor([[1.0, 0.0], [3.0, 0.0]]))
    torch.testing.assert_close(w, torch.tensor([[0.25, 0.0], [0.75, 0.0]]))


def test_clip_logits_reference_rule():
    """Rows with norm >= 1/c go to norm c; smaller rows stay as they are (c = 2.5 -> threshold 0.4)."""
    z = torch.tensor([[3.0, 4.0], [0.1, 0.2], [0.3, 0.4]])
    out = clip_logits(z, 2.5)
    torch.testing.assert_close(out, torch.tensor([[1.5, 2.0], [0.1, 0.2], [1.5, 2.0]]))


def test_config_validation_and_total_steps():
    with pytest.raises(ValueError, match="exactly one of steps and epochs"):
        DistillConfig(steps=10, epochs=2)
    assert DistillConfig(steps=None, epochs=2, batch_size=4).total_steps(10) == 6
    with pytest.raises(ConfigError, match="distill.lr: must be > 0"):
        from_dict(DistillConfig, {"lr": 0}, prefix="distill")


def test_fixed_order_batches_cycle():
    cfg = DistillConfig(steps=4, batch_size=2, shuffle=False)
    got = [b.tolist() for b in _batches(3, cfg, torch.Generator(), torch.device("cpu"))]
    assert got == [[0, 1], [2, 0], [1, 2], [0, 1]]


def test_one_sgd_step_matches_hand_gradient():
    """Linear student W=0, x = I₂, teacher one-hot: dL/dz = (softmax(z) - p)/B, so W becomes ±0.25."""
    student = nn.Linear(2, 2, bias=False)
    nn.init.zeros_(student.weight)
    cfg = DistillConfig(steps=1, batch_size=2, lr=1.0, optimizer="sgd", shuffle=False)
    out = distill(student, torch.eye(2), torch.eye(2), cfg, torch.Generator().manual_seed(0))
    torch.testing.assert_close(student.weight.detach(), torch.tensor([[0.25, -0.25], [-0.25, 0.25]]))
    assert out["steps"] == 1.0
    assert out["loss"] == pytest.approx(math.log(2.0), rel=1e-6)  # KL(onehot ‖ uniform) = ln 2


def test_keep_best_restores_best_validated_weights():
    torch.manual_seed(0)
    student = nn.Linear(4, 3)
    x, t = torch.randn(16, 4), soften(torch.randn(16, 3))
    scores, snapshots = iter([0.1, 0.9, 0.5, 0.9, 0.2]), []

    def validate(m):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        return next(scores)

    cfg = DistillConfig(steps=5, batch_size=4, eval_every=1)
    out = distill(student, x, t, cfg, torch.Generator().manual_seed(1), validate=validate)
    assert out["best_score"] == 0.9 and out["best_step"] == 4.0  # ties go to the later step
    for k, v in student.state_dict().items():
        torch.testing.assert_close(v, snapshots[3][k])


def test_the_first_step_is_validated_so_a_distillation_that_only_hurts_keeps_it():
    torch.manual_seed(0)
    student = nn.Linear(4, 3)
    x, t = torch.randn(16, 4), soften(torch.randn(16, 3))
    steps, snapshots = [], []

    def validate(m):
        snapshots.append({k: v.clone() for k, v in m.state_dict().items()})
        steps.append(len(steps))
        return 1.0 - 0.1 * len(steps)  # worse at every later check

    out = distill(student, x, t, DistillConfig(steps=10, batch_size=4, eval_every=5), torch.Generator(),
                  validate=validate)
    assert len(steps) == 3 and out["best_step"] == 1.0  # checked after steps 1, 5 and 10
    for k, v in student.state_dict().items():
        torch.testing.assert_close(v, snapshots[0][k])


def test_patience_stops_early_and_ce_needs_labels():
    student = nn.Linear(2, 2)
    cfg = DistillConfig(steps=100, batch_size=2, eval_every=1, patience=3)
    calls = iter(range(100))
    out = distill(student, torch.randn(4, 2), soften(torch.randn(4, 2)), cfg, torch.Generator(),
                  validate=lambda m: -float(next(calls)))  # best at step 1, then only worse
    assert out["steps"] == 4.0 and out["best_step"] == 1.0
    with pytest.raises(ValueError, match="hard_labels"):
        distill(student, torch.randn(4, 2), soften(torch.randn(4, 2)), DistillConfig(steps=1, ce_weight=0.5),
                torch.Generator())


def test_distill_is_deterministic_and_reduces_kl():
    def run():
        torch.manual_seed(3)
        student = nn.Linear(5, 4)
        g = torch.Generator().manual_seed(7)
        x = torch.randn(64, 5, generator=g)
        t = soften(x @ (2 * torch.randn(5, 4, generator=g)))  # realisable by a linear student
        before = kd_loss(student(x), t).item()
        cfg = DistillConfig(steps=200, batch_size=16, lr=0.05, kd_weight=1.0, ce_weight=0.0)
        distill(student, x, t, cfg, torch.Generator().manual_seed(5))
        return before, kd_loss(student(x), t).item(), student.weight.detach().clone()

    b1, a1, w1 = run()
    _, a2, w2 = run()
    assert torch.equal(w1, w2) and a1 == a2
    assert a1 < 0.5 * b1
