"""The round loop on the in-process backend: determinism, stragglers, failures, resume, results."""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pandas as pd
import pytest
from torch import nn

from fedsim.models import Classifier, register_model
from fedsim.results.plots import plot
from fedsim.results.tables import collect, load, read_table
from fedsim.runtime.backend import owner
from fedsim.runtime.callbacks import Callback
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import assign, run
from tests.forked import run_module, start_module


def deterministic(df: pd.DataFrame) -> pd.DataFrame:
    """Drop wall-clock columns (they end in _s); everything else must match exactly."""
    return df[[c for c in df.columns if not c.endswith("_s")]].reset_index(drop=True)


def test_same_numbers_with_one_and_two_workers(make_config):
    cfg = make_config("stragglers.enabled=true", "model.mix={cnn: 5, mlp: 5}", rounds=3)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    two = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(two["rounds"]))
    cl1 = deterministic(one["clients"]).drop(columns=["worker"])
    cl2 = deterministic(two["clients"]).drop(columns=["worker"])
    pd.testing.assert_frame_equal(cl1, cl2)
    assert set(two["clients"]["worker"]) == {0, 1, 2}
    assert set(one["rounds"]["model"]) == {"cnn", "mlp"}


class DropoutMLP(Classifier):
    """An MLP whose hidden layer goes through nn.Dropout: its masks come from torch's global stream."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, p: float = 0.5) -> None:
        super().__init__()
        self.embed_dim = 32
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(in_channels * image_size ** 2, 32), nn.ReLU(), nn.Dropout(p))
        self.fc = nn.Linear(32, num_classes)

    def embed(self, x):
        return self.body(x)

    def head(self, z):
        return self.fc(z)


register_model("dropout_mlp_test")(DropoutMLP)


def test_dropout_gives_the_same_numbers_with_one_and_three_workers(make_config):
    """Each client step draws its dropout masks from its own seed, not from where the worker's stream happens to be
    after the clients it trained before."""
    cfg = make_config("model.name=dropout_mlp_test", rounds=2)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))
    cl1, cl3 = (deterministic(r["clients"]).drop(columns=["worker"]) for r in (one, three))
    pd.testing.assert_frame_equal(cl1, cl3)
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    cfg.results.run_id = None
    no_dropout = load(run(make_config("model.name=dropout_mlp_test", "model.options={p: 0.0}", rounds=2),
                          LocalBackend(num_workers=1)))
    assert not no_dropout["clients"]["train_loss"].equals(one["clients"]["train_loss"])  # the masks did act


def test_a_plain_float64_sum_trains_the_same_model_to_rounding(make_config):
    exact = load(run(make_config(rounds=2), LocalBackend(num_workers=2)))
    plain = load(run(make_config("runtime.exact_sum=false", rounds=2), LocalBackend(num_workers=2)))
    a, b = (deterministic(r["rounds"]) for r in (exact, plain))
    assert list(a.columns) == list(b.columns) and len(a) == len(b) == 2
    for c in ("accuracy", "loss"):
        np.testing.assert_allclose(a[c], b[c], rtol=1e-4, atol=1e-4)


def test_local_clients_and_server_get_the_threads_they_would_get_on_ray(make_config, monkeypatch):
    """In one process the local backend switches torch's thread count, since PyTorch's CPU kernels may sum in an
    order that depends on it: client steps get what a Ray worker gets (runtime.threads, else its CPU share), the
    server what Ray's server gets (its CPU share when it reserves one, else every CPU of the process)."""
    import torch

    from fedsim.algorithms.fedavg import FedAvg
    from fedsim.threads import process_cpus

    seen: dict[str, set[int]] = {"client": set(), "server": set()}
    step, server_step = FedAvg.local_training, FedAvg.server_step

    def local_training(self, *args):
        seen["client"].add(torch.get_num_threads())
        return step(self, *args)

    def on_server(self, *args):
        seen["server"].add(torch.get_num_threads())
        return server_step(self, *args)

    monkeypatch.setattr(FedAvg, "local_training", local_training)
    monkeypatch.setattr(FedAvg, "server_step", on_server)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)  # a count the clients must not inherit
        run(make_config("runtime.client_cpus=1", rounds=2), LocalBackend(num_workers=2))
        assert seen == {"client": {1}, "server": {process_cpus()}}
        seen = {"client": set(), "server": set()}
        run(make_config("runtime.threads=3", rounds=1), LocalBackend(num_workers=2))
        assert seen == {"client": {3}, "server": {3}}
        seen = {"client": set(), "server": set()}
        run(make_config("runtime.client_cpus=2", "runtime.server_cpus=1", rounds=1), LocalBackend(num_workers=2))
        assert seen == {"client": {2}, "server": {1}}  # as a Ray server actor's share
        seen = {"client": set(), "server": set()}
        monkeypatch.setenv("OMP_NUM_THREADS", "1")  # as Ray sets it for a one-CPU task (a sweep's trial)
        run(make_config(rounds=1), LocalBackend(num_workers=2))
        assert seen == {"client": {1}, "server": {1}}
    finally:
        torch.set_num_threads(before)


