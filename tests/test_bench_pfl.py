"""The pfl-research program's pieces do the plain loop's math, and the speed summary is written and rendered."""

from __future__ import annotations

import json
import subprocess
import sys

import pandas as pd
import pytest
import torch

from bench import pfl_fedavg, plain_fedavg, report
from bench.common import BenchError, build_model, evaluate, load_prepared
from bench.prepare import prepare
from tests.conftest import ROOT
from tests.test_bench import TINY


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("bench-pfl-cache")


def pfl_style_run(p):
    """FedAvg as pfl runs it, from the program's pieces: per drawn user, the variable map reset to the global
    state, pfl's local loop (the `loss` hook, backward, optimizer step, gradients cleared) over `ClientBatches`,
    the float32 model difference weighted by the user's samples; the summed differences divided by the total
    weight and applied by `ApplyMean`. Returns the final state and the accuracy after every round."""
    w = p.workload
    model = pfl_fedavg.build_pfl_model(w.model)
    model.load_state_dict(p.initial_state())
    variables = pfl_fedavg.state_variables(model)
    central = pfl_fedavg.ApplyMean(variables.values())
    sampler = pfl_fedavg.DrawSampler(p.draws)
    x_test, y_test = p.test_data()
    accs = []
    for r in range(w.rounds):
        initial = {k: v.detach().clone() for k, v in variables.items()}
        total, weight = None, 0
        for _ in range(w.clients_per_round):
            cid = sampler()
            seed = dict(p.round_clients(r))[cid]
            x, y = p.client_data(cid)
            batches = pfl_fedavg.ClientBatches(x, y, seed)
            opt = pfl_fedavg.local_optimizer(model.parameters(), w.lr, w.momentum)
            opt.zero_grad()  # pfl clears the gradients first (the central update left the mean there)
            for _ in range(pfl_fedavg.train_params(p)["local_num_epochs"]):
                for xb, yb in batches.epoch(pfl_fedavg.train_params(p)["local_batch_size"]):
                    model.loss(xb, yb).backward()
                    opt.step()
                    opt.zero_grad()
            diff = {k: (v.to(torch.float32) - initial[k].to(torch.float32)) * float(len(batches))
                    for k, v in variables.items()}
            total = diff if total is None else {k: total[k] + diff[k] for k in diff}
            weight += len(batches)
            with torch.no_grad():
                for k, v in variables.items():
                    v.copy_(initial[k])
        for k, v in variables.items():
            v.grad = (-total[k] * float(1 / weight)).to(v.dtype)
        central.step()
        accs.append(evaluate(model, x_test, y_test, w.eval_batch_size)[0])
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, accs


@pytest.mark.parametrize("arch", ["mlp", "resnet8"])
def test_pfl_pieces_reproduce_the_plain_loop(arch, cache):
    p = load_prepared(prepare(TINY[arch], cache))
    plain = plain_fedavg.run(p, threads=1, log=lambda m: None)
    state, accs = pfl_style_run(p)
    assert accs == plain.accuracy
    assert state.keys() == plain.state.keys()
    for k, v in state.items():
        assert v.dtype == plain.state[k].dtype, k
        if v.is_floating_point():
            # pfl averages float32 deltas scaled by counts, the plain loop averages the states; two rounds of
            # training carry that rounding to about 2e-6 on weights of size 0.2 (same accuracy every round)
            torch.testing.assert_close(v, plain.state[k], rtol=1e-5, atol=1e-5, msg=k)
        else:  # BatchNorm's batch counter: pfl's float32 mean of the differences, truncated, may fall one short
            assert 0 <= int(plain.state[k]) - int(v) <= 1, k
    if arch == "resnet8":  # the buffers moved with the average (without them in the variable map they would not)
        init = p.initial_state()
        assert not torch.equal(state["stem.1.running_mean"], init["stem.1.running_mean"])
        assert state["stem.1.num_batches_tracked"] > init["stem.1.num_batches_tracked"]


