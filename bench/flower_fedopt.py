"""Flower's own server optimisers (flwr.server.strategy FedAdam, FedYogi, FedAdagrad, FedAvgM) stepped from saved
current parameters over a saved sequence of aggregated parameters, in Flower's venv: numpy and flwr only, no fedsim.

    .venv-flower/bin/python -m bench.flower_fedopt STEPS.npz STRATEGY HYPERPARAMETERS_JSON ROUND_OFFSET

STEPS.npz holds `x0_<i>` (the current parameters, one array per layer) and `avg_<t>_<i>` (round t's aggregate).
Each round gives the strategy one client whose parameters are that aggregate, with num_examples 1, so Flower's
FedAvg inside the strategy returns it unchanged. Server round r is t + ROUND_OFFSET (t from 0): Flower's FedAdam
bias-corrects with exponent r + 1. The parameters after every round go to STEPS.<strategy>.flower.npz as
`step_<t>_<i>`.
"""

from __future__ import annotations

import json
import sys
import time

import numpy as np


def layers_of(saved: np.lib.npyio.NpzFile, prefix: str) -> list[np.ndarray]:
    count = sum(1 for k in saved.files if k.startswith(prefix))
    return [saved[f"{prefix}{i}"] for i in range(count)]


def main(argv: list[str]) -> None:
    from flwr.common import Code, FitRes, Status, ndarrays_to_parameters, parameters_to_ndarrays
    from flwr.server.strategy import FedAdagrad, FedAdam, FedAvgM, FedYogi

    path, name, hyper, offset = argv[0], argv[1], json.loads(argv[2]), int(argv[3])
    saved = np.load(path)
    x0 = layers_of(saved, "x0_")
    rounds = sorted({int(k.split("_")[1]) for k in saved.files if k.startswith("avg_")})
    initial = ndarrays_to_parameters(x0)
    classes = {"fedadam": FedAdam, "fedyogi": FedYogi, "fedadagrad": FedAdagrad, "fedavgm": FedAvgM}
    strategy = classes[name](initial_parameters=initial, **hyper)
    out: dict[str, np.ndarray] = {}
    t0 = time.perf_counter()
    for t in rounds:
        aggregate = layers_of(saved, f"avg_{t}_")
        fit = FitRes(status=Status(code=Code.OK, message=""), parameters=ndarrays_to_parameters(aggregate),
                     num_examples=1, metrics={})
        params, _ = strategy.aggregate_fit(t + offset, [(None, fit)], [])
        for i, layer in enumerate(parameters_to_ndarrays(params)):
            out[f"step_{t}_{i}"] = layer
    seconds = time.perf_counter() - t0
    np.savez(path.replace(".npz", f".{name}.flower.npz"), **out)
    print("RESULT_JSON " + json.dumps({"seconds": seconds}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