def test_stateless_clients_are_balanced_by_cost_and_stateful_ones_stay_with_their_owner():
    cost = {0: 100, 1: 10, 2: 10, 3: 10, 4: 60, 5: 50}
    balanced = assign(list(cost), 2, cost)
    assert balanced == {0: [0, 1, 2], 1: [3, 4, 5]}  # loads 120 and 120; by owner they would be 170 and 70
    assert sorted(c for cs in balanced.values() for c in cs) == sorted(cost)
    assert assign(list(cost), 2) == {0: [0, 2, 4], 1: [1, 3, 5]}
    assert all(owner(c, 2) == w for w, cs in assign(list(cost), 2).items() for c in cs)


def test_clients_with_optimizer_state_are_trained_by_their_owner(make_config):
    res = load(run(make_config("train.keep_optimizer_state=true", "train.momentum=0.9", rounds=2),
                   LocalBackend(num_workers=3)))
    cl = res["clients"]
    assert (cl["worker"] == cl["client"] % 3).all()


class SpillFiles(Callback):
    """Records, at each round's end, the spilled state files under a folder."""

    def __init__(self, folder) -> None:
        self.folder, self.seen = folder, set()

    def on_round_end(self, round, rows) -> None:
        self.seen.update(p.relative_to(self.folder) for p in self.folder.glob("**/*.pt"))


def test_runs_sharing_a_spill_dir_spill_into_folders_of_their_own_and_clean_up(make_config, tmp_path):
    """Two runs (a sweep's trials) given one runtime.spill_dir: each one's spilled states stay its own, so neither
    reads the other's client 3 nor clears the other's files when it resumes; a run removes its own at the end."""
    spill = tmp_path / "shared-spill"
    args = ("train.keep_optimizer_state=true", "train.momentum=0.9", "runtime.cache_bytes=1",
            f"runtime.spill_dir={spill}")
    spy = [SpillFiles(spill), SpillFiles(spill)]
    runs = [run(make_config(*args, rounds=2), callbacks=[spy[0]]),
            run(make_config(*args, "seed=1", rounds=2), callbacks=[spy[1]])]
    for r, seen in zip(runs, (spy[0].seen, spy[1].seen - spy[0].seen)):
        assert seen and all(p.parts[0].startswith(r.name + "-") and p.parts[1] == "w0" for p in seen)
    assert spill.is_dir() and not any(spill.iterdir())  # each run removed its own folder; the user's stays
    default = run(make_config(*args[:3], rounds=2))
    assert not (default / "spill").exists()  # the run folder's spill/ goes too (the checkpoint has the states)


def test_skipping_known_late_clients_changes_nothing_but_time(make_config):
    args = ("stragglers.enabled=true", "stragglers.deadline_value=0.5", "train.epochs=2")
    full = load(run(make_config(*args, "stragglers.skip_late=false")))
    skip = load(run(make_config(*args, "stragglers.skip_late=true")))
    pd.testing.assert_frame_equal(deterministic(full["rounds"]), deterministic(skip["rounds"]))
    assert full["rounds"]["stragglers"].sum() > 0
    late_full = full["clients"][full["clients"]["status"] == "late"]
    late_skip = skip["clients"][skip["clients"]["status"] == "late"]
    assert len(late_full) == len(late_skip) > 0
    assert late_full["wall_s"].sum() > 0 and late_skip["wall_s"].sum() == 0  # not computed at all


