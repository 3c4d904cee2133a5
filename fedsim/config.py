"""The run config: one YAML file becomes a typed, validated `RunConfig`; `-o key=value` overrides any field."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from fedsim.configtools import from_dict, knob, to_dict
from fedsim.errors import ConfigError


@dataclass
class PartitionConfig:
    kind: Literal["iid", "dirichlet", "shards"] = knob("dirichlet", doc="how train samples are split over clients")
    alpha: float = knob(0.5, gt=0, doc="Dirichlet concentration over labels (Hsu et al. 2019); smaller is more skewed")
    min_samples: int = knob(10, ge=1, doc="every client gets at least this many train samples (dirichlet)")
    shards_per_client: int = knob(2, ge=1, doc="label-sorted shards per client (shards)")


@dataclass
class DataConfig:
    name: str = knob("digits", doc="dataset: digits (embedded), synthetic, cifar10, cifar100, pathmnist and the "
                     "other MedMNIST 2D sets, mnist, fashionmnist, emnist, svhn, npz")
    root: str = knob("~/.fedsim/data", doc="folder holding downloaded datasets")
    download: bool = knob(False, doc="let torchvision/medmnist download missing files (needs internet)")
    options: dict[str, Any] = knob({}, doc="loader options, e.g. {path: my.npz} for npz, {size: 32}")
    num_clients: int = knob(20, ge=1, doc="registered clients")
    partition: PartitionConfig = knob(factory=PartitionConfig)
    val_fraction: float = knob(0.1, ge=0, lt=1, doc="per-client validation split of its train shard")
    client_test: Literal["none", "balanced", "proportional"] = knob(
        "none", doc="give each client a personal test shard (for personalised methods)")


@dataclass
class ModelConfig:
    name: str = knob("cnn", doc="architecture of every client (resnet8, resnet20, wrn16_4, cnn, mlp, lenet, ...)")
    mix: dict[str, int] = knob({}, doc="heterogeneous clients: {arch: count}; counts must sum to data.num_clients; "
                               "clients get architectures in this order by id")
    options: dict[str, Any] = knob({}, doc="builder options passed to every model")


@dataclass
class TrainConfig:
    optimizer: Literal["sgd", "adam"] = knob("sgd", doc="local optimizer")
    lr: float = knob(0.05, gt=0, doc="local learning rate")
    momentum: float = knob(0.9, ge=0, lt=1, doc="SGD momentum")
    weight_decay: float = knob(0.0, ge=0, doc="L2 weight decay")
    epochs: int = knob(1, ge=0, doc="local epochs per round")
    steps: int | None = knob(None, ge=1, doc="fixed local steps per round instead of epochs")
    batch_size: int = knob(32, ge=1, doc="local batch size")
    keep_optimizer_state: bool = knob(False, doc="persist each client's optimizer state across rounds")


@dataclass
class ParticipationConfig:
    clients_per_round: int | None = knob(None, ge=1, doc="clients sampled per round")
    fraction: float | None = knob(None, gt=0, le=1, doc="fraction of clients sampled per round")
    availability: float = knob(1.0, gt=0, le=1, doc="probability that a client is available in a round")

    def __post_init__(self) -> None:
        if self.clients_per_round is not None and self.fraction is not None:
            raise ValueError("set clients_per_round or fraction, not both")


@dataclass
class DistConfig:
    dist: Literal["constant", "lognormal", "uniform"] = knob("lognormal", doc="distribution family")
    mean: float = knob(1.0, gt=0, doc="median (lognormal), value (constant), or midpoint (uniform)")
    sigma: float = knob(0.5, ge=0, doc="log-space std (lognormal) or half-width fraction (uniform)")


@dataclass
class StragglerConfig:
    enabled: bool = knob(False, doc="simulate device speeds, bandwidths and a round deadline on a virtual clock")
    speed: DistConfig = knob(factory=lambda: DistConfig("lognormal", 1.0, 0.5))
    bandwidth_mbps: DistConfig = knob(factory=lambda: DistConfig("lognormal", 20.0, 0.5))
    sample_seconds: float = knob(0.01, gt=0, doc="virtual seconds per training sample at speed 1")
    deadline: Literal["none", "fixed", "quantile"] = knob("quantile", doc="how the round deadline is set")
    deadline_value: float = knob(0.8, gt=0, doc="seconds (fixed) or quantile of participant durations")
    over_select: float = knob(0.0, ge=0, doc="sample (1+over_select)·K clients and keep the fastest K")
    skip_late: bool = knob(False, doc="do not compute clients known to miss the deadline (FedScale-style)")
    trace: str | None = knob(None, doc="CSV with columns client,speed,bandwidth_mbps,availability")


@dataclass
class RuntimeConfig:
    backend: Literal["ray", "local"] = knob("ray", doc="ray actors, or everything in-process (debugging)")
    ray_address: str | None = knob(None, doc="join this Ray cluster; default: start or join a local one")
    num_workers: int | None = knob(None, ge=1, doc="client workers; default: as many as the resources allow")
    client_cpus: float = knob(1.0, gt=0, doc="CPUs per client worker")
    client_gpus: float = knob(0.0, ge=0, doc="GPU fraction per client worker (0.25 gives 4 workers per GPU)")
    server_cpus: float = knob(0.0, ge=0, doc="CPUs reserved for the server actor")
    server_gpus: float = knob(0.0, ge=0, doc="GPU fraction of the server actor")
    threads: int | None = knob(None, ge=1, doc="torch threads per worker; default: its CPU share")
    round_timeout_s: float = knob(1800.0, gt=0, doc="wall-clock limit of one phase; late workers count as failed")
    cache_bytes: int | None = knob(None, ge=0, doc="per-worker cache for personal client state; spills to disk")
    spill_dir: str | None = knob(None, doc="where spilled client state goes; default: inside the run folder")


@dataclass
class EvalConfig:
    every: int = knob(1, ge=1, doc="evaluate the global model(s) on the test set every this many rounds")
    batch_size: int = knob(512, ge=1, doc="evaluation batch size")


@dataclass
class ResultsConfig:
    root: str = knob("results", doc="parent folder of run folders")
    run_id: str | None = knob(None, doc="run folder name; default: <name>-<timestamp>")
    checkpoint_every: int = knob(1, ge=0, doc="checkpoint every this many rounds (0: never)")


@dataclass
class AlgorithmConfig:
    name: str = knob("fedavg", doc="the method: fedavg, fedprox, feddf, single_image, dafkd, fedgdkd, dosfl, ...")
    params: Any = None  # the algorithm's own Params dataclass, filled by load_config


@dataclass
class RunConfig:
    name: str = knob("run", doc="run name, used in the run folder")
    seed: int = knob(0, ge=0, doc="run seed: sampling, partition, init and every client draw derive from it")
    rounds: int = knob(30, ge=1, doc="communication rounds")
    algorithm: AlgorithmConfig = knob(factory=AlgorithmConfig)
    data: DataConfig = knob(factory=DataConfig)
    model: ModelConfig = knob(factory=ModelConfig)
    train: TrainConfig = knob(factory=TrainConfig)
    participation: ParticipationConfig = knob(factory=ParticipationConfig)
    stragglers: StragglerConfig = knob(factory=StragglerConfig)
    runtime: RuntimeConfig = knob(factory=RuntimeConfig)
    eval: EvalConfig = knob(factory=EvalConfig)
    results: ResultsConfig = knob(factory=ResultsConfig)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {text!r}: empty key")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set each dotted key in a copy of the raw config dict."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {text!r}: {part} is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path) -> dict:
    """Read a YAML mapping, with one-line errors for missing or malformed files."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file not found: {p}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark else ""
        raise ConfigError(f"{p}{where}: not valid YAML ({getattr(exc, 'problem', exc)})") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level")
    return data


