"""DOSFL's client and server halves on a linear softmax model over 2×2 inputs (3 classes, 3 clients).

The server half is checked against a NumPy transcription of the paper's merge: the uploaded steps are
interleaved by step index (d_1^1, d_1^2, d_1^3, d_2^1, ...), repeated E_d times, and each is one plain SGD
step θ ← θ − η̃ ∇θ CE at that step's own learned lr, starting from θ0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.contract import RoundInfo
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker
from tests.algorithms.linear_model import register_linear


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """Unrolled meta-gradients are thousands of tiny ops: one thread avoids OpenMP stalls on busy machines."""
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(old)


register_linear("dosfl_linear_test")

RNG = np.random.default_rng(0)
X = RNG.standard_normal((12, 1, 2, 2)).astype(np.float32)
Y = np.array([0, 1, 2, 0, 1, 2, 0, 1, 2, 0, 1, 2])
PARTS = [np.arange(0, 4), np.arange(4, 8), np.arange(8, 12)]
TINY = ["algorithm.distill_steps=2", "algorithm.distill_batch=3", "algorithm.distill_epochs=2",
        "algorithm.epochs=3", "algorithm.batch_size=4"]


def setup(*extra: str, workers: int = 1):
    cfg = load_config(None, ["data.num_clients=3", "model.name=dosfl_linear_test", "algorithm.name=dosfl",
                             "seed=5", *TINY, *extra])
    arrays = {"x_train": X, "y_train": Y, "x_test": X, "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 3), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    server = Server(cfg, arrays, part, meta, device="cpu")
    return cfg, server, [ClientWorker(cfg, arrays, part, meta, i, device="cpu") for i in range(workers)]


def info(phase: str, arrived=(0, 1, 2)) -> RoundInfo:
    return RoundInfo(0, phase, [0, 1, 2], list(arrived), {0: 4, 1: 4, 2: 4})


def run_parallel(server, workers, clients=((0, 1, 2),)):
    phase = server.phases(0)[0]
    bc = server.broadcast(phase, info(phase.name)).broadcast
    replies = [w.run_phase(0, 0, phase, bc.common, bc.per_client or {}, list(c)) for w, c in zip(workers, clients)]
    return phase, replies


def test_same_init_seed_gives_bitwise_identical_theta0_on_every_worker() -> None:
    """Clients on different workers rebuild θ0 from the broadcast seed: the same bytes as the server's θ0."""
    cfg, server, workers = setup(workers=2)
    _, replies = run_parallel(server, workers, clients=((0, 2), (1,)))
    hashes = {o.client_id: o.result.metrics["theta0_hash"] for r in replies for o in r.outcomes}
    assert len(hashes) == 3 and len(set(hashes.values())) == 1
    algo = server.algorithm
    theta_server = server.state.models["dosfl_linear_test"]
    seed = server.state.extra["init_seed"]
    m1, m2 = workers[0].models.get("dosfl_linear_test"), workers[1].models.get("dosfl_linear_test")
    with torch.no_grad():
        m2.fc.weight.add_(1.0)  # a reused model instance that was trained before must not matter
    for a, b in ((algo.theta0(m1, seed), theta_server), (algo.theta0(m2, seed), theta_server)):
        assert all(torch.equal(a[k], b[k]) for k in b)
    assert torch.equal(theta_server["fc.bias"], torch.zeros(3))
    other = algo.theta0(m1, seed + 1)
    assert not torch.equal(other["fc.weight"], theta_server["fc.weight"])


def test_client_uploads_steps_labels_and_lrs() -> None:
    cfg, server, (worker,) = setup()
    _, (reply,) = run_parallel(server, [worker])
    out = reply.outcomes[0]
    pl = out.result.payload
    assert pl["x"].shape == (2, 3, 1, 2, 2) and pl["x"].dtype == torch.float32
    assert pl["y"].tolist() == [[0, 1, 2], [0, 1, 2]]  # class-balanced hard labels
    assert pl["lr"].shape == (2,) and torch.all(pl["lr"] > 0)
    assert out.bytes_up == 2 * 3 * 4 * 4 + 2 * 3 * 8 + 2 * 4  # inputs + int64 labels + lrs
    m = out.result.metrics
    assert m["scalars"] == 24 and m["meta_iterations"] == 3  # 4 samples, B=4: one iteration per epoch
    _, _, (w2,) = setup("algorithm.soft_labels=true", "algorithm.lr_per=unrolled")
    _, (r2,) = run_parallel(server, [w2])
    assert r2.outcomes[0].result.payload["y"].shape == (2, 3, 3)
    assert r2.outcomes[0].result.payload["lr"].shape == (4,)
    _, _, (w3,) = setup("algorithm.upload_labels=false")
    _, (r3,) = run_parallel(server, [w3])
    assert "y" not in r3.outcomes[0].result.payload


