"""FedAvg and FedProx against hand computations on a linear softmax model.

Two clients hold 3 and 2 examples. Each runs one full-batch SGD step (lr 0.5, no momentum) from the
global weights W0, b0: for logits z = xWᵀ + b, ∇W = (softmax(z) − onehot(y))ᵀx / n and ∇b is its
row-sum analogue. The new global model is (3·W1 + 2·W2) / 5. FedProx adds mu·(W − W0), which is zero at
the first step, so with one step it equals FedAvg; with two steps it differs by the computed amount.
"""

from __future__ import annotations

import numpy as np
import torch

from fedsim.configure import load_config
from fedsim.method.contract import Phase, RoundInfo
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker
from tests.algorithms.linear_model import register_linear

register_linear("linear_test")

X = np.array([[1.0, 0.0, 2.0, -1.0], [0.5, 1.5, -0.5, 0.0], [-1.0, 2.0, 0.0, 1.0],
              [2.0, -1.0, 1.0, 0.5], [0.0, 0.5, -2.0, 1.0]], dtype=np.float32).reshape(5, 1, 2, 2)
Y = np.array([0, 2, 1, 1, 0])
PARTS = [np.array([0, 1, 2]), np.array([3, 4])]


def setup(algorithm: str, *extra: str, steps: int = 1):
    cfg = load_config(None, ["data.num_clients=2", "model.name=linear_test", f"algorithm.name={algorithm}",
                             "train.lr=0.5", "train.momentum=0", f"train.steps={steps}", "train.batch_size=8",
                             "seed=3", *extra])
    arrays = {"x_train": X, "y_train": Y, "x_test": X, "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 2), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    return cfg, Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def sgd_steps(W, b, x, y, lr, steps, mu=0.0):
    W0, b0 = W.copy(), b.copy()
    for _ in range(steps):
        z = x @ W.T + b
        p = np.exp(z - z.max(1, keepdims=True))
        p /= p.sum(1, keepdims=True)
        g = (p - np.eye(3)[y]) / len(y)
        W, b = W - lr * (g.T @ x + mu * (W - W0)), b - lr * (g.sum(0) + mu * (b - b0))
    return W, b


def run_round(server, worker):
    phase = Phase("train", "sum")
    info = RoundInfo(0, "train", [0, 1], [0, 1], {0: 3, 1: 2})
    bc = server.broadcast(phase, info).broadcast
    reply = worker.run_phase(0, 0, phase, bc.common, {}, [0, 1])
    server.step(phase, [reply], info)
    return server.state.models["linear_test"]


def hand_fedavg(state, steps, mu=0.0):
    W, b = state["fc.weight"].double().numpy(), state["fc.bias"].double().numpy()
    x = X.reshape(5, 4).astype(np.float64)
    out = [sgd_steps(W, b, x[p], Y[p], 0.5, steps, mu) for p in PARTS]
    return (3 * out[0][0] + 2 * out[1][0]) / 5, (3 * out[0][1] + 2 * out[1][1]) / 5


def test_fedavg_matches_hand_computation():
    _, server, worker = setup("fedavg")
    init = {k: v.clone() for k, v in server.state.models["linear_test"].items()}
    new = run_round(server, worker)
    W, b = hand_fedavg(init, steps=1)
    np.testing.assert_allclose(new["fc.weight"].numpy(), W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["fc.bias"].numpy(), b, rtol=1e-5, atol=1e-6)


def test_uniform_weighting_is_the_plain_mean():
    _, server, worker = setup("fedavg", "algorithm.weighting=uniform")
    init = {k: v.clone() for k, v in server.state.models["linear_test"].items()}
    new = run_round(server, worker)
    W0, b0 = init["fc.weight"].double().numpy(), init["fc.bias"].double().numpy()
    x = X.reshape(5, 4).astype(np.float64)
    (W1, b1), (W2, b2) = [sgd_steps(W0, b0, x[p], Y[p], 0.5, 1) for p in PARTS]
    np.testing.assert_allclose(new["fc.weight"].numpy(), (W1 + W2) / 2, rtol=1e-5, atol=1e-6)


def test_fedprox_adds_the_proximal_gradient():
    _, server, worker = setup("fedprox", "algorithm.mu=0.7", steps=2)
    init = {k: v.clone() for k, v in server.state.models["linear_test"].items()}
    new = run_round(server, worker)
    W, b = hand_fedavg(init, steps=2, mu=0.7)
    np.testing.assert_allclose(new["fc.weight"].numpy(), W, rtol=1e-5, atol=1e-6)
    W_avg, _ = hand_fedavg(init, steps=2, mu=0.0)
    assert np.abs(W - W_avg).max() > 1e-4  # the proximal term really changed the result


def test_client_metrics_and_bytes_are_reported():
    _, server, worker = setup("fedavg")
    phase = Phase("train", "sum")
    sent = server.broadcast(phase, RoundInfo(0, "train", [0, 1], [0, 1], {0: 3, 1: 2}))
    bc, common_bytes = sent.broadcast, sent.common_bytes
    assert common_bytes == (12 + 3) * 4  # one float32 linear model goes down
    reply = worker.run_phase(0, 0, phase, bc.common, {}, [0, 1])
    assert [o.client_id for o in reply.outcomes] == [0, 1]
    assert all(o.status == "ok" and o.bytes_up == (12 + 3 + 1) * 4 for o in reply.outcomes)
    assert reply.summed.weight == 5.0 and reply.summed.count == 2
    assert set(reply.outcomes[0].result.metrics) == {"train_loss", "steps"}
    assert torch.isfinite(torch.tensor(reply.outcomes[0].result.metrics["train_loss"]))
