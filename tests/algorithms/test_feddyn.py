"""FedDyn against a numpy hand computation on a linear softmax model, and end to end on the local backend.

Three clients hold 3, 2 and 2 examples; round 0 samples clients 0 and 1, round 1 clients 1 and 2. Each runs K
full-batch SGD steps (no momentum) on CE − ⟨g_k, θ⟩ + (α/2)‖θ − θ_s‖², i.e. θ ← θ − lr·(∇L_k(θ) − g_k + α(θ − θ_s)),
then keeps g_k − α(θ_k − θ_s). The server sets h ← h − α·(1/N)·Σ(θ_k − θ_s) with N = 3 (not the 2 sampled) and
θ_s ← mean(θ_k) − h/α. Client 1 takes part twice, so its second round uses the state its first one left.
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.algorithms.feddyn import FedDynState, server_update
from fedsim.configure import load_config, uploads_model_update
from fedsim.method import Phase, RoundInfo, SummedUpdate
from fedsim.method.contract import get_algorithm
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker
from tests.algorithms.linear_model import register_linear
from tests.runtime.test_resume_methods import StopAfter
from tests.runtime.test_worker_count import comparable

MODEL = register_linear("linear_feddyn")

X = np.array([[1.0, 0.0, 2.0, -1.0], [0.5, 1.5, -0.5, 0.0], [-1.0, 2.0, 0.0, 1.0], [2.0, -1.0, 1.0, 0.5],
              [0.0, 0.5, -2.0, 1.0], [1.0, 1.0, 1.0, -1.0], [-0.5, 0.0, 1.5, 2.0]], dtype=np.float32)
Y = np.array([0, 2, 1, 1, 0, 2, 1])
PARTS = [np.array([0, 1, 2]), np.array([3, 4]), np.array([5, 6])]
LR, ALPHA = 0.5, 0.3


def setup(*extra: str, steps: int = 2):
    cfg = load_config(None, ["data.num_clients=3", f"model.name={MODEL}", "algorithm.name=feddyn",
                             f"algorithm.alpha={ALPHA}", f"train.lr={LR}", "train.momentum=0",
                             f"train.steps={steps}", "train.batch_size=8", "seed=3", *extra])
    arrays = {"x_train": X.reshape(7, 1, 2, 2), "y_train": Y, "x_test": X.reshape(7, 1, 2, 2), "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 3), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def ce_grad(W, b, x, y):
    z = x @ W.T + b
    p = np.exp(z - z.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    g = (p - np.eye(3)[y]) / len(y)
    return g.T @ x, g.sum(0)


def hand_client(theta, g, part, steps):
    """θ_k after K steps from θ_s on the dynamic loss, and the client's new g_k (pairs of (W, b))."""
    x, y = X[part].astype(np.float64), Y[part]
    W, b = theta[0].copy(), theta[1].copy()
    for _ in range(steps):
        gW, gb = ce_grad(W, b, x, y)
        W = W - LR * (gW - g[0] + ALPHA * (W - theta[0]))
        b = b - LR * (gb - g[1] + ALPHA * (b - theta[1]))
    return (W, b), (g[0] - ALPHA * (W - theta[0]), g[1] - ALPHA * (b - theta[1]))


def as_np(state):
    return state["fc.weight"].double().numpy(), state["fc.bias"].double().numpy()


def put(pair):
    return {"fc.weight": torch.tensor(pair[0], dtype=torch.float32), "fc.bias": torch.tensor(pair[1],
                                                                                           dtype=torch.float32)}


def run_round(server, worker, r, clients):
    phase = server.phases(r)[0]
    info = RoundInfo(r, "train", clients, clients, {c: len(PARTS[c]) for c in clients})
    bc = server.broadcast(phase, info).broadcast
    reply = worker.run_phase(r, 0, phase, bc.common, {}, clients)
    assert [o.status for o in reply.outcomes] == ["ok"] * len(clients)
    server.step(phase, [reply], info)


