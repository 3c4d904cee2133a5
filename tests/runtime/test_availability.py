"""Availability over virtual time (participation.availability: a FedScale trace, a CSV of intervals, diurnal): the
loaders on files in the real formats, the folding and interval semantics against a hand table, sampling only online
clients, clients that go offline mid-round, the diurnal generator, and bad input through the CLI."""

from __future__ import annotations

import pickle
from pathlib import Path

import numpy as np
import pandas as pd
import yaml

from fedsim.config.schema import DiurnalConfig
from fedsim.results.tables import load
from fedsim.runtime.availability import OnlineWindows, next_online, online, online_until
from fedsim.runtime.availability_sources import diurnal, diurnal_probability, read_fedscale, read_intervals_csv
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run

INF = np.inf
# FedScale's client_behave_trace: client 1's last interval runs into its period's end and its first starts at 0,
# so it stays online across the fold; client 2 is online at one instant a period
FEDSCALE = {
    0: {"duration": 50, "active": [10, 50], "inactive": [20, 60], "finish_time": 100, "model": "Pixel"},
    1: {"duration": 60, "active": [0, 80], "inactive": [30, 100], "finish_time": 100, "model": "Nexus"},
    2: {"duration": 0, "active": [5], "inactive": [5], "finish_time": 40, "model": "Galaxy"},
}
CSV = "client,start,end,period\n0,10,20,100\n1,0,30,100\n2,5,5,40\n0,50,60,100\n1,80,100,100\n"

# (client, t, online at t, online until, next online): boundaries included, several periods
TABLE = [
    (0, 0, False, -INF, 10), (0, 10, True, 20, 10), (0, 20, True, 20, 20), (0, 20.5, False, -INF, 50),
    (0, 60, True, 60, 60), (0, 61, False, -INF, 110), (0, 110, True, 120, 110), (0, 1020, True, 1020, 1020),
    (0, 1099.5, False, -INF, 1110),
    (1, 0, True, 30, 0), (1, 30, True, 30, 30), (1, 31, False, -INF, 80), (1, 90, True, 130, 90),
    (1, 100, True, 130, 100), (1, 250, False, -INF, 280), (1, 999, True, 1030, 999),
    (2, 0, False, -INF, 5), (2, 5, True, 5, 5), (2, 6, False, -INF, 45), (2, 45, True, 45, 45),
]


def _check_table(w: OnlineWindows) -> None:
    clients = np.array([row[0] for row in TABLE])
    t = np.array([row[1] for row in TABLE], dtype=float)
    expected = np.array([row[2:] for row in TABLE], dtype=float)
    np.testing.assert_array_equal(online(w, clients, t), expected[:, 0].astype(bool))
    np.testing.assert_array_equal(online_until(w, clients, t), expected[:, 1])
    np.testing.assert_array_equal(next_online(w, clients, t), expected[:, 2])
    for time in np.unique(t):  # one time for every client gives the same answers
        at = t == time
        np.testing.assert_array_equal(online(w, clients[at], float(time)), expected[at, 0].astype(bool))


def test_the_fedscale_pickle_and_the_csv_follow_the_hand_table(tmp_path):
    path = tmp_path / "client_behave_trace"
    with open(path, "wb") as f:
        pickle.dump(FEDSCALE, f)
    (tmp_path / "trace.csv").write_text(CSV)
    _check_table(read_fedscale(str(path), 3))
    _check_table(read_intervals_csv(str(tmp_path / "trace.csv"), 3))


def test_without_a_period_time_does_not_fold(tmp_path):
    (tmp_path / "trace.csv").write_text("client,start,end\n0,10,20\n0,20,25\n0,50,60\n")  # touching: one interval
    w = read_intervals_csv(str(tmp_path / "trace.csv"), 2)
    c = np.zeros(5, dtype=int)
    t = np.array([12.0, 22.0, 30.0, 110.0, 160.0])
    np.testing.assert_array_equal(online(w, c, t), [True, True, False, False, False])
    np.testing.assert_array_equal(online_until(w, c, t), [25, 25, -INF, -INF, -INF])
    np.testing.assert_array_equal(next_online(w, c, t), [12, 22, 50, INF, INF])
    assert not online(w, np.array([1]), 15.0)[0] and next_online(w, np.array([1]), 0.0)[0] == INF  # no rows


def test_diurnal_is_seeded_and_follows_its_curve():
    d = DiurnalConfig(zone_spread_h=0.0)
    n = 20_000
    w = diurnal(d, n, seed=3)
    again, other = diurnal(d, n, seed=3), diurnal(d, n, seed=4)
    assert all(np.array_equal(getattr(w, k), getattr(again, k)) for k in ("owner", "start", "end", "shift"))
    assert not np.array_equal(w.start, other.start) or not np.array_equal(w.owner, other.owner)
    hours = np.arange(24) + 0.5
    frac = np.array([online(w, np.arange(n), h * 3600).mean() for h in hours])
    np.testing.assert_allclose(frac, diurnal_probability(d, hours), atol=0.02)
    assert frac[2] > 0.75 and frac[14] < 0.15  # online at night (the 2 am peak), off at midday
    # with time zones, each client follows the curve in its own local time
    zoned = diurnal(DiurnalConfig(zone_spread_h=12.0), n, seed=3)
    assert np.ptp(zoned.shift) > 3600
    local = np.array([online(zoned, np.arange(n), np.mod(h * 3600 - zoned.shift, 86_400)).mean() for h in hours])
    np.testing.assert_allclose(local, diurnal_probability(d, hours), atol=0.02)