def build_config(raw: dict) -> RunConfig:
    """Validate a raw dict into a RunConfig, including the algorithm's own params."""
    from fedsim.algorithms import get_algorithm  # registers the built-in algorithms

    raw = copy.deepcopy(raw)
    algo_raw = raw.pop("algorithm", {}) or {}
    if not isinstance(algo_raw, dict):
        raise ConfigError("algorithm: expected a mapping with a name and the method's parameters")
    name = algo_raw.pop("name", "fedavg")
    cfg = from_dict(RunConfig, raw)
    algo_cls = get_algorithm(name)
    params = from_dict(algo_cls.Params, algo_raw, prefix="algorithm")
    cfg.algorithm = AlgorithmConfig(name=name, params=params)
    validate(cfg)
    return cfg


def load_config(path: str | Path | None = None, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML config (or the defaults), apply overrides, validate."""
    raw = read_yaml(path) if path is not None else {}
    return build_config(apply_overrides(raw, overrides or []))


def validate(cfg: RunConfig) -> None:
    """Cross-section checks that a single dataclass cannot see."""
    n = cfg.data.num_clients
    k = cfg.participation.clients_per_round
    if k is not None and k > n:
        raise ConfigError(f"participation.clients_per_round: {k} exceeds data.num_clients={n}")
    if cfg.model.mix and sum(cfg.model.mix.values()) != n:
        raise ConfigError(f"model.mix: counts sum to {sum(cfg.model.mix.values())}, "
                          f"but data.num_clients is {n}")
    if any(c < 0 for c in cfg.model.mix.values()):
        raise ConfigError("model.mix: counts must be >= 0")


def config_to_dict(cfg: RunConfig) -> dict:
    """The resolved config as a plain dict, the algorithm params flattened under algorithm."""
    out = to_dict(cfg)
    algo = {"name": cfg.algorithm.name, **(to_dict(cfg.algorithm.params) or {})}
    out["algorithm"] = algo
    return out


def save_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML, atomically."""
    from fedsim.io import atomic_write_text

    atomic_write_text(Path(path), yaml.safe_dump(config_to_dict(cfg), sort_keys=False))


def clients_per_round(cfg: RunConfig) -> int:
    """K, from clients_per_round or fraction (default: all clients)."""
    p, n = cfg.participation, cfg.data.num_clients
    if p.clients_per_round is not None:
        return p.clients_per_round
    if p.fraction is not None:
        return max(1, int(round(p.fraction * n)))
    return n
