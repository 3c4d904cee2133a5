"""Evaluation-only measurements of what a method's paper argues from (its "mechanism"), written once.

Methods report these as server-step metrics, so they land in rounds.parquet as `<phase>/mech_<name>`
columns, and list them in `Algorithm.mechanism_columns` (docs/mechanism.md is generated from that). They
read the held-out test set only to score, never train on it, draw no numbers from any training stream,
and run on copies of models in eval mode: switching them off (`eval.mechanism: false`) leaves every
training number bit for bit unchanged.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import nn

from fedsim import rng
from fedsim.training.train import predict_logits

PREFIX = "mech_"


def enabled(env) -> bool:
    """Whether this run records mechanism columns (`eval.mechanism`)."""
    return bool(getattr(env.config.eval, "mechanism", True))


def probe_set(env) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The held-out test set on this process's device (at most `eval.mechanism_samples` of it, a fixed
    seeded subset: the same rows on the server and every worker), or None when mechanism columns are off or
    no test data is held here."""
    if not enabled(env):
        return None
    cached = env.extras.get("_mechanism_probe")
    if cached is not None:
        return cached
    data = env.extras.get("server_data") or env.extras.get("eval_data")  # server; a client worker
    if data is None or len(data.y_test) == 0:
        return None
    x, y = data.x_test, data.y_test
    limit = int(getattr(env.config.eval, "mechanism_samples", 1000))
    if len(y) > limit:
        keep = np.sort(rng.numpy_generator(env.config.seed, "mechanism/probe").choice(len(y), limit, replace=False))
        x, y = x[keep], y[keep]
    probe = (torch.as_tensor(np.ascontiguousarray(x)).to(env.device),
             torch.as_tensor(np.asarray(y), dtype=torch.long).to(env.device))
    env.extras["_mechanism_probe"] = probe
    return probe


def client_samples(env, client_ids: list[int], per_client: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Up to `per_client` training inputs of each client (a fixed seeded subset), on the server's device,
    and the client each row came from; for scoring what a client's model holds about its own data."""
    data, part = env.extras.get("server_data"), env.extras.get("partition")
    if not enabled(env) or data is None or not hasattr(part, "train") or not client_ids:
        return None  # without a partition, or with generated shards (no indices into a training set)
    rows, owner = [], []
    for cid in client_ids:
        idx = np.asarray(part.train[cid])
        if len(idx) > per_client:
            draw = rng.numpy_generator(env.config.seed, "mechanism/client_samples", client=int(cid))
            idx = np.sort(draw.choice(idx, per_client, replace=False))
        rows.append(idx)
        owner.append(np.full(len(idx), cid))
    idx = np.concatenate(rows)
    return (torch.as_tensor(np.ascontiguousarray(data.x_train[idx])).to(env.device),
            torch.as_tensor(np.concatenate(owner)).to(env.device))


@torch.no_grad()
def logits(model: nn.Module, x: torch.Tensor, batch_size: int = 512) -> torch.Tensor:
    """Eval-mode logits of `model` on `x`; the model's mode is restored afterwards."""
    was_training = model.training
    out = predict_logits(model, x, batch_size)
    model.train(was_training)
    return out


def accuracy(scores: torch.Tensor, y: torch.Tensor) -> float:
    """Top-1 accuracy of logits or probabilities [N, C] against labels [N]."""
    return float((scores.argmax(1) == y).float().mean()) if len(y) else math.nan


def agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    """Fraction of rows on which two score tables [N, C] pick the same class."""
    return float((a.argmax(1) == b.argmax(1)).float().mean()) if len(a) else math.nan


def entropy_bits(probs: torch.Tensor) -> torch.Tensor:
    """Shannon entropy in bits of each row of probabilities [N, C] (or of one vector [C])."""
    p = probs.double().clamp_min(0)
    p = p / p.sum(-1, keepdim=True).clamp_min(1e-300)
    return -(p * torch.log2(p.clamp_min(1e-300))).sum(-1) + 0.0  # + 0.0: no "-0.0" for a one-hot row


def class_balance(labels: torch.Tensor | np.ndarray, num_classes: int) -> dict[str, float]:
    """How evenly `labels` cover the classes: entropy of their histogram as a fraction of log2(C) (1 =
    uniform), and the largest class's share."""
    counts = torch.bincount(torch.as_tensor(np.asarray(labels)).long().flatten().cpu(), minlength=num_classes)
    if int(counts.sum()) == 0:
        return {"entropy_frac": math.nan, "max_share": math.nan}
    share = counts.double() / counts.sum()
    return {"entropy_frac": float(entropy_bits(share) / math.log2(max(num_classes, 2))),
            "max_share": float(share.max())}


def concentration(weights: torch.Tensor) -> dict[str, float]:
    """How concentrated per-sample ensemble weights [K, N] (columns summing to 1) are: the mean largest
    weight (1/K = uniform, 1 = one member) and the mean entropy as a fraction of log2(K)."""
    k = weights.shape[0]
    w = weights.double() / weights.double().sum(0, keepdim=True).clamp_min(1e-300)
    ent = entropy_bits(w.T).mean() / math.log2(k) if k > 1 else torch.tensor(0.0)
    return {"max_mean": float(w.max(0).values.mean()), "entropy_frac": float(ent)}


def auc(positive: torch.Tensor, negative: torch.Tensor) -> float:
    """Area under the ROC curve of scores that should be high on `positive` and low on `negative`:
    the probability that a random positive outscores a random negative (ties count half)."""
    from sklearn.metrics import roc_auc_score

    pos, neg = positive.detach().double().cpu().numpy(), negative.detach().double().cpu().numpy()
    if len(pos) == 0 or len(neg) == 0:
        return math.nan
    return float(roc_auc_score(np.r_[np.ones(len(pos)), np.zeros(len(neg))], np.r_[pos, neg]))


def columns(metrics: dict[str, float]) -> dict[str, float]:
    """Prefix metric names with `mech_`, so the columns are told apart from training metrics."""
    return {f"{PREFIX}{k}": float(v) for k, v in metrics.items()}
