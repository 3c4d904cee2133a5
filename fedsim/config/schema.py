"""The run config: one YAML file becomes a typed, validated `RunConfig`; `-o key=value` overrides any field."""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml

from fedsim.config import yaml_dialect
from fedsim.config.knobs import knob, shown, to_dict
from fedsim.config.limits import (
    MAX_BATCH,
    MAX_BYTES,
    MAX_CLIENTS,
    MAX_CONFIG_BYTES,
    MAX_CPUS,
    MAX_EPOCHS,
    MAX_GPUS,
    MAX_ROUNDS,
    MAX_SAMPLES,
    MAX_SECONDS,
    MAX_SEED,
    MAX_STEPS,
    MAX_THREADS,
    MAX_WORKERS,
)
from fedsim.errors import ConfigError
from fedsim.persist.storage import StorePath, instead_of_a_file, location

# knobs that were deleted: a config (an older run folder's saved one, say) that sets them still loads, with a warning
RETIRED = {"runtime": ("cuda_graphs", "overlap_eval")}

# config keys a resume may change: they change no number of the run (more rounds, another backend or worker count,
# where results go, how it is tracked)
RESUME_SAFE = ("name", "rounds", "eval", "results", "runtime", "tracking", "data.root", "data.download")


@dataclass
class PartitionConfig:
    kind: Literal["iid", "dirichlet", "shards", "inner_dirichlet", "pathological", "linear", "square",
                  "exponential", "natural_id", "grouped_natural_id", "generated"] = knob(
        "dirichlet", doc="how train samples are split over clients (docs/data/partitioners.md): iid, dirichlet, "
        "shards (fedsim's, scaling to 100k+ clients; Flower's with flower: true); inner_dirichlet, pathological, "
        "linear, square, exponential, natural_id, grouped_natural_id (flwr-datasets' partitioners, with "
        "FederatedDataset's pre-shuffle, in either mode); generated: each client's shard is drawn when it trains "
        "(data.name: synthetic; fedsim.data.generated)")
    flower: bool = knob(False, doc="reproduce flwr-datasets 0.6 exactly: FederatedDataset(shuffle=True, seed)'s "
                        "pre-shuffle, then Flower's partitioner of this kind with the same seed, so each client holds "
                        "the samples of Flower's partition of its id; switches iid, dirichlet and shards to Flower's "
                        "algorithms and seed's default to 42")
    seed: int | None = knob(None, ge=0, le=MAX_SEED, doc="seed of the partition (and of Flower's pre-shuffle); "
                            "null: 42 with flower: true (Flower's default), else the run seed's stream "
                            "data/partition")
    alpha: float = knob(0.5, gt=0, doc="Dirichlet concentration (Hsu et al. 2019); smaller is more skewed: over "
                        "clients per class (dirichlet), over classes per client (inner_dirichlet); generated: each "
                        "client's class mix is Dirichlet(alpha)")
    min_samples: int = knob(10, ge=1, le=MAX_SAMPLES,
                            doc="every client gets at least this many train samples (dirichlet; Flower's "
                            "min_partition_size with flower: true)")
    self_balancing: bool = knob(False, doc="dirichlet with flower: true: a client already above n/num_clients "
                                "samples gets no share of the later classes (Flower's self_balancing)")
    sizes: list[int] = knob([], ge=0, le=MAX_SAMPLES, doc="inner_dirichlet: each client's train samples, one per "
                            "client, summing to the training set; empty: from size_skew")
    size_skew: Literal["equal", "linear", "square", "exponential"] = knob(
        "equal", doc="inner_dirichlet without sizes: client sizes as the iid (equal), linear, square or exponential "
        "kind would give them")
    classes_per_client: int = knob(2, ge=1, le=MAX_SAMPLES, doc="pathological: classes each client holds "
                                   "(Flower's num_classes_per_partition)")
    class_assignment: Literal["random", "deterministic", "first-deterministic"] = knob(
        "random", doc="pathological: a client's classes drawn at random, consecutive from its id (id mod C, ...), "
        "or its id mod C then random ones")
    shards_per_client: int | None = knob(2, ge=1, le=MAX_SAMPLES,
                                         doc="label-sorted shards per client (shards); null with flower: true: "
                                         "the count follows from shard_size")
    shard_size: int | None = knob(None, ge=1, le=MAX_SAMPLES, doc="shards with flower: true: samples per shard; "
                                  "null: the training set over num_clients × shards_per_client")
    keep_incomplete: bool = knob(False, doc="shards with flower: true: the last, smaller shard may be dealt too "
                                 "(Flower's keep_incomplete_shard)")
    group_size: int = knob(2, ge=1, le=MAX_CLIENTS, doc="grouped_natural_id: natural ids (writers, users) per "
                           "client")
    group_mode: Literal["allow-smaller", "allow-bigger", "drop-reminder", "strict"] = knob(
        "allow-smaller", doc="grouped_natural_id: the ids left over make a smaller last group, join the groups "
        "(array_split), are dropped, or are an error (Flower's mode names)")
    samples_per_client: int = knob(50, ge=1, le=MAX_SAMPLES,
                                   doc="generated: samples in a client's shard, validation split included (the "
                                   "median when samples_sigma > 0)")
    samples_sigma: float = knob(0.0, ge=0, le=10, doc="generated: 0 gives every client samples_per_client; else "
                                "shard sizes are lognormal with this log-space std, drawn per client")


