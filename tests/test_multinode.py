"""Several Ray nodes on this one machine (ray.cluster_utils.Cluster: a head and worker raylets, each with its own
CPUs and logical GPUs): placement across nodes, equality with one process, a worker node and the server's node
lost mid-round, and the wait for the autoscaler."""

from __future__ import annotations

import logging
import shutil
import threading
import time
from pathlib import Path

import pandas as pd
import pytest
import torch

from actors.pool import RayBackend
from bench.multinode_traffic import unpublished
from bench.store_traffic import StoreTraffic
from fedsim.errors import ResourceError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.setup import load_data
from tests.conftest import ROOT, start_local_ray
from tests.runtime.test_loop import deterministic

pytestmark = [pytest.mark.ray, pytest.mark.slow]

# nodes declared dead within about 2 s; and no metrics: after a node was lost, a dashboard agent (its metrics
# reporter) and the GCS took both cores, and the next round's training ran 16 times slower (98 s against 6 s)
FAST_NODE_DEATH = {"health_check_period_ms": 500, "health_check_failure_threshold": 4,
                   "health_check_initial_delay_ms": 0, "enable_metrics_collection": False}


@pytest.fixture(scope="module")
def cluster():
    """A head that holds only the driver (no CPUs) and worker nodes added by each test; the session's local Ray,
    if it was up, is started again afterwards."""
    import ray
    from ray.cluster_utils import Cluster

    was_up = ray.is_initialized()
    ray.shutdown()
    with unpublished():  # a run that another test process starts meanwhile must not join this cluster
        c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0, "include_dashboard": False,
                                                         "_system_config": FAST_NODE_DEATH})
    connect(c)
    yield c
    ray.shutdown()
    with unpublished():
        c.shutdown()
    if was_up:
        start_local_ray()


def connect(c) -> None:
    """This process joins the cluster (again), as a driver."""
    import ray

    if not ray.is_initialized():
        ray.init(address=c.address, configure_logging=False, runtime_env={"env_vars": {"PYTHONPATH": ROOT}})


_SHAPES: dict[str, tuple[int, int]] = {}  # node id -> (CPUs, GPUs) it was added with


def worker_nodes(c, count: int, cpus: int = 2, gpus: int = 2) -> list:
    """Exactly `count` worker nodes of `cpus` CPUs and `gpus` logical GPUs: live ones of that shape an earlier test
    left are kept (a node costs a raylet and its workers to start), the others removed, the rest added."""
    kept = []
    for node in list(c.worker_nodes):
        if len(kept) < count and _SHAPES.get(node.node_id) == (cpus, gpus):
            kept.append(node)
        else:
            c.remove_node(node)
    for _ in range(count - len(kept)):
        kept.append(c.add_node(num_cpus=cpus, num_gpus=gpus))
        _SHAPES[kept[-1].node_id] = (cpus, gpus)
    c.wait_for_nodes()
    return kept


def node_of(c, node_id: str):
    return next(n for n in c.worker_nodes if n.node_id == node_id)


