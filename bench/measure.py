"""What every bench program shares that needs no torch: the workload's knobs, reading them back, and measuring a
run (memory of the process tree, GPU utilisation, round times, the RESULT_JSON line). A launcher that only starts
and waits on other processes (pfl's `torchrun` mode) imports this alone, so that it weighs what a plain
interpreter does rather than torch's half a gigabyte."""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import psutil


class BenchError(Exception):
    """A bad input of a bench program (a folder that was never prepared, a damaged file): one line, exit 2."""


@dataclass(frozen=True)
class Workload:
    """Every knob of the FedAvg workload; the prepared folder is named after them."""

    num_clients: int = 100
    clients_per_round: int = 10
    rounds: int = 5
    model: str = "resnet8"
    local_epochs: int = 1
    batch_size: int = 32
    lr: float = 0.01
    momentum: float = 0.9
    alpha: float = 0.5
    partition: str = "dirichlet"  # or "iid": equal shards, as pfl-research's CIFAR-10 benchmark
    seed: int = 0
    data_seed: int = 0
    n_train: int = 20000
    n_test: int = 2000
    amp: float = 3.0
    eval_batch_size: int = 125

    def data_key(self) -> str:
        """Name of the folder holding the image arrays (shared by every workload on the same data)."""
        return f"data-s{self.data_seed}-n{self.n_train}-{self.n_test}-amp{self.amp:g}"

    def key(self) -> str:
        """Name of this workload's folder: the headline knobs plus a digest of all of them."""
        knobs = asdict(self)
        if knobs["partition"] == "dirichlet":  # the knob's first value stays out: older folders keep their names
            del knobs["partition"]
        digest = hashlib.sha1(json.dumps(knobs, sort_keys=True).encode()).hexdigest()[:10]
        return f"{self.model}-N{self.num_clients}-K{self.clients_per_round}-R{self.rounds}-{digest}"

    def with_(self, **kw) -> Workload:
        return Workload(**{**asdict(self), **kw})

    @classmethod
    def from_dict(cls, d: dict) -> Workload:
        kinds = {f.name: type(f.default) for f in fields(cls)}
        if not isinstance(d, dict):
            raise BenchError("workload.json: 'workload' must be a mapping of knobs")
        for key, value in d.items():
            if key not in kinds:
                raise BenchError(f"workload.json: unknown key {key!r}")
            want = (int, float) if kinds[key] is float else kinds[key]
            if not isinstance(value, want) or isinstance(value, bool):
                raise BenchError(f"workload.json: {key} must be of type {kinds[key].__name__}, got {value!r}")
        return cls(**d)


def read_workload(folder: Path) -> Workload:
    """The knobs of a folder written by `python -m bench.prepare` (its workload.json), checked against the name of
    its data folder."""
    meta_path = folder / "workload.json"
    if not meta_path.is_file():
        raise BenchError(f"{folder}: not a prepared bench workload (no workload.json); "
                         "create it with `python -m bench.prepare`")
    try:
        meta = json.loads(meta_path.read_text())
        w = Workload.from_dict(meta["workload"])
        data_name = meta["data"]
    except (ValueError, KeyError, TypeError) as exc:
        raise BenchError(f"{meta_path}: unreadable ({type(exc).__name__}: {exc})") from None
    if not isinstance(data_name, str) or data_name != w.data_key():
        raise BenchError(f"{meta_path}: 'data' must be {w.data_key()!r}, the data folder of its knobs")
    return w


