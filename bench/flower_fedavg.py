"""The prepared FedAvg workload on Flower's simulation engine (Message API: ClientApp, ServerApp, a FedAvg
strategy, `run_simulation` on Ray), doing the same math as the plain loop and fedsim.

    .venv-flower/bin/python -m bench.flower_fedavg --workload <folder from bench.prepare> [--client-cpus 1]

Run it from the repository root (its actors import `bench.common`). What it shares with the other programs:
- the clients: Flower's own sampling cannot reproduce the prepared draws, so the strategy's `configure_train`
  sends round r's message to the nodes of the prepared draw, node i (in node-id order) playing client i; the
  message names the client and its shuffle seed;
- the training: `client_train` runs `bench.common.client_update`, the plain loop's per-client step;
- the averaging: `aggregate_train` takes `bench.common.WeightedMean` over the replies (Flower's own average
  would turn BatchNorm's integer counter into a float);
- the evaluation: `evaluate_fn` runs `bench.common.evaluate` on the test set after every round (the call
  before round 1 does nothing, as the plain loop does not evaluate before training);
- the initial weights: init.pt.
Client-side evaluation is off. Prints a line per round and a final `RESULT_JSON {...}`. Telemetry is off.
"""

from __future__ import annotations

import time

T_START = time.perf_counter()
T_START_WALL = time.time()

import os  # noqa: E402

os.environ.setdefault("FLWR_TELEMETRY_ENABLED", "0")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import argparse  # noqa: E402
import sys  # noqa: E402
from dataclasses import dataclass, field  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import torch  # noqa: E402

from bench.cli import OneLineParser  # noqa: E402
from bench.common import (  # noqa: E402
    BenchError,
    Prepared,
    TreeMemSampler,
    WeightedMean,
    build_model,
    client_update,
    emit_result,
    evaluate,
    load_prepared,
    pss_interval_from_env,
    round_summary,
)

REPO = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------------------
# The pieces that need no flwr (the tests run them in fedsim's venv)
# ---------------------------------------------------------------------------------------------------------


def train_configs(p: Prepared, server_round: int, threads: int) -> list[tuple[int, dict[str, Any]]]:
    """Flower round `server_round` (1-based): the prepared draw, each client with the config its message carries."""
    return [(cid, {"workload": str(p.folder.resolve()), "client": cid, "seed": seed, "threads": threads})
            for cid, seed in p.round_clients(server_round - 1)]


_ACTOR: dict[str, Any] = {}  # per actor process: the prepared folder it opened and its one reused model


def client_train(state: dict[str, torch.Tensor], config) -> tuple[dict[str, torch.Tensor], int, float]:
    """One ClientApp call: train the client named in `config` from the global `state`; (new state, samples, loss)."""
    folder = str(config["workload"])
    if _ACTOR.get("folder") != folder:
        p = load_prepared(folder)
        _ACTOR.clear()
        _ACTOR.update(folder=folder, prepared=p, model=build_model(p.workload.model))
    torch.set_num_threads(int(config["threads"]))
    return client_update(_ACTOR["model"], state, _ACTOR["prepared"], int(config["client"]), int(config["seed"]))


def aggregate(results: list[tuple[int, dict[str, torch.Tensor], int]]) -> dict[str, torch.Tensor]:
    """The sample-weighted mean of (client id, state, samples) results, summed in client-id order."""
    mean = WeightedMean()
    for _, state, n in sorted(results, key=lambda r: r[0]):
        mean.add(state, n)
    return mean.result(results[0][1])


class CentralEvaluation:
    """The global model on the test set, with one reused model."""

    def __init__(self, p: Prepared) -> None:
        self.model = build_model(p.workload.model)
        self.x, self.y = p.test_data()
        self.batch_size = p.workload.eval_batch_size

    def __call__(self, state: dict[str, torch.Tensor]) -> tuple[float, float]:
        self.model.load_state_dict(state)
        return evaluate(self.model, self.x, self.y, self.batch_size)


# ---------------------------------------------------------------------------------------------------------
# Flower
# ---------------------------------------------------------------------------------------------------------


