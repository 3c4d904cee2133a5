"""Async mode (participation.mode: async; fedsim.runtime.async_run) with FedAsync and FedBuff: the event order on a
hand-made schedule, FedAsync's mixing weights against hand formulas, FedBuff with K = C and equal durations against
synchronous FedAvg, worker-count invariance, an exact resume, and the bad inputs through the CLI."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.algorithms.fedasync import FedAsync, FedAsyncParams
from fedsim.algorithms.fedbuff import FedBuff, FedBuffParams
from fedsim.method import ClientResult, GlobalModels, Phase, as_summable
from fedsim.method.asynchronous import NEW_VERSION, Arrival, staleness_weight
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.async_run import FreeClients
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_resume_methods import StopAfter, ordered
from tests.runtime.test_worker_count import comparable

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py

ASYNC = ["participation.mode=async", "model.name=mlp", "train.steps=1", "train.batch_size=10"]


def trace(tmp_path, seconds: list[float]) -> str:
    """A device trace whose clients compute for `seconds` (train.steps=1 of 10 samples at 0.01 s a sample at speed
    1), on links so fast that a message takes ~1e-10 s."""
    path = tmp_path / "trace.csv"
    path.write_text("client,speed,bandwidth_mbps\n" + "".join(f"{i},{0.1 / s!r},1e9\n" for i, s in enumerate(seconds)))
    return str(path)


@pytest.mark.parametrize(("kind", "s", "expected"), [
    ("constant", 7, 1.0), ("polynomial", 0, 1.0), ("polynomial", 3, 4 ** -0.5), ("hinge", 4, 1.0),
    ("hinge", 6, 1 / (0.5 * 2 + 1))])
def test_staleness_functions_are_the_papers(kind, s, expected) -> None:
    assert staleness_weight(kind, s, 0.5, 4) == pytest.approx(expected, rel=1e-15)


def test_fedasync_mixes_each_arrival_with_alpha_times_s_from_the_base_alpha() -> None:
    params = FedAsyncParams(staleness="hinge", a=10.0, b=1.0, alpha=0.8)
    algo = FedAsync(params, None)  # type: ignore[arg-type]  # the server step needs no environment
    g = torch.Generator().manual_seed(0)
    x = {"w": torch.randn(3, 2, generator=g), "n": torch.tensor(5)}
    state = GlobalModels({"m": x})
    phase = Phase("train", "each")
    expected = x["w"].double().numpy()
    for staleness in (0, 3, 3):  # the same staleness twice: the same α both times (Plato would decay it)
        y = {"w": torch.randn(3, 2, generator=g), "n": torch.tensor(7)}
        info = Arrival(0, "train", [1], [1], {1: 5}, staleness=staleness)
        state, metrics = algo.server_step(phase, state, {1: ClientResult(payload=as_summable("m", y))}, info)
        alpha = 0.8 * (1.0 if staleness <= 1 else 1 / (10 * (staleness - 1) + 1))
        expected = (1 - alpha) * expected + alpha * y["w"].double().numpy()
        assert metrics == {NEW_VERSION: 1, "alpha": pytest.approx(alpha, rel=1e-15)}
        np.testing.assert_allclose(state.models["m"]["w"].numpy(), expected, rtol=1e-6)
        assert int(state.models["m"]["n"]) == 7


def test_fedbuff_steps_after_k_arrivals_along_the_weighted_mean_update() -> None:
    algo = FedBuff(FedBuffParams(buffer_size=2, server_lr=0.5), None)  # type: ignore[arg-type]
    x = torch.tensor([1.0, 2.0])
    state = GlobalModels({"m": {"w": x}})
    d1, d2 = torch.tensor([0.5, -1.0], dtype=torch.float64), torch.tensor([2.0, 4.0], dtype=torch.float64)
    phase = Phase("train", "each")
    state, m1 = algo.server_step(phase, state, {0: ClientResult(payload=as_summable("m", {"w": d1}))},
                                 Arrival(0, "train", [0], [0], {}, staleness=0))
    assert m1[NEW_VERSION] == 0 and torch.equal(state.models["m"]["w"], x)
    state, m2 = algo.server_step(phase, state, {3: ClientResult(payload=as_summable("m", {"w": d2}))},
                                 Arrival(0, "train", [3], [3], {}, staleness=3))
    assert m2[NEW_VERSION] == 1
    mean = (d1 + d2 / 2.0) / 2  # s(3) = 1/sqrt(4); the buffer is divided by K, not by the weights' sum
    np.testing.assert_allclose(state.models["m"]["w"].numpy(), (x.double() + 0.5 * mean).numpy(), rtol=1e-7)
    assert "buffer" not in state.extra


def test_arrivals_follow_the_clock_ties_by_client_id_and_replacements_start_after_the_instant(tmp_path,
                                                                                              make_config) -> None:
    """Four clients all in flight (C = N), computing 1, 2, 2 and 3.5 s: client 0 arrives at 1, clients 1 and 2
    together at 2 (1 first), client 0 again at 2 and 3, client 3 at 3.5, clients 1 and 2 again at 4. Clients 1 and 2
    are dispatched again at 2 only after both arrivals are applied, so from version 3."""
    cfg = make_config(*ASYNC, "algorithm.name=fedasync", "algorithm.staleness=hinge", "algorithm.a=2",
                      "algorithm.b=1", "data.num_clients=4", "participation.concurrency=4",
                      f"stragglers.trace={trace(tmp_path, [1.0, 2.0, 2.0, 3.5])}", "eval.every=4", rounds=8)
    t = load(run(cfg, LocalBackend()))
    clients, rounds = t["clients"], t["rounds"]
    assert clients["round"].tolist() == list(range(8)) and rounds["round"].tolist() == list(range(8))
    assert clients["client"].tolist() == [0, 1, 2, 0, 0, 3, 1, 2]
    assert clients["start_version"].tolist() == [0, 0, 0, 1, 4, 0, 3, 3]
    assert clients["staleness"].tolist() == [0, 1, 2, 2, 0, 5, 3, 4]
    np.testing.assert_allclose(clients["arrival_time"], [1, 2, 2, 2, 3, 3.5, 4, 4], atol=1e-6)
    np.testing.assert_allclose(clients["dispatch_time"], [0, 0, 0, 1, 2, 0, 2, 2], atol=1e-6)
    assert (clients["status"] == "ok").all()
    np.testing.assert_array_equal(rounds["virtual_time"], clients["arrival_time"])
    assert rounds["updates"].tolist() == [1] * 8
    np.testing.assert_array_equal(rounds["staleness_max"], clients["staleness"].astype(float))
    # α_t = α·s(staleness), from the base α = 0.6 every time (hinge a = 2, b = 1)
    hinge = [1.0 if s <= 1 else 1 / (2 * (s - 1) + 1) for s in clients["staleness"]]
    np.testing.assert_allclose(rounds["train/alpha"], 0.6 * np.array(hinge), rtol=1e-15)
    assert rounds["accuracy"].notna().tolist() == [False, False, False, True] * 2  # eval.every=4


def test_fedbuff_with_k_equal_c_and_equal_durations_is_fedavg_with_uniform_weights(tmp_path, make_config) -> None:
    """Every client in flight, K = C = N, all computing 1 s: each version is one synchronous round (the same clients,
    start model and seeds). The client's float64 update and FedAvg's double-double sum of models both round the
    exact mean once to float32, so the models agree bit for bit (they could differ by one float32 rounding only
    where the float64 mean lies within 2^-29 ulp of a float32 tie)."""
    common = ["data.num_clients=4", "participation.clients_per_round=4", "model.name=mlp", "train.steps=2",
              "train.batch_size=10", f"stragglers.trace={trace(tmp_path, [1.0] * 4)}", "results.checkpoint_every=1"]
    sync = run(make_config(*common, "algorithm.weighting=uniform", "results.run_id=sync"), LocalBackend())
    buff = run(make_config(*common, "participation.mode=async", "algorithm.name=fedbuff", "algorithm.buffer_size=4",
                           "algorithm.staleness=constant", "results.run_id=buff"), LocalBackend())
    a, b = load(sync), load(buff)
    assert b["rounds"]["updates"].tolist() == [4, 4, 4] and (b["clients"]["staleness"] == 0).all()
    pd.testing.assert_series_equal(a["rounds"]["accuracy"], b["rounds"]["accuracy"])
    pd.testing.assert_series_equal(a["rounds"]["loss"], b["rounds"]["loss"])
    ma = load_run_checkpoint(sync / "checkpoints" / "last.pt")["server_state"].models
    mb = load_run_checkpoint(buff / "checkpoints" / "last.pt")["server_state"].models
    assert ma.keys() == mb.keys()
    for arch in ma:
        for k, v in ma[arch].items():
            assert torch.equal(v, mb[arch][k]), k
    sync_loss = a["clients"].sort_values(["round", "client"])["train_loss"].to_numpy()
    buff_loss = b["clients"].sort_values(["round", "client"])["train_loss"].to_numpy()
    np.testing.assert_array_equal(sync_loss, buff_loss)  # the same local training, client by client


def test_dispatch_draws_online_clients_waits_for_one_and_an_update_whose_client_leaves_is_lost(tmp_path,
                                                                                                   make_config) -> None:
    """Availability over time in async mode, every client computing 1 s, 3 in flight: clients 0 and 2 are always
    online, client 1 only until 0.5 s, client 3 only from 5 s. At 0 the three online clients are dispatched; client
    1 leaves before it arrives (at 1): recorded offline, never trained, applied to nothing. Its replacement waits
    until a client not in flight is online, and client 3 is first dispatched at 5."""
    avail = tmp_path / "online.csv"
    avail.write_text("client,start,end\n0,0,1000\n1,0,0.5\n2,0,1000\n3,5,1000\n")
    cfg = make_config(*ASYNC, "algorithm.name=fedasync", "data.num_clients=4", "participation.concurrency=3",
                      f"participation.availability={avail}", f"stragglers.trace={trace(tmp_path, [1.0] * 4)}",
                      "eval.every=100", rounds=12)
    t = load(run(cfg, LocalBackend()))
    clients, rounds = t["clients"], t["rounds"]
    lost = clients[clients["status"] == "offline"]
    assert lost["client"].tolist() == [1] and lost["dispatch_time"].tolist() == [0.0]
    assert lost["bytes_up"].tolist() == [0] and "train_loss" not in lost.dropna(axis=1).columns  # never trained
    ok = clients[clients["status"] == "ok"]
    assert len(ok) == len(rounds) == 12 and rounds["updates"].tolist() == [1] * 12  # one version per update
    assert rounds["offline"].sum() == 1
    first = clients.groupby("client")["dispatch_time"].min()
    np.testing.assert_allclose(first.to_numpy(), [0, 0, 0, 5], atol=1e-9)
    before5 = clients[clients["dispatch_time"] < 5]
    assert set(before5["client"]) == {0, 1, 2} and (clients[clients["client"] == 1]["dispatch_time"] == 0).all()


def test_fewer_clients_online_at_the_start_than_in_flight_dispatch_the_rest_when_one_is(tmp_path,
                                                                                       make_config) -> None:
    """4 in flight asked, 3 online at 0: those 3 start at 0 (the start once drew from no one and raised); the fourth
    dispatch waits for a client outside the flight to be online, and client 3, online from 5, starts no earlier."""
    avail = tmp_path / "online.csv"
    avail.write_text("client,start,end\n0,0,1000\n1,0,1000\n2,0,1000\n3,5,1000\n")
    cfg = make_config(*ASYNC, "algorithm.name=fedasync", "data.num_clients=4", "participation.concurrency=4",
                      f"participation.availability={avail}", f"stragglers.trace={trace(tmp_path, [1.0] * 4)}",
                      "eval.every=100", rounds=10)
    clients = load(run(cfg, LocalBackend()))["clients"]
    assert sorted(clients[clients["dispatch_time"] == 0]["client"]) == [0, 1, 2]
    assert (clients[clients["client"] == 3]["dispatch_time"] >= 5).all() and (clients["status"] == "ok").all()


@pytest.mark.parametrize("n", [1, 2, 7, 64, 1000])
def test_the_free_clients_kth_is_a_sorted_lists_through_takes_and_puts(n) -> None:
    """FreeClients (a Fenwick tree, O(log N) a dispatch) against the sorted list it replaces, whose k-th client the
    dispatch draws: the same k-th after any sequence of clients taken into flight and put back."""
    free, ref = FreeClients(n), list(range(n))
    rng = np.random.default_rng(n)
    for _ in range(500):
        out = sorted(set(range(n)) - set(ref))
        if ref and (not out or rng.random() < 0.5):
            c = ref[rng.integers(len(ref))]
            free.take(c)
            ref.remove(c)
        else:
            c = out[rng.integers(len(out))]
            free.put(c)
            ref = sorted([*ref, c])
        every = max(1, len(ref) // 16)
        assert len(free) == len(ref) and [free.kth(k) for k in range(0, len(ref), every)] == ref[::every]


FEDBUFF = [*ASYNC, "algorithm.name=fedbuff", "algorithm.buffer_size=2", "participation.concurrency=4",
           "algorithm.server_opt=adam", "algorithm.server_lr=0.05", "participation.availability=0.7"]


def test_one_and_two_workers_give_the_same_tables(make_config) -> None:
    tables = {w: load(run(make_config(*FEDBUFF, f"results.run_id=w{w}"), LocalBackend(num_workers=w)))
              for w in (1, 2)}
    assert tables[2]["clients"]["worker"].nunique() == 2
    assert tables[1]["clients"]["staleness"].max() > 0  # stale updates were weighted: something was compared
    for name in ("rounds", "clients"):
        pd.testing.assert_frame_equal(comparable(tables[1][name]), comparable(tables[2][name]), obj=name)


def test_a_resumed_run_equals_the_uninterrupted_one(make_config) -> None:
    whole = load(run(make_config(*FEDBUFF, "results.run_id=whole", rounds=4), LocalBackend()))
    cfg = make_config(*FEDBUFF, "results.run_id=cut", "results.checkpoint_every=1", rounds=4)
    run_dir = run(cfg, LocalBackend(), callbacks=[StopAfter(1)])
    saved = load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["async"]
    assert any(t["version"] < saved["version"] for t in saved["events"]["flying"])  # older versions referenced
    rest = StopAfter(None)
    run(resume=run_dir, backend=LocalBackend(num_workers=2), callbacks=[rest])
    assert rest.ran == [2, 3]
    cut = load(run_dir)
    for name in ("rounds", "clients"):
        pd.testing.assert_frame_equal(ordered(whole[name]), ordered(cut[name]), obj=name)
    assert math.isfinite(cut["rounds"]["accuracy"].iloc[-1])


BAD = [
    (["algorithm.name=fedbuff", "algorithm.buffer_size=5", "participation.concurrency=3"], "algorithm.buffer_size"),
    (["algorithm.name=fedasync", "algorithm.a=0"], "algorithm.a"),
    (["algorithm.name=fedasync", "algorithm.staleness=hinge", "algorithm.b=-1"], "algorithm.b"),
    (["algorithm.name=fedavg"], "participation.mode"),
    (["algorithm.name=single_image"], "participation.mode"),
    (["algorithm.name=dafkd"], "participation.mode"),
    (["algorithm.name=fedgdkd"], "participation.mode"),
    (["algorithm.name=fedasync", "participation.concurrency=5"], "participation.concurrency"),
    (["algorithm.name=fedasync", "privacy.level=client", "privacy.noise_multiplier=1"], "privacy.level"),
    (["algorithm.name=fedasync", "participation.mode=sync"], "algorithm.name"),
    (["algorithm.name=fedavg", "participation.mode=sync", "participation.concurrency=2"],
     "participation.concurrency"),
]


@pytest.mark.parametrize(("overrides", "key"), BAD)
def test_bad_input_is_one_line_naming_the_key(overrides, key, tmp_path, capsys) -> None:
    from jobs.cli import main

    (tmp_path / "c.yaml").write_text("rounds: 1\ndata: {name: digits, num_clients: 4}\n"
                                     "participation: {mode: async}\nruntime: {backend: local}\n")
    args = [a for o in overrides for a in ("-o", o)]
    assert main(["run", str(tmp_path / "c.yaml"), "--quiet", *args, "-o", f"results.root={tmp_path / 'r'}"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fedsim: error: {key}"), err
    assert not (tmp_path / "r").exists()


@pytest.mark.ray
def test_the_ray_backend_gives_the_local_tables(ray_local, make_config) -> None:
    from fedsim.api import make_backend

    local = load(run(make_config(*FEDBUFF, "runtime.num_workers=2", "results.run_id=local", rounds=2),
                     LocalBackend()))
    cfg = make_config(*FEDBUFF, "runtime.num_workers=2", "runtime.backend=ray", "results.run_id=ray", rounds=2)
    on_ray = load(run(cfg, make_backend(cfg)))
    assert on_ray["clients"]["worker"].nunique() == 2
    for name in ("rounds", "clients"):
        pd.testing.assert_frame_equal(comparable(local[name]), comparable(on_ray[name]), obj=name)


def test_a_failing_client_is_recorded_and_replaced_and_applies_nothing(monkeypatch, tmp_path, make_config) -> None:
    original = FedAsync.local_training

    def flaky(self, phase, state, msg, ctx):
        if ctx.client_id == 1:
            raise RuntimeError("client 1 always fails")
        return original(self, phase, state, msg, ctx)

    monkeypatch.setattr(FedAsync, "local_training", flaky)
    cfg = make_config(*ASYNC, "algorithm.name=fedasync", "data.num_clients=4", "participation.concurrency=4",
                      f"stragglers.trace={trace(tmp_path, [1.0, 1.5, 2.5, 3.0])}", rounds=5)
    t = load(run(cfg, LocalBackend()))
    clients, rounds = t["clients"], t["rounds"]
    failed = clients[clients["status"] == "failed"]
    assert set(failed["client"]) == {1} and len(failed) == 2  # at 1.5 and 3.0, each time dispatched again
    assert failed["error"].str.contains("client 1 always fails").all()
    assert rounds["updates"].tolist() == [1] * 5 and rounds["failures"].tolist() == [0, 1, 0, 0, 1]
    assert (clients[clients["status"] == "ok"]["client"] != 1).all()
