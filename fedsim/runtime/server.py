"""The server side of a run: holds the algorithm's state, builds broadcasts, aggregates, evaluates.

A plain class: the Ray layer wraps it in the ServerActor (with its own GPU fraction); the local backend
calls it directly.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsim.method.contract import ClientResult, Phase, RoundInfo, SummedUpdate, Updates, get_algorithm
from fedsim.method.sums import WeightedSum
from fedsim.runtime.backend import BroadcastReply, EvalReply, StepReply
from fedsim.runtime.precision import set_cuda_math
from fedsim.runtime.setup import AnyPartition, as_tensor, build_env
from fedsim.runtime.store import state_nbytes
from fedsim.runtime.worker import WorkerReply, pick_device
from fedsim.transforms import build_chain

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig


class Server:
    """Owns the global state; every method is called by the round loop, in order (fedsim.runtime.backend.ServerAPI)."""

    def __init__(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
                 device: str | None = None, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        from fedsim.data import Dataset

        self.device = torch.device(device) if device else pick_device()
        set_cuda_math(self.device, cfg.runtime.tf32)
        data = Dataset(name=cfg.data.name, num_classes=meta["num_classes"], mean=meta["mean"], std=meta["std"],
                       extras=meta.get("extras", {}), **arrays)
        self.env = build_env(cfg, data, part, self.device)
        self.env.extras.setdefault("server_data", data)
        self.env.extras.setdefault("partition", part)
        self.algorithm = get_algorithm(cfg.algorithm.name)(cfg.algorithm.params, self.env)
        self.x_test = as_tensor(arrays["x_test"], self.device)
        self.y_test = as_tensor(arrays["y_test"], self.device)
        self.state = self.algorithm.init_server(self.env)
        self.chain = build_chain(cfg, solve=True)  # the update chain's server side (fedsim.transforms): noise
        self.sent: dict[str, Any] = {}  # each chain phase's broadcast, what its clients' updates are relative to

    def ping(self) -> dict[str, Any]:
        import os

        return {"pid": os.getpid(), "device": str(self.device)}

    def phases(self, round: int) -> list[Phase]:
        return self.algorithm.phases(round)

    def broadcast(self, phase: Phase, info: RoundInfo) -> BroadcastReply:
        """The phase's broadcast, its common size in bytes, per-client extra bytes, and seconds taken."""
        t0 = time.perf_counter()
        bc = self.algorithm.broadcast(phase, self.state, info)
        if self.chain.applies(phase):
            self.sent[phase.name] = bc.common
            bc.chain = self.chain.for_clients()
        per = {cid: state_nbytes(m) for cid, m in (bc.per_client or {}).items()}
        return BroadcastReply(bc, state_nbytes(bc.common), per, time.perf_counter() - t0)

    def step(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> StepReply:
        """Aggregate the arrived results of a phase into the state; its metrics and seconds."""
        t0 = time.perf_counter()
        if phase.reduce == "sum":
            total = WeightedSum()
            for r in replies:  # worker order; the double-double sum makes the order immaterial
                if r.summed is not None:
                    total.merge(r.summed)
            updates: Updates = SummedUpdate(total.totals(), total.weight, total.count)
        else:
            got: dict[int, ClientResult] = {}
            for r in replies:
                for o in r.outcomes:
                    if o.status == "ok" and o.result is not None:
                        got[o.client_id] = o.result
            updates = dict(sorted(got.items()))
        columns: dict[str, Any] = {}
        if self.chain.applies(phase):
            assert isinstance(updates, SummedUpdate)
            common = self.sent.pop(phase.name)
            references = {a: self.algorithm.upload_reference(phase, common, a) for a in self.env.archs}
            updates, columns = self.chain.server(updates, references, info.round, phase.name)
        self.state, metrics = self.algorithm.server_step(phase, self.state, updates, info)
        return StepReply(dict(metrics or {}), time.perf_counter() - t0, columns)

    def evaluate(self) -> EvalReply:
        """Rows of test metrics, one per global model; and seconds taken."""
        t0 = time.perf_counter()
        rows = self.algorithm.evaluate(self.state, self.x_test, self.y_test, self.device)
        return EvalReply(list(rows or []), time.perf_counter() - t0)

    def finished(self, round: int) -> bool:
        return bool(self.algorithm.finished(self.state, round)) or self.chain.finished(round)

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state

    def resume_chain(self, columns: dict[str, float]) -> None:
        """The update chain's state after the last saved round, from that round's row (the adaptive clip)."""
        self.chain.resume(columns)
