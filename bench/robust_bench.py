"""Robust aggregation at 10, 100 and 1,000 client updates of ResNet-8: fedsim's rules (fedsim.transforms.robust) side
by side with Flower's own functions (flwr.server.strategy.aggregate, in Flower's venv) on the same updates; the
aggregates compared (Flower is the oracle), and fedsim's peak memory over the updates it holds.

    python -m bench.robust_bench [--sizes 10,100,1000] [--repeat 3] [--out results/bench]

Writes <out>/robust_aggregation.json and .md; exits 1 when an aggregate differs from Flower's.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from bench.runner import REPO, flower_python, run_program

RULES = ("krum", "multi_krum", "bulyan", "median", "trimmed_mean")
FLOWER_LIMIT_S = 900  # Flower's Bulyan at 1,000 updates runs 800 pairwise Krums in Python loops: hours
TOLERANCE = 1e-5  # float32 updates: Flower sums in float32, fedsim in float64


def resnet8_shapes() -> list[tuple[int, ...]]:
    """The shapes of ResNet-8's floating-point entries (CIFAR-sized), in state_dict order."""
    from fedsim.models import build_model

    return [tuple(v.shape) for v in build_model("resnet8", 3, 10, 32).state_dict().values() if v.is_floating_point()]


def updates(n: int, d: int) -> tuple[np.ndarray, np.ndarray]:
    """n seeded float32 updates of d entries (N(0, 0.01²), a tenth of them shifted as attackers would), weights."""
    gen = np.random.default_rng(n)
    rows = gen.normal(0.0, 0.01, size=(n, d)).astype(np.float32)
    rows[: max(1, n // 10)] += np.float32(0.05)
    return rows, gen.integers(10, 100, size=n).astype(np.int64)


def attackers(n: int) -> int:
    return max(1, n // 10)


class PeakRss(threading.Thread):
    """The process's peak RSS above a baseline, sampled every 2 ms."""

    def __init__(self) -> None:
        import psutil

        super().__init__(daemon=True)
        self.proc, self.stop, self.peak = psutil.Process(), threading.Event(), 0
        self.base = self.proc.memory_info().rss

    def run(self) -> None:
        while not self.stop.is_set():
            self.peak = max(self.peak, self.proc.memory_info().rss - self.base)
            time.sleep(0.002)


def fedsim_time(rule: str, held: list[dict], weights: np.ndarray, repeat: int) -> tuple[float, int, np.ndarray]:
    """Best seconds of fedsim's server path (the clients' float64 updates stacked, then the rule), its peak memory
    above the updates, and the aggregate."""
    import torch

    from fedsim.transforms import robust
    from fedsim.transforms.updates import stack

    keys = sorted(held[0])
    w = torch.tensor(weights, dtype=torch.float64)
    best, out = float("inf"), None
    sampler = PeakRss()
    sampler.start()
    for _ in range(repeat):
        t0 = time.perf_counter()
        rows = stack(held, keys)
        out = robust.aggregate(rule, rows, w, attackers(len(held)), beta=0.1).aggregate
        best = min(best, time.perf_counter() - t0)
        del rows
    sampler.stop.set()
    sampler.join()
    assert out is not None
    return best, sampler.peak, out.numpy()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.robust_bench", description=__doc__.splitlines()[0])
    p.add_argument("--sizes", default="10,100,1000")
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--out", default="results/bench")
    args = p.parse_args(argv)
    import torch

    torch.set_num_threads(2)
    sizes = [int(s) for s in args.sizes.split(",")]
    shapes = resnet8_shapes()
    d = sum(int(np.prod(s)) for s in shapes)
    py = flower_python()
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    rows_out, mismatched = [], []
    for n in sizes:
        flat, weights = updates(n, d)
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(tmp) / f"updates{n}.npz"
            padded = np.array([list(s) + [0] * (4 - len(s)) for s in shapes])
            np.savez(path, rows=flat, shapes=padded, weights=weights)
            # what fedsim's server holds: each client's update, float64, in one dict per client (keys by entry)
            held = [{f"e{i:03d}": torch.from_numpy(r[a:b].astype(np.float64))
                     for i, (a, b) in enumerate(zip(np.cumsum([0, *map(np.prod, shapes)])[:-1],
                                                    np.cumsum([int(np.prod(s)) for s in shapes])))}
                    for r in flat]
            held_bytes = n * d * 8
            for rule in RULES:
                seconds, peak, ours = fedsim_time(rule, held, weights, args.repeat)
                theirs_s, diff = float("nan"), float("nan")
                if not (rule == "bulyan" and n >= 1000):
                    res = run_program([str(py), "-m", "bench.flower_robust", str(path), rule, str(attackers(n)),
                                       str(1 if n >= 1000 else args.repeat)], Path(tmp) / f"{rule}.log",
                                      timeout=FLOWER_LIMIT_S, cwd=REPO)
                    if res.get("seconds") is not None:
                        theirs_s = float(res["seconds"])
                        theirs = np.load(path.with_suffix(f".{rule}.flower.npy"))
                        diff = float(np.max(np.abs(theirs - ours)))
                        if diff > TOLERANCE:
                            mismatched.append(f"{rule} at n={n}: max |fedsim - Flower| = {diff:.3g}")
                rows_out.append({"n": n, "rule": rule, "fedsim_s": seconds, "flower_s": theirs_s,
                                 "max_abs_diff": diff, "peak_over_updates_bytes": peak, "updates_bytes": held_bytes})
                print(f"n={n} {rule}: fedsim {seconds:.3f} s, Flower {theirs_s:.3f} s, diff {diff:.2g}, "
                      f"peak {peak / 2**20:.0f} MiB over {held_bytes / 2**20:.0f} MiB of updates", flush=True)
            del held
    (out_dir / "robust_aggregation.json").write_text(json.dumps(rows_out, indent=1))
    (out_dir / "robust_aggregation.md").write_text(render(rows_out, args))
    for line in mismatched:
        print(f"robust_bench: {line}", file=sys.stderr)
    return 1 if mismatched else 0


def render(rows: list[dict], args: argparse.Namespace) -> str:
    """The generated table: seconds side by side, their ratio, the agreement with Flower, fedsim's peak memory."""
    import platform

    import torch

    def num(v: float, fmt: str, missing: str = "") -> str:
        return missing if v != v else format(v, fmt)

    lines = ["<!-- generated by `python -m bench.robust_bench`; do not edit -->",
             "| updates | rule | fedsim (s) | Flower (s) | Flower / fedsim | max abs diff | fedsim peak over the "
             "updates (MiB) | the updates (MiB) |", "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        ratio = r["flower_s"] / r["fedsim_s"]
        lines.append(f"| {r['n']} | {r['rule']} | {r['fedsim_s']:.3f} | {num(r['flower_s'], '.3f', 'not run')} | "
                     f"{num(ratio, '.1f')}{'' if ratio != ratio else '×'} | {num(r['max_abs_diff'], '.1e')} | "
                     f"{r['peak_over_updates_bytes'] / 2**20:.0f} | {r['updates_bytes'] / 2**20:.0f} |")
    lines += ["", "ResNet-8 updates (float32 rows of 78,714 entries; f = n/10 attackers), fedsim's best of "
              f"{args.repeat} (Flower's at 1,000 updates: one call; its Bulyan there, 800 Krums in Python loops, is "
              "not run). "
              f"Machine: {platform.machine()}, torch {torch.__version__}, 2 threads. Command: "
              f"`python -m bench.robust_bench --sizes {args.sizes} --repeat {args.repeat}`.", ""]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
