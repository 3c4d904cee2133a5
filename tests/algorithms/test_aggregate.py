"""The one aggregation module against numpy, and its refusals naming the client."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.algorithms.fedavg import FedAvg
from fedsim.configure import load_config
from fedsim.errors import AggregationError
from fedsim.method.aggregate import (
    as_summable,
    average_by_arch,
    move_toward,
    split_by_arch,
    sum_by_arch,
    weighted_average,
)
from fedsim.method.contract import Phase, RoundInfo, register_algorithm
from fedsim.method.sums import WeightedSum
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientWorker


def states(seed: int, n: int) -> dict[int, dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return {c: {"w": torch.randn(3, 4, generator=g), "b": torch.randn(4, generator=g),
                "steps": torch.tensor(10 * c + 3)} for c in range(n)}


def test_weighted_average_matches_numpy_and_keeps_dtypes() -> None:
    s, w = states(0, 4), {0: 3.0, 1: 1.0, 2: 5.0, 3: 2.0}
    avg = weighted_average(s, w)
    for k in ("w", "b"):
        want = sum(w[c] * s[c][k].double().numpy() for c in s) / sum(w.values())
        np.testing.assert_allclose(avg[k].numpy(), want, rtol=1e-6)
        assert avg[k].dtype == torch.float32
    assert avg["steps"].dtype == torch.int64
    assert int(avg["steps"]) == int(sum(w[c] * (10 * c + 3) for c in s) / sum(w.values()))
    shuffled = weighted_average({c: s[c] for c in (2, 0, 3, 1)}, w)  # the order clients come in is immaterial
    assert all(torch.equal(avg[k], shuffled[k]) for k in avg)


@pytest.mark.parametrize("bad, message", [
    ({"w": torch.zeros(3, 4), "b": torch.zeros(4)}, "client 2 sent keys that differ"),
    ({"w": torch.zeros(4, 3), "b": torch.zeros(4), "steps": torch.tensor(1)}, "client 2 sent 'w' with shape"),
])
def test_a_state_that_does_not_fit_names_its_client(bad, message) -> None:
    s = states(1, 3)
    s[2] = bad
    with pytest.raises(AggregationError, match=message):
        weighted_average(s, dict.fromkeys(s, 1.0))


def test_weights_must_be_finite_and_positive() -> None:
    s = states(2, 2)
    for w in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(AggregationError, match="client 1 has weight"):
            weighted_average(s, {0: 1.0, 1: w})
    with pytest.raises(AggregationError, match="no client states"):
        weighted_average({}, {})


def test_per_architecture_sums_average_within_each_architecture() -> None:
    s, w = states(3, 5), {0: 1.0, 1: 2.0, 2: 3.0, 3: 4.0, 4: 5.0}
    archs = ["a", "b", "a", "b", "a"]
    summed = sum_by_arch(s, w, archs)
    previous = {"a": s[0], "b": s[1], "c": {"w": torch.ones(2)}}
    out = average_by_arch(summed, previous)
    for arch in ("a", "b"):
        mine = [c for c in s if archs[c] == arch]
        want = sum(w[c] * s[c]["w"].double().numpy() for c in mine) / sum(w[c] for c in mine)
        np.testing.assert_allclose(out[arch]["w"].numpy(), want, rtol=1e-6)
    assert out["c"] is previous["c"]  # nobody trained it: kept as it was
    split = split_by_arch(summed)
    assert split["a"][0] == pytest.approx(1 + 3 + 5) and set(split["b"][1]) == {"w", "b", "steps"}
    want_b = 2 * s[1]["b"].double().numpy() + 4 * s[3]["b"].double().numpy()
    np.testing.assert_allclose(split["b"][1]["b"].numpy(), want_b, rtol=1e-12)


def test_a_summable_upload_of_the_wrong_shape_is_refused_before_it_touches_the_sum() -> None:
    total = WeightedSum()
    total.add(as_summable("a", {"w": torch.ones(3)}), 2.0, client=0)
    before = {k: v.clone() for k, v in total.totals().items()}
    with pytest.raises(AggregationError, match="client 7 sent 'a/w' with shape"):
        total.add({"a/__weight__": torch.ones(()), "a/w": torch.ones(4)}, 1.0, client=7)
    with pytest.raises(AggregationError, match="client 8 sent a list"):
        total.add([torch.ones(3)], 1.0, client=8)  # type: ignore[arg-type]
    assert total.count == 1 and all(torch.equal(before[k], v) for k, v in total.totals().items())
    with pytest.raises(AggregationError, match="missing from the summed"):
        average_by_arch(sum_by_arch({0: {"v": torch.ones(3)}}, {0: 1.0}, ["a"]), {"a": {"w": torch.ones(3)}})


def test_move_toward_is_a_server_step_and_leaves_integer_buffers_to_the_target() -> None:
    old = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(4)}
    new = {"w": torch.tensor([3.0, 0.0]), "n": torch.tensor(9)}
    stepped = move_toward(old, new, 0.25)
    np.testing.assert_allclose(stepped["w"].numpy(), [1.5, 1.5])
    assert int(stepped["n"]) == 9 and move_toward(old, new, 1.0)["w"] is new["w"]


@register_algorithm
class _Misfit(FedAvg):
    """FedAvg whose client 1 uploads a first layer of the wrong shape."""

    name = "misfit_test"

    def phases(self, round):  # it wraps the client step: its phase is no batching opt-in
        return [Phase("train", "sum")]

    def client_step(self, phase, state, msg, ctx):
        res = super().client_step(phase, state, msg, ctx)
        if ctx.client_id == 1:
            key = next(iter(res.payload))
            res.payload[key] = torch.zeros(2, 2)
        return res


def test_a_misfit_upload_fails_its_client_and_the_round_goes_on() -> None:
    cfg = load_config(None, ["data.num_clients=3", "model.name=mlp", "model.options={hidden: 4, layers: 1}",
                             "algorithm.name=misfit_test", "train.steps=1", "seed=1"])
    x = np.random.default_rng(0).normal(size=(9, 1, 2, 2)).astype(np.float32)
    y = np.arange(9) % 3
    arrays = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    part = Partition(Ragged.from_list([np.arange(0, 3), np.arange(3, 6), np.arange(6, 9)]),
                     Ragged.from_list([np.array([], int)] * 3), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    server = Server(cfg, arrays, part, meta, device="cpu")
    worker = ClientWorker(cfg, arrays, part, meta, 0, device="cpu")
    phase = server.phases(0)[0]
    bc = server.broadcast(phase, RoundInfo(0, "train", [0, 1, 2], [0, 1, 2], {0: 3, 1: 3, 2: 3})).broadcast
    reply = worker.run_phase(0, 0, phase, bc.common, {}, [0, 1, 2])
    assert [o.status for o in reply.outcomes] == ["ok", "failed", "ok"]
    assert "AggregationError" in str(reply.outcomes[1].error) and "client 1" in str(reply.outcomes[1].error)
    assert reply.summed.count == 2 and reply.summed.weight == 6.0


def test_the_weight_counter_lies_where_the_state_does():
    """On a GPU worker the counter is a GPU tensor, so adding an upload to the worker's sum copies nothing from the
    CPU (a blocking copy that would wait for the GPU's queue); the meta device stands in for the GPU here."""
    on_meta = as_summable("a", {"w": torch.empty(3, device="meta"), "b": torch.empty(2, device="meta")})
    assert on_meta["a/__weight__"].device.type == "meta" and on_meta["a/__weight__"].shape == ()
    assert as_summable("a", {"w": torch.ones(3)})["a/__weight__"].device.type == "cpu"
    assert torch.equal(as_summable("a", {})["a/__weight__"], torch.ones(()))
