"""Peak memory of one DOSFL client (one meta-iteration: S_d·E_d unrolled steps + the real-batch backward).

    python -m bench.dosfl_memory [--out results/bench/dosfl_memory.md] [--iterations 3]

Each setting runs in a fresh subprocess on random inputs of the right shape (no dataset needed), with the
configs' default DOSFL settings. Figures per setting:
  - graph: bytes of the tensors autograd saves for the meta-backward (unique storages), the part that grows
    with S_d·E_d: device-independent, what a GPU would hold on top of model, data and optimiser;
  - iteration peak: the resident memory of a warm iteration (the last one) above the level before it,
    sampled every 0.5 ms, with glibc's mmap threshold fixed at 128 KiB (MALLOC_MMAP_THRESHOLD_) so freed
    tensors go back to the OS: the CPU analogue of torch.cuda.max_memory_allocated;
  - rss: growth of the process's peak resident memory over the state after setup (an upper bound: it
    also counts first-use buffers of the first iteration);
  - cuda: torch.cuda.max_memory_allocated above the pre-iteration level, when a GPU is present.
Size `runtime.client_gpus` from the largest of graph, iteration peak and cuda: fraction ≥ peak / GPU memory
(plus the worker's copy of the dataset and the CUDA context, ~0.5 GiB).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

from bench.cli import OneLineParser

SETTINGS = {
    # name: (model, model kwargs, input shape of real data, distilled settings, config)
    "MNIST LeNet (S_d=10, B_d=10, E_d=3, B=512)": ("lenet", {}, (1, 28, 28), dict(steps=10, batch=10, epochs=3),
                                                   "configs/dosfl/mnist_*.yaml, digits_*.yaml (28×28)"),
    "MNIST LeNet, soft labels + masking p=0.1": ("lenet", {}, (1, 28, 28),
                                                 dict(steps=10, batch=10, epochs=3, soft_labels=True, mask_p=0.1),
                                                 "table1_mnist.sweep.yaml (SR, RM, SL)"),
    "IMDB TextCNN (L=200, D=100, S_d=5, B_d=1, E_d=10, B=512)": (
        "textcnn", {"vocab": 50002, "dim": 100}, (200,), dict(steps=5, batch=1, epochs=10, soft_labels=True),
        "configs/dosfl/imdb_textcnn.yaml"),
    "TREC-6 Bi-LSTM (L=30, D=100, S_d=5, B_d=1, E_d=10, B=512)": (
        "bilstm", {"vocab": 50002, "dim": 100}, (30,), dict(steps=5, batch=1, epochs=10, soft_labels=True),
        "configs/dosfl/trec6_bilstm.yaml"),
}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * resource.getpagesize()


class RssSampler:
    """Peak resident memory over a code block, sampled from /proc every 0.5 ms by a thread (torch ops free
    the GIL). Run with MALLOC_MMAP_THRESHOLD_ fixed so freed tensors return to the OS and RSS tracks them."""

    def __enter__(self) -> RssSampler:
        import threading

        self.base = self.peak = _rss_bytes()
        self._stop = threading.Event()

        def loop() -> None:
            while not self._stop.is_set():
                self.peak = max(self.peak, _rss_bytes())
                self._stop.wait(0.0005)

        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())


def measure(name: str, iterations: int) -> dict:
    """One setting, in this process: graph bytes, peak RSS growth and CUDA peak of one meta-iteration."""
    import numpy as np
    import torch

    torch.set_num_threads(1)
    from fedsim.algorithms._meta_distill import Distiller, DistillSettings, trainable, xavier_init_
    from fedsim.algorithms.dosfl import distilled_shape
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
    times, iter_peak = [], float("nan")
    for i in range(iterations):
        t0 = time.perf_counter()
        sampler = RssSampler() if i == iterations - 1 and device.type == "cpu" else None
        if sampler is not None:
            sampler.__enter__()
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
        if sampler is not None:
            del loss
            sampler.__exit__()
            iter_peak = (sampler.peak - sampler.base) / 2**20
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    params = sum(p.numel() for p in theta0.values())
    out = {"name": name, "device": str(device), "params": params, "graph_mb": sum(saved.values()) / 2**20,
           "rss_mb": max(0, peak_rss - rss0) / 2**20, "iter_mb": iter_peak, "s_per_iteration": float(np.median(times)),
           "unrolled": dset["steps"] * dset["epochs"]}
    if device.type == "cuda":
        out["cuda_mb"] = (torch.cuda.max_memory_allocated() - cuda0) / 2**20
    return out


def check(p: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse, in one line, what would measure nothing (0 iterations give a table of nan that says the default
    fits) or fail after minutes of measuring (an --out that cannot be written)."""
    from bench.runner import out_of_range, unwritable
    from fedsim.config.limits import MAX_STEPS

    problem = out_of_range("--iterations", args.iterations, 1, MAX_STEPS)
    if problem:
        p.error(problem)
    if args.one is not None and args.one not in SETTINGS:
        p.error(f"--one: unknown setting {args.one[:60]!r}; choose from {'; '.join(SETTINGS)}")
    problem = None if args.one is not None else unwritable(args.out)
    if problem:
        p.error(f"--out: {problem}")


