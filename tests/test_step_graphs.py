"""Clients trained one after another with steps replayed from a captured graph (fedsim.step_graphs,
runtime.cuda_graphs) end with the bits, buffers, momentum and metrics of steps run directly.

On a CPU (CI) the graph is a stand-in that records the step without running it and runs it at each replay, which
is what a CUDA graph does to the tensors; FEDSIM_TEST_DEVICE=cuda runs the same comparisons with real CUDA graphs."""

from __future__ import annotations

import dataclasses
import logging
import math
import os
from collections.abc import Callable

import numpy as np
import pytest
import torch
from torch import nn

import fedsim.local_training as local_training
import fedsim.runtime.batching as batching
import fedsim.step_graphs as step_graphs
import fedsim.train_in_turn as train_in_turn_module
from fedsim.config import TrainConfig
from fedsim.local_training import LocalTraining, Stage
from fedsim.step_graphs import CudaGraph, StepGraphs, cuda_graphs_of, graph_reason, graphs_on, train_replayed
from fedsim.train import make_optimizer, train_classifier
from fedsim.train_batched import Unbatchable
from fedsim.train_in_turn import train_in_turn
from tests.test_train_batched import SIZES as SIZES_W
from tests.test_train_batched import make_worker, one_round

DEVICE = os.environ.get("FEDSIM_TEST_DEVICE", "cpu")
pytestmark = pytest.mark.usefixtures("one_thread")


class EagerGraph:
    """A graph's effect on tensors without a GPU: capturing records the step without running it; a replay runs it."""

    made = 0

    def __init__(self) -> None:
        EagerGraph.made += 1
        self.body: Callable[[], None] | None = None
        self.replays = 0

    def warm_up(self, step: Callable[[], None]) -> None:
        step()

    def capture(self, body: Callable[[], None]) -> None:
        self.body = body

    def replay(self) -> None:
        assert self.body is not None
        self.replays += 1
        self.body()


def graph_maker(device: str) -> Callable[[], step_graphs.Graph]:
    if device == "cuda":
        return lambda: CudaGraph(torch.device("cuda"))
    return EagerGraph


def mlp() -> nn.Module:
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 3))


def cnn() -> nn.Module:
    return nn.Sequential(nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.MaxPool2d(2), nn.Flatten(),
                         nn.Linear(64, 3))


def client_data(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = np.random.default_rng(seed)
    x = torch.from_numpy(g.normal(size=(n, 1, 8, 8)).astype(np.float32)).to(DEVICE)
    y = torch.from_numpy(g.integers(0, 3, n)).to(DEVICE)
    return x, y


SIZES = (40, 13, 24, 8, 34)  # with batch 8: full batches only, and short last batches of 5 and 2


def train_clients(model: nn.Module, train: TrainConfig, graphs: StepGraphs | None,
                  loaded: dict | None = None) -> list[tuple[dict, dict, dict]]:
    """Each client of SIZES from its own start on the one model: its weights and buffers, metrics and optimizer
    state, trained directly (graphs None) or with replays."""
    out = []
    for k, n in enumerate(SIZES):
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(k)).to(p.device) * 0.3)
        x, y = client_data(k, n)
        opt = make_optimizer(model.parameters(), train)
        if loaded is not None:
            opt.load_state_dict(loaded)
        gen = torch.Generator().manual_seed(7 + k)
        if graphs is None:
            metrics = train_classifier(model, x, y, train, gen, optimizer=opt)
        else:
            metrics = train_replayed(model, x, y, train, gen, opt, graphs)
        out.append(({n_: t.detach().clone() for n_, t in model.state_dict().items()}, metrics, opt.state_dict()))
    return out


