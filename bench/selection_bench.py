"""Server-side cost of single-image selection on CPU: pool generation, embedding, FAISS KMeans, pruning.

    python -m bench.selection_bench [--n 50000] [--k 1000] [--niter 25] [--threads 1 2]

Writes results/bench/selection.md. The paper's setting: a 50,000-patch pool of 32×32 patches, ResNet-8
(64-d embeddings), KMeans k=1000, 5,000 patches kept after KMeans balancing and 90% entropy pruning.
"""

from __future__ import annotations

import os
import platform
import time
from pathlib import Path

import numpy as np
import torch

from bench.cli import OneLineParser


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def measure(args, threads: int) -> dict[str, float]:
    """Seconds of each selection step with `threads` torch/FAISS threads."""
    import faiss

    torch.set_num_threads(threads)
    faiss.omp_set_num_threads(threads)
    from fedsim.data.single_image import PatchSpec, generate_patches, load_image
    from fedsim.models import build_model
    from fedsim.selection import SelectionConfig, embed_and_predict, entropy_prune, kmeans_balance, kmeans_distances

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


def main() -> None:
    ap = OneLineParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--k", type=int, default=1000)
    ap.add_argument("--niter", type=int, default=25)
    ap.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--out", default="results/bench/selection.md")
    args = ap.parse_args()
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
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