def test_sample_round_draws_only_online_clients(make_config):
    from dataclasses import replace

    from fedsim.runtime.clock import make_profiles, sample_round

    up = np.zeros(10, dtype=bool)
    up[[1, 3, 6, 8, 9]] = True
    for more in ([], ["participation.availability=0.5"], ["participation.sampling=poisson"]):
        cfg = make_config(*more)
        profiles = replace(make_profiles(cfg), online=up)
        drawn = [sample_round(cfg, r, profiles) for r in range(20)]
        assert all(set(d) <= {1, 3, 6, 8, 9} for d in drawn)
        assert set(np.concatenate(drawn)) == {1, 3, 6, 8, 9}, more  # and every online client is drawn sometimes
        if not more:
            assert all(len(d) == 4 for d in drawn)  # clients_per_round of the 5 online


def _tables(make_config, trace: Path, *more: str, workers: int = 1) -> dict[str, pd.DataFrame]:
    cfg = make_config(f"participation.availability={trace}", "participation.clients_per_round=10",
                      "runtime.threads=1", *more, rounds=2)
    return load(run(cfg, LocalBackend(num_workers=workers)))


def test_sampling_draws_online_clients_and_those_that_leave_mid_round_are_lost(make_config, tmp_path, monkeypatch):
    """Clients 5-9 leave at virtual time 0.001, before any can finish: round 0 records them offline and never runs
    them, and round 1 draws only 0-4. The global model is that of a run where 5-9 are never online."""
    leaving = tmp_path / "leaving.csv"
    leaving.write_text("client,start,end\n" + "".join(f"{c},0,{1000 if c < 5 else 0.001}\n" for c in range(10)))
    absent = tmp_path / "absent.csv"
    absent.write_text("client,start,end\n" + "".join(f"{c},0,1000\n" for c in range(5)))
    ran: list[int] = []
    real = LocalBackend.run_phase
    monkeypatch.setattr(LocalBackend, "run_phase", lambda self, r, pi, ph, bc, assignments, *a, **k: (
        ran.extend(c for cs in assignments.values() for c in cs), real(self, r, pi, ph, bc, assignments, *a, **k))[1])
    one = _tables(make_config, leaving)
    assert sorted(ran) == sorted([0, 1, 2, 3, 4] * 2)  # clients 5-9 never trained
    clients, rounds = one["clients"], one["rounds"]
    first = clients[clients["round"] == 0].set_index("client")
    assert list(first["status"]) == ["ok"] * 5 + ["offline"] * 5
    assert (first.loc[5:, "bytes_up"] == 0).all() and (first.loc[5:, "bytes_down"] > 0).all()
    assert list(clients[clients["round"] == 1]["client"]) == [0, 1, 2, 3, 4]
    assert list(rounds["clients_online"]) == [10, 5] and list(rounds["offline"]) == [5, 0]
    assert list(rounds["participants"]) == [5, 5] and list(rounds["arrived"]) == [5, 5]
    never = _tables(make_config, absent)
    assert list(never["rounds"]["clients_online"]) == [5, 5]
    for col in ("accuracy", "loss", "virtual_time"):
        np.testing.assert_array_equal(rounds[col], never["rounds"][col])
    two = _tables(make_config, leaving, workers=2)  # 1 vs 2 workers: the same tables
    assert two["clients"]["worker"].nunique() == 2
    for name in ("rounds", "clients"):
        keep = [c for c in one[name].columns if not c.endswith("_s") and c != "worker"]
        pd.testing.assert_frame_equal(one[name][keep], two[name][keep], obj=name)


def test_a_round_waits_until_a_client_comes_online(make_config, tmp_path):
    trace = tmp_path / "late.csv"
    trace.write_text("client,start,end\n3,100,1000\n7,250,1000\n")
    rounds = _tables(make_config, trace)["rounds"]
    assert list(rounds["clients_online"]) == [1, 1]  # round 0 starts at 100 with client 3 alone
    assert rounds["virtual_round"].iloc[0] > 100 and rounds["virtual_time"].iloc[1] < 250


class Shell:  # a pickle that names a class: the safe unpickler refuses it
    def __reduce__(self):
        return (eval, ("1",))  # builtins.eval: Ray, once imported, replaces builtins.print


def _entries(**change) -> dict:
    out = {c: {"active": [0], "inactive": [50], "finish_time": 100} for c in range(4)}
    out[1] = {**out[1], **change}
    return out


