"""runtime.batch_clients end to end: whole runs give the same numbers with batching on and off for every method
whose client step is plain local training; other methods, and a client step overridden below its description,
run one client after another and say so once."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

import fedsim.runtime.batching as batching
from fedsim.algorithms.fedavg import FedAvg
from fedsim.algorithms.fedmd import FedMD
from fedsim.algorithms.local_only import LocalOnly
from fedsim.algorithms.scaffold import Scaffold
from fedsim.algorithms.single_image import SingleImage
from fedsim.errors import AlgorithmError, ConfigError
from fedsim.method.contract import Phase
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run

PERSONAL = ["data.client_test=balanced", "algorithm.pretrain_epochs=1", "train.epochs=2"]
METHODS = {
    "fedavg": ["algorithm.name=fedavg", "model.mix={cnn: 5, mlp: 5}", "stragglers.enabled=true"],
    "fedprox": ["algorithm.name=fedprox", "algorithm.mu=0.1", "model.name=resnet8", "train.steps=3"],
    "feddf": ["algorithm.name=feddf", "algorithm.proxy=test_half", "algorithm.distill.steps=2", "algorithm.mu=0.05"],
    "single_image": ["algorithm.name=single_image", "algorithm.pool_size=200", "algorithm.selection.n=20",
                     "algorithm.selection.k=4", "algorithm.selection.niter=3", "algorithm.distill.steps=2",
                     "algorithm.distill.eval_every=2"],
    "local_only": ["algorithm.name=local_only", *PERSONAL],
    "local_shared": ["algorithm.name=local_shared", *PERSONAL],
    "centralised": ["algorithm.name=centralised", *PERSONAL],
}


pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures one_thread and together: tests/conftest.py


@pytest.mark.parametrize("method", list(METHODS))
def test_a_run_gives_the_same_numbers_with_batching_on_and_off(method: str, make_config, together) -> None:
    results = {}
    for mode in ("off", "on"):
        cfg = make_config(*METHODS[method], f"runtime.batch_clients={mode}", rounds=2)
        results[mode] = load(run(cfg, LocalBackend(num_workers=2)))
        assert (sum(together) > 0) == (mode == "on")
    off, on = results["off"], results["on"]
    assert (on["clients"]["status"] == "ok").sum() > 0
    # rounds.parquet says how many client steps were trained together: every round's, and none without batching
    assert (on["rounds"]["clients_batched"] > 0).all() and (off["rounds"]["clients_batched"] == 0).all()
    for table, keys in (("rounds", ["round", "model"]), ("clients", ["round", "phase", "client"])):
        a, b = off[table].sort_values(keys).reset_index(drop=True), on[table].sort_values(keys).reset_index(drop=True)
        exact = [c for c in a.columns if a[c].dtype == object or c in ("status", "steps", "samples", "bytes_up")]
        pd.testing.assert_frame_equal(a[exact], b[exact])
        close = [c for c in a.columns if c not in exact and not c.endswith("_s") and a[c].dtype.kind == "f"]
        assert close, table
        for c in close:  # weights agree to float rounding; a test prediction near a tie could flip
            rtol, atol = (0.0, 0.01) if "accuracy" in c else (1e-4, 1e-5)
            np.testing.assert_allclose(b[c].to_numpy(), a[c].to_numpy(), rtol=rtol, atol=atol, err_msg=f"{table} {c}")


def test_a_phase_is_trained_together_only_where_it_opts_in() -> None:
    """Batching is an explicit opt-in of the phase (`local_training=True`), and a class that overrides client_step
    under such a phase is refused before the phase runs, so the two paths never run different client steps."""
    class Overridden(FedAvg):
        def client_step(self, phase, state, msg, ctx):
            return super().client_step(phase, state, msg, ctx)

    for algo, phases in ((FedAvg(None, None), FedAvg.phases(None, 0)), (SingleImage(None, None), [
            Phase("train", "each", local_training=True)]), (LocalOnly.__new__(LocalOnly), LocalOnly.phases(
                LocalOnly.__new__(LocalOnly), 1))):
        assert [batching.phase_reason(algo, p) for p in phases if p.local_training] == [None]
    assert "'scaffold' does not declare" in (batching.phase_reason(Scaffold.__new__(Scaffold), Phase("train", "sum"))
                                             or "")
    digest = Phase("digest", "each", client="digest_client")
    assert "does not declare local_training=True" in (batching.phase_reason(FedMD.__new__(FedMD), digest) or "")
    with pytest.raises(AlgorithmError, match="Overridden: phase 'train' declares local_training=True"):
        Overridden.check_phase(FedAvg.phases(None, 0)[0])
    with pytest.raises(AlgorithmError, match="names a client handler"):
        FedAvg.check_phase(Phase("train", "sum", client="x", local_training=True))
    with pytest.raises(AlgorithmError, match="names client handler 'train_clent', which is not a method"):
        LocalOnly.check_phase(Phase("train", "each", client="train_clent", server="train_server"))


def test_a_method_that_cannot_be_batched_runs_as_before_and_says_so_once(make_config, together, caplog) -> None:
    caplog.set_level("INFO", logger="fedsim.batching")
    tables = {}
    for mode in ("off", "on"):
        cfg = make_config("algorithm.name=scaffold", f"runtime.batch_clients={mode}", rounds=2)
        tables[mode] = load(run(cfg, LocalBackend(num_workers=1)))["rounds"]
    assert together == []
    said = [r.getMessage() for r in caplog.records if r.name == "fedsim.batching"]
    assert said == ["worker 0: clients run one after another: phase 'train' of 'scaffold' does not declare "
                    "local_training=True"]
    for c in ("accuracy", "loss"):
        assert tables["on"][c].tolist() == tables["off"][c].tolist()  # the very same path


def test_the_setting(make_config) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert [batching.batching_on(m, cpu) for m in ("auto", True, "on", False, "off")] == [False, True, True, False,
                                                                                           False]
    assert batching.batching_on("auto", cuda) and not batching.batching_on(False, cuda)
    assert make_config().runtime.batch_clients == "auto" and make_config().runtime.batch_clients_max == 64
    assert make_config("runtime.batch_clients=on").runtime.batch_clients is True
    with pytest.raises(ConfigError, match=r"runtime\.batch_clients: expected bool \| 'auto' \| 'on' \| 'off'"):
        make_config("runtime.batch_clients=sometimes")
    with pytest.raises(ConfigError, match=r"runtime\.batch_clients_max: must be >= 1"):
        make_config("runtime.batch_clients_max=0")
