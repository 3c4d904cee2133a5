"""SCAFFOLD against a numpy hand computation on a linear softmax model, and end to end on both backends.

Three clients hold 3, 2 and 2 examples; a round samples clients 0 and 1. Each runs K full-batch SGD steps
(lr 0.5, no momentum) on CE + ⟨c − c_i, y⟩, i.e. y ← y − lr·(∇f_i(y) − c_i + c). Option II sets
c_i⁺ = c_i − c + (x − y)/(K·lr); option I sets it to ∇f_i(x). The server moves x by η_g times the mean
Δy and c by (1/N)·ΣΔc with N = 3, so |S|/N matters.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.contract import RoundInfo
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker
from tests.algorithms.linear_model import register_linear

register_linear("linear_scaffold")

X = np.array([[1.0, 0.0, 2.0, -1.0], [0.5, 1.5, -0.5, 0.0], [-1.0, 2.0, 0.0, 1.0], [2.0, -1.0, 1.0, 0.5],
              [0.0, 0.5, -2.0, 1.0], [1.0, 1.0, 1.0, -1.0], [-0.5, 0.0, 1.5, 2.0]], dtype=np.float32)
Y = np.array([0, 2, 1, 1, 0, 2, 1])
PARTS = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6])]
LR = 0.5


def setup(*extra: str, steps: int = 2):
    cfg = load_config(None, ["data.num_clients=3", "model.name=linear_scaffold", "algorithm.name=scaffold",
                             f"train.lr={LR}", "train.momentum=0", f"train.steps={steps}", "train.batch_size=8",
                             "seed=3", *extra])
    arrays = {"x_train": X.reshape(7, 1, 2, 2), "y_train": Y, "x_test": X.reshape(7, 1, 2, 2), "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 3), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def grad(W, b, x, y):
    z = x @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = (p - np.eye(3)[y]) / len(y)
    return g.T @ x, g.sum(0)


def hand_client(W, b, c, ci, part, steps, option="II"):
    """y after K corrected steps, and c_i⁺; c and ci are (cW, cb) pairs."""
    x, y = X[part].astype(np.float64), Y[part]
    Wy, by = W.copy(), b.copy()
    for _ in range(steps):
        gW, gb = grad(Wy, by, x, y)
        Wy, by = Wy - LR * (gW - ci[0] + c[0]), by - LR * (gb - ci[1] + c[1])
    if option == "I":
        return (Wy, by), grad(W, b, x, y)
    return (Wy, by), (ci[0] - c[0] + (W - Wy) / (steps * LR), ci[1] - c[1] + (b - by) / (steps * LR))


def as_np(state, prefix="fc."):
    return state[prefix + "weight"].double().numpy(), state[prefix + "bias"].double().numpy()


def put(pair):
    return {"fc.weight": torch.tensor(pair[0], dtype=torch.float32), "fc.bias": torch.tensor(pair[1],
                                                                                           dtype=torch.float32)}


def run_round(server, worker, r, clients):
    phase = server.phases(r)[0]
    info = RoundInfo(r, "train", clients, clients, {c: len(PARTS[c]) for c in clients})
    bc = server.broadcast(phase, info).broadcast
    reply = worker.run_phase(r, 0, phase, bc.common, {}, clients)
    server.step(phase, [reply], info)
    return reply


@pytest.mark.parametrize("option", ["II", "I"])
def test_two_rounds_match_the_hand_computation(option: str) -> None:
    server, worker = setup(f"algorithm.control={option}", "algorithm.server_lr=0.8")
    rng = np.random.default_rng(0)
    x0 = as_np(server.state.models["linear_scaffold"])
    c = (rng.normal(size=(3, 4)) * 0.1, rng.normal(size=3) * 0.1)  # a nonzero server variate
    ci = {k: (rng.normal(size=(3, 4)) * 0.1, rng.normal(size=3) * 0.1) for k in range(3)}
    server.state.controls["linear_scaffold"] = put(c)
    c = as_np(server.state.controls["linear_scaffold"])  # the float32 values the code sees
    for k in range(3):
        worker.store.put(k, {"control": put(ci[k])})
        ci[k] = as_np(worker.store.get(k)["control"])
    x = x0
    for r, sampled in ((0, [0, 1]), (1, [1, 2])):
        out = {k: hand_client(*x, c, ci[k], PARTS[k], 2, option) for k in sampled}
        x = tuple(x[j] + 0.8 * np.mean([out[k][0][j] - x[j] for k in sampled], 0) for j in (0, 1))
        c = tuple(c[j] + sum(out[k][1][j] - ci[k][j] for k in sampled) / 3 for j in (0, 1))
        for k in sampled:
            ci[k] = out[k][1]
        reply = run_round(server, worker, r, sampled)
        assert [o.status for o in reply.outcomes] == ["ok", "ok"]
        got_x, got_c = as_np(server.state.models["linear_scaffold"]), as_np(server.state.controls["linear_scaffold"])
        for j in (0, 1):
            np.testing.assert_allclose(got_x[j], x[j], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_c[j], c[j], rtol=1e-4, atol=1e-6)
        for k in sampled:
            kept = as_np(worker.store.get(k)["control"])
            np.testing.assert_allclose(kept[0], ci[k][0], rtol=1e-4, atol=1e-5)
    untouched = as_np(worker.store.get(0)["control"])  # client 0 sat out round 1: its c_0 is round 0's
    np.testing.assert_allclose(untouched[0], ci[0][0], rtol=1e-4, atol=1e-5)


def test_zero_variates_and_one_step_is_fedavg_with_uniform_weights() -> None:
    server, worker = setup(steps=1)
    x = as_np(server.state.models["linear_scaffold"])
    run_round(server, worker, 0, [0, 1])
    ys = [hand_client(*x, (0, 0), (0, 0), PARTS[k], 1)[0] for k in (0, 1)]
    np.testing.assert_allclose(as_np(server.state.models["linear_scaffold"])[0], (ys[0][0] + ys[1][0]) / 2,
                               rtol=1e-5, atol=1e-6)


def test_the_variates_double_the_download_and_refuse_adam() -> None:
    server, _ = setup()
    sent = server.broadcast(server.phases(0)[0], RoundInfo(0, "train", [0], [0], {0: 3}))
    assert sent.common_bytes == 2 * (12 + 3) * 4  # x and c, float32
    with pytest.raises(ConfigError, match="train.optimizer"):
        setup("train.optimizer=adam")


def deterministic(df: pd.DataFrame) -> pd.DataFrame:
    return df[[c for c in df.columns if not c.endswith("_s")]].reset_index(drop=True)


def test_same_numbers_with_one_and_three_workers_and_it_learns(make_config) -> None:
    cfg = make_config("algorithm.name=scaffold", "train.momentum=0", "participation.clients_per_round=4",
                      "stragglers.enabled=true", rounds=4)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    pd.testing.assert_frame_equal(deterministic(one["clients"]).drop(columns=["worker"]),
                                  deterministic(three["clients"]).drop(columns=["worker"]))
    acc = one["rounds"].groupby("round")["accuracy"].first()
    assert acc.iloc[-1] > acc.iloc[0] and (one["rounds"]["train/control_norm"] > 0).all()


@pytest.mark.slow
@pytest.mark.ray
def test_ray_matches_local(ray_local, make_config) -> None:
    from actors.pool import RayBackend

    cfg = make_config("algorithm.name=scaffold", "train.momentum=0", "runtime.backend=ray",
                      "runtime.client_cpus=0.5", "participation.clients_per_round=4", rounds=3)
    on_ray = load(run(cfg, RayBackend(num_workers=2)))  # two clients a worker: each keeps both's control variates
    cfg.results.run_id = None
    local = load(run(cfg, LocalBackend()))
    pd.testing.assert_frame_equal(deterministic(on_ray["rounds"]), deterministic(local["rounds"]))
