"""Training a worker's same-architecture clients together (fedsim.training.batched, runtime.batch_clients=on) gives
every client the weights, buffers and metrics that training them one after another gives, to float rounding."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
from unittest import mock

import numpy as np
import pytest
import torch
from torch import nn

import fedsim.runtime.batching as batching
import fedsim.runtime.worker as worker_module
from fedsim.config.schema import TrainConfig
from fedsim.configure import load_config
from fedsim.method.contract import ClientResult, RoundInfo
from fedsim.method.sums import WeightedSum
from fedsim.runtime.server import Server
from fedsim.runtime.setup import Partition, Ragged
from fedsim.runtime.worker import ClientOutcome, ClientWorker
from fedsim.training.batched import Unbatchable, train_together, unbatchable_reason
from fedsim.training.local import LocalTraining, Stage
from tests.conftest import ROOT

DEVICE = os.environ.get("FEDSIM_TEST_DEVICE", "cpu")  # "cuda" runs these comparisons on a GPU (where one is lent)
SIZES = (7, 13, 40, 21)  # with batch 8: 1, 2, 5 and 3 steps an epoch, three of them ending in a partial batch


pytestmark = pytest.mark.usefixtures("one_thread")  # fixtures one_thread and together: tests/conftest.py


def make_worker(mode: str, *overrides: str, sizes: tuple[int, ...] = SIZES, bad_client: int | None = None,
                bad_value: float = float("nan")) -> tuple[Server, ClientWorker]:
    """A server and one worker over random 1×8×8 inputs of 3 classes, client k holding sizes[k] samples."""
    n = sum(sizes)
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 1, 8, 8)).astype(np.float32)
    y = (np.arange(n) % 3).astype(np.int64)
    bounds = np.cumsum([0, *sizes])
    if bad_client is not None:
        x[bounds[bad_client]] = bad_value
    arrays = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    part = Partition(Ragged.from_list([np.arange(bounds[i], bounds[i + 1]) for i in range(len(sizes))]),
                     Ragged.from_list([np.array([], int)] * len(sizes)), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    cfg = load_config(None, [f"data.num_clients={len(sizes)}", "seed=3", "train.batch_size=8", "train.lr=0.05",
                             f"runtime.batch_clients={mode}", *overrides])
    return Server(cfg, arrays, part, meta, device=DEVICE), ClientWorker(cfg, arrays, part, meta, 0, device=DEVICE)


class RecordingSum(WeightedSum):
    """The worker's sum, keeping a copy of each upload it adds (the reply carries only the sum)."""

    uploads: dict[int | str, dict[str, torch.Tensor]] = {}

    def add(self, payload: object, weight: float, client: int | str = "?") -> None:
        assert isinstance(payload, dict)
        RecordingSum.uploads[client] = {k: v.detach().clone() for k, v in payload.items()}
        super().add(payload, weight, client)


def one_round(server: Server, worker: ClientWorker, round: int = 0) -> list[ClientOutcome]:
    """Every client's outcome of one round, each with the upload the worker added to its sum."""
    phase = server.phases(round)[0]
    ids = list(range(len(worker.part.train)))
    bc = server.broadcast(phase, RoundInfo(round, phase.name, ids, ids, {i: 1 for i in ids})).broadcast
    RecordingSum.uploads = {}
    with mock.patch.object(worker_module, "WeightedSum", RecordingSum):
        outcomes = worker.run_phase(round, 0, phase, bc.common, bc.per_client or {}, ids).outcomes
    return [o if o.result is None else dataclasses.replace(
        o, result=dataclasses.replace(o.result, payload=RecordingSum.uploads[o.client_id])) for o in outcomes]