def train_handler(msg, context):
    """The ClientApp's train function (module level, so Ray's actors import it rather than unpickle a copy)."""
    from flwr.app import ArrayRecord, Message, MetricRecord, RecordDict

    t0 = time.time()
    cfg = msg.content["config"]
    state, n, loss = client_train(msg.content["arrays"].to_torch_state_dict(), cfg)
    metrics = MetricRecord({"num-examples": n, "train-loss": loss, "client": int(cfg["client"]), "t-start": t0,
                            "t-end": time.time(), "pid": os.getpid()})
    return Message(content=RecordDict({"arrays": ArrayRecord(state), "metrics": metrics}), reply_to=msg)


@dataclass
class Stats:
    """What the server side records while the strategy runs."""

    round_end: dict[int, float] = field(default_factory=dict)
    acc: dict[int, float] = field(default_factory=dict)
    loss: dict[int, float] = field(default_factory=dict)
    clients: list[dict] = field(default_factory=list)
    t_main: float = float("nan")
    t_strategy_done: float = float("nan")


def make_apps(p: Prepared, args: argparse.Namespace, stats: Stats):
    """The ClientApp and the ServerApp (whose strategy draws the prepared clients and averages like the others)."""
    from flwr.app import ArrayRecord, ConfigRecord, Message, MessageType, MetricRecord, RecordDict
    from flwr.clientapp import ClientApp
    from flwr.serverapp import ServerApp
    from flwr.serverapp.strategy import FedAvg

    w = p.workload
    client_app = ClientApp()
    client_app.train()(train_handler)

    class PreparedDrawsFedAvg(FedAvg):
        """FedAvg whose rounds train the prepared draw and whose average is bench.common's."""

        def configure_train(self, server_round, arrays, config, grid):
            nodes = sorted(grid.get_node_ids())
            while len(nodes) < w.num_clients:  # all simulated nodes register before the first round
                time.sleep(0.5)
                nodes = sorted(grid.get_node_ids())
            return [Message(content=RecordDict({"arrays": arrays, "config": ConfigRecord(cfg)}),
                            message_type=MessageType.TRAIN, dst_node_id=nodes[cid])
                    for cid, cfg in train_configs(p, server_round, args.client_threads)]

        def aggregate_train(self, server_round, replies):
            replies = list(replies)
            ok = [m for m in replies if not m.has_error()]
            for m in replies:
                if m.has_error():
                    print(f"[flower] round {server_round}: a client failed: {m.error.reason}", flush=True)
            if not ok:
                return None, None
            results, ms = [], []
            for m in ok:
                metrics = m.content["metrics"]
                ms.append(metrics)
                results.append((int(metrics["client"]), m.content["arrays"].to_torch_state_dict(),
                                int(metrics["num-examples"])))
            stats.clients.append({"clients": len(ok), "failures": len(replies) - len(ok),
                                  "samples": sum(r[2] for r in results),
                                  "first_start": min(float(m["t-start"]) for m in ms),
                                  "last_end": max(float(m["t-end"]) for m in ms),
                                  "pids": sorted({int(m["pid"]) for m in ms})})
            loss = sum(float(m["train-loss"]) * float(m["num-examples"]) for m in ms) / stats.clients[-1]["samples"]
            return ArrayRecord(aggregate(results)), MetricRecord({"train-loss": loss})

    server_app = ServerApp()

    @server_app.main()
    def server_main(grid, context) -> None:
        stats.t_main = time.perf_counter()
        torch.set_num_threads(args.server_threads)
        central = CentralEvaluation(p)

        def evaluate_fn(server_round: int, arrays):
            t = time.perf_counter()
            if server_round == 0:  # before training: the other programs do not evaluate here
                stats.round_end[0] = t
                return None
            acc, loss = central(arrays.to_torch_state_dict())
            stats.round_end[server_round] = te = time.perf_counter()
            stats.acc[server_round], stats.loss[server_round] = acc, loss
            c = stats.clients[-1] if stats.clients else {}
            print(f"[flower] round {server_round}: {te - stats.round_end[server_round - 1]:.3f}s (eval {te - t:.3f}s, "
                  f"clients {c.get('clients')}, actor pids {c.get('pids')}) samples={c.get('samples')} "
                  f"acc={acc:.4f} loss={loss:.4f}", flush=True)
            return MetricRecord({"accuracy": acc, "loss": loss})

        strategy = PreparedDrawsFedAvg(fraction_train=w.clients_per_round / w.num_clients, fraction_evaluate=0.0,
                                       min_train_nodes=w.clients_per_round, min_available_nodes=w.num_clients)
        strategy.start(grid=grid, initial_arrays=ArrayRecord(p.initial_state()), num_rounds=w.rounds,
                       evaluate_fn=evaluate_fn)
        stats.t_strategy_done = time.perf_counter()

    return client_app, server_app


