"""The model registry: a name maps to a builder taking the input shape and class count."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from fedsim import registry
from fedsim.config.knobs import check_kwargs
from fedsim.errors import ConfigError


class Classifier(nn.Module):
    """A classifier that exposes its penultimate embedding.

    Subclasses implement `embed(x) -> (N, embed_dim)` and `head(z) -> logits`; `forward` composes them.
    """

    embed_dim: int

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def head(self, z: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.embed(x))


Builder = Callable[..., Classifier]
_BUILDERS: dict[str, Builder] = registry.table("model")


def register_model(name: str) -> Callable[[Builder], Builder]:
    """Register `fn(in_channels: int, num_classes: int, image_size: int, **kw) -> Classifier`."""

    def wrap(fn: Builder) -> Builder:
        _BUILDERS[name] = fn
        return fn

    return wrap


def model_names() -> list[str]:
    """The registered architecture names, sorted, for error messages and the CLI."""
    return sorted(_BUILDERS)


def check_options(model: str, kw: dict) -> None:
    """Reject options a builder does not define, so a misspelt config key fails loudly."""
    if kw:
        names = ", ".join(repr(k) for k in sorted(kw))
        raise ConfigError(f"model {model}: unknown option {names}")


def positive_int(model: str, key: str, value: object) -> int:
    """Validate a size-like builder argument, naming it when it is not a positive int."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(f"model {model}: {key} must be a positive integer, got {value!r}")
    return value


def check_model_options(name: str, options: dict, prefix: str = "model.options", key: str = "model.name") -> dict:
    """`options` for architecture `name` (the value of config `key`) checked against its builder's named parameters
    and their annotations (converted, e.g. 1e2 -> 100); an unknown architecture, option or type is a ConfigError."""
    if name not in _BUILDERS:
        raise ConfigError(f"{key}: unknown architecture {name!r}; choose one of {model_names()}")
    return check_kwargs(_BUILDERS[name], options, prefix, f"model {name!r}",
                        skip=("in_channels", "num_classes", "image_size"))


def build_model(name: str, in_channels: int, num_classes: int, image_size: int, **kw) -> Classifier:
    """Build a registered model; an unknown name lists the valid ones."""
    if name not in _BUILDERS:
        raise ConfigError(f"model: unknown architecture {name!r}; choose one of {model_names()}")
    return _BUILDERS[name](in_channels=in_channels, num_classes=num_classes, image_size=image_size, **kw)


def check_shape(model: str, in_channels: int, num_classes: int, image_size: int) -> None:
    """Validate the input shape and class count every builder receives, naming the bad argument."""
    positive_int(model, "in_channels", in_channels)
    positive_int(model, "num_classes", num_classes)
    positive_int(model, "image_size", image_size)
