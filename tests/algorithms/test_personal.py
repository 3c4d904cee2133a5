"""The personalised methods (FedPer, FedRep, FedBN, LG-FedAvg, Ditto, APFL, Per-FedAvg): each client and server step
against plain-torch steps written out on a tiny model, the personal columns against their definition (own shards,
never-trained clients at the server model's accuracy), the same tables on one and two workers and after a resume,
and the refusals through the CLI."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.configure import load_config
from fedsim.method import personal
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


class TwoLayer(Classifier):
    """embed: ReLU(l1·x), 4 -> 3 (with BatchNorm between when `bn`); head: l2, 3 -> 3."""

    def __init__(self, bn: bool = False) -> None:
        super().__init__()
        self.embed_dim = 3
        self.l1, self.l2 = nn.Linear(4, 3), nn.Linear(3, 3)
        self.bn = nn.BatchNorm1d(3) if bn else nn.Identity()

    def embed(self, x):
        return torch.relu(self.bn(self.l1(x.flatten(1))))

    def head(self, z):
        return self.l2(z)


register_model("two_layer_personal")(lambda in_channels, num_classes, image_size: TwoLayer())
register_model("bn_personal")(lambda in_channels, num_classes, image_size: TwoLayer(bn=True))

X = np.array([[1.0, 0.0, 2.0, -1.0], [0.5, 1.5, -0.5, 0.0], [-1.0, 2.0, 0.0, 1.0], [2.0, -1.0, 1.0, 0.5],
              [0.0, 0.5, -2.0, 1.0]], dtype=np.float32)
Y = np.array([0, 2, 1, 1, 0])
PARTS = [np.array([0, 1, 2]), np.array([3, 4])]
TESTS = [np.array([0, 3]), np.array([1, 2, 4])]  # each client's own test shard (indices into the test set)
LR = 0.5


def setup(algo: str, *extra: str, model: str = "two_layer_personal"):
    cfg = load_config(None, ["data.num_clients=2", f"model.name={model}", f"algorithm.name={algo}",
                             "data.client_test=balanced", f"train.lr={LR}", "train.momentum=0", "train.steps=1",
                             "train.batch_size=8", "seed=5", *extra])
    arrays = {"x_train": X.reshape(5, 1, 2, 2), "y_train": Y, "x_test": X.reshape(5, 1, 2, 2), "y_test": Y}
    part = Partition(Ragged.from_list(PARTS), Ragged.from_list([np.array([], int)] * 2), Ragged.from_list(TESTS))
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def one_round(server, worker, states=None):
    """Round 0 for both clients (states put first); the per-client results and the server's state after it."""
    for cid, s in (states or {}).items():
        worker.store.put(cid, s)
    phase = server.phases(0)[0]
    info = RoundInfo(0, "train", [0, 1], [0, 1], {0: 3, 1: 2})
    common = server.broadcast(phase, info).broadcast.common
    reply = worker.run_phase(0, 0, phase, common, {}, [0, 1])
    results = {o.client_id: o.result for o in reply.outcomes}
    server.metrics = server.step(phase, [reply], info).metrics  # the test reads the round's server columns here
    return common, results


def data(part):
    return torch.from_numpy(X[part]), torch.from_numpy(Y[part])


def loss_at(w: dict, x, y, bn: bool = False):
    """CE of the two-layer model with parameters `w` (training-mode BatchNorm when `bn`)."""
    h = x @ w["l1.weight"].T + w["l1.bias"]
    if bn:
        h = F.batch_norm(h, None, None, w["bn.weight"], w["bn.bias"], training=True)
    return F.cross_entropy(torch.relu(h) @ w["l2.weight"].T + w["l2.bias"], y)


def grad(w: dict, x, y, keys=None, bn: bool = False) -> dict:
    """∇ of CE at `w` by key (only `keys` when given)."""
    ks = list(keys if keys is not None else w)
    t = {k: v.clone().requires_grad_(k in ks) for k, v in w.items() if v.is_floating_point()}
    g = torch.autograd.grad(loss_at(t, x, y, bn), [t[k] for k in ks])
    return dict(zip(ks, g))


