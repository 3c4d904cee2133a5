"""Compressed uploads as a stage of the update chain (`compression.kind`): each client encodes its model update, the
encoded size is what `bytes_up` counts, and the server aggregates what it decodes, so every sum and robust
aggregator runs unchanged on it.

- Every floating entry of the update Δ = upload − reference is encoded on its own (one tensor, d coordinates, a
  flat vector in float64), in key order; integer buffers and the weight counter travel as they are.
- Stochastic schemes (qsgd's rounding, randk's choice, rotation's signs and rounding) draw from the stream
  `compression/<phase>` of (round, client), so the numbers do not depend on the worker count.
- Error feedback (Karimireddy et al. 2019): the client compresses p = Δ + e and keeps e ← p − decode(encode(p)),
  its residual, for the next round it joins; the worker commits it with the client's outcome (not for a late one,
  as the method's state), and it lives in the checkpoint's client states.
docs/compression.md gives each scheme's byte count.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from fedsim import rng
from fedsim.errors import CheckpointError, ConfigError
from fedsim.method.contract import ClientResult
from fedsim.transforms.updates import update_of

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

State = dict[str, torch.Tensor]

BYTES_UP = "compression/bytes_up"
"""A client's metric: what its encoded upload weighs, replacing the plain size in bytes_up."""
RESIDUAL_KEY = "__compression_residual__"
STATE_KEY = "__method_state__"
"""A client's checkpointed state under error feedback: {RESIDUAL_KEY: its residual, STATE_KEY: the method's}."""
FLOAT_BYTES = 4  # a scale, a norm or a kept value travels as float32


def index_bytes(d: int) -> int:
    """The narrowest unsigned integer (1, 2, 4 or 8 bytes) that holds every index of a d-entry tensor."""
    bits = max(d - 1, 1).bit_length()
    return next(w for w in (1, 2, 4, 8) if bits <= 8 * w)


def kept_count(fraction: float, d: int) -> int:
    """How many of d coordinates top-k and random-k send: ceil(fraction·d), at least one, at most d."""
    return min(max(math.ceil(fraction * d), 1), d)


def as_float32(x: torch.Tensor) -> torch.Tensor:
    """`x` as it arrives after travelling as float32 (in float64 again)."""
    return x.to(torch.float32).to(torch.float64)


def float32_at_least(x: float) -> float:
    """The smallest float32 not below x (a norm sent as float32 that still bounds every |v_i|)."""
    f = torch.tensor(x, dtype=torch.float32)
    if float(f) < x:
        f = torch.nextafter(f, torch.tensor(math.inf, dtype=torch.float32))
    return float(f)


def float32_at_most(x: float) -> float:
    """The largest float32 not above x."""
    return -float32_at_least(-x)


def level_bits(levels: int) -> int:
    """Bits of one level in 0..levels."""
    return max(levels, 1).bit_length()


Codec = Callable[[torch.Tensor, "torch.Generator | None"], torch.Tensor]
"""(flat float64 vector, the client's generator) -> what the server decodes."""


def padded(d: int) -> int:
    """The power of 2 a rotated vector of d entries is padded to."""
    return 1 << max(d - 1, 0).bit_length()


def encoded_bytes(kind: str, d: int, levels: int, fraction: float) -> int:
    """What one tensor of d coordinates weighs encoded by `kind` (docs/compression.md has the table)."""
    if kind in ("fp16", "bf16"):
        return 2 * d
    if kind == "int8":
        return d + FLOAT_BYTES
    if kind == "qsgd":
        return FLOAT_BYTES + math.ceil(d * (1 + level_bits(levels)) / 8)
    if kind in ("topk", "randk"):
        return kept_count(fraction, d) * (FLOAT_BYTES + index_bytes(d))
    if kind == "sign":
        return FLOAT_BYTES + math.ceil(d / 8)
    if kind == "rotation":
        return 2 * FLOAT_BYTES + math.ceil(padded(d) * level_bits(levels) / 8)
    raise ValueError(f"no compression kind {kind!r}")


