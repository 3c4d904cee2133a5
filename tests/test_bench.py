"""The bench's three programs do the same math on the same prepared files: the plain loop, fedsim and the Flower app."""

from __future__ import annotations

import csv
import json
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from bench import flower_fedavg, plain_fedavg
from bench.common import BenchError, Workload, build_model, load_prepared
from bench.prepare import MODEL_OPTIONS, prepare
from bench.workload import make_config, prepared_inputs
from fedsim.data.partition import partition
from fedsim.data.synthetic import make_synthetic
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.runtime.setup import client_seed
from tests.conftest import ROOT
from tests.forked import run_module

# tiny versions of configs C (the MLP) and A (ResNet-8, BatchNorm buffers)
TINY = {
    "mlp": Workload(num_clients=6, clients_per_round=3, rounds=3, model="mlp", n_train=600, n_test=100),
    "resnet8": Workload(num_clients=5, clients_per_round=2, rounds=2, model="resnet8", n_train=300, n_test=60),
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-cache")


def test_prepared_files_are_fedsims_pieces_and_deterministic(cache, tmp_path):
    w = TINY["mlp"]
    p = load_prepared(prepare(w, cache))
    x_tr, y_tr, x_te, y_te = make_synthetic(w.n_train, w.n_test, seed=w.data_seed, amp=w.amp)
    assert np.array_equal(p.x_train, x_tr) and np.array_equal(p.y_train, y_tr)
    assert np.array_equal(p.x_test, x_te) and np.array_equal(p.y_test, y_te)
    parts = partition(y_tr, w.num_clients, "dirichlet", w.seed, alpha=w.alpha, min_samples=1)
    assert all(np.array_equal(p.shard(c), parts[c]) for c in range(w.num_clients))
    for r in range(w.rounds):
        drawn = [c for c, _ in p.round_clients(r)]
        assert drawn == sorted(set(drawn)) and len(drawn) == w.clients_per_round
        assert [s for _, s in p.round_clients(r)] == [client_seed(w.seed, r, c, 0) for c in drawn]
    assert len({tuple(p.draws[r]) for r in range(w.rounds)}) > 1  # rounds draw different clients
    again = load_prepared(prepare(w, tmp_path))
    assert np.array_equal(again.draws, p.draws) and np.array_equal(again.flat, p.flat)
    init, init2 = p.initial_state(), again.initial_state()
    assert init.keys() == init2.keys() and all(torch.equal(init[k], init2[k]) for k in init)
    assert prepare(w.with_(seed=1), cache) != p.folder  # every knob names its own folder


def test_a_folder_prepared_with_other_client_seeds_is_prepared_again(tmp_path):
    w = TINY["mlp"]
    folder = prepare(w, tmp_path)
    good = np.load(folder / "seeds.npy")
    np.save(folder / "seeds.npy", good + 1)  # as an older fedsim, deriving other seeds, would have left it
    messages: list[str] = []
    assert prepare(w, tmp_path, messages.append) == folder
    assert np.array_equal(np.load(folder / "seeds.npy"), good)
    assert any("other client seeds" in m for m in messages)
    assert prepare(w, tmp_path, messages.append) == folder and len(messages) == 2  # current: reused as is


@pytest.mark.parametrize("arch", ["mlp", "resnet8", "cnn"])
def test_bench_models_are_fedsims(arch):
    """Same parameter and buffer names, shapes and dtypes; the same state dict gives the same outputs."""
    from fedsim.models import build_model as fedsim_model

    torch.manual_seed(0)
    ours, theirs = build_model(arch), fedsim_model(arch, 3, 10, 32, **MODEL_OPTIONS[arch])
    spec = lambda m: [(k, tuple(v.shape), v.dtype) for k, v in m.state_dict().items()]  # noqa: E731
    assert spec(ours) == spec(theirs)
    ours.load_state_dict(theirs.state_dict())
    x = torch.randn(8, 3, 32, 32)
    for train in (False, True):  # eval mode, then train mode (batch statistics, running buffers updated)
        ours.train(train)
        theirs.train(train)
        assert torch.equal(ours(x), theirs(x))
    assert all(torch.equal(a, b) for a, b in zip(ours.state_dict().values(), theirs.state_dict().values()))


def fedsim_run(folder, w: Workload, root):
    """fedsim's one driver on the prepared folder: local backend, two workers, one thread each; the final global
    model as its last checkpoint holds it, and the run's tables."""
    from fedsim.persist.checkpoint import load_run_checkpoint

    cfg = make_config(w, [f"results.root={root}", "runtime.backend=local", "runtime.threads=1"])
    run_dir = run(cfg, LocalBackend(num_workers=2), inputs=prepared_inputs(cfg, folder))
    state = load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["server_state"]
    return state.models[w.model], load(run_dir)


@pytest.mark.parametrize("arch", ["mlp", "resnet8"])
def test_plain_loop_and_fedsim_do_the_same_math(arch, cache, tmp_path):
    w = TINY[arch]
    folder = prepare(w, cache)
    plain = plain_fedavg.run(load_prepared(folder), threads=1, log=lambda m: None)
    state, tables = fedsim_run(folder, w, tmp_path)
    rounds, clients = tables["rounds"], tables["clients"]
    assert rounds["accuracy"].tolist() == plain.accuracy  # every round, not only the last
    assert rounds["loss"].tolist() == pytest.approx(plain.loss, rel=1e-6)
    assert state.keys() == plain.state.keys()
    for k, v in state.items():
        assert v.dtype == plain.state[k].dtype, k
        torch.testing.assert_close(v, plain.state[k], rtol=1e-6, atol=1e-7, msg=k)
    p = load_prepared(folder)
    if arch == "resnet8":  # BatchNorm: running statistics averaged, the batch counter kept an integer
        assert state["stem.1.num_batches_tracked"].dtype == torch.int64
        assert not torch.equal(state["stem.1.running_mean"], p.initial_state()["stem.1.running_mean"])
    for r in range(w.rounds):  # fedsim trained exactly the prepared draw, each on its whole shard
        got = clients[clients["round"] == r]
        assert got["client"].tolist() == p.draws[r].tolist() and (got["status"] == "ok").all()
        assert got["samples"].tolist() == [len(p.shard(c)) for c in p.draws[r]]
    assert plain.samples == [int(p.shard_sizes()[p.draws[r]].sum()) for r in range(w.rounds)]


@pytest.mark.parametrize("arch", ["mlp", "resnet8"])
def test_flower_app_pieces_reproduce_the_plain_loop(arch, cache):
    """The Flower app's server round (its draw and message configs, the ClientApp's training, its average, its
    central evaluation), driven here without flwr, ends on the plain loop's weights and accuracies."""
    w = TINY[arch]
    p = load_prepared(prepare(w, cache))
    plain = plain_fedavg.run(p, threads=1, log=lambda m: None)
    state, evaluation, accs = p.initial_state(), flower_fedavg.CentralEvaluation(p), []
    for server_round in range(1, w.rounds + 1):  # Flower counts rounds from 1
        plan = flower_fedavg.train_configs(p, server_round, threads=1)
        assert [cid for cid, _ in plan] == p.draws[server_round - 1].tolist()
        for _, cfg in plan:  # what a ConfigRecord holds: str and int64 values only
            assert all(isinstance(v, (str, int)) and (not isinstance(v, int) or abs(v) < 2**63) for v in cfg.values())
        results = []
        for cid, cfg in reversed(plan):  # replies arrive in any order
            new, n, _ = flower_fedavg.client_train(state, cfg)
            results.append((cid, new, n))
        state = flower_fedavg.aggregate(results)
        accs.append(evaluation(state)[0])
    assert accs == plain.accuracy
    assert all(torch.equal(state[k], plain.state[k]) for k in plain.state)


def test_damaged_or_missing_files_are_named(cache, tmp_path):
    with pytest.raises(BenchError, match="not a prepared bench workload"):
        load_prepared(tmp_path)
    folder = prepare(TINY["mlp"], cache)
    bad = tmp_path / folder.name
    bad.mkdir()
    for f in folder.iterdir():
        (bad / f.name).write_bytes(f.read_bytes())
    (tmp_path / TINY["mlp"].data_key()).symlink_to(cache / TINY["mlp"].data_key())
    np.save(bad / "draws.npy", np.zeros((1, 1), np.int64))
    with pytest.raises(BenchError, match=r"draws\.npy does not match workload\.json"):
        load_prepared(bad)
    (bad / "init.pt").write_bytes(b"not a weights file")
    np.save(bad / "draws.npy", np.load(folder / "draws.npy"))
    with pytest.raises(BenchError, match=r"init\.pt: not a weights file"):
        load_prepared(bad).initial_state()
    meta = json.loads((folder / "workload.json").read_text())
    for change, message in [({"workload": {**meta["workload"], "num_clients": "6"}}, "num_clients must be of type int"),
                            ({"workload": {**meta["workload"], "extra": 1}}, "unknown key 'extra'"),
                            ({"data": "../elsewhere"}, "'data' must be 'data-s0-n600-100-amp3'")]:
        (bad / "workload.json").write_text(json.dumps({**meta, **change}))
        with pytest.raises(BenchError, match=re.escape(message)):
            load_prepared(bad)
    with pytest.raises(BenchError, match="--clients-per-round"):
        prepare(TINY["mlp"].with_(clients_per_round=7), cache)


def test_bench_cli_refuses_bad_knobs_before_running_anything(tmp_path, monkeypatch, capsys):
    from bench import fedavg_bench, report

    monkeypatch.setattr(report, "OUT", tmp_path / "out")
    assert fedavg_bench.main(["--configs", "C", "--rounds", "0", "--systems", "plain", "--cache", str(tmp_path)]) == 2
    assert fedavg_bench.main(["--configs", "C", "--systems", "plain,nope", "--cache", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["bench.fedavg_bench: error: --rounds: must be from 1 to 1000000, got 0",
                   "bench.fedavg_bench: error: --systems: unknown system 'nope'; choose from plain, plain_t1, "
                   "fedsim_local, fedsim_dp, fedsim_ray, flower, pfl, pfl_multiprocess, ray_floor, fedsim_fedadam, "
                   "fedsim_1w, "
                   "flower_2c"]
    assert not (tmp_path / "out").exists() and list(tmp_path.iterdir()) == []  # nothing prepared, nothing run


def test_program_on_an_unprepared_folder_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "bench.plain_fedavg", "--workload", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0 and "not a prepared bench workload" in proc.stderr


@pytest.mark.slow
def test_bench_matrix_runs_the_programs_and_reads_their_results(cache, tmp_path, monkeypatch):
    """bench.report.run_matrix: each system as its own process on one prepared folder, RESULT_JSON read back."""
    from bench import report

    monkeypatch.setattr(report, "OUT", tmp_path)
    dropped: list[list] = []  # asked for, not done: the venvs' libraries dropped from the page cache would be read
    # from disk again by every test process's next torch import
    monkeypatch.setattr(report, "drop_cached_libraries", lambda venvs, log: dropped.append(venvs) or 0)
    df = report.run_matrix({"T": TINY["mlp"]}, ["plain_t1", "fedsim"], 1,
                           ["--backend", "local", "-o", f"results.root={tmp_path / 'runs'}", "-o", "runtime.threads=1"],
                           "t", cache=cache, log=lambda m: None)
    assert dropped == [[Path(sys.prefix), report.FLOWER_VENV, report.PFL_VENV]]
    assert df["status"].tolist() == ["ok", "ok"], df["log"].tolist()
    assert df["system"].tolist() == ["plain_t1", "fedsim"]
    assert df["final_accuracy"].iloc[0] == df["final_accuracy"].iloc[1]
    assert (df["R"] == 3).all() and (df["peak_rss_mb"] > 0).all() and (df["seconds_per_round"] > 0).all()


def test_every_venvs_shared_libraries_are_dropped_from_the_page_cache(tmp_path):
    """Before the timed runs, the bench advises the kernel to drop each venv's shared libraries (`.so`, `.so.N`,
    extension modules) and nothing else; a venv that is not there is skipped."""
    from bench.runner import drop_cached_libraries

    site = tmp_path / "v" / "lib" / "python3.11" / "site-packages"
    for name in ("torch/lib/libtorch_cpu.so", "nvidia/cu13/lib/libnvrtc.so.13", "ray/_raylet.cpython-311.so",
                 "pkg/notes.sofa", "pkg/data.so.d/inside.txt", "pkg/module.py"):
        (site / name).parent.mkdir(parents=True, exist_ok=True)
        (site / name).write_bytes(b"\0" * 4096)
    said: list[str] = []
    assert drop_cached_libraries([tmp_path / "v", tmp_path / "absent"], said.append) == 3
    assert said == ["dropped 3 shared libraries of 2 venvs from the page cache"]


def test_workload_partition_knob_keeps_older_folder_names_and_iid_gives_equal_shards(tmp_path):
    """The partition knob's first value (Dirichlet) stays out of the folder's digest, so folders prepared before the
    knob existed keep their names; iid (pfl-research's CIFAR-10 shape) gives every client the same shard size."""
    import hashlib
    from dataclasses import asdict

    w = TINY["mlp"]
    before = {k: v for k, v in asdict(w).items() if k != "partition"}
    digest = hashlib.sha1(json.dumps(before, sort_keys=True).encode()).hexdigest()[:10]
    assert w.key() == f"mlp-N6-K3-R3-{digest}"
    iid = w.with_(partition="iid")
    assert iid.key() != w.key()
    p = load_prepared(prepare(iid, tmp_path))
    assert p.shard_sizes().tolist() == [100] * 6
    assert sorted(p.flat.tolist()) == list(range(600))  # every image once
    with pytest.raises(BenchError, match="--partition: unknown partition 'shards'"):
        prepare(w.with_(partition="shards"), tmp_path)


def test_gpu_sampler_averages_over_the_steady_window_and_is_idle_without_nvml(monkeypatch):
    from types import SimpleNamespace

    from bench.common import GpuSampler, steady_window

    monkeypatch.setitem(sys.modules, "pynvml", None)  # no nvidia-ml-py: nothing is sampled, no fields
    idle = GpuSampler()
    assert not idle.active and idle.fields(0.0, 1.0) == {}
    idle.start()
    idle.stop()
    assert idle.samples == []
    readings = iter([(40, 3 * 2**20), (90, 5 * 2**20)])

    def utilisation(handle):
        util, _ = next(readings)
        return SimpleNamespace(gpu=util)

    fake = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
                           nvmlDeviceGetUtilizationRates=utilisation,
                           nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=7 * 2**20))
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # GPU 0 as NVML numbers them
    gpu = GpuSampler()
    assert gpu.active
    gpu.samples = [(1.0, 10, 2**20), (2.0, 40, 3 * 2**20), (3.0, 90, 5 * 2**20), (4.0, 0, 2**20)]
    assert steady_window([1.5, 2.5, 3.5]) == (1.5, 3.5) and steady_window([1.5]) == (None, None)
    fields = gpu.fields(*steady_window([1.5, 2.5, 3.5]))
    assert fields == {"gpu_util_mean": 65.0, "gpu_util_samples": 2, "gpu_mem_peak_mb": 5.0}
    assert gpu.fields(None, None)["gpu_util_mean"] is None
    gpu.samples = []
    gpu.run()  # samples until the fake runs out of readings (an NVML error ends the thread quietly)
    assert [u for _, u, _ in gpu.samples] == [40, 90]
    assert gpu.raw == {}  # a driver without a sample buffer: no raw fields, the polled ones as before


def test_gpu_sampler_reads_nvml_sample_buffer_once_per_sample_and_averages_it_over_the_window(monkeypatch):
    from types import SimpleNamespace

    from bench.common import GpuSampler

    def sample(stamp_s: float, util: int) -> SimpleNamespace:
        return SimpleNamespace(timeStamp=int(stamp_s * 1e6), sampleValue=SimpleNamespace(uiVal=util))

    buffer = [sample(0.9, 0), sample(1.6, 70), sample(2.0, 90), sample(2.4, 100), sample(3.6, 5)]
    asked: list[int] = []

    def get_samples(handle, kind, last_seen):
        assert kind == 1
        asked.append(last_seen)
        newer = [s for s in buffer if s.timeStamp > last_seen]
        if not newer:
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return 1, newer[:2]  # the buffer hands back at most two at a time here

    readings = iter([20, 30, 40, 50])
    fake = SimpleNamespace(nvmlInit=lambda: None, nvmlDeviceGetHandleByIndex=lambda i: "gpu0",
                           nvmlDeviceGetUtilizationRates=lambda h: SimpleNamespace(gpu=next(readings)),
                           nvmlDeviceGetMemoryInfo=lambda h: SimpleNamespace(used=2**20),
                           nvmlDeviceGetSamples=get_samples, NVML_GPU_UTILIZATION_SAMPLES=1)
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    gpu = GpuSampler(interval=0.0)
    gpu.run()  # four polls, then the fake's readings run out
    assert asked == [0, int(1.6e6), int(2.4e6), int(3.6e6)]  # each poll asks only for what is newer
    assert sorted(gpu.raw.values()) == [0, 5, 70, 90, 100]
    fields = gpu.fields(1.5, 2.5)
    assert fields["gpu_util_raw_mean"] == pytest.approx((70 + 90 + 100) / 3, abs=0.05)
    assert fields["gpu_util_raw_samples"] == 3
    assert fields["gpu_util_mean"] is None  # the polled readings were stamped now, outside this window


@pytest.mark.slow
def test_gpu_bench_runs_every_program_on_the_cpu_and_writes_its_table(tmp_path, capsys):
    """`python -m bench.gpu_bench --device cpu` on a tiny pfl-shaped workload: the plain loop and fedsim, one client
    after another and batched, each its own process; the same math (the plain loop's accuracy); the table, JSON and
    CSV written."""
    from bench import gpu_bench

    out = tmp_path / "out"
    rc = gpu_bench.main(["--configs", "P", "--rounds", "2", "--n-train", "1000", "--n-test", "100", "--device", "cpu",
                         "--clients-per-round", "20", "--systems", "plain,fedsim_seq,fedsim_batched",
                         "--out", str(out), "--cache", str(tmp_path / "cache"), "--timeout", "600"])
    assert rc == 0
    runs = json.loads((out / "gpu.json").read_text())["runs"]
    assert [r["system"] for r in runs] == ["plain", "fedsim_seq", "fedsim_batched"]
    assert [r["status"] for r in runs] == ["ok"] * 3, [r["log"] for r in runs]
    plain, seq, batched = runs
    assert seq["final_accuracy"] == plain["final_accuracy"]  # the same math, as on the GPU
    assert abs(batched["final_accuracy"] - seq["final_accuracy"]) <= 0.02  # batched: to float rounding
    assert (seq["batch_clients"], batched["batch_clients"]) == ("False", "True")
    assert (seq["clients_batched"], batched["clients_batched"]) == (0, 2 * 20)  # batched: every client step
    assert all(r["R"] == 2 and r["K"] == 20 and r["model"] == "cnn" and r["seconds_per_round"] > 0 for r in runs)
    assert all("gpu_util_mean" not in r for r in runs)  # no GPU here: no utilisation is claimed
    md = (out / "gpu.md").read_text()
    assert "| P: N=1000, K=20, R=2, cnn, batch 10 | fedsim local, batched |" in md
    assert len((out / "gpu.csv").read_text().splitlines()) == 4
    assert len(list((out / "gpu-runs").iterdir())) == 2  # fedsim's two run folders, beside the outputs
    check_same_numbers(out / "gpu.json", capsys)


def check_same_numbers(gpu_json: Path, capsys) -> None:
    """bench.same_numbers on a gpu_bench run: the pair that must agree does (both tables), a changed value is named,
    and input that is not a gpu.json is one line with exit 2. The Ray run (a GPU's) is stood in for by a copy of
    the one-process run's folder."""
    import shutil

    from bench import same_numbers

    bench = json.loads(gpu_json.read_text())
    seq = next(r for r in bench["runs"] if r["system"] == "fedsim_seq")
    twin = Path(seq["run_dir"]).with_name("ray-twin")
    shutil.copytree(seq["run_dir"], twin)
    bench["runs"].append({**seq, "system": "fedsim_ray_seq", "run_dir": str(twin)})
    gpu_json.write_text(json.dumps(bench))
    capsys.readouterr()  # the bench's own output
    assert same_numbers.main([str(gpu_json)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["P fedsim_seq vs fedsim_ray_seq rounds.parquet: 2 rows, 14 columns: IDENTICAL",
                     "P fedsim_seq vs fedsim_ray_seq clients.parquet: 40 rows, 11 columns: IDENTICAL"]
    table = twin / "clients.parquet"
    clients = pd.read_parquet(table)
    clients.loc[3, "train_loss"] += 1e-6
    clients.to_parquet(table)
    assert same_numbers.main([str(gpu_json)]) == 1
    assert capsys.readouterr().out.splitlines()[1].endswith("40 rows, 11 columns: DIFFER in train_loss")
    assert same_numbers.main([str(table)]) == 2
    err = capsys.readouterr().err
    assert err == f"python -m bench.same_numbers: error: {table}: not a gpu.json of bench.gpu_bench\n"


def test_gpu_bench_render_rewrites_a_results_table_from_its_json_alone(tmp_path, capsys):
    """--render writes the .md and .csv of a saved gpu JSON under its own name (running nothing), with the
    utilisation to a tenth of a percent (79.5 is not shown as 80); a file that is not one exits 2 in one line."""
    from bench import gpu_bench

    run = {"config": "P", "system": "fedsim_ray_seq", "status": "ok", "R": 12, "seconds_per_round": 0.341,
           "round_seconds": [1.119, 0.3], "total_seconds": 25.93, "gpu_util_mean": 79.5, "gpu_util_raw_mean": 78.94,
           "gpu_mem_peak_mb": 8465.0, "final_accuracy": 0.1966}
    older = {**run, "config": "C", "system": "fedsim_seq", "R": 5, "K": 200, "round_seconds": [6.297, 0.3]}
    del older["gpu_util_raw_mean"]  # a run from before the sampler read NVML's buffer
    failed = {"config": "B", "system": "plain", "status": "timeout", "log": "gpu-logs/B-plain.log"}
    meta = {"command": "python -m bench.gpu_bench --configs P,B", "date": "2026-11-27 13:59", "machine": "vm",
            "cpus": 16, "gpu": "NVIDIA H100 80GB HBM3",
            "versions": {"torch": "2.11.0", "pfl": "0.6.0", "ray": "2.60.0"}}
    saved = tmp_path / "gpu_old.json"
    saved.write_text(json.dumps({**meta, "runs": [run, failed, older]}))
    assert gpu_bench.main(["--render", str(saved)]) == 0
    md = (tmp_path / "gpu_old.md").read_text()
    assert "Command: `python -m bench.gpu_bench --configs P,B`" in md and "Measured 2026-11-27 13:59 on vm" in md
    assert "| P: N=1000, K=50, R=12, cnn, batch 10 | fedsim Ray 4 × 0.25 GPU, one after another | 0.341 | 1.12 | " \
           "25.9 | 79.5 | 78.9 | 8465 | 0.197 | n/a |" in md
    assert "| C: N=10000, K=200, R=5, mlp, batch 32 | fedsim local, one after another | 0.341 | 6.30 | 25.9 | 79.5 | " \
           "n/a | 8465 | 0.197 | n/a |" in md
    assert "| B: N=1000, K=50, R=3, resnet8, batch 32 | plain loop | failed (timeout; log " \
           "`gpu-logs/B-plain.log`) |" in md
    rows = list(csv.DictReader((tmp_path / "gpu_old.csv").open()))
    assert len(rows) == 3 and [r["first_round_s"] for r in rows] == ["1.119", "", "6.297"]  # the table's columns
    assert not (tmp_path / "gpu.md").exists()  # the saved run's own name, never the current table's
    (tmp_path / "bad.json").write_text("{}")
    assert gpu_bench.main(["--render", str(tmp_path / "bad.json")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"bench.gpu_bench: error: --render {tmp_path / 'bad.json'}: not a gpu")


def test_gpu_bench_rounds_apply_to_every_config_or_to_those_named():
    from bench import gpu_bench

    assert gpu_bench.rounds_arg("12") == {"": 12}
    assert gpu_bench.rounds_arg("p=12, B=5") == {"P": 12, "B": 5}
    assert gpu_bench._rounds_of("B", {"P": 12, "B": 5}) == {"rounds": 5}
    assert gpu_bench._rounds_of("C", {"P": 12, "B": 5}) == {}  # C keeps its own rounds
    assert gpu_bench._rounds_of("C", {"": 7}) == {"rounds": 7}


def test_gpu_bench_refuses_bad_arguments_in_one_line_before_preparing_anything(tmp_path, capsys):
    from bench import gpu_bench

    common = ["--out", str(tmp_path / "out"), "--cache", str(tmp_path / "cache")]
    assert gpu_bench.main(["--configs", "P,Q", "--device", "cpu", *common]) == 2
    assert gpu_bench.main(["--systems", "plain,flower", "--device", "cpu", *common]) == 2
    assert gpu_bench.main(["--configs", "C", "--rounds", "0", "--device", "cpu", *common]) == 2
    assert gpu_bench.main(["--configs", "A,C", "--n-train", "5000", "--device", "cpu", *common]) == 2  # C's 10,000
    if not torch.cuda.is_available():
        assert gpu_bench.main(["--configs", "C", *common]) == 2
    assert gpu_bench.main(["--configs", "P,C", "--rounds", "P=3,Q=2", "--device", "cpu", *common]) == 2
    assert gpu_bench.main(["--configs", "P,C", "--rounds", "P=3,C=0", "--device", "cpu", *common]) == 2
    assert gpu_bench.main(["--configs", "P", "--clients-per-round", "2000", "--device", "cpu", *common]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-3:] == ["bench.gpu_bench: error: --rounds: config 'Q' is not among --configs P,C",
                        "bench.gpu_bench: error: --rounds: must be >= 1, got 0",
                        "bench.gpu_bench: error: --clients-per-round: 2000 is more than the 1000 clients"]
    for bad in ("P=x", "12,P=3"):
        with pytest.raises(SystemExit) as exc:
            gpu_bench.main(["--rounds", bad, "--device", "cpu", *common])
        assert exc.value.code == 2
    assert capsys.readouterr().err.count("bench.gpu_bench: error: argument --rounds: ") == 2
    assert err[:4] == ["bench.gpu_bench: error: --configs: unknown config 'Q'; choose from P, A, B, C",
                       "bench.gpu_bench: error: --systems: unknown system 'flower'; choose from plain, pfl, pfl_2proc, "
                       "fedsim_seq, fedsim_batched, fedsim_ray_seq, fedsim_ray_batched",
                       "bench.gpu_bench: error: --rounds: must be >= 1, got 0",
                       "bench.gpu_bench: error: --num-clients: 10000 clients need at least 10000 training images, "
                       "--n-train is 5000"]
    assert all(line.startswith("bench.gpu_bench: error: ") for line in err)
    assert not (tmp_path / "out").exists() and not (tmp_path / "cache").exists()  # nothing prepared or written


def test_fedsim_program_profiles_the_rounds_asked_for(cache, tmp_path, capsys):
    """`--profile-rounds 2:3` records those rounds only (set-up and round 1 left out): its operator table goes to
    the file and its totals into RESULT_JSON; without a GPU the device figures are zero."""
    from bench import fedsim_fedavg

    folder = prepare(TINY["mlp"], cache)
    out = tmp_path / "profile.txt"
    code = fedsim_fedavg.main(["--workload", str(folder), "--backend", "local", "--profile-rounds", "2:3",
                               "--profile-out", str(out), "-o", f"results.root={tmp_path / 'runs'}"])
    assert code == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT_JSON "))
    got = json.loads(line.removeprefix("RESULT_JSON "))
    assert got["profile_rounds"] == [2, 3] and 0 < got["profile_wall_s"] < got["total_seconds"]
    assert got["profile_aten_ops"] > 0 and "aten::" in out.read_text() and "Self CPU" in out.read_text()
    assert got["profile_device_busy_s"] == 0 and got["profile_kernel_launches"] == got["profile_device_waits"] == 0


def test_the_profile_counts_each_kernel_once():
    """An operator's self device time repeats its kernels' time: the device's busy time is the kernel rows' sum."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.fedsim_fedavg import device_busy_seconds

    events = [SimpleNamespace(key="aten::conv2d", self_device_time_total=700.0, device_type=DeviceType.CPU),
              SimpleNamespace(key="implicit_sgemm", self_device_time_total=500.0, device_type=DeviceType.CUDA),
              SimpleNamespace(key="elementwise_kernel", self_device_time_total=200.0, device_type=DeviceType.CUDA),
              SimpleNamespace(key="Memcpy HtoD", self_device_time_total=50.0, device_type=DeviceType.CUDA),
              SimpleNamespace(key="cudaLaunchKernel", self_device_time_total=0.0, device_type=DeviceType.CPU)]
    assert device_busy_seconds(events) == pytest.approx(750e-6)


def test_the_profile_totals_count_launches_waits_and_copies_from_the_events():
    """The device-side totals stay 0 on a CPU run, so they are checked here on events a GPU run records."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    from bench.fedsim_fedavg import profile_fields

    def ev(key: str, count: int, device_us: float = 0.0, kind: DeviceType = DeviceType.CPU) -> SimpleNamespace:
        return SimpleNamespace(key=key, count=count, self_device_time_total=device_us, device_type=kind)

    events = [ev("aten::conv2d", 30, 900.0), ev("aten::add_", 12), ev("cudaLaunchKernel", 40), ev("cuLaunchKernel", 2),
              ev("cudaStreamSynchronize", 3), ev("cudaEventSynchronize", 1), ev("cudaMemcpyAsync", 9),
              ev("Memcpy HtoD (Pageable -> Device)", 5, 100.0, DeviceType.CUDA),
              ev("Memcpy HtoD (Pinned -> Device)", 2, 50.0, DeviceType.CUDA),
              ev("implicit_sgemm", 30, 850.0, DeviceType.CUDA)]
    got = profile_fields(events, wall=0.004, first=3, last=5)
    assert got == {"profile_rounds": [3, 5], "profile_wall_s": 0.004, "profile_device_busy_s": 0.001,
                   "profile_device_busy": 0.25, "profile_aten_ops": 42, "profile_kernel_launches": 42,
                   "profile_device_waits": 4, "profile_host_to_device_copies": 7}


@pytest.mark.parametrize("args, message", [
    (["--profile-rounds", "2:9"], "the workload has 3 rounds"),
    (["--profile-rounds", "2:9", "--backend", "ray"], "needs --backend local"),
    (["--profile-rounds", "3:2"], "1 <= FIRST <= LAST"),
    (["--profile-rounds", "x"], "expected FIRST:LAST"),
    (["--profile-rounds", "1:2", "--profile-out", "/nonexistent/dir/p.txt"], "its folder does not exist"),
])
def test_fedsim_program_refuses_a_bad_profile_request_in_one_line(cache, tmp_path, args, message):
    folder = prepare(TINY["mlp"], cache)
    backend = [] if "--backend" in args else ["--backend", "local"]
    proc = run_module("bench.fedsim_fedavg", ["--workload", str(folder), *backend, *args, "-o",
                                              f"results.root={tmp_path}"])
    assert proc.returncode == 2, proc.stderr
    assert "fedsim_fedavg: error: " in proc.stderr and message in proc.stderr
    assert proc.stderr.strip().count("\n") == 0  # one line: no usage, no traceback
    assert not any(tmp_path.iterdir())  # no run folder left behind


def test_batch_host_cost_times_the_batched_phase_and_its_trainer(capsys):
    from bench import batch_host_cost

    assert batch_host_cost.main(["--clients", "6", "--phases", "2"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT_JSON "))
    got = json.loads(line.removeprefix("RESULT_JSON "))
    assert got["clients"] == 6 and got["phases"] == 2 and got["model"] == "mlp"
    assert 0 < got["train_together_ms"] < got["phase_ms"]  # the trainer ran, inside the phase
    assert got["trained_together"] == 6 * 3  # every client of every phase, the first included, trained together
    assert got["first_phase_ms"] > 0
    assert batch_host_cost.main(["--clients", "3", "--phases", "1", "--model", "cnn"]) == 0
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith("RESULT_JSON "))
    got = json.loads(line.removeprefix("RESULT_JSON "))
    assert got["model"] == "cnn" and 0 < got["train_together_ms"] < got["phase_ms"] and got["trained_together"] == 3 * 2
    import fedsim.runtime.batching as batching
    from fedsim.training.batched import train_together

    assert batching.train_together is train_together  # put back
    assert batch_host_cost.main(["--clients", "0"]) == 2
    assert capsys.readouterr().err.strip() == "batch_host_cost: error: --clients and --phases must be at least 1"


def test_gpu_util_probe_summary_sets_each_reading_beside_the_true_busy_share():
    from bench.gpu_util_probe import summarise

    phases = [{"label": "idle", "t0": 0.0, "t1": 2.0, "busy_s": 0.0},
              {"label": "busy", "t0": 2.0, "t1": 4.0, "busy_s": 1.9}]
    # a polled reading that trails the step by about 0.6 s, and a buffer that follows it at once
    polled = [(0.5, 0), (1.5, 0), (2.25, 0), (2.5, 20), (2.75, 60), (3.0, 95), (3.5, 95), (3.9, 95)]
    raw = {int(t * 1e6): u for t, u in [(1.0, 0), (1.9, 0), (2.2, 95), (2.8, 95), (3.4, 95)]}
    idle, busy = summarise(phases, polled, raw)
    assert idle["true_util"] == 0.0 and idle["polled_mean"] == 0.0 and idle["raw_samples"] == 2
    assert busy["true_util"] == 95.0
    assert busy["polled_mean"] == pytest.approx((0 + 20 + 60 + 95 * 3) / 6, abs=0.05)
    assert busy["polled_mean_after_0.5s"] == pytest.approx((20 + 60 + 95 * 3) / 5, abs=0.05)
    assert busy["polled_mean_after_1s"] == 95.0 and busy["raw_mean"] == 95.0
    assert busy["polled_half_step_s"] == 0.75  # first reading at or past halfway (47.5) from 0 to 95


def test_gpu_util_probe_without_a_gpu_says_so_in_one_line(capsys, monkeypatch):
    import torch

    from bench.gpu_util_probe import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)  # as on a machine without one
    assert main([]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gpu_util_probe: error: needs a CUDA GPU (torch.cuda.is_available() is False)"]


def test_proc_memory_names_each_processs_private_library_and_shared_pages_at_the_peak(capsys):
    from bench import proc_memory

    child = "import time; b = bytearray(80 * 2**20); time.sleep(1.5)"  # 80 MB written: private pages
    code = proc_memory.main(["--every", "0.1", "--", sys.executable, "-c", child])
    out = capsys.readouterr().out.splitlines()
    assert code == 0 and out[0].startswith("exit 0; peak RSS ") and out[1].split() == [
        "RSS", "private", "library", "shared", "command"]
    rss, private, library, shared = (int(v) for v in out[2].split()[:4])
    assert private >= 80 and rss == private + library + shared and "bytearray" in out[2]

    assert proc_memory.main(["--every", "0.1", "--maps", "2", "--", sys.executable, "-c", child]) == 0
    out = capsys.readouterr().out.splitlines()
    assert "bytearray" in out[2] and len(out) == 5  # the process, then its two largest mappings
    largest = [line.split(maxsplit=1) for line in out[3:]]
    assert float(largest[0][0]) >= 80 and largest[0][1] in ("[anon]", "[heap]")  # the 80 MB written
    assert float(largest[0][0]) >= float(largest[1][0]) > 0


@pytest.mark.parametrize("argv, message", [
    (["--every", "0", "--", "true"], "bench.proc_memory: error: --every: must be > 0, got 0.0"),
    (["--maps", "-1", "--", "true"], "bench.proc_memory: error: --maps: must be >= 0, got -1"),
    (["--", "/no/such/program"],
     "bench.proc_memory: error: /no/such/program: cannot start (No such file or directory)"),
])
def test_proc_memory_refuses_bad_arguments_in_one_line(argv, message, capsys):
    from bench import proc_memory

    with pytest.raises(SystemExit) as exit_:
        proc_memory.main(argv)
    assert exit_.value.code == 2 and capsys.readouterr().err == message + "\n"


def test_robust_bench_hands_flower_the_same_updates_and_times_fedsims_server_path(tmp_path):
    """bench.robust_bench's two sides without Flower: the saved rows come back as Flower's per-layer `results`, and
    fedsim's timed path (the clients' updates stacked, then the rule) gives the rule's aggregate; the table renders."""
    import argparse

    import torch

    from bench import flower_robust, robust_bench
    from fedsim.transforms import robust

    shapes = [(2, 3), (4,), (1, 1, 2, 2)]
    d = sum(int(np.prod(s)) for s in shapes)
    rows, weights = robust_bench.updates(12, d)
    path = tmp_path / "u.npz"
    np.savez(path, rows=rows, shapes=np.array([list(s) + [0] * (4 - len(s)) for s in shapes]), weights=weights)
    results = flower_robust.results_of(str(path))
    assert [tuple(a.shape) for a in results[3][0]] == shapes and results[3][1] == weights[3]
    np.testing.assert_array_equal(np.concatenate([a.ravel() for a in results[3][0]]), rows[3])
    cuts = np.cumsum([0, *[int(np.prod(s)) for s in shapes]])
    held = [{f"e{i}": torch.from_numpy(r[cuts[i]:cuts[i + 1]].astype(np.float64)) for i in range(len(shapes))}
            for r in rows]
    seconds, peak, ours = robust_bench.fedsim_time("multi_krum", held, weights, 1)
    want = robust.aggregate("multi_krum", torch.from_numpy(rows.astype(np.float64)),
                            torch.from_numpy(weights.astype(np.float64)), robust_bench.attackers(12)).aggregate
    np.testing.assert_allclose(ours, want.numpy(), rtol=1e-12)
    assert seconds > 0 and peak >= 0
    row = {"n": 12, "rule": "multi_krum", "fedsim_s": seconds, "flower_s": float("nan"), "max_abs_diff": float("nan"),
           "peak_over_updates_bytes": peak, "updates_bytes": 12 * d * 8}
    md = robust_bench.render([row], argparse.Namespace(sizes="12", repeat=1))
    assert "| 12 | multi_krum |" in md and "not run" in md


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / ".venv-flower" / ".installed").is_file(),
                    reason="needs the bench's Flower venv (.venv-flower, made by `make bench`)")
@pytest.mark.parametrize("rule", ["krum", "multi_krum", "bulyan", "median", "trimmed_mean"])
def test_robust_rules_give_flowers_own_aggregates(tmp_path, rule):
    """The oracle of the bench tier: Flower's aggregate_* functions, in its own venv, on the same updates."""
    import torch

    from bench import robust_bench
    from bench.runner import FLOWER_VENV, REPO, run_program
    from fedsim.transforms import robust

    n, shapes = 15, [(3, 4), (5,)]
    d = sum(int(np.prod(s)) for s in shapes)
    rows, weights = robust_bench.updates(n, d)
    path = tmp_path / "u.npz"
    np.savez(path, rows=rows, shapes=np.array([list(s) + [0] * (4 - len(s)) for s in shapes]), weights=weights)
    f = robust_bench.attackers(n)
    res = run_program([str(FLOWER_VENV / "bin" / "python"), "-m", "bench.flower_robust", str(path), rule, str(f), "1"],
                      tmp_path / "flower.log", timeout=300, cwd=REPO)
    assert res.get("seconds") is not None, (tmp_path / "flower.log").read_text()[-2000:]
    theirs = np.load(path.with_suffix(f".{rule}.flower.npy"))
    ours = robust.aggregate(rule, torch.from_numpy(rows.astype(np.float64)),
                            torch.from_numpy(weights.astype(np.float64)), f, beta=0.1).aggregate.numpy()
    np.testing.assert_allclose(ours, theirs, rtol=0, atol=1e-6)


def _flower_venv_installed() -> bool:
    from bench.runner import FLOWER_VENV

    return (FLOWER_VENV / ".installed").is_file()


# Flower's legacy strategies (flwr.server.strategy) with fedsim's defaults passed in (their own tau is 1e-9 for
# FedAdam and FedAdagrad); FedAdam's bias correction takes exponent server_round + 1, so its rounds are passed
# from 0 to match fedsim's t = 1, 2, 3; FedAvgM starts its momentum on server round 1.
FEDOPT_CASES = {
    "fedadam": ({"eta": 0.1, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 0,
                {"rule": "adam", "lr": 0.1, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3, "bias_correction": True}),
    "fedyogi": ({"eta": 0.01, "beta_1": 0.9, "beta_2": 0.99, "tau": 1e-3}, 1,
                {"rule": "yogi", "lr": 0.01, "beta1": 0.9, "beta2": 0.99, "tau": 1e-3}),
    "fedadagrad": ({"eta": 0.1, "tau": 1e-3}, 1, {"rule": "adagrad", "lr": 0.1, "beta1": 0.0, "tau": 1e-3}),
    "fedavgm": ({"server_learning_rate": 0.5, "server_momentum": 0.9}, 1,
                {"rule": "avgm", "lr": 0.5, "momentum": 0.9}),
}


@pytest.mark.skipif(not _flower_venv_installed(), reason="needs the bench's Flower venv (.venv-flower, made by "
                                                          "`make bench`)")
@pytest.mark.parametrize("strategy", list(FEDOPT_CASES))
def test_server_optimisers_step_as_flowers_own_strategies(tmp_path, strategy):
    """The oracle of the bench tier: Flower's FedAdam, FedYogi, FedAdagrad and FedAvgM, in its own venv, stepped
    3 rounds from the same parameters over the same aggregates as fedsim's server_opt_step."""
    from bench.runner import FLOWER_VENV, REPO, run_program
    from fedsim.method import ServerOptimizer, server_opt_step

    hyper, offset, ours_opt = FEDOPT_CASES[strategy]
    g = np.random.default_rng(11)
    shapes = [(3, 4), (5,)]
    x0 = [g.normal(size=s) for s in shapes]
    aggregates = [[x + g.normal(scale=0.2, size=x.shape) for x in x0] for _ in range(3)]
    path = tmp_path / "steps.npz"
    np.savez(path, **{f"x0_{i}": x for i, x in enumerate(x0)},
             **{f"avg_{t}_{i}": a for t, agg in enumerate(aggregates) for i, a in enumerate(agg)})
    res = run_program([str(FLOWER_VENV / "bin" / "python"), "-m", "bench.flower_fedopt", str(path), strategy,
                       json.dumps(hyper), str(offset)], tmp_path / "flower.log", timeout=300, cwd=REPO)
    assert res.get("seconds") is not None, (tmp_path / "flower.log").read_text()[-2000:]
    theirs = np.load(path.with_suffix(f".{strategy}.flower.npz"))
    opt = ServerOptimizer(**ours_opt)
    model = {str(i): torch.from_numpy(x) for i, x in enumerate(x0)}
    slots = None
    for t, agg in enumerate(aggregates):
        model, slots = server_opt_step(opt, model, {str(i): torch.from_numpy(a) for i, a in enumerate(agg)}, slots)
        for i in range(len(shapes)):
            np.testing.assert_allclose(model[str(i)].numpy(), theirs[f"step_{t}_{i}"], rtol=0, atol=1e-6,
                                       err_msg=f"{strategy} round {t} layer {i}")


# fedsim's data.partition options of each compared split (13 natural ids: 4 groups of 4 with a smaller last one,
# 3 bigger ones, or 3 with the rest dropped); every case at Flower's default seed 42 and at seed 3
PARTITION_CASES = [
    {"kind": "iid", "num_clients": 7},
    {"kind": "linear", "num_clients": 5}, {"kind": "square", "num_clients": 5},
    {"kind": "exponential", "num_clients": 4},
    {"kind": "dirichlet", "num_clients": 8, "alpha": 1.0, "min_samples": 25},  # 6 draws at both seeds
    {"kind": "dirichlet", "num_clients": 6, "alpha": 0.3, "min_samples": 5, "self_balancing": True},
    {"kind": "inner_dirichlet", "num_clients": 4, "alpha": 0.5, "sizes": [50, 100, 70, 80]},
    {"kind": "inner_dirichlet", "num_clients": 5, "alpha": 2.0, "size_skew": "square"},
    {"kind": "pathological", "num_clients": 8, "classes_per_client": 2},
    {"kind": "pathological", "num_clients": 8, "classes_per_client": 3, "class_assignment": "deterministic"},
    {"kind": "pathological", "num_clients": 8, "classes_per_client": 2, "class_assignment": "first-deterministic"},
    {"kind": "shards", "num_clients": 5, "shards_per_client": 3},
    {"kind": "shards", "num_clients": 5, "shards_per_client": 3, "keep_incomplete": True},
    {"kind": "shards", "num_clients": 6, "shards_per_client": None, "shard_size": 23},
    {"kind": "shards", "num_clients": 6, "shards_per_client": None, "shard_size": 23, "keep_incomplete": True},
    {"kind": "shards", "num_clients": 4, "shards_per_client": 2, "shard_size": 20},
    {"kind": "natural_id", "num_clients": 13},
    {"kind": "grouped_natural_id", "num_clients": 4, "group_size": 4},
    {"kind": "grouped_natural_id", "num_clients": 3, "group_size": 4, "group_mode": "allow-bigger"},
    {"kind": "grouped_natural_id", "num_clients": 3, "group_size": 4, "group_mode": "drop-reminder"},
    {"kind": "grouped_natural_id", "num_clients": 1, "group_size": 13, "group_mode": "strict"},
]


@pytest.mark.skipif(not (_flower_venv_installed() and any(
        (Path(__file__).resolve().parents[1] / ".venv-flower").glob("lib/python*/site-packages/flwr_datasets"))),
    reason="needs flwr-datasets in the bench's Flower venv (.venv-flower, made by `make bench`)")
def test_partitions_equal_flower_datasets_own(tmp_path):
    """The oracle of the bench tier: flwr-datasets' own partitioners behind FederatedDataset(shuffle=True, seed), in
    Flower's venv: with data.partition.flower every client's index list is Flower's partition's, for every kind.
    It also settles two points read from the code but not run before: HF's `unique` keeps the unshuffled table's
    first-appearance order (grouped natural ids), and HF's sort is stable (shards); the alternatives differ."""
    from bench.runner import FLOWER_VENV, REPO, run_program
    from fedsim.configure import load_config
    from fedsim.data import Dataset
    from fedsim.data.flower_partition import natural_groups, natural_members, skewed_sizes
    from fedsim.runtime.setup import make_partition

    g = np.random.default_rng(7)
    labels, ids = g.integers(0, 6, 300), g.integers(0, 13, 300)
    x = np.zeros((300, 1, 2, 2), np.float32)
    data = Dataset("t", x, labels, x[:6], labels[:6], num_classes=6, train_ids=ids, test_ids=ids[:6])
    ours, cases = [], []
    for seed in (42, 3):
        for case in PARTITION_CASES:
            options = {k: v for k, v in case.items() if k != "num_clients"}
            cfg = load_config(None, ["runtime.backend=local", "data.val_fraction=0", "data.partition.flower=true",
                                     f"data.num_clients={case['num_clients']}",
                                     *([] if seed == 42 else [f"data.partition.seed={seed}"]),
                                     *[f"data.partition.{k}={'null' if v is None else v}" for k, v in options.items()]])
            part, p = make_partition(cfg, data), cfg.data.partition
            ours.append([part.train[i] for i in range(cfg.data.num_clients)])
            sizes = list(p.sizes) or skewed_sizes(p.size_skew, 300, cfg.data.num_clients).tolist()
            cases.append({"kind": p.kind, "seed": seed, "num_clients": cfg.data.num_clients, "alpha": p.alpha,
                          "min_samples": p.min_samples, "self_balancing": p.self_balancing, "sizes": sizes,
                          "classes_per_client": p.classes_per_client, "class_assignment": p.class_assignment,
                          "shards_per_client": p.shards_per_client, "shard_size": p.shard_size,
                          "keep_incomplete": p.keep_incomplete, "group_size": p.group_size,
                          "group_mode": p.group_mode})
    np.savez(tmp_path / "data.npz", label=labels, id=ids)
    (tmp_path / "cases.json").write_text(json.dumps(cases))
    res = run_program([str(FLOWER_VENV / "bin" / "python"), "-m", "bench.flower_partition",
                       str(tmp_path / "data.npz"), str(tmp_path / "cases.json"), str(tmp_path / "out.json")],
                      tmp_path / "flower.log", timeout=300, cwd=REPO, env={"HF_HOME": str(tmp_path / "hf")})
    assert res.get("cases") == len(cases), (tmp_path / "flower.log").read_text()[-2000:]
    theirs = json.loads((tmp_path / "out.json").read_text())
    for case, mine, flower in zip(cases, ours, theirs):
        assert [m.tolist() for m in mine] == [sorted(f) for f in flower], case
    flower_sets = [[sorted(f) for f in t] for t in theirs]
    # the alternatives: ids in order of first appearance after the shuffle; label ties broken the other way
    grouped = [(i, c) for i, c in enumerate(cases) if c["kind"] == "grouped_natural_id" and c["group_mode"] !=
               "strict"]
    moved = 0
    for i, c in grouped:
        perm = np.random.default_rng(c["seed"]).permutation(300)
        after = natural_groups(ids[perm], c["kind"], c["group_size"], c["group_mode"])
        moved += [m.tolist() for m in natural_members(ids, after)] != flower_sets[i]
    assert moved == len(grouped)
    shard_cases = [(i, c) for i, c in enumerate(cases) if c["kind"] == "shards" and c["shard_size"] is None]
    for i, c in shard_cases:
        perm = np.random.default_rng(c["seed"]).permutation(300)
        other_ties = perm[np.lexsort((-np.arange(300), labels[perm]))]
        k, per = c["num_clients"], c["shards_per_client"]
        size = 300 // (k * per)
        usable = -(-300 // size) if c["keep_incomplete"] else 300 // size
        dealt = np.random.default_rng(c["seed"]).permutation(usable)[:k * per].reshape(k, per)
        alt = [sorted(np.concatenate([other_ties[s * size:(s + 1) * size] for s in row]).tolist()) for row in dealt]
        assert alt != flower_sets[i]


@pytest.mark.skipif(not (Path(__file__).resolve().parents[1] / ".venv-opacus" / ".installed").is_file(),
                    reason="needs the bench's Opacus venv (.venv-opacus, made by `make bench`)")
def test_a_dp_sgd_step_without_noise_is_opacus_clipped_averaged_gradient(tmp_path):
    """The oracle of the bench tier: Opacus's DPOptimizer, in its own venv, on the same model and batch; both
    models' cases in one start of that venv (its torch and Opacus imports were most of each case's time)."""
    import dataclasses

    import torch

    from bench.runner import OPACUS_VENV, REPO, run_program
    from fedsim.config.schema import TrainConfig
    from fedsim.models import build_model
    from fedsim.training.dpsgd import DPSGD, train_dp_sgd
    from fedsim.training.optim import SGD

    cases = {}
    for arch, options in [("cnn", {}), ("resnet8", {"norm": "group"})]:
        torch.manual_seed(3)
        model = build_model(arch, 3, 10, 16, **options)
        x, y = torch.randn(12, 3, 16, 16), torch.randint(0, 10, (12,))
        cases[arch] = (tmp_path / f"{arch}.pt", model, x, y)
        torch.save({"model": model, "x": x, "y": y, "clip": 0.5}, cases[arch][0])
    res = run_program([str(OPACUS_VENV / "bin" / "python"), "-m", "bench.opacus_dpsgd", "grad",
                       *(str(c[0]) for c in cases.values())], tmp_path / "opacus.log", timeout=300, cwd=REPO)
    assert res.get("ok"), (tmp_path / "opacus.log").read_text()[-2000:]
    for arch, (case, model, x, y) in cases.items():
        theirs = torch.load(case.with_suffix(".opacus.pt"))
        before = {n: p.detach().clone() for n, p in model.named_parameters()}
        train = dataclasses.replace(TrainConfig(), batch_size=12, steps=1, lr=1.0, momentum=0.0, weight_decay=0.0)
        metrics = train_dp_sgd(model, x, y, train, torch.Generator().manual_seed(0),
                               DPSGD(0.5, 0.0, torch.Generator()), SGD(model.parameters(), lr=1.0))
        assert metrics["privacy/samples_clipped"] > 0, arch  # the clip binds: the comparison is not of plain gradients
        for name, p in model.named_parameters():
            torch.testing.assert_close(before[name] - p.detach(), theirs[name], rtol=1e-4, atol=1e-6,
                                       msg=lambda m, where=f"{arch} {name}": f"{where}: {m}")


def test_the_privacy_benches_measure_fedsims_side_and_render_their_tables():
    """bench.dpsgd_bench's fedsim side (the Opacus side is the oracle test above) and bench.secagg_bench's round, at
    their smallest: positive times, and the rows in the generated tables."""
    import argparse

    from bench import dpsgd_bench, secagg_bench

    steps = dpsgd_bench.fedsim_steps("resnet8_gn", 1, 1, 0)
    row = {"model": "resnet8_gn", "fedsim_step_s": steps[0], "opacus_step_s": 2 * steps[0]}
    table = dpsgd_bench.render([row], argparse.Namespace(models="resnet8_gn", steps=1, repeat=1))
    assert steps[0] > 0 and "| resnet8_gn |" in table and "| 2.00× |" in table
    one = secagg_bench.one(5, "secagg+")
    assert one["neighbours"] == 4 and one["client_encode_s"] > one["client_plain_s"] > 0
    table = secagg_bench.render([one], argparse.Namespace(cohorts="5", full_up_to=5))
    assert "| 5 | secagg+ | 4 |" in table
