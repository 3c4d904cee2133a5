"""Opacus's DP-SGD (PrivacyEngine.make_private: Poisson batches, per-sample gradients by hooks, flat clipping, noise)
on fedsim's own model, in Opacus's venv.

    .venv-opacus/bin/python -m bench.opacus_dpsgd time MODEL STEPS REPEAT SEED
    .venv-opacus/bin/python -m bench.opacus_dpsgd grad CASE.pt [CASE.pt ...]

`time` prints RESULT_JSON with the seconds per step of each repeat; `grad` loads a model, a batch and a clip from
each CASE.pt and saves, beside it, the clipped averaged gradient of Opacus's optimizer without noise (CASE.opacus.pt);
several cases share one start of the venv's torch and Opacus.
"""

from __future__ import annotations

import json
import sys
import time

import torch

import bench.dpsgd_bench as shared


def out_of_place(model: torch.nn.Module) -> torch.nn.Module:
    """The model with in-place ReLUs made out-of-place (the same numbers): Opacus's backward hooks forbid in-place
    ops on a hooked module's output."""
    for m in model.modules():
        if isinstance(m, torch.nn.ReLU):
            m.inplace = False
    return model


def private(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, batch: int, noise: float, clip: float):
    from opacus import PrivacyEngine
    from torch.utils.data import DataLoader, TensorDataset

    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loader = DataLoader(TensorDataset(x, y), batch_size=batch)
    return PrivacyEngine(accountant="prv").make_private(module=model, optimizer=opt, data_loader=loader,
                                                        noise_multiplier=noise, max_grad_norm=clip,
                                                        poisson_sampling=True)


def time_steps(name: str, steps: int, repeat: int, seed: int) -> list[float]:
    """Seconds per step of each repeat: `steps` Poisson batches of Opacus's loader, after one warm-up step."""
    torch.set_num_threads(2)
    model, x, y = shared.workload(name, seed)
    model, opt, loader = private(out_of_place(model), x, y, shared.BATCH, shared.NOISE, shared.CLIP)
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(n: int) -> None:
        done = 0
        while done < n:
            for xb, yb in loader:
                opt.zero_grad(set_to_none=True)
                loss_fn(model(xb), yb).backward()
                opt.step()
                done += 1
                if done == n:
                    return

    run(1)
    out = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        run(steps)
        out.append((time.perf_counter() - t0) / steps)
    return out


def clipped_gradient(case: str) -> None:
    """Opacus's averaged clipped gradient of the saved batch (noise 0, expected batch = the batch's size)."""
    from opacus import GradSampleModule
    from opacus.optimizers import DPOptimizer

    saved = torch.load(case, weights_only=False)
    model = GradSampleModule(out_of_place(saved["model"]))
    opt = DPOptimizer(torch.optim.SGD(model.parameters(), lr=1.0), noise_multiplier=0.0,
                      max_grad_norm=saved["clip"], expected_batch_size=len(saved["y"]))
    torch.nn.functional.cross_entropy(model(saved["x"]), saved["y"]).backward()
    opt.pre_step()  # clip each sample's gradient, sum, add (no) noise, divide by the expected batch: p.grad
    grads = {n.removeprefix("_module."): p.grad.detach().clone() for n, p in model.named_parameters()}
    torch.save(grads, case.replace(".pt", ".opacus.pt"))


def main(argv: list[str]) -> None:
    if argv[0] == "grad":
        for case in argv[1:]:
            clipped_gradient(case)
        print("RESULT_JSON " + json.dumps({"ok": True}))
        return
    name, steps, repeat, seed = argv[1], int(argv[2]), int(argv[3]), int(argv[4])
    print("RESULT_JSON " + json.dumps({"model": name, "step_s": time_steps(name, steps, repeat, seed)}))


if __name__ == "__main__":
    main(sys.argv[1:])
