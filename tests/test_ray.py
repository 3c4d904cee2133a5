"""The Ray layer: placement on fractional (logical) GPUs, equality with the local backend, worker death,
and the cluster config (the Jobs API on a loopback head: tests/test_plugins.py)."""

from __future__ import annotations

import functools
import os
import signal
import time
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import psutil
import pytest
import yaml

import actors.pool as pool_module
from actors.node_loss import node_gone
from actors.pool import RayBackend, RemoteServer, size_pool
from fedsim.errors import ConfigError, ResourceError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.conftest import ROOT
from tests.runtime.test_loop import deterministic

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def test_pool_sizing_counts_node_by_node(make_config):
    cfg = make_config("runtime.client_gpus=0.25", "runtime.client_cpus=1", "runtime.server_gpus=0.5")
    nodes = [{"CPU": 16, "GPU": 2}, {"CPU": 2, "GPU": 1}, {"CPU": 8}]
    assert size_pool(cfg, nodes) == 6 + 2  # 1.5 GPUs left on node 1, CPU-bound 2 on node 2
    cfg.data.num_clients = 5
    assert size_pool(cfg, nodes) == 5  # never more workers than clients
    with pytest.raises(ResourceError, match="runtime.client_cpus=4.0"):
        size_pool(make_config("runtime.client_cpus=4"), [{"CPU": 2}])


def test_gpus_reserved_where_torch_sees_none_warn_or_stop_the_run(caplog):
    rt = SimpleNamespace(client_gpus=0.5, server_gpus=0.25, require_gpu=False)
    placement = [{"device": "cuda"}, {"device": "cpu"}, {"device": "cpu"}]
    pool_module.check_gpus(rt, placement, {"device": "cuda"})
    assert [r.getMessage() for r in caplog.records] == [
        "GPUs reserved but torch sees no CUDA device (runtime.client_gpus=0.5: 2 of 3 client workers): they compute "
        "on the CPU (runtime.require_gpu: true stops the run instead)"]
    rt.require_gpu = True
    with pytest.raises(ConfigError, match=r"^runtime.require_gpu: GPUs reserved but torch sees no CUDA device "
                       r"\(runtime.server_gpus=0.25: the server\): they compute on the CPU$"):
        pool_module.check_gpus(rt, [{"device": "cuda"}], {"device": "cpu"})
    pool_module.check_gpus(SimpleNamespace(client_gpus=0.0, server_gpus=0.0, require_gpu=True), placement, {})


def test_ray_matches_local_with_workers_on_fractional_gpus(ray_local, make_config, caplog):
    """Four workers on two logical GPUs (0.5 each) and a ServerActor that reserves 0.5 CPU (the other server path,
    in the driver, is what every other Ray test here uses) give the local backend's numbers; the clients keep their
    momentum in a one-byte cache, so it spills."""
    cfg = make_config("runtime.backend=ray", "runtime.client_gpus=0.5", "runtime.client_cpus=0.25",
                      "runtime.server_cpus=0.5", "stragglers.enabled=true", "train.keep_optimizer_state=true",
                      "train.momentum=0.9", "runtime.cache_bytes=1")
    ray_dir = run(cfg, RayBackend())
    on_ray = load(ray_dir)
    said = [r.getMessage() for r in caplog.records if "GPUs reserved" in r.getMessage()]
    assert said == ["GPUs reserved but torch sees no CUDA device (runtime.client_gpus=0.5: 4 of 4 client workers): "
                    "they compute on the CPU (runtime.require_gpu: true stops the run instead)"]  # once, not per round
    placement = on_ray["meta"]["placement"]
    assert on_ray["meta"]["num_workers"] == len(placement) == len({p["pid"] for p in placement}) == 4
    assert sorted(p["gpu_ids"][0] for p in placement) == ["0", "0", "1", "1"]
    assert all(p["device"] == "cpu" for p in placement)  # logical GPUs: torch sees no CUDA here
    assert not (ray_dir / "spill").exists()  # each worker removed its spilled states when the run stopped
    cfg.results.run_id = None
    local_dir = run(cfg, LocalBackend())
    local = load(local_dir)
    pd.testing.assert_frame_equal(deterministic(on_ray["rounds"]), deterministic(local["rounds"]))
    # the workers that hold momentum are asked for it: the last checkpoint has every trained client's, as locally
    kept = [load_run_checkpoint(d / "checkpoints" / "last.pt")["client_states"] for d in (ray_dir, local_dir)]
    assert sorted(kept[0]) == sorted(kept[1]) == sorted(on_ray["clients"].query("status == 'ok'")["client"].unique())


