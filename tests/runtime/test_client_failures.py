"""A client whose step raises fails alone, as a ClientFailedError whose type and message reach clients.parquet,
on the local backend and across Ray's process boundary alike."""

from __future__ import annotations

import pickle
import re

import pandas as pd
import pytest

from fedsim.algorithms.fedavg import FedAvg
from fedsim.errors import ClientFailedError, FedsimError, RunFailedError
from fedsim.method import Phase
from fedsim.method.contract import register_algorithm
from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.failing_client import FAILING_CLIENT, FAILING_ROUND, FailingClientRayBackend
from tests.runtime.test_loop import deterministic

FAILING = ("algorithm.name=fedavg_failing_client", "data.num_clients=4", "participation.clients_per_round=4")


def assert_one_failure_reported(res: dict) -> None:
    clients, rounds = res["clients"], res["rounds"]
    failed = clients[clients["status"] == "failed"]
    assert failed[["round", "client"]].values.tolist() == [[FAILING_ROUND, FAILING_CLIENT]]
    row = failed.iloc[0]
    assert row["error_type"] == "ZeroDivisionError"
    assert row["error_message"] == f"client {FAILING_CLIENT} divided by zero"
    assert row["error"] == f"ZeroDivisionError: client {FAILING_CLIENT} divided by zero"
    assert "failing_client.py" in row["error_traceback"] and "raise ZeroDivisionError" in row["error_traceback"]
    assert clients.loc[clients["status"] != "failed", ["error", "error_type", "error_message"]].isna().all().all()
    assert rounds["failures"].tolist() == [0, 1, 0] and rounds["arrived"].tolist() == [4, 3, 4]
    assert rounds["accuracy"].notna().all()


def test_client_failed_error_keeps_its_fields_across_pickling_and_reads_in_one_line():
    try:
        {}["missing"]
    except KeyError as exc:
        err = ClientFailedError.wrap(exc, client_id=7, round=3, phase="train")
    again = pickle.loads(pickle.dumps(err))
    assert isinstance(again, FedsimError) and isinstance(again, ClientFailedError)
    assert (again.client_id, again.round, again.phase, again.error_type, again.error_message) == \
        (7, 3, "train", "KeyError", "'missing'")
    assert "KeyError" in again.traceback and "test_client_failures.py" in again.traceback
    assert str(again) == "client 7 failed in round 3, phase 'train': KeyError: 'missing'"
    multi = ClientFailedError(1, 0, "train", "ValueError", "first line\nsecond line")
    assert str(multi).endswith("ValueError: first line") and multi.error_message == "first line\nsecond line"


def test_a_failing_client_is_reported_with_its_error_on_the_local_backend(make_config):
    assert_one_failure_reported(load(run(make_config(*FAILING), LocalBackend(num_workers=2))))


@pytest.mark.ray
@pytest.mark.slow
def test_a_failing_client_is_reported_with_its_error_on_ray(ray_local, make_config):
    cfg = make_config(*FAILING, "runtime.backend=ray", "runtime.client_cpus=1")
    on_ray = load(run(cfg, FailingClientRayBackend(num_workers=1)))  # the error's way back from a worker: one is enough
    assert on_ray["meta"]["backend"] == "FailingClientRayBackend" and on_ray["meta"]["num_workers"] == 1
    assert_one_failure_reported(on_ray)
    cfg.results.run_id = None
    local = load(run(cfg, LocalBackend(num_workers=2)))
    pd.testing.assert_frame_equal(deterministic(on_ray["rounds"]), deterministic(local["rounds"]))
    keep = ["round", "client", "status", "error", "error_type", "error_message"]
    pd.testing.assert_frame_equal(on_ray["clients"][keep], local["clients"][keep])


class _StopAfter(Callback):
    def __init__(self, last: int) -> None:
        self.last = last

    def on_round_end(self, round, rows) -> bool:
        return round == self.last


