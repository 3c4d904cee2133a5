"""Secure aggregation as a stage of the update chain (`privacy.secure_aggregation: secagg | secagg+`): each client
uploads its update quantised and masked (fedsim.transforms.secagg), the workers sum the masked vectors, and the server
unmasks the round's sum, as SecAgg's server would, before the rest of the chain and the method's server step read it.

- What a client encodes is w·Δ (its weight times its update, or under client-level DP its clipped update), each
  coordinate clamped to [-range, range] and stochastically rounded to `levels` levels, followed by two exact integer
  coordinates: its weight (an integer: 1 under DP, its sample count for FedAvg) and whether DP clipped it.
- The masked vectors travel through the workers' exact sums as float64 integers below 2^53 (hence bits <= 32), so
  the sum mod 2^bits does not depend on how clients are grouped into workers.
- The cohort is the clients the round's broadcast went to (they did the key setup); those whose masked vector did
  not arrive (late, failed, over-selected) are the dropouts whose masks the server rebuilds from Shamir shares.
  With too few survivors in some neighbourhood the round aborts: the method's state is kept, and the round's row
  says so (`secagg/aborted`, `secagg/abort_reason`).
- Costs: the masked vector and the protocol's keys and shares replace the plain upload in `bytes_up`; the
  neighbours' keys and shares are added to each client's `bytes_down` and to its virtual download time.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from fedsim import rng
from fedsim.config.schema import clients_per_round
from fedsim.errors import ConfigError
from fedsim.method.aggregate import WEIGHT_KEY
from fedsim.transforms import secagg
from fedsim.transforms.privacy import CLIPPED_KEY
from fedsim.transforms.updates import as_upload, flatten, unflatten

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

log = logging.getLogger("fedsim")

MASKED_KEY = "__secagg__"
"""The payload entry of a client's masked vector (its only entry)."""
BYTES_UP = "secagg/bytes_up"
"""A client's metric: what its upload weighs under SecAgg (masked vector, keys, shares), replacing the plain size."""
MAX_EXACT_BITS = 32  # masked values below 2^32, summed over up to 2^21 clients, stay exact in float64


def float_keys(references: Mapping[str, Mapping[str, torch.Tensor]]) -> list[str]:
    """The encoded coordinates' entries, `<arch>/<name>`, in a fixed order: every floating entry of the reference."""
    return [f"{a}/{n}" for a in sorted(references) for n in sorted(references[a])
            if references[a][n].is_floating_point()]


def neighbour_count(kind: str, configured: int | None, cohort: int) -> int | None:
    """SecAgg+'s degree k: the configured one, else the smallest even k >= 2·log2(cohort) (Bell et al. take
    k = O(log n)); None (everyone) for SecAgg."""
    if kind == "secagg":
        return None
    if configured is not None:
        return configured
    k = 2 * math.ceil(math.log2(max(cohort, 2)))
    return k + k % 2


