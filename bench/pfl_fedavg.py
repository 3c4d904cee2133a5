"""The prepared FedAvg workload on pfl-research (`pfl[pytorch]`): its FederatedAveraging algorithm, its simulated
aggregation backend and its PyTorchModel, doing the same math as the plain loop.

    .venv-pfl/bin/python -m bench.pfl_fedavg --workload <folder from bench.prepare> [--processes 1|2] [--threads N]
                                             [--device cpu|cuda]

Run it from the repository root. `--processes 2` starts two workers through `torchrun` (pfl's documented way to
run a simulation on several processes: each takes a share of every cohort, and the statistics are summed over
gloo), one torch thread each; the launcher (bench.pfl_launch, which imports no torch) starts them, samples the
memory of the whole tree and prints the RESULT_JSON. What it shares with the other programs:
- the clients: pfl's user sampler is a callable returning the next user id; `DrawSampler` returns the prepared
  draws in order, and each user's data set carries its client's shuffle seed;
- the training: pfl's local loop over `ClientBatches`, which draws a fresh permutation per epoch from the
  client's seed exactly as `bench.common.train_client` does, with torch's SGD (momentum, no dampening: the same
  update as `bench.common.sgd_step`) on the model's `loss` (cross-entropy);
- the averaging: pfl sums the model differences weighted by the clients' sample counts (`WeightByDatapoints`)
  and applies their mean; the variable map holds every state entry, BatchNorm buffers included, and
  `ApplyMean` adds the mean to each entry (truncated for the integer batch counter);
- the evaluation: `bench.common.evaluate` on the test set after every round, in a callback; pfl's per-user
  evaluation before and after local training is off.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()
T_START_WALL = time.time()

import sys  # noqa: E402

if __name__ == "__main__":  # the several-process launcher only waits on torchrun: it starts before torch loads
    from bench.pfl_launch import launcher_main, launches, parse

    if launches(_args := parse(sys.argv[1:])):
        sys.exit(launcher_main(_args, T_START, T_START_WALL))

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
from collections.abc import Iterator  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from bench.common import (  # noqa: E402
    CNN,
    MLP,
    BenchError,
    Prepared,
    ResNet8,
    Workload,
    evaluate,
    load_prepared,
)
from bench.pfl_launch import announce, launcher_main, launches, measured, parse  # noqa: E402

# ---------------------------------------------------------------------------------------------------------
# The pieces that need no pfl (the tests run them in fedsim's venv)
# ---------------------------------------------------------------------------------------------------------


class DrawSampler:
    """pfl's user sampler (`() -> user id`): the prepared draws, round after round, each in client-id order.

    pfl may sample ahead of the rounds (its multi-process cohort sampler fills a cache), so after the last round
    the sequence starts over; those extra ids are never trained.
    """

    def __init__(self, draws) -> None:
        self.order = [int(c) for row in draws for c in row]
        self.calls = 0

    def __call__(self) -> int:
        cid = self.order[self.calls % len(self.order)]
        self.calls += 1
        return cid


class ClientBatches:
    """A client's shard in `bench.common.train_client`'s batch order: every pass draws a fresh permutation from a
    torch generator seeded with the client's shuffle seed, so pass e of pfl's epoch loop is epoch e of the plain
    loop."""

    def __init__(self, x: torch.Tensor, y: torch.Tensor, seed: int) -> None:
        self.x, self.y = x, y
        self.generator = torch.Generator(device="cpu")
        self.generator.manual_seed(int(seed))

    def __len__(self) -> int:
        return len(self.y)

    def epoch(self, batch_size: int) -> Iterator[list[torch.Tensor]]:
        perm = torch.randperm(len(self.y), generator=self.generator)
        for start in range(0, len(self.y), batch_size):
            idx = perm[start:start + batch_size]
            yield [self.x[idx], self.y[idx]]


class PflHooks:
    """The two methods pfl's PyTorchModel calls on the module: `loss` (training mode, mean cross-entropy, as the
    plain loop's step) and `metrics` (only for pfl's own evaluations, which this program switches off)."""

    def loss(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        self.train()
        return F.cross_entropy(self(x), y)

    @torch.no_grad()
    def metrics(self, x: torch.Tensor, y: torch.Tensor) -> dict:
        from pfl.metrics import Weighted

        self.eval()
        logits = self(x)
        return {"loss": Weighted(F.cross_entropy(logits, y, reduction="sum").item(), len(y)),
                "accuracy": Weighted((logits.argmax(1) == y).sum().item(), len(y))}


class PflResNet8(PflHooks, ResNet8):
    """bench.common's ResNet-8 (same state names) with pfl's hooks."""


class PflMLP(PflHooks, MLP):
    """bench.common's MLP (same state names) with pfl's hooks."""


class PflCNN(PflHooks, CNN):
    """bench.common's CNN (same state names) with pfl's hooks."""


def build_pfl_model(name: str) -> nn.Module:
    """The workload's model with pfl's `loss` and `metrics` methods."""
    if name == "resnet8":
        return PflResNet8()
    if name == "mlp":
        return PflMLP()
    if name == "cnn":
        return PflCNN()
    raise BenchError(f"model: unknown model {name!r}")


def state_variables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every state entry pfl must average: the trainable parameters (its default variable map) plus all buffers
    (BatchNorm's running statistics and batch counter), which pfl would otherwise leave out of the mean and carry
    over from one client to the next."""
    out = {k: v for k, v in model.named_parameters() if v.requires_grad}
    out.update(dict(model.named_buffers()))
    return out


