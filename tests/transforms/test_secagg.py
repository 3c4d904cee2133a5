"""Secure aggregation's simulation: the unmasked sum is the plain sum of the quantised vectors bit for bit, with and
without dropouts, for SecAgg and SecAgg+; too many dropouts abort naming the client; a masked vector alone looks
uniform; Shamir, the Harary graph, quantisation, the field check and the costs against hand values."""

from __future__ import annotations

import itertools
import re

import numpy as np
import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.transforms import secagg
from fedsim.transforms.secagg import SecAggAbort, SecAggSpec


def spec_of(neighbours: int | None = None, bits: int = 24, levels: int = 256, threshold: float = 0.5,
            seed: int = 7) -> SecAggSpec:
    return SecAggSpec(bits=bits, levels=levels, range=1.0, neighbours=neighbours, threshold=threshold, seed=seed)


def cohort_of(n: int, seed: int = 0) -> list[int]:
    """n sorted, non-contiguous client ids, one of them near rng's 2**31 limit."""
    ids = np.random.default_rng(seed).choice(10_000, n - 1, replace=False).tolist()
    return sorted([*ids, 2**31 - 2])


def quantised(spec: SecAggSpec, cohort: list[int], d: int) -> dict[int, torch.Tensor]:
    out = {}
    for u in cohort:
        x = torch.randn(d, generator=torch.Generator().manual_seed(u), dtype=torch.float64) * 0.6
        out[u] = secagg.quantise(x, spec, torch.Generator().manual_seed(u + 1))[0]
    return out


def masked_sum(spec: SecAggSpec, rnd: int, clients: list[int], qs: dict[int, torch.Tensor],
               graph: dict[int, list[int]]) -> torch.Tensor:
    total = torch.zeros_like(next(iter(qs.values())))
    for u in clients:
        total = secagg.add_mod(total, secagg.masked(spec, rnd, u, qs[u], graph), spec)
    return total


def recoverable(spec: SecAggSpec, graph: dict[int, list[int]], alive: set[int]) -> bool:
    """Every client keeps at least t of its neighbours alive (the test's own statement of the threshold)."""
    return all(sum(v in alive for v in graph[u]) >= spec.shares_needed(len(graph[u])) for u in graph)


def safe_drops(spec: SecAggSpec, graph: dict[int, list[int]], want: int, seed: int = 1) -> set[int]:
    """Up to `want` clients dropped greedily (in a shuffled order) while every secret stays recoverable."""
    dropped: set[int] = set()
    for u in np.random.default_rng(seed).permutation(sorted(graph)).tolist():
        if len(dropped) < want and recoverable(spec, graph, set(graph) - dropped - {u}):
            dropped.add(u)
    return dropped


@pytest.mark.parametrize(("n", "k", "drops", "bits", "levels"), [
    (5, None, 0, 24, 256), (5, None, 2, 24, 256), (12, None, 5, 62, 2**20), (12, 4, 0, 24, 256),
    (12, 4, 3, 62, 2**20), (40, 6, 0, 24, 256), (40, 6, 8, 24, 256), (40, None, 10, 16, 1000)])
def test_unmasked_sum_is_the_plain_sum_bit_for_bit(n: int, k: int | None, drops: int, bits: int, levels: int) -> None:
    spec, rnd, d = spec_of(k, bits, levels), 3, 50
    spec.check(n)
    cohort = cohort_of(n, seed=n)
    graph = secagg.neighbours(spec, rnd, cohort)
    dropped = safe_drops(spec, graph, drops)
    assert len(dropped) == drops
    survivors = [u for u in cohort if u not in dropped]
    qs = quantised(spec, cohort, d)
    total = masked_sum(spec, rnd, survivors, qs, graph)
    state = secagg.setup(spec, rnd, cohort, graph)
    got = secagg.unmask(spec, rnd, total, cohort, survivors, graph, state)
    plain = torch.stack([qs[u] for u in survivors]).sum(dim=0)
    assert got.dtype == torch.int64 and torch.equal(got, plain)
    assert torch.equal(secagg.unmask(spec, rnd, total, cohort, survivors, graph), plain)  # setup recomputed
    if drops:  # the dropped clients' pair masks are really in the total: it is not the plain sum before unmasking
        assert not torch.equal(torch.remainder(total - plain, spec.modulus), torch.zeros_like(plain))


