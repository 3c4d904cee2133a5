"""Every wait on a Ray actor is bounded by a named config key, and a hung or failing actor is one FedsimError
naming what hung: the server's calls, the workers' and the server's start, and errors the server raises itself."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest

from tests.conftest import ROOT


def test_every_ray_get_in_actors_has_a_timeout():
    calls = []
    for path in sorted((Path(ROOT) / "actors").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                    and isinstance(node.func.value, ast.Name) and node.func.value.id == "ray":
                calls.append((path.name, node.lineno, any(k.arg == "timeout" for k in node.keywords)))
    assert calls and all(has for _, _, has in calls), calls


@pytest.fixture
def stuck(ray_local):
    """A started actor whose calls hang (sleep) or raise, killed after the test."""
    import ray

    from fedsim.errors import AggregationError

    @ray.remote(num_cpus=0)
    class Stuck:
        def ready(self):
            return True

        def ping(self):
            time.sleep(60)

        def attach(self, *args):
            time.sleep(60)

        def phases(self, round):
            time.sleep(60)

        def evaluate(self):
            raise AggregationError("client 3 uploaded 9 logits for 10 classes")

        def finished(self, round):
            raise RuntimeError("lost its model\nsecond line")

    actors = []

    def make():
        actor = Stuck.remote()
        ray.get(actor.ready.remote(), timeout=60)  # started, so the limits measure the calls alone
        actors.append(actor)
        return actor

    yield make
    for actor in actors:
        ray.kill(actor)


def _one_line(call, error, pattern: str, limit_s: float = 20):
    t0 = time.monotonic()
    with pytest.raises(error, match=pattern) as err:
        call()
    assert "\n" not in str(err.value) and time.monotonic() - t0 < limit_s
    return err.value


@pytest.mark.ray
@pytest.mark.slow
def test_a_hung_or_failing_server_actor_is_one_error_naming_the_call(stuck, make_config):
    from actors.pool import RemoteServer
    from fedsim.errors import AggregationError, FedsimError

    cfg = make_config("runtime.round_timeout_s=1", "runtime.startup_timeout_s=2")
    server = lambda: RemoteServer(stuck(), cfg)  # noqa: E731  (a fresh actor: a hung one serves calls in order)
    _one_line(lambda: server().phases(0), FedsimError,
              r"^server phases: no answer within runtime.round_timeout_s=1.0$")
    _one_line(server().ping, FedsimError, r"^server actor start: no answer within runtime.startup_timeout_s=2.0$")
    # an error of fedsim's own, raised inside the actor, arrives as itself
    err = _one_line(server().evaluate, AggregationError, r"^client 3 uploaded 9 logits for 10 classes$")
    assert type(err) is AggregationError
    _one_line(lambda: server().finished(0), FedsimError, r"^server finished failed: RuntimeError: lost its model$")


@pytest.mark.ray
@pytest.mark.slow
def test_a_worker_that_does_not_start_is_named_and_every_worker_is_stopped(stuck, make_config):
    import ray

    from actors.pool import RayBackend
    from fedsim.errors import FedsimError

    backend = RayBackend()
    backend.cfg = make_config("runtime.startup_timeout_s=1")
    backend.workers = [stuck(), stuck()]
    backend._refs = (None, None, {})
    _one_line(lambda: backend._attach([0, 1]), FedsimError,
              r"^client workers 0, 1 did not start: no answer within runtime.startup_timeout_s=1.0$")
    from ray.exceptions import RayActorError

    with pytest.raises(RayActorError):  # killed, not left running
        ray.get(backend.workers[0].ready.remote(), timeout=30)