def test_a_failing_worker_costs_only_its_clients(make_config, monkeypatch):
    from fedsim.runtime.worker import ClientWorker

    original = ClientWorker.run_phase
    calls = {"n": 0}

    def flaky(self, round, *args, **kw):
        if self.index == 1 and round == 1 and calls["n"] == 0:
            calls["n"] += 1
            raise RuntimeError("worker lost")
        return original(self, round, *args, **kw)

    monkeypatch.setattr(ClientWorker, "run_phase", flaky)
    res = load(run(make_config(), LocalBackend(num_workers=2)))
    rounds = res["rounds"].set_index("round")
    assert rounds.loc[1, "failures"] > 0 and rounds.loc[1, "arrived"] == 4 - rounds.loc[1, "failures"]
    assert rounds.loc[0, "failures"] == 0 and rounds.loc[2, "failures"] == 0
    failed = res["clients"][res["clients"]["status"] == "failed"]
    assert set(failed["round"]) == {1} and set(failed["worker"]) == {1}
    assert failed["error"].str.contains("worker lost").all()
    assert rounds["accuracy"].notna().all()


def test_workers_failing_in_one_phase_are_restarted_together_and_restored_from_one_read(make_config, monkeypatch,
                                                                                      caplog):
    """Both workers fail in round 2 of a method with personal state: one restart of both, one restore of every
    client they held from round 1's checkpoint, one warning naming both; round 3 runs on both again."""
    import fedsim.runtime.loop as loop_mod
    from fedsim.runtime.worker import ClientWorker

    original = ClientWorker.run_phase
    failed_once: set[int] = set()

    def flaky(self, round, *args, **kw):
        if round == 2 and self.index not in failed_once:
            failed_once.add(self.index)
            raise RuntimeError("worker lost")
        return original(self, round, *args, **kw)

    restarts: list[list[int]] = []
    loads: list[tuple[list[int] | None, list[int]]] = []
    reads: list[str] = []
    real_restart, real_load, real_read = LocalBackend.restart_workers, LocalBackend.load_states, \
        loop_mod.load_run_checkpoint

    def restart(self, indices):
        restarts.append(list(indices))
        return real_restart(self, indices)

    def load_states(self, states, workers=None):
        loads.append((workers, sorted(states)))
        return real_load(self, states, workers)

    def read(path):
        reads.append(str(path))
        return real_read(path)

    monkeypatch.setattr(ClientWorker, "run_phase", flaky)
    monkeypatch.setattr(LocalBackend, "restart_workers", restart)
    monkeypatch.setattr(LocalBackend, "load_states", load_states)
    monkeypatch.setattr(loop_mod, "load_run_checkpoint", read)
    cfg = make_config("algorithm.name=local_only", "data.client_test=balanced", "algorithm.pretrain_epochs=1",
                      "results.checkpoint_every=1", rounds=4)
    with caplog.at_level("WARNING", logger="fedsim"):
        res = load(run(cfg, LocalBackend(num_workers=2)))
    rounds = res["rounds"].set_index("round")
    assert failed_once == {0, 1} and restarts == [[0, 1]] and len(reads) == 1
    assert len(loads) == 1 and loads[0][0] == [0, 1] and len(loads[0][1]) > 0  # every held client, in one call
    assert rounds.loc[2, "arrived"] == 0 and rounds.loc[3, "failures"] == 0
    warned = [r.getMessage() for r in caplog.records if "started again" in r.getMessage()]
    assert warned == ["workers 0, 1 started again; their clients' personal states come back from round 1's "
                      "checkpoint"]


