"""Size accounting for models and their states, used for communication-cost reporting."""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn


def count_parameters(model: nn.Module) -> int:
    """Number of scalar parameters (trainable or not, buffers excluded), as papers report model size."""
    return sum(p.numel() for p in model.parameters())


def state_nbytes(state_dict: Mapping[str, torch.Tensor]) -> int:
    """Bytes a state dict occupies (parameters and buffers), i.e. what one upload or download costs."""
    return sum(t.numel() * t.element_size() for t in state_dict.values() if isinstance(t, torch.Tensor))
