"""Every built-in method gives the same numbers on one worker and on three: which worker trains a client, and
which clients it trained before, must not reach a client's seed, batches or the server's sum. FedAvg with a
model mix, SCAFFOLD and FedGDKD have their own such tests; these are the others, at toy size."""

from __future__ import annotations

import pandas as pd
import pytest

from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_batching import METHODS

PERSONAL = ["data.client_test=balanced"]
GENERATOR = ["algorithm.generator.nz=8", "algorithm.generator.ngf=4", "algorithm.generator.init_size=2"]
OTHERS = {
    **{m: METHODS[m] for m in ("fedprox", "feddf", "single_image", "local_only", "local_shared", "centralised")},
    "fedmd": ["algorithm.name=fedmd", *PERSONAL, "algorithm.pretrain_public_epochs=1", "algorithm.digest_epochs=1",
              "algorithm.revisit_epochs=1"],
    "fd_faug": ["algorithm.name=fd_faug", *PERSONAL, "algorithm.faug_epochs=2", "algorithm.faug_samples=50",
                *GENERATOR],
    "feddtg": ["algorithm.name=feddtg", *PERSONAL, "algorithm.kd_size=40", "algorithm.kd_epochs=1", *GENERATOR],
    "dafkd": ["algorithm.name=dafkd", "model.name=resnet11", "model.options={width: 2}", "train.optimizer=adam",
              "train.steps=2", "algorithm.gen_width=4", "algorithm.noise_dim=8", "algorithm.distill_size=40",
              "algorithm.distill.batch_size=16", "algorithm.distill.epochs=1"],
    "dosfl": ["algorithm.name=dosfl", "model.name=lenet", "algorithm.distill_steps=2", "algorithm.distill_batch=3",
              "algorithm.distill_epochs=2", "algorithm.epochs=3", "algorithm.batch_size=64"],
    # personal heads kept by their clients and re-scored at each evaluation; compressed up and down, residuals kept
    "fedrep": ["algorithm.name=fedrep", *PERSONAL, "algorithm.head_epochs=1"],
    "compressed": ["compression={kind: topk, fraction: 0.1, error_feedback: true, download: fp16}"],
}

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


def comparable(df: pd.DataFrame) -> pd.DataFrame:
    """A table less its wall-clock columns (they end in _s) and the worker that trained each client."""
    return df[[c for c in df.columns if not c.endswith("_s") and c != "worker"]].reset_index(drop=True)


@pytest.mark.parametrize("method", list(OTHERS))
def test_one_and_three_workers_give_the_same_tables(method: str, make_config) -> None:
    tables = {}
    for workers in (1, 3):
        cfg = make_config(*OTHERS[method], rounds=2)
        tables[workers] = load(run(cfg, LocalBackend(num_workers=workers)))
    three_workers = tables[3]["clients"]["worker"]
    assert three_workers.nunique() > 1, "the clients all landed on one worker: nothing was compared"
    for name in ("rounds", "clients"):
        assert len(tables[1][name]) > 0, name
        pd.testing.assert_frame_equal(comparable(tables[1][name]), comparable(tables[3][name]), obj=name)