@dataclass
class DataConfig:
    name: str = knob("digits", doc="dataset: digits (embedded), synthetic, cifar10, cifar100, pathmnist and the "
                     "other MedMNIST 2D sets, mnist, fashionmnist, emnist, svhn, tff_emnist and tff_cifar100 (TFF's "
                     "HDF5 files), hf (a local Hugging Face copy), npz, text_tsv and text_npz (token ids), subsample "
                     "(a seeded fraction of another)")
    root: str = knob("~/.fedsim/data", doc="folder holding downloaded datasets")
    download: bool = knob(False, doc="let torchvision/medmnist download missing files (needs internet)")
    options: dict[str, Any] = knob({}, doc="loader options, e.g. {path: my.npz} for npz, {size: 32}")
    num_clients: int = knob(20, ge=1, le=MAX_CLIENTS, doc="registered clients")
    partition: PartitionConfig = knob(factory=PartitionConfig)
    val_fraction: float = knob(0.1, ge=0, lt=1, doc="per-client validation split of its train shard")
    client_test: Literal["none", "balanced", "proportional", "natural"] = knob(
        "none", doc="give each client a personal test shard (for personalised methods): balanced over classes, "
        "proportional to its train labels, or natural: the test samples of its own natural ids (natural_id and "
        "grouped_natural_id)")


@dataclass
class ModelConfig:
    name: str = knob("cnn", doc="architecture of every client (resnet8, resnet20, wrn16_4, cnn, mlp, lenet, ...)")
    mix: dict[str, int] = knob({}, ge=0, le=MAX_CLIENTS,
                               doc="heterogeneous clients: {arch: count}; counts must sum to data.num_clients; "
                               "clients get architectures in this order by id")
    options: dict[str, Any] = knob({}, doc="builder options passed to every model")


@dataclass
class TrainConfig:
    optimizer: Literal["sgd", "adam"] = knob("sgd", doc="local optimizer")
    lr: float = knob(0.05, gt=0, doc="local learning rate")
    momentum: float = knob(0.9, ge=0, lt=1, doc="SGD momentum")
    weight_decay: float = knob(0.0, ge=0, doc="L2 weight decay")
    epochs: int = knob(1, ge=0, le=MAX_EPOCHS, doc="local epochs per round")
    steps: int | None = knob(None, ge=1, le=MAX_STEPS, doc="fixed local steps per round instead of epochs")
    batch_size: int = knob(32, ge=1, le=MAX_BATCH, doc="local batch size")
    keep_optimizer_state: bool = knob(False, doc="persist each client's optimizer state across rounds")


@dataclass
class DiurnalConfig:
    low: float = knob(0.1, ge=0, le=1, doc="diurnal availability: a client's online probability at the curve's "
                      "lowest, 12 hours from its peak")
    high: float = knob(0.8, ge=0, le=1, doc="diurnal availability: its online probability at the peak")
    peak_hour: float = knob(2.0, ge=0, lt=24, doc="diurnal availability: the local hour of the peak (night: phones "
                            "charging)")
    period_s: float = knob(86_400.0, gt=0, le=MAX_SECONDS, doc="diurnal availability: virtual seconds in a day; "
                           "each client's online hours repeat every day")
    slots: int = knob(24, ge=1, le=1440, doc="diurnal availability: a day's slots (each period_s / slots long), each "
                      "online or not by one seeded draw at the curve's probability of its middle")
    zone_spread_h: float = knob(8.0, ge=0, le=24, doc="diurnal availability: clients' time zones are drawn uniformly "
                                "over this many hours (0: one zone; 24: all round the globe)")

    def __post_init__(self) -> None:
        if self.low > self.high:
            raise ValueError(f"low ({self.low:g}) must not exceed high ({self.high:g})")


