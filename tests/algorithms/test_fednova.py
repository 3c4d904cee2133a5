"""FedNova: the step norm of plain and momentum SGD, the server's rescaled mean direction against a hand computation,
and FedAvg's numbers (to float rounding) when every client takes the same number of steps."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.algorithms.fednova import STEPS_KEY, step_norm
from fedsim.method import GlobalModels, Phase, RoundInfo, SummedUpdate
from fedsim.method.contract import get_algorithm
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run


def test_the_step_norm_of_plain_and_momentum_sgd():
    assert step_norm(5, 0.0) == 5.0
    assert step_norm(3, 0.5) == pytest.approx(1.0 + 1.5 + 1.75)  # Σ (1 − ρ^k)/(1 − ρ), k = 1..3


def test_the_server_rescales_the_weighted_mean_direction_by_the_mean_step_norm(make_config):
    """Two clients of weights 30 and 10 with step norms 2 and 6 and directions d_1, d_2 (one 3-entry parameter and
    an integer buffer): x ← x − τ_eff·(30 d_1 + 10 d_2)/40 with τ_eff = (30·2 + 10·6)/40."""
    cfg = make_config("algorithm.name=fednova")
    method = get_algorithm("fednova")(cfg.algorithm.params, None)
    method.parameter_names = lambda arch: {"w"}  # type: ignore[method-assign]
    x = {"w": torch.tensor([1.0, -2.0, 0.5]), "n": torch.tensor(4)}
    d1, d2 = np.array([0.1, 0.2, -0.3]), np.array([-0.05, 0.0, 0.4])
    total = {"m/w": torch.tensor(30 * d1 + 10 * d2, dtype=torch.float64), "m/n": torch.tensor(30 * 5 + 10 * 5),
             f"m/{STEPS_KEY}": torch.tensor(30 * 2.0 + 10 * 6.0, dtype=torch.float64),
             "m/__weight__": torch.tensor(40.0, dtype=torch.float64)}
    state, metrics = method.server_step(Phase("train", "sum"), GlobalModels(models={"m": x}),
                                        SummedUpdate(total, 40.0, 2), RoundInfo(0, "train", [1, 2], [1, 2], {}))
    tau = (30 * 2.0 + 10 * 6.0) / 40
    want = np.array([1.0, -2.0, 0.5]) - tau * (30 * d1 + 10 * d2) / 40
    np.testing.assert_allclose(state.models["m"]["w"].numpy(), want, rtol=1e-6)
    assert int(state.models["m"]["n"]) == 5 and metrics["tau_eff"] == tau


def test_equal_local_steps_give_fedavgs_model_to_float_rounding(make_config):
    """train.steps fixes every client's steps: τ_eff·d̄ = x − ȳ, so the model is FedAvg's up to float32 rounding of
    the normalised directions (measured below 1e-6 on the CNN after 2 rounds)."""
    models = {}
    for name in ("fedavg", "fednova"):
        cfg = make_config(f"algorithm.name={name}", "train.steps=3", f"results.run_id={name}", rounds=2)
        models[name] = load_run_checkpoint(run(cfg, LocalBackend()) / "checkpoints" / "last.pt")["server_state"].models
    for key, value in models["fedavg"]["cnn"].items():
        assert torch.allclose(models["fednova"]["cnn"][key], value, rtol=0, atol=1e-6), key
