"""The split methods' re-scoring pass (PersonalMethod.measurement): at each evaluation every client that has trained
is scored with the server's current shared entries and its own personal ones, which a numpy forward pass over the
checkpoint's weights reproduces; the pass changes no training number and costs no bytes or virtual time; one and two
workers (states spilled) and a resumed run give the same tables; the Ray backend's server actor gives the local
backend's."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F

from fedsim import rng
from fedsim.method.personal import PersonalMethod
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.setup import load_data, make_partition
from tests.conftest import small_config
from tests.runtime.test_resume_methods import StopAfter
from tests.runtime.test_worker_count import comparable

# 4 clients, one a round: with seed 0 client 0 trains in round 0 and sits rounds 1 and 2 out (checked below)
FEDPER = ["algorithm.name=fedper", "model.name=mlp", "data.num_clients=4", "participation.clients_per_round=1",
          "train.steps=5", "train.lr=0.1", "data.client_test=balanced", "seed=0"]
PERSONAL_COLUMNS = ["personal_accuracy_mean", "personal_accuracy_p10"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """FedPer, three rounds on one worker: its config and run folder."""
    cfg = small_config(tmp_path_factory.mktemp("rescore"), *FEDPER, "results.run_id=base")
    return cfg, run(cfg, LocalBackend())


def hand_scores(weights: dict, x: np.ndarray, y: np.ndarray) -> tuple[float, float]:
    """Accuracy and mean CE of the MLP with `weights` (hidden Linear+ReLU layers, then `fc`) on (x, y), in numpy."""
    h = x.reshape(len(x), -1).astype(np.float64)
    hidden = [k[:-len(".weight")] for k in weights if k.endswith(".weight") and not k.startswith("fc.")]
    for name in hidden:
        h = np.maximum(h @ weights[f"{name}.weight"].double().numpy().T + weights[f"{name}.bias"].double().numpy(), 0)
    z = h @ weights["fc.weight"].double().numpy().T + weights["fc.bias"].double().numpy()
    z = z - z.max(1, keepdims=True)
    logp = z - np.log(np.exp(z).sum(1, keepdims=True))
    return float((z.argmax(1) == y).mean()), float(-logp[np.arange(len(y)), y].mean())


def test_a_client_that_sat_rounds_out_is_scored_with_the_current_body_and_its_own_head(base) -> None:
    cfg, folder = base
    tables = load(folder)
    clients, rounds = tables["clients"], tables["rounds"]
    first = int(clients.query("round == 0")["client"].iloc[0])
    assert first not in clients.query("round > 0")["client"].tolist()  # it sat rounds 1 and 2 out
    ck = load_run_checkpoint(folder / "checkpoints" / "last.pt")
    assert ck["round"] == 2
    server = ck["server_state"].models["mlp"]
    data = load_data(cfg)
    part = make_partition(cfg, data)
    want = {}
    for c in range(4):
        own = ck["client_states"].get(c, {}).get("personal", {})
        assert set(own) <= {"fc.weight", "fc.bias"}
        idx = part.test[c]
        want[c] = (*hand_scores({**server, **own}, data.x_test[idx], data.y_test[idx]), len(idx))
    # the round-2 score of the client that trained in round 0 only: round 2's body with its own head
    got = ck["server_state"].scores[first]
    assert got == pytest.approx(want[first], rel=1e-5)
    stale = clients.query("round == 0").iloc[0]  # the score it got when it trained: not what it reports now
    assert got[0] != pytest.approx(stale["personal_accuracy"]) and got[1] != pytest.approx(stale["personal_loss"])
    last = rounds.query("round == 2").iloc[0]
    trained = sorted(ck["server_state"].scores)
    assert last["personal_trained"] == len(trained) and last["personal_never_trained"] == 4 - len(trained)
    for c in trained:  # every trained client re-scored, this round's one too (after the server averaged)
        assert ck["server_state"].scores[c] == pytest.approx(want[c], rel=1e-5)
    accs = [want[c][0] for c in range(4)]  # never-trained clients: the server model (initial head) on their shard
    assert last["personal_accuracy_mean"] == pytest.approx(np.mean(accs))
    assert last["personal_accuracy_p10"] == pytest.approx(min(accs))


def test_perfedavg_rescores_with_the_current_global_models_one_step_fine_tune(tmp_path) -> None:
    """Per-FedAvg's personal model is one α-step from the global model: a client that trained in round 0 and sat out
    rounds 1 and 2 is scored at round 2 with round 2's global model, stepped on the first batch of its stream
    "perfedavg/personal" at round 2 (a plain-torch step here)."""
    opts = [o for o in FEDPER if not o.startswith("algorithm.name")] + ["algorithm.name=perfedavg",
                                                                         "algorithm.alpha=0.5"]
    cfg = small_config(tmp_path, *opts, "results.run_id=pfa")
    folder = run(cfg, LocalBackend(num_workers=2))
    clients = load(folder)["clients"]
    first = int(clients.query("round == 0")["client"].iloc[0])
    assert first not in clients.query("round > 0")["client"].tolist()
    ck = load_run_checkpoint(folder / "checkpoints" / "last.pt")
    glob = ck["server_state"].models["mlp"]
    data = load_data(cfg)
    part = make_partition(cfg, data)
    x, y = torch.from_numpy(data.x_train[part.train[first]]), torch.from_numpy(data.y_train[part.train[first]])
    batch = torch.randperm(len(y), generator=rng.torch_generator(cfg.seed, "perfedavg/personal", 2, first, 0))
    batch = batch[:cfg.train.batch_size]
    w = {k: v.clone().requires_grad_(True) for k, v in glob.items()}
    h = x[batch].flatten(1)
    for name in [k[:-len(".weight")] for k in w if k.endswith(".weight") and not k.startswith("fc.")]:
        h = torch.relu(h @ w[f"{name}.weight"].T + w[f"{name}.bias"])
    loss = F.cross_entropy(h @ w["fc.weight"].T + w["fc.bias"], y[batch])
    grads = dict(zip(w, torch.autograd.grad(loss, list(w.values()))))
    tuned = {k: (w[k] - 0.5 * grads[k]).detach() for k in w}
    idx = part.test[first]
    want = (*hand_scores(tuned, data.x_test[idx], data.y_test[idx]), len(idx))
    got = ck["server_state"].scores[first]
    assert got == pytest.approx(want, rel=1e-4)
    stale = clients.query("round == 0").iloc[0]
    assert got[1] != pytest.approx(stale["personal_loss"])


def test_fedavg_fine_tuned_rescores_with_a_fine_tune_of_the_current_global_model(tmp_path) -> None:
    """The reference's personal model is the global model fine-tuned for an epoch: a client that sat rounds 1 and 2
    out is scored at round 2 with round 2's global model fine-tuned on its data (stream "fedavg_ft/finetune" at
    round 2), not with the fine-tune of round 0's it made when it trained."""
    from fedsim.method.personal import replace_epochs
    from fedsim.models import build_model
    from fedsim.training.train import train_classifier

    opts = [o for o in FEDPER if not o.startswith("algorithm.name")] + ["algorithm.name=fedavg_ft"]
    cfg = small_config(tmp_path, *opts, "results.run_id=ft")
    folder = run(cfg, LocalBackend())
    clients = load(folder)["clients"]
    first = int(clients.query("round == 0")["client"].iloc[0])
    assert first not in clients.query("round > 0")["client"].tolist()
    ck = load_run_checkpoint(folder / "checkpoints" / "last.pt")
    data = load_data(cfg)
    part = make_partition(cfg, data)
    model = build_model("mlp", 1, data.num_classes, data.image_size, **cfg.model.options)
    model.load_state_dict(ck["server_state"].models["mlp"])
    x, y = torch.from_numpy(data.x_train[part.train[first]]), torch.from_numpy(data.y_train[part.train[first]])
    train_classifier(model, x, y, replace_epochs(cfg.train, 1), rng.torch_generator(cfg.seed, "fedavg_ft/finetune",
                                                                                     2, first, 0))
    idx = part.test[first]
    want = (*hand_scores(model.state_dict(), data.x_test[idx], data.y_test[idx]), len(idx))
    assert ck["server_state"].scores[first] == pytest.approx(want, rel=1e-5)
    stale = clients.query("round == 0").iloc[0]
    assert ck["server_state"].scores[first][1] != pytest.approx(stale["personal_loss"])


