"""ClientWorker: hosts many virtual clients (shard indices + personal state) and runs them one after another, or
same-architecture clients of plain local training together (fedsim.runtime.batching).

A plain class: the Ray layer wraps it in an actor, tests and the local backend call it directly. The
dataset is held once per worker on its device; one model instance per architecture is reused.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar, overload

import numpy as np
import torch

from fedsim import rng
from fedsim.errors import ClientFailedError, ConfigError, OutOfMemory
from fedsim.memory import is_out_of_memory
from fedsim.method.contract import Algorithm, ClientContext, ClientResult, Env, Message, Phase, get_algorithm
from fedsim.method.sums import WeightedSum
from fedsim.runtime.batching import ClientBatcher
from fedsim.runtime.precision import set_cuda_math
from fedsim.runtime.setup import CLIENT_STREAM, AnyPartition, as_tensor, build_env, client_data, client_seed
from fedsim.runtime.store import ClientStateStore, state_nbytes
from fedsim.training.local import DROPOUT_STREAM
from fedsim.transforms import build_chain
from fedsim.transforms.compression import BYTES_UP as COMPRESSED_BYTES_UP
from fedsim.transforms.secure import BYTES_UP as SECAGG_BYTES_UP

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.models import Classifier

M = TypeVar("M", bound=torch.nn.Module)


class ModelPool:
    """One reusable module per architecture (or custom key) on the worker's device."""

    def __init__(self, env: Env, device: torch.device) -> None:
        self.env, self.device = env, device
        self._models: dict[str, torch.nn.Module] = {}

    @overload
    def get(self, key: str) -> Classifier: ...
    @overload
    def get(self, key: str, build: Callable[[], M]) -> M: ...

    def get(self, key: str, build: Callable[[], torch.nn.Module] | None = None) -> torch.nn.Module:
        """The instance for `key`; classifiers are built from the registry, anything else by `build` (a key is
        always built by the same `build`, so it keeps the type that `build` returns). The build's draws leave
        torch's global stream where it was: the client step that happens to build it draws what the others do."""
        if key not in self._models:
            if build is None:
                from fedsim.method.toolkit import new_model

                build = lambda: new_model(self.env, key)  # noqa: E731
            with torch.random.fork_rng(devices=[]):
                self._models[key] = build().to(self.device)
        return self._models[key]

    def storages(self) -> set[int]:
        """Where the pooled modules' parameters and buffers live (storage addresses): what a client's result may
        view but the worker must copy before it keeps it, since the next client trains in the same tensors."""
        return {t.untyped_storage().data_ptr() for m in self._models.values()
                for t in (*m.parameters(), *m.buffers())}


@dataclass
class ClientOutcome:
    """One client's result in one phase, as the worker reports it."""

    client_id: int
    status: str  # ok | late | failed
    result: ClientResult | None = None
    bytes_up: int = 0
    seconds: float = 0.0
    error: ClientFailedError | None = None  # why a failed client failed


@dataclass
class WorkerReply:
    """What a worker returns for a phase: per-client outcomes, and the pre-summed payload for reduce=sum."""

    outcomes: list[ClientOutcome]
    summed: WeightedSum | None = None
    seconds: float = 0.0
    info: dict[str, Any] = field(default_factory=dict)


def pick_device(gpu_ids: list | None = None) -> torch.device:
    """CUDA when this process was given a GPU, else CPU."""
    if torch.cuda.is_available() and (gpu_ids is None or len(gpu_ids) > 0):
        return torch.device("cuda")
    return torch.device("cpu")


