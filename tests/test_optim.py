"""fedsim's SGD and Adam against torch.optim's: the same parameters, bit for bit, and interchangeable state."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from fedsim.training.optim import SGD, Adam, CosineAnnealing
from tests.conftest import ROOT


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 8), torch.nn.ReLU(), torch.nn.Linear(8, 3))


def _steps(model, opt, n: int, seed: int = 1) -> None:
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        x, y = torch.randn(5, 6, generator=g), torch.randint(0, 3, (5,), generator=g)
        opt.zero_grad(set_to_none=True)
        torch.nn.functional.cross_entropy(model(x), y).backward()
        opt.step()


KW = [dict(lr=0.1), dict(lr=0.05, momentum=0.9), dict(lr=0.05, momentum=0.9, weight_decay=1e-3),
      dict(lr=0.05, momentum=0.5, dampening=0.3), dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=5e-4)]


ADAM_KW = [dict(lr=1e-2), dict(lr=3e-3, betas=(0.5, 0.99), weight_decay=1e-2),
           dict(lr=2e-3, betas=(0.5, 0.999), eps=1e-6, weight_decay=1e-2, amsgrad=True)]
EQUAL = [(SGD, torch.optim.SGD, kw, 7) for kw in KW] + [(Adam, torch.optim.Adam, kw, 9) for kw in ADAM_KW]


@pytest.mark.parametrize("foreach", [False, True])
@pytest.mark.parametrize("mine, theirs, kw, steps", EQUAL)
def test_each_optimizer_equals_torchs_bit_for_bit(mine, theirs, kw, steps, foreach):
    a, b = _model(), _model()
    _steps(a, mine(a.parameters(), **kw), steps)
    _steps(b, theirs(b.parameters(), foreach=foreach, **kw), steps)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert not torch.equal(next(a.parameters()), next(_model().parameters()))  # it did move


def test_sgd_leaves_a_parameter_without_gradient_and_the_gradients_alone():
    kw = dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3)
    a, b = _model(), _model()
    for m in (a, b):
        m[0].bias.requires_grad_(False)  # never trained
    opt_a, opt_b = SGD(a.parameters(), **kw), torch.optim.SGD(b.parameters(), foreach=False, **kw)
    frozen = a[2].bias.detach().clone()
    for step in range(4):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            loss = m(x).sum() if step % 2 else m[0](x).sum()  # odd steps: the last layer gets no gradient
            loss.backward()
            before = [p.grad.clone() if p.grad is not None else None for p in m.parameters()]
            opt.step()
            if opt is opt_a:  # our step reads the gradients without changing them
                assert all(g is None and p.grad is None or torch.equal(g, p.grad)
                           for g, p in zip(before, m.parameters(), strict=True))
        if step == 0:
            assert torch.equal(a[2].bias, frozen)
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


RESUMED = [(SGD, torch.optim.SGD, dict(lr=0.05, momentum=0.9, weight_decay=1e-3), "momentum_buffer"),
           (Adam, torch.optim.Adam, dict(lr=1e-2, betas=(0.5, 0.99), weight_decay=1e-3, amsgrad=True), "exp_avg")]


@pytest.mark.parametrize("ours_first", [True, False])
@pytest.mark.parametrize("ours, theirs, kw, buffer", RESUMED, ids=["sgd", "adam"])
def test_saved_state_resumes_across_the_two_optimizers(ours_first, ours, theirs, kw, buffer):
    first, second = (ours, theirs) if ours_first else (theirs, ours)
    a, ref = _model(), _model()
    opt = first(a.parameters(), **kw)
    _steps(a, opt, 3)
    saved = opt.state_dict()
    kept = {i: s[buffer].clone() for i, s in saved["state"].items()}
    resumed = second(a.parameters(), **kw)
    resumed.load_state_dict(saved)
    _steps(a, resumed, 3, seed=2)
    ref_opt = theirs(ref.parameters(), foreach=False, **kw)
    _steps(ref, ref_opt, 3)
    _steps(ref, ref_opt, 3, seed=2)
    for pa, pr in zip(a.parameters(), ref.parameters(), strict=True):
        assert torch.equal(pa, pr)
    if not ours_first:  # our loader copied the state: the saved one was not stepped in place
        assert all(torch.equal(saved["state"][i][buffer], kept[i]) for i in kept)


def test_a_float64_parameter_beside_float32_ones_steps_as_in_torch():
    kw = dict(lr=0.05, momentum=0.9, weight_decay=1e-3)
    a, b = _model(), _model()
    a[2].double(), b[2].double()
    for m, opt in ((a, SGD(a.parameters(), **kw)), (b, torch.optim.SGD(b.parameters(), foreach=False,
                                                                                        **kw))):
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            m[2](m[1](m[0](x)).double()).sum().backward()
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert pa.dtype == pb.dtype and torch.equal(pa, pb)


@pytest.mark.parametrize("kw", [dict(lr=0.1), dict(lr=0.05, momentum=0.9)])
def test_sparse_gradients_step_as_in_torch_sgd(kw):
    def model() -> torch.nn.Module:
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Flatten(), torch.nn.Linear(8, 2))

    a, b = model(), model()
    for m, opt in ((a, SGD(a.parameters(), **kw)), (b, torch.optim.SGD(b.parameters(), **kw))):
        for step in range(3):
            opt.zero_grad(set_to_none=True)
            m(torch.tensor([[step, step + 1], [3, 4]])).sum().backward()
            opt.step()
    assert a[0].weight.grad.is_sparse
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)


def test_load_state_dict_rejects_another_models_state():
    opt = SGD(_model().parameters(), lr=0.1, momentum=0.9)
    other = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="different set of parameters"):
        opt.load_state_dict(torch.optim.SGD(other.parameters(), lr=0.1).state_dict())


def test_adam_counts_steps_per_parameter_as_torch_does():
    """A parameter without a gradient in a step is not stepped, and its own step count (bias correction) waits."""
    kw = dict(lr=1e-2, weight_decay=1e-3, amsgrad=True)
    a, b = _model(), _model()
    opt_a, opt_b = Adam(a.parameters(), **kw), torch.optim.Adam(b.parameters(), foreach=False, **kw)
    for step in range(5):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad(set_to_none=True)
            x = torch.randn(5, 6, generator=torch.Generator().manual_seed(step))
            (m(x).sum() if step % 2 else m[0](x).sum()).backward()  # even steps: the last layer gets no gradient
            opt.step()
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        assert torch.equal(pa, pb)
    assert opt_a.state_dict()["state"][2]["step"] == opt_b.state_dict()["state"][2]["step"] == 2


def test_adam_refuses_bad_hyper_parameters_and_another_models_state():
    with pytest.raises(ValueError, match="betas"):
        Adam(_model().parameters(), betas=(0.9, 1.0))
    opt = Adam(_model().parameters())
    with pytest.raises(ValueError, match="different set of parameters"):
        opt.load_state_dict(torch.optim.Adam(torch.nn.Linear(2, 2).parameters()).state_dict())


@pytest.mark.parametrize("t_max, steps", [(7, 7), (5, 13), (1, 3)])
def test_cosine_annealing_gives_torchs_learning_rates_bit_for_bit(t_max, steps):
    ours = Adam(_model().parameters(), lr=0.01)
    theirs = torch.optim.Adam(_model().parameters(), lr=0.01)
    sched_ours = CosineAnnealing(ours, T_max=t_max)
    sched_theirs = torch.optim.lr_scheduler.CosineAnnealingLR(theirs, T_max=t_max)
    seen = []
    for _ in range(steps):
        ours.step()  # no gradients: nothing moves, but torch's scheduler expects a step first
        theirs.step()
        sched_ours.step()
        sched_theirs.step()
        seen.append(ours.param_groups[0]["lr"])
        assert ours.param_groups[0]["lr"] == theirs.param_groups[0]["lr"]
    assert min(seen) < 0.01 * 0.5  # it did anneal


def test_training_with_either_optimizer_never_imports_the_compiler():
    """One fresh process trains a step with each optimizer in turn and says after each whether torch's compiler
    (torch._dynamo) was imported: a process per optimizer cost an interpreter and torch start each."""
    code = ("import sys, torch\nfrom fedsim.config.schema import TrainConfig\n"
            "from fedsim.training.train import make_optimizer\n"
            "from fedsim.training.optim import CosineAnnealing\n"
            "for name in ('adam', 'sgd'):\n"
            "    m = torch.nn.Linear(3, 2)\n"
            "    opt = make_optimizer(m.parameters(), TrainConfig(optimizer=name, momentum=0.9))\n"
            "    sched = CosineAnnealing(opt, T_max=3)\n"
            "    m(torch.ones(1, 3)).sum().backward()\n    opt.step()\n    sched.step()\n"
            "    print(name, type(opt).__name__, 'torch._dynamo' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.split("\n")[:-1] == ["adam Adam False", "sgd SGD False"], proc.stdout
