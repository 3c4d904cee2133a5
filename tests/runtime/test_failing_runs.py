"""A failing run says so: a round whose every client fails stops the run in one line (exit 1, the finished rounds
kept), some failures give one warning line per run, and a server state that cannot be checkpointed is refused
before round 0 trains."""

from __future__ import annotations

import logging
import textwrap

import pytest

from fedsim.errors import AlgorithmError
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.forked import run_module
from tests.runtime.test_client_failures import FAILING

PLUGIN = textwrap.dedent('''
    from dataclasses import dataclass, field

    from fedsim.algorithms.fedavg import FedAvg
    from fedsim.method import GlobalModels, init_global_models, register_algorithm


    @register_algorithm
    class Broken(FedAvg):
        """FedAvg whose every client raises from round 1 on."""

        name = "broken_from_round_1"

        def local_training(self, phase, state, msg, ctx):
            if ctx.round >= 1:
                raise KeyError(f"no such column in client {ctx.client_id}")
            return super().local_training(phase, state, msg, ctx)


    @dataclass
    class Unregistered:
        models: dict = field(default_factory=dict)


    @register_algorithm
    class Unpackable(FedAvg):
        """FedAvg whose server state is a dataclass nobody registered."""

        name = "unregistered_state"

        def init_server(self, env):
            return Unregistered(models=init_global_models(env))
''')


def _cli(tmp_path, *overrides: str):
    (tmp_path / "broken_plugin.py").write_text(PLUGIN)
    (tmp_path / "run.yaml").write_text("rounds: 3\nplugins: [broken_plugin.py]\ndata: {num_clients: 6}\n"
                                       "participation: {clients_per_round: 3}\nresults: {root: results}\n")
    args = ["run", "run.yaml", "--backend", "local", *[a for o in overrides for a in ("-o", o)]]
    return run_module("jobs.cli", args, cwd=tmp_path)


@pytest.mark.parametrize("override, reason", [
    ("algorithm.name=broken_from_round_1", "KeyError: 'no such column in client"),
    ("train.weight_decay=1e12", "FloatingPointError: diverged: non-finite"),  # legal, but every client diverges
])
def test_a_round_whose_every_client_fails_stops_the_run_in_one_line(tmp_path, override, reason):
    proc = _cli(tmp_path, override)
    assert proc.returncode == 1, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("fedsim: error: round ") and "every client failed (3 of 3)" in last and reason in last
    assert "Traceback" not in proc.stderr
    runs = list((tmp_path / "results").glob("*"))
    if override.startswith("algorithm"):  # round 0 finished: it is kept
        (folder,) = runs
        assert load(folder)["rounds"]["round"].tolist() == [0]
        assert "round 1, phase 'train'" in last
    else:  # round 0 failed: nothing was finished, nothing is left behind
        assert runs == [] and "round 0, phase 'train'" in last


def test_some_failed_clients_give_one_warning_line_per_run(make_config, caplog):
    caplog.set_level(logging.WARNING, logger="fedsim")
    folder = run(make_config(*FAILING), LocalBackend(num_workers=2))
    said = [r.getMessage() for r in caplog.records if r.name.startswith("fedsim")]
    assert said == [f"1 client step(s) failed in 1 round(s); their errors and tracebacks are in "
                    f"{folder / 'clients.parquet'} (rows with status 'failed')"]
    assert load(folder)["meta"]["status"] == "completed"


def test_an_unregistered_state_class_is_refused_before_round_0_trains(tmp_path, make_config, isolated, monkeypatch):
    (tmp_path / "broken_plugin.py").write_text(PLUGIN)
    cfg = make_config(f"plugins=[{tmp_path / 'broken_plugin.py'}]", "algorithm.name=unregistered_state")
    trained: list[int] = []
    backend = LocalBackend(num_workers=1)
    original = backend.run_phase
    monkeypatch.setattr(backend, "run_phase", lambda round, *a, **k: trained.append(round) or original(round, *a, **k))
    with pytest.raises(AlgorithmError, match="Unregistered is not a registered state class; decorate it with "
                                             "@register_state"):
        run(cfg, backend)
    assert trained == [] and not list((tmp_path / "results").glob("*"))

