"""DOSFL's mechanism columns: θ0 trained on each client's distilled steps alone, on their merge (as is and with
the learned lrs divided by K) and on a centralised distillation of the same data, scored on the test subset."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.algorithms._meta_distill import sgd_replay, trainable
from fedsim.algorithms.dosfl import DOSFL
from fedsim.runtime.loop import run
from tests.conftest import small_config
from tests.mechanism_check import check_mechanism

TINY = ["algorithm.distill_steps=2", "algorithm.distill_batch=5", "algorithm.distill_epochs=2",
        "algorithm.epochs=2", "algorithm.batch_size=64", "model.name=lenet"]
COL = "distill/mech_"


def test_columns_documented_measured_and_training_untouched(tmp_path):
    on = check_mechanism(tmp_path, "dosfl", *TINY, rounds=1)
    row = on.dropna(subset=[f"{COL}merged_acc"]).iloc[0]
    for name in ("theta0_acc", "alone_acc_mean", "alone_acc_min", "alone_acc_max", "merged_acc",
                 "merged_reversed_acc", "merged_lr_div_k_acc", "ceiling_acc"):
        assert 0.0 <= row[f"{COL}{name}"] <= 1.0, name
    assert row[f"{COL}alone_acc_min"] <= row[f"{COL}alone_acc_mean"] <= row[f"{COL}alone_acc_max"]
    # the merged model is the server's model: its probe accuracy is the run's accuracy (the probe is the
    # whole 360-sample digits test set, under eval.mechanism_samples)
    assert row[f"{COL}merged_acc"] == pytest.approx(on["accuracy"].dropna().iloc[0])


def test_ceiling_off_drops_only_its_column(tmp_path):
    from fedsim.results.tables import load

    cfg = small_config(tmp_path, "algorithm.name=dosfl", *TINY, "algorithm.ceiling=false", rounds=1)
    rounds = load(run(cfg))["rounds"]
    mech = {c for c in rounds.columns if "mech_" in c}
    assert mech == set(DOSFL.mechanism_columns) - {f"{COL}ceiling_acc"}


def test_serial_mode_reports_no_columns(tmp_path):
    from fedsim.results.tables import load

    cfg = small_config(tmp_path, "algorithm.name=dosfl", *TINY, "algorithm.mode=serial", rounds=1)
    rounds = load(run(cfg))["rounds"]
    assert not [c for c in rounds.columns if "mech_" in c]


def _server(tmp_path, *overrides: str):
    """A DOSFL instance on the tiny digits setup, with its environment's server data and partition."""
    from fedsim.method.contract import get_algorithm
    from fedsim.runtime.setup import build_env, load_data, make_partition

    cfg = small_config(tmp_path, "algorithm.name=dosfl", *TINY, *overrides, rounds=1)
    data = load_data(cfg)
    part = make_partition(cfg, data)
    env = build_env(cfg, data, part)
    env.extras.update(server_data=data, partition=part)
    algo = get_algorithm("dosfl")(cfg.algorithm.params, env)
    return algo, env


def test_mechanism_by_hand_on_crafted_steps(tmp_path):
    """Crafted payloads: the alone/merged/reversed/lr÷K columns equal hand-run replays of θ0, and the global RNG is
    left where it was (the ceiling distils from its own generator)."""
    algo, env = _server(tmp_path)
    arch = env.archs[0]
    state = algo.init_server(env)
    theta0 = state.models[arch]
    g = torch.Generator().manual_seed(5)
    shape = (2, 5, *env.input_shape)
    got = {c: {"x": torch.randn(shape, generator=g), "y": torch.randint(0, 10, (2, 5), generator=g),
               "lr": torch.full((2,), 0.05 * (c + 1))} for c in range(3)}
    merged = algo.train_on(arch, theta0, [got[c] for c in sorted(got)])
    before = torch.get_rng_state()
    cols = algo._mechanism({arch: theta0}, {arch: merged}, got)
    assert torch.equal(torch.get_rng_state(), before)

    x, y = torch.as_tensor(env.extras["server_data"].x_test), torch.as_tensor(env.extras["server_data"].y_test)

    def acc(sd):
        model = algo_model(algo, arch, sd)
        with torch.no_grad():
            return float((model(x).argmax(1) == y).float().mean())

    def replay(payloads):  # E_d passes of the interleaved steps, written out independently of DOSFL.sequence
        model = algo_model(algo, arch, theta0)
        params, rest = trainable(model)
        seq = [(pl["x"][j], pl["y"][j], pl["lr"][j]) for _ in range(2) for j in range(2) for pl in payloads]
        params = sgd_replay(model, params, rest, seq)
        return {k: params.get(k, v) for k, v in model.state_dict().items()}

    alone = [acc(replay([got[c]])) for c in range(3)]
    assert cols["mech_alone_acc_mean"] == pytest.approx(np.mean(alone))
    assert cols["mech_alone_acc_min"] == pytest.approx(min(alone))
    assert cols["mech_alone_acc_max"] == pytest.approx(max(alone))
    assert cols["mech_merged_acc"] == pytest.approx(acc(replay([got[c] for c in range(3)])))
    assert cols["mech_merged_reversed_acc"] == pytest.approx(acc(replay([got[c] for c in (2, 1, 0)])))
    div = [dict(got[c], lr=got[c]["lr"] / 3) for c in range(3)]
    assert cols["mech_merged_lr_div_k_acc"] == pytest.approx(acc(replay(div)))
    assert cols["mech_theta0_acc"] == pytest.approx(acc(theta0))
    assert 0.0 <= cols["mech_ceiling_acc"] <= 1.0
    # the ceiling is deterministic: a second measurement gives the same number
    assert algo._mechanism({arch: theta0}, {arch: merged}, got)["mech_ceiling_acc"] == cols["mech_ceiling_acc"]


def algo_model(algo, arch, weights):
    from fedsim.method.toolkit import new_model

    model = new_model(algo.env, arch)
    model.load_state_dict(weights)
    return model.eval()
