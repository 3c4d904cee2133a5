"""What the runtime enforces of a method's contract: a client state is never lost to a client moving between
workers, and a phase naming a handler the class lacks stops the run before any client trains."""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from fedsim.algorithms.fedavg import FedAvg
from fedsim.algorithms.fedprox import FedProx
from fedsim.errors import AlgorithmError
from fedsim.method.contract import Algorithm, Phase, register_algorithm
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from tests.runtime.test_loop import deterministic

# 6 clients, 4 a round: over 4 rounds most clients come back, and with 2 or 3 workers a balanced phase would put
# some of them on another worker than the one of their last visit
SMALL = ("data.num_clients=6", "participation.clients_per_round=4")


@register_algorithm
class CountingAvg(FedAvg):
    """FedAvg whose clients count their visits in their state: a variant with its own client step."""

    name = "test_counting_avg"

    def phases(self, round):  # it wraps the client step: its phase is no batching opt-in
        return [Phase("train", "sum")]

    def client_step(self, phase, state, msg, ctx):
        res = super().client_step(phase, state, msg, ctx)
        visits = (state or {}).get("visits", 0) + 1
        res.state, res.metrics = {"visits": visits}, {**res.metrics, "visits": float(visits)}
        return res


@register_algorithm
class ClaimsStateless(CountingAvg):
    """The same, but declaring (wrongly) that its clients keep nothing."""

    name = "test_claims_stateless"

    @classmethod
    def stateless_clients(cls, cfg):
        return True


@dataclass
class NoParams:
    pass


@register_algorithm
class MisnamedHandler(Algorithm):
    """A two-handler phase whose client handler is misspelt."""

    name = "test_misnamed_handler"
    Params = NoParams

    def init_server(self, env):
        return 0

    def phases(self, round):
        return [Phase("train", "each", client="train_clientX", server="merge")]

    def train_client(self, state, msg, ctx):
        raise AssertionError("never reached")

    def merge(self, state, updates, info):
        return state, {}


def test_fedavg_variants_with_their_own_client_step_are_stateful_unless_they_say_otherwise(make_config):
    cfg = make_config()
    assert FedAvg.stateless_clients(cfg) and FedProx.stateless_clients(cfg)  # only their weights differ
    assert not CountingAvg.stateless_clients(cfg) and ClaimsStateless.stateless_clients(cfg)
    cfg.train.keep_optimizer_state = True
    assert not FedAvg.stateless_clients(cfg)


def test_a_variants_client_state_survives_whatever_the_number_of_workers(make_config):
    tables = []
    for workers in (1, 2, 3):
        res = load(run(make_config(*SMALL, "algorithm.name=test_counting_avg", f"results.run_id=w{workers}", rounds=4),
                       LocalBackend(num_workers=workers)))
        clients = res["clients"].sort_values(["round", "client"])
        # each client's count is its number of visits so far: nothing was lost when it came back
        expected = clients.groupby("client").cumcount() + 1
        assert (clients["visits"] == expected).all(), (workers, clients[["round", "client", "visits"]])
        assert expected.max() >= 3
        tables.append(deterministic(res["rounds"]))
    assert tables[0].equals(tables[1]) and tables[0].equals(tables[2])


@pytest.mark.parametrize("workers", [1, 2])
def test_a_state_from_clients_declared_stateless_stops_the_run_naming_the_client(make_config, workers):
    cfg = make_config(*SMALL, "algorithm.name=test_claims_stateless")
    with pytest.raises(AlgorithmError, match=r"ClaimsStateless: client \d+ returned a state in phase 'train', but "
                                             r"ClaimsStateless.stateless_clients\(config\) is True"):
        run(cfg, LocalBackend(num_workers=workers))


def test_a_misnamed_handler_stops_the_run_before_any_client_trains(make_config):
    with pytest.raises(AlgorithmError, match="MisnamedHandler: phase 'train' names client handler 'train_clientX', "
                                             "which is not a method of the class"):
        run(make_config(*SMALL, "algorithm.name=test_misnamed_handler"), LocalBackend(num_workers=2))


def test_check_phase_accepts_overridden_hooks_and_named_methods_only() -> None:
    FedAvg.check_phase(Phase("train", "sum"))  # FedAvg overrides client_step and server_step
    MisnamedHandler.check_phase(Phase("train", "each", client="train_client", server="merge"))
    with pytest.raises(AlgorithmError, match="names no server handler and the class does not override server_step"):
        MisnamedHandler.check_phase(Phase("train", "each", client="train_client"))
    with pytest.raises(AlgorithmError, match="names broadcast handler 'name'"):  # an attribute, not a method
        MisnamedHandler.check_phase(Phase("train", "each", broadcast="name", client="train_client", server="merge"))


def test_the_cli_reports_a_contract_error_in_one_line_and_leaves_no_folder(tmp_path, capsys) -> None:
    from jobs.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("name: t\ndata: {name: digits, num_clients: 6}\nmodel: {name: cnn}\nrounds: 2\n"
                   "participation: {clients_per_round: 4}\nalgorithm: {name: test_misnamed_handler}\n"
                   f"results: {{root: {tmp_path / 'results'}}}\n")
    code = main(["run", str(cfg), "--quiet", "--backend", "local"])
    err = capsys.readouterr().err
    assert code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, err
    assert "names client handler 'train_clientX'" in err
    assert not (tmp_path / "results").exists()
