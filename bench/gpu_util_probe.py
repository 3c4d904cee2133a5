"""How NVML's utilisation readings follow a GPU whose true busy share is known: the instrument behind the GPU
bench's "GPU util" column, checked before its figures are trusted.

    python -m bench.gpu_util_probe [--out FILE.json]

Runs phases of known duty (idle, busy, busy a fixed share of each short period) with back-to-back matrix products,
timing the device's busy slices with CUDA events, while bench.common.GpuSampler polls
nvmlDeviceGetUtilizationRates every 50 ms and reads NVML's own sample buffer. Prints, per phase, the true busy share
beside the polled mean (whole phase, and leaving out its first 0.5 s and 1 s) and the buffered samples' mean, and
how long the polled reading takes to follow a step from idle to busy and back: the lag that decides how much of a
slow first round leaks into the steady rounds' mean. Needs a CUDA GPU and nvidia-ml-py.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import numpy as np

from bench.cli import OneLineParser

# (label, seconds, busy share of each period, period in seconds)
PHASES = [("idle", 1.5, 0.0, 0.0), ("busy", 3.0, 1.0, 0.0), ("idle", 3.0, 0.0, 0.0),
          ("duty 50% / 40 ms", 4.0, 0.5, 0.04), ("idle", 2.0, 0.0, 0.0), ("duty 80% / 100 ms", 4.0, 0.8, 0.1),
          ("idle", 2.0, 0.0, 0.0)]


def _mean(values: list[float]) -> float | None:
    return round(float(np.mean(values)), 1) if values else None


def summarise(phases: list[dict], polled: list[tuple[float, int]], raw: dict[int, int]) -> list[dict]:
    """Per phase ({label, t0, t1, busy_s}): the true busy share, the polled and buffered means inside it, and the
    seconds from its start until the polled reading first crosses halfway to its true share."""
    out = []
    for ph in phases:
        t0, t1 = ph["t0"], ph["t1"]
        true = 100.0 * ph["busy_s"] / (t1 - t0)
        inside = [(t, u) for t, u in polled if t0 <= t <= t1]
        buffered = [u for t, u in raw.items() if t0 <= t / 1e6 <= t1]
        before = [u for t, u in polled if t < t0][-1:] or [0]
        half = (before[0] + true) / 2
        crossed = [t - t0 for t, u in inside if (u >= half if true >= before[0] else u <= half)]
        out.append({"phase": ph["label"], "seconds": round(t1 - t0, 2), "true_util": round(true, 1),
                    "polled_mean": _mean([u for _, u in inside]),
                    "polled_mean_after_0.5s": _mean([u for t, u in inside if t >= t0 + 0.5]),
                    "polled_mean_after_1s": _mean([u for t, u in inside if t >= t0 + 1.0]),
                    "raw_mean": _mean(buffered), "raw_samples": len(buffered),
                    "polled_half_step_s": round(crossed[0], 3) if crossed else None})
    return out


def _run_phase(label: str, seconds: float, share: float, period: float) -> dict:
    """Keep the GPU busy `share` of every `period` (or throughout) for `seconds`; the busy time from CUDA events."""
    import torch

    a = torch.randn(2048, 2048, device="cuda")
    busy = 0.0
    t0 = time.time()
    end = t0 + seconds
    while time.time() < end:
        if share <= 0:
            time.sleep(min(0.01, max(0.0, end - time.time())))
            continue
        slice_s = seconds if period <= 0 else share * period
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        stop_at = min(end, time.time() + slice_s)
        while time.time() < stop_at:
            for _ in range(4):
                a = (a @ a).tanh_()
            torch.cuda.synchronize()  # the host follows the device, so the slice ends when its work does
        stop.record()
        stop.synchronize()
        busy += start.elapsed_time(stop) / 1e3
        if period > 0:
            time.sleep(max(0.0, min(end, stop_at + (1 - share) * period) - time.time()))
    return {"label": label, "t0": t0, "t1": time.time(), "busy_s": busy}


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.gpu_util_probe", description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="write the phases, readings and summary here as JSON")
    args = ap.parse_args(argv)
    from bench.common import BenchError, GpuSampler, check_out_file

    try:  # before any GPU phase: a bad --out would otherwise fail after the whole measurement
        if args.out is not None:
            check_out_file(args.out, "--out")
    except BenchError as exc:
        print(f"gpu_util_probe: error: {exc}", file=sys.stderr)
        return 2
    import torch

    if not torch.cuda.is_available():
        print("gpu_util_probe: error: needs a CUDA GPU (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    gpu = GpuSampler()
    if not gpu.active:
        print("gpu_util_probe: error: NVML cannot be read (is nvidia-ml-py installed?)", file=sys.stderr)
        return 2
    torch.randn(8, device="cuda").sum().item()  # the context and the kernels' first load, before any phase
    gpu.start()
    phases = [_run_phase(*p) for p in PHASES]
    gpu.stop()
    polled = [(t, u) for t, u, _ in gpu.samples]
    rows = summarise(phases, polled, gpu.raw)
    stamps = sorted(gpu.raw)
    facts = {"raw_spacing_ms": round(float(np.median(np.diff(stamps))) / 1e3, 1) if len(stamps) > 1 else None,
             "raw_newest_minus_wall_s": round(stamps[-1] / 1e6 - phases[-1]["t1"], 3) if stamps else None,
             "gpu": torch.cuda.get_device_name(0)}
    for r in rows:
        print("PROBE " + json.dumps(r))
    print("PROBE " + json.dumps(facts))
    if args.out is not None:
        Path(args.out).write_text(json.dumps({"facts": facts, "summary": rows, "phases": phases, "polled": polled,
                                        "raw": sorted(gpu.raw.items())}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
