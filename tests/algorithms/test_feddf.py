"""FedDF and single-image FL: schedules, the sample-weighted teacher, FedAvg within architectures, mirrors,
best-mirror selection, what travels, and a short end-to-end run on digits."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import fedsim.algorithms.feddf as feddf_mod
from fedsim.algorithms.feddf import scheduled_steps
from fedsim.algorithms.single_image import SingleImage
from fedsim.data.proxy import split_test_halves
from fedsim.errors import ConfigError
from fedsim.method import ClientResult, Phase, RoundInfo, toolkit
from fedsim.results.tables import load
from fedsim.runtime.loop import run
from fedsim.runtime.server import Server
from fedsim.runtime.setup import load_data, make_partition
from fedsim.runtime.store import state_nbytes
from fedsim.runtime.worker import ClientWorker
from fedsim.training.local import ClippedLogits

TINY = ["algorithm.name=single_image", "algorithm.pool_size=400", "algorithm.selection.n=40",
        "algorithm.selection.k=8", "algorithm.selection.niter=5", "algorithm.distill.steps=4",
        "algorithm.distill.eval_every=2"]
PHASE = Phase("train", "each")


def make_pair(cfg):
    data = load_data(cfg)
    part = make_partition(cfg, data)
    arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
    meta = {"num_classes": data.num_classes, "mean": data.mean, "std": data.std}
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu"), part


def test_cosine_restart_schedule_matches_the_reference_log():
    """hetero_sched log (max 500, min 100, interval 5): 500, 300, 158, 100, 500, 441, 300, 158, 100, 500."""
    assert [scheduled_steps(r, 500, 100, 5) for r in range(1, 11)] == [500, 300, 158, 100, 500, 441, 300, 158, 100,
                                                                       500]
    assert sum(scheduled_steps(r, 500, 250, 5) for r in range(1, 31)) == 11281  # Table 4's "11.3K" steps


def test_fedavg_initialisation_rates(make_config):
    for every, rounds in ((1, list(range(10))), (2, [0, 1, 3, 5, 7, 9]), (5, [0, 4, 9])):
        cfg = make_config(*TINY, f"algorithm.fedavg_every={every}")
        algo = SingleImage(cfg.algorithm.params, None)
        assert [r for r in range(10) if algo.is_fedavg_round(r)] == rounds


def test_round_on_digits_only_indices_travel(make_config):
    cfg = make_config(*TINY)
    server, worker, part = make_pair(cfg)
    again, _, _ = make_pair(cfg)
    st = server.state
    assert np.array_equal(st.indices, again.state.indices)  # selection is deterministic
    assert 40 <= len(st.indices) <= 40 + 10 and np.all(np.diff(st.indices) > 0)
    info = RoundInfo(0, "train", [0, 1, 2], [0, 1, 2], {c: int(len(part.train[c])) for c in range(3)})
    sent = server.broadcast(PHASE, info)
    bc, common_b, per_b = sent.broadcast, sent.common_bytes, sent.per_client_bytes
    assert per_b == {} and common_b == state_nbytes(st.models) + 4 * len(st.indices) + 8  # models + int32 indices
    reply = worker.run_phase(0, 0, PHASE, bc.common, {}, [0, 1, 2])
    res = reply.outcomes[0].result
    assert res.payload["logits"].shape == (len(st.indices), 10) and "weights" in res.payload  # round 0: FedAvg init
    assert res.weight == len(part.train[0])
    metrics = server.step(PHASE, [reply], info).metrics
    assert {"selection_s", "distill_s", "distill_steps", "distill_steps_total", "fedavg_init"} <= set(metrics)
    assert server.state.total_steps == 4 and metrics["fedavg_init"] == 1.0
    info1 = RoundInfo(1, "train", [0, 1], [0, 1], info.num_samples)
    bc1 = server.broadcast(PHASE, info1).broadcast
    reply1 = worker.run_phase(1, 0, PHASE, bc1.common, {}, [0, 1])
    assert "weights" not in reply1.outcomes[0].result.payload  # other rounds upload logits only
    assert reply1.outcomes[0].bytes_up == 4 * 10 * len(server.state.indices)


def _fake_updates(logits, weights, states):
    return {c: ClientResult(payload={"logits": lg, **({"weights": s} if s is not None else {})}, weight=w)
            for c, (lg, w, s) in enumerate(zip(logits, weights, states))}


def test_teacher_fedavg_mirrors_and_best_mirror(make_config, monkeypatch):
    cfg = make_config(*TINY, "data.num_clients=4", "model.mix={cnn: 2, mlp: 2}",
                      "participation.clients_per_round=2")
    server, _, _ = make_pair(cfg)
    algo, st = server.algorithm, server.state
    n = len(st.indices)
    seen = {}

    def fake_distill(student, x, teacher, cfg, gen, validate=None):
        seen["teacher"], seen["x"] = teacher, x
        return {"best_score": 0.9 if "mlp" in type(student).__name__.lower() else 0.2, "loss": 0.0, "steps": 4.0}

    monkeypatch.setattr(feddf_mod, "distill", fake_distill)
    picked = []
    monkeypatch.setattr(type(algo), "select_for", lambda self, s, r: (picked.append(s.best) or (s.indices, {})))
    g = torch.Generator().manual_seed(0)
    l0, l1 = torch.randn(n, 10, generator=g), torch.randn(n, 10, generator=g)
    cnn = st.models["cnn"]
    s0 = {k: v + 1.0 if v.is_floating_point() else v for k, v in cnn.items()}
    s1 = {k: v + 4.0 if v.is_floating_point() else v for k, v in cnn.items()}
    info = RoundInfo(0, "train", [0, 1], [0, 1], {0: 30, 1: 10})
    new, _ = algo.server_step(PHASE, st, _fake_updates([l0, l1], [30.0, 10.0], [s0, s1]), info)
    torch.testing.assert_close(seen["teacher"], torch.softmax((30 * l0 + 10 * l1) / 40, dim=1))
    torch.testing.assert_close(seen["x"], algo.pool(algo.env).take(st.indices))
    for k, v in cnn.items():  # clients 0 and 1 are both cnn: sample-weighted FedAvg (3:1) of +1 and +4
        if v.is_floating_point():
            torch.testing.assert_close(new.models["cnn"][k], v + 1.75)
    for k, v in st.models["mlp"].items():  # no mlp client sampled: its mirror is unchanged
        torch.testing.assert_close(new.models["mlp"][k], v)
    assert new.best == "mlp" and picked == ["mlp"]  # the best-validated mirror drives the next selection
    info2 = RoundInfo(1, "train", [0, 1], [0, 1], {0: 30, 1: 10})  # round 2: no FedAvg init (every 5)
    newer, _ = algo.server_step(PHASE, new, _fake_updates([l0, l1], [30.0, 10.0], [s0, s1]), info2)
    for k, v in new.models["cnn"].items():
        torch.testing.assert_close(newer.models["cnn"][k], v)  # starts from the last distilled model


def test_heterogeneous_broadcast_sends_each_client_its_own_mirror(make_config):
    cfg = make_config(*TINY, "data.num_clients=4", "model.mix={cnn: 2, mlp: 2}")
    server, _, _ = make_pair(cfg)
    info = RoundInfo(0, "train", [1, 2], [1, 2], {1: 10, 2: 10})
    sent = server.broadcast(PHASE, info)
    bc, per_b = sent.broadcast, sent.per_client_bytes
    assert bc.common.models is None and set(bc.per_client[1]) == {"cnn"} and set(bc.per_client[2]) == {"mlp"}
    assert per_b[2] == state_nbytes(server.state.models["mlp"])


def test_test_half_proxy_scores_on_the_other_half(make_config):
    proxy, keep = split_test_halves(11, 0)
    assert len(proxy) == 5 and sorted(np.concatenate([proxy, keep]).tolist()) == list(range(11))
    cfg = make_config("algorithm.name=feddf", "algorithm.proxy=test_half", "algorithm.distill.steps=2")
    server, _, _ = make_pair(cfg)
    assert len(server.state.indices) == len(server.y_test) // 2  # no selection: the whole proxy half
    rows = server.evaluate().rows
    _, keep = split_test_halves(len(server.y_test), 0)
    model = toolkit.new_model(server.env, "cnn")
    model.load_state_dict(server.state.models["cnn"])
    expect = feddf_mod.evaluate_classifier(model, server.x_test[keep], server.y_test[keep])["accuracy"]
    assert rows[0]["accuracy"] == pytest.approx(expect) and rows[0]["macro_accuracy"] == rows[0]["accuracy"]


def test_config_errors_and_clipping(make_config):
    with pytest.raises(ConfigError, match="cosine_restart"):
        make_config(*TINY, "algorithm.schedule=cosine_restart", "algorithm.steps_min=10")
    net = ClippedLogits(torch.nn.Linear(2, 3), 2.5)
    out = net(torch.tensor([[10.0, -4.0]]))
    assert out.norm().item() == pytest.approx(2.5, rel=1e-5)


def test_two_rounds_end_to_end_record_server_times(make_config):
    cfg = make_config(*TINY, "algorithm.fedavg_every=2", "algorithm.fedavg_first=0", rounds=2)
    rounds = load(run(cfg))["rounds"]
    for col in ("train/selection_s", "train/distill_s", "wall_eval_s", "train/distill_steps_total"):
        assert rounds[col].notna().all()
    n = int(rounds["train/selected"].iloc[0])
    assert rounds["bytes_up"].iloc[0] == 4 * 10 * n * 4  # round 1 (no FedAvg init): 4 clients' logits only
    assert rounds["bytes_up"].iloc[1] > rounds["bytes_up"].iloc[0]  # round 2 adds the weights
    assert not math.isnan(rounds["accuracy"].iloc[-1])