def test_spread_and_pack_place_workers_by_node_and_match_one_process(cluster, make_config):
    from ray._private.utils import read_ray_address

    assert read_ray_address() != cluster.address  # not published: no other process's `ray.init()` joins it
    nodes = worker_nodes(cluster, 3)
    ids = {n.node_id for n in nodes}
    base = ["runtime.backend=ray", "runtime.client_cpus=0.5", "runtime.client_gpus=1", "runtime.num_workers=3",
            "participation.clients_per_round=6", "model.name=mlp", "model.options={hidden: 16, layers: 1}"]
    runs, traffic = {}, StoreTraffic()
    for how, workers in (("spread", 3), ("pack", 2)):
        cfg = make_config(*base, f"runtime.placement={how}", f"results.run_id={how}", f"runtime.num_workers={workers}",
                          rounds=2)
        runs[how] = load(run(cfg, RayBackend(), callbacks=[traffic] if how == "spread" else []))
    local = load(run(make_config(*base, "results.run_id=local", rounds=2), LocalBackend(num_workers=3)))

    spread, pack = runs["spread"]["meta"], runs["pack"]["meta"]
    assert spread["placement_strategy"] == "spread" and pack["placement_strategy"] == "pack"
    spread_nodes = [p["node_id"] for p in spread["placement"]]
    assert len(set(spread_nodes)) == 3 and set(spread_nodes) <= ids  # one worker on each node
    assert sorted(spread["workers_per_node"].values()) == [1, 1, 1]
    assert list(pack["workers_per_node"].values()) == [2]  # two logical GPUs per node: one node holds both
    assert spread["server"]["node_id"] == cluster.head_node.node_id  # the server lives in the driver, on the head
    for how, res in runs.items():
        pd.testing.assert_frame_equal(deterministic(res["rounds"]), deterministic(local["rounds"]), obj=how)
        # every client's row came back from a worker on another node than the driver's, intact
        clients = deterministic(res["clients"]).drop(columns=["worker"])
        assert len(clients) == 2 * 6 and (clients["status"] == "ok").all()
        pd.testing.assert_frame_equal(clients, deterministic(local["clients"]).drop(columns=["worker"]), obj=how)

    # the dataset moves to each worker node once, when its workers start; a round moves only messages
    data = load_data(cfg)
    dataset = sum(a.nbytes for a in (data.x_train, data.y_train, data.x_test, data.y_test))
    moved = pd.DataFrame(traffic.rows())
    print("\nobject-store bytes per node and stage:\n" + moved.pivot(index="stage", columns="node", values="bytes")
          .rename(columns=lambda n: n[:8]).to_string())
    on_workers = moved[moved["node"].isin(ids)]
    assert (on_workers.query("stage == 'start'")["bytes"] >= dataset).all()
    assert (on_workers.query("stage != 'start'")["bytes"] < dataset / 2).all()


def test_a_cluster_kept_unpublished_neither_writes_nor_removes_the_machines_address_file(tmp_path):
    from ray._common import utils as common
    from ray._private import utils as private

    (tmp_path / "ray_current_cluster").write_text("10.0.0.1:6379")  # a cluster the user started
    with unpublished():
        private.write_ray_address("10.0.0.2:6379", str(tmp_path))
        common.reset_ray_address(str(tmp_path))
    assert private.read_ray_address(str(tmp_path)) == "10.0.0.1:6379"
    common.reset_ray_address(str(tmp_path))  # Ray's own again after
    assert private.read_ray_address(str(tmp_path)) is None


def _states_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_states_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_states_equal(x, y) for x, y in zip(a, b))
    return a == b


class KeepCheckpoints(Callback):
    """A copy of every round's checkpoint, to compare clients' personal states round by round (the run's own
    callbacks come first: during a round's callbacks the checkpoint holds that round)."""

    def __init__(self) -> None:
        self.states: dict[int, dict] = {}

    def on_setup_end(self, run) -> None:
        self.path = run.checkpoint

    def on_round_end(self, round, rows) -> None:
        self._keep()

    def _keep(self) -> None:
        ck = load_run_checkpoint(self.path)
        self.states[ck["round"]] = ck["client_states"]


def timed_shutdown(backend: RayBackend) -> list[float]:
    """The seconds the backend's own shutdown takes (its workers stopped, their resources given back)."""
    took: list[float] = []
    real = backend.shutdown

    def shutdown() -> None:
        t0 = time.monotonic()
        try:
            real()
        finally:
            took.append(time.monotonic() - t0)

    backend.shutdown = shutdown
    return took


