"""runtime.overlap_eval: a round is evaluated and recorded while the next round's clients train."""

from __future__ import annotations

import time
import types

import pandas as pd
import pytest

from fedsim.checkpoint import load_run_checkpoint
from fedsim.results import load
from fedsim.runtime.callbacks import Callback
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import overlap_on, run
from fedsim.runtime.server import Server


def deterministic(df: pd.DataFrame) -> pd.DataFrame:
    """Drop wall-clock columns (they end in _s); everything else must match exactly."""
    return df[[c for c in df.columns if not c.endswith("_s")]].reset_index(drop=True)


class HandsOut(LocalBackend):
    """The local backend as a backend whose workers are other processes: `idle` comes once a phase's work is handed
    out, here after its clients trained (the local backend itself calls it first). Logs what happened, in order."""

    def __init__(self, events: list, **kw) -> None:
        super().__init__(**kw)
        self.events = events

    def run_phase(self, round, phase_index, phase, bc, assignments, late, timeout, idle=None):
        out = super().run_phase(round, phase_index, phase, bc, assignments, late, timeout)
        self.events.append(("trained", round))
        if idle is not None:
            idle()
        return out


@pytest.fixture
def events(monkeypatch) -> list:
    """Each evaluation and each round's end, logged beside HandsOut's training."""
    log: list = []
    evaluate = Server.evaluate

    def logged(self):
        log.append(("evaluated",))
        return evaluate(self)

    monkeypatch.setattr(Server, "evaluate", logged)
    return log


class Ends(Callback):
    """Logs each round's end; asks to stop after round `stop`."""

    def __init__(self, events: list, stop: int | None = None) -> None:
        self.events, self.stop = events, stop

    def on_round_end(self, round, rows):
        self.events.append(("recorded", round))
        return round == self.stop


def broadcast_fails_in(monkeypatch, round: int) -> None:
    """The server's broadcast raises in `round`, before any of its clients is handed work."""
    broadcast = Server.broadcast

    def failing(self, phase, info):
        if info.round == round:
            raise RuntimeError("broadcast failed")
        return broadcast(self, phase, info)

    monkeypatch.setattr(Server, "broadcast", failing)


def test_a_round_is_evaluated_while_the_next_trains_with_the_same_numbers(make_config, events):
    cfg = make_config("runtime.overlap_eval=on", "eval.every=2", rounds=5)
    overlapped = load(run(cfg, HandsOut(events, num_workers=2), callbacks=[Ends(events)]))
    # round 1 and 3 are evaluated as the next one trains; 0 and 2 are not evaluated; 4 is the last
    assert events == [("trained", 0), ("recorded", 0), ("trained", 1), ("trained", 2), ("evaluated",),
                      ("recorded", 1), ("recorded", 2), ("trained", 3), ("trained", 4), ("evaluated",),
                      ("recorded", 3), ("evaluated",), ("recorded", 4)]
    cfg.results.run_id = None
    cfg.runtime.overlap_eval = False
    events.clear()
    plain = load(run(cfg, HandsOut(events, num_workers=2), callbacks=[Ends(events)]))
    assert events[:4] == [("trained", 0), ("recorded", 0), ("trained", 1), ("evaluated",)]
    pd.testing.assert_frame_equal(deterministic(overlapped["rounds"]), deterministic(plain["rounds"]))
    pd.testing.assert_frame_equal(deterministic(overlapped["clients"]), deterministic(plain["clients"]))
    assert overlapped["rounds"]["accuracy"].notna().tolist() == [False, True, False, True, True]
    assert (overlapped["rounds"].query("round in (1, 3)")["wall_eval_s"] > 0).all()


def test_a_callback_stopping_the_run_drops_the_round_in_flight_and_a_resume_repeats_it(make_config, events):
    cfg = make_config("runtime.overlap_eval=on", rounds=4)
    run_dir = run(cfg, HandsOut(events), callbacks=[Ends(events, stop=1)])
    assert events[-3:] == [("trained", 2), ("evaluated",), ("recorded", 1)]  # round 2 trained, then dropped
    stopped = load(run_dir)
    assert stopped["meta"]["status"] == "stopped"
    assert stopped["rounds"]["round"].tolist() == [0, 1] and set(stopped["clients"]["round"]) == {0, 1}
    assert load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 1
    resumed = load(run(backend=HandsOut(events), resume=run_dir))
    cfg.results.run_id = None
    whole = load(run(cfg, LocalBackend()))
    pd.testing.assert_frame_equal(deterministic(resumed["rounds"]), deterministic(whole["rounds"]))
    pd.testing.assert_frame_equal(deterministic(resumed["clients"]), deterministic(whole["clients"]))