def assert_identical(direct: list[tuple[dict, dict, dict]], replayed: list[tuple[dict, dict, dict]]) -> None:
    for k, ((sa, ma, oa), (sb, mb, ob)) in enumerate(zip(direct, replayed, strict=True)):
        assert ma == mb, k
        for name in sa:
            assert torch.equal(sa[name], sb[name]), (k, name)
        assert oa["state"].keys() == ob["state"].keys(), k
        for i in oa["state"]:
            assert torch.equal(oa["state"][i]["momentum_buffer"], ob["state"][i]["momentum_buffer"]), (k, i)


def fresh(factory: Callable[[], nn.Module]) -> nn.Module:
    torch.manual_seed(0)
    return factory().to(DEVICE)


@pytest.mark.parametrize("factory", [mlp, cnn], ids=["mlp+bn", "cnn+bn"])
@pytest.mark.parametrize("momentum,decay,epochs", [(0.0, 0.0, 1), (0.9, 0.01, 2), (0.5, 0.0, 1)])
def test_replayed_steps_give_every_client_the_direct_steps_bits(factory, momentum, decay, epochs) -> None:
    train = TrainConfig(lr=0.05, momentum=momentum, weight_decay=decay, batch_size=8, epochs=epochs)
    direct = train_clients(fresh(factory), train, None)
    model = fresh(factory)
    graphs = StepGraphs(model, graph_maker(DEVICE))
    replayed = train_clients(model, train, graphs)
    assert_identical(direct, replayed)
    captured = [s for s in graphs.steps.values() if s is not None]
    assert len(captured) == len(graphs.steps) == 1  # one shape (full batches of 8), one setting
    if DEVICE != "cuda":
        full = sum(epochs * (n // 8) for n in SIZES)
        direct_steps = len(SIZES) if momentum else 1  # the capture's, and each client's first (it makes the momentum)
        assert captured[0].graph.replays == full - direct_steps


def test_a_loaded_momentum_buffer_is_replayed_from_the_first_step() -> None:
    train = TrainConfig(lr=0.05, momentum=0.9, batch_size=8, epochs=1)
    model = fresh(mlp)
    saved = make_optimizer(model.parameters(), train)
    saved.momentum_buffers = [torch.full_like(p, 0.01) for p in saved.params]
    state = saved.state_dict()
    direct = train_clients(fresh(mlp), train, None, loaded=state)
    model = fresh(mlp)
    graphs = StepGraphs(model, graph_maker(DEVICE))
    assert_identical(direct, train_clients(model, train, graphs, loaded=state))
    assert all(torch.equal(b["momentum_buffer"], torch.full_like(b["momentum_buffer"], 0.01))
               for b in state["state"].values())  # the saved state itself was not stepped
    if DEVICE != "cuda":  # every full batch but the one run before the capture, first steps included
        (step,) = graphs.steps.values()
        assert step is not None and step.graph.replays == sum(n // 8 for n in SIZES) - 1


class FailingGraph(EagerGraph):
    def capture(self, body: Callable[[], None]) -> None:
        raise RuntimeError("operation not permitted when stream is capturing\nmore")


def test_a_step_that_cannot_be_captured_runs_directly_with_the_same_numbers(caplog) -> None:
    train = TrainConfig(lr=0.05, momentum=0.9, batch_size=8, epochs=1)
    direct = train_clients(fresh(cnn), train, None)
    model = fresh(cnn)
    graphs = StepGraphs(model, FailingGraph)
    step_graphs._said.clear()
    with caplog.at_level(logging.INFO, logger="fedsim.step_graphs"):
        replayed = train_clients(model, train, graphs)
    assert_identical(direct, replayed)
    assert list(graphs.steps.values()) == [None] and graphs.failed is not None
    said = [r.getMessage() for r in caplog.records if "capturing a step" in r.getMessage()]
    assert said == ["training steps run directly, not replayed from CUDA graphs: capturing a step of Sequential "
                    "failed (RuntimeError: operation not permitted when stream is capturing)"]


def test_models_whose_step_draws_random_numbers_or_reads_the_host_are_not_captured() -> None:
    assert graph_reason(mlp()) is None and graph_reason(cnn()) is None
    assert graph_reason(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.0))) is None
    assert graph_reason(nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.5))) == \
        "model layer '1' (Dropout) draws random numbers"
    assert graph_reason(nn.Sequential(nn.Linear(4, 4), nn.RReLU())) == "model layer '1' (RReLU) draws random numbers"
    assert graph_reason(nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4, momentum=None))) == \
        "model layer '1' (BatchNorm1d) reads its batch count on the host at every step"


