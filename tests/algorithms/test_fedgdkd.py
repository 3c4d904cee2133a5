"""FedGDKD: the LSE discriminator, generator averaging, leave-one-out teachers, catch-up and privacy of C_k.

The losses are checked on hand-picked logits whose LogSumExp is a log of an integer; the server halves
with hand-made client results; the client halves through `ClientWorker.run_phase` on digits with a tiny
generator, exactly as the runtime calls them.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fedsim.algorithms._gan import frechet_distance, synthetic_set
from fedsim.algorithms.fedgdkd import PHASES, classifier_loss, generator_loss, lse
from fedsim.configure import load_config
from fedsim.method.contract import ClientResult, RoundInfo
from fedsim.models import state_nbytes
from fedsim.runtime.server import Server
from fedsim.runtime.setup import load_data, make_partition
from fedsim.runtime.worker import ClientWorker

GAN, LOGITS, CODISTILL = PHASES
N_KD = 30  # kd_size: 3 noise rows × 10 classes


def make(tmp_path, *extra: str, num_clients: int = 4):
    cfg = load_config(None, [
        "seed=1", "data.name=digits", f"data.num_clients={num_clients}", "data.client_test=balanced",
        "data.partition.alpha=1.0", "data.partition.min_samples=5", "algorithm.name=fedgdkd",
        "algorithm.generator.nz=8", "algorithm.generator.ngf=4", "algorithm.generator.init_size=2",
        f"algorithm.kd_size={N_KD}", "algorithm.kd_epochs=1", "train.epochs=1", "train.batch_size=64",
        "train.lr=0.01", "train.momentum=0", f"model.mix={{cnn_small: 2, cnn_medium: {num_clients - 2}}}",
        f"results.root={tmp_path}", *extra])
    data = load_data(cfg)
    part = make_partition(cfg, data)
    arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
    meta = {"num_classes": 10, "mean": data.mean, "std": data.std}
    return cfg, arrays, part, meta


@pytest.fixture(autouse=True)
def one_thread():
    """The 2 CPUs are shared by parallel jobs; oversubscribed OpenMP threads spin for whole seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def new_worker(env, index: int = 0) -> ClientWorker:
    return ClientWorker(*env, index, device="cpu")


def run_round(server: Server, workers: list[ClientWorker], r: int, clients: list[int]) -> dict[str, list]:
    """One FedGDKD round through the server and workers (client c lives on worker c % len(workers))."""
    replies_by_phase = {}
    for pi, phase in enumerate(server.phases(r)):
        info = RoundInfo(r, phase.name, clients, clients, {c: 1 for c in clients})
        bc = server.broadcast(phase, info).broadcast
        replies = []
        for w, worker in enumerate(workers):
            mine = [c for c in clients if c % len(workers) == w]
            per = {c: bc.per_client[c] for c in mine if bc.per_client and c in bc.per_client}
            replies.append(worker.run_phase(r, pi, phase, bc.common, per, mine))
        server.step(phase, replies, info)
        replies_by_phase[phase.name] = replies
    return replies_by_phase


def outcomes(replies) -> dict:
    return {o.client_id: o for r in replies for o in r.outcomes}


def test_lse_discriminator_identities() -> None:
    """D = Z/(Z+1) with Z = Σ exp(l): softplus(−LSE) = −log D and softplus(LSE) = −log(1 − D)."""
    logits = torch.randn(64, 10, dtype=torch.float64) * 3
    Z = logits.exp().sum(1)
    D = Z / (Z + 1)
    torch.testing.assert_close(F.softplus(-lse(logits)), -torch.log(D))
    torch.testing.assert_close(F.softplus(lse(logits)), -torch.log(1 - D))
    torch.testing.assert_close(torch.sigmoid(lse(logits)), D)
    # real logits (0, ln 3): Z = 4, D = 4/5; class 1: CE = ln(4/3). Fake logits (ln 2, 0): Z = 3; class 0: CE = ln(3/2)
    real = torch.tensor([[0.0, math.log(3)]], dtype=torch.float64)
    fake = torch.tensor([[math.log(2), 0.0]], dtype=torch.float64)
    one, zero = torch.tensor([1]), torch.tensor([0])
    # L_G on the real-looking logits: −log(4/5) + ln(4/3) = ln(5/3)
    assert generator_loss(real, one).item() == pytest.approx(math.log(5 / 3), abs=1e-12)
    # L_C = ln(4/3) + ln(5/4) + ln(3/2) + ln(1 + 3) = ln 10
    assert classifier_loss(real, one, fake, zero).item() == pytest.approx(math.log(10), abs=1e-12)


