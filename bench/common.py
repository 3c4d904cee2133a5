"""What the plain loop, the Flower app and fedsim's bench run share: the prepared files, the models, one client's
local training, the weighted mean, the central evaluation and the process-tree memory sampler.

It imports only numpy, torch and psutil, so Flower's venv (which has no fedsim) runs the same code. The
models carry fedsim's parameter and buffer names, and every step does what fedsim's FedAvg does: the same
shuffles, the same SGD update, BatchNorm buffers averaged like the weights (integer counters truncated).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
import warnings
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import psutil
import torch
import torch.nn.functional as F
from torch import nn

from bench.runner import unwritable

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
MODELS = ("resnet8", "mlp", "cnn")
PARTITIONS = ("dirichlet", "iid")
FILES = ("workload.json", "partition.npz", "draws.npy", "seeds.npy", "init.pt")


class BenchError(Exception):
    """A bad input of a bench program (a folder that was never prepared, a damaged file): one line, exit 2."""


def name_list(text: str, flag: str, what: str, known: list[str]) -> list[str]:
    """Comma-separated names out of `known`: at least one, each once (a system named twice would run twice and
    overwrite its log, a config twice would be listed twice)."""
    given = [t.strip() for t in text.split(",") if t.strip()]
    if not given:
        raise BenchError(f"{flag}: no {what} given; choose from {', '.join(known)}")
    for name in given:
        if name not in known:
            raise BenchError(f"{flag}: unknown {what} {name[:60]!r}; choose from {', '.join(known)}")
        if given.count(name) > 1:
            raise BenchError(f"{flag}: {what} {name!r} is given twice")
    return given


def check_out_dir(path: str | Path, flag: str) -> Path:
    """`path` as a folder that outputs may go to (made later, when missing), checked before a long measurement."""
    if not str(path).strip():
        raise BenchError(f"{flag}: empty path")
    problem = unwritable(path, folder=True)
    if problem:
        raise BenchError(f"{flag} {problem}")
    return Path(path)


def check_out_file(path: str | Path, flag: str) -> Path:
    """`path` as a file that may be written, in a folder that exists, checked before a long measurement."""
    if not str(path).strip():
        raise BenchError(f"{flag}: empty path")
    out = Path(path)
    if not out.is_dir() and (out.is_symlink() or (out.exists() and not out.is_file())):
        raise BenchError(f"{flag} {out}: exists and is not a plain file")
    if not out.is_dir() and not out.parent.is_dir():
        raise BenchError(f"{flag} {out}: its folder does not exist")
    problem = unwritable(out)
    if problem:
        raise BenchError(f"{flag} {problem}")
    return out


@dataclass(frozen=True)
class Workload:
    """Every knob of the FedAvg workload; the prepared folder is named after them."""

    num_clients: int = 100
    clients_per_round: int = 10
    rounds: int = 5
    model: str = "resnet8"
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    alpha: float = 0.5
    partition: str = "dirichlet"  # or "iid": equal shards, as pfl-research's CIFAR-10 benchmark
    seed: int = 0
    data_seed: int = 0
    n_train: int = 20000
    n_test: int = 2000
    amp: float = 3.0
    eval_batch_size: int = 125

    def data_key(self) -> str:
        """Name of the folder holding the image arrays (shared by every workload on the same data)."""
        return f"data-s{self.data_seed}-n{self.n_train}-{self.n_test}-amp{self.amp:g}"

    def key(self) -> str:
        """Name of this workload's folder: the headline knobs plus a digest of all of them."""
        knobs = asdict(self)
        if knobs["partition"] == "dirichlet":  # the knob's first value stays out: older folders keep their names
            del knobs["partition"]
        digest = hashlib.sha1(json.dumps(knobs, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.model}-N{self.num_clients}-K{self.clients_per_round}-R{self.rounds}-{digest}"

    def with_(self, **kw) -> Workload:
        return Workload(**{**asdict(self), **kw})

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        kinds = {f.name: type(f.default) for f in fields(cls)}
        if not isinstance(d, dict):
            raise BenchError("workload.json: 'workload' must be a mapping of knobs")
        for key, value in d.items():
            if key not in kinds:
                raise BenchError(f"workload.json: unknown key {key!r}")
            want = (int, float) if kinds[key] is float else kinds[key]
            if not isinstance(value, want) or isinstance(value, bool):
                raise BenchError(f"workload.json: {key} must be of type {kinds[key].__name__}, got {value!r}")
        return cls(**d)


# ---------------------------------------------------------------------------------------------------------
# The prepared files
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Prepared:
    """One prepared workload: data (x arrays memory-mapped), client shards, draws, shuffle seeds, initial weights."""

    folder: Path
    workload: Workload
    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray
    offsets: np.ndarray  # client c owns flat[offsets[c]:offsets[c + 1]]
    flat: np.ndarray
    draws: np.ndarray  # rounds × clients_per_round, sorted client ids
    seeds: np.ndarray  # rounds × clients_per_round, each drawn client's shuffle seed

    def shard(self, cid: int) -> np.ndarray:
        """Sorted training-sample indices of client `cid`."""
        return self.flat[self.offsets[cid]:self.offsets[cid + 1]]

    def shard_sizes(self) -> np.ndarray:
        return np.diff(self.offsets)

    def round_clients(self, rnd: int) -> list[tuple[int, int]]:
        """(client id, shuffle seed) of every client drawn in round `rnd` (0-based), in id order."""
        return [(int(c), int(s)) for c, s in zip(self.draws[rnd], self.seeds[rnd], strict=True)]

    def client_data(self, cid: int, device: str | torch.device = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
        """Client `cid`'s images and labels as tensors on `device`."""
        idx = self.shard(cid)
        x, y = torch.from_numpy(np.ascontiguousarray(self.x_train[idx])), torch.from_numpy(self.y_train[idx])
        return x.to(device), y.to(device)

    def test_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The test set as tensors (a view of the memory-mapped file)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # read-only mapping; nothing writes to it
            return torch.as_tensor(self.x_test), torch.as_tensor(self.y_test)

    def initial_state(self) -> dict[str, torch.Tensor]:
        """The initial global weights (a plain state dict; loaded with weights_only)."""
        path = self.folder / "init.pt"
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # any unreadable file is bad input, not a crash
            import pickle

            why = "torch's weights-only reader refused what it holds" if isinstance(exc, pickle.UnpicklingError) \
                else f"{type(exc).__name__}: {(str(exc).strip().splitlines() or [''])[0][:200]}"
            raise BenchError(f"{path}: not a weights file ({why})") from None
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise BenchError(f"{path}: expected a state dict of tensors")
        return dict(state)


def load_prepared(folder: str | Path) -> Prepared:
    """Open a folder written by `python -m bench.prepare`, checking that its files agree with each other."""
    folder = Path(folder)
    meta_path = folder / "workload.json"
    if not meta_path.is_file():
        raise BenchError(f"{folder}: not a prepared bench workload (no workload.json); "
                         "create it with `python -m bench.prepare`")
    try:
        meta = json.loads(meta_path.read_text())
        w = Workload.from_dict(meta["workload"])
        data_name = meta["data"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{meta_path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data_name, str) or data_name != w.data_key():
        raise BenchError(f"{meta_path}: 'data' must be {w.data_key()!r}, the data folder of its knobs")
    data_dir = folder.parent / data_name

    def npy(path: Path, mmap: bool = False) -> np.ndarray:
        try:
            return np.load(path, mmap_mode="r" if mmap else None, allow_pickle=False)
        except (OSError, ValueError) as exc:
            raise BenchError(f"{path}: unreadable ({exc})") from None

    x_train, y_train = npy(data_dir / "x_train.npy", True), npy(data_dir / "y_train.npy")
    x_test, y_test = npy(data_dir / "x_test.npy", True), npy(data_dir / "y_test.npy")
    try:
        with np.load(folder / "partition.npz", allow_pickle=False) as part:
            offsets, flat = part["offsets"], part["flat"]
    except (OSError, ValueError, KeyError) as exc:
        raise BenchError(f"{folder / 'partition.npz'}: unreadable ({exc})") from None
    draws, seeds = npy(folder / "draws.npy"), npy(folder / "seeds.npy")
    p = Prepared(folder, w, x_train, y_train, x_test, y_test, offsets, flat, draws, seeds)
    _check(p)
    return p


def _check(p: Prepared) -> None:
    """Shapes and ranges of the prepared arrays against the workload."""
    w = p.workload
    checks = [
        (p.x_train.shape == (w.n_train, *IMAGE_SHAPE) and p.x_train.dtype == np.float32, "x_train.npy"),
        (p.y_train.shape == (w.n_train,) and p.y_train.dtype == np.int64, "y_train.npy"),
        (p.x_test.shape == (w.n_test, *IMAGE_SHAPE) and p.x_test.dtype == np.float32, "x_test.npy"),
        (p.y_test.shape == (w.n_test,) and p.y_test.dtype == np.int64, "y_test.npy"),
        (p.offsets.shape == (w.num_clients + 1,) and p.offsets[0] == 0 and p.offsets[-1] == len(p.flat)
         and bool(np.all(np.diff(p.offsets) >= 0)), "partition.npz (offsets)"),
        (len(p.flat) == 0 or (p.flat.min() >= 0 and p.flat.max() < w.n_train), "partition.npz (indices)"),
        (p.draws.shape == (w.rounds, w.clients_per_round) and p.draws.size > 0 and p.draws.min() >= 0
         and p.draws.max() < w.num_clients, "draws.npy"),
        (p.seeds.shape == p.draws.shape and p.seeds.dtype == np.int64, "seeds.npy"),
    ]
    for ok, name in checks:
        if not ok:
            raise BenchError(f"{p.folder}: {name} does not match workload.json; delete the folder and prepare it again")


# ---------------------------------------------------------------------------------------------------------
# Models (fedsim's `resnet8` and `mlp` with hidden 64, 1 layer: same names, shapes and operations)
# ---------------------------------------------------------------------------------------------------------


class Block(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus the identity or a 1×1-conv-BN shortcut, then ReLU."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, stride=1, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.bn1(self.conv1(x)))
        return torch.relu(self.bn2(self.conv2(h)) + self.shortcut(x))


class ResNet8(nn.Module):
    """16-channel stem, one block per stage (16, 32, 64 channels), global average pool, linear head."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 3, padding=1, bias=False), nn.BatchNorm2d(16), nn.ReLU())
        self.layers = nn.Sequential(Block(16, 16, 1), Block(16, 32, 2), Block(32, 64, 2))
        self.fc = nn.Linear(64, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(self.layers(self.stem(x)), 1), 1))


class MLP(nn.Module):
    """flatten, linear 3072→64, ReLU, linear 64→10."""

    def __init__(self, hidden: int = 64, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        self.features = nn.Sequential(nn.Flatten(), nn.Linear(int(np.prod(IMAGE_SHAPE)), hidden), nn.ReLU())
        self.fc = nn.Linear(hidden, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


class CNN(nn.Module):
    """fedsim's `cnn`: conv3×3(32)-ReLU-conv3×3(64)-ReLU-maxpool-flatten-linear(128)-ReLU, linear head. It is
    pfl-research's `simple_cnn` of its CIFAR-10 benchmark without the two dropout layers."""

    def __init__(self, num_classes: int = NUM_CLASSES) -> None:
        super().__init__()
        size = (IMAGE_SHAPE[1] - 4) // 2
        self.features = nn.Sequential(
            nn.Conv2d(IMAGE_SHAPE[0], 32, 3), nn.ReLU(inplace=True), nn.Conv2d(32, 64, 3), nn.ReLU(inplace=True),
            nn.MaxPool2d(2), nn.Flatten(), nn.Linear(64 * size * size, 128), nn.ReLU(inplace=True))
        self.fc = nn.Linear(128, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.features(x))


def build_model(name: str) -> nn.Module:
    """The workload's model by name (its weights come from the prepared init.pt)."""
    if name == "resnet8":
        return ResNet8()
    if name == "mlp":
        return MLP()
    if name == "cnn":
        return CNN()
    raise BenchError(f"model: unknown model {name!r}; choose one of {list(MODELS)}")


# ---------------------------------------------------------------------------------------------------------
# One client's training, the weighted mean, the evaluation
# ---------------------------------------------------------------------------------------------------------


def train_client(model: nn.Module, x: torch.Tensor, y: torch.Tensor, w: Workload, seed: int) -> tuple[int, float]:
    """Train `model` in place on (x, y): `w.local_epochs` shuffled passes of SGD with momentum, a fresh optimizer.

    The shuffles come from a torch generator seeded with `seed`; returns (samples, mean training loss).
    """
    n = len(y)
    if n == 0:
        return 0, float("nan")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    momentum: list[torch.Tensor | None] = [None] * len(params)
    g = torch.Generator(device="cpu")
    g.manual_seed(int(seed))
    loss_sum, seen = 0.0, 0
    for _ in range(w.local_epochs):
        perm = torch.randperm(n, generator=g)
        for start in range(0, n, w.batch_size):
            idx = perm[start:start + w.batch_size]
            loss = F.cross_entropy(model(x[idx]), y[idx])
            for p in params:
                p.grad = None
            loss.backward()
            sgd_step(params, momentum, w.lr, w.momentum)
            loss_sum += float(loss.detach()) * len(idx)
            seen += len(idx)
    return n, loss_sum / seen


@torch.no_grad()
def sgd_step(params: list[torch.Tensor], buffers: list[torch.Tensor | None], lr: float, momentum: float) -> None:
    """p -= lr·b with b = momentum·b + grad (b = grad on the first step): torch.optim.SGD's update, no dampening."""
    for i, p in enumerate(params):
        if p.grad is None:
            continue
        d = p.grad
        if momentum:
            if buffers[i] is None:
                buffers[i] = torch.clone(d).detach()
            else:
                buffers[i].mul_(momentum).add_(d)
            d = buffers[i]
        p.add_(d, alpha=-lr)


def client_update(model: nn.Module, global_state: dict[str, torch.Tensor], p: Prepared, cid: int,
                  seed: int, device: str | torch.device = "cpu") -> tuple[dict[str, torch.Tensor], int, float]:
    """Load the global weights into `model` (on `device`), train client `cid`; returns (its new state, samples,
    loss)."""
    model.load_state_dict(global_state)
    x, y = p.client_data(cid, device)
    n, loss = train_client(model, x, y, p.workload, seed)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, n, loss


class WeightedMean:
    """Σ n_k·state_k / Σ n_k over every entry of the state dict, buffers included, summed in float64.

    Each entry is cast back to its own dtype at the end, so BatchNorm's integer batch counter is truncated.
    """

    def __init__(self) -> None:
        self.sums: dict[str, torch.Tensor] = {}
        self.total = 0.0

    def add(self, state: dict[str, torch.Tensor], weight: float) -> None:
        for k, v in state.items():
            term = v.detach().to("cpu", torch.float64) * float(weight)
            if k in self.sums:
                self.sums[k] += term
            else:
                self.sums[k] = term
        self.total += float(weight)

    def result(self, like: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The mean, each entry in the dtype of `like`'s (the previous global state)."""
        if self.total <= 0:
            return dict(like)
        return {k: (self.sums[k] / self.total).to(v.dtype) for k, v in like.items()}


@torch.no_grad()
def evaluate(model: nn.Module, x: torch.Tensor, y: torch.Tensor, batch_size: int) -> tuple[float, float]:
    """(accuracy, mean cross-entropy) of `model` on (x, y) in eval mode, logits computed `batch_size` at a time."""
    model.eval()
    logits = torch.cat([model(x[i:i + batch_size]) for i in range(0, len(x), batch_size)])
    return (logits.argmax(1) == y).float().mean().item(), F.cross_entropy(logits, y).item()


# ---------------------------------------------------------------------------------------------------------
# Measuring
# ---------------------------------------------------------------------------------------------------------


class TreeMemSampler(threading.Thread):
    """Peak of the RSS summed over this process and all its descendants (Ray's daemons and workers), sampled
    every `interval` s by a daemon thread; the process list is refreshed every `rescan_every` samples to stay
    cheap. With `pss_interval` > 0 it also samples PSS (shared pages split between processes), which is costly."""

    def __init__(self, interval: float = 0.25, rescan_every: int = 4, pss_interval: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.interval, self.rescan_every, self.pss_interval = interval, rescan_every, pss_interval
        self.root = psutil.Process(os.getpid())
        self.procs: list[psutil.Process] = []
        self.labels: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        self.peak_rss = self.peak_pss = self.peak_nproc = self.samples = 0
        self.peak_breakdown: list[tuple[int, str, int]] = []
        self._last_pss = 0.0
        self._halt = threading.Event()

    def _rescan(self) -> None:
        try:
            self.procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            self.procs = []
        self.peak_nproc = max(self.peak_nproc, len(self.procs))
        for p in self.procs:
            try:
                self.labels[p.pid] = (" ".join(p.cmdline()) or p.name())[:90]  # Ray retitles its workers late
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass

    def sample(self) -> None:
        if self.samples % self.rescan_every == 0 or not self.procs:
            self._rescan()
        rss = []
        for p in self.procs:
            try:
                rss.append((p, p.memory_info().rss))
            except psutil.Error:
                pass
        total = sum(r for _, r in rss)
        if total > self.peak_rss:
            self.peak_rss = total
            self.peak_breakdown = [(p.pid, self.labels.get(p.pid, "?"), r) for p, r in rss]
        now = time.monotonic()
        if self.pss_interval > 0 and now - self._last_pss >= self.pss_interval:
            self._last_pss = now
            pss = 0
            for p, _ in rss:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pass
            self.peak_pss = max(self.peak_pss, pss)
        self.samples += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self._rescan()
        self.sample()

    def cpu_summary(self) -> dict[str, float]:
        """CPU seconds (user + system, as last seen) of this process, of Ray's worker processes, of the rest."""
        out = {"driver": 0.0, "ray_workers": 0.0, "other": 0.0}
        for pid, sec in self.cpu.items():
            kind = "driver" if pid == self.root.pid else \
                "ray_workers" if self.labels.get(pid, "").startswith("ray::") else "other"
            out[kind] = round(out[kind] + sec, 2)
        return out

    def fields(self) -> dict:
        """The memory fields of RESULT_JSON."""
        return {"peak_rss_mb": round(self.peak_rss / 2**20, 1),
                "peak_pss_mb": round(self.peak_pss / 2**20, 1) if self.pss_interval > 0 else None,
                "peak_nproc": self.peak_nproc, "cpu_seconds": self.cpu_summary(),
                "peak_breakdown_mb": [[pid, lab, round(r / 2**20, 1)]
                                      for pid, lab, r in sorted(self.peak_breakdown, key=lambda t: -t[2])][:8]}


class GpuSampler(threading.Thread):
    """GPU utilisation (NVML's share of time a kernel ran) and used memory of the program's first GPU (the first of
    CUDA_VISIBLE_DEVICES, as NVML numbers the GPUs), sampled every `interval` s with wall-clock stamps, so a
    program can average them over its steady rounds. Idle (no samples) without a GPU or without `pynvml`
    (nvidia-ml-py)."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), utilisation %, used bytes)
        self.raw: dict[int, int] = {}  # NVML's own sample buffer: its CPU time stamp (µs) -> utilisation %
        self._halt = threading.Event()
        self._nvml = None
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-")) else \
                pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)
            self._nvml = pynvml
        except Exception:  # no driver, no GPU or no pynvml: nothing to sample
            self._nvml = None

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def run(self) -> None:
        while self._nvml is not None and not self._halt.is_set():
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            except Exception:
                return
            self.samples.append((time.time(), int(util), int(used)))
            self._read_raw()
            self._halt.wait(self.interval)

    def _read_raw(self) -> None:
        """Append NVML's buffered utilisation samples newer than the last one read. Each covers a period far
        shorter than nvmlDeviceGetUtilizationRates' trailing one (up to 1 s), which smears a slow first round
        into the steady window's first readings; none where the driver keeps no such buffer."""
        try:
            last = max(self.raw, default=0)
            _, found = self._nvml.nvmlDeviceGetSamples(self._handle, self._nvml.NVML_GPU_UTILIZATION_SAMPLES, last)
        except Exception:  # no new sample since `last` (NVML_ERROR_NOT_FOUND), or no such buffer on this driver
            return
        for sample in found:
            if sample.timeStamp > last:
                self.raw[int(sample.timeStamp)] = int(sample.sampleValue.uiVal)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)

    def fields(self, t0: float | None, t1: float | None) -> dict:
        """Mean utilisation over the wall-clock window [t0, t1] (the steady rounds), by the polled readings and, where
        the driver buffers them, by NVML's own samples; peak memory over the run; empty without samples."""
        if not self.samples:
            return {}
        inside = [u for t, u, _ in self.samples if t0 is not None and t1 is not None and t0 <= t <= t1]
        out = {"gpu_util_mean": round(float(np.mean(inside)), 1) if inside else None,
               "gpu_util_samples": len(inside),
               "gpu_mem_peak_mb": round(max(m for _, _, m in self.samples) / 2**20, 1)}
        if self.raw:
            raw = [u for t, u in self.raw.items() if t0 is not None and t1 is not None and t0 <= t / 1e6 <= t1]
            out.update({"gpu_util_raw_mean": round(float(np.mean(raw)), 1) if raw else None,
                        "gpu_util_raw_samples": len(raw)})
        return out


def steady_window(bounds: list[float]) -> tuple[float | None, float | None]:
    """The wall-clock window of the steady rounds (after the first), from their bounds: each round's end (or, for
    fedsim, the start of the second round to the last one's end); None without two bounds."""
    if len(bounds) >= 2:
        return bounds[0], bounds[-1]
    return None, None


def pss_interval_from_env() -> float:
    """Seconds between PSS samples, from $BENCH_PSS_INTERVAL (0 or unset: PSS is not sampled)."""
    try:
        return max(0.0, float(os.environ.get("BENCH_PSS_INTERVAL", "0") or 0))
    except ValueError:
        raise BenchError(f"BENCH_PSS_INTERVAL: expected seconds, got {os.environ['BENCH_PSS_INTERVAL']!r}") from None


def round_summary(round_times: list[float], samples: list[int], t_start: float, t_done: float) -> dict:
    """Timing fields of RESULT_JSON: steady state = the mean over the rounds after the first."""
    steady = round_times[1:] if len(round_times) > 1 else round_times
    return {"total_seconds": round(t_done - t_start, 3),
            "round_seconds": [round(t, 3) for t in round_times],
            "seconds_per_round": round(float(np.mean(steady)), 3) if steady else None,
            "seconds_per_round_all": round(float(np.mean(round_times)), 3) if round_times else None,
            "round_train_samples": samples,
            "train_samples_per_second": round(sum(samples) / sum(round_times), 1) if sum(round_times) else None,
            "train_samples_per_second_e2e": round(sum(samples) / (t_done - t_start), 1)}


def emit_result(result: dict) -> None:
    """The one line `bench.runner.run_program` reads back."""
    print("RESULT_JSON " + json.dumps(result), flush=True)