def test_ray_workers_train_clients_together_as_the_local_backend_does(ray_local, make_config, monkeypatch):
    """runtime.batch_clients=on on Ray: every round's client steps are trained together (rounds.parquet's
    clients_batched counts them) and give the numbers of the local backend with as many workers. FedAvg's clients
    keep nothing, so its checkpoints ask no worker for client states."""
    asked: list[int] = []  # workers asked for personal states, per checkpoint
    get = RayBackend._get

    def counted(self, refs, what):
        if what == "collecting client states":
            asked.append(len(refs))
        return get(self, refs, what)

    monkeypatch.setattr(RayBackend, "_get", counted)
    cfg = make_config("runtime.backend=ray", "runtime.client_cpus=1", "runtime.threads=1",
                      "runtime.batch_clients=on", rounds=2)
    on_ray = load(run(cfg, RayBackend(num_workers=2)))
    assert asked == []
    cfg.results.run_id = None
    local = load(run(cfg, LocalBackend(num_workers=2)))
    assert on_ray["rounds"]["clients_batched"].tolist() == local["rounds"]["clients_batched"].tolist() == [4, 4]
    pd.testing.assert_frame_equal(deterministic(on_ray["rounds"]), deterministic(local["rounds"]))
    pd.testing.assert_frame_equal(deterministic(on_ray["clients"]), deterministic(local["clients"]))


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _kill(pid: int) -> int:
    """SIGKILL a worker's process and wait (up to 30 s) until it is gone; returns its pid."""
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pid


def test_a_killed_worker_or_a_reply_that_ray_lost_costs_only_its_clients_and_only_that_round(ray_local, make_config,
                                                                                           monkeypatch):
    """One run of two workers meets, one round each, every way a worker's clients can be lost, and after each the
    next rounds run whole:
    - rounds 1 and 2: the worker is SIGKILLed just before a phase is handed out (round 1, then its replacement
      before round 2): exactly the clients sent to it fail. The checkpoint of clients that keep nothing does not
      wait on (or fail with) the dead worker: there is no state to collect; the worker is replaced. (A timer
      "mid-phase" raced the phase on fast machines: the kill waits until the process is gone.)
    - rounds 3, 4 and 5: which error a finished worker's reply meets when its node goes depends on the moment (the
      actor's death, the reply lost with the node's object store, the node's death): each one fails that worker's
      clients, not the run.
    (Two tests until the suite had to get faster: each paid for its own run and pool.)"""
    import ray
    import ray.exceptions

    errors = {3: "ObjectLostError", 4: "NodeDiedError", 5: "WorkerCrashedError"}
    cfg = make_config("runtime.backend=ray", "runtime.client_cpus=1", "participation.clients_per_round=10",
                      rounds=7)
    backend = RayBackend(num_workers=2)
    original_phase, original_get = backend.run_phase, ray.get
    now: dict[str, int] = {}
    killed: dict[int, int] = {}
    raised: dict[int, str] = {}

    def run_phase(round, *args, **kw):
        now["round"] = round
        if round in (1, 2) and round not in killed:
            killed[round] = _kill(backend.placement[1]["pid"])
        return original_phase(round, *args, **kw)

    def get(refs, *args, **kw):
        r = now.get("round")
        if r in errors and r not in raised and isinstance(refs, ray.ObjectRef) and \
                refs.task_id().actor_id() == backend.workers[1]._actor_id:
            lost = raised[r] = errors[r]  # once a round
            if lost == "ObjectLostError":
                raise ray.exceptions.ObjectLostError(refs.hex(), refs.owner_address(), refs.call_site())
            raise getattr(ray.exceptions, lost)(*(["the node died"] if lost == "NodeDiedError" else []))
        return original_get(refs, *args, **kw)

    backend.run_phase = run_phase
    monkeypatch.setattr(ray, "get", get)
    # round 4's error speaks of a dead node, whose raylet still answers: the pool's look at it need not wait 5 s
    monkeypatch.setattr(pool_module, "node_gone", functools.partial(node_gone, grace_s=0.3))
    res = load(run(cfg, backend))
    rounds, clients = res["rounds"].set_index("round"), res["clients"]
    assert killed[1] != killed[2]  # round 2 killed the replacement
    assert raised == errors and list(rounds.index) == list(range(7))  # each error was raised, and the run went on
    failed = clients[clients["status"] == "failed"]
    assert set(failed["round"]) == {1, 2, *errors} and set(failed["worker"]) == {1}
    for r in (1, 2, *errors):
        on_lost = clients[(clients["round"] == r) & (clients["worker"] == 1)]
        here = failed[failed["round"] == r]
        assert len(here) >= 1 and len(here) == len(on_lost)  # every client sent to the lost worker, no other
        if r in errors:
            assert (here["error_type"] == errors[r]).all(), (r, here["error_type"].tolist())
        assert rounds.loc[r, "failures"] == len(here) and rounds.loc[r, "arrived"] == 10 - len(here)
    assert rounds.loc[[0, 6], "failures"].eq(0).all() and rounds.loc[6, "arrived"] == 10
    assert res["meta"]["status"] == "completed" and rounds["accuracy"].notna().all()


def test_a_phase_past_the_timeout_closes_with_what_arrived(ray_local, make_config):
    # one worker is enough: the phase is past its time limit however its clients are spread, and a second worker
    # only cost a process start (and a core the driver's wait shares)
    cfg = make_config("runtime.backend=ray", "runtime.client_cpus=1", "runtime.round_timeout_s=2",
                      "train.epochs=10000", "participation.clients_per_round=4", rounds=1)
    backend = RayBackend(num_workers=1)
    res = load(run(cfg, backend))
    row = res["rounds"].iloc[0]
    assert row["failures"] == 4 and row["arrived"] == 0 and row["accuracy"] == row["accuracy"]
    errors = res["clients"].query("status == 'failed'")["error"]
    assert len(errors) == 4 and errors.str.contains("round_timeout_s=2").all()
    assert row["wall_clients_s"] < 60  # the loop did not wait for the 10000 epochs (minutes per client)