@dataclass
class ParticipationConfig:
    clients_per_round: int | None = knob(None, ge=1, le=MAX_CLIENTS, doc="clients sampled per round")
    fraction: float | None = knob(None, gt=0, le=1, doc="fraction of clients sampled per round")
    availability: float | str = knob(
        1.0, gt=0, le=1, doc="availability over virtual time (docs/availability.md): diurnal (participation.diurnal) "
        "or a trace file of each client's online intervals (FedScale's client_behave_trace pickle, or a CSV with "
        "columns client,start,end and optionally period); or, as a number, the probability that a client is "
        "available in a round")
    diurnal: DiurnalConfig = knob(factory=DiurnalConfig)
    sampling: Literal["fixed", "poisson"] = knob(
        "fixed", doc="fixed: exactly clients_per_round (or fraction) clients, drawn without replacement; poisson: "
        "each client joins independently with probability fraction (or clients_per_round / num_clients), as "
        "DP-FedAvg's accounting assumes")
    mode: Literal["sync", "async"] = knob(
        "sync", doc="sync: rounds of a sampled cohort; async: clients in flight arrive one at a time on the virtual "
        "clock and the method (fedasync, fedbuff) applies each arrival, and `rounds` then counts server versions "
        "(docs/async.md)")
    concurrency: int | None = knob(None, ge=1, le=MAX_CLIENTS, doc="async mode: clients in flight at once (C); "
                                   "unset: clients_per_round (or fraction) clients")

    def __post_init__(self) -> None:
        if self.clients_per_round is not None and self.fraction is not None:
            raise ValueError("set clients_per_round or fraction, not both")


@dataclass
class DistConfig:
    dist: Literal["constant", "lognormal", "uniform"] = knob("lognormal", doc="distribution family")
    mean: float = knob(1.0, gt=0, doc="median (lognormal), value (constant), or midpoint (uniform)")
    sigma: float = knob(0.5, ge=0, le=10, doc="log-space std (lognormal) or half-width fraction (uniform)")


@dataclass
class StragglerConfig:
    enabled: bool = knob(False, doc="simulate device speeds, bandwidths and a round deadline on a virtual clock")
    speed: DistConfig = knob(factory=lambda: DistConfig("lognormal", 1.0, 0.5))
    bandwidth_mbps: DistConfig = knob(factory=lambda: DistConfig("lognormal", 20.0, 0.5))
    sample_seconds: float = knob(0.01, gt=0, le=1e6, doc="virtual seconds per training sample at speed 1")
    latency_s: float = knob(0.0, ge=0, le=1e6, doc="virtual seconds of each message round trip between the server "
                            "and a client: a round's download and upload are one, secure aggregation adds three")
    deadline: Literal["none", "fixed", "quantile"] = knob("quantile", doc="how the round deadline is set")
    deadline_value: float = knob(0.8, gt=0, doc="virtual seconds (fixed), or the quantile of participant "
                                  "durations in (0, 1] (quantile)")
    over_select: float = knob(0.0, ge=0, le=10, doc="sample (1+over_select)·K clients and keep the fastest K")
    skip_late: bool = knob(False, doc="do not compute clients known to miss the deadline (FedScale-style)")
    trace: str | None = knob(None, doc="CSV with columns client,speed,bandwidth_mbps,availability (speed 1e-6 to 1e6, "
                                           "Mbit/s 1e-6 to 1e9, availability in (0, 1])")


