"""Everything a run derives from its config before round 0: data, partition, architectures, the Env."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from fedsim import rng
from fedsim.config.schema import RunConfig
from fedsim.data import Dataset, client_test_shards, load_dataset, partition, split_validation
from fedsim.data.flower_partition import (
    FLOWER_SEED,
    NATURAL_KINDS,
    NEW_KINDS,
    flower_partition,
    natural_groups,
    natural_members,
    options_of,
)
from fedsim.data.generated import GeneratedShards, make_shards, test_set
from fedsim.errors import ConfigError
from fedsim.method.client_archs import ClientArchs
from fedsim.method.contract import ClientData, Env


@dataclass
class Ragged:
    """Many index arrays stored as one flat array plus offsets: ~8 bytes per index whatever the client count."""

    flat: np.ndarray
    offsets: np.ndarray  # len = clients + 1

    @classmethod
    def from_list(cls, parts: list[np.ndarray]) -> Ragged:
        lengths = np.fromiter((len(p) for p in parts), dtype=np.int64, count=len(parts))
        offsets = np.zeros(len(parts) + 1, dtype=np.int64)
        np.cumsum(lengths, out=offsets[1:])
        flat = np.concatenate(parts).astype(np.int64) if parts else np.zeros(0, np.int64)
        return cls(flat, offsets)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.flat[self.offsets[i]:self.offsets[i + 1]]

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)


@dataclass
class Partition:
    """Per-client train, validation and (optional) personal test indices."""

    train: Ragged
    val: Ragged
    test: Ragged | None

    def num_samples(self) -> np.ndarray:
        """Train samples per client id."""
        return self.train.lengths()


AnyPartition = Partition | GeneratedShards  # index lists into one dataset, or shards drawn on demand


def make_partition(cfg: RunConfig, data: Dataset) -> AnyPartition:
    """Split the training set over clients as the config says (streams "data/*" of the run seed); generated shards
    hold only each client's sizes."""
    p = cfg.data.partition
    if p.kind == "generated":
        sizes = rng.numpy_generator(cfg.seed, "data/shard_sizes") if p.samples_sigma > 0 else None
        return make_shards(cfg.data.options, cfg.data.num_clients, p.samples_per_client, p.samples_sigma, p.alpha,
                           cfg.data.val_fraction, cfg.data.client_test, cfg.seed, sizes)
    parts, test_parts = _split(cfg, data)
    train, val = split_validation(parts, cfg.data.val_fraction, rng.seed(cfg.seed, "data/validation"))
    test = None
    if test_parts is not None:
        test = Ragged.from_list(test_parts)
    elif cfg.data.client_test != "none":
        seed = rng.seed(cfg.seed, "data/client_test")
        test = Ragged.from_list(client_test_shards(data.y_test, cfg.data.num_clients, cfg.data.client_test, seed,
                                                   train_parts=train, train_labels=data.y_train))
    return Partition(Ragged.from_list(train), Ragged.from_list(val), test)


def _split(cfg: RunConfig, data: Dataset) -> tuple[list[np.ndarray], list[np.ndarray] | None]:
    """Each client's train indices, and with data.client_test: natural its own test indices: fedsim's scalable
    iid/dirichlet/shards, or flwr-datasets' partitioners (fedsim.data.flower_partition)."""
    p, k = cfg.data.partition, cfg.data.num_clients
    if p.kind in NATURAL_KINDS:
        if data.train_ids is None:
            raise ConfigError(f"data.partition.kind: {p.kind} needs each sample's natural client, which dataset "
                              f"{cfg.data.name!r} does not have")
        groups = natural_groups(data.train_ids, p.kind, p.group_size, p.group_mode)
        if len(groups) != k:
            raise ConfigError(f"data.num_clients: {p.kind} makes {len(groups)} clients of dataset "
                              f"{cfg.data.name!r}, but data.num_clients is {k}: set data.num_clients={len(groups)}")
        if cfg.data.client_test != "natural":
            return natural_members(data.train_ids, groups), None
        if data.test_ids is None:
            raise ConfigError(f"data.client_test: natural needs each test sample's natural client, which dataset "
                              f"{cfg.data.name!r} does not have")
        tests = natural_members(data.test_ids, groups)
        if not any(len(t) for t in tests):  # TFF CIFAR-100's test clients, LEAF's user split
            raise ConfigError(f"data.client_test: natural, but no test sample of dataset {cfg.data.name!r} belongs "
                              "to a training client (its test clients are others); use balanced or proportional")
        return natural_members(data.train_ids, groups), tests
    if p.seed is not None:
        seed = p.seed
    else:
        seed = FLOWER_SEED if p.flower else rng.seed(cfg.seed, "data/partition")
    if p.flower or p.kind in NEW_KINDS:
        return flower_partition(data.y_train, k, p.kind, seed, options_of(p)), None
    assert p.shards_per_client is not None  # fedsim.data.flower_partition.check_partition
    return partition(data.y_train, k, p.kind, seed, alpha=p.alpha, min_samples=p.min_samples,
                     shards_per_client=p.shards_per_client), None