class ClientWorker:
    """Runs the client side of each phase for the clients it owns."""

    def __init__(self, cfg: RunConfig, arrays: dict[str, np.ndarray], part: AnyPartition, meta: dict[str, Any],
                 worker_index: int, device: str | None = None, threads: int | None = None,
                 spill_dir: str | None = None) -> None:
        if threads:
            torch.set_num_threads(threads)
        self.index = worker_index
        self.device = torch.device(device) if device else pick_device()
        set_cuda_math(self.device, cfg.runtime.tf32)
        from fedsim.data import Dataset

        data = Dataset.of_arrays(cfg.data.name, arrays, meta)
        self.part = part
        self.env = build_env(cfg, data, part, self.device)
        self.env.extras.setdefault("eval_data", data)  # the test subset of evaluation-only mechanism columns
        self.algorithm: Algorithm = get_algorithm(cfg.algorithm.name)(cfg.algorithm.params, self.env)
        self.data_t = {k: as_tensor(v, self.device) for k, v in arrays.items()}
        self.models = ModelPool(self.env, self.device)
        cache = cfg.runtime.cache_bytes
        self.store = ClientStateStore(cache, spill_dir if cache is not None else None)
        self.seed = cfg.seed
        rt = cfg.runtime
        self.exact_sum = rt.exact_sum
        self.batcher = ClientBatcher(rt.batch_clients, rt.batch_clients_max, self.device, worker_index)
        self.kept_state: list[int] = []  # clients whose state a phase committed (checked for a stateless method)
        self.chain = build_chain(cfg, data=data, env=self.env)  # the update chain's client side (fedsim.transforms)

    def ping(self) -> dict[str, Any]:
        """Health check and placement facts (pid, device, visible GPU ids)."""
        return {"index": self.index, "pid": os.getpid(), "device": str(self.device),
                "cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES", "")}

    def run_phase(self, round: int, phase_index: int, phase: Phase, common: Any, per_client: dict[int, Any],
                  client_ids: list[int], late: list[int] | None = None,
                  chain: dict[str, Any] | None = None) -> WorkerReply:
        """Run `phase` for `client_ids` (sorted). Clients in `late` run (their time and metrics count), but their
        state is not committed and their upload is dropped here: the server reads only the clients that arrived."""
        start = time.perf_counter()
        late_set = set(late or ())
        # a GPU worker sums its clients' uploads where they were trained, and hands the sum over on the CPU
        # (unless the update chain needs each client's update: a robust aggregator, a model attack)
        summed = WeightedSum(exact=self.exact_sum, device=self.device) \
            if phase.reduce == "sum" and not self.chain.per_client(phase) else None
        ids = sorted(client_ids)
        for stream in (CLIENT_STREAM, DROPOUT_STREAM):  # each client's seeds of the phase, derived all at once
            rng.prefetch(self.seed, stream, round, ids, phase_index)

        def context(cid: int) -> ClientContext:
            return ClientContext(client_id=cid, round=round, phase=phase.name, arch=self.env.client_archs[cid],
                                 data=self.chain.poison(cid, client_data(self.data_t, self.part, cid)),
                                 device=self.device,
                                 seed=client_seed(self.seed, round, cid, phase_index), models=self.models,
                                 env=self.env, phase_index=phase_index,
                                 dp_sgd=self.chain.dp_sgd(chain or {}, round, cid, phase.name, phase_index))

        outcomes: dict[int, ClientOutcome] = {}
        transform = self._chain_for(phase, common, round, chain or {})
        batched_before = self.batcher.trained
        self.kept_state = []
        if self.batcher.on and not phase.measure:  # clients trained together, settled chunk by chunk
            for cid, (res, exc, seconds) in self.batcher.run(self.algorithm, phase, ids, self.env.client_archs, (
                    lambda c: self.algorithm.local_training(phase, self.store.get(c), _merge(common, per_client, c),
                                                            context(c)))):
                outcomes[cid] = self._settle(cid, "late" if cid in late_set else "ok", res, exc,
                                             time.perf_counter() - seconds, summed, round, phase.name, transform)
        # an evaluation-only phase calls the handler it names (a method's own client_step would train) and keeps no
        # state: the clients' states are read, never changed
        step = self.algorithm.handler(phase, "client") if phase.measure else \
            (lambda state, msg, ctx: self.algorithm.client_step(phase, state, msg, ctx))
        for cid in ids:
            if cid in outcomes:
                continue
            t0 = time.perf_counter()
            try:
                # torch's global stream (dropout masks) seeded per client, as the batched path seeds each client's
                with rng.global_streams(rng.seed(self.seed, DROPOUT_STREAM, round, cid, phase_index), self.device):
                    res, exc = step(self.store.get(cid), _merge(common, per_client, cid), context(cid)), None
                if phase.measure and res is not None:
                    res.state = None
            except Exception as err:  # one client's failure must not sink the round
                res, exc = None, err
            outcomes[cid] = self._settle(cid, "late" if cid in late_set else "ok", res, exc, t0, summed, round,
                                         phase.name, transform)
        return WorkerReply([outcomes[cid] for cid in ids], summed.to_cpu() if summed is not None else None,
                           time.perf_counter() - start,
                           info={"cache_bytes": self.store.memory_bytes, "spills": self.store.spills,
                                 "states": len(self.store), "batched": self.batcher.trained - batched_before,
                                 "kept_state": self.kept_state[:1]})

    def _chain_for(self, phase: Phase, common: Any, round: int,
                   settings: dict[str, Any]) -> Callable[[int, ClientResult], ClientResult] | None:
        """The update chain's client side for this phase (None where it does not apply), each architecture's
        reference taken from the broadcast once."""
        if not self.chain.applies(phase):
            return None
        references: dict[str, dict[str, torch.Tensor]] = {}

        def transform(cid: int, res: ClientResult) -> ClientResult:
            arch = self.env.client_archs[cid]
            if arch not in references:
                references[arch] = self.algorithm.upload_reference(phase, common, arch)
            return self.chain.client(res, arch, references[arch], round, cid, phase.name, settings.get("clip"),
                                     settings.get("secagg_cohort", ()))

        return transform

    def _settle(self, cid: int, status: str, res: ClientResult | None, exc: BaseException | None, t0: float,
                summed: WeightedSum | None, round: int, phase: str,
                transform: Callable[[int, ClientResult], ClientResult] | None = None) -> ClientOutcome:
        """A client's outcome from its result (or error): checked, pre-summed and its state committed unless late;
        `transform`: the update chain's client side."""
        sent = 0
        if exc is None:
            try:
                assert res is not None
                sent = state_nbytes(res.payload)  # what the client uploads (the chain's float64 sum entries aside)
                if transform is not None:
                    res = transform(cid, res)
                    sent = int(res.metrics.get(SECAGG_BYTES_UP, res.metrics.get(COMPRESSED_BYTES_UP, sent)))
                    # a masked or compressed upload weighs what it sends
                _check_weight(res, cid)
                _check_finite_upload(res)  # before the sum: one client's NaN would spoil every other's
                if status == "ok" and summed is not None:  # a payload that does not fit fails its client only
                    summed.add(res.payload, res.weight, cid)
            except Exception as err:
                exc = err
        if isinstance(exc, ConfigError):  # a config the client's step cannot run under: every client would fail
            raise exc
        if exc is not None and is_out_of_memory(exc):  # the next client would fail alike: the run stops
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            raise OutOfMemory(f"round {round}: client {cid} ran out of memory training model "
                              f"{self.env.client_archs[cid]!r} (phase {phase!r}: {type(exc).__name__}: {first}); the "
                              "run stops, its finished rounds kept: try a smaller train.batch_size or model, or "
                              "fewer runtime.num_workers") from None
        if self.chain.compression is not None:  # error feedback's new residual kept with the client's outcome
            self.chain.compression.settle(cid, exc is None and res is not None and status == "ok")
        if exc is not None or res is None:
            return ClientOutcome(cid, "failed", seconds=time.perf_counter() - t0,
                                 error=ClientFailedError.wrap(exc or ValueError("no result"), cid, round, phase))
        up = sent
        lent: set[int] | None = None  # a result may view the pooled models: what the worker keeps is copied
        if status == "ok" and res.state is not None:
            lent = self.models.storages()
            self.store.put(cid, own_copy(res.state, lent))
            self.kept_state.append(cid)
        if summed is not None or status != "ok":  # summed already, or a late upload that the server never reads
            res = ClientResult(payload=None, weight=res.weight, metrics=res.metrics)
        if res.payload is not None or res.probe is not None:
            lent = self.models.storages() if lent is None else lent
            res.payload, res.probe = own_copy(res.payload, lent), own_copy(res.probe, lent)
        res.state = None
        return ClientOutcome(cid, status, res, bytes_up=up, seconds=time.perf_counter() - t0)

    def export_states(self) -> dict[int, Any]:
        """Personal states of this worker's clients (for checkpoints)."""
        states = self.store.export()
        return states if self.chain.compression is None else self.chain.compression.export(states)

    def load_states(self, states: dict[int, Any]) -> None:
        self.store.load(states if self.chain.compression is None else self.chain.compression.load(states))

    def close(self) -> None:
        """Remove this worker's spilled states (a cache: checkpoints keep their own copy), then the run's spill
        folder once no other worker on this machine still has files in it."""
        self.store.clear()
        if self.store.spill_dir is not None:
            with contextlib.suppress(OSError):  # not empty yet: the last worker to close removes it
                self.store.spill_dir.parent.rmdir()


