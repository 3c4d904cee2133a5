"""Server-side cost of single-image selection on CPU: pool generation, embedding, FAISS KMeans, pruning.

    python -m bench.selection_bench [--n 50000] [--k 1000] [--niter 25] [--threads 1 2]

Writes results/bench/selection.md. The paper's setting: a 50,000-patch pool of 32×32 patches, ResNet-8
(64-d embeddings), KMeans k=1000, 5,000 patches kept after KMeans balancing and 90% entropy pruning.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

from bench.cli import OneLineParser
from bench.runner import out_of_range, unwritable
from fedsim.config.limits import MAX_SAMPLES, MAX_STEPS, MAX_THREADS
from fedsim.persist.io import atomic_write_text


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(args, threads: int) -> dict[str, float]:
    """Seconds of each selection step with `threads` torch/FAISS threads."""
    import faiss

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    from fedsim.algorithms._selection import (
        SelectionConfig,
        embed_and_predict,
        entropy_prune,
        kmeans_balance,
        kmeans_distances,
    )
    from fedsim.data.single_image import PatchSpec, generate_patches, load_image
    from fedsim.models import build_model

    px, t_pool = timed(lambda: generate_patches(load_image("china"), PatchSpec(n=args.n, size=32, seed=0)))
    torch.manual_seed(0)
    model = build_model("resnet8", 3, 10, 32)
    x = (px.float() / 255 - 0.5) / 0.25

    def embed():
        parts = [embed_and_predict(model, x[i:i + 4096], 512) for i in range(0, len(x), 4096)]
        return np.concatenate([e for e, _ in parts]), torch.cat([lg for _, lg in parts])

    (emb, logits), t_embed = timed(embed)
    (labels, dist, _), t_km = timed(lambda: kmeans_distances(emb, args.k, args.niter, seed=0, device="cpu"))
    rnd = np.random.default_rng(0).normal(size=emb.shape).astype(np.float32)
    _, t_km_rand = timed(lambda: kmeans_distances(rnd, args.k, args.niter, seed=0, device="cpu"))
    cfg = SelectionConfig()
    conf, pred = (t.numpy() for t in torch.softmax(logits, 1).max(1))
    n_km = int(cfg.n / (1 - cfg.removal))
    keep, t_bal = timed(lambda: kmeans_balance(pred, dist, n_km, 1.0, "hard"))
    kept, t_ent = timed(lambda: entropy_prune(pred[keep], conf[keep], cfg.removal, "top", np.random.default_rng(0)))
    d = emb.shape[1]
    return {f"generate the pool ({args.n} patches of china.jpg, 32×32)": t_pool,
            "ResNet-8 embeddings + logits of the pool (random init)": t_embed,
            f"FAISS KMeans k={args.k}, niter={args.niter} on the {args.n}×{d} ResNet-8 embeddings": t_km,
            f"FAISS KMeans k={args.k}, niter={args.niter} on {args.n}×{d} Gaussian noise": t_km_rand,
            f"KMeans class balancing (keeps {len(keep)})": t_bal,
            f"entropy pruning, 90% top (keeps {len(kept)})": t_ent}


def arguments_problem(args: argparse.Namespace) -> str | None:
    """What FAISS or the pool would fail on (no patches, more clusters than patches, no thread) or what would
    measure nothing, and an --out that cannot be written: named before the minutes of measuring."""
    problem = out_of_range("--n", args.n, 1, MAX_SAMPLES) or out_of_range("--niter", args.niter, 1, MAX_STEPS)
    if problem:
        return problem
    if not 1 <= args.k <= args.n:
        return f"--k: must be from 1 to --n ({args.n}) clusters, got {args.k}"
    for t in args.threads:
        problem = out_of_range("--threads", t, 1, MAX_THREADS)
        if problem:
            return problem
        if args.threads.count(t) > 1:
            return f"--threads: {t} is given twice"
    out = unwritable(args.out)
    return out and f"--out: {out}"


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="bench.selection_bench", description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000, help="patches in the pool")
    ap.add_argument("--k", type=int, default=1000, help="KMeans clusters, at most --n")
    ap.add_argument("--niter", type=int, default=25, help="KMeans iterations")
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2], help="thread counts to measure, one column each")
    ap.add_argument("--out", default="results/bench/selection.md")
    args = ap.parse_args(argv)
    problem = arguments_problem(args)
    if problem:
        ap.error(problem)
    import faiss

    cols = {t: measure(args, t) for t in args.threads}
    names = list(next(iter(cols.values())))
    md = ["# Selection cost on CPU", "",
          f"Command: `python -m bench.selection_bench --n {args.n} --k {args.k} --niter {args.niter} "
          f"--threads {' '.join(map(str, args.threads))}`", "",
          f"Machine: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs shared with other jobs "
          f"(load average {os.getloadavg()[0]:.1f} at the end), faiss {faiss.__version__}, torch {torch.__version__}.",
          "Seconds per step, with torch and FAISS limited to the given number of threads.", "",
          "| step | " + " | ".join(f"{t} thread{'s' if t > 1 else ''}" for t in args.threads) + " |",
          "|---|" + "---|" * len(args.threads)]
    md += [f"| {name} | " + " | ".join(f"{cols[t][name]:.2f}" for t in args.threads) + " |" for name in names]
    atomic_write_text(Path(args.out), "\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
