"""Client shards generated on demand (`data.partition.kind: generated`): registered clients that cost nothing
until they train.

A client's shard comes from its own named stream (run seed, "data/shard", client id): first a Dirichlet(α)
class mix, then its labels drawn from that mix, then its images by the synthetic recipe
(fedsim.data.synthetic.render) from the dataset's class prototypes. Nothing of size clients × samples exists:
all registered clients together cost their int32 shard sizes, and a worker draws a participant's shard when
it runs (keeping the most recent few). The central test set is drawn once from the same prototypes.
"""

from __future__ import annotations

import inspect
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from fedsim.config.limits import MAX_SAMPLES
from fedsim.data.registry import Dataset
from fedsim.data.synthetic import make_synthetic, prototypes, render
from fedsim.errors import ConfigError

RECENT_BYTES = 64 * 2**20  # a worker keeps the shards it drew last, up to this many bytes


def synthetic_options(options: dict[str, Any]) -> dict[str, Any]:
    """The synthetic loader's options with its defaults filled in (n_train excluded: generated shards have none)."""
    from fedsim.data.datasets import load_synthetic

    defaults = {name: p.default for name, p in inspect.signature(load_synthetic).parameters.items()
                if p.kind is p.KEYWORD_ONLY and name != "n_train"}
    return {**defaults, **options}


def test_set(options: dict[str, Any]) -> Dataset:
    """The central test set of a generated run: `n_test` samples from the prototypes of `options["seed"]` (no
    training samples; x_train is empty with the test set's shape)."""
    o = synthetic_options(options)
    x_tr, y_tr, x_te, y_te = make_synthetic(0, o["n_test"], o["channels"], o["size"], o["num_classes"], o["seed"],
                                            o["amp"])
    return Dataset("synthetic", x_tr, y_tr, x_te, y_te, o["num_classes"], (0.0,) * o["channels"],
                   (1.0,) * o["channels"])


def shard_sizes(num_clients: int, samples: int, sigma: float, rng: np.random.Generator | None) -> np.ndarray:
    """Each client's shard size as int32: `samples` for all, or lognormal around it (log-space std `sigma`), at
    least 1 and at most MAX_SAMPLES."""
    if sigma == 0 or rng is None:
        return np.full(num_clients, samples, dtype=np.int32)
    drawn = np.rint(samples * np.exp(sigma * rng.standard_normal(num_clients)))
    return np.clip(drawn, 1, MAX_SAMPLES).astype(np.int32)


def validation_sizes(sizes: np.ndarray, fraction: float) -> np.ndarray:
    """round(fraction · size) of each shard held out for validation, leaving at least one training sample."""
    return np.minimum(np.rint(fraction * sizes.astype(np.float64)), np.maximum(sizes - 1, 0)).astype(np.int32)


