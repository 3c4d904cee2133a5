"""The server side of a run: holds the algorithm's state, builds broadcasts, aggregates, evaluates.

A plain class: the Ray layer wraps it in the ServerActor (with its own GPU fraction); the local backend
calls it directly.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsim import rng
from fedsim.errors import ConfigError
from fedsim.method.contract import (
    ClientContext,
    ClientData,
    ClientResult,
    Message,
    Phase,
    RoundInfo,
    SummedUpdate,
    Updates,
    get_algorithm,
)
from fedsim.method.sums import WeightedSum
from fedsim.runtime.backend import BroadcastReply, EvalReply, Measurement, StepReply
from fedsim.runtime.precision import set_cuda_math
from fedsim.runtime.setup import AnyPartition, as_tensor, build_env
from fedsim.runtime.store import state_nbytes
from fedsim.runtime.worker import ModelPool, WorkerReply, pick_device
from fedsim.transforms import build_chain
from fedsim.transforms.download import Downloads, compresses, split_state
from fedsim.transforms.updates import update_of

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig


def hold_out_root(cfg: RunConfig, x_test: torch.Tensor,
                  y_test: torch.Tensor) -> tuple[ClientData, torch.Tensor, torch.Tensor]:
    """FLTrust's root set: aggregator.root_samples test samples drawn by the stream `fltrust-root`; the accuracy is
    scored on the rest (a ConfigError when nothing would be left)."""
    n, k = int(y_test.shape[0]), cfg.aggregator.root_samples
    if k >= n:
        raise ConfigError(f"aggregator.root_samples: {k} leaves none of the test set's {n} samples to score on")
    order = torch.from_numpy(rng.numpy_generator(cfg.seed, "fltrust-root").permutation(n)).to(x_test.device)
    root, rest = order[:k].sort().values, order[k:].sort().values
    empty = root[:0]
    data = ClientData(x_test[root], y_test[root], x_test[empty], y_test[empty])
    return data, x_test[rest], y_test[rest]


class Server:
    """Owns the global state; every method is called by the round loop, in order (fedsim.runtime.backend.ServerAPI)."""

    def __init__(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
                 device: str | None = None, threads: int | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        from fedsim.data import Dataset

        self.device = torch.device(device) if device else pick_device()
        set_cuda_math(self.device, cfg.runtime.tf32)
        data = Dataset.of_arrays(cfg.data.name, arrays, meta)
        self.env = build_env(cfg, data, part, self.device)
        self.env.extras.setdefault("server_data", data)
        self.env.extras.setdefault("partition", part)
        self.algorithm = get_algorithm(cfg.algorithm.name)(cfg.algorithm.params, self.env)
        self.x_test = as_tensor(arrays["x_test"], self.device)
        self.y_test = as_tensor(arrays["y_test"], self.device)
        self.root: ClientData | None = None  # fltrust: the server's root set, held out of the test set
        if cfg.aggregator.name == "fltrust":
            self.root, self.x_test, self.y_test = hold_out_root(cfg, self.x_test, self.y_test)
            self.models = ModelPool(self.env, self.device)
        self.state = self.algorithm.init_server(self.env)
        # the update chain's server side (fedsim.transforms): noise, model attacks, the robust aggregator
        self.chain = build_chain(cfg, solve=True, data=data, env=self.env)
        robustness = self.chain.robustness
        self.triggered = robustness.triggered_test(self.x_test, self.y_test) \
            if robustness is not None and cfg.attack.kind == "backdoor" else None
        # compressed downloads (fedsim.transforms.download): the replica the clients train from
        self.downloads = Downloads(cfg, self.env.archs, cfg.data.num_clients) \
            if cfg.compression.download != "none" else None
        self.sent: dict[str, Any] = {}  # each chain phase's broadcast, what its clients' updates are relative to
        self.cohorts: dict[str, list[int]] = {}  # each chain phase's broadcast's clients

    def ping(self) -> dict[str, Any]:
        import os

        return {"pid": os.getpid(), "device": str(self.device)}

    def phases(self, round: int) -> list[Phase]:
        return self.algorithm.phases(round)

    def broadcast(self, phase: Phase, info: RoundInfo) -> BroadcastReply:
        """The phase's broadcast, its common size in bytes, per-client extra bytes, and seconds taken."""
        t0 = time.perf_counter()
        bc = self.algorithm.broadcast(phase, self.state, info)
        per = {cid: state_nbytes(m) for cid, m in (bc.per_client or {}).items()}
        common_bytes, dense = state_nbytes(bc.common), None
        catch_up: dict[int, int] = {}
        if self.downloads is not None and compresses(phase):  # the replica goes out, as its encoded change
            dense = common_bytes
            common, models_bytes, catch_up = self.downloads.send(bc.common, info.round, phase.name,
                                                                 info.participants)
            common_bytes = dense - state_nbytes(self.downloads.replica) + models_bytes  # the rest goes dense
            bc = replace(bc, common=common)
            for cid, extra in catch_up.items():
                per[cid] = per.get(cid, 0) + extra
        if self.chain.applies(phase):
            self.sent[phase.name] = bc.common
            self.cohorts[phase.name] = list(info.participants)  # a secure sum's key setup: who the broadcast reaches
            bc.chain = self.chain.for_clients(info.participants)
            if self.chain.secure is not None:  # the protocol's keys and shares, down to each client
                refs = {a: self.algorithm.upload_reference(phase, bc.common, a) for a in self.env.archs}
                d = sum(v.numel() for r in refs.values() for v in r.values() if v.is_floating_point())
                for cid, extra in self.chain.secure.extra_down(info.participants, d).items():
                    per[cid] = per.get(cid, 0) + extra
        return BroadcastReply(bc, common_bytes, per, time.perf_counter() - t0, dense, catch_up)

    def synced(self, clients: list[int]) -> None:
        """The clients that downloaded the last compressed broadcast (they now hold the replica)."""
        if self.downloads is not None:
            self.downloads.synced_now(clients)

    def step(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> StepReply:
        """Aggregate the arrived results of a phase into the state; its metrics and seconds."""
        t0 = time.perf_counter()
        per_client = self.chain.per_client(phase)
        if phase.reduce == "sum" and not per_client:
            total = WeightedSum()
            for r in replies:  # worker order; the double-double sum makes the order immaterial
                if r.summed is not None:
                    total.merge(r.summed)
            updates: Updates = SummedUpdate(total.totals(), total.weight, total.count)
        else:
            updates = arrived_results(replies)
        columns: dict[str, Any] = {}
        per: dict[int, dict[str, Any]] = {}
        if self.chain.applies(phase):
            common = self.sent.pop(phase.name)
            references = {a: self.algorithm.upload_reference(phase, common, a) for a in self.env.archs}
            if per_client:
                assert isinstance(updates, dict)
                if self.root is not None:
                    self.chain.robustness.root = self.root_update(phase, common, references, info.round)  # type: ignore[union-attr]
                updates, columns, per = self.chain.server_each(updates, references, info.round, phase.name)
            else:
                assert isinstance(updates, SummedUpdate)
                updates, columns = self.chain.server(updates, references, info.round, phase.name,
                                                     self.cohorts.pop(phase.name, []), info.arrived)
        if self.chain.sample is not None and self.chain.applies(phase):  # each client's epsilon, late ones too
            trained = {o.client_id: o.result.metrics for r in replies for o in r.outcomes
                       if o.status in ("ok", "late") and o.result is not None}
            spent, epsilons = self.chain.account(trained)
            columns = {**columns, **spent}
            per = {c: {**per.get(c, {}), **epsilons.get(c, {})} for c in per.keys() | epsilons.keys()}
        self.state, metrics = self.algorithm.server_step(phase, self.state, updates, info)
        return StepReply(dict(metrics or {}), time.perf_counter() - t0, columns, per)

    def root_update(self, phase: Phase, common: Any, references: dict[str, dict[str, torch.Tensor]],
                    round: int) -> dict[str, torch.Tensor]:
        """FLTrust's reference direction: the update the method's own client step makes on the server's root set,
        from the round's broadcast (seeded by the stream `fltrust-root` at the round)."""
        arch = self.env.archs[0]
        ctx = ClientContext(client_id=-1, round=round, phase=phase.name, arch=arch, data=self.root,  # type: ignore[arg-type]
                            device=self.device, seed=rng.seed(self.env.config.seed, "fltrust-root", round),
                            models=self.models, env=self.env)
        res = self.algorithm.client_step(phase, None, Message(common=common), ctx)
        return update_of(res.payload, arch, references[arch])

    def measure(self, round: int) -> Measurement | None:
        """The method's evaluation-only phase before this evaluation (Algorithm.measurement) with its broadcast, or
        None when it has none or it reaches no client."""
        t0 = time.perf_counter()
        got = self.algorithm.measurement(self.state)
        if got is None or not got[1]:
            return None
        phase, clients = got
        n = self.env.num_samples
        info = RoundInfo(round, phase.name, list(clients), list(clients), {c: int(n[c]) for c in clients})
        bc = self.algorithm.handler(phase, "broadcast")(self.state, info)
        return Measurement(phase, bc, info, time.perf_counter() - t0)

    def measured(self, phase: Phase, replies: list[WorkerReply], info: RoundInfo) -> float:
        """Fold the measurement's results (its clients that answered) into the state; the seconds taken."""
        t0 = time.perf_counter()
        self.state, _ = self.algorithm.handler(phase, "server")(self.state, arrived_results(replies), info)
        return time.perf_counter() - t0

    def evaluate(self) -> EvalReply:
        """Rows of test metrics, one per global model; and seconds taken."""
        t0 = time.perf_counter()
        rows = list(self.algorithm.evaluate(self.state, self.x_test, self.y_test, self.device) or [])
        if self.triggered is not None:  # the backdoor's success rate: accuracy on the triggered, relabelled set
            scored = self.algorithm.evaluate(self.state, *self.triggered, self.device) or []
            for row, hit in zip(rows, scored):
                if "accuracy" in hit:
                    row["attack/success_rate"] = hit["accuracy"]
        return EvalReply(rows, time.perf_counter() - t0)

    def finished(self, round: int) -> bool:
        return bool(self.algorithm.finished(self.state, round)) or self.chain.finished(round)

    def get_state(self) -> Any:
        return self.state

    def set_state(self, state: Any) -> None:
        self.state = state

    def chain_state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the update chain beyond its columns (centred clipping's centre)."""
        state = self.chain.state()
        return state if self.downloads is None else {**state, **self.downloads.state()}

    def resume_chain(self, columns: dict[str, float], state: dict[str, torch.Tensor] | None = None) -> None:
        """The update chain's state after the last saved round, from that round's row (the adaptive clip) and the
        checkpoint's chain state."""
        chain, down = split_state(state or {})
        if self.downloads is not None:
            self.downloads.load(down)
        self.chain.resume(columns, chain)


def arrived_results(replies: list[WorkerReply]) -> dict[int, ClientResult]:
    """The results of the clients whose outcome is ok, by client id in order."""
    got = {o.client_id: o.result for r in replies for o in r.outcomes if o.status == "ok" and o.result is not None}
    return dict(sorted(got.items()))
