"""Small models for small images (sklearn digits 8×8 up to CIFAR 32×32): a CNN, an MLP and LeNet-5.

Flattened sizes are computed from `image_size`, so one builder serves every dataset.
"""

from __future__ import annotations

import torch
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.registry import (
    Classifier,
    check_options,
    check_shape,
    positive_int,
    register_model,
)


def _maybe_pool(size: int) -> tuple[nn.Module, int]:
    """A 2×2 max-pool and the size after it, or identity when the map is already 1 pixel wide."""
    return (nn.MaxPool2d(2), size // 2) if size >= 2 else (nn.Identity(), size)


class SmallCNN(Classifier):
    """conv3×3(32)-ReLU-conv3×3(64)-ReLU-maxpool-flatten-linear(128)-ReLU, then a linear head.

    The convolutions are unpadded, as in the classic Keras MNIST CNN; the pool is skipped on 1×1 maps.
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        size = image_size - 4
        if size < 1:
            raise ConfigError(f"model cnn: image_size must be at least 5, got {image_size}")
        pool, size = _maybe_pool(size)
        self.embed_dim = 128
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 32, 3), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3), nn.ReLU(inplace=True),
            pool, nn.Flatten(),
            nn.Linear(64 * size * size, self.embed_dim), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.fc = nn.Linear(self.embed_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The 128-d ReLU features before the head."""
        return self.features(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear classifier on the embedding."""
        return self.fc(z)


class MLP(Classifier):
    """flatten, then `layers` × (linear(hidden)-ReLU), then a linear head: the FedAvg paper's 2NN."""

    def __init__(self, in_features: int, num_classes: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.embed_dim = hidden
        body: list[nn.Module] = [nn.Flatten()]
        width = in_features
        for _ in range(layers):
            body += [nn.Linear(width, hidden), nn.ReLU(inplace=True)]
            width = hidden
        self.features = nn.Sequential(*body)
        self.fc = nn.Linear(hidden, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The last hidden layer's ReLU activations, (N, hidden)."""
        return self.features(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear classifier on the embedding."""
        return self.fc(z)


class LeNet5(Classifier):
    """LeNet-5 with ReLU and max-pool: conv5×5(6, pad 2)-pool-conv5×5(16)-pool-120-84, then a linear head.

    The second conv is padded by 2 when an unpadded one would leave less than 2×2 (e.g. 8×8 digits).
    """

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        pool1, size = _maybe_pool(image_size)  # conv1 with padding 2 keeps the size
        pad2 = 0 if size - 4 >= 2 else 2
        size = size + 2 * pad2 - 4
        pool2, size = _maybe_pool(size)
        self.embed_dim = 84
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 6, 5, padding=2), nn.ReLU(inplace=True), pool1,
            nn.Conv2d(6, 16, 5, padding=pad2), nn.ReLU(inplace=True), pool2,
            nn.Flatten(),
            nn.Linear(16 * size * size, 120), nn.ReLU(inplace=True),
            nn.Linear(120, self.embed_dim), nn.ReLU(inplace=True),
        )  # fmt: skip
        self.fc = nn.Linear(self.embed_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The 84-d ReLU features before the head."""
        return self.features(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear classifier on the embedding."""
        return self.fc(z)


@register_model("cnn")
def cnn(in_channels: int, num_classes: int, image_size: int, **kw: object) -> SmallCNN:
    """Two-conv CNN: a cheap image baseline that trains in seconds on CPU."""
    check_options("cnn", kw)
    check_shape("cnn", in_channels, num_classes, image_size)
    return SmallCNN(in_channels, num_classes, image_size)


@register_model("mlp")
def mlp(
    in_channels: int, num_classes: int, image_size: int, hidden: int = 200, layers: int = 2, **kw: object
) -> MLP:
    """Fully connected net (default 2×200, McMahan et al.'s 2NN): the cheapest non-linear baseline."""
    check_options("mlp", kw)
    check_shape("mlp", in_channels, num_classes, image_size)
    hidden = positive_int("mlp", "hidden", hidden)
    layers = positive_int("mlp", "layers", layers)
    return MLP(in_channels * image_size * image_size, num_classes, hidden, layers)


@register_model("lenet")
def lenet(in_channels: int, num_classes: int, image_size: int, **kw: object) -> LeNet5:
    """LeNet-5: the classic small convnet for MNIST-like and digits inputs."""
    check_options("lenet", kw)
    check_shape("lenet", in_channels, num_classes, image_size)
    return LeNet5(in_channels, num_classes, image_size)