def accuracy(w: dict, part, bn_stats=None) -> float:
    x, y = data(part)
    h = x @ w["l1.weight"].T + w["l1.bias"]
    if bn_stats is not None:
        h = F.batch_norm(h, bn_stats[0], bn_stats[1], w["bn.weight"], w["bn.bias"], training=False)
    pred = (torch.relu(h) @ w["l2.weight"].T + w["l2.bias"]).argmax(1)
    return float((pred == y).double().mean())


def params(state: dict) -> dict:
    return {k: v for k, v in state.items() if not k.startswith("bn.running") and "num_batches" not in k}


@pytest.mark.parametrize("algo, model, own", [
    ("fedper", "two_layer_personal", ("l2.weight", "l2.bias")),
    ("lgfedavg", "two_layer_personal", ("l1.weight", "l1.bias")),
    ("fedbn", "bn_personal", ("bn.weight", "bn.bias", "bn.running_mean", "bn.running_var", "bn.num_batches_tracked")),
])
def test_split_methods_average_the_shared_entries_and_keep_the_personal_ones(algo, model, own) -> None:
    """One full-batch SGD step at each client from (broadcast shared entries, its own personal ones); the server
    replaces the shared entries by the 3:2 mean and leaves its personal ones; each client keeps its own."""
    bn = model == "bn_personal"
    server, worker = setup(algo, model=model)
    init = {k: v.clone() for k, v in server.state.models[model].items()}
    g = torch.Generator().manual_seed(3)
    mine = {k: init[k] + torch.randn(init[k].shape, generator=g) for k in own if init[k].is_floating_point()
            and "running" not in k}  # client 1 brings its own personal parameters; client 0 has none yet
    states = {1: {"personal": {k: mine.get(k, init[k]).clone() for k in own}}}
    common, results = one_round(server, worker, states)
    assert set(common[model]) == set(init) - set(own)  # personal entries are never sent
    trained = {}
    for cid in (0, 1):
        start = {**init, **(mine if cid == 1 else {})}
        x, y = data(PARTS[cid])
        gr = grad(params(start), x, y, bn=bn)
        trained[cid] = {k: start[k] - LR * gr[k] if k in gr else start[k] for k in start}
        upload = results[cid].payload
        assert set(upload) == set(init) - set(own)
        for k in upload:
            torch.testing.assert_close(upload[k], trained[cid][k], rtol=1e-5, atol=1e-6)
        kept = worker.store.get(cid)["personal"]
        assert set(kept) == set(own)
        for k in own:
            if "running" not in k and "num_batches" not in k:
                torch.testing.assert_close(kept[k], trained[cid][k], rtol=1e-5, atol=1e-6)
        if bn:  # the statistics of the client's own batch, not the server's
            h = x @ start["l1.weight"].T + start["l1.bias"]
            torch.testing.assert_close(kept["bn.running_mean"], 0.9 * init["bn.running_mean"] + 0.1 * h.mean(0))
            assert int(kept["bn.num_batches_tracked"]) == 1
    after = server.state.models[model]
    for k in init:
        want = init[k] if k in own else (3 * trained[0][k] + 2 * trained[1][k]) / 5
        torch.testing.assert_close(after[k], want, rtol=1e-5, atol=1e-6, msg=k)


def test_fedrep_trains_the_head_with_the_body_frozen_then_the_body_with_the_head_frozen() -> None:
    server, worker = setup("fedrep", "algorithm.head_epochs=1")
    init = {k: v.clone() for k, v in server.state.models["two_layer_personal"].items()}
    _, results = one_round(server, worker)
    for cid in (0, 1):
        x, y = data(PARTS[cid])
        gh = grad(init, x, y, ["l2.weight", "l2.bias"])
        w = {**init, **{k: init[k] - LR * g for k, g in gh.items()}}
        gb = grad(w, x, y, ["l1.weight", "l1.bias"])
        w = {**w, **{k: w[k] - LR * g for k, g in gb.items()}}
        for k in ("l1.weight", "l1.bias"):
            torch.testing.assert_close(results[cid].payload[k], w[k], rtol=1e-5, atol=1e-6)
        for k in ("l2.weight", "l2.bias"):
            torch.testing.assert_close(worker.store.get(cid)["personal"][k], w[k], rtol=1e-5, atol=1e-6)
        # the personal model is scored on the client's own shard
        assert results[cid].metrics["personal_accuracy"] == pytest.approx(accuracy(w, TESTS[cid]))
        assert results[cid].metrics["test_samples"] == len(TESTS[cid])