@dataclass
class RuntimeConfig:
    backend: Literal["ray", "local"] = knob("ray", doc="ray actors, or everything in-process (debugging)")
    ray_address: str | None = knob(None, doc="join this Ray cluster; default: start or join a local one")
    num_workers: int | None = knob(None, ge=1, le=MAX_WORKERS,
                                   doc="client workers; default: on Ray, as many as the resources allow (1 in a "
                                   "sweep trial); on the local backend, 1")
    client_cpus: float = knob(1.0, gt=0, le=MAX_CPUS, doc="CPUs per client worker")
    client_gpus: float = knob(0.0, ge=0, le=MAX_GPUS,
                              doc="GPU fraction per client worker (0.25 gives 4 workers per GPU)")
    server_cpus: float = knob(0.0, ge=0, le=MAX_CPUS, doc="CPUs reserved for the server actor")
    server_gpus: float = knob(0.0, ge=0, le=MAX_GPUS, doc="GPU fraction of the server actor")
    require_gpu: bool = knob(False, doc="on Ray, stop before round 0 when GPUs are reserved (client_gpus, "
                             "server_gpus) but torch sees no CUDA device there; false: one warning, and the CPU")
    threads: int | None = knob(None, ge=1, le=MAX_THREADS,
                               doc="torch threads per worker, on either backend (the numbers depend on it: PyTorch's "
                                   "CPU kernels may sum in a thread-count-dependent order); default: its CPU share")
    round_timeout_s: float = knob(1800.0, gt=0, le=MAX_SECONDS,
                                  doc="wall-clock limit of one phase (late workers count as failed) and, on Ray, of "
                                  "each server call and client-state transfer")
    startup_timeout_s: float = knob(600.0, gt=0, le=MAX_SECONDS,
                                    doc="on Ray, wall-clock limit for the client workers and the server actor to "
                                    "start and answer their first call")
    cache_bytes: int | None = knob(None, ge=0, le=MAX_BYTES,
                                   doc="per-worker cache for personal client state; spills to disk")
    spill_dir: str | None = knob(None, doc="where spilled client state goes (a folder per run inside it); "
                                 "default: the run folder's spill/ (a local temporary folder when results.root is "
                                 "a URI)")
    exact_sum: bool = knob(True, doc="workers add clients' uploads exactly (double-double), so the numbers do not "
                           "depend on the worker count; false adds in plain float64, but a weight's last bit may then "
                           "change with the worker count")
    batch_clients: bool | Literal["auto", "on", "off"] = knob(
        "auto", doc="train a worker's same-architecture clients together (one vmapped step) in phases that "
        "declare local_training (FedAvg, FedProx, FedDF, ...): on, off, or auto (on for CUDA workers, off on "
        "CPU); on, a run repeats its numbers at the same runtime.num_workers and batch_clients_max, not across them")
    batch_clients_max: int = knob(64, ge=1, le=MAX_CLIENTS, doc="most clients trained together (bounds memory)")
    tf32: bool = knob(False, doc="let CUDA convolutions and matrix products of float32 use TF32 tensor cores (Ampere "
                      "and later): faster on large models, but with 10-bit mantissas, so a GPU run's numbers then "
                      "differ from the CPU's, and batched from one-after-another training, by more than float32 "
                      "rounding; off: full float32 (PyTorch's own default turns it on for convolutions)")
    placement: Literal["none", "spread", "pack"] = knob(
        "none", doc="on Ray, where client workers go: spread over the nodes or pack onto as few as fit (one placement "
        "group), or none (Ray's default scheduling)")
    autoscale_timeout_s: float = knob(600.0, ge=0, le=MAX_SECONDS,
                                      doc="on a Ray cluster joined by address, how long to wait for the autoscaler to "
                                      "add the workers the config asks for before failing (0: fail at once)")

    def __post_init__(self) -> None:
        for key in ("batch_clients",):  # auto | on | off knobs
            if getattr(self, key) in ("on", "off"):  # the words YAML 1.1 read as booleans: kept as the same values
                setattr(self, key, getattr(self, key) == "on")


@dataclass
class EvalConfig:
    every: int = knob(1, ge=1, le=MAX_ROUNDS, doc="evaluate the global model(s) on the test set every this many rounds")
    batch_size: int = knob(512, ge=1, le=MAX_BATCH, doc="evaluation batch size")
    mechanism: bool = knob(True, doc="record each method's mechanism columns (mech_*, docs/mechanism.md); "
                           "evaluation only, training is the same either way")
    mechanism_samples: int = knob(1000, ge=1, le=MAX_SAMPLES,
                                  doc="test samples (a fixed seeded subset) the mechanism columns are scored on")


