"""The async simulator's own cost per applied update (participation.mode: async): event handling, dispatch draws,
versioning, staleness and the records, beyond the clients' training and the method's server step, with many
clients in flight on a tiny MLP (FedAsync: one version per arrival, the most bookkeeping per update).

    python -m bench.async_bench [--in-flight 1000] [--versions 3000] [--out results/bench]

Reads the run's own wall columns: rounds.parquet's wall_round_s less wall_clients_s (training), wall_server_s (the
server step) and wall_eval_s, per version; and the whole run's wall time less all of those and the start-up (the
tables and checkpoints included). Writes <out>/async_overhead.json; exits 1 past the 0.5 ms target.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

TARGET_MS = 0.5


def measure(in_flight: int, versions: int, root: Path) -> dict[str, float]:
    """One FedAsync run of `versions` versions with `in_flight` clients in flight; its costs per update in ms."""
    from fedsim.configure import load_config
    from fedsim.results.tables import load
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import run

    clients = in_flight + max(in_flight // 4, 16)  # digits has 1,437 training samples: at least one each
    cfg = load_config(None, [
        "name=async-bench", f"rounds={versions}", "data.name=digits", f"data.num_clients={clients}",
        "data.partition.kind=iid", "model.name=mlp", "model.options={hidden: 8}", "train.steps=1",
        "train.batch_size=1", "algorithm.name=fedasync", "participation.mode=async",
        f"participation.concurrency={in_flight}", f"eval.every={versions}", "results.checkpoint_every=0",
        "runtime.backend=local", "runtime.threads=1", f"results.root={root}"])
    t0 = time.perf_counter()
    run_dir = run(cfg, LocalBackend(num_workers=1))
    wall = time.perf_counter() - t0
    rounds = load(run_dir)["rounds"]
    meta = json.loads((Path(run_dir) / "meta.json").read_text())
    trained, server, evaluated = (float(rounds[c].sum()) for c in ("wall_clients_s", "wall_server_s", "wall_eval_s"))
    loop = float((rounds["wall_round_s"] - rounds["wall_clients_s"] - rounds["wall_server_s"]
                  - rounds["wall_eval_s"]).sum())
    updates = int(rounds["updates"].sum())
    whole = wall - trained - server - evaluated - float(meta.get("startup_s", 0.0))
    return {"in_flight": in_flight, "versions": versions, "updates": updates, "wall_s": wall,
            "training_ms": 1e3 * trained / updates, "server_step_ms": 1e3 * server / updates,
            "loop_overhead_ms": 1e3 * loop / updates, "run_overhead_ms": 1e3 * whole / updates}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--in-flight", type=int, default=1000)
    ap.add_argument("--versions", type=int, default=3000)
    ap.add_argument("--out", default="results/bench")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        row = measure(args.in_flight, args.versions, Path(tmp))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "async_overhead.json").write_text(json.dumps(row, indent=2) + "\n")
    print(json.dumps(row, indent=2))
    return 0 if row["loop_overhead_ms"] <= TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
