"""The peer benchmark's FedAvg workload in fedsim terms: the harness's own data, partition and sampling.

fedsim's `synthetic` dataset and `dirichlet` partitioner follow the same recipes but are not bit-identical
to `fl_common`'s (float64 prototypes; a different top-up rule), so the bench feeds the harness's arrays,
client index lists and per-round client draws straight into the engine through `PeerSimulation`.
Everything else (workers, messages, reduction, evaluation, result tables) is fedsim's normal path.
"""

from __future__ import annotations

import argparse
from contextlib import contextmanager
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path

import numpy as np

from bench.peer import REPO, fl_common
from fedsim.config import RunConfig, load_config
from fedsim.runtime import loop
from fedsim.runtime.loop import Simulation
from fedsim.runtime.setup import Partition, Ragged

BASE_CONFIG = REPO / "configs" / "bench" / "peer.yaml"


@dataclass(frozen=True)
class PeerWorkload:
    """The knobs of `fl_common.add_common_args` (same names, same defaults)."""

    num_clients: int = 100
    clients_per_round: int = 10
    rounds: int = 5
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    model: str = "resnet8"
    alpha: float = 0.5
    seed: int = 0
    data_seed: int = 0
    n_train: int = 20000
    n_test: int = 2000
    amp: float = 3.0

    @classmethod
    def from_args(cls, ns: argparse.Namespace) -> PeerWorkload:
        return cls(**{f.name: getattr(ns, f.name) for f in fields(cls)})

    def peer_args(self) -> list[str]:
        """The same workload as command-line flags of plain_fedavg.py / flower_fedavg.py."""
        out = []
        for key, value in asdict(self).items():
            out += [f"--{key.replace('_', '-')}", str(value)]
        return out

    def with_(self, **kw) -> PeerWorkload:
        return replace(self, **kw)


# The harness's README: A = ResNet-8, 100 clients, 10 per round; B = 1,000 and 50; C = MLP, 10,000 and 100.
PEER_CONFIGS = {
    "A": PeerWorkload(num_clients=100, clients_per_round=10, rounds=5, model="resnet8"),
    "B": PeerWorkload(num_clients=1000, clients_per_round=50, rounds=3, model="resnet8"),
    "C": PeerWorkload(num_clients=10000, clients_per_round=100, rounds=2, model="mlp"),
}


def make_config(w: PeerWorkload, overrides: list[str] | None = None, base: Path = BASE_CONFIG) -> RunConfig:
    """configs/bench/peer.yaml with the workload's knobs. fl_common's ResNet-8 is fedsim's with PyTorch's default
    init (the harness does not re-initialise); its MLP is fedsim's mlp(hidden 64, 1 layer)."""
    model = ["model.name=resnet8", "model.options={init: torch}"] if w.model == "resnet8" else \
        ["model.name=mlp", "model.options={hidden: 64, layers: 1}"]
    knobs = [f"rounds={w.rounds}", f"seed={w.seed}", f"data.num_clients={w.num_clients}",
             f"participation.clients_per_round={w.clients_per_round}", f"train.epochs={w.local_epochs}",
             f"train.batch_size={w.batch_size}", f"train.lr={w.lr}", f"train.momentum={w.momentum}",
             f"data.options={{n_train: {w.n_train}, n_test: {w.n_test}, amp: {w.amp}, seed: {w.data_seed}}}"]
    return load_config(base, knobs + model + list(overrides or []))


def sampled_clients(w: PeerWorkload) -> list[np.ndarray]:
    """Each round's clients exactly as plain_fedavg.py draws them (sorted: fedsim runs clients by id)."""
    rng = np.random.default_rng(w.seed + 12345)
    return [np.sort(rng.choice(w.num_clients, size=w.clients_per_round, replace=False)) for _ in range(w.rounds)]


def peer_partition(w: PeerWorkload) -> Partition:
    """fl_common's Dirichlet client index lists as fedsim's Partition (no validation split, no test shards)."""
    parts = fl_common().get_partitions(w.num_clients, w.alpha, w.seed, w.data_seed, w.n_train, w.n_test, w.amp)
    empty = Ragged(np.zeros(0, np.int64), np.zeros(w.num_clients + 1, np.int64))
    return Partition(Ragged.from_list(parts), empty, None)


def peer_dataset(w: PeerWorkload):
    """fl_common's cached arrays as a fedsim Dataset (identity normalisation, as the harness trains)."""
    from fedsim.data import Dataset

    common = fl_common()
    x_tr, y_tr, x_te, y_te = (np.asarray(a) for a in common.load_data(w.data_seed, w.n_train, w.n_test, w.amp))
    common._DATA_CACHE.clear()  # the Dataset is the only holder: the backend frees it once the data is shared
    # np.asarray turns the np.memmap subclass into a plain ndarray view: Ray pickles a memmap in-band,
    # so every worker would hold a private copy; a plain array goes out-of-band and is mapped zero-copy.
    return Dataset("synthetic", x_tr, y_tr, x_te, y_te, 10, (0.0,) * 3, (1.0,) * 3)


@contextmanager
def _replaced(module, **names):
    """Temporarily rebind module-level names (the loop's data, partition and sampling functions)."""
    old = {k: getattr(module, k) for k in names}
    for k, v in names.items():
        setattr(module, k, v)
    try:
        yield
    finally:
        for k, v in old.items():
            setattr(module, k, v)


class PeerSimulation(Simulation):
    """A Simulation whose data, partition and client draws come from the harness instead of the config.

    The engine's own `setup` and `run_round` run unchanged; only the three functions they call to load
    data, partition it and draw a round's clients are swapped for the harness's while they run.
    """

    def __init__(self, cfg: RunConfig, backend, run_dir: Path, workload: PeerWorkload, progress=None) -> None:
        super().__init__(cfg, backend, run_dir, progress)
        self.workload = workload
        self.draws = sampled_clients(workload)

    def setup(self) -> None:
        w = self.workload
        with _replaced(loop, load_data=lambda cfg: peer_dataset(w), make_partition=lambda cfg, d: peer_partition(w)):
            super().setup()

    def run_round(self, r: int):
        with _replaced(loop, sample_round=lambda cfg, rnd, profiles: self.draws[rnd]):
            return super().run_round(r)