@dataclass
class ResultsConfig:
    root: str = knob("results", doc="parent folder of run folders: a path (on a shared file system for a cluster) or a "
                     "URI: s3://bucket/prefix (extra [s3]), gs://bucket/prefix (extra [gcs]), file://, memory://")
    run_id: str | None = knob(None, doc="run folder name; default: <name>-<timestamp>")
    checkpoint_every: int = knob(1, ge=0, le=MAX_ROUNDS, doc="checkpoint every this many rounds (0: never)")


@dataclass
class MlflowConfig:
    enabled: bool = knob(False, doc="log every round's metrics and the config to MLflow (needs the mlflow extra)")
    tracking_uri: str | None = knob(None, doc="MLflow tracking URI; default: MLflow's own (MLFLOW_TRACKING_URI or "
                                    "./mlruns)")
    experiment: str = knob("fedsim", doc="MLflow experiment the run is logged under")


@dataclass
class WandbConfig:
    enabled: bool = knob(False, doc="log every round's metrics and the config to Weights & Biases (needs the wandb "
                         "extra)")
    project: str = knob("fedsim", doc="W&B project")
    entity: str | None = knob(None, doc="W&B team or user; default: your W&B default")
    mode: Literal["online", "offline"] | None = knob(None, doc="W&B mode; default: W&B's own (WANDB_MODE)")


@dataclass
class TrackingConfig:
    tensorboard: bool = knob(False, doc="write every round's metrics as TensorBoard events to <run folder>/tensorboard")
    mlflow: MlflowConfig = knob(factory=MlflowConfig)
    wandb: WandbConfig = knob(factory=WandbConfig)


@dataclass
class AlgorithmConfig:
    name: str = knob("fedavg", doc="the method: fedavg, fedprox, feddf, single_image, dafkd, fedgdkd, dosfl, ...")
    params: Any = None  # the algorithm's own Params dataclass, filled by load_config


@dataclass
class PrivacyConfig:
    level: Literal["none", "client", "sample", "local"] = knob(
        "none", doc="none; client: client-level DP-FedAvg (McMahan et al. 2018): each client's update clipped in "
        "its worker, Gaussian noise added once to the round's sum; sample: every client trains with DP-SGD (Abadi "
        "et al. 2016), each client's epsilon for its own data accounted; local: each client adds its own noise to "
        "its clipped update before it leaves (fedsim.transforms, docs/privacy.md)")
    clip: float = knob(1.0, gt=0, nonfinite=True, doc="L2 norm each client's model update is clipped to (C); under "
                       "level sample, each sample's gradient; .inf clips nothing")
    noise_multiplier: float | None = knob(None, ge=0, le=1e6, doc="z: the noise on the sum has std z * clip (level "
                                          "client; level sample: on each step's sum of clipped per-sample "
                                          "gradients); on each update, 2 * z * clip (level local: two clipped "
                                          "updates differ by up to 2 clip); unset: solved from target_epsilon")
    target_epsilon: float | None = knob(None, gt=0, le=1e6, doc="solve noise_multiplier before round 0 so that the "
                                        "planned rounds spend at most this epsilon at delta")
    adaptive_clip: bool = knob(False, doc="level client: the clip follows a quantile of the update norms (Andrew et "
                               "al. 2021), from clip as its start, its noisy count paid for in the accountant")
    target_quantile: float = knob(0.5, gt=0, lt=1, doc="adaptive_clip: the share of updates left unclipped it aims at")
    clip_lr: float = knob(0.2, gt=0, le=10, doc="adaptive_clip: the geometric step, clip *= exp(-clip_lr * (share "
                          "unclipped - target_quantile))")
    count_noise: float | None = knob(None, gt=0, le=1e9, doc="adaptive_clip: std of the noise on the count of "
                                     "unclipped updates (coded +-1/2); default expected cohort / 20")
    delta: float | None = knob(None, gt=0, lt=1, doc="the delta of (epsilon, delta); default 1 / num_clients^1.1 "
                                      "(level sample: 1 / n^1.1, n the largest client dataset)")
    accountant: Literal["pld", "rdp", "prv"] = knob(
        "pld", doc="dp-accounting's privacy-loss-distribution (pld) or Renyi (rdp) accountant, or prv-accountant's "
        "upper bound (prv); fixed-size cohorts need rdp")
    max_epsilon: float | None = knob(None, gt=0, le=1e6, doc="stop the run cleanly before a round would take "
                                     "epsilon past this")
    secure_aggregation: Literal["none", "secagg", "secagg+"] = knob(
        "none", doc="secure aggregation simulated exactly: each client's update quantised and masked, the server "
        "learns only the sum (secagg: Bonawitz et al. 2017, every pair masks; secagg+: Bell et al. 2020, a "
        "neighbour graph); with or without DP (docs/privacy.md)")
    secagg_bits: int = knob(32, ge=2, le=32, doc="secure aggregation's field: integers mod 2^bits")
    secagg_levels: int = knob(65536, ge=1, le=2**31, doc="quantisation levels over [-secagg_range, secagg_range]; "
                              "the cohort times the levels must stay below 2^secagg_bits")
    secagg_range: float | None = knob(None, gt=0, le=1e9, doc="each coordinate of a client's weighted update is "
                                      "clamped to [-range, range] before quantisation; default the clip (level "
                                      "client), else required")
    secagg_neighbours: int | None = knob(None, ge=2, le=MAX_CLIENTS, doc="secagg+: each client's neighbours (even); "
                                         "default the smallest even number >= 2 log2(cohort)")
    secagg_threshold: float = knob(0.5, gt=0, le=1, doc="the share of a client's neighbours that must survive to "
                                   "rebuild its secrets; fewer, and the round aborts")

    def __post_init__(self) -> None:
        if self.level != "none" and (self.noise_multiplier is None) == (self.target_epsilon is None):
            raise ValueError(f"level {self.level}: set noise_multiplier or target_epsilon (one of them)")


