"""The FedGDKD thesis comparators: local-only, local + 5% shared, centralised, FedMD, FD + FAug, FedDTG.

Server halves are checked against hand computations on made-up client results (FedMD's plain-mean
consensus, FD's per-label leave-one-out teacher); client halves and byte accounting through the workers
and the round loop on digits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.configure import load_config
from fedsim.method.contract import ClientResult, Phase, RoundInfo
from fedsim.runtime.server import Server
from fedsim.runtime.setup import load_data, make_partition
from fedsim.runtime.worker import ClientWorker

SHARE, TRAIN = "share", "train"  # phase names; each algorithm names its own handlers
FAST = {"local_only": ["algorithm.pretrain_epochs=2"], "local_shared": ["algorithm.pretrain_epochs=2"],
        "centralised": ["algorithm.pretrain_epochs=1"],
        "fedmd": ["algorithm.pretrain_public_epochs=2", "algorithm.digest_epochs=1", "algorithm.revisit_epochs=1"],
        "fd_faug": ["algorithm.faug_epochs=3", "algorithm.faug_samples=50", "algorithm.generator.nz=8",
                    "algorithm.generator.ngf=4", "algorithm.generator.init_size=2"],
        "feddtg": ["algorithm.kd_size=40", "algorithm.kd_epochs=1", "algorithm.generator.nz=8",
                   "algorithm.generator.ngf=4", "algorithm.generator.init_size=2"]}


@pytest.fixture(autouse=True)
def one_thread():
    """The 2 CPUs are shared by parallel jobs; oversubscribed OpenMP threads spin for whole seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def overrides(tmp_path, algorithm: str, *extra: str) -> list[str]:
    return ["seed=2", "data.name=digits", "data.num_clients=4", "data.client_test=balanced",
            "data.partition.alpha=0.5", "data.partition.min_samples=5", "model.mix={cnn_small: 2, cnn_medium: 2}",
            "train.lr=0.01", "train.momentum=0", "train.epochs=1", "train.batch_size=64", "runtime.backend=local",
            f"results.root={tmp_path}", f"algorithm.name={algorithm}", *FAST[algorithm], *extra]


def make(tmp_path, algorithm: str, *extra: str):
    cfg = load_config(None, overrides(tmp_path, algorithm, *extra))
    data = load_data(cfg)
    arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
    return cfg, arrays, make_partition(cfg, data), {"num_classes": 10, "mean": data.mean, "std": data.std}


def info(r: int, phase: Phase, clients: list[int]) -> RoundInfo:
    return RoundInfo(r, phase.name, clients, clients, {c: 1 for c in clients})


def phase_of(algo, name: str, round: int = 0) -> Phase:
    """The algorithm's phase called `name` in `round`."""
    return next(p for p in algo.phases(round) if p.name == name)


def step(server: Server, worker: ClientWorker, r: int, phase_index: int, name: str, clients: list[int]):
    phase = phase_of(server.algorithm, name, r)
    sent = server.broadcast(phase, info(r, phase, clients))
    bc, per_bytes = sent.broadcast, sent.per_client_bytes
    per = {c: bc.per_client[c] for c in clients if bc.per_client and c in bc.per_client}
    reply = worker.run_phase(r, phase_index, phase, bc.common, per, clients)
    server.step(phase, [reply], info(r, phase, clients))
    return reply, per_bytes


@pytest.mark.parametrize("algorithm", sorted(FAST))
def test_runs_and_reports_the_sample_weighted_personal_mean(tmp_path, algorithm: str) -> None:
    from fedsim.results.tables import load
    from fedsim.runtime.loop import run

    out = load(run(load_config(None, overrides(tmp_path, algorithm, "rounds=2", "participation.clients_per_round=3"))))
    rounds, clients = out["rounds"], out["clients"]
    assert list(rounds["model"]) == ["personal", "personal"]
    scored = clients.dropna(subset=["personal_accuracy"])
    for r in (0, 1):  # latest score of every client scored so far, weighted by its test-shard size
        last = scored[scored["round"] <= r].sort_values("round").groupby("client").last()
        want = (last.personal_accuracy * last.test_samples).sum() / last.test_samples.sum()
        assert rounds.loc[rounds["round"] == r, "accuracy"].item() == pytest.approx(want, abs=1e-12)
    if algorithm in ("local_only",):
        assert clients["bytes_up"].sum() == 0 and clients["bytes_down"].sum() == 0


def test_local_only_pretrains_once_and_keeps_its_model(tmp_path) -> None:
    env = make(tmp_path, "local_only")
    server, worker = Server(*env, device="cpu"), ClientWorker(*env, 0, device="cpu")
    first, _ = step(server, worker, 0, 0, TRAIN, [0, 1])
    second, _ = step(server, worker, 1, 0, TRAIN, [0, 1])
    n = env[2].train.lengths()
    for o in first.outcomes:  # 2 pre-training epochs + 1 epoch, in batches of 64
        assert o.result.metrics["pretrain_steps"] == 2 * np.ceil(n[o.client_id] / 64)
        assert o.bytes_up == 0
    assert all("pretrain_steps" not in o.result.metrics for o in second.outcomes)
    assert set(worker.export_states()) == {0, 1}


