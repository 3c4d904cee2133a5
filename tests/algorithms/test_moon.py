"""MOON: the contrastive loss against numpy, one local step against a hand-written torch step on a two-layer model,
μ = 0 against FedAvg bit for bit, the same numbers on one and two workers and after a resume, and the refusals."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.algorithms.moon import contrastive_loss
from fedsim.configure import load_config, uploads_model_update
from fedsim.errors import ConfigError
from fedsim.method.contract import RoundInfo
from fedsim.models import Classifier, register_model
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker
from tests.runtime.test_resume_methods import StopAfter
from tests.runtime.test_worker_count import comparable


def numpy_loss(z, z_glob, z_prev, tau):
    """−log(e^{cos(z,z_glob)/τ} / (e^{cos(z,z_glob)/τ} + Σ e^{cos(z,z_prev)/τ})), averaged over the rows."""
    def cos(a, b):
        return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1))

    pos = np.exp(cos(z, z_glob) / tau)
    neg = sum((np.exp(cos(z, p) / tau) for p in z_prev), np.zeros(len(z)))
    return float(np.mean(-np.log(pos / (pos + neg))))


@pytest.mark.parametrize("pool", [0, 1, 2])
def test_the_contrastive_loss_matches_numpy(pool: int) -> None:
    g = np.random.default_rng(pool)
    z, z_glob = g.normal(size=(5, 4)), g.normal(size=(5, 4))
    z_prev = [g.normal(size=(5, 4)) for _ in range(pool)]
    got = contrastive_loss(torch.tensor(z), torch.tensor(z_glob), [torch.tensor(p) for p in z_prev], 0.5)
    if pool == 0:
        assert got.item() == 0.0  # a single logit: exactly 0, so a first round trains CE alone
    else:
        assert got.item() == pytest.approx(numpy_loss(z, z_glob, z_prev, 0.5), rel=1e-12)
        assert got.item() != pytest.approx(numpy_loss(z, z_glob, z_prev, 1.0), rel=1e-3)  # τ matters


class TwoLayer(Classifier):
    """embed: ReLU(W1·x + b1), 4 -> 3; head: W2·z + b2, 3 -> 3."""

    def __init__(self) -> None:
        super().__init__()
        self.embed_dim = 3
        self.l1, self.l2 = nn.Linear(4, 3), nn.Linear(3, 3)

    def embed(self, x):
        return torch.relu(self.l1(x.flatten(1)))

    def head(self, z):
        return self.l2(z)


class NoEmbedding(Classifier):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(4, 3)

    def forward(self, x):
        return self.fc(x.flatten(1))


register_model("two_layer_moon")(lambda in_channels, num_classes, image_size: TwoLayer())
register_model("no_embedding_moon")(lambda in_channels, num_classes, image_size: NoEmbedding())

X = np.array([[1.0, 0.0, 2.0, -1.0], [0.5, 1.5, -0.5, 0.0], [-1.0, 2.0, 0.0, 1.0], [2.0, -1.0, 1.0, 0.5],
              [0.0, 0.5, -2.0, 1.0]], dtype=np.float32)
Y = np.array([0, 2, 1, 1, 0])
PARTS = [np.array([0, 1, 2]), np.array([3, 4])]
LR, MU, TAU = 0.5, 2.0, 0.5


def setup(*extra: str):
    cfg = load_config(None, ["data.num_clients=2", "model.name=two_layer_moon", "algorithm.name=moon",
                             f"algorithm.mu={MU}", f"algorithm.temperature={TAU}", "algorithm.buffer=2",
                             f"train.lr={LR}", "train.momentum=0", "train.steps=1", "train.batch_size=8", "seed=5",
                             *extra])
    arrays = {"x_train": X.reshape(5, 1, 2, 2), "y_train": Y, "x_test": X.reshape(5, 1, 2, 2), "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 2), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def hand_step(start, previous, part):
    """One full-batch SGD step on CE + μ·ℓ_con written out: θ − lr·∇, and ℓ_con (0 and no term without a pool)."""
    x, y = torch.from_numpy(X[part]), torch.from_numpy(Y[part])
    theta = {k: v.clone().requires_grad_(True) for k, v in start.items()}

    def z_of(w):
        return torch.relu(x @ w["l1.weight"].T + w["l1.bias"])

    def cos(a, b):
        return (a * b).sum(1) / (a.norm(dim=1) * b.norm(dim=1))

    z = z_of(theta)
    loss = F.cross_entropy(z @ theta["l2.weight"].T + theta["l2.bias"], y)
    con = torch.zeros(())
    if previous:
        pos = torch.exp(cos(z, z_of(start)) / TAU)  # the broadcast global model's (frozen) representation
        neg = sum(torch.exp(cos(z, z_of(p)) / TAU) for p in previous)
        con = (-torch.log(pos / (pos + neg))).mean()
        loss = loss + MU * con
    grads = torch.autograd.grad(loss, list(theta.values()))
    return {k: (v - LR * gr).detach() for (k, v), gr in zip(theta.items(), grads)}, float(con.detach())


def test_one_local_step_matches_the_hand_written_step() -> None:
    """Client 0 holds two previous models (buffer 2): its step contrasts against both and then keeps the newer one
    and its trained model; client 1 has none, so its step is plain CE and it keeps its trained model."""
    server, worker = setup()
    g = torch.Generator().manual_seed(1)
    server.state.models["two_layer_moon"]["l1.bias"] += 3.0  # every ReLU unit on: no zero representation
    start = {k: v.clone() for k, v in server.state.models["two_layer_moon"].items()}
    previous = [{k: torch.randn(v.shape, generator=g) + (5.0 if k == "l1.bias" else 0.0) for k, v in start.items()}
                for _ in range(2)]
    worker.store.put(0, {"previous": previous})
    phase = server.phases(0)[0]
    assert not phase.local_training and phase.model_update
    info = RoundInfo(0, "train", [0, 1], [0, 1], {0: 3, 1: 2})
    reply = worker.run_phase(0, 0, phase, server.broadcast(phase, info).broadcast.common, {}, [0, 1])
    metrics = {o.client_id: o.result.metrics for o in reply.outcomes}
    for cid, prev in ((0, previous), (1, [])):
        want, con = hand_step(start, prev, PARTS[cid])
        kept = worker.store.get(cid)["previous"]
        assert len(kept) == (2 if prev else 1)
        if prev:
            assert all(torch.equal(kept[0][k], previous[1][k]) for k in start)  # the oldest one dropped
            assert con > 0.1
        for k in start:
            torch.testing.assert_close(kept[-1][k], want[k], rtol=1e-5, atol=1e-6)
        assert metrics[cid]["contrastive_loss"] == pytest.approx(con, rel=1e-5, abs=0)


def test_a_model_without_embeddings_and_sample_level_dp_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"^model.name: moon contrasts .*'no_embedding_moon' does not expose them"):
        setup("model.name=no_embedding_moon")
    with pytest.raises(ConfigError, match="^privacy.level: sample-level DP-SGD"):
        setup("privacy.level=sample", "privacy.noise_multiplier=0.5", "privacy.clip=1.0")
    assert uploads_model_update(load_config(None, ["algorithm.name=moon"])) is True  # the chain's other stages apply


SMALL = ["model.name=mlp", "data.num_clients=6", "participation.clients_per_round=4", "train.steps=3"]


def final_models(run_dir):
    return load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["server_state"].models["mlp"]


def test_mu_zero_is_fedavg_bit_for_bit_and_a_first_round_is_fedavgs_for_any_mu(make_config) -> None:
    plain = run(make_config(*SMALL, "results.run_id=fedavg", rounds=2), LocalBackend())
    zero = run(make_config(*SMALL, "algorithm.name=moon", "algorithm.mu=0", "results.run_id=zero", rounds=2),
               LocalBackend())
    one = run(make_config(*SMALL, "algorithm.name=moon", "algorithm.mu=1", "results.run_id=one", rounds=1),
              LocalBackend())
    fedavg = load(plain)
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(comparable(load(zero)[table]), comparable(fedavg[table]), obj=table)
    for key, value in final_models(plain).items():
        assert torch.equal(final_models(zero)[key], value), key
    first = load(one)
    assert (first["clients"]["contrastive_loss"] == 0).all()  # nobody has a previous model yet
    pd.testing.assert_frame_equal(comparable(first["rounds"]), comparable(fedavg["rounds"][fedavg["rounds"]["round"]
                                                                                          == 0]))



def test_one_and_two_workers_and_a_resumed_run_give_the_same_numbers(make_config) -> None:
    """Two rounds (buffer 2) on one worker, on two, and stopped after round 0 then resumed: the same tables, and the
    same final model and per-client previous models bit for bit."""
    opts = [*SMALL, "algorithm.name=moon", "algorithm.buffer=2"]
    runs = {}
    for name, workers in (("one", 1), ("two", 2)):
        runs[name] = run(make_config(*opts, f"results.run_id={name}", rounds=2), LocalBackend(num_workers=workers))
    cut = run(make_config(*opts, "results.run_id=cut", rounds=2), LocalBackend(), callbacks=[StopAfter(0)])
    assert load(cut)["rounds"]["round"].max() == 0
    runs["cut"] = run(resume=cut, backend=LocalBackend())
    tables = {k: load(v) for k, v in runs.items()}
    assert tables["two"]["clients"]["worker"].nunique() == 2
    clients = tables["one"]["clients"]
    assert (clients[clients["round"] == 1]["contrastive_loss"] > 0).any(), "no client reused a previous model"
    final = {k: load_run_checkpoint(v / "checkpoints" / "last.pt") for k, v in runs.items()}
    for other in ("two", "cut"):
        for table in ("rounds", "clients"):
            pd.testing.assert_frame_equal(comparable(tables["one"][table]), comparable(tables[other][table]),
                                          obj=f"{other} {table}")
        ours, theirs = final["one"], final[other]
        for key, value in ours["server_state"].models["mlp"].items():
            assert torch.equal(value, theirs["server_state"].models["mlp"][key]), (other, key)
        assert sorted(ours["client_states"]) == sorted(theirs["client_states"])
        for cid, state in ours["client_states"].items():
            mine, yours = state["previous"], theirs["client_states"][cid]["previous"]
            assert len(mine) == len(yours) and all(torch.equal(a[k], b[k]) for a, b in zip(mine, yours) for k in a)