@dataclass
class AttackConfig:
    kind: Literal["none", "label_flip", "backdoor", "sign_flip", "gaussian", "scaling", "alie", "min_max", "min_sum",
                  "ipm"] = knob("none", doc="what the malicious clients do (docs/robustness.md): poison their data "
                                "(label_flip, backdoor) or their model update (sign_flip, gaussian, scaling, and the "
                                "colluding alie, min_max, min_sum, ipm)")
    fraction: float = knob(0.0, ge=0, lt=1, doc="share of the clients that are malicious, a fixed seeded set for the "
                           "whole run")
    clients: list[int] = knob([], ge=0, le=MAX_CLIENTS, doc="the malicious clients by id, instead of fraction")
    knowledge: Literal["omniscient", "colluders"] = knob(
        "omniscient", doc="alie, min_max, min_sum, ipm: the benign statistics the attack reads: every honest update "
        "of the round (omniscient), or the colluders' own honest updates")
    scale: float | None = knob(None, gt=0, le=1e6, doc="sign_flip: c in -c * update (default 1); scaling: gamma in "
                               "gamma * update (default: the round's participants / its attackers)")
    sigma: float = knob(1.0, gt=0, le=1e6, doc="gaussian: std of the update sent instead")
    z: float | None = knob(None, ge=0, le=100, doc="alie: the std multiple; default Baruch et al.'s z_max from the "
                           "round's participants and attackers")
    perturbation: Literal["std", "unit_vec", "sign"] = knob("std", doc="min_max, min_sum: the direction moved along")
    epsilon: float = knob(0.1, gt=0, le=1e6, doc="ipm: the update sent is -epsilon * the benign mean")
    target: int = knob(0, ge=0, le=100_000, doc="backdoor: the label the trigger maps to")
    poison_fraction: float = knob(0.5, gt=0, le=1, doc="backdoor: share of an attacker's training samples given "
                                  "the trigger and the target label")
    trigger_size: int = knob(2, ge=1, le=64, doc="backdoor: side of the square patch, bottom-right, in pixels")
    trigger_value: float | None = knob(None, doc="backdoor: the patch's raw pixel value; default the training "
                                       "data's largest")


