"""Secure aggregation simulated exactly: SecAgg (Bonawitz et al., CCS 2017) and SecAgg+ (Bell et al., CCS 2020).

The server learns the sum of the surviving clients' quantised updates and nothing else; dropouts after key setup are
recovered from Shamir shares held by the survivors. Every number the protocol moves is computed here, integers mod
M = 2**bits, so the unmasked sum equals the plain sum of the quantised vectors bit for bit, and a round with too many
dropouts in some neighbourhood aborts as the real protocol would. What a round does:

1. quantise: each coordinate clamped to [-c, c] and stochastically rounded to an integer in [0, levels] (unbiased);
2. setup: each client u has a masking key s_u and a self seed b_u, and Shamir-shares both among its neighbours
   N(u) (everyone else for SecAgg; a seeded Harary graph of degree k for SecAgg+), t_u of them reconstruct;
3. masked input: y_u = q_u + PRG(b_u) + Σ_{v∈N(u), u<v} PRG(s_uv) − Σ_{v∈N(u), u>v} PRG(s_uv) mod M, summed by
   the workers with `add_mod` in any order or grouping;
4. unmask: from the survivors' shares only, the server rebuilds b_u of each survivor and s_v of each dropped client,
   removes PRG(b_u) and the dropped clients' pair masks; the survivors' pair masks cancel among themselves.

Simplifications, none of which changes a number of the sum: keys and self seeds are seeds of named streams
(fedsim.rng), and Diffie-Hellman agreement is a symmetric function of the two keys (a key is its own public value:
this simulates correctness and cost, not secrecy); shares are not encrypted or signed; the clients whose masked
vector arrived are the ones that answer the unmasking request. Bytes and round trips come from `costs`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from fedsim import rng
from fedsim.errors import ConfigError

PRIME = 2**61 - 1  # Shamir's field: a Mersenne prime above every secret (seeds are < 2**31)

# assumed wire sizes, in bytes, for `costs`
PUBLIC_KEY_BYTES = 32  # an X25519 public key; a client advertises two (encryption and masking)
FIELD_BYTES = 8  # one Shamir share: an element of the 61-bit field
CIPHER_OVERHEAD_BYTES = 16  # an authenticated-encryption tag per encrypted share
ID_BYTES = 4  # a client id in the server's list of survivors and dropouts
EXTRA_ROUND_TRIPS = 3  # AdvertiseKeys, ShareKeys, Unmasking: the masked input replaces the plain round's upload


class SecAggAbort(Exception):
    """The round cannot be unmasked: some secret has fewer surviving shares than its threshold."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True)
class SecAggSpec:
    """A run's secure-aggregation settings: field bits, quantisation, SecAgg+ degree, share threshold, run seed."""

    bits: int
    levels: int
    range: float
    neighbours: int | None
    threshold: float
    seed: int

    @property
    def modulus(self) -> int:
        """M = 2**bits."""
        return 1 << self.bits

    def shares_needed(self, k_u: int) -> int:
        """t = max(2, ceil(threshold * k_u)): the shares that rebuild the secrets of a client with k_u neighbours."""
        return max(2, math.ceil(round(self.threshold * k_u, 9)))  # rounded: 0.7 * 10 is 7, not 7.000000000000001

    def check(self, cohort_size: int) -> None:
        """A ConfigError naming the key when a setting is out of range or the cohort's sum would wrap the field."""
        if not isinstance(self.bits, int) or not 2 <= self.bits <= 62:
            raise ConfigError(f"privacy.secagg_bits: {self.bits} is not an integer in 2..62")
        if not isinstance(self.levels, int) or self.levels < 1:
            raise ConfigError(f"privacy.secagg_levels: {self.levels} is not an integer >= 1")
        if not (math.isfinite(self.range) and self.range > 0):
            raise ConfigError(f"privacy.secagg_range: {self.range} is not a finite number > 0")
        if self.neighbours is not None and (self.neighbours < 2 or self.neighbours % 2):
            raise ConfigError(f"privacy.secagg_neighbours: {self.neighbours} is not an even number >= 2 "
                              "(the degree of a Harary graph)")
        if not 0 < self.threshold <= 1:
            raise ConfigError(f"privacy.secagg_threshold: {self.threshold} is not a fraction in (0, 1]")
        if cohort_size * self.levels >= self.modulus:
            raise ConfigError(f"privacy.secagg_bits: a cohort of {cohort_size} at privacy.secagg_levels {self.levels} "
                              f"sums to up to {cohort_size * self.levels}, which wraps the field of 2**{self.bits}; "
                              f"the largest cohort that fits is {(self.modulus - 1) // self.levels} (raise "
                              "privacy.secagg_bits or lower privacy.secagg_levels)")