def own_copy(value: Any, lent: set[int]) -> Any:
    """`value` with every tensor that lives in `lent` storage or off the CPU (in dicts, lists and tuples) replaced
    by a CPU copy of its own; what holds no such tensor is returned as it is. Off the CPU: a GPU worker's upload
    goes to a driver or server that may have no GPU."""
    if isinstance(value, torch.Tensor):
        viewed = value.layout == torch.strided and value.untyped_storage().data_ptr() in lent
        return value.detach().to("cpu", copy=True) if viewed or value.device.type != "cpu" else value
    if isinstance(value, dict):
        items = {k: own_copy(v, lent) for k, v in value.items()}
        return items if any(items[k] is not v for k, v in value.items()) else value
    if isinstance(value, (list, tuple)):
        parts = [own_copy(v, lent) for v in value]
        if all(p is v for p, v in zip(parts, value)):
            return value
        return type(value)(*parts) if hasattr(value, "_fields") else type(value)(parts)
    return value


def _merge(common: Any, per_client: dict[int, Any] | None, cid: int) -> Message:
    """The message a client sees: the common part, and its own part (None when it has none)."""
    return Message(common, per_client.get(cid) if per_client else None)


def _check_finite_upload(res: ClientResult) -> None:
    """Raise FloatingPointError ("diverged: ...") for a client whose training loss or upload is not finite, whatever
    its method: the client fails alone (clients.parquet records why), and no NaN reaches the aggregate."""
    for k, v in res.metrics.items():
        if k.endswith("train_loss") and isinstance(v, (int, float)) and not np.isfinite(v):
            raise FloatingPointError(f"diverged: non-finite {k} ({v})")
    tensors = dict(_float_tensors(res.payload, "payload"))
    groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}
    for t in tensors.values():
        groups.setdefault((t.device, t.dtype), []).append(t.reshape(-1))
    # one sum per device and dtype (finite when every entry is, unless it overflows): 0.14 ms for ResNet-8's 47
    # tensors on one CPU thread, where a norm or sum per tensor took 0.22-0.24 ms
    if all(torch.isfinite(torch.cat(group).sum()) for group in groups.values()):
        return
    bad = next((k for k, t in tensors.items() if not bool(torch.isfinite(t).all())), None)
    if bad is not None:  # else a sum overflowed its dtype, every entry finite
        raise FloatingPointError(f"diverged: non-finite update ({bad})")


def _float_tensors(value: Any, where: str) -> list[tuple[str, torch.Tensor]]:
    """The floating-point tensors in a payload (dicts, lists, tuples), each with where it lies."""
    if isinstance(value, torch.Tensor):
        return [(where, value)] if value.is_floating_point() else []
    if isinstance(value, np.ndarray) and np.issubdtype(value.dtype, np.floating):
        return [(where, torch.from_numpy(value))]
    if isinstance(value, dict):
        return [p for k, v in value.items() for p in _float_tensors(v, f"{where}[{k!r}]")]
    if isinstance(value, (list, tuple)):
        return [p for i, v in enumerate(value) for p in _float_tensors(v, f"{where}[{i}]")]
    return []


def _check_weight(res: ClientResult, cid: int) -> None:
    w = res.weight
    if not (isinstance(w, (int, float)) and np.isfinite(w) and w > 0):
        raise ValueError(f"client {cid} returned aggregation weight {w!r}; it must be finite and > 0")
