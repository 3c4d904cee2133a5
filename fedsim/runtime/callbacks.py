"""Callbacks: what a run does besides training, attached to the one driver (fedsim.runtime.loop.run).

A callback sees three moments: `on_setup_end(run)` once data, backend and run folder are ready (before the
first round it will run), `on_round_end(round, rows)` after every round (a true return value stops the run
after that round), and `on_run_end(run, status)` whatever way the run ended, before the backend shuts down.
The run's own files are callbacks too, and run first: `MetaWriter` (meta.json) and `ResultsWriter` (tables,
then the checkpoint); `ProgressBar` is the CLI's bar. A callback that
raises stops the run with a CallbackError naming it, the hook and the round.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from fedsim.errors import CallbackError, FedsimError

if TYPE_CHECKING:
    import pandas as pd
    from tqdm import tqdm

    from fedsim.config.schema import RunConfig
    from fedsim.persist.storage import Location
    from fedsim.runtime.backend import Backend

RunStatus = Literal["completed", "stopped", "interrupted", "failed"]
"""completed: every round ran (or the method finished); stopped: a callback asked to stop; interrupted: Ctrl-C or
SIGTERM; failed: an error ended the run."""


@dataclass(frozen=True)
class RunInfo:
    """A run that is about to start its rounds: its config, folder, backend and the first round it runs."""

    cfg: RunConfig
    run_dir: Location  # a local folder, or a folder in a store (fedsim.persist.storage)
    backend: dict[str, Any]  # as in meta.json: backend class, num_workers, startup_s, placement, server
    first_round: int = 0  # > 0 when a resumed run continues
    partition: dict[str, Any] = field(default_factory=dict)  # the split's numbers (fedsim.results.partition_report)

    @property
    def checkpoint(self) -> Location:
        return self.run_dir / "checkpoints" / "last.pt"


@dataclass(frozen=True)
class RoundRows:
    """One finished round's rows of rounds.parquet (one per global model) and clients.parquet, and every row the
    run has so far (a resumed run's kept rows included), as the run's tables will hold them."""

    round: int
    rounds: list[dict[str, Any]]
    clients: list[dict[str, Any]]
    all_rounds: list[dict[str, Any]]
    all_clients: list[dict[str, Any]]
    last: bool  # the run's last round: its configured rounds are done, or the method finished

    @property
    def row(self) -> dict[str, Any]:
        """The first global model's row (the only one for most methods)."""
        return self.rounds[0]

    def frame(self) -> pd.DataFrame:
        """This round's rows of rounds.parquet as a DataFrame."""
        import pandas as pd

        return pd.DataFrame(self.rounds)


class Callback:
    """Base class: override the hooks you need; each default does nothing."""

    def on_setup_end(self, run: RunInfo) -> None:
        """Data, backend and run folder are ready; rounds from `run.first_round` follow."""

    def on_round_end(self, round: int, rows: RoundRows) -> bool | None:
        """Round `round` finished and its rows are final; return True to stop the run after it."""
        return None

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        """The run ended (see RunStatus); the backend is still up."""


def callback_error(cb: Callback, where: str, exc: Exception) -> CallbackError:
    """The one line naming the callback, the hook (and round) and what it raised."""
    first = (str(exc).strip().splitlines() or [""])[0][:300]
    return CallbackError(f"callback {type(cb).__name__}.{where} raised {type(exc).__name__}: {first}")


class Callbacks:
    """Several callbacks called in order; an exception from one becomes a CallbackError naming it."""

    def __init__(self, callbacks: Sequence[Callback]) -> None:
        self.items = list(callbacks)

    def _call(self, cb: Callback, hook: str, where: str, *args: Any) -> Any:
        try:
            return getattr(cb, hook)(*args)
        except FedsimError:
            raise
        except Exception as exc:
            raise callback_error(cb, f"{hook}{where}", exc) from exc

    def setup_end(self, run: RunInfo) -> None:
        for cb in self.items:
            self._call(cb, "on_setup_end", "", run)

    def round_end(self, round: int, rows: RoundRows) -> bool:
        """Every callback sees the round; True when any of them asks to stop."""
        stop = False
        for cb in self.items:
            stop = bool(self._call(cb, "on_round_end", f" (round {round})", round, rows)) or stop
        return stop

    def run_end(self, run: RunInfo, status: RunStatus) -> None:
        """Every callback hears the end, even when one before it raised; the first error is raised after."""
        error: BaseException | None = None
        for cb in self.items:
            try:
                self._call(cb, "on_run_end", "", run, status)
            except Exception as exc:
                error = error or exc
        if error is not None:
            raise error


class MetaWriter(Callback):
    """meta.json: versions, git sha, hardware, the backend's description (workers, placement, start-up; the loop
    rewrites it when workers are replaced) and the partition's numbers (`partition`); at the end, how the run ended
    (`status`), so readers tell a finished run from a running or killed one."""

    def on_setup_end(self, run: RunInfo) -> None:
        from fedsim.results.tables import write_meta

        write_meta(run.run_dir, {**run.backend, **({"partition": run.partition} if run.partition else {})})

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        from fedsim.results.tables import update_meta

        update_meta(run.run_dir, {"status": status})


class ResultsWriter(Callback):
    """rounds.parquet and clients.parquet after every round, then the checkpoint every results.checkpoint_every
    rounds and after the last round run (also when a callback stopped the run early). A table past
    fedsim.results.tables.FRESH_ROWS rows (clients.parquet of a long run) is rewritten whole as it grows by
    REWRITE_GROWTH, its rows since then going to its tail file, and whole at the run's end (TableWriter).

    Tables first, then the checkpoint, so a resume never misses rows (it truncates extra ones); Ctrl-C and SIGTERM
    wait until both are written, so an interrupted run keeps its last round. A write that fails stops the run,
    naming the round. (They are written in the driver, in order: a round's files of ResNet-8 take 15-28 ms.)"""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend
        self.saved: int | None = None  # the round the checkpoint holds
        self.written: tuple[int, float] | None = None  # the last round written, and its virtual time
        self._handed = [0, 0]  # rows of each table written so far
        self.extra: Callable[[], dict[str, Any]] | None = None  # more for the checkpoint (async mode's events)

    def on_setup_end(self, run: RunInfo) -> None:
        from fedsim.method.contract import get_algorithm
        from fedsim.results.tables import CLIENT_COLUMNS, ROUND_COLUMNS, TableWriter
        from fedsim.transforms.compression import keeps_client_state

        self.run = run
        # clients that keep nothing have no state to collect: the workers are not asked (a dead one must cost only
        # its clients)
        self.stateless = get_algorithm(run.cfg.algorithm.name).stateless_clients(run.cfg) and \
            not keeps_client_state(run.cfg)  # error feedback's residuals are client states too
        # clients.parquet is written before rounds.parquet, so a round in rounds.parquet has its client rows on
        # disk: `fedsim.results.tables.load` on a live run reads rounds.parquet first and keeps the clients up to it
        self.tables = (TableWriter(run.run_dir / "clients.parquet", CLIENT_COLUMNS),
                       TableWriter(run.run_dir / "rounds.parquet", ROUND_COLUMNS))

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        from fedsim.runtime.signals import shielded

        every = self.run.cfg.results.checkpoint_every
        where = f"on_round_end (round {round})"
        with shielded():
            for i, (table, every_row) in enumerate(zip(self.tables, (rows.all_clients, rows.all_rounds),
                                                       strict=True)):
                new = [dict(r) for r in every_row[self._handed[i]:]]  # later callbacks may change the dicts
                self._handed[i] = len(every_row)
                self._write(functools.partial(table.append, new), where)
            self.written = (round, float(rows.row["virtual_time"]))
            if every and ((round + 1) % every == 0 or rows.last):
                self.save(where)

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        from fedsim.runtime.signals import shielded

        with shielded():
            if status == "stopped" and run.cfg.results.checkpoint_every and self.written and \
                    self.saved != self.written[0]:
                self.save("on_run_end")
            self._flush_tables("on_run_end")

    def save(self, where: str) -> None:
        """The checkpoint of the last round handed over: server state and every client's personal state (none where
        the method's clients keep none), listed in the manifest beside it (fedsim.persist.checkpoint)."""
        from fedsim.persist.checkpoint import save_run_checkpoint

        assert self.written is not None
        round, virtual_time = self.written
        path = self.run.checkpoint
        payload = {"round": round, "virtual_time": virtual_time, "server_state": self.backend.server.get_state(),
                   "client_states": {} if self.stateless else self.backend.export_states(),
                   "chain_state": self.backend.server.chain_state(), **(self.extra() if self.extra else {})}
        self._write(functools.partial(save_run_checkpoint, path, payload, round), where)
        self.saved = round

    def _flush_tables(self, where: str) -> None:
        """Rewrite each table whose rows are partly in its tail file (fedsim.results.tables.TableWriter)."""
        for table in getattr(self, "tables", ()):
            self._write(table.flush, where)

    def _write(self, write: Callable[[], None], where: str) -> None:
        """A write whose failure names this callback, the hook and the round, as Callbacks would."""
        try:
            write()
        except FedsimError:
            raise
        except Exception as exc:
            raise callback_error(self, where, exc) from exc


class ProgressBar(Callback):
    """A tqdm bar over rounds on stderr, showing the latest accuracy and how many clients arrived."""

    def __init__(self) -> None:
        self.bar: tqdm | None = None

    def on_setup_end(self, run: RunInfo) -> None:
        from tqdm import tqdm

        self.bar = tqdm(total=run.cfg.rounds, initial=run.first_round, unit="round", dynamic_ncols=True,
                        file=sys.stderr)

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        assert self.bar is not None, "on_setup_end opens the bar"
        acc = rows.row.get("accuracy")
        if acc is not None and acc == acc:
            self.bar.set_postfix(acc=f"{acc:.4f}", arrived=rows.row.get("arrived"))
        self.bar.update(1)

    def on_run_end(self, run: RunInfo, status: RunStatus) -> None:
        if self.bar is not None:  # None when an earlier callback's on_setup_end failed
            self.bar.close()


def default_callbacks(backend: Backend) -> list[Callback]:
    """The callbacks every run has, first: meta.json, then the tables and checkpoints."""
    return [MetaWriter(), ResultsWriter(backend)]
