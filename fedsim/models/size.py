"""A model's memory, estimated before it is allocated: built on the meta device (which allocates nothing), and
refused in one line when this machine has less available."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsim import memory
from fedsim.errors import ConfigError, FedsimError
from fedsim.memory import human
from fedsim.models.registry import build_model

MODEL_COPIES_DRIVER = 2  # the global model and the sum of the clients' uploads
MODEL_COPIES_TRAINING = 2  # where clients train too (the local backend): a client's copy and its gradients


def model_parameter_bytes(arch: str, input_shape: tuple[int, ...], num_classes: int,
                          options: Mapping[str, Any]) -> tuple[int, int] | None:
    """(parameters, bytes of parameters and buffers) of `arch` for this input, from an instance built on the meta
    device; None when the builder cannot build there (the real build then speaks for itself)."""
    import torch


    channels = input_shape[0] if len(input_shape) == 3 else 1
    size = input_shape[-1] if len(input_shape) == 3 else 0
    try:
        with torch.device("meta"):
            model = build_model(arch, channels, num_classes, size, **options)
    except FedsimError:
        raise
    except Exception:  # a builder that computes with real values (meta tensors hold none)
        return None
    tensors = [*model.parameters(), *model.buffers()]
    return sum(p.numel() for p in model.parameters()), sum(t.numel() * t.element_size() for t in tensors)


def check_models(cfg: Any, input_shape: tuple[int, ...], num_classes: int, trains_here: bool) -> None:
    """Refuse, in one line naming the model and its options, a run whose models this machine cannot hold: the
    driver keeps MODEL_COPIES_DRIVER copies of each (and, where the clients train in this process,
    MODEL_COPIES_TRAINING more)."""
    copies = MODEL_COPIES_DRIVER + (MODEL_COPIES_TRAINING if trains_here else 0)
    have = memory.available_bytes()  # read through the module, so a test may set it
    for arch in dict.fromkeys(cfg.model.mix or [cfg.model.name]):
        found = model_parameter_bytes(arch, input_shape, num_classes, cfg.model.options)
        if found is None or found[1] * copies <= have:
            continue
        params, nbytes = found
        key = (f"model.options {cfg.model.options}" if cfg.model.options else
               "model.mix" if cfg.model.mix else "model.name")
        raise ConfigError(f"{key}: model {arch!r} for inputs {'×'.join(map(str, input_shape))} has {params:,} "
                          f"parameters ({human(nbytes)}); a run holds about {copies} copies "
                          f"({human(nbytes * copies)}), more than the {human(have)} of memory available here")
