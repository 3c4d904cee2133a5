"""Patch selection with the current global model (Soni et al. 2024, Sec. 3.2 and App. A).

KMeans class balancing (Alg. 2): FAISS KMeans on penultimate embeddings gives each patch its distance to
its own centroid; patches are grouped by *predicted class* (the cluster id only supplies that distance,
as in the reference code), each class contributes up to `n / classes · balancing` patches chosen by the
easy/hard/mixed heuristic, and the remaining slots are filled from the leftovers with the same heuristic.
Entropy pruning (Alg. 3): per predicted class, drop a fraction `removal` of the patches by max-softmax
confidence (`top` drops the most confident, keeping high-entropy patches). Combined, KMeans keeps
n/(1 - removal) patches and entropy pruning brings them down to about n.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

import numpy as np
import torch

from fedsim.config.limits import MAX_SAMPLES
from fedsim.extras import require
from fedsim.method import knob

if TYPE_CHECKING:
    from fedsim.models import Classifier


@dataclass
class SelectionConfig:
    """Which patches of the pool are distilled on this round; the paper's settings are the defaults."""

    n: int = knob(5000, ge=1, le=MAX_SAMPLES, doc="distillation set size after selection")
    kmeans: bool = knob(True, doc="KMeans class balancing on the global model's embeddings")
    k: int = knob(1000, ge=1, le=1_000_000, doc="KMeans clusters")
    niter: int = knob(25, ge=1, le=10_000,
                      doc="KMeans iterations (FAISS default; the reference ran sklearn to convergence)")
    heuristic: Literal["hard", "easy", "mixed"] = knob("hard", doc="take the patches farthest from (hard) or "
                                                        "nearest to (easy) their centroid, or a mix")
    mixed: str = knob("50-50", doc="easy-hard percentages for heuristic=mixed")
    balancing: float = knob(1.0, ge=0, le=1, doc="per-class quota factor: quota = n / classes · balancing")
    entropy: bool = knob(True, doc="entropy (max-softmax confidence) pruning")
    removal: float = knob(0.9, ge=0, lt=1, doc="fraction of patches entropy pruning removes, per predicted class")
    removal_strategy: Literal["top", "bottom", "random"] = knob("top", doc="remove the most confident (top), the "
                                                                "least confident (bottom) or random patches")
    device: Literal["auto", "cpu", "gpu"] = knob("auto", doc="FAISS device: gpu when FAISS sees one (auto)")

    def __post_init__(self) -> None:
        easy_hard(self.heuristic, self.mixed)

    @property
    def needs_model(self) -> bool:
        return self.kmeans or self.entropy

    def candidates(self, pool_size: int) -> int:
        """How many pool patches selection looks at: all with KMeans, n/(1-removal) for entropy alone."""
        if self.kmeans:
            return pool_size
        if self.entropy:
            return min(pool_size, int(self.n / (1 - self.removal)))
        return min(pool_size, self.n)


def easy_hard(heuristic: str, mixed: str = "50-50") -> tuple[int, int]:
    """(easy %, hard %) of a heuristic; 'easy' is pure easy (the reference's 50/50 'easy' is not copied)."""
    if heuristic == "hard":
        return 0, 100
    if heuristic == "easy":
        return 100, 0
    if heuristic != "mixed":
        raise ValueError(f"heuristic must be 'hard', 'easy' or 'mixed', got {heuristic!r}")
    try:
        a, b = (int(p) for p in mixed.split("-"))
    except ValueError:
        raise ValueError(f"mixed must look like '30-70' (easy-hard percentages), got {mixed!r}") from None
    if a < 0 or b < 0 or a + b != 100:
        raise ValueError(f"mixed percentages must be >= 0 and sum to 100, got {mixed!r}")
    return a, b


def _faiss() -> Any:
    """The faiss module, or one error naming the extra that installs it."""
    return require("faiss", "faiss", "KMeans selection (algorithm.selection.kmeans)")


def faiss_gpu_available() -> bool:
    faiss = _faiss()
    return hasattr(faiss, "get_num_gpus") and faiss.get_num_gpus() > 0