def assert_same_outcomes(one_by_one: list[ClientOutcome], batched: list[ClientOutcome], atol: float = 2e-5) -> None:
    assert [o.status for o in batched] == [o.status for o in one_by_one]
    for a, b in zip(one_by_one, batched):
        if a.result is None or b.result is None:
            assert a.result is b.result is None
            continue
        assert a.result.metrics.keys() == b.result.metrics.keys()
        for k, v in a.result.metrics.items():
            assert b.result.metrics[k] == pytest.approx(v, rel=1e-5, abs=1e-6), (a.client_id, k)
        pa, pb = a.result.payload, b.result.payload
        assert pa.keys() == pb.keys()
        for k in pa:
            assert pa[k].dtype == pb[k].dtype and pa[k].shape == pb[k].shape
            if pa[k].is_floating_point():
                torch.testing.assert_close(pb[k], pa[k], atol=atol, rtol=1e-5, msg=f"client {a.client_id} {k}")
            else:
                assert torch.equal(pa[k], pb[k]), (a.client_id, k)


CASES = {
    "mlp, momentum and weight decay, 2 epochs": ("mlp", "{hidden: 16, layers: 2}",
                                                 ["train.momentum=0.9", "train.weight_decay=0.01", "train.epochs=2"]),
    "cnn, plain SGD": ("cnn", "{}", ["train.momentum=0"]),
    "lenet, FedProx": ("lenet", "{}", ["algorithm.name=fedprox", "algorithm.mu=0.5"]),
    "resnet8 (BatchNorm), 2 epochs, weight decay": ("resnet8", "{}", ["train.epochs=2", "train.weight_decay=0.001"]),
    "resnet8, fixed steps, FedProx": ("resnet8", "{}", ["train.steps=7", "algorithm.name=fedprox",
                                                        "algorithm.mu=0.1"]),
    "mlp, 3 clients per batch": ("mlp", "{hidden: 8, layers: 1}", ["train.steps=3",
                                                                    "runtime.batch_clients_max=3"]),
    "two architectures": (None, None, ["model.mix={mlp: 2, cnn: 2}"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_every_clients_weights_match_one_after_another(case: str, together: list[int]) -> None:
    name, options, extra = CASES[case]
    model = [f"model.name={name}", f"model.options={options}"] if name else []
    outcomes = {mode: one_round(*make_worker(mode, *model, *extra)) for mode in ("off", "on")}
    assert_same_outcomes(outcomes["off"], outcomes["on"])
    assert sum(together) == len(SIZES)  # every client was trained together with others
    if "3 clients" in case:
        assert together == [3, 1]
    if "two" in case:
        assert together == [2, 2]  # one group per architecture
    if name == "resnet8":  # the running buffers are per client: each tracked its own batches
        tracked = [int(o.result.payload["resnet8/stem.1.num_batches_tracked"]) for o in outcomes["on"]]
        steps = [int(o.result.metrics["steps"]) for o in outcomes["on"]]
        assert tracked == steps and steps == ([7] * 4 if "fixed" in case else [2, 4, 10, 6])


@pytest.mark.skipif(DEVICE == "cuda", reason="on a GPU the batched matrix products round by the number of clients "
                    "(an H100 parted every model's weights in the last bits between groups of 1 to 4)")
def test_a_clients_weights_do_not_depend_on_which_clients_share_its_group(together: list[int]) -> None:
    """Each step is padded to the batch size, not to the group's longest batch, so a client's shapes are its own:
    on the CPU, for a model of linear layers, its weights are the same bits in a group of four, of three and one, of
    two and two, and alone (a worker's group is the clients that it holds, so this keeps a batched run's numbers
    from depending on runtime.num_workers). A convolution's weight gradient still depends on the number of groups."""
    mlp = ["model.name=mlp", "model.options={hidden: 16, layers: 2}", "train.momentum=0.9", "train.epochs=2"]
    runs = {}
    for most in (4, 3, 2, 1):
        together.clear()
        runs[most] = {o.client_id: o.result.payload for o in one_round(*make_worker("on", *mlp,
                                                                                  f"runtime.batch_clients_max={most}"))}
        assert together == {4: [4], 3: [3, 1], 2: [2, 2], 1: [1, 1, 1, 1]}[most]
    for most in (3, 2, 1):
        for client, upload in runs[4].items():
            for k, v in upload.items():
                assert torch.equal(runs[most][client][k], v), (most, client, k)


def test_kept_optimizer_state_matches_and_carries_into_the_next_round(together: list[int]) -> None:
    extra = ["train.keep_optimizer_state=true", "train.momentum=0.9", "model.name=mlp",
             "model.options={hidden: 8, layers: 1}"]
    states, rounds = {}, {}
    for mode in ("off", "on"):
        server, worker = make_worker(mode, *extra)
        one_round(server, worker, 0)  # the momentum buffers are kept
        states[mode] = worker.export_states()
        rounds[mode] = one_round(server, worker, 0)  # same broadcast again, starting from the kept momentum
    assert states["off"].keys() == states["on"].keys() == set(range(len(SIZES)))
    for cid, st in states["off"].items():
        got = states["on"][cid]["optimizer"]
        assert got["param_groups"] == st["optimizer"]["param_groups"]
        assert got["state"].keys() == st["optimizer"]["state"].keys() and len(got["state"]) == 4
        for i, s in st["optimizer"]["state"].items():
            torch.testing.assert_close(got["state"][i]["momentum_buffer"], s["momentum_buffer"], atol=1e-5, rtol=1e-5)
    assert_same_outcomes(rounds["off"], rounds["on"])
    assert sum(together) == 2 * len(SIZES)


@pytest.mark.parametrize("bad", [float("nan"), float("inf")])
def test_a_diverging_client_fails_alone(bad: float, together: list[int]) -> None:
    outcomes = {mode: one_round(*make_worker(mode, "model.name=resnet8", bad_client=2, bad_value=bad))
                for mode in ("off", "on")}
    for mode, out in outcomes.items():
        assert [o.status for o in out] == ["ok", "ok", "failed", "ok"], mode
        err = out[2].error
        assert err is not None and err.error_type == "FloatingPointError" and "diverged" in err.error_message
    assert_same_outcomes(outcomes["off"], outcomes["on"])
    assert sum(together) == len(SIZES)


class DropNet(nn.Module):
    def __init__(self, p: float, channel: bool = False) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), (nn.Dropout1d if channel else nn.Dropout)(p),
                                  nn.Linear(16, 3))
        nn.init.uniform_(self.body[0].weight, -0.5, 0.5)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def plan(model: nn.Module, n: int, seed: int, dropout_seed: int = 0) -> LocalTraining:
    """A client of `n` random samples whose batches come from `seed`, finishing with its trained weights."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, 4, generator=g), torch.randint(0, 3, (n,), generator=g)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        start = DropNet(0.0).state_dict()
    return LocalTraining(model, start, x, y, TrainConfig(lr=0.1, momentum=0.9, batch_size=4, epochs=2),
                         torch.Generator().manual_seed(seed), finish, (Stage(2),), dropout_seed=dropout_seed)


def finish(model: nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
    return ClientResult(payload={k: v.detach().clone() for k, v in model.state_dict().items()}, metrics=metrics)


def weights(plans: list[LocalTraining]) -> list[dict[str, torch.Tensor]]:
    return [p.complete(t.state, t.metrics, t.momentum).payload for p, t in zip(plans, train_together(plans))]


def test_dropout_masks_come_from_each_clients_own_seed() -> None:
    net = DropNet(0.5)
    alone = weights([plan(net, 10, 1, dropout_seed=11)])[0]
    grouped = weights([plan(net, 23, 2, dropout_seed=12), plan(net, 10, 1, dropout_seed=11),
                       plan(net, 6, 3, dropout_seed=13)])[1]
    for k in alone:  # the same masks whoever the client trains with
        torch.testing.assert_close(grouped[k], alone[k], atol=1e-6, rtol=1e-6)
    other_seed = weights([plan(net, 10, 1, dropout_seed=99)])[0]
    no_dropout = weights([plan(DropNet(0.0), 10, 1, dropout_seed=11)])[0]
    for other in (other_seed, no_dropout):
        assert not torch.allclose(other["body.3.weight"], alone["body.3.weight"], atol=1e-4)
    sequential = plan(DropNet(0.0), 10, 1).run().payload  # without dropout both paths agree
    for k in sequential:
        torch.testing.assert_close(no_dropout[k], sequential[k], atol=1e-6, rtol=1e-5)


def test_a_model_that_cannot_be_batched_runs_one_by_one_and_is_logged_once(caplog) -> None:
    net = DropNet(0.5, channel=True)
    assert "Dropout1d" in (unbatchable_reason(net) or "")
    assert unbatchable_reason(DropNet(0.5)) is None and "recurrent" in (unbatchable_reason(nn.LSTM(2, 2)) or "")
    batcher = batching.ClientBatcher("on", 8, torch.device("cpu"), worker_index=5)
    caplog.set_level("INFO", logger="fedsim.batching")
    for _ in range(2):
        with torch.random.fork_rng():
            torch.manual_seed(7)  # the clients' channel dropout draws from torch's global stream, one by one
            done = dict(batcher.train({0: plan(net, 10, 1), 1: plan(net, 7, 2)}, {0: 0.0, 1: 0.0}))
            torch.manual_seed(7)
            alone = [plan(net, 10, 1).run(), plan(net, 7, 2).run()]
        assert all(err is None and res is not None and seconds >= 0 for res, err, seconds in done.values())
        for cid, expect in enumerate(alone):
            res = done[cid][0]
            assert res is not None and res.metrics == expect.metrics and res.metrics["steps"] == [6.0, 4.0][cid]
            for k, v in expect.payload.items():
                assert torch.equal(res.payload[k], v)
    records = [r.getMessage() for r in caplog.records if r.name == "fedsim.batching"]
    assert len(records) == 1 and "worker 5" in records[0] and "Dropout1d" in records[0]


def test_a_methods_own_loss_trains_one_by_one_with_that_loss() -> None:
    """A plan with extra_loss (FedDyn's linear term) or batch_loss (MOON's contrastive term) is not trained together:
    the batcher falls back to each plan's run, which trains the loss it was given; DP-SGD refuses a batch_loss."""
    net = DropNet(0.0)
    pull = {n: torch.full_like(p, 0.5) for n, p in net.named_parameters()}

    def extra(model: nn.Module) -> torch.Tensor:  # −⟨g, θ⟩: its gradient −g pulls every weight up
        return -sum((p * pull[n]).sum() for n, p in model.named_parameters())

    def doubled(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return 2 * nn.functional.cross_entropy(model(x), y)

    plain = plan(net, 10, 1).run().payload
    for options in ({"extra_loss": extra}, {"batch_loss": doubled}):
        plans = {0: dataclasses.replace(plan(net, 10, 1), **options), 1: dataclasses.replace(plan(net, 7, 2),
                                                                                             **options)}
        with pytest.raises(Unbatchable, match="own loss"):
            train_together(list(plans.values()))
        done = dict(batching.ClientBatcher("on", 8, torch.device("cpu")).train(plans, {0: 0.0, 1: 0.0}))
        alone = dataclasses.replace(plan(net, 10, 1), **options).run().payload  # a fresh generator
        assert done[0][1] is None and all(torch.equal(done[0][0].payload[k], v) for k, v in alone.items())
        assert not torch.allclose(alone["body.0.weight"], plain["body.0.weight"], atol=1e-4)
    dp = mock.Mock()
    with pytest.raises(ValueError, match="batch_loss"):
        dataclasses.replace(plan(net, 10, 1), batch_loss=doubled, dp=dp).run()


def test_stages_restart_momentum_and_report_each_stage_as_one_after_another() -> None:
    """Two stages (the personal baselines' pre-training, then the round's epochs), each with a fresh optimizer, a
    proximal term and clipped logits (FedDF's local training): the same weights and per-stage metrics."""
    def staged(n: int, seed: int) -> LocalTraining:
        p = plan(net, n, seed)
        p.stages, p.mu, p.clip = (Stage(1, prefix="pretrain_"), Stage(2), Stage(0, steps=3, prefix="extra_")), 0.3, 0.5
        return p

    net = DropNet(0.0)
    batched = weights([staged(9, 4), staged(17, 5), staged(3, 6)])
    for got, (n, seed) in zip(batched, [(9, 4), (17, 5), (3, 6)]):
        expect = staged(n, seed).run().payload
        for k in expect:
            torch.testing.assert_close(got[k], expect[k], atol=1e-6, rtol=1e-5)
    metrics = plan(net, 9, 4)
    metrics.stages = (Stage(1, prefix="pretrain_"), Stage(2))
    trained = train_together([metrics])[0].metrics
    assert trained.keys() == {"pretrain_train_loss", "pretrain_steps", "train_loss", "steps"}
    assert (trained["pretrain_steps"], trained["steps"]) == (3.0, 6.0)


def test_check_finite_flags_nan_and_inf_but_not_large_finite_weights():
    from fedsim.training.local import check_finite

    huge = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows
    check_finite({"train_loss": 1.0}, {"w": huge, "n": torch.tensor(3)})
    for bad in (float("nan"), float("inf"), -float("inf")):
        with pytest.raises(FloatingPointError, match="diverged: non-finite weight 'w'"):
            check_finite({"train_loss": 1.0}, {"w": torch.tensor([1.0, bad, 2.0])})
    with pytest.raises(FloatingPointError, match=r"diverged: non-finite train_loss \(nan\)"):
        check_finite({"train_loss": float("nan")}, {"w": huge})


def test_the_group_finiteness_check_names_exactly_the_clients_with_a_non_finite_entry() -> None:
    """train_together checks every client's weights at once (one wait on a GPU); a client it clears skips the
    per-tensor scan. Large finite float32 entries do not overflow the float64 sums; integer buffers are skipped."""
    from fedsim.training.batched import _finite_rows

    big = torch.full((4, 3, 5), torch.finfo(torch.float32).max)
    weights = torch.zeros(4, 7)
    weights[1, 2], weights[3, 0] = float("inf"), float("nan")
    counts = torch.tensor([1, 2, 3, 4])
    assert _finite_rows([big, weights, counts], 4) == [True, False, True, False]
    assert _finite_rows([counts], 4) == [True] * 4


def test_a_batched_phase_never_imports_the_compiler() -> None:
    """torch.func.grad imports torch._dynamo and torch._inductor (1-3 s per process, in the first round): the batched
    trainer differentiates the vmapped losses with plain autograd instead. A vmapped F.cross_entropy goes through a
    decomposition that imports sympy (0.7 s of the first batched phase): the loss is a log-softmax and a gather."""
    heavy = ('torch._dynamo', 'torch._inductor', 'sympy', 'torch.fx.experimental.symbolic_shapes')
    code = ("import sys\nimport fedsim.runtime.batching as b\n"
            "from tests.test_train_batched import make_worker, one_round\n"
            "real, trained = b.train_together, []\n"
            "def counted(plans):\n    out = real(plans)\n    trained.append(len(plans))\n    return out\n"
            "b.train_together = counted\n"
            "outcomes = one_round(*make_worker('on', 'model.name=cnn', 'train.momentum=0.9'))\n"
            "assert all(o.status == 'ok' for o in outcomes), outcomes\n"
            "assert trained == [len(outcomes)], trained  # trained together, not one after another\n"
            f"print(sorted(m for m in {heavy!r} if m in sys.modules))")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[]"
