"""Generated client shards (data.partition.kind: generated): deterministic per (run seed, client), skewed as α
says, small for a million registered clients, trainable, resumable, and refused in combinations they cannot serve."""

from __future__ import annotations

import gc
import pickle
import time

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.data.generated import GeneratedShards
from fedsim.errors import ConfigError
from fedsim.method.client_archs import ClientArchs
from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback, RoundRows
from fedsim.runtime.clock import make_profiles, sample_round
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.setup import build_env, client_data, load_data, make_partition
from tests.forked import run_module

GENERATED = ["data.name=synthetic", "data.partition.kind=generated", "data.options={n_test: 400, channels: 1, size: 8}",
             "model.name=mlp"]


def generated(*overrides: str, clients: int = 50):
    cfg = load_config(None, GENERATED + [f"data.num_clients={clients}", *overrides])
    data = load_data(cfg)
    return cfg, data, make_partition(cfg, data)


def test_a_shard_depends_on_the_run_seed_and_client_only_not_on_process_or_order():
    _, _, part = generated("seed=3", "data.val_fraction=0.2", "data.client_test=proportional")
    assert isinstance(part, GeneratedShards)
    other = pickle.loads(pickle.dumps(part))  # what another worker gets
    forward = {c: part.shard(c) for c in range(20)}
    backward = {c: other.shard(c) for c in reversed(range(20))}
    for c in range(20):
        assert all(np.array_equal(a, b) for a, b in zip(forward[c], backward[c], strict=True))
    x, y, x_val, y_val, x_test, y_test = forward[7]
    assert x.dtype == np.float32 and y.dtype == np.int64 and x.shape == (40, 1, 8, 8) and len(x_val) == 10
    assert len(x_test) >= 1 and len(y_test) == len(x_test)
    assert not np.array_equal(forward[7][0], forward[8][0])  # clients differ
    _, _, reseeded = generated("seed=4", "data.val_fraction=0.2")
    assert not np.array_equal(reseeded.shard(7)[0], x)  # and so do runs


def test_a_worker_keeps_its_recent_shards_and_none_travel_with_it():
    _, _, part = generated()
    first = part.shard(3)
    assert part.shard(3) is first  # the recent ones are kept
    assert pickle.loads(pickle.dumps(part))._recent == {}  # a fresh worker starts empty


def test_the_label_skew_follows_alpha():
    def top_share(alpha: float) -> float:
        _, _, part = generated(f"data.partition.alpha={alpha}", "data.partition.samples_per_client=400", clients=40)
        shares = [np.bincount(part.shard(c)[1], minlength=10).max() / 400 for c in range(40)]
        return float(np.mean(shares))

    skewed, mild, flat = top_share(0.05), top_share(1.0), top_share(100.0)
    assert skewed > 0.6 and flat < 0.2 and skewed > mild > flat  # uniform: 0.1 plus sampling noise
    _, _, part = generated("data.partition.alpha=0.3", "data.partition.samples_per_client=5000", clients=3)
    for c in range(3):  # labels follow the client's own mix
        y = part.shard(c)[1]
        hist = np.bincount(y, minlength=10) / len(y)
        assert np.abs(hist - part.mix(c)).max() < 0.03


def test_shard_sizes_fixed_or_drawn_and_the_validation_split():
    _, _, fixed = generated("data.partition.samples_per_client=30", "data.val_fraction=0.1")
    assert (fixed.train_sizes == 27).all() and (fixed.val_sizes == 3).all() and fixed.train_sizes.dtype == np.int32
    _, _, drawn = generated("data.partition.samples_per_client=30", "data.partition.samples_sigma=0.8", clients=2000)
    total = drawn.train_sizes + drawn.val_sizes
    assert total.min() >= 1 and len(np.unique(total)) > 20 and 20 < np.median(total) < 40
    assert [len(drawn.shard(c)[1]) for c in range(5)] == drawn.train_sizes[:5].tolist()


def test_personal_test_shards_are_balanced_or_follow_the_mix():
    _, _, part = generated("data.client_test=balanced", "data.partition.alpha=0.05", clients=10)
    for c in range(10):
        assert (np.bincount(part.shard(c)[5], minlength=10) == 4).all()  # 400 test samples / 10 clients
    _, _, part = generated("data.client_test=proportional", "data.partition.alpha=0.05", clients=10)
    d = client_data({"x_test": torch.zeros(0)}, part, 2)  # 400 test samples × 45 / 450 train samples
    assert d.x_test is not None and d.y_test is not None and len(d.y_test) == 40 and d.x_test.shape == (40, 1, 8, 8)
    mix = part.mix(2)
    assert np.bincount(d.y_test.numpy()).argmax() == mix.argmax() and mix[d.y_test.numpy()].min() > 1e-4


