"""Every built-in method with state beyond the global model (personal models, control variates, generators,
server optimisers) resumes to the numbers of an uninterrupted run, stopped after round 0 and again after round 1,
each time on another worker count. FedAvg's resume has its own tests (tests/runtime/test_tables_written.py)."""

from __future__ import annotations

import pandas as pd
import pytest

from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback, RoundRows
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_worker_count import OTHERS, comparable

STATEFUL = ["local_only", "local_shared", "centralised", "feddf", "single_image", "fedmd", "fd_faug", "feddtg"]
SCAFFOLD = ["algorithm.name=scaffold"]

pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


class StopAfter(Callback):
    """Stops the run after `round` (None: never), and keeps the rounds this run trained."""

    def __init__(self, round: int | None) -> None:
        self.round = round
        self.ran: list[int] = []

    def on_round_end(self, round: int, rows: RoundRows) -> bool:
        self.ran.append(round)
        return round == self.round


def ordered(df: pd.DataFrame) -> pd.DataFrame:
    keys = [k for k in ("round", "phase", "client", "model") if k in df.columns]
    return comparable(df.sort_values(keys))


@pytest.mark.parametrize("method", [*STATEFUL, "scaffold"])
def test_stopped_twice_and_resumed_on_other_worker_counts_gives_the_uninterrupted_tables(method, make_config):
    overrides = SCAFFOLD if method == "scaffold" else OTHERS[method]
    whole = load(run(make_config(*overrides, "results.run_id=whole"), LocalBackend(num_workers=2)))
    cfg = make_config(*overrides, "results.run_id=cut", "results.checkpoint_every=5")
    run_dir = run(cfg, LocalBackend(num_workers=2), callbacks=[StopAfter(0)])
    assert load(run_dir)["rounds"]["round"].max() == 0
    first, second = StopAfter(1), StopAfter(None)
    run(resume=run_dir, backend=LocalBackend(num_workers=3), callbacks=[first])
    run(resume=run_dir, backend=LocalBackend(num_workers=1), callbacks=[second])
    assert (first.ran, second.ran) == ([1], [2])  # each resume went on from its checkpoint, not from round 0
    cut = load(run_dir)
    assert sorted(set(cut["rounds"]["round"])) == [0, 1, 2]
    for name in ("rounds", "clients"):
        pd.testing.assert_frame_equal(ordered(whole[name]), ordered(cut[name]), obj=name)
