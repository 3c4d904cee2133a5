"""Model helpers every method uses: build an architecture, copy and load weights, score global models.

An Env fixes the input shape and class count, so `new_model(env, arch)` is all a method needs to build
any registered architecture; states are plain dicts of CPU tensors that pickle and checkpoint unchanged.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedsim import rng
from fedsim.method.contract import Env
from fedsim.models import Classifier, build_model
from fedsim.persist.checkpoint import register_state, register_state_alias
from fedsim.training.train import evaluate_classifier

State = dict[str, torch.Tensor]


@register_state
@dataclass
class GlobalModels:
    """Server state of the FedAvg family: one state dict per architecture."""

    models: dict[str, State] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)


register_state_alias("fedsim.algorithms.fedavg:GlobalModels", GlobalModels)  # checkpoints written before the moves
register_state_alias("fedsim.method.toolkit:GlobalModels", GlobalModels)


def new_model(env: Env, arch: str) -> Classifier:
    """Build an architecture for this run's input shape and class count (weights from torch's global RNG)."""
    shape = env.input_shape
    channels = shape[0] if len(shape) == 3 else 1
    size = shape[-1] if len(shape) == 3 else 0
    return build_model(arch, channels, env.num_classes, size, **env.config.model.options)


def loaded_model(env: Env, arch: str, weights: Mapping[str, torch.Tensor],
                 device: torch.device | str | None = None) -> Classifier:
    """A new instance of `arch` holding `weights`, on `device` (default: the env's); torch's RNG is untouched."""
    with torch.random.fork_rng(devices=[]):
        model = new_model(env, arch)
    model = model.to(device if device is not None else env.device)
    model.load_state_dict(weights)
    return model


def evaluation_model(env: Env, arch: str, weights: Mapping[str, torch.Tensor],
                     device: torch.device | str | None = None) -> Classifier:
    """`arch` holding `weights`, to evaluate with: one instance per architecture and device, reused until the next
    call (a new one draws initial weights only to overwrite them: 1.5 ms for the MLP, 3.6 ms for the CNN)."""
    key = (arch, str(torch.device(device if device is not None else env.device)))
    model = env.evaluation_models.get(key)
    if model is None:
        model = env.evaluation_models[key] = loaded_model(env, arch, weights, device)
    else:
        model.load_state_dict(weights)
    return model


def clone_state(model: torch.nn.Module) -> State:
    """A detached CPU copy of a model's state dict (what a client uploads)."""
    return {k: v.detach().to("cpu", copy=True) for k, v in model.state_dict().items()}


def init_global_models(env: Env) -> dict[str, State]:
    """One freshly initialised model per architecture, from stream "init/<arch>" (torch's global RNG untouched)."""
    return {arch: clone_state(seeded_model(env, arch, rng.seed(env.config.seed, f"init/{arch}")))
            for arch in env.archs}


def seeded_model(env: Env, arch: str, seed: int) -> Classifier:
    """A new instance of `arch` whose initial weights are drawn from `seed`, not from torch's global stream."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return new_model(env, arch)


def evaluate_models(env: Env, models: Mapping[str, State], x_test: torch.Tensor, y_test: torch.Tensor,
                    device: torch.device) -> list[dict[str, Any]]:
    """One row per global model ({"model": arch, "accuracy", "loss"}) on the test set."""
    return [{"model": arch, **evaluate_classifier(evaluation_model(env, arch, weights, device), x_test, y_test,
                                                  env.config.eval.batch_size)}
            for arch, weights in models.items()]
