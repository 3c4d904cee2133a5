"""Flower's own robust-aggregation functions (flwr.server.strategy.aggregate) timed on the updates that
bench.robust_bench saved, in Flower's venv: numpy only, no fedsim.

    .venv-flower/bin/python -m bench.flower_robust UPDATES.npz RULE F REPEAT
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def results_of(path: str) -> list:
    """[(layers, num_examples)] per client, Flower's `results` shape, from the saved (n, d) rows and layer shapes."""
    saved = np.load(path)
    rows, shapes, weights = saved["rows"], saved["shapes"], saved["weights"]
    out = []
    for row, w in zip(rows, weights):
        layers, at = [], 0
        for shape in shapes:
            size = int(np.prod(shape[shape > 0])) if (shape > 0).any() else 1
            layers.append(row[at:at + size].reshape(tuple(int(s) for s in shape if s > 0)))
            at += size
        out.append((layers, int(w)))
    return out


def main(argv: list[str]) -> None:
    from flwr.server.strategy.aggregate import (
        aggregate_bulyan,
        aggregate_krum,
        aggregate_median,
        aggregate_trimmed_avg,
    )

    path, rule, f, repeat = argv[0], argv[1], int(argv[2]), int(argv[3])
    results = results_of(path)
    calls = {"krum": lambda: aggregate_krum(results, f, 0),
             "multi_krum": lambda: aggregate_krum(results, f, len(results) - f),
             "bulyan": lambda: aggregate_bulyan(list(results), f, aggregate_krum, to_keep=0),
             "median": lambda: aggregate_median(results),
             "trimmed_mean": lambda: aggregate_trimmed_avg(results, 0.1)}
    seconds, out = [], None
    for _ in range(repeat):
        t0 = time.perf_counter()
        out = calls[rule]()
        seconds.append(time.perf_counter() - t0)
    flat = np.concatenate([np.asarray(a, dtype=np.float64).ravel() for a in out])
    np.save(path.replace(".npz", f".{rule}.flower.npy"), flat)
    print("RESULT_JSON " + json.dumps({"seconds": min(seconds)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