def kmeans_distances(x: np.ndarray, k: int, niter: int, seed: int, device: str = "auto"
                     ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """FAISS KMeans on rows of x: (cluster id, Euclidean distance to its centroid, centroids)."""
    faiss = _faiss()
    x = np.ascontiguousarray(x, dtype=np.float32)
    k = max(1, min(k, len(x)))
    gpu = device == "gpu" or (device == "auto" and faiss_gpu_available())
    km = faiss.Kmeans(x.shape[1], k, niter=niter, seed=seed, gpu=gpu, verbose=False, min_points_per_centroid=1)
    km.train(x)
    assert km.centroids is not None  # set by train
    sq, ids = km.index.search(x, 1)
    return ids[:, 0].astype(np.int64), np.sqrt(np.maximum(sq[:, 0], 0)).astype(np.float64), km.centroids


def _split(count: int, easy_pct: int, hard_pct: int) -> tuple[int, int]:
    """(easy, hard) counts for `count` slots; the rounding remainder goes to easy, as in the reference."""
    n_easy, n_hard = int(easy_pct / 100 * count), int(hard_pct / 100 * count)
    return n_easy + (count - n_easy - n_hard), n_hard


def _take(idx: np.ndarray, dist: np.ndarray, count: int, easy_pct: int, hard_pct: int) -> np.ndarray:
    """`count` of idx: the nearest `easy` and the farthest `hard` by dist (ties broken by index)."""
    if count >= len(idx):
        return idx
    order = idx[np.lexsort((idx, dist[idx]))]  # ascending distance, then index
    n_easy, n_hard = _split(count, easy_pct, hard_pct)
    return np.concatenate([order[:n_easy], order[len(order) - n_hard:]])


def kmeans_balance(pred: np.ndarray, dist: np.ndarray, n: int, balancing: float, heuristic: str,
                   mixed: str = "50-50") -> np.ndarray:
    """Alg. 2: per-predicted-class quotas by centroid distance, then a global fill; sorted pool indices."""
    easy_pct, hard_pct = easy_hard(heuristic, mixed)
    pred, dist = np.asarray(pred), np.asarray(dist, dtype=np.float64)
    n = min(n, len(pred))
    classes = np.unique(pred)
    quota = int(n / max(len(classes), 1) * balancing)
    chosen = [_take(np.flatnonzero(pred == c), dist, quota, easy_pct, hard_pct) for c in classes]
    picked = np.concatenate(chosen) if chosen else np.zeros(0, np.int64)
    mask = np.ones(len(pred), bool)
    mask[picked] = False
    rest = _take(np.flatnonzero(mask), dist, n - len(picked), easy_pct, hard_pct)
    return np.sort(np.concatenate([picked, rest]).astype(np.int64))


def entropy_prune(pred: np.ndarray, confidence: np.ndarray, removal: float, strategy: str,
                  rng: np.random.Generator) -> np.ndarray:
    """Alg. 3: within each predicted class drop int(removal·size) patches; returns kept positions, sorted."""
    if strategy not in ("top", "bottom", "random"):
        raise ValueError(f"removal_strategy must be 'top', 'bottom' or 'random', got {strategy!r}")
    pred, confidence = np.asarray(pred), np.asarray(confidence, dtype=np.float64)
    kept = []
    for c in np.unique(pred):
        idx = np.flatnonzero(pred == c)
        drop = int(removal * len(idx))
        if strategy == "random":
            order = rng.permutation(idx)
        else:
            order = idx[np.lexsort((idx, -confidence[idx] if strategy == "top" else confidence[idx]))]
        kept.append(order[drop:])
    return np.sort(np.concatenate(kept)) if kept else np.zeros(0, np.int64)


@torch.no_grad()
def embed_and_predict(model: Classifier, x: torch.Tensor, batch_size: int = 1024
                      ) -> tuple[np.ndarray, torch.Tensor]:
    """Penultimate embeddings (float32 numpy) and logits of `model` on `x`, in eval mode."""
    model.eval()
    embs, logits = [], []
    for i in range(0, len(x), batch_size):
        z = model.embed(x[i:i + batch_size])
        embs.append(z.float().cpu())
        logits.append(model.head(z).float().cpu())
    return torch.cat(embs).numpy(), torch.cat(logits)


def select(embeddings: np.ndarray | None, logits: torch.Tensor | None, cfg: SelectionConfig, pool_size: int,
           seed: int) -> tuple[np.ndarray, dict[str, float]]:
    """Sorted pool indices to distil on, from the model outputs on the first `cfg.candidates(pool_size)` patches."""
    m = cfg.candidates(pool_size)
    info: dict[str, float] = {"candidates": float(m)}
    if not cfg.needs_model:
        return np.arange(m, dtype=np.int64), {**info, "selected": float(m)}
    if logits is None or len(logits) != m or (cfg.kmeans and (embeddings is None or len(embeddings) != m)):
        raise ValueError(f"select: expected model outputs for {m} candidate patches")
    probs = torch.softmax(logits.float(), dim=1)
    conf, pred = (t.numpy() for t in probs.max(dim=1))
    idx = np.arange(m, dtype=np.int64)
    if cfg.kmeans:
        assert embeddings is not None  # checked above
        t0 = time.perf_counter()
        _, dist, _ = kmeans_distances(embeddings, cfg.k, cfg.niter, seed, cfg.device)
        info["kmeans_s"] = time.perf_counter() - t0
        keep = int(cfg.n / (1 - cfg.removal)) if cfg.entropy else cfg.n
        idx = kmeans_balance(pred, dist, keep, cfg.balancing, cfg.heuristic, cfg.mixed)
    if cfg.entropy:
        kept = entropy_prune(pred[idx], conf[idx], cfg.removal, cfg.removal_strategy, np.random.default_rng(seed))
        idx = idx[kept]
    info.update(selected=float(len(idx)), classes=float(len(np.unique(pred[idx]))),
                confidence=float(conf[idx].mean()) if len(idx) else float("nan"))
    return idx, info
