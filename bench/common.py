"""What the plain loop, the Flower app and fedsim's bench run share: the prepared files, the models, one client's
local training, the weighted mean and the central evaluation (what needs no torch, the knobs and the measuring, is
in bench.measure, and taken from here too).

It imports only numpy, torch and psutil, so Flower's venv (which has no fedsim) runs the same code. The
models carry fedsim's parameter and buffer names, and every step does what fedsim's FedAvg does: the same
shuffles, the same SGD update, BatchNorm buffers averaged like the weights (integer counters truncated).
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from bench.measure import (  # noqa: F401  (the programs take these from here, as before they moved)
    BenchError,
    GpuSampler,
    TreeMemSampler,
    Workload,
    emit_result,
    pss_interval_from_env,
    read_workload,
    round_summary,
    steady_window,
)
from bench.runner import unwritable

NUM_CLASSES = 10
IMAGE_SHAPE = (3, 32, 32)
MODELS = ("resnet8", "mlp", "cnn")
PARTITIONS = ("dirichlet", "iid")
FILES = ("workload.json", "partition.npz", "draws.npy", "seeds.npy", "init.pt")


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
    w = read_workload(folder)
    data_name = w.data_key()
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
