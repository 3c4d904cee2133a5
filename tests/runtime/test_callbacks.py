"""Run callbacks: what each hook sees, a callback that stops a run after a round (and the run resumed from
there), and a callback that raises (a CallbackError naming it; nothing left behind before the first round)."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from fedsim.errors import CallbackError, FedsimError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo, RunStatus
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_loop import deterministic


class Recorder(Callback):
    """Records every hook call; asks to stop after round `stop_after`."""

    def __init__(self, stop_after: int | None = None) -> None:
        self.stop_after = stop_after
        self.events: list[tuple] = []
        self.rows: list[RoundRows] = []
        self.info: RunInfo | None = None

    def on_setup_end(self, run: RunInfo) -> None:
        self.info = run
        self.events.append(("setup", run.first_round, (run.run_dir / "meta.json").is_file()))

    def on_round_end(self, round: int, rows: RoundRows) -> bool:
        self.rows.append(rows)
        self.events.append(("round", round, rows.last))
        return round == self.stop_after

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        self.events.append(("end", status))


class Raises(Callback):
    """Raises `error` from hook `hook` (at round `at` for on_round_end)."""

    def __init__(self, hook: str, error: BaseException, at: int = 0) -> None:
        self.hook, self.error, self.at = hook, error, at

    def on_setup_end(self, run: RunInfo) -> None:
        if self.hook == "on_setup_end":
            raise self.error

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        if self.hook == "on_round_end" and round == self.at:
            raise self.error


def test_a_callback_stops_the_run_after_a_round_and_a_resume_continues_from_there(make_config):
    cfg = make_config("results.run_id=stopped", "results.checkpoint_every=3", rounds=4)
    rec = Recorder(stop_after=1)
    run_dir = run(cfg, LocalBackend(num_workers=2), callbacks=[rec])
    assert rec.events == [("setup", 0, True), ("round", 0, False), ("round", 1, False), ("end", "stopped")]
    assert rec.info.cfg is cfg and rec.info.run_dir == run_dir and rec.info.backend["num_workers"] == 2
    assert json.loads((run_dir / "meta.json").read_text())["backend"] == rec.info.backend["backend"] == "LocalBackend"
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    assert rounds["round"].tolist() == [0, 1]
    assert [r["round"] for r in rec.rows[1].all_rounds] == [0, 1] and rec.rows[1].row["round"] == 1
    assert {c["round"] for c in rec.rows[1].clients} == {1} and len(rec.rows[1].all_clients) == 2 * 4
    # checkpoint_every=3 would not have saved round 1: a stopped run saves the round it stopped after
    assert load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 1

    again = Recorder()
    assert run(resume=run_dir, callbacks=[again]) == run_dir
    assert again.events == [("setup", 2, True), ("round", 2, False), ("round", 3, True), ("end", "completed")]
    cfg.results.run_id = "full"
    full = run(cfg, LocalBackend(num_workers=2))
    pd.testing.assert_frame_equal(deterministic(pd.read_parquet(run_dir / "rounds.parquet")),
                                  deterministic(pd.read_parquet(full / "rounds.parquet")))


def test_a_callback_that_raises_is_named_in_one_line_and_the_others_hear_the_failure(make_config):
    backend = LocalBackend(num_workers=2)
    rec = Recorder()
    with pytest.raises(CallbackError) as err:
        run(make_config("results.run_id=broken"), backend,
            callbacks=[Raises("on_round_end", ValueError("no space left for the plot\ndetails"), at=1), rec])
    assert str(err.value) == "callback Raises.on_round_end (round 1) raised ValueError: no space left for the plot"
    assert isinstance(err.value, FedsimError) and isinstance(err.value.__cause__, ValueError)
    assert rec.events[-1] == ("end", "failed") and ("round", 1, False) not in rec.events
    assert backend.workers == []  # shut down
    run_dir = rec.info.run_dir
    assert pd.read_parquet(run_dir / "rounds.parquet")["round"].tolist() == [0, 1]  # the tables come first


def test_a_callback_failing_before_the_first_round_leaves_no_folder(make_config, tmp_path):
    with pytest.raises(CallbackError, match=r"^callback Raises.on_setup_end raised OSError: dashboard unreachable$"):
        run(make_config(), callbacks=[Raises("on_setup_end", OSError("dashboard unreachable"))])
    assert not (tmp_path / "results").exists()


def test_an_interrupt_inside_a_callback_is_not_wrapped_and_ends_the_run_as_interrupted(make_config):
    rec = Recorder()
    with pytest.raises(KeyboardInterrupt):
        run(make_config(), callbacks=[Raises("on_round_end", KeyboardInterrupt(), at=0), rec])
    assert rec.events[-1] == ("end", "interrupted")
    assert pd.read_parquet(rec.info.run_dir / "rounds.parquet")["round"].tolist() == [0]


def test_tables_written_round_by_round_equal_the_whole_table_written_at_once(tmp_path):
    """The results writer converts each round's rows once: its file after every round must read back as the
    DataFrame of all rows so far, with a column a later round adds (a failure) and one it widens (int to float)."""
    from fedsim.results.tables import CLIENT_COLUMNS, TableWriter

    def rows_of(r: int) -> list[dict]:
        out = [{"round": r, "client": c, "status": "ok", "samples": 10 + c, "train_loss": 0.5 * c, "steps": 3}
               for c in range(4)]
        if r == 1:
            out[2].update(status="failed", error="ValueError: x", error_type="ValueError")
        if r == 2:
            out[0]["steps"] = 2.5
        return out

    writer, rows = TableWriter(tmp_path / "clients.parquet", CLIENT_COLUMNS), []
    for r in range(4):
        rows += rows_of(r)
        writer.write(rows)
        expected = pd.DataFrame(rows)
        expected = expected[[c for c in CLIENT_COLUMNS if c in expected] + [c for c in expected
                                                                            if c not in CLIENT_COLUMNS]]
        got = pd.read_parquet(tmp_path / "clients.parquet")
        pd.testing.assert_frame_equal(got, expected, check_dtype=False)
        assert list(got.columns) == list(expected.columns)
    assert got["steps"].dtype == "float64" and got["error"].notna().sum() == 1
    writer.write(rows[:4])  # rows it has not seen as such: written again from scratch
    assert len(pd.read_parquet(tmp_path / "clients.parquet")) == 4