def test_a_worker_node_lost_mid_round_costs_only_its_clients_updates(cluster, make_config, caplog, tmp_path):
    nodes = worker_nodes(cluster, 3)  # the placement test's nodes: logical GPUs unused (client_gpus 0)
    base = ["runtime.backend=ray", "runtime.client_cpus=1", "runtime.placement=spread",
            "train.keep_optimizer_state=true"]
    cfg = make_config(*base, "runtime.num_workers=4", "participation.clients_per_round=10", rounds=4)
    backend = RayBackend()
    original = backend.run_phase
    removed: dict[int, str] = {}

    def run_phase(round, *args, **kw):
        # round 1: the first node with workers goes (they start again on the others: 2 CPUs free there);
        # round 2: a full node goes, and nothing has room left (the pool shrinks). The node goes as the phase is
        # sent to its workers
        if round in (1, 2) and round not in removed:
            held = [p["node_id"] for i, p in enumerate(backend.placement) if backend._host[i] == i]
            victim = sorted(set(held), key=lambda n: (-held.count(n), n))[0] if round == 2 else held[0]
            removed[round] = victim
            cluster.remove_node(node_of(cluster, victim), allow_graceful=False)
        return original(round, *args, **kw)

    backend.run_phase = run_phase
    lost_shutdown = timed_shutdown(backend)
    kept = KeepCheckpoints()
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        res = load(run(cfg, backend, callbacks=[kept]))
    rounds, clients = res["rounds"].set_index("round"), res["clients"]
    table = clients.pivot_table(index="round", columns="status", values="client", aggfunc="count", fill_value=0)
    print("\nstatuses per round:\n" + table.to_string())

    assert list(rounds.index) == [0, 1, 2, 3] and rounds["accuracy"].notna().all()
    for r in (1, 2):
        lost = clients[(clients["round"] == r) & (clients["status"] == "failed")]
        assert len(lost) >= 1 and (lost["error_type"] == "NodeLost").all(), lost
        assert lost["error"].str.contains(f"node {removed[r][:12]} of worker .* left the cluster").all()
        # the reason is Ray's own error that told of the loss (ActorDiedError, ...), type and text
        assert lost["error_traceback"].str.match(r"^\w+Error: \S").all(), lost["error_traceback"]
        assert rounds.loc[r, "failures"] == len(lost) and rounds.loc[r, "arrived"] == 10 - len(lost)
        # the lost clients' states are the ones of the checkpoint before: restored, not reset, not missing
        before, after = kept.states[r - 1], kept.states[r]
        assert set(before) == set(range(10)) and set(after) == set(range(10))
        for c in lost["client"]:
            assert _states_equal(after[c], before[c]), f"round {r}: client {c}'s state was not restored"
        trained = clients[(clients["round"] == r) & (clients["status"] == "ok")]["client"]
        assert not any(_states_equal(after[c], before[c]) for c in trained)
    assert set(clients[clients["status"] != "ok"]["round"]) == {1, 2}
    assert (clients[clients["round"] == 3]["status"] == "ok").all()  # the shrunk pool serves every client

    # meta.json says where the workers are now: no lost node, and round 2's lost slots served by survivors
    meta = res["meta"]
    placed = {p["index"]: p for p in meta["placement"]}
    moved = {i: p["hosted_by"] for i, p in placed.items() if "hosted_by" in p}
    assert not {p["node_id"] for p in placed.values()} & set(removed.values())
    assert sorted(meta["workers_per_node"].values()) == [2] and len(moved) == 2  # one node, two actors, four slots
    assert all(placed[i]["node_id"] == placed[h]["node_id"] and "hosted_by" not in placed[h]
               for i, h in moved.items())
    # the worker column names the worker that trained the client: round 2's lost clients, the lost slot; then
    # the survivor that took them over
    lost2 = clients[(clients["round"] == 2) & (clients["status"] == "failed")].set_index("client")["worker"]
    assert set(lost2 % 4) == set(moved) and (lost2 == lost2.index % 4).all()
    third = clients[clients["round"] == 3].set_index("client")["worker"]
    assert (third == [placed[c % 4].get("hosted_by", c % 4) for c in third.index]).all(), third
    assert set(third[lost2.index]) == set(moved.values())

    # one line per lost node, saying what became of its workers
    lines = [r.getMessage() for r in caplog.records if r.name.startswith("fedsim")]
    print("\n".join(lines))
    about = [m for m in lines if "left the cluster" in m or "started again" in m or "replaced" in m]
    assert len(about) == 2, about
    assert about[0].startswith(f"node {removed[1][:12]} left the cluster: worker ") and \
        "started again on node" in about[0] and about[0].endswith("come back from round 0's checkpoint")
    assert about[1].startswith(f"node {removed[2][:12]} left the cluster: no node has room for worker ") and \
        about[1].endswith("the pool shrinks to 2 workers); their clients' personal states come back from round 1's "
                          "checkpoint")
    assert all(f"no node has room for worker {i}: its clients move to worker {h}" in about[1] for i, h in moved.items())

    # stopping the pool after the loss waits on no lost worker (0.01-0.05 s measured, as after a clean run; a wait
    # on one would be runtime.round_timeout_s). Ray's own `ray.shutdown` after a loss can take seconds more: its
    # last metrics export (docs/cluster.md)
    assert lost_shutdown[0] < 10, lost_shutdown
    shutil.rmtree(tmp_path / "results", ignore_errors=True)
    del nodes