def test_graphs_are_on_for_cuda_devices_only() -> None:
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    assert [graphs_on(m, cuda) for m in ("auto", "on", True, "off", False)] == [True, True, True, False, False]
    assert not any(graphs_on(m, cpu) for m in ("auto", "on", True))


def test_new_parameters_get_new_graphs() -> None:
    model = fresh(mlp)
    train = TrainConfig(lr=0.1, batch_size=8)
    opt = make_optimizer(model.parameters(), train)
    first = cuda_graphs_of(model, opt)
    assert cuda_graphs_of(model, make_optimizer(model.parameters(), train)) is first
    model[1].weight.data = model[1].weight.data.clone()  # same parameter object, other storage
    assert cuda_graphs_of(model, make_optimizer(model.parameters(), train)) is not first
    other = fresh(mlp)
    assert not first.holds(model, make_optimizer(other.parameters(), train))  # an optimizer of other parameters


def plan(model: nn.Module, x: torch.Tensor, y: torch.Tensor, train: TrainConfig, graphs: bool,
         stages: tuple[Stage, ...]) -> LocalTraining:
    start = {k: v.clone() for k, v in model.state_dict().items()}
    return LocalTraining(model=model, start=start, x=x, y=y, train=train, generator=torch.Generator().manual_seed(3),
                         finish=lambda m, metrics, opt: (  # type: ignore[arg-type, return-value]
                             {k: v.clone() for k, v in m.state_dict().items()}, metrics, opt),
                         stages=stages, keep_optimizer=True, cuda_graphs=graphs)


def test_local_training_replays_only_plain_sgd_steps(monkeypatch) -> None:
    made: list[StepGraphs] = []

    def of(model: nn.Module, opt) -> StepGraphs:
        made.append(StepGraphs(model, graph_maker(DEVICE)))
        return made[-1]

    monkeypatch.setattr(local_training, "cuda_graphs_of", of)
    train = TrainConfig(lr=0.05, momentum=0.9, batch_size=8)
    x, y = client_data(1, 37)
    stages = (Stage(epochs=1, prefix="pretrain_"), Stage(steps=6))
    direct = plan(fresh(cnn), x, y, train, False, stages).run()
    replayed = plan(fresh(cnn), x, y, train, True, stages).run()
    assert len(made) == 2  # one per stage (a real worker keeps one set per model)
    assert direct[1] == replayed[1]
    assert all(torch.equal(direct[0][k], replayed[0][k]) for k in direct[0])
    assert all(torch.equal(a["momentum_buffer"], b["momentum_buffer"])
               for a, b in zip(direct[2]["state"].values(), replayed[2]["state"].values(), strict=True))
    made.clear()
    prox = plan(fresh(cnn), x, y, train, True, stages)
    prox.mu = 0.1
    prox.run()
    clipped = plan(fresh(cnn), x, y, train, True, stages)
    clipped.clip = 2.0
    clipped.run()
    adam = plan(fresh(cnn), x, y, TrainConfig(lr=0.01, optimizer="adam", batch_size=8), True, stages)
    adam.run()
    assert made == []  # a proximal term, clipped logits and Adam train directly