def quantise(x: torch.Tensor, spec: SecAggSpec, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    """A flat float64 vector as int64 in [0, levels] by stochastic rounding (uniforms from `gen`, on x's device),
    and how many coordinates were clamped to [-c, c]."""
    c = spec.range
    clamped = int((x.abs() > c).sum())
    scaled = (x.clamp(-c, c) + c) * (spec.levels / (2 * c))
    low = scaled.floor()
    up = torch.rand(x.shape, generator=gen, dtype=torch.float64, device=x.device) < scaled - low
    return (low + up).clamp_(0, spec.levels).to(torch.int64), clamped


def dequantise(total: torch.Tensor, count: int, spec: SecAggSpec) -> torch.Tensor:
    """The float64 sum of `count` vectors from the sum of their quantised forms: total·2c/levels − count·c."""
    return total.to(torch.float64) * (2 * spec.range / spec.levels) - count * spec.range


def key(spec: SecAggSpec, round: int, u: int) -> int:
    """Client u's masking key for the round (stream "secagg/key"); in this simulation also its public value."""
    return rng.seed(spec.seed, "secagg/key", round, u)


def self_seed(spec: SecAggSpec, round: int, u: int) -> int:
    """Client u's self-mask seed b_u for the round (stream "secagg/self")."""
    return rng.seed(spec.seed, "secagg/self", round, u)


def agree(key_a: int, key_b: int, round: int) -> int:
    """The pair seed two keys agree on, symmetric in them: stream "secagg/pair" keyed by the sorted keys."""
    lo, hi = sorted((key_a, key_b))
    return rng.seed(lo, "secagg/pair", round, hi)


def pair_seed(spec: SecAggSpec, round: int, u: int, v: int) -> int:
    """The pair seed s_uv = s_vu of clients u and v: agreement of their round keys."""
    return agree(key(spec, round, u), key(spec, round, v), round)


def prg(seed: int, d: int, bits: int) -> torch.Tensor:
    """d int64 numbers uniform in [0, 2**bits) from PCG64(seed)."""
    return torch.from_numpy(np.random.Generator(np.random.PCG64(seed)).integers(0, 1 << bits, d, dtype=np.int64))


def add_mod(a: torch.Tensor, b: torch.Tensor, spec: SecAggSpec) -> torch.Tensor:
    """(a + b) mod M for int64 vectors in [0, M): how a worker sums masked vectors (a plain sum overflows int64)."""
    return torch.remainder(a + b, spec.modulus)


def neighbours(spec: SecAggSpec, round: int, cohort: list[int]) -> dict[int, list[int]]:
    """Each client's neighbours, sorted: everyone else for SecAgg; for SecAgg+, the Harary graph H(k, n) on the
    cohort permuted by stream "secagg/graph" (ring offsets ±1..±k/2), everyone when k >= n − 1."""
    n, k = len(cohort), spec.neighbours
    if k is None or k >= n - 1:
        return {u: [v for v in cohort if v != u] for u in cohort}
    ring = [cohort[i] for i in rng.numpy_generator(spec.seed, "secagg/graph", round).permutation(n)]
    return {ring[i]: sorted(ring[(i + o) % n] for o in range(-(k // 2), k // 2 + 1) if o) for i in range(n)}


def masked(spec: SecAggSpec, round: int, client: int, q: torch.Tensor, graph: dict[int, list[int]]) -> torch.Tensor:
    """Client's masked input y_u on the CPU: q + PRG(b_u) + Σ_{v>u} PRG(s_uv) − Σ_{v<u} PRG(s_uv) over its
    neighbours, mod M."""
    d, m = q.numel(), spec.modulus
    out = add_mod(q.to("cpu", torch.int64), prg(self_seed(spec, round, client), d, spec.bits), spec)
    for v in graph[client]:
        mask = prg(pair_seed(spec, round, client, v), d, spec.bits)
        out = add_mod(out, mask, spec) if client < v else torch.remainder(out - mask, m)
    return out


def share(secret: int, holders: list[int], t: int, gen: np.random.Generator) -> dict[int, int]:
    """Shamir shares of `secret` (< PRIME): a random degree t−1 polynomial (coefficients from `gen`) evaluated at
    x = holder + 1 for each holder. With fewer holders than t the secret cannot be rebuilt."""
    if not 0 <= secret < PRIME or t < 1:
        raise ValueError(f"shamir: needs 0 <= secret < 2**61 - 1 and t >= 1 (t={t})")
    coeffs = [secret, *(int(a) for a in gen.integers(0, PRIME, t - 1, dtype=np.int64))]
    out = {}
    for h in holders:
        y = 0
        for a in reversed(coeffs):  # Horner
            y = (y * (h + 1) + a) % PRIME
        out[h] = y
    return out


def reconstruct(shares: dict[int, int], t: int) -> int:
    """The secret from t of the shares (holder -> share), by Lagrange interpolation at 0; a ValueError with fewer."""
    if len(shares) < t:
        raise ValueError(f"shamir: {len(shares)} shares cannot rebuild a secret that needs {t}")
    xs = {h + 1: y for h, y in sorted(shares.items())[:t]}
    secret = 0
    for xi, yi in xs.items():
        num = den = 1
        for xj in xs:
            if xj != xi:
                num, den = num * xj % PRIME, den * (xj - xi) % PRIME
        secret = (secret + yi * num * pow(den, -1, PRIME)) % PRIME
    return secret


@dataclass(frozen=True)
class Setup:
    """A round's key setup: each client's key (public in this simulation), its self seed and threshold t_u, and the
    shares each holder got: held[holder][owner] = (share of b_owner, share of key_owner)."""

    keys: dict[int, int]
    self_seeds: dict[int, int]
    needed: dict[int, int]
    held: dict[int, dict[int, tuple[int, int]]]


def setup(spec: SecAggSpec, round: int, cohort: list[int], graph: dict[int, list[int]]) -> Setup:
    """Every client's keys, and its b_u and key Shamir-shared among its neighbours (stream "secagg/shamir")."""
    keys = {u: key(spec, round, u) for u in cohort}
    seeds = {u: self_seed(spec, round, u) for u in cohort}
    needed = {u: spec.shares_needed(len(graph[u])) for u in cohort}
    held: dict[int, dict[int, tuple[int, int]]] = {u: {} for u in cohort}
    for u in cohort:
        gen = rng.numpy_generator(spec.seed, "secagg/shamir", round, u)
        b_shares = share(seeds[u], graph[u], needed[u], gen)
        key_shares = share(keys[u], graph[u], needed[u], gen)
        for v in graph[u]:
            held[v][u] = (b_shares[v], key_shares[v])
    return Setup(keys, seeds, needed, held)


def _rebuild(state: Setup, graph: dict[int, list[int]], alive: set[int], owner: int, which: int, what: str) -> int:
    """Owner's secret (0: self seed, 1: key) from the shares its surviving neighbours hold, or SecAggAbort."""
    holders = [v for v in graph[owner] if v in alive]
    t = state.needed[owner]
    if len(holders) < t:
        raise SecAggAbort(f"client {owner}: {len(holders)} of its {len(graph[owner])} neighbours survived, {t} shares "
                          f"are needed to {what}")
    return reconstruct({v: state.held[v][owner][which] for v in holders}, t)


def unmask(spec: SecAggSpec, round: int, total: torch.Tensor, cohort: list[int], survivors: list[int],
           graph: dict[int, list[int]], state: Setup | None = None) -> torch.Tensor:
    """Σ q_u mod M over the survivors from `total`, the sum mod M of their masked vectors, as the server finds it:
    self masks and dropped clients' pair masks removed with secrets rebuilt from the survivors' shares (`state`, or
    the round's `setup` recomputed). SecAggAbort when a needed secret has too few surviving shares."""
    state = setup(spec, round, cohort, graph) if state is None else state
    alive = set(survivors)
    if not alive <= set(cohort):
        raise ValueError(f"secagg: survivors {sorted(alive - set(cohort))} are not in the cohort")
    d, out = total.numel(), total.to("cpu", torch.int64)
    for u in sorted(alive):
        b = _rebuild(state, graph, alive, u, 0, "remove its self mask")
        out = torch.remainder(out - prg(b, d, spec.bits), spec.modulus)
    for v in sorted(set(cohort) - alive):
        if not any(u in alive for u in graph[v]):
            continue  # none of its pair masks reached the sum
        key_v = _rebuild(state, graph, alive, v, 1, "cancel its pair masks")
        for u in (u for u in graph[v] if u in alive):
            mask = prg(agree(key_v, state.keys[u], round), d, spec.bits)
            out = torch.remainder(out - mask, spec.modulus) if u < v else add_mod(out, mask, spec)
    return out


def costs(spec: SecAggSpec, cohort_size: int, k_u: int, d: int) -> dict[str, int]:
    """One client's protocol costs with k_u neighbours and d coordinates: bytes up and down besides the masked vector
    (AdvertiseKeys: 2 public keys up, the neighbours' down; ShareKeys: 2 encrypted shares per neighbour up, and as
    many forwarded down; Unmasking: the survivor/dropout status of each neighbour down, one share per neighbour up),
    the masked vector's ceil(d·bits/8) bytes, which replace the plain upload, and the round trips: the protocol's 4
    (AdvertiseKeys, ShareKeys, MaskedInput, Unmasking), 3 beyond the plain round's upload. Sizes: module constants."""
    if not 0 <= k_u <= cohort_size - 1:
        raise ValueError(f"secagg: {k_u} neighbours in a cohort of {cohort_size}")
    encrypted = 2 * (FIELD_BYTES + CIPHER_OVERHEAD_BYTES) * k_u
    return {"extra_up_bytes": 2 * PUBLIC_KEY_BYTES + encrypted + FIELD_BYTES * k_u,
            "extra_down_bytes": 2 * PUBLIC_KEY_BYTES * k_u + encrypted + ID_BYTES * k_u,
            "masked_bytes": math.ceil(d * spec.bits / 8), "round_trips": EXTRA_ROUND_TRIPS + 1,
            "extra_round_trips": EXTRA_ROUND_TRIPS}