def client_archs(cfg: RunConfig) -> ClientArchs:
    """The architecture of each client id: `model.mix` in order, else `model.name` for all."""
    if not cfg.model.mix:
        return ClientArchs.uniform(cfg.model.name, cfg.data.num_clients)
    return ClientArchs(cfg.model.mix.items())


def load_data(cfg: RunConfig) -> Dataset:
    """The config's dataset; with generated shards only its central test set (the shards are drawn per client)."""
    if cfg.data.partition.kind == "generated":
        return test_set(cfg.data.options)
    return load_dataset(cfg.data.name, cfg.data.root, cfg.data.download, **cfg.data.options)


def build_env(cfg: RunConfig, data: Dataset, part: AnyPartition, device: torch.device | str = "cpu") -> Env:
    """The Env shared by the server and every worker."""
    from fedsim.models import model_names

    archs = client_archs(cfg)
    unknown = sorted(set(archs.distinct()) - set(model_names()))
    if unknown:
        raise ConfigError(f"model: unknown architecture {unknown[0]!r}; choose one of {model_names()}")
    return Env(config=cfg, params=cfg.algorithm.params, num_classes=data.num_classes,
               input_shape=data.input_shape, mean=tuple(data.mean), std=tuple(data.std), client_archs=archs,
               num_samples=part.num_samples(), device=torch.device(device), extras=dict(data.extras))


def client_data(data_t: dict[str, torch.Tensor], part: AnyPartition, cid: int) -> ClientData:
    """A client's tensors, gathered from the worker's one copy of the dataset (`data_t` on its device), or drawn
    from its generated shard."""
    if isinstance(part, GeneratedShards):
        return _generated_data(part, cid, data_t["x_test"].device)

    def take(x: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        return x.index_select(0, idx)  # index_select: a third of what x[idx] costs for a few rows

    device = data_t["x_train"].device
    tr, va = (torch.from_numpy(ids).to(device) for ids in (part.train[cid], part.val[cid]))
    out = ClientData(take(data_t["x_train"], tr), take(data_t["y_train"], tr),
                     take(data_t["x_train"], va), take(data_t["y_train"], va))
    if part.test is not None:
        te = torch.from_numpy(part.test[cid]).to(data_t["x_test"].device)
        out.x_test, out.y_test = take(data_t["x_test"], te), take(data_t["y_test"], te)
    return out


def _generated_data(shards: GeneratedShards, cid: int, device: torch.device) -> ClientData:
    """Client `cid`'s generated shard as tensors on `device`."""
    x, y, x_val, y_val, x_test, y_test = (torch.from_numpy(a).to(device) for a in shards.shard(cid))
    out = ClientData(x, y, x_val, y_val)
    if shards.client_test != "none":
        out.x_test, out.y_test = x_test, y_test
    return out


def as_tensor(array: np.ndarray, device: torch.device | str = "cpu") -> torch.Tensor:
    """A tensor view of a (possibly read-only, shared-memory) array; fedsim never writes to dataset tensors."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return torch.as_tensor(array).to(device)


CLIENT_STREAM = "client"


def client_seed(seed: int, round: int, client_id: int, phase: int) -> int:
    """The seed of one client's draws in one phase (stream "client"), independent of worker count and order."""
    return rng.seed(seed, CLIENT_STREAM, round, client_id, phase)
