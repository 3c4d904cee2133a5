"""Order-independent sums and the spilling client-state store."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.errors import AggregationError
from fedsim.method.sums import WeightedSum
from fedsim.runtime.store import ClientStateStore, state_nbytes


def test_weighted_sum_does_not_depend_on_grouping():
    g = torch.Generator().manual_seed(0)
    payloads = [{"w": torch.randn(1000, generator=g) * 10 ** torch.randint(-6, 6, (1000,), generator=g)}
                for _ in range(13)]
    weights = [float(w) for w in torch.randint(1, 5000, (13,), generator=g)]
    one = WeightedSum()
    for p, w in zip(payloads, weights):
        one.add(p, w)
    results = []
    for groups in ([range(0, 13)], [range(0, 5), range(5, 13)], [range(0, 13, 3), range(1, 13, 3), range(2, 13, 3)]):
        parts = []
        for grp in groups:
            s = WeightedSum()
            for i in grp:
                s.add(payloads[i], weights[i])
            parts.append(s)
        total = WeightedSum()
        for s in reversed(parts):
            total.merge(s)
        results.append(total)
    ref = (one.totals()["w"] / one.weight).float()
    for total in results:
        assert total.count == 13 and total.weight == sum(weights)
        assert torch.equal((total.totals()["w"] / total.weight).float(), ref)
    expect = np.average(np.stack([p["w"].double().numpy() for p in payloads]), axis=0, weights=weights)
    np.testing.assert_allclose(ref.numpy(), expect, rtol=1e-6)


def test_a_plain_float64_sum_rounds_in_the_order_it_adds_and_the_exact_one_does_not():
    """runtime.exact_sum: false rounds each addition, so a term far below the running sum is lost or kept
    depending on the order; the exact sum keeps it in every order."""
    big, tiny = torch.tensor([1.0, 3.0]), torch.tensor([2.0 ** -60, 2.0 ** -70])  # exact in float32

    def total(order, exact):
        s = WeightedSum(exact=exact)
        for p, w in order:
            s.add({"w": p}, w)
        return s.totals()["w"]

    orders = ([(big, 1.0), (tiny, 1.0), (-big, 1.0)], [(big, 1.0), (-big, 1.0), (tiny, 1.0)])
    assert all(torch.equal(total(o, True), tiny.double()) for o in orders)
    assert torch.equal(total(orders[0], False), torch.zeros(2, dtype=torch.float64))  # tiny lost next to big
    assert torch.equal(total(orders[1], False), tiny.double())


def test_weighted_sum_is_exact_in_place_and_travels_at_the_size_of_its_accumulators():
    """Payloads are not modified, the partial sum pickles at the size of its hi/lo accumulators, and hi + lo is the
    exact sum of terms that cancel catastrophically in plain float64."""
    import pickle

    big, small = torch.tensor([2.0 ** 60, 1.0]), torch.tensor([1.0, 2.0 ** -40])
    kept = (big.clone(), small.clone())
    s = WeightedSum()
    for p in (big, small, -big):
        s.add({"w": p}, 1.0)
    assert torch.equal(big, kept[0]) and torch.equal(small, kept[1])
    assert torch.equal(s.totals()["w"], torch.tensor([1.0, 2.0 ** -40], dtype=torch.float64))
    assert torch.equal(big.double() + small.double() - big.double(), torch.tensor([0.0, 2.0 ** -40],
                                                                                   dtype=torch.float64))
    copy = pickle.loads(pickle.dumps(s))
    assert len(pickle.dumps(s)) < 2 * 2 * 8 * 2 + 2000
    copy.add({"w": torch.tensor([3.0, 0.0])}, 2.0)
    assert torch.equal(copy.totals()["w"], torch.tensor([7.0, 2.0 ** -40], dtype=torch.float64))


def test_a_partial_sum_travels_as_raw_buffers_and_arrives_writable():
    """Pickled with protocol 5 (Ray's transport), both layouts' accumulators go out of band as raw buffers, not
    through torch's serializer; unpickled from read-only buffers (Ray maps them from its object store), the sum is
    equal, and adding to it leaves those buffers alone."""
    import pickle

    one = {"w": torch.arange(6.0).view(2, 3), "b": torch.ones(3)}
    flat, by_key, exact, signed = WeightedSum(), WeightedSum(), WeightedSum(), WeightedSum()
    for s in (flat, by_key, exact, signed):
        s.add(one, 2.0)
        s.add({k: v * 0.1 for k, v in one.items()}, 3.0)
    flat.add({"w": torch.full((2, 3), 2.0 ** -60), "b": torch.zeros(3)}, 1.0)  # 2 + 2^-60: lo holds the 2^-60
    by_key.add({"w": torch.ones(2, 3)}, 1.0)  # another layout: the sum is kept key by key
    assert not exact.lo["w"].view(torch.int64).any()  # every product and sum exact: lo is all +0.0
    signed._flat.lo[0] = -0.0  # a -0.0 in lo is sent as it is
    # flat and key by key: hi and lo (float64), the exact sum's +0.0 lo is not sent
    for s, sent in ((flat, 2 * 9), (by_key, 2 * 9), (exact, 9), (signed, 2 * 9)):
        buffers: list[pickle.PickleBuffer] = []
        data = pickle.dumps(s, protocol=5, buffer_callback=buffers.append)
        assert sum(b.raw().nbytes for b in buffers) == sent * 8 and len(data) < 2000
        frozen = [bytes(b.raw()) for b in buffers]
        kept = [bytearray(f) for f in frozen]
        got = pickle.loads(data, buffers=[memoryview(f) for f in frozen])
        assert _bits(got) == _bits(s) and (got.weight, got.count) == (s.weight, s.count)
        got.add({"w": torch.full((2, 3), 5.0), "b": torch.full((3,), 5.0)}, 1.0)
        s.add({"w": torch.full((2, 3), 5.0), "b": torch.full((3,), 5.0)}, 1.0)
        assert _bits(got) == _bits(s)
        assert frozen == [bytes(k) for k in kept]


def _bits(sums: WeightedSum) -> dict[str, tuple[bytes, bytes]]:
    return {k: (v.numpy().tobytes(), sums.lo[k].numpy().tobytes()) for k, v in sums.hi.items()}


def test_one_buffer_per_layout_adds_as_the_per_key_sum():
    """Payloads of one layout are summed in one flat buffer; a payload of another layout (here the same tensors in
    another key order) switches the sum to per-key accumulators. Both give the same hi and lo, bit for bit, for
    weights whose product with a float32 is exact and for others, for float64 entries, and through merges (the
    flat sum swapping its hi with a spare buffer)."""
    g = torch.Generator().manual_seed(3)

    def payload() -> dict[str, torch.Tensor]:
        w = torch.randn(40, 7, generator=g) * 10.0 ** torch.randint(-7, 7, (40, 7), generator=g)
        w[torch.rand(40, 7, generator=g) < 0.1] = -0.0
        return {"m/w": w, "m/b": torch.randn(7, generator=g).double() * 1e-3,
                "m/t": torch.randn(5, 3, generator=g).t(),  # not contiguous: widened into the term buffer first
                "m/big": torch.randn(130, 130, generator=g),  # large enough to be added where it lies
                "m/n": torch.randint(0, 1000, (), generator=g), "m/h": torch.randn(4, generator=g).half(),
                "m/bigt": torch.randn(200, 100, generator=g).t(),  # large, but must be widened first
                "m/__weight__": torch.ones(())}

    items = [(payload(), w) for w in (3.0, 17.0, 0.1, 2.0 ** 40, 1.0, 1e-3, 4095.0, 5.0)]
    flat, by_key = WeightedSum(), WeightedSum()
    for i, (p, w) in enumerate(items):
        flat.add(p, w)
        by_key.add(dict(reversed(p.items())) if i == 0 else p, w)
    assert by_key._flat is None and flat._flat is not None
    assert _bits(flat) == _bits(by_key) and flat.weight == by_key.weight and flat.count == by_key.count == 8
    halves = []
    for part in (items[:5], items[5:]):
        s = WeightedSum()
        for p, w in part:
            s.add(p, w)
        halves.append(s)
    merged_flat, merged_by_key = WeightedSum(), WeightedSum()
    merged_flat.merge(flat)
    merged_by_key.merge(by_key)
    for s in halves:
        merged_flat.merge(s)
        merged_by_key.merge(s)
    assert merged_flat._flat is not None and merged_by_key._flat is None
    assert _bits(merged_flat) == _bits(merged_by_key)
    assert {k: v.shape for k, v in merged_flat.totals().items()} == {
        "m/w": (40, 7), "m/b": (7,), "m/t": (3, 5), "m/big": (130, 130), "m/n": (), "m/h": (4,),
        "m/bigt": (100, 200), "m/__weight__": ()}


def test_store_spills_and_reloads_bit_for_bit(tmp_path):
    one = {"w": torch.randn(256, 256), "opt": {"step": 3, "m": torch.randn(256)}}
    size = state_nbytes(one)
    store = ClientStateStore(capacity_bytes=int(2.5 * size), spill_dir=tmp_path)
    states = {c: {"w": torch.randn(256, 256), "opt": {"step": c, "m": torch.randn(256)}} for c in range(6)}
    for c, s in states.items():
        store.put(c, s)
    assert store.memory_bytes <= 2.5 * size and store.spills >= 4 and len(store) == 6
    assert len(list(tmp_path.glob("*.pt"))) == 4
    for c in [0, 5, 1, 2]:
        got = store.get(c)
        assert torch.equal(got["w"], states[c]["w"]) and torch.equal(got["opt"]["m"], states[c]["opt"]["m"])
        assert got["opt"]["step"] == c
    assert store.loads >= 3
    exported = store.export()
    assert sorted(exported) == list(range(6)) and torch.equal(exported[3]["w"], states[3]["w"])


def test_unbounded_store_keeps_everything_in_memory(tmp_path):
    store = ClientStateStore()
    store.put(1, {"x": torch.ones(3)})
    assert store.get(1)["x"].sum() == 3 and store.get(2) is None and store.spills == 0


def test_partial_sums_of_different_shapes_do_not_merge_and_the_sum_is_untouched():
    a, b = WeightedSum(), WeightedSum()
    a.add({"w": torch.ones(3), "v": torch.ones(2)}, 1.0)
    a.add({"w": torch.ones(3)}, 2.0)  # another layout: the per-key sums
    b.add({"w": torch.ones(4)}, 1.0)
    before = {k: v.clone() for k, v in a.totals().items()}
    with pytest.raises(AggregationError, match="partial sums disagree on the shape of 'w': \\(4,\\) vs \\(3,\\)"):
        a.merge(b)
    assert a.count == 2 and all(torch.equal(a.totals()[k], v) for k, v in before.items())


def test_a_sum_kept_on_a_device_is_handed_over_on_the_cpu_with_the_same_bits():
    """A worker sums on its device (`WeightedSum(device=...)`, the torch operations) and hands the sum over with
    `to_cpu`; here the device is the CPU (a GPU's bits against the CPU's were checked on an H100: equal). Pickled,
    a sum arrives on the CPU, and a sum pickled before sums had a device still loads."""
    import pickle

    g = torch.Generator().manual_seed(3)
    payloads = [{"a": torch.randn(300, 7, generator=g), "b": torch.randint(0, 9, (4,), generator=g)} for _ in range(9)]
    weights = [float(w) for w in torch.randint(1, 90, (9,), generator=g)] + [0.1]
    payloads.append({"a": torch.randn(300, 7, generator=g), "b": torch.tensor([1, 2, 3, 4])})
    compiled = WeightedSum()
    for p, w in zip(payloads, weights):
        compiled.add(p, w)
    on_device = WeightedSum(device="cpu")
    for p, w in zip(payloads, weights):
        on_device.add(p, w)
    assert on_device.to_cpu() is on_device and on_device.device == torch.device("cpu")
    for k in ("a", "b"):
        assert torch.equal(on_device.hi[k], compiled.hi[k]) and torch.equal(on_device.lo[k], compiled.lo[k])
    back = pickle.loads(pickle.dumps(on_device))
    assert back.device == torch.device("cpu") and torch.equal(back.totals()["a"], compiled.totals()["a"])
    state = on_device.__getstate__()
    del state["device"]  # as an older fedsim pickled it
    old = WeightedSum.__new__(WeightedSum)
    old.__setstate__(state)
    assert old.device == torch.device("cpu") and torch.equal(old.totals()["b"], compiled.totals()["b"])


@pytest.mark.parametrize("fails_at", ["scratch", "zeros"])
def test_an_add_that_cannot_allocate_leaves_the_sum_untouched(monkeypatch, fails_at):
    """A payload of another layout is added key by key with the torch operations (as on a GPU). Running out of
    memory there fails that client only (the worker catches it), so it must come before any key is written."""
    from fedsim.method import twosum

    monkeypatch.setattr(twosum, "_scratch", {})
    s = WeightedSum(device="cpu")
    s.add({"a": torch.full((3,), 0.1), "b": torch.full((5,), 0.2)}, 2.0)
    s.add({"b": torch.full((5,), 0.3), "c": torch.ones(2)}, 1.0)  # another layout: key by key from here on
    before = {k: v.clone() for k, v in s.totals().items()}
    real_scratch, real_zeros = twosum._scratch_buffer, torch.zeros_like

    def scratch(like, slot):
        if fails_at == "scratch" and like.numel() == 3:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real_scratch(like, slot)

    def zeros_like(t, *args, **kwargs):
        if fails_at == "zeros" and t.numel() == 4:
            raise torch.OutOfMemoryError("out of memory (test)")
        return real_zeros(t, *args, **kwargs)

    monkeypatch.setattr(twosum, "_scratch_buffer", scratch)
    monkeypatch.setattr(torch, "zeros_like", zeros_like)
    # keys in this order: b is added before a's scratch or d's low-order zeros are needed
    with pytest.raises(torch.OutOfMemoryError):
        s.add({"b": torch.full((5,), 0.5), "a": torch.full((3,), 0.7), "d": torch.ones(4)}, 3.0)
    assert (s.count, s.weight) == (2, 3.0) and set(s.totals()) == set(before)
    assert all(torch.equal(s.totals()[k], v) for k, v in before.items())
    monkeypatch.undo()
    s.add({"b": torch.full((5,), 0.5), "a": torch.full((3,), 0.7), "d": torch.ones(4)}, 3.0)
    assert torch.equal(s.totals()["b"], before["b"] + 1.5) and s.count == 3