def check_secure(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """The secure-aggregation keys against the rest of the config, one line per problem (ConfigError)."""
    p = cfg.privacy
    if p.secure_aggregation == "none":
        return
    if uploads_model_update is False:
        raise ConfigError(f"privacy.secure_aggregation: sums a model update, and {cfg.algorithm.name}'s round is not "
                          "one phase that uploads one (model_update=True)")
    if cfg.aggregator.name != "mean" or cfg.attack.kind not in ("none", "label_flip", "backdoor"):
        raise ConfigError("privacy.secure_aggregation: the server sees only the sum, so it cannot run a robust "
                          f"aggregator or a model attack on each update (aggregator.name: {cfg.aggregator.name}, "
                          f"attack.kind: {cfg.attack.kind})")
    if len(set(cfg.model.mix) or {cfg.model.name}) > 1:
        raise ConfigError("privacy.secure_aggregation: clients of several architectures (model.mix) upload vectors of "
                          "different lengths, which one secure sum cannot add")
    if p.secagg_bits > MAX_EXACT_BITS:
        raise ConfigError(f"privacy.secagg_bits: {p.secagg_bits} is above {MAX_EXACT_BITS} (the workers' float64 sums "
                          "are exact for masked values below 2^32)")
    if p.secagg_range is None and p.level != "client":
        raise ConfigError("privacy.secagg_range: set the range [-range, range] each coordinate of w·update is clamped "
                          "to (under privacy.level client it defaults to the clip)")
    spec = spec_of(cfg, neighbour_count(p.secure_aggregation, p.secagg_neighbours, clients_per_round(cfg)))
    cohort = math.ceil(clients_per_round(cfg) * (1 + max(cfg.stragglers.over_select, 0.0)))
    spec.check(cohort)


def spec_of(cfg: RunConfig, neighbours: int | None, range_: float | None = None) -> secagg.SecAggSpec:
    p = cfg.privacy
    c = range_ if range_ is not None else (p.secagg_range if p.secagg_range is not None else p.clip)
    return secagg.SecAggSpec(bits=p.secagg_bits, levels=p.secagg_levels, range=float(c), neighbours=neighbours,
                             threshold=p.secagg_threshold, seed=cfg.seed)


@dataclass
class SecureAggregation:
    """Both sides of secure aggregation for one run: encoding in the clients, unmasking on the server."""

    cfg: RunConfig
    kind: str
    graphs: dict[tuple[int, tuple[int, ...]], dict[int, list[int]]] = field(default_factory=dict)

    def spec(self, cohort: Sequence[int], clip: float | None = None) -> secagg.SecAggSpec:
        """The round's settings: its SecAgg+ degree from the cohort's size, the range from the round's clip when
        it follows the DP clip (adaptive clipping changes it)."""
        p = self.cfg.privacy
        range_ = clip if p.secagg_range is None and clip is not None else None
        return spec_of(self.cfg, neighbour_count(self.kind, p.secagg_neighbours, len(cohort)), range_)

    def graph(self, spec: secagg.SecAggSpec, round: int, cohort: Sequence[int]) -> dict[int, list[int]]:
        key = (round, tuple(cohort))
        if key not in self.graphs:
            self.graphs = {key: secagg.neighbours(spec, round, list(cohort))}  # one round's graph kept
        return self.graphs[key]

    def encode(self, update: Mapping[str, torch.Tensor], weight: float, clipped: float, keys: list[str], round: int,
               client: int, cohort: Sequence[int], clip: float | None = None) -> tuple[dict[str, torch.Tensor],
                                                                                      dict[str, float]]:
        """A client's upload: w·`update` (entries `keys`) quantised, its integer weight and clip flag appended,
        masked; and its metrics (coordinates clamped, bytes on the wire)."""
        if weight != round_weight(weight):
            raise ConfigError(f"privacy.secure_aggregation: client {client}'s weight {weight:g} is not an integer "
                              "(the secure sum carries it exactly)")
        spec = self.spec(cohort, clip)
        graph = self.graph(spec, round, cohort)
        gen = secagg_generator(spec, round, client)
        q, clamped = secagg.quantise(flatten(update, keys) * weight, spec, gen)
        vector = torch.cat([q, torch.tensor([round_weight(weight), int(clipped)], dtype=torch.int64)])
        masked = secagg.masked(spec, round, client, vector, graph)
        cost = secagg.costs(spec, len(cohort), len(graph[client]), vector.numel())
        metrics = {"secagg/clamped": float(clamped), BYTES_UP: float(cost["masked_bytes"] + cost["extra_up_bytes"])}
        return {MASKED_KEY: masked.to(torch.float64)}, metrics

    def extra_down(self, cohort: Sequence[int], d: int) -> dict[int, int]:
        """Each cohort client's protocol bytes down (its neighbours' keys and shares, the unmasking request)."""
        spec = self.spec(cohort)
        n = len(cohort)
        k = n - 1 if spec.neighbours is None else min(spec.neighbours, n - 1)
        down = secagg.costs(spec, n, max(k, 0), d + 2)["extra_down_bytes"] if n else 0
        return {int(c): down for c in cohort}

    def decode(self, total: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]],
               round: int, cohort: Sequence[int], survivors: Sequence[int], clip: float | None = None
               ) -> tuple[dict[str, torch.Tensor] | None, dict[str, Any]]:
        """The round's unmasked sum as summed update entries (Σ w·Δ per entry, the weight, the clipped count), or
        None when the round aborts; and the round's columns."""
        keys = float_keys(references)
        spec = self.spec(cohort, clip)
        columns: dict[str, Any] = {"secagg/aborted": 0.0, "secagg/dropouts": float(len(cohort) - len(survivors))}
        if not survivors:
            return None, columns
        summed = torch.remainder(total[MASKED_KEY].round().to(torch.int64), spec.modulus)
        try:
            plain = secagg.unmask(spec, round, summed, list(cohort), list(survivors),
                                  self.graph(spec, round, cohort))
        except secagg.SecAggAbort as err:
            log.warning("round %d: secure aggregation aborted (%s); the round's updates are lost", round, err.reason)
            return None, {**columns, "secagg/aborted": 1.0, "secagg/abort_reason": err.reason}
        values = secagg.dequantise(plain[:-2], len(survivors), spec)
        like = {k: references[k.split("/", 1)[0]][k.split("/", 1)[1]] for k in keys}
        out = unflatten(values, like, keys)
        arch = keys[0].split("/", 1)[0] if keys else next(iter(references))
        out[f"{arch}/{WEIGHT_KEY}"] = plain[-2].to(torch.float64)
        out[CLIPPED_KEY] = plain[-1].to(torch.float64)
        return out, columns


def round_weight(weight: float) -> int:
    return int(round(weight))


def secagg_generator(spec: secagg.SecAggSpec, round: int, client: int) -> torch.Generator:
    """The client's stochastic-rounding stream (`secagg/rounding`)."""
    return rng.torch_generator(spec.seed, "secagg/rounding", round, client)


def summed_upload(entries: Mapping[str, torch.Tensor], references: Mapping[str, Mapping[str, torch.Tensor]]
                  ) -> tuple[dict[str, torch.Tensor], float]:
    """Decoded entries without DP, in the upload's summed form for the method (Σw·reference + Σw·Δ, weight Σw)."""
    weight = sum(float(v) for k, v in entries.items() if k.endswith(f"/{WEIGHT_KEY}"))
    update = {k: v for k, v in entries.items() if not k.endswith(f"/{WEIGHT_KEY}") and k != CLIPPED_KEY}
    return as_upload(update, references, weight), weight