def test_too_many_dropouts_around_a_survivor_abort_naming_it() -> None:
    spec, cohort = spec_of(None, threshold=0.75), [0, 1, 2, 3, 4]  # t = ceil(0.75 * 4) = 3
    graph = secagg.neighbours(spec, 0, cohort)
    qs = quantised(spec, cohort, 10)
    survivors = [0, 1, 2]
    total = masked_sum(spec, 0, survivors, qs, graph)
    with pytest.raises(SecAggAbort) as err:
        secagg.unmask(spec, 0, total, cohort, survivors, graph)
    assert err.value.reason == ("client 0: 2 of its 4 neighbours survived, 3 shares are needed to remove its self "
                                "mask")
    assert secagg.unmask(spec, 0, masked_sum(spec, 0, [0, 1, 2, 3], qs, graph), cohort, [0, 1, 2, 3],
                         graph).equal(qs[0] + qs[1] + qs[2] + qs[3])  # one dropout fewer: t = 3 shares survive


def test_secagg_plus_abort_names_a_client_short_of_shares() -> None:
    spec, rnd = spec_of(4), 2  # t = 2 of 4 neighbours
    cohort = cohort_of(12)
    graph = secagg.neighbours(spec, rnd, cohort)
    u = cohort[5]
    alive = set(cohort) - set(graph[u][:3])  # 1 of u's 4 neighbours survives
    survivors = sorted(alive)
    qs = quantised(spec, cohort, 10)
    with pytest.raises(SecAggAbort) as err:
        secagg.unmask(spec, rnd, masked_sum(spec, rnd, survivors, qs, graph), cohort, survivors, graph)
    found = re.fullmatch(r"client (\d+): (\d+) of its (\d+) neighbours survived, (\d+) shares are needed to .*",
                         str(err.value))
    assert found is not None
    named, kept, degree, needed = map(int, found.groups())
    assert sum(v in alive for v in graph[named]) == kept < needed == 2 and degree == 4


def test_a_dropped_clients_key_short_of_shares_aborts() -> None:
    spec, rnd = spec_of(4), 0
    cohort = list(range(12))
    graph = secagg.neighbours(spec, rnd, cohort)
    qs = quantised(spec, cohort, 10)
    # a dropped client and 3 of its neighbours, while every survivor keeps its t shares: only a key is lost
    cases = [{v, *gone} for v in cohort for gone in itertools.combinations(graph[v], 3)]
    cases = [c for c in cases if all(sum(w not in c for w in graph[u]) >= 2 for u in cohort if u not in c)]
    assert cases
    survivors = [u for u in cohort if u not in cases[0]]
    with pytest.raises(SecAggAbort, match=r"client \d+: 1 of its 4 neighbours survived, 2 shares are needed to cancel "
                                          r"its pair masks") as err:
        secagg.unmask(spec, rnd, masked_sum(spec, rnd, survivors, qs, graph), cohort, survivors, graph)
    assert int(err.value.reason.split(":")[0].split()[1]) in cases[0]


