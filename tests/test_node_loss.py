"""What the Ray pool does with the workers of a node that left, without a cluster: where their clients go, and
how long it waits for room (once per lost node)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

import actors.pool as pool
from actors.pool import RayBackend
from fedsim.errors import FedsimError


class NoRoom:
    """A placement in which no lost worker fits again: each look-up records its grace and waits it out on a clock
    of its own (the pool's `time.monotonic`)."""

    def __init__(self) -> None:
        self.graces: list[float] = []
        self.now = 1000.0

    def fits(self, index: int, grace_s: float) -> bool:
        self.graces.append(grace_s)
        self.now += grace_s
        return False


def lost_node_backend(monkeypatch, make_config, nodes: list[str]) -> tuple[RayBackend, NoRoom]:
    """A started-looking pool with one worker per entry of `nodes` (its node id); the first node is the lost one."""
    monkeypatch.setattr(pool, "await_marked_dead", lambda node, limit: None)
    monkeypatch.setattr(pool, "alive_nodes", lambda: set(nodes) - {nodes[0]})
    backend = RayBackend()
    backend.cfg = make_config("runtime.startup_timeout_s=30")
    backend.workers = [f"actor{i}" for i in range(len(nodes))]
    backend.placement = [{"index": i, "node_id": n} for i, n in enumerate(nodes)]
    backend._host, backend._holds = list(range(len(nodes))), [True] * len(nodes)
    where = backend._where = NoRoom()
    monkeypatch.setattr(pool, "time", SimpleNamespace(monotonic=lambda: where.now))
    return backend, where


def test_the_workers_of_one_lost_node_wait_for_room_once(monkeypatch, make_config):
    backend, where = lost_node_backend(monkeypatch, make_config, ["dead" * 4, "dead" * 4, "live" * 4])
    assert backend._replace_lost(0) == ([0], "no node has room for worker 0: its clients move to worker 2 (the pool "
                                             "shrinks to 2 workers)")
    assert backend._replace_lost(1) == ([1], "no node has room for worker 1: its clients move to worker 2 (the pool "
                                             "shrinks to 1 workers)")
    assert where.graces == [10.0, 0.0]  # min(startup_timeout_s, 10 s), then the same wait, over: a look-up
    assert backend._host == [2, 2, 2] and backend.workers == ["actor2"] * 3  # both slots served by the survivor
    assert backend.placement[0]["hosted_by"] == 2 and backend.placement[1]["hosted_by"] == 2


def test_each_lost_node_gets_its_own_wait(monkeypatch, make_config):
    backend, where = lost_node_backend(monkeypatch, make_config, ["a" * 16, "b" * 16, "c" * 16])
    monkeypatch.setattr(pool, "alive_nodes", lambda: {"c" * 16})
    backend._replace_lost(0)
    backend._replace_lost(1)
    assert where.graces == [10.0, 10.0]


def test_no_survivor_left_is_one_error(monkeypatch, make_config):
    backend, _ = lost_node_backend(monkeypatch, make_config, ["dead" * 4])
    with pytest.raises(FedsimError, match="worker 0 was lost with its node and no worker on a live node is left"):
        backend._replace_lost(0)


def test_workers_on_live_nodes_start_again_together_and_a_lost_nodes_alone(monkeypatch, make_config):
    """Three failed workers: two on live nodes are created, then attached in one wait (each start imports torch);
    the one whose node left goes through the lost-node path; the slots returned are all three."""
    backend, _ = lost_node_backend(monkeypatch, make_config, ["dead" * 4, "live" * 4, "live" * 4, "live" * 4])
    monkeypatch.setattr(pool, "node_gone", lambda node, error: node == "dead" * 4)
    killed, created, attached = [], [], []
    monkeypatch.setattr(pool.ray, "kill", lambda actor, no_restart: killed.append(actor))
    monkeypatch.setattr(backend, "_create", lambda i: created.append(i) or f"new{i}")

    def attach(indices):
        attached.append(list(indices))
        return [{"index": i, "node_id": "live" * 4, "pid": 100 + i} for i in indices]

    monkeypatch.setattr(backend, "_attach", attach)
    restarted = backend.restart_workers([3, 0, 1])
    assert restarted.slots == [0, 1, 3]
    assert killed == ["actor1", "actor3"] and created == [1, 3] and attached == [[1, 3]]
    assert backend.workers[1:] == ["new1", "actor2", "new3"] and backend.placement[3]["pid"] == 103
    # worker 0's node had no room: its clients moved to worker 1, which then started again itself: slot 0 follows
    # the new actor (not the killed one), and meta.json's placement of slot 0 names the new process
    assert backend._host[0] == 1 and backend.workers[0] == "new1" and backend.worker_of(0) == 1
    assert backend.placement[0] == {"index": 0, "node_id": "live" * 4, "pid": 101, "hosted_by": 1}
    assert restarted.events == [f"node {'dead' * 3} left the cluster: no node has room for worker 0: its clients "
                                "move to worker 1 (the pool shrinks to 3 workers)", "workers 1, 3 started again"]


class Cluster:
    """Ray's resource views, on a clock of its own: what the live nodes hold, and what is free."""

    def __init__(self, total: dict[str, float], free: dict[str, float]) -> None:
        self.total, self.free, self.now, self.polls = total, free, 0.0, 0

    def cluster_resources(self) -> dict[str, float]:
        return dict(self.total)

    def available_resources(self) -> dict[str, float]:
        self.polls += 1
        return dict(self.free)

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@pytest.mark.parametrize("free, returns", [({"CPU": 2.0}, True), ({"CPU": 1.0}, False)])
def test_the_wait_for_released_resources_asks_no_more_than_the_live_nodes_hold(monkeypatch, free, returns):
    """A run gave back 3 CPUs, 2 of them on a node that left meanwhile: the 2 CPUs the live nodes hold are all
    that can come back, and once they are free the wait ends at once; while they are not, it waits its limit."""
    ray = Cluster(total={"CPU": 2.0}, free=free)
    monkeypatch.setattr(pool, "ray", ray)
    monkeypatch.setattr(pool, "time", SimpleNamespace(monotonic=lambda: ray.now, sleep=ray.sleep))
    pool.wait_released({"CPU": 0.0}, {"CPU": 3.0, "GPU": 0.0}, 5.0)
    if returns:
        assert ray.polls == 1 and ray.now == 0.0
    else:
        assert ray.polls > 50 and ray.now >= 5.0


def test_a_run_that_gave_nothing_back_does_not_ask_ray(monkeypatch):
    """A Ray the run stops itself (or one already stopped) is not asked anything: no share, no wait."""
    monkeypatch.setattr(pool, "ray", SimpleNamespace())  # any call would raise AttributeError
    pool.wait_released({}, {}, 5.0)
    pool.wait_released({"CPU": 1.0}, {"CPU": 0.0, "GPU": 0.0}, 5.0)


def test_a_raylet_answers_while_its_port_accepts_and_not_once_its_node_is_killed_or_dead(monkeypatch):
    """A killed node's port refuses at once, seconds before the cluster's health checks mark it dead."""
    import socket

    import ray

    from actors.node_loss import node_gone, raylet_answers

    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        nodes = [{"NodeID": "up", "Alive": True, "NodeManagerAddress": "127.0.0.1",
                  "NodeManagerPort": listening.getsockname()[1]},
                 {"NodeID": "killed", "Alive": True, "NodeManagerAddress": "127.0.0.1",
                  "NodeManagerPort": closed.getsockname()[1]},
                 {"NodeID": "dead", "Alive": False, "NodeManagerAddress": "127.0.0.1",
                  "NodeManagerPort": listening.getsockname()[1]}]
        monkeypatch.setattr(ray, "nodes", lambda: nodes)
        assert raylet_answers("up") and not node_gone("up")
        assert not raylet_answers("killed") and node_gone("killed")
        assert not raylet_answers("dead") and not raylet_answers("never-there")
