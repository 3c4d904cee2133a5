"""A client's result may view the worker's pooled model (FedAvg uploads `model.state_dict()`, no copy): what the
worker keeps past the client step is copied, so every client keeps its own numbers."""

from __future__ import annotations

from collections import namedtuple
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import fedsim.runtime.batching as batching_module
from fedsim.algorithms.fedavg import FedAvg
from fedsim.configure import load_config
from fedsim.method.contract import ClientResult, Phase, RoundInfo, register_algorithm
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker, own_copy

SIZES = (9, 14, 6, 11)


@register_algorithm
class KeepsViews(FedAvg):
    """FedAvg whose uploads come one by one (reduce="each") and whose personal state is the model itself: both
    views of the worker's pooled model, as a careless method would return them."""

    name = "test_keeps_views"

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "each")]

    def client_step(self, phase, state, msg, ctx) -> ClientResult:
        res = super().client_step(phase, state, msg, ctx)
        return ClientResult(payload=res.payload, weight=res.weight, metrics=res.metrics,
                            state={"model": ctx.models.get(ctx.arch).state_dict()})


@register_algorithm
class UploadsViews(FedAvg):
    """FedAvg whose uploads come one by one (reduce="each"), each a view of the worker's pooled model; its client
    step is FedAvg's plain local training, so a worker may train its clients together."""

    name = "test_uploads_views"

    def phases(self, round: int) -> list[Phase]:
        return [Phase("train", "each", local_training=True)]