def test_a_round_that_fails_before_its_clients_train_still_records_the_last_one(make_config, events, monkeypatch,
                                                                                tmp_path):
    broadcast_fails_in(monkeypatch, 2)
    with pytest.raises(RuntimeError, match="broadcast failed"):
        run(make_config("runtime.overlap_eval=on", "results.run_id=failing", rounds=4), HandsOut(events),
            callbacks=[Ends(events)])
    assert events == [("trained", 0), ("trained", 1), ("evaluated",), ("recorded", 0), ("evaluated",),
                      ("recorded", 1)]  # round 1 recorded on the way out of round 2
    run_dir = tmp_path / "results" / "failing"
    assert pd.read_parquet(run_dir / "rounds.parquet")["round"].tolist() == [0, 1]
    assert load_run_checkpoint(run_dir / "checkpoints" / "last.pt")["round"] == 1


def test_when_the_last_round_cannot_be_recorded_either_the_rounds_own_error_is_raised(make_config, monkeypatch,
                                                                                      caplog):
    def fails(self):
        raise ValueError("evaluation failed")

    broadcast_fails_in(monkeypatch, 1)
    monkeypatch.setattr(Server, "evaluate", fails)
    with pytest.raises(RuntimeError, match="broadcast failed"):  # round 0, evaluated on the way out, fails too
        run(make_config("runtime.overlap_eval=on", rounds=4), HandsOut([]))
    assert "round 0 could not be recorded either: ValueError: evaluation failed" in caplog.text


def test_an_overlapped_evaluation_is_not_in_its_rounds_wall_time(make_config, monkeypatch):
    from fedsim.algorithms.fedavg import FedAvg

    evaluate = FedAvg.evaluate

    def slow(self, *args):
        time.sleep(1.5)
        return evaluate(self, *args)

    monkeypatch.setattr(FedAvg, "evaluate", slow)
    rounds = load(run(make_config("runtime.overlap_eval=on", rounds=2), HandsOut([])))["rounds"]
    overlapped, last = rounds.iloc[0], rounds.iloc[1]
    assert overlapped["wall_eval_s"] >= 1.5 and overlapped["wall_round_s"] < 1.5
    assert last["wall_round_s"] >= last["wall_eval_s"] >= 1.5  # the last round's evaluation is its own
    assert rounds.iloc[1]["wall_clients_s"] >= 1.5  # round 1's phase lasted until round 0 was recorded


def test_a_stop_drops_the_next_round_before_a_backend_that_trains_in_this_process_trains_it(make_config, events,
                                                                                            monkeypatch):
    """The local backend calls `idle` before it trains: told that the run stopped, it trains nothing."""
    from fedsim.runtime.worker import ClientWorker

    train = ClientWorker.run_phase

    def logged(self, round, *args, **kw):
        events.append(("trained", round))
        return train(self, round, *args, **kw)

    monkeypatch.setattr(ClientWorker, "run_phase", logged)
    run_dir = run(make_config("runtime.overlap_eval=on", rounds=4), LocalBackend(), callbacks=[Ends(events, stop=1)])
    assert events == [("trained", 0), ("evaluated",), ("recorded", 0), ("trained", 1), ("evaluated",),
                      ("recorded", 1)]  # round 2 was handed to the backend, which trained none of it
    assert load(run_dir)["meta"]["status"] == "stopped"


def test_clients_that_keep_a_state_are_evaluated_before_the_next_round(make_config, events):
    """A checkpoint taken while the next round trains would hold that round's client states."""
    cfg = make_config("runtime.overlap_eval=on", "train.keep_optimizer_state=true", "train.momentum=0.9", rounds=2)
    run(cfg, HandsOut(events), callbacks=[Ends(events)])
    assert events == [("trained", 0), ("evaluated",), ("recorded", 0), ("trained", 1), ("evaluated",),
                      ("recorded", 1)]


@pytest.mark.parametrize(("mode", "gpus", "local", "on"), [
    ("auto", 0.25, False, True), ("auto", 0.0, False, False), ("auto", 0.25, True, False),
    (True, 0.0, True, True), ("on", 0.0, False, True), (False, 0.5, False, False), ("off", 0.5, False, False)])
def test_auto_overlaps_gpu_workers_in_other_processes(make_config, mode, gpus, local, on):
    cfg = make_config()
    cfg.runtime.overlap_eval, cfg.runtime.client_gpus = mode, gpus
    backend = LocalBackend() if local else types.SimpleNamespace()
    assert overlap_on(cfg, backend) is on


def test_the_config_takes_the_words_and_refuses_others(make_config):
    from fedsim.errors import ConfigError

    assert make_config("runtime.overlap_eval=on").runtime.overlap_eval is True
    assert make_config("runtime.overlap_eval=off").runtime.overlap_eval is False
    assert make_config().runtime.overlap_eval == "auto"
    with pytest.raises(ConfigError, match="runtime.overlap_eval"):
        make_config("runtime.overlap_eval=sometimes")