CSV_CASES = [
    ("client,start,end\n0,0,5\n4,0,5\n", "row 2: client 4 is not one of the run's clients 0..3"),
    ("client,start,end\n0,0,5\n0,3,8\n", "row 2: interval [3, 8] overlaps the one before it"),
    ("client,start,end\n0,10,20\n1,0,1\n0,0,5\n", "row 3: interval [0, 5] starts before the one before it"),
    ("client,start,end\n0,-1,5\n", "row 1: interval [-1, 5] has a negative time"),
    ("client,start,end\n0,6,5\n", "row 1: interval [6, 5] ends before it starts"),
    ("client,start,end\n", "no client is ever online"),
    ("client,start,end\n0,0,x\n", "column end, row 1: 'x' is not a number"),
    ("client,start\n0,0\n", "lacks columns ['end']"),
    ("client,start,end,period\n0,0,5,10\n0,6,7,20\n", "row 1: client 0 has another period"),
    ("client,start,end,period\n0,0,5,10\n1,12,13,10\n", "row 2: interval [12, 13] starts at or after client 1's"),
    ("client,start,end,period\n0,0,5,0\n", "column period, row 1: '0' is not a number in (0, inf]"),
]
PICKLE_CASES = [
    ([{"active": [0]}], "holds a list; FedScale's client_behave_trace is a dict"),
    ({**_entries(), 4: _entries()[0]}, "client 4 is not one of the run's clients 0..3"),
    ({**_entries(), "a": _entries()[0]}, "key 'a' is not a client id"),
    ({c: v for c, v in _entries().items() if c != 2}, "no entry for client 2"),
    ({**_entries(), 1: {"active": [0], "inactive": [5]}}, "client 1's entry lacks ['finish_time']"),
    (_entries(inactive=[5, 9]), "client 1 has 1 active times and 2 inactive ones"),
    (_entries(active=[0, 3], inactive=[5, 9]), "client 1, interval 1: interval [3, 9] overlaps the one before it"),
    (_entries(active=["0"]), "client 1's active is not a list of numbers"),
    (_entries(finish_time=0), "client 1's finish_time 0 is not a positive number"),
    ({c: {**v, "active": [], "inactive": []} for c, v in _entries().items()}, "no client is ever online"),
    ({0: Shell()}, "refusing to load builtins.eval"),
    (_entries(active=np.array([0])), "refusing to load numpy"),  # plain values only: no array either
]


def test_bad_availability_input_is_one_line_and_leaves_no_run_folder(tmp_path, capsys):
    """Every case through `fedsim run`: exit 2, one line naming the key and the file, no run folder left."""
    from jobs.cli import main

    cases: list[tuple[list[str], str]] = []
    for i, (text, fragment) in enumerate(CSV_CASES):
        path = tmp_path / f"case{i}.csv"
        path.write_text(text)
        cases.append(([f"participation.availability={path}"], f"participation.availability: {path}"))
        cases.append(([f"participation.availability={path}"], fragment))
    for i, (obj, fragment) in enumerate(PICKLE_CASES):
        path = tmp_path / f"case{i}.pkl"
        with open(path, "wb") as f:
            pickle.dump(obj, f)
        cases.append(([f"participation.availability={path}"], f"participation.availability: {path}"))
        cases.append(([f"participation.availability={path}"], fragment))
    cases += [
        ([f"participation.availability={tmp_path / 'nope.pkl'}"], "cannot read"),
        (["participation.availability=' '"], "participation.availability: an empty string"),
        (["participation.availability=diurnal", "participation.diurnal.high=0", "participation.diurnal.low=0"],
         "participation.availability: diurnal: no client is ever online"),
        (["participation.availability=diurnal", "participation.diurnal.low=0.9"],
         "participation.diurnal: low (0.9) must not exceed high (0.8)"),
        (["participation.availability=diurnal", "privacy.level=client", "privacy.noise_multiplier=1",
          "algorithm.weighting=uniform"], "privacy.level: participation.availability 'diurnal' makes who joins"),
        ([f"participation.availability={tmp_path / 'good.csv'}", "privacy.level=client", "privacy.noise_multiplier=1",
          "algorithm.weighting=uniform"], f"privacy.level: participation.availability '{tmp_path / 'good.csv'}'"),
    ]
    (tmp_path / "good.csv").write_text("client,start,end\n0,0,5\n")
    results = tmp_path / "results"
    base = {"name": "tiny", "rounds": 1, "data": {"name": "digits", "num_clients": 4, "partition": {"kind": "iid"}},
            "participation": {"clients_per_round": 2}, "runtime": {"backend": "local", "threads": 1},
            "results": {"root": str(results)}}
    config = tmp_path / "tiny.yaml"
    config.write_text(yaml.safe_dump(base))
    seen: dict[tuple[str, ...], str] = {}
    for overrides, fragment in cases:
        key = tuple(overrides)
        if key not in seen:
            args = ["run", str(config), "--quiet"] + [a for o in overrides for a in ("-o", o)]
            assert main(args) == 2, overrides
            err = capsys.readouterr().err
            assert err.startswith("fedsim: error: ") and err.count("\n") == 1 and "Traceback" not in err, err
            seen[key] = err
        assert fragment in seen[key], (fragment, seen[key])
        assert not results.exists(), overrides