def test_the_pass_changes_no_training_number_bytes_or_virtual_time(base, tmp_path, monkeypatch) -> None:
    cfg, folder = base
    monkeypatch.setattr(PersonalMethod, "measurement", lambda self, state: None)  # today's stale scores
    without = run(small_config(tmp_path, *FEDPER, "results.run_id=without"), LocalBackend())
    ours, theirs = load(folder), load(without)
    pd.testing.assert_frame_equal(comparable(ours["clients"]), comparable(theirs["clients"]))
    pd.testing.assert_frame_equal(comparable(ours["rounds"]).drop(columns=PERSONAL_COLUMNS),
                                  comparable(theirs["rounds"]).drop(columns=PERSONAL_COLUMNS))
    assert (ours["rounds"]["personal_accuracy_mean"] != theirs["rounds"]["personal_accuracy_mean"]).any()
    cks = [load_run_checkpoint(f / "checkpoints" / "last.pt") for f in (folder, without)]
    assert cks[0]["virtual_time"] == cks[1]["virtual_time"]
    for k, v in cks[0]["server_state"].models["mlp"].items():
        assert np.array_equal(v.numpy(), cks[1]["server_state"].models["mlp"][k].numpy()), k
    assert sorted(cks[0]["client_states"]) == sorted(cks[1]["client_states"])
    for c, state in cks[0]["client_states"].items():
        for k, v in state["personal"].items():
            assert np.array_equal(v.numpy(), cks[1]["client_states"][c]["personal"][k].numpy()), (c, k)


def test_two_workers_with_spilled_states_and_a_resumed_run_give_the_same_tables(base, tmp_path) -> None:
    _, folder = base
    two = run(small_config(tmp_path, *FEDPER, "results.run_id=two", "runtime.cache_bytes=1"),
              LocalBackend(num_workers=2))
    cut = run(small_config(tmp_path, *FEDPER, "results.run_id=cut"), LocalBackend(), callbacks=[StopAfter(0)])
    assert load(cut)["rounds"]["round"].max() == 0
    resumed = run(resume=cut, backend=LocalBackend(num_workers=2))
    ours = load(folder)
    for name, other in (("two", load(two)), ("resumed", load(resumed))):
        for table in ("rounds", "clients"):
            pd.testing.assert_frame_equal(comparable(ours[table]), comparable(other[table]), obj=f"{name} {table}")
    assert load(two)["clients"]["worker"].nunique() == 2


@pytest.mark.ray
def test_the_ray_backend_with_a_server_actor_gives_the_local_tables(base, ray_local, tmp_path) -> None:
    from actors.pool import RayBackend

    _, folder = base
    cfg = small_config(tmp_path, *FEDPER, "results.run_id=ray", "runtime.backend=ray", "runtime.client_cpus=0.5",
                       "runtime.server_cpus=0.5")
    on_ray = load(run(cfg, RayBackend(num_workers=1)))  # the server actor's measure calls are what is new here
    ours = load(folder)
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(comparable(ours[table]), comparable(on_ray[table]), obj=table)