def test_pfl_pieces_follow_the_prepared_draws_and_seeds(cache):
    p = load_prepared(prepare(TINY["mlp"], cache))
    sampler = pfl_fedavg.DrawSampler(p.draws)
    w = p.workload
    seen = [[sampler() for _ in range(w.clients_per_round)] for _ in range(w.rounds)]
    assert seen == p.draws.tolist()
    assert sampler() == int(p.draws[0][0])  # sampling ahead past the last round starts over
    cid, seed = p.round_clients(0)[0]
    x, y = p.client_data(cid)
    batches = pfl_fedavg.ClientBatches(x, y, seed)
    g = torch.Generator().manual_seed(seed)
    for _ in range(2):  # each pass is a fresh permutation from the same generator, as the plain loop's epochs
        perm = torch.randperm(len(y), generator=g)
        got = list(batches.epoch(w.batch_size))
        assert torch.equal(torch.cat([b[1] for b in got]), y[perm])
        assert [len(b[0]) for b in got] == [min(w.batch_size, len(y) - i) for i in range(0, len(y), w.batch_size)]
    model = pfl_fedavg.build_pfl_model("resnet8")
    assert pfl_fedavg.state_variables(model).keys() == model.state_dict().keys()
    assert model.state_dict().keys() == build_model("resnet8").state_dict().keys()
    with pytest.raises(BenchError, match="unknown model"):
        pfl_fedavg.build_pfl_model("vgg")


def fake_runs() -> pd.DataFrame:
    rows = []
    for system, acc in [("plain", 0.5), ("pfl", 0.5), ("fedsim_ray", 0.5)]:
        for rep, sec in enumerate([1.0, 3.0]):
            rows.append({"config": "A", "system": system, "repeat": rep, "status": "ok", "seconds_per_round": sec,
                         "total_seconds": 10 * sec, "startup_seconds": 2 * sec, "round_seconds": [sec] * 5,
                         "peak_rss_mb": 100.0 * (rep + 1), "final_accuracy": acc, "load_before": 0.5})
    rows.append({"config": "A", "system": "flower", "repeat": 0, "status": "rc=1", "load_before": 0.7})
    return pd.DataFrame(rows)


def test_summary_has_the_schema_and_the_report_renders_it(tmp_path, monkeypatch, capsys):
    from bench.workload import BENCH_CONFIGS

    df = fake_runs()
    data = report.summary(df, {"A": BENCH_CONFIGS["A"]}, ["bench.fedavg_bench", "--configs", "A"],
                          {"python": "3", "pfl": "0.6.0"})
    assert {"date", "machine", "versions", "configs"} <= data.keys()
    a = data["configs"]["A"]
    assert a["workload"] == {"N": 100, "K": 10, "R": 5, "model": "resnet8"}
    assert set(a) == {"workload", "plain", "pfl", "fedsim_ray", "flower"}
    assert a["pfl"] == {"s_per_round": 2.0, "total_s": 20.0, "startup_s": 4.0, "shutdown_s": 6.0,
                        "peak_rss_mb": 150.0, "final_accuracy": 0.5, "runs": 2, "failed": 0,
                        "load_before": [0.5, 0.5]}
    assert a["flower"]["s_per_round"] is None and a["flower"]["failed"] == 1  # a failed run has no numbers
    monkeypatch.setattr(report, "OUT", tmp_path)
    path = report.write_summary(data, "fedavg")
    assert report.read_summary(path) == json.loads(json.dumps(data))
    assert report.main([str(path)]) == 0
    table = capsys.readouterr().out.splitlines()
    assert "pfl 0.6.0" in table[0]
    assert table[2].startswith("| config | system | s/round | total s | start-up s | shutdown s |")
    assert "| A: resnet8, N=100, K=10, R=5 | pfl | 2.00 | 20.0 | 4.0 | 6.0 | 150 | 0.5000 |" in table
    assert "| A: resnet8, N=100, K=10, R=5 | flower | n/a | n/a | n/a | n/a | n/a | n/a |" in table


def test_report_refuses_a_bad_summary_with_one_line(tmp_path):
    bad = tmp_path / "fedavg.json"
    bad.write_text(json.dumps({"configs": {"A": {"pfl": {"total_s": "fast"}}}}))
    proc = subprocess.run([sys.executable, "-m", "bench.report", str(bad)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == f"bench.report: error: {bad}: configs.A.pfl: total_s must be a number or null, " \
                                  "got 'fast'"