def test_a_masked_vector_alone_looks_uniform() -> None:
    spec, rnd, d = spec_of(4, bits=16, levels=16), 1, 8000
    cohort = cohort_of(12)
    graph = secagg.neighbours(spec, rnd, cohort)
    q = torch.full((d,), 8, dtype=torch.int64)  # a constant input: anything spread out comes from the masks
    y = secagg.masked(spec, rnd, cohort[0], q, graph)
    assert int(y.min()) >= 0 and int(y.max()) < spec.modulus
    assert float((y != q).double().mean()) > 0.99
    assert bool((torch.remainder(y - q, spec.modulus) != 0).any())
    counts = torch.bincount(y // (spec.modulus // 16), minlength=16)
    assert int(counts.min()) > d / 16 * 0.75 and int(counts.max()) < d / 16 * 1.25
    assert not torch.equal(y, secagg.masked(spec, rnd, cohort[1], q, graph))  # the same input, other masks


def test_shamir_any_t_shares_rebuild_fewer_do_not() -> None:
    gen = np.random.default_rng(0)
    secret, holders, t = 2**31 - 5, [0, 3, 4, 9, 17, 30], 3
    shares = secagg.share(secret, holders, t, gen)
    assert sorted(shares) == holders and all(0 <= s < secagg.PRIME for s in shares.values())
    for subset in itertools.combinations(holders, t):
        assert secagg.reconstruct({h: shares[h] for h in subset}, t) == secret
    assert secagg.reconstruct(shares, t) == secret
    for subset in itertools.combinations(holders, t - 1):
        part = {h: shares[h] for h in subset}
        with pytest.raises(ValueError, match="cannot rebuild"):
            secagg.reconstruct(part, t)
        assert secagg.reconstruct(part, t - 1) != secret  # interpolating too low a degree gives another number
    with pytest.raises(ValueError):
        secagg.share(secagg.PRIME, holders, t, gen)


def test_harary_graph_symmetric_of_degree_k_and_per_round() -> None:
    cohort = cohort_of(40)
    for k in (2, 4, 6):
        spec = spec_of(k)
        graph = secagg.neighbours(spec, 0, cohort)
        assert sorted(graph) == cohort
        assert all(len(vs) == k and u not in vs and len(set(vs)) == k for u, vs in graph.items())
        assert all(u in graph[v] for u, vs in graph.items() for v in vs)
        assert graph == secagg.neighbours(spec, 0, cohort)
        assert graph != secagg.neighbours(spec, 1, cohort)
    ring = secagg.neighbours(spec_of(2), 4, cohort)  # k = 2: one cycle through the whole cohort
    seen, prev, here = [cohort[0]], None, cohort[0]
    while True:
        prev, here = here, next(v for v in ring[here] if v != prev)
        if here == cohort[0]:
            break
        seen.append(here)
    assert sorted(seen) == cohort
    small = secagg.neighbours(spec_of(6), 0, [1, 2, 3, 4, 5])  # k >= n - 1: everyone
    assert small == secagg.neighbours(spec_of(None), 0, [1, 2, 3, 4, 5]) == {u: [v for v in range(1, 6) if v != u]
                                                                            for u in range(1, 6)}


def test_pair_seeds_symmetric_and_prg_in_range() -> None:
    spec = spec_of()
    assert secagg.pair_seed(spec, 2, 3, 9) == secagg.pair_seed(spec, 2, 9, 3) != secagg.pair_seed(spec, 2, 3, 8)
    assert secagg.pair_seed(spec, 2, 3, 9) != secagg.pair_seed(spec, 3, 3, 9)
    assert secagg.self_seed(spec, 2, 3) != secagg.self_seed(spec, 2, 4)
    r = secagg.prg(12345, 10_000, 62)
    assert r.dtype == torch.int64 and int(r.min()) >= 0 and int(r.max()) < 2**62 and int(r.max()) > 2**61
    assert torch.equal(r, secagg.prg(12345, 10_000, 62)) and not torch.equal(r, secagg.prg(12346, 10_000, 62))


def test_quantise_round_trip_clamping_and_unbiased() -> None:
    spec = SecAggSpec(bits=32, levels=10, range=2.0, neighbours=None, threshold=0.5, seed=0)
    step = 2 * spec.range / spec.levels
    x = torch.linspace(-2.0, 2.0, 1001, dtype=torch.float64)
    q, clamped = secagg.quantise(x, spec, torch.Generator().manual_seed(0))
    assert q.dtype == torch.int64 and int(q.min()) >= 0 and int(q.max()) <= spec.levels and clamped == 0
    assert float((secagg.dequantise(q, 1, spec) - x).abs().max()) <= step + 1e-12
    wild = torch.tensor([5.0, -7.0, 1.9, 0.0, 2.0000001], dtype=torch.float64)
    q, clamped = secagg.quantise(wild, spec, torch.Generator().manual_seed(0))
    assert clamped == 3 and q[0] == spec.levels and q[1] == 0 and q[4] == spec.levels
    for value in (0.123, -1.37, 1.99):  # between grid points: nearest rounding would be off by up to step / 2
        x = torch.full((200_000,), value, dtype=torch.float64)
        q, _ = secagg.quantise(x, spec, torch.Generator().manual_seed(1))
        assert abs(float(secagg.dequantise(q, 1, spec).mean()) - value) < 0.004
    assert torch.allclose(secagg.dequantise(torch.tensor([0, 30, 15]), 3, spec),
                          torch.tensor([-6.0, 6.0, 0.0], dtype=torch.float64))


def test_check_field_wrap_and_settings() -> None:
    spec = SecAggSpec(bits=4, levels=4, range=1.0, neighbours=None, threshold=0.5, seed=0)
    spec.check(3)  # 3 * 4 = 12 < 16
    with pytest.raises(ConfigError, match=r"^privacy\.secagg_bits: .*largest cohort that fits is 3 "):
        spec.check(4)  # 16 wraps
    SecAggSpec(bits=10, levels=100, range=1.0, neighbours=4, threshold=0.5, seed=0).check(10)
    with pytest.raises(ConfigError, match="largest cohort that fits is 10 "):
        SecAggSpec(bits=10, levels=100, range=1.0, neighbours=4, threshold=0.5, seed=0).check(11)
    for bad, key in [({"bits": 63}, "bits"), ({"levels": 0}, "levels"), ({"range": 0.0}, "range"),
                     ({"neighbours": 3}, "neighbours"), ({"threshold": 0.0}, "threshold")]:
        fields = {"bits": 20, "levels": 4, "range": 1.0, "neighbours": None, "threshold": 0.5, "seed": 0, **bad}
        with pytest.raises(ConfigError, match=rf"^privacy\.secagg_{key}: "):
            SecAggSpec(**fields).check(5)


def test_sum_order_and_grouping_do_not_matter() -> None:
    spec, rnd = spec_of(4, bits=62, levels=2**20), 5
    cohort = cohort_of(12)
    graph = secagg.neighbours(spec, rnd, cohort)
    qs = quantised(spec, cohort, 40)
    worker_a = masked_sum(spec, rnd, cohort[0::2], qs, graph)
    worker_b = masked_sum(spec, rnd, cohort[1::2], qs, graph)
    together = secagg.add_mod(worker_b, worker_a, spec)
    assert torch.equal(together, masked_sum(spec, rnd, cohort[::-1], qs, graph))
    assert int(together.max()) < 2**62 and int(together.min()) >= 0
    assert torch.equal(secagg.unmask(spec, rnd, together, cohort, cohort, graph), sum(qs.values()))


def test_costs_by_hand() -> None:
    spec = spec_of(4, bits=24)
    assert secagg.costs(spec, 12, 4, 1000) == {
        "extra_up_bytes": 64 + 4 * 2 * (8 + 16) + 4 * 8, "extra_down_bytes": 4 * 64 + 4 * 2 * (8 + 16) + 4 * 4,
        "masked_bytes": 3000, "round_trips": 4, "extra_round_trips": 3}
    assert secagg.costs(spec_of(bits=20), 12, 11, 3)["masked_bytes"] == 8  # ceil(60 / 8)
    with pytest.raises(ValueError):
        secagg.costs(spec, 5, 5, 10)