def main(argv: list[str] | None = None) -> int:
    p = OneLineParser(prog="bench.dosfl_memory", description=__doc__.splitlines()[0])
    p.add_argument("--out", default="results/bench/dosfl_memory.md", help="the markdown table, written at the end")
    p.add_argument("--iterations", type=int, default=3, help="meta-iterations per setting (the last one is sampled)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    check(p, args)
    if args.one is not None:
        print(json.dumps(measure(args.one, args.iterations)))
        return 0
    rows = []
    for name in SETTINGS:
        env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072"}
        res = subprocess.run([sys.executable, "-m", "bench.dosfl_memory", "--one", name, "--iterations",
                              str(args.iterations)], capture_output=True, text=True, check=True, env=env)
        rows.append(json.loads(res.stdout.strip().splitlines()[-1]))
        print(rows[-1], file=sys.stderr, flush=True)
    cuda = any("cuda_mb" in r for r in rows)
    head = ["setting", "config", "θ params", "unrolled steps", "graph (MiB)", "iteration peak (MiB)",
            "peak RSS growth (MiB)"] + \
        (["CUDA peak (MiB)"] if cuda else []) + ["s / meta-iteration", "client_gpus on a 16 GiB GPU"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        peak = max(r["graph_mb"], r.get("cuda_mb", 0.0), r["iter_mb"] if r["iter_mb"] == r["iter_mb"] else 0.0)
        frac = peak / (16 * 1024)
        lines.append("| " + " | ".join([
            r["name"], SETTINGS[r["name"]][4], f"{r['params']:,}", str(r["unrolled"]), f"{r['graph_mb']:.1f}",
            f"{r['iter_mb']:.1f}", f"{r['rss_mb']:.1f}", *([f"{r.get('cuda_mb', float('nan')):.1f}"] if cuda else []),
            f"{r['s_per_iteration']:.3f} ({r['device']})",
            f"≥ {frac:.4f} (memory); the default 0.25 fits" if frac < 0.25 else f"≥ {frac:.3f}"]) + " |")
    import torch

    text = ("### DOSFL: peak memory per client (one meta-iteration)\n\n" + "\n".join(lines) +
            f"\n\nCommand: `python -m bench.dosfl_memory`; torch {torch.__version__}, 1 thread, "
            f"{rows[0]['device']}. Graph = unique storages autograd saves for the meta-gradient; RSS = growth of "
            "the CPU process's peak resident set over its state after setup (includes first-use buffers); iteration "
            "peak = resident memory of a warm meta-iteration above the level before it (sampled every 0.5 ms, "
            "glibc mmap threshold fixed at 128 KiB). client_gpus uses the largest of graph, iteration peak and "
            "CUDA peak. Real batches are random inputs "
            "of the datasets' shapes.\n")
    print(text)
    from fedsim.persist.io import atomic_write_text

    atomic_write_text(Path(args.out), text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