class TreeMemSampler(threading.Thread):
    """Peak of the RSS summed over this process and all its descendants (Ray's daemons and workers), sampled
    every `interval` s by a daemon thread; the process list is refreshed every `rescan_every` samples to stay
    cheap. With `pss_interval` > 0 it also samples PSS (shared pages split between processes), which is costly."""

    def __init__(self, interval: float = 0.25, rescan_every: int = 4, pss_interval: float = 0.0) -> None:
        super().__init__(daemon=True)
        self.interval, self.rescan_every, self.pss_interval = interval, rescan_every, pss_interval
        self.root = psutil.Process(os.getpid())
        self.procs: list[psutil.Process] = []
        self.labels: dict[int, str] = {}
        self.cpu: dict[int, float] = {}
        self.peak_rss = self.peak_pss = self.peak_nproc = self.samples = 0
        self.peak_breakdown: list[tuple[int, str, int]] = []
        self._last_pss = 0.0
        self._halt = threading.Event()

    def _rescan(self) -> None:
        try:
            self.procs = [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            self.procs = []
        self.peak_nproc = max(self.peak_nproc, len(self.procs))
        for p in self.procs:
            try:
                self.labels[p.pid] = (" ".join(p.cmdline()) or p.name())[:90]  # Ray retitles its workers late
                t = p.cpu_times()
                self.cpu[p.pid] = t.user + t.system
            except psutil.Error:
                pass

    def sample(self) -> None:
        if self.samples % self.rescan_every == 0 or not self.procs:
            self._rescan()
        rss = []
        for p in self.procs:
            try:
                rss.append((p, p.memory_info().rss))
            except psutil.Error:
                pass
        total = sum(r for _, r in rss)
        if total > self.peak_rss:
            self.peak_rss = total
            self.peak_breakdown = [(p.pid, self.labels.get(p.pid, "?"), r) for p, r in rss]
        now = time.monotonic()
        if self.pss_interval > 0 and now - self._last_pss >= self.pss_interval:
            self._last_pss = now
            pss = 0
            for p, _ in rss:
                try:
                    pss += p.memory_full_info().pss
                except (psutil.Error, AttributeError):
                    pass
            self.peak_pss = max(self.peak_pss, pss)
        self.samples += 1

    def run(self) -> None:
        while not self._halt.is_set():
            self.sample()
            self._halt.wait(self.interval)

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)
        self._rescan()
        self.sample()

    def cpu_summary(self) -> dict[str, float]:
        """CPU seconds (user + system, as last seen) of this process, of Ray's worker processes, of the rest."""
        out = {"driver": 0.0, "ray_workers": 0.0, "other": 0.0}
        for pid, sec in self.cpu.items():
            kind = "driver" if pid == self.root.pid else \
                "ray_workers" if self.labels.get(pid, "").startswith("ray::") else "other"
            out[kind] = round(out[kind] + sec, 2)
        return out

    def fields(self) -> dict:
        """The memory fields of RESULT_JSON."""
        return {"peak_rss_mb": round(self.peak_rss / 2**20, 1),
                "peak_pss_mb": round(self.peak_pss / 2**20, 1) if self.pss_interval > 0 else None,
                "peak_nproc": self.peak_nproc, "cpu_seconds": self.cpu_summary(),
                "peak_breakdown_mb": [[pid, lab, round(r / 2**20, 1)]
                                      for pid, lab, r in sorted(self.peak_breakdown, key=lambda t: -t[2])][:8]}


