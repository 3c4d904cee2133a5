"""The FedOpt family built in (fedadam, fedyogi, fedadagrad) and FedAvgM: the kit's server step against a numpy hand
computation over three steps, FedAdam's first step against the paper's closed form, FedAvgM without momentum
equal to FedAvg bit for bit, a resumed FedAdam run equal to an uninterrupted one, and FedYogi's numbers the same
on one and three workers. (tests/test_bench.py checks the step against Flower's own strategies.)"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.method import ServerOptimizer, server_opt_step
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_loop import deterministic
from tests.transforms.test_privacy import stopped_then_resumed

FLOATS = ("w", "b")


def tiny_models(steps: int = 3, seed: int = 0) -> tuple[dict[str, torch.Tensor], list[dict[str, torch.Tensor]]]:
    """A float32 model of two entries and an integer buffer, and `steps` averaged client models around it."""
    g = np.random.default_rng(seed)
    model = {"w": torch.from_numpy(g.normal(size=(2, 3)).astype(np.float32)),
             "b": torch.from_numpy(g.normal(size=3).astype(np.float32)),
             "n": torch.tensor(5, dtype=torch.int64)}
    averaged = [{"w": torch.from_numpy(g.normal(scale=0.3, size=(2, 3)).astype(np.float32)) + model["w"],
                 "b": torch.from_numpy(g.normal(scale=0.3, size=3).astype(np.float32)) + model["b"],
                 "n": torch.tensor(6 + t, dtype=torch.int64)} for t in range(steps)]
    return model, averaged


def numpy_steps(opt: ServerOptimizer, x0: np.ndarray, targets: list[np.ndarray]) -> list[np.ndarray]:
    """The rules as written (Reddi et al. 2021, Algorithm 2; Hsu et al. 2019), in float64 numpy, one entry."""
    x = x0.astype(np.float64)
    m, v, u = np.zeros_like(x), np.full_like(x, opt.v_init), np.zeros_like(x)
    out = []
    for t, target in enumerate(targets, start=1):
        avg = target.astype(np.float64)
        if opt.rule == "avgm":
            u = opt.momentum * u + (x - avg)
            x = x - opt.lr * u
        else:
            d = avg - x
            m = opt.beta1 * m + (1 - opt.beta1) * d
            if opt.rule == "adam":
                v = opt.beta2 * v + (1 - opt.beta2) * d * d
            elif opt.rule == "yogi":
                v = v - (1 - opt.beta2) * d * d * np.sign(v - d * d)
            else:
                v = v + d * d
            eta = opt.lr
            if opt.bias_correction:
                eta = opt.lr * np.sqrt(1 - opt.beta2 ** t) / (1 - opt.beta1 ** t)
            x = x + eta * m / (np.sqrt(v) + opt.tau)
        x = x.astype(np.float32).astype(np.float64)  # the model is float32 between steps
        out.append(x)
    return out


OPTIMIZERS = {
    "adam": ServerOptimizer("adam", 0.1, beta1=0.9, beta2=0.99, tau=1e-3),
    "adam_bias_corrected": ServerOptimizer("adam", 0.1, beta1=0.9, beta2=0.99, tau=1e-3, bias_correction=True),
    "adam_v_init": ServerOptimizer("adam", 0.05, beta1=0.8, beta2=0.9, tau=1e-2, v_init=1e-4),
    "yogi": ServerOptimizer("yogi", 0.01, beta1=0.9, beta2=0.99, tau=1e-3),
    "yogi_v_init": ServerOptimizer("yogi", 0.01, beta1=0.9, beta2=0.99, tau=1e-3, v_init=0.05),
    "adagrad": ServerOptimizer("adagrad", 0.1, beta1=0.0, tau=1e-3),
    "adagrad_momentum": ServerOptimizer("adagrad", 0.1, beta1=0.5, tau=1e-3),
    "avgm": ServerOptimizer("avgm", 1.0, momentum=0.9),
    "avgm_lr": ServerOptimizer("avgm", 0.3, momentum=0.5),
}


@pytest.mark.parametrize("which", list(OPTIMIZERS))
def test_three_server_steps_match_a_numpy_hand_computation(which):
    opt = OPTIMIZERS[which]
    model, averaged = tiny_models()
    expected = {k: numpy_steps(opt, model[k].numpy(), [a[k].numpy() for a in averaged]) for k in FLOATS}
    slots = None
    for t, avg in enumerate(averaged):
        model, slots = server_opt_step(opt, model, avg, slots)
        assert slots["step"] == t + 1
        assert model["n"].dtype == torch.int64 and int(model["n"]) == int(avg["n"])  # the average's counter
        for k in FLOATS:
            assert model[k].dtype == torch.float32
            np.testing.assert_allclose(model[k].numpy(), expected[k][t], rtol=1e-6, atol=1e-7, err_msg=f"{k} {t}")
    assert all(v.dtype == torch.float64 for part in slots.values() if isinstance(part, dict) for v in part.values())


def test_fedadams_first_step_is_the_papers_update():
    """v_init 0: x + η·(1−β1)Δ/(√((1−β2)Δ²) + τ), from m = (1−β1)Δ and v = (1−β2)Δ²."""
    opt = ServerOptimizer("adam", 0.1, beta1=0.9, beta2=0.99, tau=1e-3)
    model, (avg, *_) = tiny_models()
    new, _ = server_opt_step(opt, model, avg)
    for k in FLOATS:
        x, d = model[k].double(), avg[k].double() - model[k].double()
        paper = x + 0.1 * (1 - 0.9) * d / (torch.sqrt((1 - 0.99) * d * d) + 1e-3)
        np.testing.assert_allclose(new[k].numpy(), paper.float().numpy(), rtol=1e-6, atol=0, err_msg=k)


def test_bias_correction_is_fedadams_alone():
    with pytest.raises(ValueError, match="bias_correction is FedAdam's"):
        ServerOptimizer("yogi", 0.01, bias_correction=True)


def test_fedavgm_without_momentum_is_fedavg_bit_for_bit(make_config):
    plain = run(make_config("results.run_id=plain", rounds=2), LocalBackend())
    avgm = run(make_config("algorithm.name=fedavgm", "algorithm.momentum=0", "algorithm.server_lr=1",
                           "results.run_id=avgm", rounds=2), LocalBackend())
    rounds = deterministic(load(avgm)["rounds"])
    # the step's length over the mean update's: exactly FedAvg's step here, so 1 (to float32 rounding of the model)
    np.testing.assert_allclose(rounds.pop("train/step_ratio"), 1.0, rtol=1e-6)
    pd.testing.assert_frame_equal(rounds, deterministic(load(plain)["rounds"]))
    ours = load_run_checkpoint(avgm / "checkpoints" / "last.pt")["server_state"]
    theirs = load_run_checkpoint(plain / "checkpoints" / "last.pt")["server_state"]
    assert ours.extra["server_opt"]["cnn"]["step"] == 2
    for name, a in theirs.models["cnn"].items():
        assert torch.equal(a, ours.models["cnn"][name]), name


def test_a_resumed_fedadam_run_equals_an_uninterrupted_one(make_config):
    cfg = make_config("algorithm.name=fedadam", "algorithm.bias_correction=true", "results.run_id=whole", rounds=3)
    whole_dir = run(cfg, LocalBackend())
    whole = load(whole_dir)["rounds"]
    resumed = stopped_then_resumed(cfg)
    pd.testing.assert_frame_equal(deterministic(resumed), deterministic(whole))
    ours = load_run_checkpoint(whole_dir.parent / "resumed" / "checkpoints" / "last.pt")["server_state"]
    theirs = load_run_checkpoint(whole_dir / "checkpoints" / "last.pt")["server_state"]
    assert ours.extra["server_opt"]["cnn"]["step"] == theirs.extra["server_opt"]["cnn"]["step"] == 3
    for part in ("m", "v"):
        for name, a in theirs.extra["server_opt"]["cnn"][part].items():
            assert torch.equal(a, ours.extra["server_opt"]["cnn"][part][name]), (part, name)
    for name, a in theirs.models["cnn"].items():
        assert torch.equal(a, ours.models["cnn"][name]), name


def test_fedyogi_gives_the_same_numbers_on_one_and_three_workers(make_config):
    cfg = make_config("algorithm.name=fedyogi", rounds=2)
    one = load(run(cfg, LocalBackend(num_workers=1)))["rounds"]
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))["rounds"]
    pd.testing.assert_frame_equal(deterministic(one), deterministic(three))