def test_the_server_node_lost_stops_with_a_resume_line_and_resume_finishes(cluster, make_config):
    from actors.node_loss import NodeLostError

    worker_nodes(cluster, 2)
    cfg = make_config("runtime.backend=ray", "runtime.client_cpus=0.5", "runtime.server_cpus=0.5",
                      "runtime.num_workers=2", "participation.clients_per_round=4", "results.run_id=served",
                      rounds=3)
    backend = RayBackend()
    original = backend.run_phase

    def run_phase(round, *args, **kw):
        if round == 1:  # the round has begun on the server (phases, broadcast): its node goes
            cluster.remove_node(node_of(cluster, backend.server_placement["node_id"]), allow_graceful=False)
        return original(round, *args, **kw)

    backend.run_phase = run_phase
    with pytest.raises(NodeLostError, match=r"^the server actor's node \w+ left the cluster \(server \w+\); the run "
                                            r"stops at its last checkpoint: resume it with `fedsim run --resume "
                                            r".*served`$") as err:
        run(cfg, backend)
    assert "\n" not in str(err.value)
    run_dir = Path(cfg.results.root) / "served"
    assert list(load(run_dir)["rounds"]["round"]) == [0]
    _SHAPES[cluster.add_node(num_cpus=2, num_gpus=2).node_id] = (2, 2)  # room again for the server and workers
    cluster.wait_for_nodes()
    res = load(run(resume=run_dir, backend=RayBackend(num_workers=1)))  # any worker count gives the same numbers
    assert list(res["rounds"]["round"]) == [0, 1, 2] and res["rounds"]["accuracy"].notna().all()
    assert (res["clients"]["status"] == "ok").all() and len(res["clients"]) == 3 * 4


def test_more_workers_than_the_cluster_holds_wait_for_a_node(cluster, make_config, caplog, monkeypatch):
    from ray.autoscaler import sdk

    asked: list[list[dict]] = []
    real_request = sdk.request_resources

    def request_resources(bundles):  # what the autoscaler is asked for, passed on to Ray's own call
        asked.append(bundles)
        return real_request(bundles=bundles)

    monkeypatch.setattr(sdk, "request_resources", request_resources)
    worker_nodes(cluster, 1)  # 2 CPUs: 2 workers of 1 CPU
    cfg = make_config("runtime.backend=ray", "runtime.client_cpus=1", "runtime.num_workers=3",
                      "runtime.autoscale_timeout_s=1", "participation.clients_per_round=4", rounds=1)
    t0 = time.monotonic()
    with caplog.at_level(logging.WARNING, logger="fedsim"), pytest.raises(ResourceError) as err:
        run(cfg, RayBackend())
    assert str(err.value) == ("runtime.num_workers=3 but only 2 workers fit with runtime.client_cpus=1.0 and "
                              "runtime.client_gpus=0.0 after waiting runtime.autoscale_timeout_s=1.0")
    assert time.monotonic() - t0 < 60
    assert "waiting up to runtime.autoscale_timeout_s=1.0 for the autoscaler: 2 client workers fit, 3 asked for" \
        in caplog.text
    assert not list(Path(cfg.results.root).glob("*/*"))  # a run that cannot start leaves nothing behind
    assert [len(b) for b in asked] == [3, 0] and all(b.get("CPU") == 1.0 for b in asked[0])  # asked, then withdrawn

    caplog.clear()
    cfg.runtime.autoscale_timeout_s = 120
    out: dict = {}

    def start_run() -> None:
        try:
            out["run_dir"] = run(cfg, RayBackend())
        except BaseException as exc:  # handed to the test's thread
            out["error"] = exc

    # the run waits in a thread; the "autoscaler" (this thread: Ray starts nodes from the main thread only)
    # adds a node once the wait has begun
    with caplog.at_level(logging.WARNING, logger="fedsim"):
        waiting = threading.Thread(target=start_run)
        waiting.start()
        end = time.monotonic() + 120
        while "for the autoscaler" not in caplog.text and waiting.is_alive() and time.monotonic() < end:
            time.sleep(0.2)
        assert waiting.is_alive(), out
        cluster.add_node(num_cpus=2, num_gpus=0)
        waiting.join(timeout=300)
    assert "error" not in out, out
    res = load(out["run_dir"])
    assert res["meta"]["num_workers"] == 3 and len(res["meta"]["workers_per_node"]) == 2
    assert "for the autoscaler: 2 client workers fit, 3 asked for" in caplog.text
    assert "the cluster holds 4 client workers after" in caplog.text  # the new node's two and the first's
