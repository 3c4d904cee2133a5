"""The bench's FedAvg workload in fedsim terms: configs A, B, C, the run config, and the run `Inputs` that take the
prepared folder's data, partition, client draws and initial weights.

Everything else (the driver, workers, messages, the shuffle seeds each worker derives, reduction, evaluation,
result tables, checkpoints) is fedsim's normal path; only the inputs differ.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from bench.common import BenchError, Prepared, Workload, load_prepared
from bench.prepare import MODEL_OPTIONS, REPO
from fedsim.config.schema import RunConfig
from fedsim.configure import load_config
from fedsim.runtime.loop import Inputs
from fedsim.runtime.setup import Partition, Ragged, client_seed

BASE_CONFIG = REPO / "configs" / "bench" / "fedavg.yaml"

# A = ResNet-8, 100 clients, 10 per round, 5 rounds; B = 1,000 and 50, 3 rounds; C = the MLP, 10,000 and 100, 2.
BENCH_CONFIGS = {
    "A": Workload(num_clients=100, clients_per_round=10, rounds=5, model="resnet8"),
    "B": Workload(num_clients=1000, clients_per_round=50, rounds=3, model="resnet8"),
    "C": Workload(num_clients=10000, clients_per_round=100, rounds=2, model="mlp"),
}


def make_config(w: Workload, overrides: list[str] | None = None, base: Path = BASE_CONFIG) -> RunConfig:
    """configs/bench/fedavg.yaml with the workload's knobs (the model options give the workload's models)."""
    options = ", ".join(f"{k}: {v}" for k, v in MODEL_OPTIONS[w.model].items())
    knobs = [f"rounds={w.rounds}", f"seed={w.seed}", f"data.num_clients={w.num_clients}",
             f"participation.clients_per_round={w.clients_per_round}", f"train.epochs={w.local_epochs}",
             f"train.batch_size={w.batch_size}", f"train.lr={w.lr}", f"train.momentum={w.momentum}",
             f"eval.batch_size={w.eval_batch_size}", f"model.name={w.model}", f"model.options={{{options}}}"]
    return load_config(base, knobs + list(overrides or []))


def bench_dataset(p: Prepared):
    """The prepared arrays as a fedsim Dataset (identity normalisation: the images are used as they are)."""
    from fedsim.data import Dataset

    # np.asarray turns the np.memmap subclass into a plain ndarray view: Ray pickles a memmap in-band, so every
    # worker would hold a private copy; a plain array goes out-of-band and is mapped zero-copy.
    return Dataset("synthetic", np.asarray(p.x_train), p.y_train, np.asarray(p.x_test), p.y_test, 10,
                   (0.0,) * 3, (1.0,) * 3)


def bench_partition(p: Prepared) -> Partition:
    """The prepared client shards as fedsim's Partition (no validation split, no personal test shards)."""
    empty = Ragged(np.zeros(0, np.int64), np.zeros(p.workload.num_clients + 1, np.int64))
    return Partition(Ragged(p.flat, p.offsets), empty, None)


def check_seeds(p: Prepared) -> None:
    """The prepared shuffle seeds are the ones fedsim's workers derive, so all programs shuffle alike."""
    for r in range(p.workload.rounds):
        for cid, seed in p.round_clients(r):
            if client_seed(p.workload.seed, r, cid, 0) != seed:
                raise BenchError(f"{p.folder / 'seeds.npy'}: round {r}, client {cid} has seed {seed}, but fedsim "
                                 "derives another; delete the folder and prepare it again")


def check_matches(cfg: RunConfig, w: Workload, folder: Path) -> None:
    """The run config keeps the knobs the prepared files fix (a round past the prepared draws would fail mid-run,
    another cohort would silently train the prepared one): checked before the run makes its folder."""
    fixed = [("rounds", cfg.rounds, w.rounds), ("participation.clients_per_round",
             cfg.participation.clients_per_round, w.clients_per_round),
             ("data.num_clients", cfg.data.num_clients, w.num_clients), ("model.name", cfg.model.name, w.model),
             ("seed", cfg.seed, w.seed)]
    for key, got, want in fixed:
        if got != want:
            raise BenchError(f"{key}={got}: the workload {folder} was prepared with {want}; prepare another "
                             "(`python -m bench.prepare`) rather than override it")


def prepared_inputs(cfg: RunConfig, folder: str | Path) -> Inputs:
    """What a fedsim run of `cfg` starts from on a prepared folder: its data, client shards, per-round draws and
    initial global weights (checked against fedsim's own model)."""
    folder = Path(folder)
    p = load_prepared(folder)
    check_seeds(p)
    check_matches(cfg, p.workload, folder)
    draws, init = p.draws, p.initial_state()
    # the run takes the only reference to the images, so the driver drops them once they are shared
    pending, part = [bench_dataset(p)], bench_partition(p)
    del p

    def initial_state(state: Any) -> Any:
        built = state.models[cfg.model.name]
        if {k: tuple(v.shape) for k, v in built.items()} != {k: tuple(v.shape) for k, v in init.items()}:
            raise BenchError(f"{folder / 'init.pt'}: its tensors are not those of fedsim's {cfg.model.name}")
        state.models[cfg.model.name] = {k: v.to(built[k].dtype) for k, v in init.items()}
        return state

    return Inputs(data=lambda cfg: pending.pop(), partition=lambda cfg, data: part,
                  draw=lambda cfg, rnd, profiles: draws[rnd], initial_state=initial_state)
