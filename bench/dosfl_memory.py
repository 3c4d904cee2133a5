"""Peak memory of one DOSFL client (one meta-iteration: S_d·E_d unrolled steps + the real-batch backward).

    python -m bench.dosfl_memory [--out results/bench/dosfl_memory.md] [--iterations 3]

Each setting runs in a fresh subprocess on random inputs of the right shape (no dataset needed), with the
configs' default DOSFL settings. Three figures per setting:
  - graph: bytes of the tensors autograd saves for the meta-backward (unique storages), the part that grows
    with S_d·E_d: device-independent, what a GPU would hold on top of model, data and optimiser;
  - heap: the CPU peak of live heap bytes (glibc mallinfo2, read after every aten op, forward and backward,
    through a TorchDispatchMode) above the level before the iteration, measured on the last iteration after
    warm-up: the CPU analogue of torch.cuda.max_memory_allocated;
  - rss: growth of the process's peak resident memory over the state after setup (an upper bound: it
    includes allocator caching and first-use buffers);
  - cuda: torch.cuda.max_memory_allocated above the pre-iteration level, when a GPU is present.
Use the larger of graph and cuda to size `runtime.client_gpus`: fraction ≥ peak / GPU memory.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

SETTINGS = {
    # name: (model, model kwargs, input shape of real data, distilled settings, config)
    "MNIST LeNet (S_d=10, B_d=10, E_d=3, B=512)": ("lenet", {}, (1, 28, 28), dict(steps=10, batch=10, epochs=3),
                                                   "configs/dosfl/mnist_*.yaml"),
    "MNIST LeNet, soft labels + masking p=0.1": ("lenet", {}, (1, 28, 28),
                                                 dict(steps=10, batch=10, epochs=3, soft_labels=True, mask_p=0.1),
                                                 "table1_mnist.sweep.yaml (SR, RM, SL)"),
    "IMDB TextCNN (L=200, D=100, S_d=5, B_d=1, E_d=10, B=512)": (
        "textcnn", {"vocab": 50002, "dim": 100}, (200,), dict(steps=5, batch=1, epochs=10, soft_labels=True),
        "configs/dosfl/imdb_textcnn.yaml"),
    "TREC-6 Bi-LSTM (L=30, D=100, S_d=5, B_d=1, E_d=10, B=512)": (
        "bilstm", {"vocab": 50002, "dim": 100}, (30,), dict(steps=5, batch=1, epochs=10, soft_labels=True),
        "configs/dosfl/trec6_bilstm.yaml"),
    "digits LeNet 8×8 (embedded run)": ("lenet", {}, (1, 8, 8), dict(steps=10, batch=10, epochs=3),
                                        "configs/dosfl/digits_*.yaml"),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


def _heap_probe():
    """A dispatch mode that records the peak of glibc's live heap bytes after every op (None off glibc)."""
    import ctypes

    from torch.utils._python_dispatch import TorchDispatchMode

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                   "fsmblks", "uordblks", "fordblks", "keepcost")]

    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
    except (OSError, AttributeError):
        return None

    def live() -> int:
        m = libc.mallinfo2()
        return int(m.uordblks + m.hblkhd)

    class Peak(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.base = self.peak = live()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            self.peak = max(self.peak, live())
            return out

    return Peak


def measure(name: str, iterations: int) -> dict:
    """One setting, in this process: graph bytes, peak RSS growth and CUDA peak of one meta-iteration."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from fedsim.algorithms.dosfl import distilled_shape
    from fedsim.meta_distill import Distiller, DistillSettings, trainable, xavier_init_
    from fedsim.models import build_model
    from fedsim.models import text as _text  # noqa: F401

    arch, kw, shape, dset, _ = SETTINGS[name]
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(0)
    if arch in ("textcnn", "bilstm"):
        table = np.random.default_rng(0).standard_normal((kw["vocab"], kw["dim"])).astype(np.float32)
        model = build_model(arch, 1, 2, 0, embedding=table)
        x = torch.randint(0, kw["vocab"], (512, *shape), generator=g)
    else:
        model = build_model(arch, shape[0], 10, shape[-1])
        x = torch.randn((512, *shape), generator=g)
    y = torch.randint(0, 2 if arch in ("textcnn", "bilstm") else 10, (512,), generator=g)
    model = model.to(device)
    xavier_init_(model, 0)
    theta0, rest = trainable(model)
    d = Distiller(DistillSettings(**dset), distilled_shape(model, shape), int(model.fc.out_features), g, device)
    x, y = x.to(device), y.to(device)
    mask, noise = d.sample_mask(g)

    saved: dict[tuple, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if t.device == device:
            st = t.untyped_storage()
            saved[(st.data_ptr(), st.nbytes())] = st.nbytes()
        return t

    rss0 = _rss_bytes()
    if device.type == "cuda":
        torch.cuda.synchronize()
        cuda0 = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    times, heap = [], float("nan")
    probe = _heap_probe() if device.type == "cpu" else None
    for i in range(iterations + 1):
        if i == iterations:  # one more, under the heap probe (slower, so not timed)
            if probe is None:
                break
            mode = probe()
            with mode:
                loss = d.meta_loss(model, theta0, rest, x, y, mask, noise)
                d.opt.zero_grad()
                loss.backward()
            heap = (mode.peak - mode.base) / 2**20
            break
        t0 = time.perf_counter()
        if i == 0:
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = d.meta_loss(model, theta0, rest, x, y, mask, noise)
        else:
            loss = d.meta_loss(model, theta0, rest, x, y, mask, noise)
        d.opt.zero_grad()
        loss.backward()
        d.opt.step()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in theta0.values())
    out = {"name": name, "device": str(device), "params": params, "graph_mb": sum(saved.values()) / 2**20,
           "rss_mb": max(0, peak_rss - rss0) / 2**20, "heap_mb": heap, "s_per_iteration": float(np.median(times)),
           "unrolled": dset["steps"] * dset["epochs"]}
    if device.type == "cuda":
        out["cuda_mb"] = (torch.cuda.max_memory_allocated() - cuda0) / 2**20
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.dosfl_memory", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/bench/dosfl_memory.md")
    p.add_argument("--iterations", type=int, default=2)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one, args.iterations)))
        return 0
    rows = []
    for name in SETTINGS:
        res = subprocess.run([sys.executable, "-m", "bench.dosfl_memory", "--one", name, "--iterations",
                              str(args.iterations)], capture_output=True, text=True, check=True)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    cuda = any("cuda_mb" in r for r in rows)
    head = ["setting", "config", "θ params", "unrolled steps", "graph (MiB)", "peak heap (MiB)",
            "peak RSS growth (MiB)"] + \
        (["CUDA peak (MiB)"] if cuda else []) + ["s / meta-iteration", "client_gpus on a 16 GiB GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peak = max(r["graph_mb"], r.get("cuda_mb", 0.0), r["heap_mb"] if r["heap_mb"] == r["heap_mb"] else 0.0)
        frac = peak / (16 * 1024)
        lines.append("| " + " | ".join([
            r["name"], SETTINGS[r["name"]][4], f"{r['params']:,}", str(r["unrolled"]), f"{r['graph_mb']:.1f}",
            f"{r['heap_mb']:.1f}", f"{r['rss_mb']:.1f}", *([f"{r.get('cuda_mb', float('nan')):.1f}"] if cuda else []),
            f"{r['s_per_iteration']:.3f} ({r['device']})",
            f"≥ {frac:.4f} (memory); the default 0.25 fits" if frac < 0.25 else f"≥ {frac:.3f}"]) + " |")
    import torch

    text = ("### DOSFL: peak memory per client (one meta-iteration)\n\n" + "\n".join(lines) +
            f"\n\nCommand: `python -m bench.dosfl_memory`; torch {torch.__version__}, 1 thread, "
            f"{rows[0]['device']}. Graph = unique storages autograd saves for the meta-gradient; RSS = growth of "
            "the CPU process's peak resident set over its state after setup; heap = peak live heap bytes during one "
            "meta-iteration (after warm-up) above the level before it. client_gpus uses the largest of graph, "
            "heap and CUDA peak. Real batches are random inputs "
            "of the datasets' shapes.\n")
    print(text)
    from fedsim.io import atomic_write_text

    atomic_write_text(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
