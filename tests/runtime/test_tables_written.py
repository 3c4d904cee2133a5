"""A run's tables and checkpoint: written in order (client rows, round rows, checkpoint) before other callbacks see
the round, a failed write that stops the run naming its round, and large tables rewritten as they grow (their
latest rows in a tail file; in full at a checkpoint and at the end)."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from fedsim.errors import CallbackError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.runtime.callbacks import Callback, RoundRows, RunInfo
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_loop import deterministic


def test_during_a_round_the_files_hold_that_round_and_at_the_end_every_round(make_config):
    """The run's own callbacks write a round's tables, then its checkpoint, before any other callback sees it."""
    files = FilesSeen()
    run_dir = run(make_config(rounds=3), LocalBackend(num_workers=2), callbacks=[files])
    assert files.seen == [(0, [0], 0), (1, [0, 1], 1), (2, [0, 1, 2], 2)]
    assert pd.read_parquet(run_dir / "clients.parquet")["round"].max() == 2


class FilesSeen(Callback):
    """The rounds in rounds.parquet and in the checkpoint, as a callback after the results writer sees them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], int | None]] = []

    def on_setup_end(self, run: RunInfo) -> None:
        self.run = run

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        table = self.run.run_dir / "rounds.parquet"
        on_disk = pd.read_parquet(table)["round"].tolist() if table.exists() else []
        ck = load_run_checkpoint(self.run.checkpoint)["round"] if self.run.checkpoint.exists() else None
        self.seen.append((round, on_disk, ck))


def test_a_table_that_cannot_be_written_fails_the_run_naming_its_round_and_the_checkpoint_stays_behind(
        make_config, monkeypatch):
    from fedsim.results.tables import TableWriter

    append = TableWriter.append

    def full_at_round_1(self, rows):
        if self.path.name == "clients.parquet" and any(r["round"] == 1 for r in rows):
            raise OSError(28, "No space left on device")
        append(self, rows)

    monkeypatch.setattr(TableWriter, "append", full_at_round_1)
    cfg = make_config("results.run_id=full", rounds=4)
    with pytest.raises(CallbackError, match=r"^callback ResultsWriter.on_round_end \(round 1\) raised OSError: "
                                            r".*No space left on device$"):
        run(cfg, LocalBackend(num_workers=2))
    run_dir = Path(cfg.results.root) / "full"
    assert pd.read_parquet(run_dir / "clients.parquet")["round"].max() == 0
    assert pd.read_parquet(run_dir / "rounds.parquet")["round"].max() == 0  # not ahead of its client rows
    assert load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 0  # not ahead of the tables
    assert not list(run_dir.rglob("*.tmp"))


def test_a_rounds_client_rows_are_written_before_its_row_and_load_keeps_the_tables_in_step(make_config,
                                                                                           monkeypatch):
    """rounds.parquet is the last table of a round to land: a reader of a live run (`fedsim.load`) that finds a
    round there finds its client rows, and client rows of a round not yet in rounds.parquet are left out."""
    from fedsim.results.tables import TableWriter, load

    append, order = TableWriter.append, []

    def noted(self, rows):
        order.append((self.path.name, sorted({r["round"] for r in rows})))
        append(self, rows)

    monkeypatch.setattr(TableWriter, "append", noted)
    run_dir = run(make_config(rounds=2), LocalBackend(num_workers=2))
    assert order == [("clients.parquet", [0]), ("rounds.parquet", [0]), ("clients.parquet", [1]),
                     ("rounds.parquet", [1])]
    whole = load(run_dir)
    assert sorted(whole["clients"]["round"].unique()) == [0, 1]

    # as a reader finds a run between the two writes of round 1: clients.parquet holds it, rounds.parquet not yet
    rounds = pd.read_parquet(run_dir / "rounds.parquet")
    rounds[rounds["round"] == 0].to_parquet(run_dir / "rounds.parquet")
    between = load(run_dir)
    assert list(between["rounds"]["round"]) == [0] and set(between["clients"]["round"]) == {0}
    pd.testing.assert_frame_equal(between["clients"], whole["clients"][whole["clients"]["round"] == 0])
    assert len(pd.read_parquet(run_dir / "clients.parquet")) == len(whole["clients"])  # the file is left as it is