def numpy_server(theta, payloads, steps, epochs, lr_per):
    W, b = theta["fc.weight"].double().numpy().copy(), theta["fc.bias"].double().numpy().copy()
    for e in range(epochs):
        for j in range(steps):
            for pl in payloads:
                x = pl["x"][j].double().reshape(len(pl["x"][j]), -1).numpy()
                y = pl["y"][j].numpy()
                lr = float(pl["lr"][j if lr_per == "step" else e * steps + j])
                z = x @ W.T + b
                p = np.exp(z - z.max(1, keepdims=True))
                p /= p.sum(1, keepdims=True)
                g = (p - np.eye(3)[y]) / len(y)
                W, b = W - lr * g.T @ x, b - lr * g.sum(0)
    return W, b


@pytest.mark.parametrize("lr_per", ["step", "unrolled"])
def test_server_interleaves_by_step_index_with_each_steps_lr(lr_per: str) -> None:
    """Only clients 0 and 2 arrive; the server trains θ0 on d_1^0, d_1^2, d_2^0, d_2^2, ... (×E_d)."""
    cfg, server, (worker,) = setup(f"algorithm.lr_per={lr_per}")
    theta0 = dict(server.state.models["dosfl_linear_test"])
    phase, (reply,) = run_parallel(server, [worker], clients=((0, 2),))
    seq = server.algorithm.sequence([o.result.payload for o in reply.outcomes], torch.device("cpu"))
    assert [round(float(s[2]), 7) for s in seq[:4]] == [round(float(reply.outcomes[c].result.payload["lr"][j]), 7)
                                                       for j, c in ((0, 0), (0, 1), (1, 0), (1, 1))]
    metrics = server.step(phase, [reply], info(phase.name, arrived=(0, 2))).metrics
    assert {k: v for k, v in metrics.items() if "mech_" not in k} == {"clients": 2.0, "scalars": 48.0}
    W, b = numpy_server(theta0, [o.result.payload for o in reply.outcomes], 2, 2, lr_per)
    new = server.state.models["dosfl_linear_test"]
    np.testing.assert_allclose(new["fc.weight"].numpy(), W, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(new["fc.bias"].numpy(), b, rtol=1e-5, atol=1e-6)
    assert server.finished(0)
    assert [r["model"] for r in server.evaluate().rows] == ["dosfl_linear_test"]


def test_client_step_is_seeded_and_resets_change_it() -> None:
    cfg, server, (w,) = setup()
    _, (a,) = run_parallel(server, [w])
    _, (b,) = run_parallel(server, [w])
    assert torch.equal(a.outcomes[1].result.payload["x"], b.outcomes[1].result.payload["x"])
    assert not torch.equal(a.outcomes[0].result.payload["x"], a.outcomes[1].result.payload["x"])
    for extra in (["algorithm.reset=soft", "algorithm.soft_reset_var=0.01"], ["algorithm.reset=hard"],
                  ["algorithm.mask_p=0.5"]):
        _, _, (w2,) = setup(*extra)
        _, (c,) = run_parallel(server, [w2])
        assert not torch.equal(a.outcomes[1].result.payload["x"], c.outcomes[1].result.payload["x"]), extra


def test_serial_mode_runs_one_phase_per_client_against_the_updated_model() -> None:
    cfg, server, (w,) = setup("algorithm.mode=serial", "algorithm.serial_curve=true")
    phases = server.phases(0)
    assert [p.name for p in phases] == ["serial0", "serial1", "serial2"]
    order, models = [], [server.state.models["dosfl_linear_test"]]
    for i, phase in enumerate(phases):
        sent = server.broadcast(phase, info(phase.name))
        bc, per_bytes = sent.broadcast, sent.per_client_bytes
        cid = bc.common["selected"]
        assert cid not in order
        if i == 0:
            assert bc.per_client is None  # the first client rebuilds θ0 from the seed
        else:
            assert list(bc.per_client) == [cid] and per_bytes[cid] == 4 * (3 * 4 + 3)
        (reply,) = [w.run_phase(0, i, phase, bc.common, bc.per_client or {}, [0, 1, 2])]
        by = {o.client_id: o for o in reply.outcomes}
        assert [c for c, o in by.items() if o.result.payload is not None] == [cid]
        assert all(by[c].result.metrics == {"skipped": 1.0} and by[c].bytes_up == 0 for c in by if c != cid)
        from fedsim.algorithms.dosfl import theta_hash

        assert by[cid].result.metrics["theta0_hash"] == theta_hash(dict(models[-1]))  # distilled for θ_current
        server.step(phase, [reply], info(phase.name))
        order.append(cid)
        models.append(server.state.models["dosfl_linear_test"])
        assert not torch.equal(models[-1]["fc.weight"], models[-2]["fc.weight"])
    assert sorted(order) == [0, 1, 2] and server.state.extra["done"] == order
    rows = server.evaluate().rows
    assert [r["model"] for r in rows] == ["dosfl_linear_test", "after_1", "after_2", "after_3"]
    assert rows[0]["accuracy"] == rows[3]["accuracy"]


def test_soft_labels_must_be_uploaded() -> None:
    with pytest.raises(ConfigError, match="upload_labels"):
        load_config(None, ["algorithm.name=dosfl", "algorithm.soft_labels=true", "algorithm.upload_labels=false"])
    with pytest.raises(ConfigError, match="mask_p"):
        load_config(None, ["algorithm.name=dosfl", "algorithm.mask_p=1.0"])


def one_shot_config(tmp_path):
    """Digits through LeNet, 3 clients, rounds=4: DOSFL stops after round 0 all the same."""
    return load_config(None, ["data.name=digits", "data.num_clients=3", "data.partition.kind=shards",
                              "model.name=lenet", "algorithm.name=dosfl", *TINY, "algorithm.batch_size=512",
                              "runtime.backend=local", "rounds=4", f"results.root={tmp_path}"])


def test_one_round_end_to_end_records_the_payload_bytes(tmp_path) -> None:
    """rounds=4 still stops after round 0; bytes_up is the distilled data of the 3 clients."""
    from fedsim.results.tables import load
    from fedsim.runtime.loop import run

    res = load(run(one_shot_config(tmp_path)))
    rounds = res["rounds"]
    assert len(rounds) == 1 and rounds["round"].tolist() == [0]
    assert rounds["bytes_up"].iloc[0] == 3 * (2 * 3 * 64 * 4 + 2 * 3 * 8 + 2 * 4)
    assert rounds["bytes_down"].iloc[0] == 3 * 8  # the init seed only
    assert rounds["distill/scalars"].iloc[0] == 3 * 2 * 3 * 64
    assert 0 <= rounds["accuracy"].iloc[0] <= 1


def test_a_resumed_one_shot_run_trains_no_further_round(tmp_path) -> None:
    """A finished DOSFL run resumed (say, to add rounds) stays at its one round: the method has finished."""
    import pandas as pd

    from fedsim.results.tables import load
    from fedsim.runtime.loop import run

    run_dir = run(one_shot_config(tmp_path))
    before = load(run_dir)
    assert run(resume=run_dir) == run_dir
    after = load(run_dir)
    assert after["rounds"]["round"].tolist() == [0]
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(before[table], after[table])


def test_text_run_distils_sentences_after_the_embedding(tmp_path) -> None:
    """TextCNN over a generated GloVe file: clients upload continuous L×D sentences and soft label logits."""
    from fedsim.results.tables import load
    from fedsim.runtime.loop import run

    words = ["good", "great", "fine", "bad", "awful", "poor", "the", "movie"]
    rng = np.random.default_rng(0)
    (tmp_path / "glove.txt").write_text("".join(f"{w} " + " ".join(f"{v:.3f}" for v in rng.standard_normal(3))
                                                + "\n" for w in words))
    lines = [f"{int(i % 2)}\tthe movie {words[(i % 2) * 3 + i % 3]} {words[(i % 2) * 3 + (i + 1) % 3]}"
             for i in range(24)]
    (tmp_path / "train.tsv").write_text("\n".join(lines[:16]))
    (tmp_path / "test.tsv").write_text("\n".join(lines[16:]))
    glove = str(tmp_path / "glove.txt")
    cfg = load_config(None, ["data.name=text_tsv", f"data.options={{train: {tmp_path / 'train.tsv'}, "
                             f"test: {tmp_path / 'test.tsv'}, embedding: {glove}, max_len: 6}}",
                             "data.num_clients=2", "data.partition.kind=iid", "data.val_fraction=0",
                             "model.name=textcnn", f"model.options={{embedding: {glove}, filters: 4}}",
                             "algorithm.name=dosfl", "algorithm.distill_steps=2", "algorithm.distill_batch=1",
                             "algorithm.distill_epochs=1", "algorithm.epochs=2", "algorithm.soft_labels=true",
                             "runtime.backend=local", "rounds=1", f"results.root={tmp_path / 'res'}"])
    res = load(run(cfg))
    per_client = 2 * 1 * 6 * 3 * 4 + 2 * 1 * 2 * 4 + 2 * 4  # sentences L×D, label logits, lrs (float32)
    assert res["rounds"]["bytes_up"].iloc[0] == 2 * per_client
    assert res["clients"]["scalars"].tolist() == [36.0, 36.0]