def test_two_rounds_match_the_hand_computation() -> None:
    server, worker = setup()
    rng = np.random.default_rng(0)
    g = {0: (rng.normal(size=(3, 4)) * 0.1, rng.normal(size=3) * 0.1), 1: (np.zeros((3, 4)), np.zeros(3)),
         2: (np.zeros((3, 4)), np.zeros(3))}  # client 0 starts from a nonzero g, the others from the default 0
    worker.store.put(0, {"grad": put(g[0])})
    g[0] = as_np(worker.store.get(0)["grad"])  # the float32 values the code sees
    theta = as_np(server.state.models[MODEL])
    h = (np.zeros((3, 4)), np.zeros(3))
    for r, sampled in ((0, [0, 1]), (1, [1, 2])):
        out = {k: hand_client(theta, g[k], PARTS[k], 2) for k in sampled}
        mean = tuple(np.mean([out[k][0][j] for k in sampled], 0) for j in (0, 1))
        h = tuple(h[j] - ALPHA * sum(out[k][0][j] - theta[j] for k in sampled) / 3 for j in (0, 1))
        theta = tuple(mean[j] - h[j] / ALPHA for j in (0, 1))
        for k in sampled:
            g[k] = out[k][1]
        run_round(server, worker, r, sampled)
        got = as_np(server.state.models[MODEL])
        got_h = server.state.h[MODEL]["fc.weight"].numpy(), server.state.h[MODEL]["fc.bias"].numpy()
        for j in (0, 1):
            np.testing.assert_allclose(got[j], theta[j], rtol=1e-5, atol=1e-6)
            np.testing.assert_allclose(got_h[j], h[j], rtol=1e-5, atol=1e-8)
            for k in sampled:
                np.testing.assert_allclose(as_np(worker.store.get(k)["grad"])[j], g[k][j], rtol=1e-5, atol=1e-7)
        theta = got  # the float32 model the next round starts from
    np.testing.assert_allclose(as_np(worker.store.get(0)["grad"])[0], g[0][0], rtol=1e-5, atol=1e-7)  # sat out


@pytest.mark.parametrize("nonzero", [False, True])
def test_one_local_step_follows_the_dynamic_gradient(nonzero: bool) -> None:
    """With one step from θ_s the quadratic's gradient α(θ − θ_s) is 0, so θ_1 = θ_s − lr·(∇L_k(θ_s) − g_k)."""
    server, worker = setup(steps=1)
    g = (np.full((3, 4), 0.2), np.array([0.1, -0.3, 0.05])) if nonzero else (np.zeros((3, 4)), np.zeros(3))
    if nonzero:
        worker.store.put(1, {"grad": put(g)})
    theta = as_np(server.state.models[MODEL])
    run_round(server, worker, 0, [1])
    gW, gb = ce_grad(*theta, X[PARTS[1]].astype(np.float64), Y[PARTS[1]])
    want = theta[0] - LR * (gW - g[0]), theta[1] - LR * (gb - g[1])
    kept = as_np(worker.store.get(1)["grad"])
    for j in (0, 1):  # g_1 ← g_1 − α(θ_1 − θ_s) reveals θ_1
        np.testing.assert_allclose(theta[j] + (g[j] - kept[j]) / ALPHA, want[j], rtol=1e-4, atol=1e-5)