def test_leave_one_out_teachers_and_catch_up_payload(tmp_path) -> None:
    env = make(tmp_path)
    server = Server(*env, device="cpu")
    algo = server.algorithm
    info = RoundInfo(0, "logits", [0, 1, 2], [0, 1, 2], {0: 1, 1: 1, 2: 1})
    base = torch.arange(N_KD * 10, dtype=torch.float32).view(N_KD, 10) / 100
    logits = {0: base, 1: base * 2, 2: base * 6}
    state, _ = algo.server_step(LOGITS, server.state, {c: ClientResult({"logits": v}) for c, v in logits.items()},
                                info)
    bc = algo.broadcast(CODISTILL, state, info)
    assert sorted(bc.per_client) == [0, 1, 2]
    # hand: teacher_0 = (2 + 6)/2 · base = 4·base, teacher_1 = (1 + 6)/2 · base, teacher_2 = (1 + 2)/2 · base
    for c, factor in ((0, 4.0), (1, 3.5), (2, 1.5)):
        torch.testing.assert_close(bc.per_client[c]["teacher"], base * factor)
    scored = {c: ClientResult(None, 1.0, {"personal_accuracy": 0.5, "personal_loss": 1.0, "test_samples": 10.0})
              for c in (0, 1, 2)}
    state, metrics = algo.server_step(CODISTILL, state, scored, info)
    assert metrics["personal_accuracy"] == 0.5 and state.prev.participants == [0, 1, 2]
    # next round: only client 3 (absent in round 0) gets last round's noise seed and the full-mean teacher 3·base
    nxt = algo.broadcast(GAN, state, RoundInfo(1, "gan", [1, 3], [1, 3], {1: 1, 3: 1}))
    assert list(nxt.per_client) == [3]
    torch.testing.assert_close(nxt.per_client[3]["teacher"], base * 3)
    assert nxt.per_client[3]["kd_seed"] == state.kd_seed and "generator" not in nxt.per_client[3]


def test_catch_up_fires_only_for_clients_absent_last_round(tmp_path) -> None:
    env = make(tmp_path)
    server = Server(*env, device="cpu")
    worker = new_worker(env, 0)
    first = outcomes(run_round(server, [worker], 0, [0, 1])["gan"])
    assert {c: o.result.metrics["catch_up"] for c, o in first.items()} == {0: 0.0, 1: 0.0}
    second = outcomes(run_round(server, [worker], 1, [1, 2, 3])["gan"])
    assert {c: o.result.metrics["catch_up"] for c, o in second.items()} == {1: 0.0, 2: 1.0, 3: 1.0}
    # d = 1 epoch over last round's 30 samples in batches of 32: one step, before the GAN training
    assert second[2].result.metrics["catch_up_kd_steps"] == 1.0
    assert "catch_up_kd_steps" not in second[1].result.metrics
    third = outcomes(run_round(server, [worker], 2, [0, 1, 2])["gan"])
    assert {c: o.result.metrics["catch_up"] for c, o in third.items()} == {0: 1.0, 1: 0.0, 2: 0.0}


def test_generator_average_is_sample_weighted_with_bn_buffers(tmp_path) -> None:
    env = make(tmp_path)
    server = Server(*env, device="cpu")
    init = server.state.shared["generator"]
    info = RoundInfo(0, "gan", [0, 1], [0, 1], {0: 1, 1: 1})
    bc = server.broadcast(GAN, info).broadcast
    alone = [new_worker(env).run_phase(0, 0, GAN, bc.common, {}, [c]) for c in (0, 1)]
    n = env[2].train.lengths()
    assert [r.summed.weight for r in alone] == [float(n[0]), float(n[1])]  # |D_k|
    server.step(GAN, [new_worker(env).run_phase(0, 0, GAN, bc.common, {}, [0, 1])], info)
    avg = server.state.shared["generator"]
    for key in ("l1.weight", "main.1.running_mean", "main.1.running_var", "main.1.num_batches_tracked"):
        want = sum(r.summed.totals()[f"generator/{key}"] for r in alone) / (n[0] + n[1])
        torch.testing.assert_close(avg[key], want.to(avg[key].dtype))
    assert not torch.equal(avg["main.1.running_mean"], init["main.1.running_mean"])