def test_a_hung_or_dead_worker_cannot_hang_a_checkpoint_or_a_restore(ray_local, make_config):
    """State export/import and memory probes wait at most runtime.round_timeout_s, then fail in one line."""
    import ray

    from fedsim.errors import FedsimError

    @ray.remote(num_cpus=0)
    class Stuck:
        def export_states(self):
            time.sleep(60)

        def load_states(self, states):
            time.sleep(60)

        def rss_bytes(self):
            raise RuntimeError("worker lost its process table")

        def ready(self):
            return True

    backend = RayBackend()
    backend.cfg = make_config("runtime.round_timeout_s=1")
    actors = []
    for call, message in [(lambda: backend.export_states(), "collecting client states: no answer within "
                                                            "runtime.round_timeout_s=1"),
                          (lambda: backend.load_states({0: {}}), "restoring client states: no answer within"),
                          (lambda: backend.rss_bytes(), "measuring memory failed: .*lost its process table")]:
        backend.workers = [Stuck.remote()]  # a fresh actor: a stuck one serves its calls in order
        ray.get(backend.workers[0].ready.remote())  # started, so the 1 s limit measures the call alone
        backend.server = RemoteServer(backend.workers[0], backend.cfg)
        actors.append(backend.workers[0])
        t0 = time.monotonic()
        with pytest.raises(FedsimError, match=message) as err:
            call()
        assert "\n" not in str(err.value) and time.monotonic() - t0 < 20
    for actor in actors:
        ray.kill(actor)


def test_cluster_config_passes_ray_validation():
    from ray.autoscaler._private.util import prepare_config, validate_config

    raw = yaml.safe_load((Path(ROOT) / "ray_cluster.yaml").read_text())
    cfg = prepare_config(raw)
    validate_config(cfg)
    assert cfg["available_node_types"]["gpu_4x"]["resources"]["GPU"] == 4
    raw["available_node_types"]["gpu_4x"]["max_wrkers"] = 3
    with pytest.raises(Exception, match="max_wrkers"):
        validate_config(prepare_config(raw))


def test_dp_noise_and_clipping_on_ray_match_the_local_backend(ray_local, make_config):
    """Client-level DP with an adaptive clip under SecAgg+ on two Ray workers: the clipping in the workers (at the
    clip the server sends each round), the masked sums and the noise on the server give the local backend's numbers
    (named streams, exact sums)."""
    dp = ["algorithm.weighting=uniform", "privacy.level=client", "privacy.noise_multiplier=1.0", "privacy.clip=0.5",
          "privacy.accountant=rdp", "privacy.adaptive_clip=true", "privacy.count_noise=1", "runtime.client_cpus=0.5",
          "runtime.num_workers=2", "privacy.secure_aggregation=secagg+", "privacy.secagg_neighbours=2"]
    on_ray = load(run(make_config("runtime.backend=ray", *dp, rounds=2), RayBackend()))["rounds"]
    local = load(run(make_config(*dp, rounds=2), LocalBackend(num_workers=1)))["rounds"]
    assert on_ray["privacy/clipped_fraction"].gt(0).any() and on_ray["privacy/clip"].nunique() == 2
    assert (on_ray["secagg/aborted"] == 0).all()
    pd.testing.assert_frame_equal(deterministic(on_ray), deterministic(local))


def test_colluders_and_a_robust_aggregator_on_three_ray_workers_match_one_local_worker(ray_local, make_config):
    """Min-max colluders spread over three Ray workers, every client training with sample-level DP-SGD (its noise
    from its own stream), each client's update sent to the server, Multi-Krum there: the local backend's tables, row
    for row (who was kept and each client's epsilon included)."""
    robust = ["attack.kind=min_max", "attack.fraction=0.3", "aggregator.name=multi_krum", "aggregator.f=1",
              "participation.clients_per_round=6", "runtime.client_cpus=0.5", "runtime.num_workers=3",
              "privacy.level=sample", "privacy.noise_multiplier=1.0", "privacy.clip=0.5", "privacy.accountant=rdp"]
    on_ray = load(run(make_config("runtime.backend=ray", *robust, rounds=2), RayBackend()))
    local = load(run(make_config(*robust, rounds=2), LocalBackend(num_workers=1)))
    assert on_ray["rounds"]["attack/attackers"].gt(0).all() and on_ray["clients"]["worker"].nunique() == 3
    pd.testing.assert_frame_equal(deterministic(on_ray["rounds"]), deterministic(local["rounds"]))
    columns = ["round", "client", "role", "kept", "update_norm", "privacy/epsilon", "privacy/samples_clipped"]
    pd.testing.assert_frame_equal(on_ray["clients"][columns], local["clients"][columns])