@dataclass
class AggregatorConfig:
    name: Literal["mean", "krum", "multi_krum", "bulyan", "median", "trimmed_mean", "geometric_median", "norm_bound",
                  "centered_clip", "fltrust"] = knob(
        "mean", doc="how the server combines the clients' model updates (docs/robustness.md); mean is the method's "
        "own weighted sum")
    f: int = knob(0, ge=0, le=MAX_CLIENTS, doc="krum, multi_krum, bulyan: how many attackers the rule tolerates")
    m: int | None = knob(None, ge=1, le=MAX_CLIENTS, doc="multi_krum: updates kept (default n - f)")
    beta: float = knob(0.1, ge=0, lt=0.5, doc="trimmed_mean: share cut from each end, per coordinate")
    bound: float | None = knob(None, gt=0, le=1e9, doc="norm_bound: L2 norm each update is clipped to (required)")
    noise: float = knob(0.0, ge=0, le=1e6, doc="norm_bound: std of the weak-DP noise added once to the aggregate")
    tau: float = knob(10.0, gt=0, le=1e9, doc="centered_clip: the clipping radius around the centre")
    iterations: int = knob(1, ge=1, le=100, doc="centered_clip: clipping passes a round")
    nu: float = knob(1e-5, gt=0, le=1, doc="geometric_median: the smoothing floor of Weiszfeld's weights")
    max_iter: int = knob(100, ge=1, le=10_000, doc="geometric_median: Weiszfeld iterations at most")
    ftol: float = knob(1e-6, gt=0, lt=1, doc="geometric_median: stop at this relative change of the objective")
    root_samples: int = knob(100, ge=1, le=100_000, doc="fltrust: size of the server's root set, held out from the "
                             "test set (the accuracy is scored on the rest)")


@dataclass
class CompressionConfig:
    kind: Literal["none", "fp16", "bf16", "int8", "qsgd", "topk", "randk", "sign", "rotation"] = knob(
        "none", doc="how each client encodes its model update for upload (docs/compression.md): a cast (fp16, bf16), "
        "per-tensor int8, QSGD, top-k or random-k sparsification, scaled sign, or a randomised Hadamard rotation "
        "then quantisation; the server aggregates what it decodes, and bytes_up counts what was encoded")
    download: Literal["none", "fp16", "bf16", "int8", "qsgd", "topk", "randk", "sign", "rotation"] = knob(
        "none", doc="how the server encodes the model it broadcasts (docs/compression.md): the change since the "
        "replica clients hold, in one of kind's schemes (levels and fraction shared; not qsgd or randk), the "
        "replica stepping by what was decoded; bytes_down counts what each client needs to catch up")
    error_feedback: bool = knob(False, doc="each client adds what compression dropped last time (its residual, kept "
                                "between rounds and in checkpoints) to the next update it compresses")
    levels: int = knob(16, ge=1, le=2**16, doc="qsgd, rotation: quantisation levels s per coordinate (rotation: s "
                       "intervals between the rotated vector's min and max; 1 is one bit a coordinate)")
    fraction: float = knob(0.01, gt=0, lt=1, doc="topk, randk: share k of each tensor's coordinates sent "
                           "(ceil(k·size) of them, at least one)")