@pytest.fixture
def in_turn(monkeypatch) -> list[int]:
    """Graphs on for the test's workers (on a CPU the stand-in replays them), and how many clients each call of
    the in-turn trainer trained (so a test knows that it ran)."""
    calls: list[int] = []
    if DEVICE != "cuda":
        monkeypatch.setattr(local_training, "graphs_on", lambda mode, device: mode in ("auto", "on", True))
        monkeypatch.setattr(batching, "graphs_on", lambda mode, device: mode in ("auto", "on", True))
        monkeypatch.setattr(train_in_turn_module, "cuda_graphs_of",
                            lambda model, opt: step_graphs._GRAPHS.setdefault(model, StepGraphs(model, EagerGraph)))

    def counted(plans):
        out = train_in_turn(plans)
        calls.append(len(out))
        return out

    monkeypatch.setattr(batching, "train_in_turn", counted)
    EagerGraph.made = 0
    return calls


def run_both(*overrides: str, rounds: int = 2, **worker_options) -> dict[str, list[list]]:
    """Each round's outcomes of one worker with CUDA graphs off and of one with them on (batching off)."""
    out = {}
    for graphs in ("off", "on"):
        server, worker = make_worker("off", *overrides, f"runtime.cuda_graphs={graphs}", **worker_options)
        out[graphs] = [one_round(server, worker, r) for r in range(rounds)]
    return out


def assert_same_rounds(a_rounds: list[list], b_rounds: list[list]) -> None:
    for a_round, b_round in zip(a_rounds, b_rounds, strict=True):
        for a, b in zip(a_round, b_round, strict=True):
            assert a.status == b.status
            if a.result is None:
                assert b.result is None and a.error.error_message == b.error.error_message
                continue
            assert a.result.metrics == b.result.metrics
            assert all(torch.equal(a.result.payload[k], b.result.payload[k]) for k in a.result.payload)


def test_a_worker_with_cuda_graphs_trains_in_turn_with_the_numbers_of_one_without(in_turn) -> None:
    runs = run_both("model.name=cnn", "train.momentum=0.9")
    assert_same_rounds(runs["off"], runs["on"])
    assert in_turn == [len(SIZES_W)] * 2  # every client of both rounds trained in turn, one group a round
    if DEVICE != "cuda":
        assert EagerGraph.made == 1  # one capture for the worker's model, replayed by every client of both rounds


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverging_client_trained_in_turn_fails_alone(bad: float, in_turn) -> None:
    runs = run_both("model.name=resnet8", rounds=1, bad_client=2, bad_value=bad)
    assert [o.status for o in runs["on"][0]] == ["ok", "ok", "failed", "ok"]
    err = runs["on"][0][2].error
    assert err is not None and err.error_type == "FloatingPointError" and "diverged" in err.error_message
    assert_same_rounds(runs["off"], runs["on"])
    assert in_turn == [len(SIZES_W)]


def test_kept_momentum_trained_in_turn_carries_into_the_next_round(in_turn) -> None:
    runs = run_both("train.keep_optimizer_state=true", "train.momentum=0.9", "model.name=mlp",
                    "model.options={hidden: 8, layers: 1}", rounds=3)
    assert_same_rounds(runs["off"], runs["on"])
    assert in_turn == [len(SIZES_W)] * 3


def test_clients_that_cannot_be_replayed_train_alone_with_the_same_numbers(in_turn) -> None:
    runs = run_both("algorithm.name=fedprox", "algorithm.mu=0.1", rounds=1)
    assert_same_rounds(runs["off"], runs["on"])
    assert in_turn == []  # a proximal term: each client on its own


