"""Compressed downloads (`compression.download`): the server broadcasts the encoded change of its model since the
replica its clients hold, and the clients train from the replica, never from the server's own model.

- The server keeps the replica θ̂ (one model per architecture). Each compressed broadcast t sends
  C(θ_t − θ̂_{t−1}) and sets θ̂_t = θ̂_{t−1} + decode(...), in the model's dtype; what C dropped stays in
  θ_t − θ̂_t and is sent with the next change, so the server carries the error as error feedback would. The first
  broadcast sends the model dense (θ̂_0 = θ_0).
- Every float entry of the broadcast's models is encoded on its own by upload's encoders (fedsim.transforms.
  compression); integer buffers travel as they are; the rest of the broadcast (control variates, per-client parts)
  travels dense.
- A client that holds θ̂_{t−1} downloads the change; one that last synced at version v < t − 1 needs every change
  since, or the dense replica when that is smaller (a client that never synced: the dense replica). Each client's
  last version is kept, with the replica, in the checkpoint's chain state.
- Stochastic schemes draw from the stream `compression/download` at (round, version): the same numbers on any
  number of workers and after a resume.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from fedsim import rng
from fedsim.errors import CheckpointError, ConfigError
from fedsim.method.contract import Phase
from fedsim.models.params import state_nbytes
from fedsim.transforms.compression import codec_of, encoded_bytes

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

State = dict[str, torch.Tensor]
PREFIX = "download/"
"""The download side's keys in the checkpoint's chain state: replica/<arch>/<key>, sizes, synced."""
STREAM = "compression/download"


def compresses(phase: Phase) -> bool:
    """Whether a phase's broadcast is compressed: the one a model update is relative to."""
    return phase.reduce == "sum" and phase.model_update