def test_shared_pool_is_the_union_of_shares_sent_once(tmp_path) -> None:
    env = make(tmp_path, "local_shared")
    server, worker = Server(*env, device="cpu"), ClientWorker(*env, 0, device="cpu")
    part, x_train = env[2], torch.as_tensor(env[1]["x_train"])
    share, _ = step(server, worker, 0, 0, SHARE, [0, 1, 2, 3])
    n = part.train.lengths()
    sizes = [max(1, round(0.05 * k)) for k in n]
    pool = server.state.pool
    assert len(pool["y"]) == sum(sizes)
    start = 0
    for c, k in enumerate(sizes):  # client-id order; each share is drawn from the client's own samples
        own = x_train[torch.as_tensor(part.train[c])].flatten(1)
        rows = pool["x"][start:start + k].flatten(1)
        assert all((own == row).all(1).any() for row in rows)
        start += k
    assert [o.bytes_up for o in share.outcomes] == [k * (64 * 4 + 8) for k in sizes]  # 1×8×8 float32 + int64
    _, sent = step(server, worker, 0, 1, TRAIN, [0, 1])
    assert sent == {0: sum(sizes) * (64 * 4 + 8), 1: sum(sizes) * (64 * 4 + 8)}
    _, sent = step(server, worker, 1, 0, TRAIN, [0, 1, 2])
    assert sent == {2: sum(sizes) * (64 * 4 + 8)}  # only the client that has not received it yet


def test_centralised_trains_on_the_pool_of_all_training_data(tmp_path) -> None:
    env = make(tmp_path, "centralised", "algorithm.pretrain_epochs=0")
    server, worker = Server(*env, device="cpu"), ClientWorker(*env, 0, device="cpu")
    step(server, worker, 0, 0, SHARE, [0, 1, 2, 3])
    total = int(env[2].train.lengths().sum())
    assert len(server.state.pool["y"]) == total
    reply, _ = step(server, worker, 0, 1, TRAIN, [0])
    assert reply.outcomes[0].result.metrics["steps"] == np.ceil(total / 64)


def test_fedmd_consensus_is_the_plain_mean(tmp_path) -> None:
    env = make(tmp_path, "fedmd")
    server = Server(*env, device="cpu")
    algo = server.algorithm
    state = server.state
    state.pool = {"x": torch.zeros(3, 1, 8, 8), "y": torch.tensor([0, 1, 2])}
    base = torch.arange(30, dtype=torch.float32).view(3, 10)
    results = {0: base, 1: 2 * base, 2: 6 * base}
    logits = phase_of(algo, "logits")
    state, metrics = algo.server_step(logits, state, {c: ClientResult({"logits": v}) for c, v in results.items()},
                                      info(0, logits, [0, 1, 2]))
    bc = algo.broadcast(phase_of(algo, "digest"), state, info(0, logits, [0, 1, 2]))
    torch.testing.assert_close(bc.common["consensus"], 3 * base)  # (1 + 2 + 6)/3, no leave-one-out
    assert bc.per_client is None
    assert metrics["consensus_public_accuracy"] == 0.0  # argmax is class 9 for every row


def test_fd_teacher_is_the_per_label_leave_one_out_mean(tmp_path) -> None:
    env = make(tmp_path, "fd_faug")
    server = Server(*env, device="cpu")
    algo = server.algorithm
    eye = torch.eye(10)
    uploads = {0: eye, 1: 2 * eye, 2: 6 * eye}
    train = phase_of(algo, TRAIN, 1)
    state, _ = algo.server_step(train, server.state,
                                {c: ClientResult({"label_logits": v}, 1.0,
                                                 {"personal_accuracy": 0.5, "personal_loss": 1.0,
                                                  "test_samples": 10.0}) for c, v in uploads.items()},
                                info(0, train, [0, 1, 2]))
    bc = algo.broadcast(train, state, info(1, train, [0, 1, 2, 3]))
    for c, want in ((0, 4.0), (1, 3.5), (2, 1.5), (3, 3.0)):  # client 3 has no upload: mean of all three
        torch.testing.assert_close(bc.per_client[c]["teacher"], want * eye)


def test_fd_faug_trains_the_gan_on_the_shares_and_sends_it_once(tmp_path) -> None:
    env = make(tmp_path, "fd_faug")
    server, worker = Server(*env, device="cpu"), ClientWorker(*env, 0, device="cpu")
    step(server, worker, 0, 0, SHARE, [0, 1, 2, 3])
    g_bytes = sum(t.numel() * t.element_size() for t in server.state.extra["faug_generator"].values())
    reply, sent = step(server, worker, 0, 1, TRAIN, [0, 1])
    assert sent == {0: g_bytes + 8, 1: g_bytes + 8}  # generator + its noise seed; no teacher in round 0
    assert {o.bytes_up for o in reply.outcomes} == {10 * 10 * 4}  # c×c per-label average logits only
    assert all("fd_loss" not in o.result.metrics for o in reply.outcomes)
    reply, sent = step(server, worker, 1, 0, TRAIN, [0, 1])
    assert sent == {0: 400, 1: 400} and all("fd_loss" in o.result.metrics for o in reply.outcomes)


def test_feddtg_averages_generator_and_discriminator_uniformly_without_catch_up(tmp_path) -> None:
    env = make(tmp_path, "feddtg")
    server, worker = Server(*env, device="cpu"), ClientWorker(*env, 0, device="cpu")
    phases = server.phases(0)
    gan_phases = 0
    for r, clients in ((0, [0, 1]), (1, [1, 2])):
        for pi, phase in enumerate(phases):
            reply, sent = step(server, worker, r, pi, phase.name, clients)
            if phase.name == "gan":
                gan_phases += 1
                assert reply.summed.weight == 2.0 and reply.summed.count == 2  # uniform 1/|S_t|
                keys = reply.summed.totals()
                assert any(k.startswith("discriminator/") for k in keys)
                assert all(k.split("/")[0] in ("generator", "discriminator") for k in keys)
                assert sent == {}  # no catch-up payload, not even for client 2 in round 1
    assert gan_phases == 2  # one GAN phase a round: the checks above ran