def test_personal_classifiers_never_leave_the_client(tmp_path) -> None:
    env = make(tmp_path)
    server = Server(*env, device="cpu")
    worker = new_worker(env, 0)
    gen_bytes = state_nbytes(server.state.shared["generator"]) + 4  # + the float32 weight counter
    for r in range(2):
        replies = run_round(server, [worker], r, [0, 1, 2, 3])
        assert all(k.startswith("generator/") for k in replies["gan"][0].summed.totals())
        assert {o.bytes_up for o in outcomes(replies["gan"]).values()} == {gen_bytes}
        assert {o.bytes_up for o in outcomes(replies["logits"]).values()} == {N_KD * 10 * 4}
        assert {o.bytes_up for o in outcomes(replies["codistill"]).values()} == {0}
        assert all(o.result.payload is None for o in outcomes(replies["codistill"]).values())
    # the classifiers persisted in the worker, trained and distinct per client (own architecture and init)
    states = worker.export_states()
    assert sorted(states) == [0, 1, 2, 3] and all(set(s) == {"model"} for s in states.values())
    assert "net.0.weight" in states[0]["model"] and not torch.equal(states[0]["model"]["net.0.weight"],
                                                                     states[1]["model"]["net.0.weight"])


def test_synthetic_set_is_identical_across_workers(tmp_path) -> None:
    """Two workers (as two Ray actors would) build the same set and, for the same client, the same logits."""
    env = make(tmp_path)
    server = Server(*env, device="cpu")
    w0, w1 = (new_worker(env, i) for i in (0, 1))
    run_round(server, [w0, w1], 0, [0, 1, 2, 3])
    info = RoundInfo(1, "logits", [0, 1], [0, 1], {0: 1, 1: 1})
    bc = server.broadcast(LOGITS, info).broadcast
    algo = server.algorithm
    sets = []
    for w in (w0, w1):
        G = w.models.get("fedgdkd/generator", build=lambda: algo.build("generator"))
        G.load_state_dict(bc.common["generator"])
        sets.append(synthetic_set(G, bc.common["kd_seed"], N_KD, 10, 8, "shared", torch.device("cpu")))
    assert torch.equal(sets[0][0], sets[1][0]) and torch.equal(sets[0][1], sets[1][1])
    assert torch.equal(sets[0][1], torch.arange(N_KD) % 10)  # class-balanced, fixed interleaved order
    w1.load_states(w0.export_states())  # client 0's classifier, hosted by the other worker too
    a = w0.run_phase(1, 1, LOGITS, bc.common, {}, [0]).outcomes[0].result.payload["logits"]
    b = w1.run_phase(1, 1, LOGITS, bc.common, {}, [0]).outcomes[0].result.payload["logits"]
    assert torch.equal(a, b)


def test_end_to_end_bytes_and_worker_count_invariance(tmp_path) -> None:
    from fedsim.results.tables import load
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import run

    tables = []
    for workers in (1, 2):
        cfg, *_ = make(tmp_path / str(workers), "rounds=2", "runtime.backend=local",
                       "participation.clients_per_round=3")
        tables.append(load(run(cfg, backend=LocalBackend(num_workers=workers))))
    cols = ["round", "phase", "client", "bytes_up", "catch_up", "loss_g", "kd_loss", "personal_accuracy"]
    c0, c1 = (t["clients"].sort_values(["round", "phase", "client"])[cols].reset_index(drop=True) for t in tables)
    assert c0.equals(c1)
    r0 = tables[0]["rounds"]
    assert list(r0["model"]) == ["personal", "personal"]
    assert np.allclose(r0["accuracy"], tables[1]["rounds"]["accuracy"])
    assert set(c0[c0.phase == "codistill"].bytes_up) == {0}


def test_internal_generator_distance_is_reported_when_asked(tmp_path) -> None:
    env = make(tmp_path, "algorithm.fid_every=1")
    server = Server(*env, device="cpu")
    run_round(server, [new_worker(env)], 0, [0, 1])
    (row,) = server.algorithm.evaluate(server.state, server.x_test, server.y_test, torch.device("cpu"))
    assert row["model"] == "personal" and np.isfinite(row["generator_fd"]) and row["generator_fd"] > 0


def test_frechet_distance() -> None:
    g = torch.Generator().manual_seed(0)
    a = torch.randn(4000, 3, generator=g, dtype=torch.float64)
    assert frechet_distance(a, a) == pytest.approx(0.0, abs=1e-8)
    # same covariance, means 2 apart in one coordinate: distance = 4
    assert frechet_distance(a, a + torch.tensor([2.0, 0, 0], dtype=torch.float64)) == pytest.approx(4.0, abs=1e-6)
