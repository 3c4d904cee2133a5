"""A FedAvg whose client 2 raises in round 1, to test how one client's failure is reported, locally and on Ray.

Ray workers import this module through `FailingClientRayBackend`'s worker class, so the algorithm is registered in
their processes too.
"""

from __future__ import annotations

from actors.client_worker import ClientWorkerActor
from actors.pool import RayBackend
from fedsim.algorithms.fedavg import FedAvg
from fedsim.method.contract import register_algorithm

FAILING_CLIENT, FAILING_ROUND = 2, 1


@register_algorithm
class FailingClientFedAvg(FedAvg):
    """FedAvg, but client FAILING_CLIENT's step raises ZeroDivisionError in round FAILING_ROUND."""

    name = "fedavg_failing_client"

    def local_training(self, phase, state, msg, ctx):
        if (ctx.client_id, ctx.round) == (FAILING_CLIENT, FAILING_ROUND):
            raise ZeroDivisionError(f"client {ctx.client_id} divided by zero")
        return super().local_training(phase, state, msg, ctx)


class FailingClientWorkerActor(ClientWorkerActor):
    """The usual worker actor, defined here so that its process imports (and registers) the algorithm above."""


class FailingClientRayBackend(RayBackend):
    worker_cls = FailingClientWorkerActor