def test_ditto_personal_step_adds_lambda_times_v_minus_w() -> None:
    lam = 0.7
    server, worker = setup("ditto", f"algorithm.lam={lam}")
    w0 = {k: v.clone() for k, v in server.state.models["two_layer_personal"].items()}
    g = torch.Generator().manual_seed(4)
    v0 = {k: v + torch.randn(v.shape, generator=g) for k, v in w0.items()}
    _, results = one_round(server, worker, {0: {"model": v0}})
    for cid in (0, 1):
        x, y = data(PARTS[cid])
        gw = grad(w0, x, y)
        v = v0 if cid == 0 else w0  # a first visit starts the personal model at the global one
        gv = grad(v, x, y)
        want_w = {k: w0[k] - LR * gw[k] for k in w0}
        want_v = {k: v[k] - LR * (gv[k] + lam * (v[k] - w0[k])) for k in v}
        for k in w0:
            torch.testing.assert_close(results[cid].payload[k], want_w[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(worker.store.get(cid)["model"][k], want_v[k], rtol=1e-5, atol=1e-6)
        assert results[cid].metrics["personal_accuracy"] == pytest.approx(accuracy(want_v, TESTS[cid]))
    # the mechanism column: personal accuracy minus the received global model's, on each client's own shard
    gains = [accuracy({k: v0[k] - LR * (grad(v0, *data(PARTS[0]))[k] + lam * (v0[k] - w0[k])) for k in v0}, TESTS[0])
             - accuracy(w0, TESTS[0]),
             results[1].metrics["personal_accuracy"] - accuracy(w0, TESTS[1])]
    assert server.metrics["mech_personal_gain"] == pytest.approx(np.mean(gains))
    for k in w0:  # the server is FedAvg's
        torch.testing.assert_close(server.state.models["two_layer_personal"][k],
                                   (3 * (w0[k] - LR * grad(w0, *data(PARTS[0]))[k]) +
                                    2 * (w0[k] - LR * grad(w0, *data(PARTS[1]))[k])) / 5, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("alpha_lr", [0.0, 0.3])
def test_apfl_steps_w_then_v_on_the_mixture_and_alpha_along_its_gradient(alpha_lr: float) -> None:
    a = 0.6
    server, worker = setup("apfl", f"algorithm.alpha={a}", f"algorithm.alpha_lr={alpha_lr}")
    w0 = {k: v.clone() for k, v in server.state.models["two_layer_personal"].items()}
    g = torch.Generator().manual_seed(5)
    v0 = {k: v + 0.5 * torch.randn(v.shape, generator=g) for k, v in w0.items()}
    _, results = one_round(server, worker, {1: {"model": v0, "alpha": a}})
    for cid in (0, 1):
        x, y = data(PARTS[cid])
        w1 = {k: w0[k] - LR * gr for k, gr in grad(w0, x, y).items()}
        v = w0 if cid == 0 else v0
        mix = {k: a * v[k] + (1 - a) * w1[k] for k in v}
        gm = grad(mix, x, y)
        v1 = {k: v[k] - LR * a * gm[k] for k in v}
        a1 = min(1.0, max(0.0, a - alpha_lr * float(sum((v[k] - w1[k]).mul(gm[k]).sum() for k in v))))
        for k in w0:
            torch.testing.assert_close(results[cid].payload[k], w1[k], rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(worker.store.get(cid)["model"][k], v1[k], rtol=1e-5, atol=1e-6)
        kept_alpha = worker.store.get(cid)["alpha"]
        assert kept_alpha == pytest.approx(a1, rel=1e-5)
        assert (kept_alpha != a) == (alpha_lr > 0)
        scored = {k: a1 * v1[k] + (1 - a1) * w1[k] for k in v1}
        assert results[cid].metrics["personal_accuracy"] == pytest.approx(accuracy(scored, TESTS[cid]))


@pytest.mark.parametrize("steps", [2, 1])  # one batch: the meta-step takes it as both D and D′ (it once skipped it)
def test_perfedavg_first_order_meta_step_and_one_step_personal_model(steps: int) -> None:
    alpha, beta = 0.3, 0.2
    server, worker = setup("perfedavg", f"algorithm.alpha={alpha}", f"algorithm.beta={beta}", f"train.steps={steps}")
    w0 = {k: v.clone() for k, v in server.state.models["two_layer_personal"].items()}
    _, results = one_round(server, worker)
    for cid in (0, 1):
        x, y = data(PARTS[cid])  # each batch is the whole shard (batch size 8): D = D′
        trial = {k: w0[k] - alpha * gr for k, gr in grad(w0, x, y).items()}
        meta = {k: w0[k] - beta * gr for k, gr in grad(trial, x, y).items()}
        for k in w0:
            torch.testing.assert_close(results[cid].payload[k], meta[k], rtol=1e-5, atol=1e-6)
        assert results[cid].metrics["personal_accuracy"] == pytest.approx(accuracy(trial, TESTS[cid]))
        assert results[cid].metrics["steps"] == 1
        assert worker.store.get(cid) is None  # nothing personal to keep


@pytest.mark.parametrize("epochs", [0, 1])
def test_fedavg_ft_uploads_fedavgs_step_and_scores_the_global_model_fine_tuned(epochs: int) -> None:
    server, worker = setup("fedavg_ft", f"algorithm.finetune_epochs={epochs}")
    w0 = {k: v.clone() for k, v in server.state.models["two_layer_personal"].items()}
    _, results = one_round(server, worker)
    for cid in (0, 1):
        w1 = {k: w0[k] - LR * gr for k, gr in grad(w0, *data(PARTS[cid])).items()}
        for k in w0:
            torch.testing.assert_close(results[cid].payload[k], w1[k], rtol=1e-5, atol=1e-6)
        # one epoch is one full batch here: the fine-tuned model is the same step from the global model
        want = accuracy(w1 if epochs else w0, TESTS[cid])
        assert results[cid].metrics["personal_accuracy"] == pytest.approx(want)
    # fine-tuned: each client's kept score; the global model itself: the current one, scored on every shard
    model = server.state.models["two_layer_personal"]
    (row,) = server.evaluate().rows
    want = [accuracy(model, TESTS[c]) if epochs == 0 else results[c].metrics["personal_accuracy"] for c in (0, 1)]
    assert row["personal_accuracy_mean"] == pytest.approx(np.mean(want)) and row["personal_never_trained"] == 0


def test_personal_columns_use_own_shards_and_score_never_trained_clients_with_the_server_model() -> None:
    """Client 0 trained (its score kept); client 1 never did: it counts with the server model's accuracy on its own
    shard. Mean over clients, p10 the worst one of two."""
    server, _ = setup("fedper")
    model = server.state.models["two_layer_personal"]
    server.state.scores = {0: (0.5, 1.0, 2.0)}
    (row,) = server.evaluate().rows
    never = accuracy(model, TESTS[1])
    assert row["model"] == "personal" and row["personal_never_trained"] == 1 and row["personal_trained"] == 1
    assert row["personal_accuracy_mean"] == pytest.approx((0.5 + never) / 2)
    assert row["personal_accuracy_p10"] == pytest.approx(min(0.5, never))
    assert never != accuracy(model, TESTS[0])  # the shard matters
    got = personal.shard_accuracies(server.env, "two_layer_personal", model, [0, 1], torch.device("cpu"))
    assert got == pytest.approx({0: accuracy(model, TESTS[0]), 1: never})
    values = list(np.linspace(0, 1, 21))
    assert personal.worst_mean(values) == pytest.approx(np.mean(sorted(values)[:3]))  # ceil(2.1) = 3
    assert personal.worst_mean([0.3]) == 0.3


SMALL = ["model.name=mlp", "data.num_clients=6", "participation.clients_per_round=3", "train.steps=2",
         "data.client_test=balanced"]



def test_one_and_two_workers_and_a_resumed_run_give_the_same_numbers(make_config) -> None:
    """Ditto (a personal model per client) and FedRep (a personal head; the others share their machinery): two rounds
    on one worker, on two, and (Ditto) stopped after round 0 then resumed: the same tables, and the same personal
    states bit for bit."""
    for algo in ("ditto", "fedrep"):
        opts = [*SMALL, f"algorithm.name={algo}"]
        runs = {name: run(make_config(*opts, f"results.run_id={algo}{name}", rounds=2),
                          LocalBackend(num_workers=workers)) for name, workers in (("one", 1), ("two", 2))}
        if algo == "ditto":
            cut = run(make_config(*opts, f"results.run_id={algo}cut", rounds=2), LocalBackend(),
                      callbacks=[StopAfter(0)])
            assert load(cut)["rounds"]["round"].max() == 0
            runs["cut"] = run(resume=cut, backend=LocalBackend())
        tables = {k: load(v) for k, v in runs.items()}
        assert tables["two"]["clients"]["worker"].nunique() == 2
        rounds = tables["one"]["rounds"]
        assert rounds["personal_never_trained"].tolist()[0] == 3 and rounds["personal_trained"].is_monotonic_increasing
        assert rounds["personal_accuracy_p10"].le(rounds["personal_accuracy_mean"]).all()
        final = {k: load_run_checkpoint(v / "checkpoints" / "last.pt") for k, v in runs.items()}
        for other in [k for k in runs if k != "one"]:
            for table in ("rounds", "clients"):
                pd.testing.assert_frame_equal(comparable(tables["one"][table]), comparable(tables[other][table]),
                                              obj=f"{algo} {other} {table}")
            ours, theirs = final["one"]["client_states"], final[other]["client_states"]
            assert sorted(ours) == sorted(theirs) and ours
            key = "model" if algo == "ditto" else "personal"
            for cid, state in ours.items():
                assert all(torch.equal(v, theirs[cid][key][k]) for k, v in state[key].items()), (algo, other, cid)


def test_fedper_trained_together_gives_the_numbers_of_one_client_at_a_time(make_config, one_thread) -> None:
    """FedPer's client step is a LocalTraining plan, so `runtime.batch_clients` may train its clients together."""
    tables = {b: load(run(make_config(*SMALL, "algorithm.name=fedper", f"runtime.batch_clients={b}",
                                      f"results.run_id=b{b}", rounds=2), LocalBackend()))
              for b in ("false", "true")}
    batched = {b: t["rounds"]["clients_batched"].sum() for b, t in tables.items()}
    assert batched["true"] > 0 and batched["false"] == 0
    for name in ("rounds", "clients"):
        drop = ["clients_batched"]
        pd.testing.assert_frame_equal(comparable(tables["false"][name]).drop(columns=drop, errors="ignore"),
                                      comparable(tables["true"][name]).drop(columns=drop, errors="ignore"), obj=name)


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=fedper", "algorithm.personal_layers=[nope]"],
     "algorithm.personal_layers: ['nope'] names no layer of model 'mlp'"),
    (["algorithm.name=fedrep", "algorithm.personal_layers=[features, fc]"],
     "algorithm.personal_layers: ['features', 'fc'] names every layer of model 'mlp'"),
    (["algorithm.name=lgfedavg", "algorithm.global_layers=[fc2]"],
     "algorithm.global_layers: ['fc2'] names no layer"),
    (["algorithm.name=fedbn"], "model.name: model 'mlp' has no BatchNorm layer"),
    (["algorithm.name=ditto", "algorithm.lam=-1"], "algorithm.lam"),
    (["algorithm.name=apfl", "algorithm.alpha=1.5"], "algorithm.alpha"),
    (["algorithm.name=perfedavg", "algorithm.beta=0"], "algorithm.beta"),
    (["algorithm.name=fedper", "data.client_test=none"], "data.client_test: fedper scores each personal model"),
])
def test_bad_input_is_one_line_naming_the_key(overrides, message, tmp_path, capsys) -> None:
    from jobs.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\ndata: {name: digits, num_clients: 4, client_test: balanced}\nmodel: {name: mlp}\n"
                   f"rounds: 1\nresults: {{root: {tmp_path / 'results'}}}\n")
    code = main(["run", str(cfg), "--quiet", "--backend", "local", *[a for o in overrides for a in ("-o", o)]])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0], err