def test_a_million_registered_clients_cost_arrays_not_python_objects():
    gc.collect()
    objects = len(gc.get_objects())
    t0 = time.perf_counter()
    cfg, data, part = generated("participation.clients_per_round=100", "stragglers.enabled=true",
                                "participation.availability=0.5", clients=1_000_000)
    env = build_env(cfg, data, part)
    profiles = make_profiles(cfg)
    drawn = sample_round(cfg, 0, profiles)
    seconds = time.perf_counter() - t0
    gc.collect()
    assert len(gc.get_objects()) - objects < 5000  # nothing per client
    assert part.nbytes <= 8 * 1_000_000 + 100_000  # two int32 sizes a client, plus the prototypes
    assert len(pickle.dumps(part)) < part.nbytes + 10_000  # what the workers receive
    assert isinstance(env.client_archs, ClientArchs) and len(pickle.dumps(env.client_archs)) < 500
    assert env.num_samples.nbytes == 4 * 1_000_000 and env.archs == ["mlp"]
    assert len(drawn) == 100 and seconds < 20
    assert client_data({"x_test": torch.zeros(0)}, part, 999_999).num_samples == 45  # 10% validation


def test_client_archs_answer_like_the_list_they_replace():
    cfg = load_config(None, ["data.num_clients=10", "model.mix={cnn: 6, mlp: 0, lenet: 4}"])
    from fedsim.runtime.setup import client_archs

    archs = client_archs(cfg)
    assert list(archs) == ["cnn"] * 6 + ["lenet"] * 4 and len(archs) == 10
    assert archs[5] == "cnn" and archs[6] == "lenet" and archs[-1] == "lenet" and archs[2:4] == ["cnn", "cnn"]
    assert archs.count("lenet") == 4 and archs.count("mlp") == 0 and archs.distinct() == ["cnn", "lenet"]
    assert archs == ["cnn"] * 6 + ["lenet"] * 4 and "mlp" not in archs
    with pytest.raises(IndexError):
        archs[10]


def _config(tmp_path, *overrides: str, rounds: int = 6):
    return load_config(None, GENERATED + [
        f"rounds={rounds}", "name=g", "data.num_clients=100000", "data.partition.alpha=1.0",
        "data.partition.samples_per_client=100", "participation.clients_per_round=10", "train.epochs=5",
        "train.lr=0.05", "runtime.backend=local", "runtime.threads=1", f"results.root={tmp_path}", *overrides])


def _table(run_dir) -> pd.DataFrame:
    df = load(run_dir)["rounds"]
    return df[[c for c in df.columns if not c.endswith("_s")]]


def test_fedavg_on_generated_shards_learns_with_the_same_numbers_on_any_worker_count(tmp_path):
    cfg = _config(tmp_path, "stragglers.enabled=true")
    one = _table(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    two = _table(run(cfg, LocalBackend(num_workers=2)))
    pd.testing.assert_frame_equal(one, two)
    assert one["accuracy"].iloc[-1] > 0.5  # 10 classes: chance is 0.1


class StopAfter(Callback):
    def __init__(self, last: int) -> None:
        self.last = last

    def on_round_end(self, round: int, rows: RoundRows) -> bool:
        return round == self.last


def test_a_resumed_run_gives_the_numbers_of_an_uninterrupted_one(tmp_path):
    personal = ["train.keep_optimizer_state=true", "runtime.cache_bytes=1", "participation.clients_per_round=30",
                "data.num_clients=60", "results.checkpoint_every=1"]  # momentum kept, spilled and checkpointed
    full = run(_config(tmp_path, *personal, "results.run_id=full", rounds=4), LocalBackend(num_workers=2))
    stopped = run(_config(tmp_path, *personal, "results.run_id=stopped", rounds=4), LocalBackend(num_workers=2),
                  callbacks=[StopAfter(1)])
    assert len(load(stopped)["rounds"]) == 2
    resumed = run(resume=stopped, backend=LocalBackend(num_workers=2))
    pd.testing.assert_frame_equal(_table(full), _table(resumed))
    clients = [load(d)["clients"] for d in (full, resumed)]
    assert clients[0]["train_loss"].tolist() == clients[1]["train_loss"].tolist()


@pytest.mark.parametrize("overrides,message", [
    (["data.name=digits"], "data.partition.kind: generated shards are drawn from the synthetic set's prototypes; "
                           "set data.name: synthetic (got 'digits')"),
    (["data.options={n_train: 100}"], "data.options.n_train: generated shards have no fixed training set"),
    (["data.client_test=balanced", "data.options={n_test: 0}"], "data.client_test: personal test shards are scaled"),
    (["algorithm.name=feddf"], "algorithm.validation: with it feddf's server reads the clients' pooled training data"),
    (["algorithm.name=dosfl"], "algorithm.ceiling: with it dosfl's server reads"),
    (["data.partition.samples_per_client=0"], "data.partition.samples_per_client"),
    (["data.partition.samples_sigma=-1"], "data.partition.samples_sigma"),
])
def test_bad_combinations_are_one_line_config_errors(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, GENERATED + ["data.num_clients=10", *overrides])
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_the_cli_refuses_a_bad_combination_in_one_line(tmp_path):
    config = tmp_path / "million.yaml"
    config.write_text("data: {name: digits, num_clients: 1000000, partition: {kind: generated}}\n"
                      f"results: {{root: {tmp_path / 'results'}}}\n")
    proc = run_module("jobs.cli", ["run", str(config)])
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "fedsim: error: data.partition.kind: generated shards are drawn from the synthetic set's prototypes; set "
        "data.name: synthetic (got 'digits')"]
    assert not (tmp_path / "results").exists()