def local_optimizer(params, lr: float, momentum: float) -> torch.optim.Optimizer:
    """The client's fresh optimizer: torch's SGD with momentum and no dampening, `bench.common.sgd_step`'s update."""
    return torch.optim.SGD(params, lr=lr, momentum=momentum)


class ApplyMean(torch.optim.Optimizer):
    """pfl's central optimizer: it hands over the mean model difference as `-grad`; this adds it to each entry.

    Unlike torch's SGD it takes integer entries too (their grad is the truncated mean), so the global state is
    global + mean difference for every entry, BatchNorm buffers included.
    """

    def __init__(self, tensors) -> None:
        super().__init__(list(tensors), {"lr": 1.0})  # pfl reports the central learning rate: 1, the mean as is

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for t in group["params"]:
                if t.grad is not None:
                    t.sub_(t.grad.to(t.dtype))
        return None


def train_params(p: Prepared) -> dict:
    """pfl's NNTrainHyperParams for the workload (the local loop's epochs, learning rate and batch size)."""
    w = p.workload
    return {"local_num_epochs": w.local_epochs, "local_learning_rate": w.lr, "local_batch_size": w.batch_size}


# ---------------------------------------------------------------------------------------------------------
# pfl
# ---------------------------------------------------------------------------------------------------------


@dataclass
class Stats:
    """What the evaluation callback records (wall clock, so the launcher can compare with its own)."""

    loop_start: float = float("nan")
    round_end: list[float] = field(default_factory=list)
    acc: list[float] = field(default_factory=list)
    loss: list[float] = field(default_factory=list)