@dataclass
class GeneratedShards:
    """Every registered client's shard, as a recipe: prototypes, α and the run seed, plus per-client int32 sizes.

    `shard(cid)` draws a client's train, validation and personal test arrays, the same ones whatever the process,
    the worker or the order in which clients are drawn."""

    protos: np.ndarray  # classes × C × H × W, float64 (fedsim.data.synthetic.prototypes)
    amp: float
    alpha: float
    run_seed: int
    train_sizes: np.ndarray  # int32, one per registered client
    val_sizes: np.ndarray  # int32, one per registered client
    client_test: str = "none"  # none | balanced | proportional: a personal test shard, as data.client_test says
    n_test: int = 0  # the central test set's size, which personal test shards are scaled from
    _recent: OrderedDict = field(default_factory=OrderedDict, init=False, repr=False, compare=False)
    _recent_bytes: int = field(default=0, init=False, repr=False, compare=False)

    def __len__(self) -> int:
        return len(self.train_sizes)

    @property
    def num_classes(self) -> int:
        return int(self.protos.shape[0])

    @property
    def nbytes(self) -> int:
        """Bytes held for all registered clients (the prototypes and the size arrays)."""
        return int(self.protos.nbytes + self.train_sizes.nbytes + self.val_sizes.nbytes)

    def num_samples(self) -> np.ndarray:
        """Train samples per client id."""
        return self.train_sizes

    def mix(self, cid: int) -> np.ndarray:
        """Client `cid`'s class proportions, Dirichlet(α): the first draw of its stream."""
        return self._mix(self._stream("data/shard", cid))

    def _stream(self, name: str, cid: int) -> np.random.Generator:
        from fedsim import rng

        if not 0 <= cid < len(self):
            raise IndexError(f"client {cid} is not registered ({len(self)} clients)")
        return rng.numpy_generator(self.run_seed, name, client=int(cid))

    def _mix(self, stream: np.random.Generator) -> np.ndarray:
        return stream.dirichlet(np.full(self.num_classes, self.alpha))

    def _labels(self, stream: np.random.Generator, mix: np.ndarray, n: int) -> np.ndarray:
        cdf = np.cumsum(mix)
        return np.minimum(np.searchsorted(cdf, stream.random(n) * cdf[-1], side="right"), self.num_classes - 1)

    def shard(self, cid: int) -> tuple[np.ndarray, ...]:
        """(x, y, x_val, y_val, x_test, y_test) of client `cid`: float32 images, int64 labels; the test pair is
        empty without data.client_test."""
        if cid in self._recent:
            self._recent.move_to_end(cid)
            return self._recent[cid]
        stream = self._stream("data/shard", cid)
        mix = self._mix(stream)
        n_train, n_val = int(self.train_sizes[cid]), int(self.val_sizes[cid])
        y = self._labels(stream, mix, n_train + n_val)
        x = render(stream, self.protos, y, self.amp)
        x_test, y_test = self._test(cid, mix)
        out = (x[:n_train], y[:n_train], x[n_train:], y[n_train:], x_test, y_test)
        self._remember(cid, out)
        return out

    def test_sizes(self) -> np.ndarray:
        """Each client's personal test shard size: n_test/clients (at least one per class) when balanced, else in
        proportion to its training size (at least one); none without personal test shards."""
        k = len(self)
        if self.client_test == "none":
            return np.zeros(k, dtype=np.int64)
        if self.client_test == "balanced":
            return np.full(k, max(self.n_test // k, self.num_classes), dtype=np.int64)
        total = max(int(self.train_sizes.sum(dtype=np.int64)), 1)
        return np.maximum(np.rint(self.n_test * self.train_sizes.astype(np.int64) / total), 1).astype(np.int64)

    def split_sizes(self) -> np.ndarray:
        """clients × (train, val, test) sample counts: all a generated split knows before its shards are drawn."""
        return np.stack([self.train_sizes, self.val_sizes, self.test_sizes()], axis=1).astype(np.int64)

    def _test(self, cid: int, mix: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """A personal test shard (stream "data/shard_test"): balanced over the classes, or following the mix."""
        if self.client_test == "none":
            return np.empty((0, *self.protos.shape[1:]), np.float32), np.empty(0, np.int64)
        stream = self._stream("data/shard_test", cid)
        if self.client_test == "balanced":  # the sizes of test_sizes(), one client's
            size = max(self.n_test // len(self), self.num_classes)
            y = (np.arange(size) - cid) % self.num_classes
        else:
            total = max(int(self.train_sizes.sum(dtype=np.int64)), 1)
            size = max(int(np.rint(self.n_test * int(self.train_sizes[cid]) / total)), 1)
            y = self._labels(stream, mix, size)
        return render(stream, self.protos, y, self.amp), y.astype(np.int64)

    def _remember(self, cid: int, arrays: tuple[np.ndarray, ...]) -> None:
        size = sum(a.nbytes for a in arrays)
        self._recent[cid] = arrays
        self._recent_bytes += size
        while self._recent_bytes > RECENT_BYTES and len(self._recent) > 1:
            _, old = self._recent.popitem(last=False)
            self._recent_bytes -= sum(a.nbytes for a in old)

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_recent"], state["_recent_bytes"] = OrderedDict(), 0  # each process draws its own
        return state


def make_shards(options: dict[str, Any], num_clients: int, samples: int, sigma: float, alpha: float,
                val_fraction: float, client_test: str, run_seed: int,
                sizes_stream: np.random.Generator | None) -> GeneratedShards:
    """The generated shards of a run: the synthetic dataset's prototypes (its `seed` option), sizes drawn from
    `sizes_stream` (stream "data/shard_sizes"), each shard from the run seed."""
    o = synthetic_options(options)
    protos = prototypes(np.random.default_rng(o["seed"]), o["num_classes"], o["channels"], o["size"])
    sizes = shard_sizes(num_clients, samples, sigma, sizes_stream)
    val = validation_sizes(sizes, val_fraction)
    return GeneratedShards(protos, float(o["amp"]), float(alpha), int(run_seed), sizes - val, val, client_test,
                           int(o["n_test"]))


def check_generated(cfg: Any) -> None:
    """Combinations a generated run cannot have, each a one-line ConfigError naming the key."""
    d = cfg.data
    if d.partition.kind != "generated":
        return
    if d.name != "synthetic":
        raise ConfigError(f"data.partition.kind: generated shards are drawn from the synthetic set's prototypes; "
                          f"set data.name: synthetic (got {d.name!r})")
    if "n_train" in d.options:
        raise ConfigError("data.options.n_train: generated shards have no fixed training set; size them with "
                          "data.partition.samples_per_client")
    from fedsim.data.registry import check_options

    if d.client_test != "none" and synthetic_options(check_options("synthetic", d.options))["n_test"] < 1:
        raise ConfigError("data.client_test: personal test shards are scaled from the central test set; "
                          "set data.options.n_test >= 1")