def cast(dtype: torch.dtype) -> Codec:
    """fp16 / bf16: each value cast and back; 2 bytes a coordinate."""
    def codec(v: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        return v.to(dtype).to(torch.float64)
    return codec


def int8(v: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Per-tensor scale max|v|/127 (float32), each value rounded to the nearest of -127..127; d + 4 bytes."""
    top = float(v.abs().max()) if v.numel() else 0.0
    scale = float(torch.tensor(top / 127, dtype=torch.float32))
    q = torch.clamp(torch.round(v / scale), -127, 127) if scale > 0 else torch.zeros_like(v)
    return q * scale


def qsgd(levels: int) -> Codec:
    """QSGD (Alistarh et al. 2017): ‖v‖₂ as float32, and per coordinate its sign and a level of |v_i|/‖v‖·s rounded
    up with probability its fractional part (unbiased); 4 bytes + ceil(d·(1 + bits of 0..s) / 8)."""
    def codec(v: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        d = v.numel()
        norm = float32_at_least(float(torch.linalg.vector_norm(v))) if d else 0.0
        u = torch.rand(d, generator=gen, dtype=torch.float64).to(v.device)  # drawn whatever the norm
        if norm == 0:
            return torch.zeros_like(v)
        r = v.abs() / norm * levels
        low = torch.floor(r)
        level = torch.clamp(low + (u < r - low).to(torch.float64), max=levels)
        return torch.sign(v) * level * (norm / levels)
    return codec


def topk(fraction: float) -> Codec:
    """The ceil(k·d) largest |v_i| (ties to the lower index), values as float32 and their indices."""
    def codec(v: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        d = v.numel()
        k = kept_count(fraction, d)
        idx = torch.argsort(v.abs(), descending=True, stable=True)[:k]
        out = torch.zeros_like(v)
        out[idx] = as_float32(v[idx])
        return out
    return codec


def randk(fraction: float) -> Codec:
    """ceil(k·d) coordinates drawn uniformly without replacement, values as float32 and their indices, scaled by
    d/k on arrival (unbiased)."""
    def codec(v: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        d = v.numel()
        k = kept_count(fraction, d)
        idx = torch.randperm(d, generator=gen)[:k].to(v.device)
        out = torch.zeros_like(v)
        out[idx] = as_float32(v[idx]) * (d / k)
        return out
    return codec


def sign(v: torch.Tensor, gen: torch.Generator | None = None) -> torch.Tensor:
    """Scaled sign (EF-signSGD): ‖v‖₁/d as float32 times sign(v), a zero sent as +; 4 bytes + ceil(d/8)."""
    d = v.numel()
    scale = float(as_float32(v.abs().sum() / d)) if d else 0.0
    return torch.where(v >= 0, scale, -scale).to(torch.float64)


def hadamard(x: torch.Tensor) -> torch.Tensor:
    """The normalised Walsh–Hadamard transform H x / √D of a vector of length D = 2^m (its own inverse)."""
    D = x.numel()
    y = x.reshape(1, D)
    h = 1
    while h < D:
        y = y.reshape(-1, 2, h)
        y = torch.stack([y[:, 0] + y[:, 1], y[:, 0] - y[:, 1]], dim=1)
        h *= 2
    return y.reshape(D) / math.sqrt(D)


def rotation(levels: int) -> Codec:
    """Suresh et al. 2017: v padded to D = 2^m, random signs ξ, rotated y = H(ξ·v)/√D, each y_i stochastically
    rounded to one of s + 1 evenly spaced levels in [min y, max y] (unbiased); decoded ξ·H ŷ/√D, cut to d.
    Sends min and max as float32 and D·(bits of 0..s) bits; the signs come from the shared seed."""
    def codec(v: torch.Tensor, gen: torch.Generator | None) -> torch.Tensor:
        d = v.numel()
        D = padded(d)
        signs = (torch.randint(0, 2, (D,), generator=gen, dtype=torch.int64) * 2 - 1).to(v.device, torch.float64)
        u = torch.rand(D, generator=gen, dtype=torch.float64).to(v.device)
        y = hadamard(torch.nn.functional.pad(v, (0, D - d)) * signs)
        lo, hi = float32_at_most(float(y.min())), float32_at_least(float(y.max()))  # enclose y
        if hi == lo:
            return (hadamard(torch.full_like(y, lo)) * signs)[:d]
        step = (hi - lo) / levels
        r = (y - lo) / step
        low = torch.floor(r)
        level = torch.clamp(low + (u < r - low).to(torch.float64), 0, levels)
        return (hadamard(lo + level * step) * signs)[:d]
    return codec


def codec_of(kind: str, levels: int, fraction: float) -> Codec:
    """The encoder-decoder of `compression.kind`."""
    codecs: dict[str, Callable[[], Codec]] = {
        "fp16": lambda: cast(torch.float16), "bf16": lambda: cast(torch.bfloat16), "int8": lambda: int8,
        "qsgd": lambda: qsgd(levels), "topk": lambda: topk(fraction), "randk": lambda: randk(fraction),
        "sign": lambda: sign, "rotation": lambda: rotation(levels)}
    return codecs[kind]()


def check_compression(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """The compression section against the rest of the config, one line per problem (ConfigError)."""
    c = cfg.compression
    if c.kind == "none":
        if c.error_feedback:
            raise ConfigError("compression.error_feedback: needs a compression.kind (it is none, which drops nothing)")
        return
    if c.error_feedback and c.kind in ("randk", "qsgd"):
        raise ConfigError(f"compression.error_feedback: {c.kind} is unbiased by scaling up what it keeps, so its error "
                          "can exceed the update and the residual grows every round (error feedback needs a "
                          "compressor whose error is smaller than its input); use it with topk, sign, rotation or a "
                          f"cast, or {c.kind} without it")
    if uploads_model_update is False:
        raise ConfigError(f"compression.kind: compresses a model update, and {cfg.algorithm.name}'s round is not one "
                          "phase that uploads one (model_update=True)")
    if cfg.privacy.secure_aggregation != "none":
        raise ConfigError("compression.kind: secure aggregation masks a dense quantised vector of its own, so a "
                          "compressed upload would not survive it; set privacy.secure_aggregation: none")
    if cfg.privacy.level == "local":
        raise ConfigError("compression.kind: under privacy.level local each client adds dense noise to its clipped "
                          "update, which would travel uncompressed; use privacy.level client, sample or none")


@dataclass
class Compression:
    """Both ends of compressed uploads for one run: encoding, counting and decoding each client's update in its
    worker, and the clients' residuals under error feedback."""

    cfg: RunConfig
    residuals: dict[int, State] = field(default_factory=dict)  # committed, by client
    pending: dict[int, State] = field(default_factory=dict)  # this phase's, until the client's outcome is known

    def __post_init__(self) -> None:
        c = self.cfg.compression
        self.codec = codec_of(c.kind, c.levels, c.fraction)

    def encoded_bytes(self, d: int) -> int:
        """What a tensor of d coordinates weighs encoded."""
        c = self.cfg.compression
        return encoded_bytes(c.kind, d, c.levels, c.fraction)

    @property
    def error_feedback(self) -> bool:
        return self.cfg.compression.error_feedback

    def client(self, res: ClientResult, arch: str, reference: Mapping[str, torch.Tensor], round: int, client: int,
               phase: str) -> ClientResult:
        """The client's upload as the server decodes it, in the upload's form (reference + decoded update, float64),
        its encoded size among its metrics."""
        payload = res.payload
        update = update_of(payload, arch, reference)
        residual = self.residuals.get(client, {}) if self.error_feedback else {}
        gen = rng.torch_generator(self.cfg.seed, f"compression/{phase}", round, client)
        out: State = {}
        kept: State = {}
        size = 0
        for key in sorted(payload):
            value = payload[key]
            if key not in update:  # the weight counter, an integer buffer: sent as it is
                out[key] = value
                size += value.numel() * value.element_size()
                continue
            p = update[key]
            if key in residual:
                if residual[key].shape != p.shape:
                    raise CheckpointError(f"client {client}'s compression residual for {key!r} has shape "
                                          f"{tuple(residual[key].shape)}, its update {tuple(p.shape)}")
                p = p + residual[key].to(p.device, torch.float64)
            decoded = self.codec(p.reshape(-1), gen).reshape(p.shape)
            size += self.encoded_bytes(p.numel())
            if self.error_feedback:
                kept[key] = (p - decoded).cpu()
            name = key[len(arch) + 1:] if key.startswith(f"{arch}/") else key
            ref = reference.get(name)
            out[key] = decoded + ref.to(decoded.device, torch.float64) if ref is not None else decoded
        if self.error_feedback:
            self.pending[client] = kept
        return ClientResult(payload=out, weight=res.weight, metrics={**res.metrics, BYTES_UP: float(size)},
                            state=res.state, probe=res.probe)

    def settle(self, client: int, committed: bool) -> None:
        """Keep the client's new residual if its outcome is committed (it arrived), else keep the old one."""
        new = self.pending.pop(client, None)
        if committed and new is not None:
            self.residuals[client] = new

    def export(self, states: dict[int, object]) -> dict[int, object]:
        """The worker's client states with each residual beside its client's method state."""
        out = dict(states)
        for cid, residual in self.residuals.items():
            out[cid] = {RESIDUAL_KEY: residual, STATE_KEY: states.get(cid)}
        return out

    def load(self, states: Mapping[int, object]) -> dict[int, object]:
        """Take the residuals out of checkpointed client states; the method's states are returned."""
        out: dict[int, object] = {}
        self.residuals, self.pending = {}, {}
        for cid, state in states.items():
            if isinstance(state, dict) and RESIDUAL_KEY in state:
                residual = state[RESIDUAL_KEY]
                if not isinstance(residual, dict) or not all(isinstance(v, torch.Tensor) and v.is_floating_point()
                                                             for v in residual.values()):
                    raise CheckpointError(f"client {cid}'s compression residual is not a dict of float tensors")
                self.residuals[cid] = dict(residual)
                state = state.get(STATE_KEY)
                if state is None:
                    continue
            out[cid] = state
        return out


def predicted_upload(cfg: RunConfig, down: np.ndarray) -> np.ndarray:
    """The upload sizes the virtual clock plans a round with: the download's (as without compression), encoded as
    one float32 tensor of that many bytes / 4 coordinates (the recorded bytes_up counts each tensor exactly)."""
    c = cfg.compression
    if c.kind == "none":
        return down
    return np.array([encoded_bytes(c.kind, int(b) // FLOAT_BYTES, c.levels, c.fraction) for b in down], dtype=float)


def keeps_client_state(cfg: RunConfig) -> bool:
    """Whether the chain keeps per-client state between rounds (error feedback's residuals), which pins each client
    to its worker and into the checkpoint."""
    return cfg.compression.kind != "none" and cfg.compression.error_feedback