class Unused(nn.Module):
    """A classifier with a parameter its forward never reads (so a non-finite value there leaves the loss finite)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Flatten(), nn.Linear(64, 3))
        self.extra = nn.Parameter(torch.zeros(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def finished(result: tuple) -> tuple:
    state, metrics, opt = result
    return state, metrics, None if opt is None else [b["momentum_buffer"] for b in opt["state"].values()]


def assert_same_result(a: tuple, b: tuple) -> None:
    (sa, ma, oa), (sb, mb, ob) = finished(a), finished(b)
    assert ma == mb and sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert (oa is None) == (ob is None) and all(torch.equal(x, y) for x, y in zip(oa or [], ob or [], strict=True))


def test_clients_trained_in_turn_end_as_each_alone(in_turn) -> None:
    """Two stages with their own metrics, a loaded momentum state, a client that fails and one whose weights are
    not finite while its loss is: each ends as LocalTraining.run ends, and the plans' generators are left as they
    were (a retry on its own draws the same batches)."""
    train = TrainConfig(lr=0.05, momentum=0.9, batch_size=8)
    stages = (Stage(epochs=1, prefix="pretrain_"), Stage(steps=5))

    def plans(graphs: bool) -> list[LocalTraining]:
        model = fresh(cnn)  # each list from the same start (a plan starts from the weights the model has when made)
        out = [plan(model, *client_data(k, n), train, graphs, stages) for k, n in enumerate((37, 8, 21))]
        saved = make_optimizer(model.parameters(), train)
        saved.momentum_buffers = [torch.full_like(p, 0.02) for p in saved.params]
        out[2].optimizer_state = saved.state_dict()
        out.insert(1, plan(model, torch.zeros(9, 3, 8, 8, device=DEVICE), torch.zeros(9, dtype=torch.long,
                                                                                       device=DEVICE),
                           train, graphs, stages))  # three channels for a one-channel model: its training raises
        return out

    alone = []
    for p in plans(False):
        try:
            alone.append(p.run())
        except RuntimeError as exc:
            alone.append(exc)
    group = plans(True)
    before = [p.generator.get_state() for p in group]
    trained = train_in_turn(group)
    assert all(torch.equal(p.generator.get_state(), s) for p, s in zip(group, before, strict=True))
    assert isinstance(alone[1], RuntimeError) and type(trained[1].error) is type(alone[1])
    for i in (0, 2, 3):
        t = trained[i]
        assert t.error is None and t.finite, (i, t.error)
        assert_same_result(alone[i], group[i].complete(t.state, t.metrics, t.momentum, t.finite))
    assert trained[0].metrics == {"pretrain_train_loss": alone[0][1]["pretrain_train_loss"], "pretrain_steps": 5.0,
                                  "train_loss": alone[0][1]["train_loss"], "steps": 5.0}
    # an epoch, then 5 steps of 8 (an epoch of 37 ends in 5; of 21 in 5, then 8 + 8 of the next)
    assert [t.samples for t in trained] == [37 + 37, 0, 8 + 5 * 8, 21 + 21 + 16]

    bad = Unused().to(DEVICE)
    with torch.no_grad():
        bad.extra.fill_(float("inf"))
    x, y = client_data(5, 16)
    direct = plan(bad, x, y, train, False, stages)
    with pytest.raises(FloatingPointError, match="diverged: non-finite weight 'extra'"):
        direct.run()
    t = train_in_turn([plan(bad, x, y, train, True, stages)])[0]
    assert t.error is None and not t.finite and math.isfinite(t.metrics["train_loss"])
    with pytest.raises(FloatingPointError, match="diverged: non-finite weight 'extra'"):
        plan(bad, x, y, train, True, stages).complete(t.state, t.metrics, t.momentum, t.finite)


def test_a_saved_state_with_other_sgd_settings_is_not_trained_in_turn(in_turn) -> None:
    """Finishing in turn rebuilds the optimizer state from the run's settings, so a state saved with others (a
    resumed run whose config changed) trains alone, where its own settings are kept."""
    train = TrainConfig(lr=0.05, momentum=0.9, batch_size=8)
    model = fresh(cnn)
    saved = make_optimizer(model.parameters(), dataclasses.replace(train, lr=0.1))
    saved.momentum_buffers = [torch.zeros_like(p) for p in saved.params]
    p = plan(model, *client_data(1, 16), train, True, (Stage(),))
    p.optimizer_state = saved.state_dict()
    with pytest.raises(Unbatchable, match="the saved optimizer state has other SGD settings than the run's"):
        train_in_turn([p])
