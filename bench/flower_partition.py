"""flwr-datasets' own partitioners, in Flower's venv, on the labels and natural ids that a test saved: each case
is a FederatedDataset(shuffle=True, seed) over a parquet file of (label, id, idx) with one partitioner, and what
comes back is every partition's `idx` column, the original positions of its samples. No fedsim.

    .venv-flower/bin/python -m bench.flower_partition DATA.npz CASES.json OUT.json

DATA.npz holds `label` and `id` (int64, one per sample); CASES.json is a list of {"kind", "seed", "num_clients",
and the options under fedsim's data.partition names}; OUT.json gets one list of index lists per case.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np


def partitioner(case: dict):
    """The flwr_datasets partitioner of a case (fedsim's kind and option names)."""
    from flwr_datasets import partitioner as fp

    kind, k, seed = case["kind"], case.get("num_clients"), case["seed"]
    if kind == "iid":
        return fp.IidPartitioner(k)
    if kind in ("linear", "square", "exponential"):
        return {"linear": fp.LinearPartitioner, "square": fp.SquarePartitioner,
                "exponential": fp.ExponentialPartitioner}[kind](k)
    if kind == "dirichlet":
        return fp.DirichletPartitioner(k, "label", case["alpha"], min_partition_size=case["min_samples"],
                                       self_balancing=case.get("self_balancing", False), seed=seed)
    if kind == "inner_dirichlet":
        return fp.InnerDirichletPartitioner(case["sizes"], "label", case["alpha"], seed=seed)
    if kind == "pathological":
        return fp.PathologicalPartitioner(k, "label", case["classes_per_client"],
                                          class_assignment_mode=case["class_assignment"], seed=seed)
    if kind == "shards":
        return fp.ShardPartitioner(k, "label", num_shards_per_partition=case.get("shards_per_client"),
                                   shard_size=case.get("shard_size"),
                                   keep_incomplete_shard=case.get("keep_incomplete", False), seed=seed)
    if kind == "natural_id":
        return fp.NaturalIdPartitioner("id")
    if kind == "grouped_natural_id":
        return fp.GroupedNaturalIdPartitioner("id", case["group_size"], mode=case["group_mode"])
    raise SystemExit(f"bench.flower_partition: unknown kind {kind!r}")


def main(argv: list[str]) -> None:
    data_path, cases_path, out_path = argv
    os.environ.setdefault("HF_HOME", tempfile.mkdtemp(prefix="fedsim-hf-"))
    os.environ["HF_DATASETS_OFFLINE"] = "1"
    os.environ["HF_HUB_OFFLINE"] = "1"
    os.environ["HF_DATASETS_DISABLE_PROGRESS_BARS"] = "1"
    import datasets
    from flwr_datasets import FederatedDataset

    saved = np.load(data_path)
    table = datasets.Dataset.from_dict({"label": saved["label"].tolist(), "id": saved["id"].tolist(),
                                        "idx": list(range(len(saved["label"])))})
    parquet = os.path.join(os.environ["HF_HOME"], "train.parquet")
    table.to_parquet(parquet)
    cases = json.loads(open(cases_path).read())
    out: list = [None] * len(cases)
    for seed in sorted({c["seed"] for c in cases}):  # one FederatedDataset a seed, a split (the same file) a case
        mine = {f"case{i}": partitioner(c) for i, c in enumerate(cases) if c["seed"] == seed}
        fds = FederatedDataset(dataset="parquet", data_files=dict.fromkeys(mine, parquet), partitioners=mine,
                               shuffle=True, seed=seed)
        for split, p in mine.items():
            fds.load_partition(0, split)  # assigns the split to the partitioner, which then counts its partitions
            out[int(split[4:])] = [fds.load_partition(i, split)[:]["idx"]
                                   for i in range(p.num_partitions)]
    with open(out_path, "w") as fh:
        json.dump(out, fh)
    print("RESULT_JSON " + json.dumps({"cases": len(out)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
