"""Bytes moved between nodes per round: a prepared bench workload run by fedsim on a Ray cluster of several nodes
on this machine (ray.cluster_utils.Cluster: a head holding only the driver, and worker nodes of one client worker
each, placed by runtime.placement=spread).

    python -m bench.multinode_traffic --workload <folder from bench.prepare> [--nodes 2] [--rounds R]

Prints, per stage (the start, then each round), the bytes created in each node's object store (put there, or
pulled there from another node; bench.store_traffic). On a worker node that is what came in (the dataset at the start,
each phase's broadcast) plus the replies its workers put there for the driver; on the head, the driver's puts
plus the replies it pulled. Replies under Ray's inline limit (100 KiB) travel in the call's answer instead and are
not counted.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import sys
import tempfile
from collections.abc import Iterator
from typing import TYPE_CHECKING

from bench.cli import OneLineParser
from bench.runner import out_of_range
from fedsim.config.limits import MAX_ROUNDS, MAX_WORKERS

if TYPE_CHECKING:
    from bench.common import Workload

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

STORE_BYTES = 600 * 1024**2  # each node's object store: the dataset (270 MB for configs A-C) fits without spilling


@contextlib.contextmanager
def unpublished() -> Iterator[None]:
    """While inside, ray.cluster_utils.Cluster neither writes nor deletes /tmp/ray/ray_current_cluster, the file
    where `ray start` publishes a cluster for any `ray.init()` on the machine to join: a cluster started for one
    bench or test would otherwise draw in every Ray run that starts meanwhile (a head with no CPUs: its workers
    wait), and its shutdown would remove the address of a cluster the user started."""
    from ray._common import utils as common
    from ray._private import utils as private

    keep = private.write_ray_address, common.reset_ray_address
    private.write_ray_address = common.reset_ray_address = lambda *a, **k: None
    try:
        yield
    finally:
        private.write_ray_address, common.reset_ray_address = keep


def parse(argv: list[str] | None) -> argparse.Namespace:
    """The arguments, their ranges checked (one line, exit 2) before Ray or a temporary folder is touched."""
    ap = OneLineParser(prog="bench.multinode_traffic", description=__doc__.splitlines()[0])
    ap.add_argument("--workload", required=True, help="a folder written by `python -m bench.prepare`")
    ap.add_argument("--nodes", type=int, default=2, help="worker nodes, one single-CPU client worker each")
    ap.add_argument("--rounds", type=int, default=None, help="rounds to run, at least 1 (default: the workload's)")
    args = ap.parse_args(argv)
    problem = out_of_range("--nodes", args.nodes, 1, MAX_WORKERS)
    if args.rounds is not None:
        problem = problem or out_of_range("--rounds", args.rounds, 1, MAX_ROUNDS)
    if problem:
        ap.error(problem)
    return args


def workload_of(args: argparse.Namespace) -> Workload:
    """The prepared workload, with client draws for every round --rounds asks for (BenchError naming the argument)."""
    from bench.common import BenchError, load_prepared

    try:
        w = load_prepared(args.workload).workload
    except BenchError as exc:
        raise BenchError(f"--workload: {exc}") from None
    if args.rounds is not None and args.rounds > w.rounds:
        raise BenchError(f"--rounds: {args.workload} has client draws for {w.rounds} rounds, not {args.rounds}")
    return w


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    from bench.common import BenchError
    from fedsim.errors import FedsimError

    try:
        w = workload_of(args)
        out = tempfile.mkdtemp(prefix="fedsim-traffic-")  # the run's results, removed with it
        try:
            traffic(args, w, args.rounds or w.rounds, out)
        finally:
            shutil.rmtree(out, ignore_errors=True)
    except (BenchError, FedsimError) as exc:
        print(f"bench.multinode_traffic: error: {exc}", file=sys.stderr)
        return 2
    return 0


def traffic(args: argparse.Namespace, w: Workload, rounds: int, out: str) -> None:
    """Run the workload on a Ray cluster of `args.nodes` worker nodes, results under `out`, and print the bytes
    each node's object store took in per stage."""
    import pandas as pd
    import ray
    from ray import cluster_utils

    from actors.pool import RayBackend
    from bench.store_traffic import StoreTraffic
    from bench.workload import make_config, prepared_inputs
    from fedsim.runtime.loop import run

    cfg = make_config(w, ["runtime.backend=ray", "runtime.client_cpus=1", f"runtime.num_workers={args.nodes}",
                          "runtime.placement=spread", f"rounds={rounds}", f"results.root={out}"])
    with unpublished():
        cluster = cluster_utils.Cluster(initialize_head=True,
                                        head_node_args={"num_cpus": 0, "object_store_memory": STORE_BYTES})
    try:
        for _ in range(args.nodes):
            cluster.add_node(num_cpus=1, object_store_memory=STORE_BYTES)
        cluster.wait_for_nodes()
        repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        ray.init(address=cluster.address, configure_logging=False, log_to_driver=False,
                 runtime_env={"env_vars": {"PYTHONPATH": repo, "RAY_USAGE_STATS_ENABLED": "0"}})
        assert cluster.head_node is not None
        head = cluster.head_node.node_id
        store = StoreTraffic()
        run(cfg, RayBackend(), callbacks=[store], inputs=prepared_inputs(cfg, args.workload))
        table = pd.DataFrame(store.rows()).pivot(index="stage", columns="node", values="bytes")
        table = table.reindex(["start"] + [f"round {r}" for r in range(rounds)])
        workers = [c for c in table.columns if c != head]
        table = table.rename(columns={head: "head"} | {n: f"node {i + 1}" for i, n in enumerate(workers)})
        table["worker nodes"] = table[[f"node {i + 1}" for i in range(len(workers))]].sum(axis=1)
        print(f"N={w.num_clients} K={w.clients_per_round} model={w.model}, {args.nodes} worker nodes; "
              "bytes created in each node's object store:")
        print((table / 1e6).round(3).rename(columns=lambda c: f"{c} (MB)").to_string())
    finally:
        ray.shutdown()
        with unpublished():
            cluster.shutdown()


if __name__ == "__main__":
    sys.exit(main())