def main(argv: list[str] | None = None) -> int:
    ap = OneLineParser(prog="python -m bench.flower_fedavg", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--client-cpus", type=float, default=1.0, help="client_resources num_cpus (actors = CPUs / this)")
    ap.add_argument("--client-threads", type=int, default=0, help="torch threads per client call (0: client CPUs)")
    ap.add_argument("--server-threads", type=int, default=2, help="torch threads of the server's evaluation")
    ap.add_argument("--ray-cpus", type=int, default=2)
    ap.add_argument("--verbose", action="store_true")
    ap.add_argument("--tag", default="")
    args = ap.parse_args(argv)
    args.client_threads = args.client_threads or max(1, int(args.client_cpus))
    try:
        sampler = TreeMemSampler(pss_interval=pss_interval_from_env())
        sampler.start()
        p = load_prepared(args.workload)
    except BenchError as exc:
        print(f"flower_fedavg: error: {exc}", file=sys.stderr)
        return 2
    from flwr.simulation import run_simulation

    # the apps are built from this module under its import name, which Ray's actors import (the repository
    # goes on their path below) instead of unpickling copies of __main__'s functions
    from bench import flower_fedavg as app_module

    t_imported = time.perf_counter()
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    torch.set_num_threads(args.server_threads)
    w = p.workload
    print(f"[flower] N={w.num_clients} K={w.clients_per_round} R={w.rounds} model={w.model} "
          f"client_cpus={args.client_cpus} client_threads={args.client_threads} "
          f"server_threads={args.server_threads}", flush=True)
    stats = app_module.Stats()
    client_app, server_app = app_module.make_apps(p, args, stats)
    backend_config = {"client_resources": {"num_cpus": args.client_cpus, "num_gpus": 0.0},
                      "init_args": {"num_cpus": args.ray_cpus, "num_gpus": 0, "include_dashboard": False,
                                    "_node_ip_address": "127.0.0.1"}}
    run_simulation(server_app=server_app, client_app=client_app, num_supernodes=w.num_clients,
                   backend_config=backend_config, verbose_logging=args.verbose)
    t_done = time.perf_counter()
    sampler.stop()
    ends = stats.round_end
    round_times = [ends[r] - ends[r - 1] for r in range(1, w.rounds + 1) if r in ends and r - 1 in ends]
    cs = stats.clients
    emit_result({
        "system": "flower", "tag": args.tag, "api": "run_simulation + ServerApp/ClientApp (Message API)",
        "N": w.num_clients, "K": w.clients_per_round, "R": w.rounds, "E": w.local_epochs, "model": w.model,
        "client_cpus": args.client_cpus, "client_threads": args.client_threads, "server_threads": args.server_threads,
        "import_seconds": round(t_imported - T_START, 3),
        "startup_seconds": round(ends.get(0, t_done) - T_START, 3),
        "to_first_client_start_seconds": round(cs[0]["first_start"] - T_START_WALL, 3) if cs else None,
        "sim_return_after_strategy_seconds": round(t_done - stats.t_strategy_done, 3),
        **round_summary(round_times, [c["samples"] for c in cs], T_START, t_done),
        "client_span_seconds": [round(c["last_end"] - c["first_start"], 3) for c in cs],
        "client_failures": sum(c["failures"] for c in cs),
        "actor_pids": sorted({pid for c in cs for pid in c["pids"]}),
        **sampler.fields(),
        "final_accuracy": round(stats.acc.get(w.rounds, float("nan")), 4),
        "final_loss": round(stats.loss.get(w.rounds, float("nan")), 4),
        "pid": os.getpid(),
    })
    return 0


if __name__ == "__main__":
    sys.exit(main())
