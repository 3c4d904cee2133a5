"""Whether a worker whose node was lost can start again elsewhere (actors.placement.WorkerPlacement.fits), on a
simulated cluster and clock: where Ray has re-placed the worker's bundle or has room for it, the answer waits
for it; where the bundle is placed nowhere and no node has room, no answer is waited for past the settling time."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import ray

import actors.placement as placement
from actors.placement import NO_ROOM_SETTLE_S, WorkerPlacement

GROUP = "ab12"
GRACE_S = 10.0


class Clock:
    """time.monotonic and time.sleep of a clock that moves only when slept on."""

    def __init__(self) -> None:
        self.now = 100.0

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class Cluster:
    """Two live nodes a and b (and a dead one): from `placed_at` seconds on, the group table puts bundle 0 on b,
    and from `reported_at` on, its group resources show there as free; b has `raw_cpu` CPUs free outside it."""

    def __init__(self, clock: Clock, raw_cpu: float, placed_at: float | None, reported_at: float | None) -> None:
        self.clock, self.raw_cpu, self.placed_at = clock, raw_cpu, placed_at
        self.reported_at = placed_at if reported_at is None else reported_at
        self.start = clock.now

    def _since(self, at: float | None) -> bool:
        return at is not None and self.clock.now - self.start >= at

    def placed(self) -> bool:
        return self._since(self.placed_at)

    def free(self) -> dict[str, dict[str, float]]:
        b = {"CPU": self.raw_cpu}
        if self._since(self.reported_at):
            b.update({f"CPU_group_0_{GROUP}": 1.0, f"CPU_group_{GROUP}": 1.0})
        return {"a": {"CPU": 0.0}, "b": b, "dead": {"CPU": 4.0}}

    def free_total(self) -> dict[str, float]:
        """What `ray.available_resources()` reports: the live nodes' free resources, summed."""
        total: dict[str, float] = {}
        for node, free in self.free().items():
            if node != "dead":
                for k, v in free.items():
                    total[k] = total.get(k, 0.0) + v
        return total

    def table(self, group) -> dict:
        return {"state": "CREATED" if self.placed() else "RESCHEDULING",
                "bundles_to_node_id": {0: "b" if self.placed() else "", 1: "a"}}


@pytest.fixture
def cluster(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(placement, "time", clock)
    monkeypatch.setattr(placement, "alive_nodes", lambda: {"a", "b"})

    def make(raw_cpu: float, placed_at: float | None, owned: bool = True, grouped: bool = True,
             reported_at: float | None = None):
        c = Cluster(clock, raw_cpu, placed_at, reported_at)
        monkeypatch.setattr(ray, "available_resources", c.free_total)
        monkeypatch.setattr(ray.util, "placement_group_table", c.table)
        group = SimpleNamespace(id=SimpleNamespace(hex=lambda: GROUP)) if grouped else None
        rt = SimpleNamespace(client_cpus=1.0, client_gpus=0.0)
        return WorkerPlacement(rt, group, owned=owned), clock

    return make


def test_a_bundle_placed_nowhere_with_room_nowhere_is_given_up_after_the_settling_time(cluster):
    where, clock = cluster(raw_cpu=0.0, placed_at=None)
    t0 = clock.now
    assert where.fits(0, GRACE_S) is False
    assert NO_ROOM_SETTLE_S <= clock.now - t0 <= NO_ROOM_SETTLE_S + 0.5  # not the whole grace


def test_a_re_placed_bundle_is_waited_for_until_its_resources_show(cluster):
    where, clock = cluster(raw_cpu=0.0, placed_at=0.0, reported_at=2.5)  # placed on b; reported 2.5 s later
    t0 = clock.now
    assert where.fits(0, GRACE_S) is True and clock.now - t0 >= 2.5


def test_room_on_a_live_node_is_waited_for_until_ray_places_the_bundle_there(cluster):
    where, clock = cluster(raw_cpu=1.0, placed_at=3.0)
    t0 = clock.now
    assert where.fits(0, GRACE_S) is True and clock.now - t0 >= 3.0


def test_room_on_a_live_node_that_ray_never_uses_costs_the_whole_grace(cluster):
    where, clock = cluster(raw_cpu=1.0, placed_at=None)  # room, yet Ray never places the bundle
    t0 = clock.now
    assert where.fits(0, GRACE_S) is False and clock.now - t0 >= GRACE_S


def test_a_captured_group_is_its_owners_to_re_place_so_the_whole_grace_is_waited(cluster):
    where, clock = cluster(raw_cpu=0.0, placed_at=None, owned=False)
    t0 = clock.now
    assert where.fits(0, GRACE_S) is False and clock.now - t0 >= GRACE_S


def test_without_a_group_only_the_live_nodes_free_resources_count(cluster):
    where, clock = cluster(raw_cpu=1.0, placed_at=None, grouped=False)
    assert where.fits(0, GRACE_S) is True and clock.now == 100.0  # b has a free CPU: at once
    where, clock = cluster(raw_cpu=0.0, placed_at=None, grouped=False)  # the dead node's CPUs do not count
    t0 = clock.now
    assert where.fits(0, GRACE_S) is False and clock.now - t0 <= NO_ROOM_SETTLE_S + 0.5


def test_an_unanswered_group_table_waits_for_the_whole_grace(cluster, monkeypatch):
    where, clock = cluster(raw_cpu=0.0, placed_at=None)

    def down(group):
        raise ConnectionError("GCS unreachable")

    monkeypatch.setattr(ray.util, "placement_group_table", down)
    t0 = clock.now
    assert where.fits(0, GRACE_S) is False and clock.now - t0 >= GRACE_S
