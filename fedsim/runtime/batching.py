"""Training a phase's clients as a group (`runtime.batch_clients`): which phases qualify, the groups, the fallback.

A phase qualifies when it declares `Phase(..., local_training=True)`: its client step is then the method's
`local_training(...)` plan. Its clients are
grouped by architecture, in chunks of `runtime.batch_clients_max`, trained together by fedsim.training.batched,
and finished one by one. Clients that cannot be trained so run each on its own, as without either; why is logged
once per worker and reason.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from fedsim.method.contract import Algorithm, ClientResult, Phase
from fedsim.training.batched import train_together
from fedsim.training.local import LocalTraining

log = logging.getLogger("fedsim.batching")

Done = tuple[ClientResult | None, BaseException | None, float]
"""A client's result (or the exception that failed it) and the wall seconds it took."""


def batching_on(mode: Any, device: torch.device) -> bool:
    """Whether `runtime.batch_clients` (true/"on", false/"off" or "auto") trains clients together on `device`:
    auto means on CUDA only (on CPU one client at a time is faster)."""
    if mode == "auto":
        return device.type == "cuda"
    return mode is True or mode == "on"


def phase_reason(algorithm: Algorithm, phase: Phase) -> str | None:
    """Why the clients of `phase` cannot be trained together, or None when they may be: a phase opts in with
    `Phase(..., local_training=True)`."""
    if not phase.local_training:
        return f"phase {phase.name!r} of {type(algorithm).name!r} does not declare local_training=True"
    return None


class ClientBatcher:
    """One worker's grouped training: the setting, and the reasons it has already logged."""

    def __init__(self, mode: Any, max_clients: int, device: torch.device, worker_index: int = 0) -> None:
        """`mode`: runtime.batch_clients."""
        self.on = batching_on(mode, device)
        self.level = logging.INFO if mode == "auto" else logging.WARNING  # asked for explicitly: worth a warning
        self.max_clients = max(1, int(max_clients))
        self.worker_index = worker_index
        self.said: set[str] = set()
        self.trained = 0  # client steps the batched trainer has run (a group that fell back one by one: none)

    def note(self, reason: str) -> None:
        """Log once per reason that some clients run one after another."""
        if reason not in self.said:
            self.said.add(reason)
            log.log(self.level, "worker %d: clients run one after another: %s", self.worker_index, reason)

    def run(self, algorithm: Algorithm, phase: Phase, client_ids: Sequence[int], archs: Sequence[str],
            plan_for: Callable[[int], LocalTraining | None]) -> Iterator[tuple[int, Done]]:
        """Run the clients of `phase` that can be trained together, yielding each one's outcome chunk by chunk (so
        a chunk's results can be settled before the next is trained); the others are not yielded (the worker runs
        their client step as usual). `plan_for(cid)` builds a client's LocalTraining."""
        reason = phase_reason(algorithm, phase)
        if reason is not None:
            self.note(reason)
            return
        for arch in dict.fromkeys(archs[c] for c in client_ids):
            ids = [c for c in client_ids if archs[c] == arch]
            for i in range(0, len(ids), self.max_clients):
                plans: dict[int, LocalTraining] = {}
                seconds: dict[int, float] = {}
                for cid in ids[i:i + self.max_clients]:
                    t0 = time.perf_counter()
                    try:
                        plan = plan_for(cid)
                    except Exception as exc:  # fails this client only, as its client step would
                        yield cid, (None, exc, time.perf_counter() - t0)
                        continue
                    if plan is not None:
                        plans[cid], seconds[cid] = plan, time.perf_counter() - t0
                yield from self.train(plans, seconds)

    def train(self, plans: dict[int, LocalTraining], seconds: dict[int, float]) -> Iterator[tuple[int, Done]]:
        """Train `plans` together and finish each, yielding each client's outcome as soon
        as it is finished (a finished client's payload may view the shared model, which the next one's finish
        overwrites); each on its own when they cannot be trained as a group."""
        if not plans:
            return
        t0 = time.perf_counter()
        try:
            trained = train_together(list(plans.values()))
        except Exception as exc:
            self.note(f"{type(exc).__name__}: {(str(exc).splitlines() or [''])[0]}")
            for cid, plan in plans.items():
                yield cid, _alone(plan, seconds[cid])
            return
        elapsed = time.perf_counter() - t0
        self.trained += len(trained)
        total = sum(t.samples for t in trained)
        for (cid, plan), t in zip(plans.items(), trained):
            t1 = time.perf_counter()
            share = elapsed * (t.samples / total if total else 1 / len(trained))
            res: ClientResult | None = None
            err: BaseException | None = None
            try:
                if t.error is not None:
                    raise t.error
                res = plan.complete(t.state, t.metrics, t.momentum, t.finite)
            except Exception as exc:
                err = exc
            yield cid, (res, err, seconds[cid] + share + time.perf_counter() - t1)


def _alone(plan: LocalTraining, seconds: float) -> Done:
    t0 = time.perf_counter()
    try:
        return plan.run(), None, seconds + time.perf_counter() - t0
    except Exception as exc:
        return None, exc, seconds + time.perf_counter() - t0