def test_a_large_table_is_rewritten_as_it_grows_by_a_share_with_the_rows_since_in_its_tail(tmp_path, monkeypatch):
    """Past `fresh_rows` a table's main file is rewritten once the table has grown by `growth` since the last
    rewrite (rewriting it whole every round made a long run's rounds slower and slower); the rows since then are
    in its tail file, which `read_table` joins to it. `flush` leaves the main file whole and no tail."""
    import fedsim.results.tables as results
    from fedsim.results.tables import CLIENT_COLUMNS, TableWriter, read_table

    written = []
    atomic_write = results.atomic_write
    monkeypatch.setattr(results, "atomic_write", lambda path, fn: (written.append(path.name), atomic_write(path, fn)))
    path, tail = tmp_path / "clients.parquet", tmp_path / "clients.tail.parquet"
    writer, rows, main_rows, tail_rows = TableWriter(path, CLIENT_COLUMNS, fresh_rows=8, growth=0.5), [], [], []
    for r in range(9):
        new = [{"round": r, "client": c, "status": "ok", "samples": 10 + c} for c in range(4)]
        if r == 5:
            new[1].update(status="failed", error="ValueError: x")  # a column the main file does not have
        if r == 6:
            new[0]["samples"] = 10.5  # a column the tail widens
        rows += new
        writer.append(new)
        main_rows.append(len(pd.read_parquet(path)))
        tail_rows.append(len(pd.read_parquet(tail)) if tail.exists() else 0)
        expected = pd.DataFrame(rows)
        expected = expected[[c for c in CLIENT_COLUMNS if c in expected] + [c for c in expected
                                                                            if c not in CLIENT_COLUMNS]]
        pd.testing.assert_frame_equal(read_table(path), expected, check_dtype=False)
        assert list(read_table(path).columns) == list(expected.columns)
    # whole every round while at most 8 rows, then once the table is half as large again as the main file
    assert main_rows == [4, 8, 12, 12, 20, 20, 20, 32, 32]
    assert tail_rows == [0, 0, 0, 4, 0, 4, 8, 0, 4]
    assert written.count("clients.parquet") == 5 and written.count("clients.tail.parquet") == 4
    writer.flush()
    assert writer._table.column("round").num_chunks == 1  # a chunk a round made each rewrite slower
    assert not tail.exists()
    pd.testing.assert_frame_equal(pd.read_parquet(path), read_table(path))
    assert read_table(path)["samples"].dtype == "float64" and read_table(path)["error"].notna().sum() == 1
    writer.flush()  # the main file holds every row: nothing to rewrite
    assert written.count("clients.parquet") == 6


def test_a_tail_that_does_not_follow_the_main_file_is_left_out_and_a_bad_one_is_named(tmp_path, monkeypatch):
    """A tail is joined only to the main file it follows: a main file rewritten since (the process stopped before
    it removed the tail) already holds its rows, and a writer's first main file removes any tail it finds; a tail
    removed while it is read was joined to a later main file. A tail that is not a table, or does not fit, is one
    line."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    import fedsim.results.tables as results
    from fedsim.errors import CheckpointError
    from fedsim.results.tables import FOLLOWS_ROWS, ROUND_COLUMNS, TableWriter, read_table

    path, tail = tmp_path / "rounds.parquet", tmp_path / "rounds.tail.parquet"
    pd.DataFrame({"round": [0, 1, 2], "accuracy": [0.1, 0.2, 0.3]}).to_parquet(path)

    def write_tail(follows: int, **columns) -> None:
        pq.write_table(pa.table(columns).replace_schema_metadata({FOLLOWS_ROWS: str(follows)}), tail)

    write_tail(3, round=[3], accuracy=[0.4])
    assert read_table(path)["round"].tolist() == [0, 1, 2, 3]
    writer = TableWriter(path, ROUND_COLUMNS)  # a resumed run, writing the three rows it kept: the tail is stale
    writer.append([{"round": r, "accuracy": 0.1 * (r + 1)} for r in range(3)])
    assert not tail.exists() and read_table(path)["round"].tolist() == [0, 1, 2]
    write_tail(2, round=[2], accuracy=[0.3])
    assert read_table(path)["round"].tolist() == [0, 1, 2]
    write_tail(3, round=[3], accuracy=[0.4])
    read_bytes = results._read_bytes

    def removed_meanwhile(p):  # the live run rewrote the main file whole and removed the tail since it was read
        if p == tail:
            tail.unlink()
        return read_bytes(p)

    monkeypatch.setattr(results, "_read_bytes", removed_meanwhile)
    assert read_table(path)["round"].tolist() == [0, 1, 2]
    monkeypatch.undo()
    write_tail(3, round=["three"], accuracy=[0.4])
    with pytest.raises(CheckpointError, match=rf"^{tail}: does not fit rounds.parquet \("):
        read_table(path)
    tail.write_bytes(b"not parquet")
    with pytest.raises(CheckpointError, match=rf"^{tail}: unreadable table \(") as err:
        read_table(path)
    assert "\n" not in str(err.value)


class TablesSeen(Callback):
    """The rounds in clients.parquet (alone, and joined to its tail) and in the checkpoint, as a callback after the
    results writer sees them."""

    def __init__(self) -> None:
        self.seen: list[tuple[int, list[int], list[int], int | None]] = []

    def on_setup_end(self, run: RunInfo) -> None:
        self.run = run

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        from fedsim.results.tables import read_table

        table = self.run.run_dir / "clients.parquet"
        alone = sorted(set(pd.read_parquet(table)["round"])) if table.exists() else []
        joined = sorted(set(read_table(table)["round"])) if table.exists() else []
        ck = load_run_checkpoint(self.run.checkpoint)["round"] if self.run.checkpoint.exists() else None
        self.seen.append((round, alone, joined, ck))


def small_tables(monkeypatch) -> None:
    """Tables past FRESH_ROWS from a run's second round on (4 clients a round), rewritten as they double."""
    import fedsim.results.tables as results

    monkeypatch.setattr(results, "FRESH_ROWS", 4)
    monkeypatch.setattr(results, "REWRITE_GROWTH", 1.0)


