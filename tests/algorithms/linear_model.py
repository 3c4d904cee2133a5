"""A linear softmax classifier for hand-computed tests: logits = x·Wᵀ + b on the flattened input."""

from __future__ import annotations

from torch import nn

from fedsim.models import Classifier, register_model


class Linear(Classifier):
    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.embed_dim = in_channels * image_size * image_size
        self.fc = nn.Linear(self.embed_dim, num_classes)

    def embed(self, x):
        return x.flatten(1)

    def head(self, z):
        return self.fc(z)


def register_linear(name: str) -> str:
    """Register the linear model under `name` (one name per test module) and return the name."""
    register_model(name)(lambda in_channels, num_classes, image_size: Linear(in_channels, num_classes, image_size))
    return name