def test_results_load_collect_show_plot(make_config, tmp_path):
    a = run(make_config("algorithm.name=fedavg"))
    b = run(make_config("algorithm.name=fedprox", "algorithm.mu=0.1"))
    res = load(a)
    assert list(res["rounds"]["round"]) == [0, 1, 2]
    for col in ["accuracy", "loss", "participants", "stragglers", "failures", "bytes_up", "bytes_down",
                "virtual_time", "wall_round_s"]:
        assert col in res["rounds"], col
    for col in ["round", "client", "samples", "status", "virtual_duration", "bytes_up", "train_loss"]:
        assert col in res["clients"], col
    assert res["config"]["algorithm"]["name"] == "fedavg" and res["meta"]["torch"]
    assert res["meta"]["processor"] and res["meta"]["cpus"] >= 1  # the hardware, on Linux too
    both = collect([a, b])
    assert set(both["config.algorithm.name"]) == {"fedavg", "fedprox"} and len(both) == 6
    png = plot(a)
    assert png.read_bytes()[:4] == b"\x89PNG"
    out = run_module("jobs.cli", ["results", "show", str(a)], timeout=120)
    assert out.returncode == 0 and "accuracy" in out.stdout and len(out.stdout.splitlines()) == 4
    assert not list(a.glob(".*.tmp"))  # atomic writes leave no temporaries


@pytest.mark.slow
def test_resume_after_kill_gives_identical_rounds(tmp_path):
    base = ["run", "configs/demo.yaml", "--quiet", "--backend", "local",
            "-o", "rounds=6", "-o", "train.epochs=2", "-o", "data.num_clients=10",
            "-o", "participation.clients_per_round=4", "-o", f"results.root={tmp_path}"]
    full_run = run_module("jobs.cli", base + ["-o", "results.run_id=full"], timeout=600)  # forked after imports
    assert full_run.returncode == 0, full_run.stderr[-3000:]
    proc = start_module("jobs.cli", base + ["-o", "results.run_id=killed"], new_session=True)
    killed_dir = tmp_path / "killed"
    deadline = time.time() + 300
    while time.time() < deadline:
        if (killed_dir / "rounds.parquet").exists() and len(read_table(killed_dir / "rounds.parquet")) >= 2:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(pd.read_parquet(killed_dir / "rounds.parquet"))
    assert 2 <= done < 6, "the run must be killed part-way"
    resumed_run = run_module("jobs.cli", ["run", "--resume", str(killed_dir), "--quiet"], timeout=600)
    assert resumed_run.returncode == 0, resumed_run.stderr[-3000:]
    full = pd.read_parquet(tmp_path / "full" / "rounds.parquet")
    resumed = pd.read_parquet(killed_dir / "rounds.parquet")
    pd.testing.assert_frame_equal(deterministic(full), deterministic(resumed))


def test_a_late_client_whose_step_raises_is_a_failure_not_also_a_straggler(make_config, monkeypatch):
    """rounds.parquet's counts agree with clients.parquet's statuses: every participant of a one-phase round is
    arrived, a straggler or a failure, exactly one of them."""
    from fedsim.algorithms.fedavg import FedAvg

    step = FedAvg.local_training

    def raises_in_round_1(self, phase, state, msg, ctx):
        if ctx.round == 1 and ctx.client_id % 2 == 0:  # not all: a round whose every client fails stops the run
            raise ValueError(f"client {ctx.client_id} fails")
        return step(self, phase, state, msg, ctx)

    monkeypatch.setattr(FedAvg, "local_training", raises_in_round_1)
    cfg = make_config("stragglers.enabled=true", "stragglers.deadline_value=0.5", "stragglers.skip_late=false")
    res = load(run(cfg))
    rounds, clients = res["rounds"].set_index("round"), res["clients"]
    statuses = clients.pivot_table(index="round", columns="status", values="client", aggfunc="count", fill_value=0)
    assert statuses.loc[1, "failed"] == (clients.query("round == 1")["client"] % 2 == 0).sum() > 0
    assert rounds["stragglers"].iloc[[0, 2]].sum() > 0  # some clients were late in the rounds that did not fail
    for r in rounds.index:
        counts = statuses.loc[r].reindex(["ok", "late", "failed"], fill_value=0)
        assert (rounds.loc[r, "arrived"], rounds.loc[r, "stragglers"], rounds.loc[r, "failures"]) == tuple(counts)
        assert rounds.loc[r, "participants"] == counts.sum()
