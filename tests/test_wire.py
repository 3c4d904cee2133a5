"""A message's tensors on their way to Ray workers: numpy arrays on the wire (raw buffers, a slice's own elements
only), tensors again on arrival, writable even from read-only buffers; the tensors numpy cannot hold keep torch's
way."""

from __future__ import annotations

import pickle
from dataclasses import dataclass

import torch

from actors.wire import for_the_wire


@dataclass
class Message:
    models: dict
    rows: list


def _travel(obj: object) -> tuple[object, int, int]:
    """`obj` pickled as Ray does (protocol 5), unpickled from read-only copies of its buffers; also the bytes sent
    out of band and in band."""
    buffers: list[pickle.PickleBuffer] = []
    data = pickle.dumps(obj, protocol=5, buffer_callback=buffers.append)
    frozen = [bytes(b.raw()) for b in buffers]
    return pickle.loads(data, buffers=[memoryview(f) for f in frozen]), sum(len(f) for f in frozen), len(data)


def test_tensors_travel_as_arrays_and_arrive_as_writable_tensors_of_their_own():
    whole = torch.arange(40.0).view(10, 4)
    msg = Message(models={"mlp": {"w": torch.randn(64, 32), "n": torch.tensor(3)}}, rows=[whole[2], whole[7:9]])
    got, out_of_band, in_band = _travel(for_the_wire(msg))
    assert isinstance(got, Message)
    for a, b in [(got.models["mlp"]["w"], msg.models["mlp"]["w"]), (got.models["mlp"]["n"], msg.models["mlp"]["n"]),
                 (got.rows[0], whole[2]), (got.rows[1], whole[7:9])]:
        assert type(a) is torch.Tensor and a.dtype == b.dtype and torch.equal(a, b)
    assert out_of_band == (64 * 32 + 4 + 8) * 4 + 8  # the rows: their own 12 elements, not the 40 of `whole`
    assert in_band < 2000
    got.models["mlp"]["w"].add_(1.0)  # arrived from read-only buffers, yet writable
    assert torch.equal(got.models["mlp"]["w"], msg.models["mlp"]["w"] + 1.0)


def test_tensors_numpy_cannot_hold_keep_torch_pickling_and_a_view_sends_only_itself():
    whole = torch.randn(100, 8).to(torch.bfloat16)
    wanted = torch.randn(5, requires_grad=True)
    got, _, in_band = _travel(for_the_wire({"bf16": whole[:2], "grad": wanted}))
    assert got["bf16"].dtype == torch.bfloat16 and torch.equal(got["bf16"], whole[:2])
    assert got["grad"].requires_grad and torch.equal(got["grad"].detach(), wanted.detach())
    assert in_band < 100 * 8 * 2  # the bf16 slice was cloned: not the whole storage
