"""Dataset distillation by unrolling: the meta-gradient is the true derivative of the real-batch loss."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from fedsim.algorithms._meta_distill import (
    Distiller,
    DistillSettings,
    class_balanced_labels,
    label_loss,
    sgd_replay,
    sgd_unroll,
    trainable,
    xavier_init_,
)


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Unrolled meta-gradients are thousands of tiny ops: one thread avoids OpenMP stalls on busy machines."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


def tiny_problem(soft: bool, lr_per: str = "unrolled", lr_param: str = "softplus"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()
    xavier_init_(model, seed=7)
    theta0, rest = trainable(model)
    s = DistillSettings(steps=2, batch=3, epochs=2, lr0=0.3, lr_per=lr_per, lr_param=lr_param, soft_labels=soft)
    d = Distiller(s, (3,), 2, torch.Generator().manual_seed(1), dtype=torch.float64)
    with torch.no_grad():
        d.raw_lr.add_(torch.linspace(-0.2, 0.2, d.raw_lr.numel(), dtype=torch.float64))  # distinct lrs
        if soft:
            d.y.add_(0.3 * torch.randn(d.y.shape, generator=torch.Generator().manual_seed(3), dtype=torch.float64))
    x_real = torch.randn(5, 3, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    y_real = torch.tensor([0, 1, 1, 0, 1])
    return model, theta0, rest, d, x_real, y_real


def finite_difference(fn, leaf: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    grad = torch.zeros_like(leaf)
    flat, gflat = leaf.data.view(-1), grad.view(-1)
    for i in range(flat.numel()):
        old = flat[i].item()
        flat[i] = old + eps
        up = fn().item()
        flat[i] = old - eps
        down = fn().item()
        flat[i] = old
        gflat[i] = (up - down) / (2 * eps)
    return grad


@pytest.mark.parametrize("lr_per,lr_param", [("unrolled", "softplus"), ("step", "raw")])
def test_meta_gradient_matches_finite_differences(lr_per: str, lr_param: str) -> None:
    """d ℓ(real; θ_T) / d(x̃, η̃, ỹ) through 4 unrolled SGD steps equals central differences (float64)."""
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=True, lr_per=lr_per, lr_param=lr_param)
    loss = d.meta_loss(model, theta0, rest, x_real, y_real)
    loss.backward()

    def fn():
        return d.meta_loss(model, theta0, rest, x_real, y_real).detach()

    for leaf in (d.x, d.raw_lr, d.y):
        fd = finite_difference(fn, leaf)
        torch.testing.assert_close(leaf.grad, fd, rtol=1e-5, atol=1e-8)
        assert leaf.grad.abs().max() > 1e-4  # the check is not vacuous


def test_first_order_shortcut_is_not_the_meta_gradient() -> None:
    """Treating ∇θℓ as a constant (no create_graph) gives a different lr gradient and none for x̃."""
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=False)
    start = {n: p.detach().requires_grad_(True) for n, p in theta0.items()}
    lrs = d.lrs()
    theta = sgd_unroll(model, start, rest, d.x, d.y, lrs, d.s.epochs, create_graph=False)
    first = torch.autograd.grad(label_loss(torch.func.functional_call(model, (theta, rest), (x_real,)), y_real),
                                d.raw_lr)[0]
    d.meta_loss(model, theta0, rest, x_real, y_real).backward()
    assert not torch.allclose(first, d.raw_lr.grad, rtol=1e-3)
    assert d.x.grad.abs().max() > 0


def test_server_replay_equals_unroll_without_graph() -> None:
    """The server's graph-free SGD over the same sequence reaches the same θ_T as the client's unroll."""
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=True, lr_per="step")
    with torch.no_grad():
        lrs = d.lrs()
    start = {n: p.detach().requires_grad_(True) for n, p in theta0.items()}
    a = sgd_unroll(model, start, rest, d.x.detach(), d.y.detach(), lrs, 2, create_graph=False)
    seq = [(d.x[j].detach(), d.y[j].detach(), lrs[j]) for _ in range(2) for j in range(2)]
    b = sgd_replay(model, theta0, rest, seq)
    for n in a:
        torch.testing.assert_close(a[n].detach(), b[n], rtol=0, atol=1e-12)


def test_xavier_init_is_bitwise_reproducible_and_zero_bias() -> None:
    a = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    b = nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3))
    torch.manual_seed(123)  # global RNG state must not matter
    xavier_init_(a, 42)
    torch.manual_seed(999)
    xavier_init_(b, 42)
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        assert torch.equal(p, q), n
    assert torch.equal(a[0].bias, torch.zeros(4))
    c = xavier_init_(nn.Sequential(nn.Linear(5, 4), nn.Linear(4, 3)), 43)
    assert not torch.equal(a[0].weight, c[0].weight)
    # Xavier-normal std = sqrt(2 / (fan_in + fan_out)) = sqrt(2/9) for a 5→4 layer, over many draws
    big = xavier_init_(nn.Linear(500, 400), 0).weight
    assert abs(big.std().item() - (2 / 900) ** 0.5) < 1e-3


def test_class_balanced_labels() -> None:
    assert class_balanced_labels(3, 4, 5).tolist() == [[0, 1, 2, 3], [4, 0, 1, 2], [3, 4, 0, 1]]


def test_masking_replaces_exactly_p_and_blocks_their_gradient() -> None:
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=True)
    d.s.mask_p = 0.5  # 3 of the 6 examples
    mask, noise = d.sample_mask(torch.Generator().manual_seed(0))
    assert int(mask.sum()) == 3
    d.meta_loss(model, theta0, rest, x_real, y_real, mask, noise).backward()
    assert torch.all(d.x.grad[mask] == 0) and torch.all(d.y.grad[mask] == 0)
    assert torch.all(d.x.grad[~mask].abs().sum(-1) > 0)
    d.s.mask_unit = "step"
    d.s.mask_p = 0.5
    mask, _ = d.sample_mask(torch.Generator().manual_seed(0))
    assert mask.all(1).sum() == 1 and (mask.any(1) == mask.all(1)).all()


def test_fit_halves_meta_lr_every_tau_epochs_and_learns() -> None:
    """Adam's lr is α·0.5^(epoch // τ); distilling lowers the real-batch loss of θ_T."""
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=False, lr_per="step")
    d.s.outer_epochs, d.s.decay_every, d.s.real_batch, d.s.meta_lr = 5, 2, 5, 0.05
    seen = []
    step = d.opt.step

    def spy(*a, **k):
        seen.append(d.opt.param_groups[0]["lr"])
        return step(*a, **k)

    d.opt.step = spy
    out = d.fit(model, lambda it: theta0, rest, x_real, y_real, torch.Generator().manual_seed(0))
    assert seen == pytest.approx([0.05, 0.05, 0.025, 0.025, 0.0125])
    assert out["meta_iterations"] == 5
    assert out["meta_loss_last"] < out["meta_loss_first"]


def test_diverged_iterations_are_skipped_and_counted() -> None:
    """A non-finite real-batch loss (diverged unroll) updates nothing: the last finite tuples are kept."""
    model, theta0, rest, d, x_real, y_real = tiny_problem(soft=False, lr_per="step")
    d.s.outer_epochs, d.s.real_batch = 2, 5
    with torch.no_grad():
        d.x[0, 0, 0] = float("nan")
    before = d.x.detach().clone()
    out = d.fit(model, lambda it: theta0, rest, x_real, y_real, torch.Generator().manual_seed(0))
    assert out["nonfinite_iterations"] == 2 and out["meta_iterations"] == 2
    torch.testing.assert_close(d.x.detach(), before, equal_nan=True)