def make(algorithm: str, *overrides: str) -> tuple[Server, ClientWorker]:
    n = sum(SIZES)
    rng = np.random.default_rng(1)
    arrays = {"x_train": rng.normal(size=(n, 1, 8, 8)).astype(np.float32), "y_train": np.arange(n) % 3}
    arrays |= {"x_test": arrays["x_train"], "y_test": arrays["y_train"]}
    bounds = np.cumsum([0, *SIZES])
    part = Partition(Ragged.from_list([np.arange(bounds[i], bounds[i + 1]) for i in range(len(SIZES))]),
                     Ragged.from_list([np.array([], int)] * len(SIZES)), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    cfg = load_config(None, [f"data.num_clients={len(SIZES)}", "seed=5", "train.batch_size=4", "train.lr=0.1",
                             f"algorithm.name={algorithm}", "model.name=mlp", "model.options={hidden: 8, layers: 1}",
                             *overrides])
    return Server(cfg, arrays, part, meta, device="cpu"), ClientWorker(cfg, arrays, part, meta, 0, device="cpu")


def run(server: Server, worker: ClientWorker, ids: list[int], late: bool) -> list:
    phase = server.phases(0)[0]
    bc = server.broadcast(phase, RoundInfo(0, phase.name, ids, ids, {i: 1 for i in ids})).broadcast
    return worker.run_phase(0, 0, phase, bc.common, bc.per_client or {}, ids, late=ids if late else None).outcomes


@pytest.mark.parametrize("algorithm, batching", [("test_keeps_views", "off"), ("test_uploads_views", "off"),
                                                  ("test_uploads_views", "on")])
def test_each_kept_upload_is_the_clients_own(algorithm: str, batching: str) -> None:
    """A reduce="each" method whose uploads view the worker's model: every upload equals the one the client makes
    alone and shares no memory with the worker's model, whether the clients trained one by one or together."""
    ids = list(range(len(SIZES)))
    server, worker = make(algorithm, f"runtime.batch_clients={batching}")
    trained = []
    real = batching_module.train_together

    def counted(plans):
        out = real(plans)
        trained.append(len(plans))
        return out

    with mock.patch.object(batching_module, "train_together", counted):
        together = run(server, worker, ids, late=False)
    assert trained == ([len(ids)] if batching == "on" else [])  # "on": the phase really trained them together
    lent = worker.models.storages()
    assert lent
    for o in together:
        alone = run(*make(algorithm, f"runtime.batch_clients={batching}"), [o.client_id], False)[0]
        assert o.status == alone.status == "ok"
        for k, v in alone.result.payload.items():
            torch.testing.assert_close(o.result.payload[k], v, rtol=1e-6, atol=1e-7)
            assert o.result.payload[k].untyped_storage().data_ptr() not in lent, (o.client_id, k)
    first, last = together[0].result.payload, together[-1].result.payload
    assert not torch.equal(first["mlp/fc.weight"], last["mlp/fc.weight"])


@pytest.mark.parametrize("algorithm, batching", [("fedavg", "off"), ("fedavg", "on"), ("test_keeps_views", "off")])
def test_a_late_client_trains_but_its_upload_stays_behind(algorithm: str, batching: str) -> None:
    """The server reads arrived clients only, so a late client's upload is not sent: its outcome keeps the metrics
    and upload size that the same client has when it arrives, and its state is not committed."""
    ids = list(range(len(SIZES)))
    late_worker = make(algorithm, f"runtime.batch_clients={batching}")[1]
    late = run(make(algorithm)[0], late_worker, ids, late=True)
    arrived = run(*make(algorithm, f"runtime.batch_clients={batching}"), ids, late=False)
    for o, a in zip(late, arrived, strict=True):
        assert (o.status, a.status) == ("late", "ok")
        assert o.result is not None and o.result.payload is None and o.result.state is None
        assert o.bytes_up == a.bytes_up > 0
        assert o.result.metrics == a.result.metrics
    assert late_worker.export_states() == {}


def test_a_committed_state_that_views_the_model_is_copied() -> None:
    server, worker = make("test_keeps_views")
    outcomes = run(server, worker, list(range(len(SIZES))), late=False)
    states, lent = worker.export_states(), worker.models.storages()
    for o in outcomes:
        kept = states[o.client_id]["model"]
        for k, v in kept.items():
            assert v.untyped_storage().data_ptr() not in lent
            torch.testing.assert_close(v, o.result.payload[f"mlp/{k}"])  # the state is the trained model


def test_own_copy_copies_only_tensors_in_lent_storage() -> None:
    model = nn.Linear(3, 2)
    lent = {t.untyped_storage().data_ptr() for t in model.parameters()}
    views, other = model.state_dict(), torch.ones(2)
    pair = namedtuple("pair", "a b")
    value = {"w": views["weight"], "nested": [views["bias"], other], "pair": pair(views["bias"], 3),
             "plain": (1, "x"), "other": other}
    got = own_copy(value, lent)
    assert got["nested"][1] is other and got["other"] is other and got["plain"] is value["plain"]
    assert isinstance(got["pair"], pair) and got["pair"].b == 3 and isinstance(got["nested"], list)
    for copy, view in ((got["w"], views["weight"]), (got["nested"][0], views["bias"]), (got["pair"].a, views["bias"])):
        assert torch.equal(copy, view) and copy.untyped_storage().data_ptr() not in lent
    with torch.no_grad():
        model.weight.add_(1.0)  # the next client trains in the same tensors: the copies keep their numbers
    assert not torch.equal(got["w"], model.weight)
    untouched = {"a": [other], "b": None}
    assert own_copy(untouched, lent) is untouched


class OnGpu(torch.Tensor):
    """A CPU tensor that says it lies on a GPU: what a GPU worker's upload looks like to own_copy."""

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return torch.device("cuda", 0)


def test_own_copy_brings_tensors_off_the_cpu_to_the_cpu() -> None:
    """A reduce="each" upload goes to a driver or server that may have no GPU: own_copy copies what is off the CPU
    even when it views no pooled model."""
    far = torch.arange(4.0).as_subclass(OnGpu)
    near = torch.ones(2)
    got = own_copy({"logits": far, "n": near, "probe": [far]}, lent=set())
    assert got["n"] is near
    for copy in (got["logits"], got["probe"][0]):
        assert copy is not far and copy.untyped_storage().data_ptr() != far.untyped_storage().data_ptr()
        assert torch.equal(copy.as_subclass(torch.Tensor), torch.arange(4.0))