class GpuSampler(threading.Thread):
    """GPU utilisation (NVML's share of time a kernel ran) and used memory of the program's first GPU (the first of
    CUDA_VISIBLE_DEVICES, as NVML numbers the GPUs), sampled every `interval` s with wall-clock stamps, so a
    program can average them over its steady rounds. Idle (no samples) without a GPU or without `pynvml`
    (nvidia-ml-py)."""

    def __init__(self, interval: float = 0.05) -> None:
        super().__init__(daemon=True)
        self.interval = interval
        self.samples: list[tuple[float, int, int]] = []  # (time.time(), utilisation %, used bytes)
        self.raw: dict[int, int] = {}  # NVML's own sample buffer: its CPU time stamp (µs) -> utilisation %
        self._halt = threading.Event()
        self._nvml = None
        self._handle = None
        try:
            import pynvml

            pynvml.nvmlInit()
            first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
            self._handle = pynvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-")) else \
                pynvml.nvmlDeviceGetHandleByIndex(int(first) if first.isdigit() else 0)
            self._nvml = pynvml
        except Exception:  # no driver, no GPU or no pynvml: nothing to sample
            self._nvml = None

    @property
    def active(self) -> bool:
        return self._nvml is not None

    def run(self) -> None:
        while self._nvml is not None and not self._halt.is_set():
            try:
                util = self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu
                used = self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used
            except Exception:
                return
            self.samples.append((time.time(), int(util), int(used)))
            self._read_raw()
            self._halt.wait(self.interval)

    def _read_raw(self) -> None:
        """Append NVML's buffered utilisation samples newer than the last one read. Each covers a period far
        shorter than nvmlDeviceGetUtilizationRates' trailing one (up to 1 s), which smears a slow first round
        into the steady window's first readings; none where the driver keeps no such buffer."""
        try:
            last = max(self.raw, default=0)
            _, found = self._nvml.nvmlDeviceGetSamples(self._handle, self._nvml.NVML_GPU_UTILIZATION_SAMPLES, last)
        except Exception:  # no new sample since `last` (NVML_ERROR_NOT_FOUND), or no such buffer on this driver
            return
        for sample in found:
            if sample.timeStamp > last:
                self.raw[int(sample.timeStamp)] = int(sample.sampleValue.uiVal)

    def stop(self) -> None:
        self._halt.set()
        if self.is_alive():
            self.join(timeout=5)

    def fields(self, t0: float | None, t1: float | None) -> dict:
        """Mean utilisation over the wall-clock window [t0, t1] (the steady rounds), by the polled readings and, where
        the driver buffers them, by NVML's own samples; peak memory over the run; empty without samples."""
        if not self.samples:
            return {}
        inside = [u for t, u, _ in self.samples if t0 is not None and t1 is not None and t0 <= t <= t1]
        out = {"gpu_util_mean": round(float(np.mean(inside)), 1) if inside else None,
               "gpu_util_samples": len(inside),
               "gpu_mem_peak_mb": round(max(m for _, _, m in self.samples) / 2**20, 1)}
        if self.raw:
            raw = [u for t, u in self.raw.items() if t0 is not None and t1 is not None and t0 <= t / 1e6 <= t1]
            out.update({"gpu_util_raw_mean": round(float(np.mean(raw)), 1) if raw else None,
                        "gpu_util_raw_samples": len(raw)})
        return out


def steady_window(bounds: list[float]) -> tuple[float | None, float | None]:
    """The wall-clock window of the steady rounds (after the first), from their bounds: each round's end (or, for
    fedsim, the start of the second round to the last one's end); None without two bounds."""
    if len(bounds) >= 2:
        return bounds[0], bounds[-1]
    return None, None


def pss_interval_from_env() -> float:
    """Seconds between PSS samples, from $BENCH_PSS_INTERVAL (0 or unset: PSS is not sampled)."""
    try:
        return max(0.0, float(os.environ.get("BENCH_PSS_INTERVAL", "0") or 0))
    except ValueError:
        raise BenchError(f"BENCH_PSS_INTERVAL: expected seconds, got {os.environ['BENCH_PSS_INTERVAL']!r}") from None


def round_summary(round_times: list[float], samples: list[int], t_start: float, t_done: float) -> dict:
    """Timing fields of RESULT_JSON: steady state = the mean over the rounds after the first."""
    steady = round_times[1:] if len(round_times) > 1 else round_times
    return {"total_seconds": round(t_done - t_start, 3),
            "round_seconds": [round(t, 3) for t in round_times],
            "seconds_per_round": round(float(np.mean(steady)), 3) if steady else None,
            "seconds_per_round_all": round(float(np.mean(round_times)), 3) if round_times else None,
            "round_train_samples": samples,
            "train_samples_per_second": round(sum(samples) / sum(round_times), 1) if sum(round_times) else None,
            "train_samples_per_second_e2e": round(sum(samples) / (t_done - t_start), 1)}


def emit_result(result: dict) -> None:
    """The one line `bench.runner.run_program` reads back."""
    print("RESULT_JSON " + json.dumps(result), flush=True)