@dataclass
class RunConfig:
    name: str = knob("run", doc="run name, used in the run folder")
    seed: int = knob(0, ge=0, le=MAX_SEED,
                     doc="run seed: sampling, partition, init and every client draw derive from it")
    rounds: int = knob(30, ge=1, le=MAX_ROUNDS, doc="communication rounds (async mode: server versions)")
    plugins: list[str] = knob([], doc="your own modules, imported first so the config can name what they register: "
                              "module names or .py files/package folders relative to the config; shipped to Ray "
                              "workers (docs/writing-a-method.md)")
    algorithm: AlgorithmConfig = knob(factory=AlgorithmConfig)
    data: DataConfig = knob(factory=DataConfig)
    model: ModelConfig = knob(factory=ModelConfig)
    train: TrainConfig = knob(factory=TrainConfig)
    participation: ParticipationConfig = knob(factory=ParticipationConfig)
    stragglers: StragglerConfig = knob(factory=StragglerConfig)
    privacy: PrivacyConfig = knob(factory=PrivacyConfig)
    attack: AttackConfig = knob(factory=AttackConfig)
    aggregator: AggregatorConfig = knob(factory=AggregatorConfig)
    compression: CompressionConfig = knob(factory=CompressionConfig)
    runtime: RuntimeConfig = knob(factory=RuntimeConfig)
    eval: EvalConfig = knob(factory=EvalConfig)
    results: ResultsConfig = knob(factory=ResultsConfig)
    tracking: TrackingConfig = knob(factory=TrackingConfig)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'a.b=value' -> (['a', 'b'], value parsed as YAML, like a config file's; text that is no YAML stays text)."""
    if "=" not in text:
        raise ConfigError(f"override {shown(text)}: expected key=value")
    key, raw = text.split("=", 1)
    if not key.strip():
        raise ConfigError(f"override {shown(text)}: empty key")
    try:
        value = yaml_dialect.parse(raw) if raw.strip() else ""
    except yaml_dialect.YAMLShapeError as exc:
        raise ConfigError(f"override {shown(text)}: {exc.problem}") from None
    except yaml.YAMLError:
        value = raw
    return key.strip().split("."), value


def check_overrides(overrides: Any, where: str = "overrides") -> None:
    """Overrides must be a list of "key=value" strings: a single string would be read letter by letter."""
    if isinstance(overrides, (str, bytes)) or not isinstance(overrides, (list, tuple)) or \
            not all(isinstance(o, str) for o in overrides):
        raise ConfigError(f"{where}: expected a list of 'key=value' strings, got {shown(overrides)}")


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set each dotted key in a copy of the raw config dict."""
    out = copy.deepcopy(raw)
    for text in overrides:
        path, value = parse_override(text)
        node = out
        for part in path[:-1]:
            if not isinstance(node.get(part, {}), dict):
                raise ConfigError(f"override {shown(text)}: {part} is not a section")
            node = node.setdefault(part, {})
        node[path[-1]] = value
    return out


def read_yaml(path: str | Path | StorePath) -> dict:
    """Read a config file's mapping, with one-line errors for missing, malformed, empty or non-mapping files."""
    p = location(path)
    if not p.is_file():
        what = instead_of_a_file(p)
        raise ConfigError(f"config file {p}: {what}" if what else f"config file not found: {p}")
    try:
        with p.open("rb") as fh:  # no more than the limit is read: a 50 MB file costs what 1 MiB does
            raw = fh.read(MAX_CONFIG_BYTES + 1)
        if len(raw) > MAX_CONFIG_BYTES:
            raise ConfigError(f"{p}: larger than {MAX_CONFIG_BYTES // 2**20} MiB, the most a config file may hold "
                              "(fedsim.config.limits.MAX_CONFIG_BYTES); a config holds kilobytes")
        text = raw.decode("utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{p}: cannot be read as text ({type(exc).__name__})") from None
    try:
        data = yaml_dialect.parse(text)
    except yaml.YAMLError as exc:
        line, reason = yaml_dialect.describe_error(exc)
        where = f" line {line}" if line else ""
        if isinstance(exc, yaml_dialect.YAMLShapeError):
            raise ConfigError(f"{p}{where}: {reason}") from None
        raise ConfigError(f"{p}{where}: not valid YAML ({reason})") from None
    if data is None:
        raise ConfigError(f"{p}: the file is empty (or only comments); a config is a mapping such as 'rounds: 5'")
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping at the top level, got {type(data).__name__}")
    return data


def check_folder_name(key: str, value: str, max_len: int) -> None:
    """A name that becomes one folder inside results.root: no separators, no '.'/'..', nothing absolute."""
    bad = None
    if not value.strip():
        bad = "is empty"
    elif value in (".", ".."):
        bad = "is not a folder name"
    elif any(sep in value for sep in ("/", "\\", os.sep)) or Path(value).is_absolute():
        bad = "contains a path separator; it names one folder inside results.root"
    elif not value.isprintable() or len(value.encode("utf-8", "replace")) > max_len:
        bad = f"must be printable text of at most {max_len} bytes"
    if bad:
        raise ConfigError(f"{key}: {value[:60]!r} {bad}")


def config_to_dict(cfg: RunConfig) -> dict:
    """The resolved config as a plain dict, the algorithm params flattened under algorithm."""
    out = to_dict(cfg)
    algo = {"name": cfg.algorithm.name, **(to_dict(cfg.algorithm.params) or {})}
    out["algorithm"] = algo
    return out


def sampling_rate(cfg: RunConfig) -> float:
    """q, the probability that a client joins a round under Poisson sampling: fraction, else K / num_clients."""
    p = cfg.participation
    return p.fraction if p.fraction is not None else min(1.0, clients_per_round(cfg) / cfg.data.num_clients)


def clients_per_round(cfg: RunConfig) -> int:
    """K, from clients_per_round or fraction (default: all clients)."""
    p, n = cfg.participation, cfg.data.num_clients
    if p.clients_per_round is not None:
        return p.clients_per_round
    if p.fraction is not None:
        return max(1, int(round(p.fraction * n)))
    return n
