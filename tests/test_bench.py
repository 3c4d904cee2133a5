"""The bench harness runs the shared peer workload: fl_common's data, partition, models and the plain loop's draws."""

from __future__ import annotations

import argparse
import re

import numpy as np
import pytest

from bench.peer import fl_common, peer_dir
from bench.workload import PeerSimulation, PeerWorkload, make_config, peer_dataset, peer_partition, sampled_clients
from fedsim.algorithms.fedavg import new_model
from fedsim.results import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import new_run_dir

# a tiny version of the harness's workload: 7 clients, 3 per round, 600 training images
TINY = PeerWorkload(num_clients=7, clients_per_round=3, rounds=3, model="mlp", n_train=600, n_test=60)


def test_the_flags_are_the_harness_flags():
    ap = argparse.ArgumentParser()
    fl_common().add_common_args(ap)
    assert PeerWorkload.from_args(ap.parse_args(TINY.peer_args())) == TINY
    assert PeerWorkload.from_args(ap.parse_args([])) == PeerWorkload()  # same defaults


def test_data_and_partition_are_fl_commons():
    C = fl_common()
    ref = C.load_data(TINY.data_seed, TINY.n_train, TINY.n_test, TINY.amp)
    data = peer_dataset(TINY)
    for got, want in zip((data.x_train, data.y_train, data.x_test, data.y_test), ref, strict=True):
        assert type(got) is np.ndarray and np.array_equal(got, want)  # a plain array: Ray maps it zero-copy
    parts = C.get_partitions(TINY.num_clients, TINY.alpha, TINY.seed, TINY.data_seed, TINY.n_train, TINY.n_test,
                             TINY.amp)
    part = peer_partition(TINY)
    assert len(part.train) == 7 and all(np.array_equal(part.train[c], parts[c]) for c in range(7))
    assert part.val.lengths().sum() == 0 and part.test is None


def test_draws_are_the_plain_loops():
    """plain_fedavg.py draws with one generator seeded seed+12345, K of N without replacement, once per round."""
    src = (peer_dir() / "plain_fedavg.py").read_text()
    assert "sel_rng = np.random.default_rng(args.seed + 12345)" in src
    assert re.search(r"sel_rng\.choice\(args\.num_clients, size=args\.clients_per_round, replace=False\)", src)
    rng = np.random.default_rng(TINY.seed + 12345)
    want = [sorted(rng.choice(7, size=3, replace=False).tolist()) for _ in range(3)]
    assert [d.tolist() for d in sampled_clients(TINY)] == want


@pytest.mark.parametrize("arch", ["mlp", "resnet8"])
def test_models_have_the_harness_shapes(arch):
    from fedsim.runtime.setup import build_env

    cfg = make_config(TINY.with_(model=arch))
    env = build_env(cfg, peer_dataset(TINY), peer_partition(TINY))
    ours = [tuple(p.shape) for p in new_model(env, cfg.model.name).parameters()]
    theirs = [tuple(p.shape) for p in fl_common().build_model(arch).parameters()]
    assert ours == theirs
    t = cfg.train
    assert (t.optimizer, t.lr, t.momentum, t.batch_size, t.epochs, t.steps) == ("sgd", 0.01, 0.9, 32, 1, None)
    assert cfg.data.val_fraction == 0.0 and cfg.eval.batch_size == 125


def test_the_engine_trains_the_drawn_clients_on_their_shards(tmp_path):
    cfg = make_config(TINY, [f"results.root={tmp_path}", "runtime.backend=local", "runtime.threads=1"])
    run_dir = new_run_dir(cfg)
    sim = PeerSimulation(cfg, LocalBackend(num_workers=2), run_dir, TINY)
    sim.setup()
    sim.run()
    clients = load(run_dir)["clients"]
    parts = peer_partition(TINY).train
    for r, draw in enumerate(sampled_clients(TINY)):
        got = clients[clients["round"] == r]
        assert got["client"].tolist() == draw.tolist() and (got["status"] == "ok").all()
        assert got["samples"].tolist() == [len(parts[c]) for c in draw]
    rounds = load(run_dir)["rounds"]
    assert len(rounds) == 3 and rounds["accuracy"].notna().all()
