"""Participation, device profiles, deadlines and over-selection on the virtual clock."""

from __future__ import annotations

import math

import numpy as np
import pytest

from fedsim.errors import DataError
from fedsim.runtime.clock import durations, make_profiles, sample_round, schedule


def test_sampling_is_seeded_per_round(make_config):
    cfg = make_config()
    rounds = [sample_round(cfg, r, make_profiles(cfg)) for r in range(5)]
    assert all(len(s) == 4 and np.all(np.diff(s) > 0) for s in rounds)
    again = [sample_round(cfg, r, make_profiles(cfg)) for r in range(5)]
    assert all(np.array_equal(a, b) for a, b in zip(rounds, again))
    assert len({tuple(s) for s in rounds}) > 1


def test_availability_limits_the_pool(make_config):
    cfg = make_config("participation.availability=0.3", "participation.clients_per_round=10")
    sizes = [len(sample_round(cfg, r, make_profiles(cfg))) for r in range(20)]
    assert max(sizes) < 10 and 0 < np.mean(sizes) < 6


def test_fixed_deadline_drops_exactly_the_slow(make_config):
    cfg = make_config("stragglers.enabled=true", "stragglers.deadline=fixed", "stragglers.deadline_value=2.0")
    sampled = np.array([1, 3, 5, 7])
    sch = schedule(cfg, sampled, np.array([1.0, 2.5, 2.0, 3.0]))
    assert list(sch.participants) == [1, 3, 5, 7] and list(sch.late) == [3, 7] and sch.deadline == 2.0


def test_quantile_deadline_and_over_selection(make_config):
    cfg = make_config("stragglers.enabled=true", "stragglers.over_select=0.5", "stragglers.deadline=quantile",
                      "stragglers.deadline_value=0.5")
    sampled = np.array([0, 2, 4, 6, 8, 9])
    sch = schedule(cfg, sampled, np.array([5.0, 1.0, 4.0, 2.0, 3.0, 9.0]))
    assert list(sch.participants) == [2, 4, 6, 8]  # the fastest K = 4
    assert list(sch.over_selected) == [0, 9]
    assert sch.deadline == pytest.approx(2.5) and list(sch.late) == [4, 8]
    assert len(sample_round(cfg, 0, make_profiles(cfg))) == 6  # ceil(4 · 1.5) sampled


def test_disabled_stragglers_keep_everyone(make_config):
    sch = schedule(make_config(), np.array([0, 1]), np.array([1.0, 100.0]))
    assert list(sch.late) == [] and math.isinf(sch.deadline)


def test_durations_combine_transfer_and_compute(make_config):
    cfg = make_config("stragglers.speed={dist: constant, mean: 2.0}",
                      "stragglers.bandwidth_mbps={dist: constant, mean: 8.0}", "stragglers.sample_seconds=0.1",
                      "train.epochs=3")
    prof = make_profiles(cfg)
    d = durations(cfg, prof, np.array([0, 1]), np.array([10, 20]), np.array([1e6, 1e6]), np.array([1e6, 0.0]))
    # 8 Mbit/s = 1e6 B/s; compute = samples · epochs · 0.1 s / speed 2
    np.testing.assert_allclose(d, [2.0 + 1.5, 1.0 + 3.0])


def test_trace_file(tmp_path, make_config):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps,availability\n" + "".join(
        f"{c},{c + 1},{8 * (c + 1)},1.0\n" for c in range(10)))
    prof = make_profiles(make_config(f"stragglers.trace={trace}"))
    assert prof.speed[3] == 4 and prof.bandwidth[3] == 4e6
    trace.write_text("client,speed\n0,1\n")
    with pytest.raises(DataError, match="lacks columns"):
        make_profiles(make_config(f"stragglers.trace={trace}"))


def test_a_bad_trace_fails_before_the_backend_starts_its_workers(make_config, tmp_path):
    """The device trace is read before the workers start: on Ray a typo in its path costs no Ray start."""
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import run

    started: list[int] = []

    class Recorded(LocalBackend):
        def start(self, *args, **kwargs):
            started.append(1)
            return super().start(*args, **kwargs)

    cfg = make_config("stragglers.enabled=true", f"stragglers.trace={tmp_path / 'no_such_trace.csv'}")
    with pytest.raises(DataError, match=r"^stragglers.trace: cannot read .*no_such_trace.csv"):
        run(cfg, Recorded())
    assert started == []
    assert run(make_config("stragglers.enabled=true", "results.run_id=ok"), Recorded()) and started == [1]