def run_pfl(p: Prepared, threads: int, stats: Stats, log=print) -> dict[str, torch.Tensor]:
    """All rounds on pfl in this process (one of the torchrun workers when launched so); the final global state."""
    from pfl.aggregate.simulate import SimulatedBackend
    from pfl.aggregate.weighting import WeightByDatapoints
    from pfl.algorithm import FederatedAveraging, NNAlgorithmParams
    from pfl.callback.base import TrainingProcessCallback
    from pfl.data.dataset import Dataset
    from pfl.data.federated_dataset import FederatedDataset
    from pfl.hyperparam import NNTrainHyperParams
    from pfl.internal.ops.selector import get_default_framework_module
    from pfl.metrics import Metrics
    from pfl.model.pytorch import PyTorchModel

    torch.set_num_threads(threads)
    w = p.workload
    seeds = {(r, c): s for r in range(w.rounds) for c, s in p.round_clients(r)}
    drawn = {c for r in range(w.rounds) for c, _ in p.round_clients(r)}
    sizes = p.shard_sizes()

    class SeededClient(Dataset):
        """A user's data set whose batches come from `ClientBatches` (fresh seeded permutation per epoch)."""

        def __init__(self, batches: ClientBatches, cid: int) -> None:
            super().__init__([batches.x, batches.y], user_id=cid)
            self.batches = batches

        def iter(self, batch_size):  # noqa: A003
            yield from self.batches.epoch(batch_size)

    current = {"round": 0}  # set as each round starts: a client drawn in several rounds gets each round's seed

    def make_user(cid: int) -> SeededClient:
        x, y = p.client_data(cid)
        return SeededClient(ClientBatches(x, y, seeds[(current["round"], cid)]), cid)

    distributed = get_default_framework_module().distributed
    weights = {c: int(sizes[c]) for c in drawn} if distributed.world_size > 1 else None
    users = FederatedDataset(make_user, DrawSampler(p.draws), user_id_to_weight=weights)
    module = build_pfl_model(w.model)
    module.load_state_dict(p.initial_state())
    variables = state_variables(module)
    model = PyTorchModel(module, lambda params, lr: local_optimizer(params, lr, w.momentum),
                         ApplyMean(variables.values()))
    model.variable_map.update(variables)  # BatchNorm buffers join the average
    device = next(module.parameters()).device  # pfl's default device (PFL_PYTORCH_DEVICE), where it put the model
    x_test, y_test = (t.to(device) for t in p.test_data())
    is_main = distributed.global_rank == 0

    class CentralEvaluation(TrainingProcessCallback):
        """The global model on the test set after every round (main worker), timestamps for the round times."""

        def after_central_iteration(self, aggregate_metrics, model, *, central_iteration):
            if is_main:
                acc, loss = evaluate(module, x_test, y_test, w.eval_batch_size)
                stats.acc.append(acc)
                stats.loss.append(loss)
                ends = [stats.loop_start, *stats.round_end, time.time()]
                stats.round_end.append(ends[-1])
                log(f"[pfl] round {central_iteration + 1}: {ends[-1] - ends[-2]:.3f}s acc={acc:.4f} loss={loss:.4f}")
            return False, Metrics()

    class NoUserEvaluation(FederatedAveraging):
        """FedAvg without pfl's per-user evaluation before and after local training (it would double the work)."""

        def get_next_central_contexts(self, model_, iteration, *args, **kwargs):
            import dataclasses

            current["round"] = iteration
            contexts, model_, metrics = super().get_next_central_contexts(model_, iteration, *args, **kwargs)
            if contexts is not None:
                contexts = tuple(dataclasses.replace(c, do_evaluation=False) for c in contexts)
            return contexts, model_, metrics

    algorithm_params = NNAlgorithmParams(central_num_iterations=w.rounds, evaluation_frequency=w.rounds + 1,
                                         train_cohort_size=w.clients_per_round, val_cohort_size=0)
    backend = SimulatedBackend(training_data=users, val_data=None, postprocessors=[WeightByDatapoints()])
    stats.loop_start = time.time()
    NoUserEvaluation().run(algorithm_params=algorithm_params, backend=backend, model=model,
                           model_train_params=NNTrainHyperParams(**train_params(p)),
                           callbacks=[CentralEvaluation()], send_metrics_to_platform=False)
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def result_fields(p: Prepared, stats: Stats) -> dict:
    """The fields the main worker measured (round times from its evaluation callback)."""
    w = p.workload
    ends = [stats.loop_start, *stats.round_end]
    return {"round_times": [b - a for a, b in zip(ends, ends[1:])], "loop_start": stats.loop_start,
            "last_round_end": stats.round_end[-1] if stats.round_end else None, "round_end_wall": stats.round_end,
            "samples": [int(p.shard_sizes()[p.draws[r]].sum()) for r in range(len(stats.round_end))],
            "final_accuracy": round(stats.acc[-1], 4) if stats.acc else None,
            "final_loss": round(stats.loss[-1], 4) if stats.loss else None, "rounds_done": len(stats.round_end),
            "R": w.rounds}


def worker(args: argparse.Namespace) -> int:
    """One torchrun worker: run pfl; the main one writes what it measured for the launcher."""
    p = load_prepared(args.workload)
    stats = Stats()
    run_pfl(p, args.threads, stats, log=lambda m: print(m, flush=True))
    if int(os.environ.get("RANK", "0")) == 0:
        Path(args.worker_result).write_text(json.dumps(result_fields(p, stats)))
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if args.worker_result:
        return worker(args)
    if launches(args):
        return launcher_main(args, T_START, T_START_WALL)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("pfl_fedavg: error: --device cuda: no CUDA device here", file=sys.stderr)
        return 2

    def body() -> tuple[Workload, dict]:
        p = load_prepared(args.workload)
        announce(p.workload, args)
        os.environ["PFL_PYTORCH_DEVICE"] = args.device
        stats = Stats()
        run_pfl(p, args.threads, stats, log=lambda m: print(m, flush=True))
        return p.workload, result_fields(p, stats)

    return measured(args, T_START, T_START_WALL, body)


if __name__ == "__main__":
    sys.exit(main())