def test_the_server_step_corrects_parameters_and_averages_buffers(make_config) -> None:
    """Two arrived clients of four (uniform weights): parameter w moves to mean − h/α with
    h = −α·(2/4)·(mean − θ); the integer buffer n takes the plain mean; an architecture nobody trained stays."""
    cfg = make_config("algorithm.name=feddyn", "algorithm.alpha=0.5")
    method = get_algorithm("feddyn")(cfg.algorithm.params, None)
    method.env = type("E", (), {"client_archs": ["m", "m", "m", "m", "q"]})()  # type: ignore[assignment]
    theta = {"w": torch.tensor([1.0, -2.0, 0.5]), "n": torch.tensor(4)}
    w1, w2 = np.array([1.2, -1.0, 0.0]), np.array([0.6, -2.5, 1.5])
    total = {"m/w": torch.tensor(w1 + w2, dtype=torch.float64), "m/n": torch.tensor(10.0, dtype=torch.float64),
             "m/__weight__": torch.tensor(2.0, dtype=torch.float64)}
    h0 = {"w": torch.tensor([0.1, 0.0, -0.2], dtype=torch.float64)}
    other = {"w": torch.zeros(3)}
    state = FedDynState(models={"m": theta, "q": other}, h={"m": h0, "q": {"w": torch.zeros(3, dtype=torch.float64)}})
    new, metrics = method.server_step(Phase("train", "sum"), state, SummedUpdate(total, 2.0, 2),
                                      RoundInfo(0, "train", [0, 1], [0, 1], {}))
    mean = (w1 + w2) / 2
    h = h0["w"].numpy() - 0.5 * (2 / 4) * (mean - theta["w"].double().numpy())
    np.testing.assert_allclose(new.h["m"]["w"].numpy(), h, rtol=1e-12)
    np.testing.assert_allclose(new.models["m"]["w"].numpy(), mean - h / 0.5, rtol=1e-6)
    assert new.models["m"]["n"].dtype == torch.int64 and int(new.models["m"]["n"]) == 5
    assert new.models["q"] is other and new.h["q"] is state.h["q"]
    assert metrics["h_norm"] == pytest.approx(float(np.linalg.norm(h)))
    theta_w, h_w = server_update({"w": theta["w"]}, h0, {"w": torch.tensor(mean)}, 2.0, 4, 0.5)
    assert torch.equal(theta_w["w"], new.models["m"]["w"]) and torch.equal(h_w["w"], new.h["m"]["w"])


SMALL = ["algorithm.name=feddyn", "model.name=mlp", "data.num_clients=6", "participation.clients_per_round=4",
         "train.steps=3"]



def test_one_and_two_workers_and_a_resumed_run_give_the_same_numbers(make_config) -> None:
    """Two rounds on one worker, on two, and stopped after round 0 then resumed on one: the same tables, and the same
    final server state and per-client g_k bit for bit."""
    runs = {}
    for name, workers in (("one", 1), ("two", 2)):
        runs[name] = run(make_config(*SMALL, f"results.run_id={name}", rounds=2), LocalBackend(num_workers=workers))
    cut = run(make_config(*SMALL, "results.run_id=cut", rounds=2), LocalBackend(), callbacks=[StopAfter(0)])
    assert load(cut)["rounds"]["round"].max() == 0
    runs["cut"] = run(resume=cut, backend=LocalBackend())
    tables = {k: load(v) for k, v in runs.items()}
    assert tables["two"]["clients"]["worker"].nunique() == 2
    ids = tables["one"]["clients"].groupby("round")["client"].apply(set)
    assert ids[0] & ids[1], "no client took part twice: its kept g_k was never used"
    final = {k: load_run_checkpoint(v / "checkpoints" / "last.pt") for k, v in runs.items()}
    for other in ("two", "cut"):
        for table in ("rounds", "clients"):
            pd.testing.assert_frame_equal(comparable(tables["one"][table]), comparable(tables[other][table]),
                                          obj=f"{other} {table}")
        ours, theirs = final["one"], final[other]
        for key, value in ours["server_state"].models["mlp"].items():
            assert torch.equal(value, theirs["server_state"].models["mlp"][key]), (other, key)
        for key, value in ours["server_state"].h["mlp"].items():
            assert torch.equal(value, theirs["server_state"].h["mlp"][key]), (other, key)
        assert sorted(ours["client_states"]) == sorted(theirs["client_states"]) == sorted(set().union(*ids))
        for cid, state in ours["client_states"].items():
            for key, value in state["grad"].items():
                assert torch.equal(value, theirs["client_states"][cid]["grad"][key]), (other, cid, key)


def test_its_round_takes_the_update_chain() -> None:
    """One phase summing a model update: DP, robust aggregators and secure aggregation apply, and the config check
    says so before the run."""
    cfg = load_config(None, ["algorithm.name=feddyn"])
    assert uploads_model_update(cfg) is True