def test_a_large_tables_rows_lag_in_its_main_file_only_and_the_run_ends_with_it_whole(make_config, monkeypatch):
    small_tables(monkeypatch)
    files = TablesSeen()
    cfg = make_config("results.run_id=tails", rounds=6)
    run_dir = run(cfg, LocalBackend(num_workers=2), callbacks=[files])
    # the main file: whole at rounds 0, 1 (doubled) and 3 (doubled); joined to its tail, always the round itself
    assert files.seen == [(0, [0], [0], 0), (1, [0, 1], [0, 1], 1), (2, [0, 1], [0, 1, 2], 2),
                          (3, [0, 1, 2, 3], [0, 1, 2, 3], 3), (4, [0, 1, 2, 3], [0, 1, 2, 3, 4], 4),
                          (5, [0, 1, 2, 3], [0, 1, 2, 3, 4, 5], 5)]
    assert not (run_dir / "clients.tail.parquet").exists()
    monkeypatch.undo()
    cfg.results.run_id = "whole"
    full = run(cfg, LocalBackend(num_workers=2))
    for name in ("clients.parquet", "rounds.parquet"):
        pd.testing.assert_frame_equal(deterministic(pd.read_parquet(run_dir / name)),
                                      deterministic(pd.read_parquet(full / name)))


def test_an_interrupted_run_leaves_a_large_table_whole(make_config, monkeypatch):
    small_tables(monkeypatch)

    class Interrupt(Callback):
        def on_setup_end(self, run: RunInfo) -> None:
            self.run = run

        def on_round_end(self, round: int, rows: RoundRows) -> None:
            if round == 2:  # round 2's rows go to the tail (the table grew by half), then whole to the main file
                raise KeyboardInterrupt

    stop = Interrupt()
    with pytest.raises(KeyboardInterrupt):
        run(make_config(rounds=5), LocalBackend(num_workers=2), callbacks=[stop])
    assert sorted(set(pd.read_parquet(stop.run.run_dir / "clients.parquet")["round"])) == [0, 1, 2]
    assert not (stop.run.run_dir / "clients.tail.parquet").exists()


def test_a_run_killed_with_a_tail_resumes_to_the_tables_of_a_whole_run(make_config, monkeypatch):
    """Killed, a run cannot join its tables: the resume reads each table with its tail (rows past the checkpoint
    dropped), and writes them whole again without the stale tail."""
    from fedsim.runtime.callbacks import ResultsWriter

    small_tables(monkeypatch)

    class Killed(Callback):
        def on_round_end(self, round: int, rows: RoundRows) -> None:
            if round == 2:
                raise KeyboardInterrupt

    monkeypatch.setattr(ResultsWriter, "_flush_tables", lambda self, where: None)  # as if killed: no end
    cfg = make_config("results.run_id=killed", rounds=5)
    with pytest.raises(KeyboardInterrupt):
        run(cfg, LocalBackend(num_workers=2), callbacks=[Killed()])
    run_dir = Path(cfg.results.root) / "killed"
    assert (run_dir / "clients.tail.parquet").exists()
    monkeypatch.undo()
    run(backend=LocalBackend(num_workers=2), resume=run_dir)
    assert not (run_dir / "clients.tail.parquet").exists()
    cfg.results.run_id = "whole"
    full = run(cfg, LocalBackend(num_workers=2))
    for name in ("clients.parquet", "rounds.parquet"):
        pd.testing.assert_frame_equal(deterministic(pd.read_parquet(run_dir / name)),
                                      deterministic(pd.read_parquet(full / name)))