def check_download(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """compression.download against the rest of the config, one line per problem (ConfigError)."""
    kind = cfg.compression.download
    if kind == "none":
        return
    if kind in ("qsgd", "randk"):
        raise ConfigError(f"compression.download: {kind} is unbiased by scaling up what it keeps, so its error can "
                          "exceed the change and the server's replica, which carries that error to the next round, "
                          "drifts further each round; use topk, sign, rotation, int8 or a cast")
    if cfg.participation.mode == "async":
        raise ConfigError("compression.download: async mode sends each client the model of its own arrival, which "
                          "no replica shared by the clients follows; set participation.mode: sync or download: none")
    if uploads_model_update is False:
        raise ConfigError(f"compression.download: compresses the model a model update is relative to, and "
                          f"{cfg.algorithm.name}'s round is not one phase that uploads one (model_update=True)")


def models_of(common: Any, archs: Sequence[str]) -> dict[str, State] | None:
    """The broadcast's models, one per architecture: `common` itself ({arch: model}) or its `models` field."""
    found = getattr(common, "models", None) if dataclasses.is_dataclass(common) else common
    if not isinstance(found, Mapping) or not all(isinstance(found.get(a), Mapping) for a in archs):
        return None
    models = {a: found[a] for a in archs}
    if not all(isinstance(v, torch.Tensor) for m in models.values() for v in m.values()):
        return None
    return models


def with_models(common: Any, models: dict[str, State]) -> Any:
    """`common` with its models replaced."""
    if dataclasses.is_dataclass(common) and not isinstance(common, type):
        return dataclasses.replace(common, models={**common.models, **models})  # type: ignore[attr-defined]
    return {**common, **models}


class Downloads:
    """The server's side of compressed downloads: the replica, each version's encoded size, each client's last
    synced version."""

    def __init__(self, cfg: RunConfig, archs: Sequence[str], num_clients: int) -> None:
        c = cfg.compression
        self.cfg, self.archs = cfg, list(archs)
        self.kind, self.levels, self.fraction = c.download, c.levels, c.fraction
        self.codec = codec_of(c.download, c.levels, c.fraction)
        self.replica: dict[str, State] = {}
        self.sizes: list[int] = []  # version t's change, encoded (version 0: the dense model)
        self.synced = np.full(num_clients, -1, dtype=np.int64)  # each client's last version, -1: never

    @property
    def version(self) -> int:
        """The replica's version (-1 before the first broadcast)."""
        return len(self.sizes) - 1

    def send(self, common: Any, round: int, phase: str, participants: Sequence[int]) -> tuple[Any, int, dict[int, int]]:
        """The broadcast with its models replaced by the new replica, what a client that holds the last replica
        downloads of its models, and each other participant's extra bytes to catch up."""
        models = models_of(common, self.archs)
        if models is None:
            raise ConfigError(f"compression.download: {self.cfg.algorithm.name}'s broadcast in phase {phase!r} is a "
                              f"{type(common).__name__}, not one model per architecture (a dict of tensors), so "
                              "there is no model to encode; set compression.download: none")
        dense = sum(state_nbytes(m) for m in models.values())
        fresh = not self.sizes or self.replica.keys() != models.keys() or any(
            self.replica[a].keys() != m.keys() or any(self.replica[a][k].shape != v.shape for k, v in m.items())
            for a, m in models.items())
        if fresh:  # the first broadcast: the model itself, dense
            self.replica = {a: {k: v.detach().clone() for k, v in m.items()} for a, m in models.items()}
            size = dense
        else:
            size = self.encode(models, round)
        self.sizes.append(size)
        t = self.version
        common_bytes = min(size, dense)
        extra: dict[int, int] = {}
        for c in participants:
            v = int(self.synced[c])
            need = dense if v < 0 else min(sum(self.sizes[v + 1:t + 1]), dense)
            if need > common_bytes:
                extra[c] = need - common_bytes
        return with_models(common, self.replica), common_bytes, extra

    def encode(self, models: dict[str, State], round: int) -> int:
        """Step the replica by the decoded change towards `models`; the change's encoded size."""
        gen = rng.torch_generator(self.cfg.seed, STREAM, round, phase=len(self.sizes))
        size = 0
        replica: dict[str, State] = {}
        for arch in sorted(models):
            old, out = self.replica[arch], {}
            for key in sorted(models[arch]):
                value = models[arch][key].detach()
                if not value.is_floating_point():  # an integer buffer: sent as it is
                    out[key] = value.clone()
                    size += value.numel() * value.element_size()
                    continue
                held = old[key].to(value.device, torch.float64)
                change = value.to(torch.float64) - held
                decoded = self.codec(change.reshape(-1), gen).reshape(change.shape)
                out[key] = (held + decoded).to(value.dtype)
                size += encoded_bytes(self.kind, value.numel(), self.levels, self.fraction)
            replica[arch] = {k: out[k] for k in models[arch]}
        self.replica = replica
        return size

    def synced_now(self, clients: Sequence[int]) -> None:
        """`clients` downloaded the last broadcast: they hold the replica's current version."""
        self.synced[list(clients)] = self.version

    def state(self) -> dict[str, torch.Tensor]:
        """The replica, the sizes and the clients' versions, for the checkpoint's chain state."""
        out = {f"{PREFIX}replica/{a}/{k}": v.cpu() for a, m in self.replica.items() for k, v in m.items()}
        out[f"{PREFIX}sizes"] = torch.tensor(self.sizes, dtype=torch.int64)
        out[f"{PREFIX}synced"] = torch.from_numpy(self.synced.copy())
        return out

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        """Continue from a checkpoint's chain state (a CheckpointError when its download part is malformed)."""
        sizes, synced = state.get(f"{PREFIX}sizes"), state.get(f"{PREFIX}synced")
        if sizes is None or synced is None or sizes.dtype != torch.int64 or sizes.dim() != 1 or \
                synced.dtype != torch.int64 or tuple(synced.shape) != self.synced.shape or \
                bool((synced < -1).any()) or bool((synced >= len(sizes)).any()) or bool((sizes < 0).any()):
            raise CheckpointError("the checkpoint's compressed-download state (chain_state download/sizes, "
                                  "download/synced) is missing or malformed")
        replica: dict[str, State] = {}
        for key, value in state.items():
            if not key.startswith(f"{PREFIX}replica/"):
                continue
            rest = key[len(f"{PREFIX}replica/"):]
            arch = next((a for a in self.archs if rest.startswith(f"{a}/")), None)
            if arch is None:
                raise CheckpointError(f"the checkpoint's download replica entry {key!r} names no architecture of "
                                      "this run")
            replica.setdefault(arch, {})[rest[len(arch) + 1:]] = value
        if len(sizes) and set(replica) != set(self.archs):
            raise CheckpointError("the checkpoint's download replica does not hold every architecture of this run")
        self.replica, self.sizes = replica, [int(s) for s in sizes]
        self.synced = synced.numpy().astype(np.int64).copy()


def split_state(state: Mapping[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """A chain state's (upload chain's, download's) parts."""
    down = {k: v for k, v in state.items() if k.startswith(PREFIX)}
    return {k: v for k, v in state.items() if k not in down}, down