def test_a_run_stopped_after_a_failure_resumes_to_the_tables_of_an_uninterrupted_one(make_config):
    """The kept rows come back from the tables with the failure's text columns empty for the other clients: they
    must be written again as they were (a missing text read back as NaN once made every resume fail)."""
    cfg = make_config(*FAILING)
    whole = load(run(cfg, LocalBackend(num_workers=2)))
    cfg.results.run_id = None
    stopped = run(cfg, LocalBackend(num_workers=2), callbacks=[_StopAfter(FAILING_ROUND)])
    assert load(stopped)["rounds"]["round"].tolist() == [0, 1]
    resumed = load(run(resume=stopped, backend=LocalBackend(num_workers=2)))
    assert_one_failure_reported(resumed)
    for name in ("rounds", "clients"):
        pd.testing.assert_frame_equal(deterministic(resumed[name]), deterministic(whole[name]), obj=name)


@register_algorithm
class NaNUploadFedAvg(FedAvg):
    """FedAvg whose client 1 uploads a NaN weight with a finite loss, as a method without fedsim's local training
    might: only the upload says it diverged."""

    name = "fedavg_nan_upload"

    def phases(self, round):  # it wraps the client step: its phase is no batching opt-in
        return [Phase("train", "sum")]

    def client_step(self, phase, state, msg, ctx):
        res = super().client_step(phase, state, msg, ctx)
        if ctx.client_id == 1:
            first = next(k for k, v in res.payload.items() if v.is_floating_point() and v.dim() > 0)
            res.payload[first] = res.payload[first].clone().fill_(float("nan"))
        return res


@pytest.mark.parametrize("overrides, failed, reason", [
    (("train.weight_decay=1e12",), [0, 1, 2, 3], "diverged: non-finite train_loss (nan)"),  # fedavg's training
    (("algorithm.name=scaffold", "train.weight_decay=1e12"), [0, 1, 2, 3], "diverged: non-finite train_loss (nan)"),
    (("algorithm.name=fedavg_nan_upload",), [1], "diverged: non-finite update (payload['cnn/"),
])
def test_a_client_that_diverges_fails_alone_with_the_reason(make_config, overrides, failed, reason):
    """A diverging client is a failed client in clients.parquet, whatever its method: SCAFFOLD's NaN used to be
    summed into the global model, and a method's NaN upload too; the lead's all-failed rule then stops the run."""
    cfg = make_config("data.num_clients=4", "participation.clients_per_round=4", *overrides, rounds=1)
    if len(failed) == 4:  # every client: the run stops, naming the first one's reason
        with pytest.raises(RunFailedError, match=re.escape(f"every client failed (4 of 4); the first, client 0: "
                                                           f"FloatingPointError: {reason}")):
            run(cfg, LocalBackend(num_workers=2))
        return
    clients = load(run(cfg, LocalBackend(num_workers=2)))["clients"]
    bad = clients[clients["status"] == "failed"]
    assert bad["client"].tolist() == failed, clients[["client", "status", "error"]]
    assert (bad["error_type"] == "FloatingPointError").all()
    assert all(m.startswith(reason) for m in bad["error_message"]), bad["error_message"].tolist()


@register_algorithm
class OutOfMemoryFedAvg(FedAvg):
    """FedAvg whose client 1 asks torch's CPU allocator for 256 TiB in round 1: a real allocation failure (no address
    space holds it), as a model or batch too large for the machine gives."""

    name = "fedavg_out_of_memory"

    def phases(self, round):  # it wraps the client step: its phase is no batching opt-in
        return [Phase("train", "sum")]

    def client_step(self, phase, state, msg, ctx):
        if (ctx.client_id, ctx.round) == (1, 1):
            import torch

            torch.empty(2**46)
        return super().client_step(phase, state, msg, ctx)


def test_a_client_out_of_memory_stops_the_run_in_one_line_keeping_the_finished_rounds(make_config, capsys):
    """It used to count as one failed client, the next one failing alike; the run stops now, exit 1."""
    from fedsim.configure import save_config
    from jobs.cli import main

    cfg = make_config("algorithm.name=fedavg_out_of_memory", "data.num_clients=4", "participation.clients_per_round=4",
                      "results.run_id=oom", rounds=3)
    path = cfg.results.root + "/../oom.yaml"
    save_config(cfg, path)
    assert main(["run", path, "--quiet", "--backend", "local"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "fedsim: error: round 1: client 1 ran out of memory training model 'cnn' (phase 'train': RuntimeError: "
        "[enforce fail at alloc_cpu.cpp"), err
    assert "the run stops, its finished rounds kept" in err
    res = load(cfg.results.root + "/oom")
    assert res["rounds"]["round"].tolist() == [0] and res["meta"]["status"] == "failed"
