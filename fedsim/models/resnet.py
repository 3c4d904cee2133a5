"""CIFAR-style ResNets (He et al. 2016) and Wide-ResNet 16-4 (Zagoruyko & Komodakis 2016).

These are the backbones of FedDF and the single-image distillation papers. All end in an adaptive
average pool, so they also accept small inputs such as the 8×8 sklearn digits.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.registry import (
    Classifier,
    check_options,
    check_shape,
    register_model,
)


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


def _norm(kind: str, channels: int) -> nn.Module:
    """BatchNorm, or GroupNorm of gcd(32, C) groups (for sample-level DP-SGD, which BatchNorm's batch mixing
    rules out; the groups Opacus's ModuleValidator.fix uses)."""
    return nn.BatchNorm2d(channels) if kind == "batch" else nn.GroupNorm(math.gcd(32, channels), channels)


def _kaiming_init(model: nn.Module) -> None:
    """He-normal conv weights and unit BN, as in both papers, so training starts from the usual point."""
    for m in model.modules():
        if isinstance(m, nn.Conv2d):
            nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
        elif isinstance(m, (nn.BatchNorm2d, nn.GroupNorm)):
            nn.init.ones_(m.weight)
            nn.init.zeros_(m.bias)


class BasicBlock(nn.Module):
    """Post-activation basic block: conv-BN-ReLU-conv-BN, plus identity or 1×1-conv-BN (option B)."""

    def __init__(self, c_in: int, c_out: int, stride: int, norm: str = "batch") -> None:
        super().__init__()
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.bn1 = _norm(norm, c_out)
        self.conv2 = _conv3x3(c_out, c_out)
        self.bn2 = _norm(norm, c_out)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), _norm(norm, c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return torch.relu(out + self.shortcut(x))


class CifarResNet(Classifier):
    """ResNet-(6n+2) for CIFAR: 16-channel stem, three stages of n blocks (16/32/64), GAP, linear head."""

    def __init__(self, blocks_per_stage: int, in_channels: int, num_classes: int, init: str = "he",
                 norm: str = "batch") -> None:
        super().__init__()
        self.embed_dim = 64
        self.stem = nn.Sequential(_conv3x3(in_channels, 16), _norm(norm, 16), nn.ReLU(inplace=True))
        layers: list[nn.Module] = []
        c_in = 16
        for stage, width in enumerate((16, 32, 64)):
            for i in range(blocks_per_stage):
                stride = 2 if stage > 0 and i == 0 else 1
                layers.append(BasicBlock(c_in, width, stride, norm))
                c_in = width
        self.layers = nn.Sequential(*layers)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.embed_dim, num_classes)
        if init == "he":
            _kaiming_init(self)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled features of the last stage, (N, 64)."""
        return torch.flatten(self.pool(self.layers(self.stem(x))), 1)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear classifier on the pooled features."""
        return self.fc(z)


class WideBlock(nn.Module):
    """Pre-activation wide block: BN-ReLU-conv-BN-ReLU-(dropout)-conv, 1×1-conv shortcut on shape change."""

    def __init__(self, c_in: int, c_out: int, stride: int, dropout: float) -> None:
        super().__init__()
        self.bn1 = nn.BatchNorm2d(c_in)
        self.conv1 = _conv3x3(c_in, c_out, stride)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        self.conv2 = _conv3x3(c_out, c_out)
        self.shortcut: nn.Module | None = None
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pre = torch.relu(self.bn1(x))
        out = self.conv1(pre)
        out = self.conv2(self.dropout(torch.relu(self.bn2(out))))
        # As in the reference code, a projection shortcut reads the pre-activated input.
        return out + (x if self.shortcut is None else self.shortcut(pre))


class WideResNet(Classifier):
    """WRN-depth-k: 16-channel stem, three stages of (depth-4)/6 wide blocks, final BN-ReLU, GAP, linear."""

    def __init__(
        self, depth: int, widen: int, in_channels: int, num_classes: int, dropout: float = 0.0
    ) -> None:
        super().__init__()
        n = (depth - 4) // 6
        widths = (16 * widen, 32 * widen, 64 * widen)
        self.embed_dim = widths[-1]
        self.stem = _conv3x3(in_channels, 16)
        layers: list[nn.Module] = []
        c_in = 16
        for stage, width in enumerate(widths):
            for i in range(n):
                layers.append(WideBlock(c_in, width, 2 if stage > 0 and i == 0 else 1, dropout))
                c_in = width
        self.layers = nn.Sequential(*layers)
        self.bn = nn.BatchNorm2d(c_in)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(self.embed_dim, num_classes)
        _kaiming_init(self)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Globally pooled, BN-ReLU'd features of the last stage, (N, 64·k)."""
        out = torch.relu(self.bn(self.layers(self.stem(x))))
        return torch.flatten(self.pool(out), 1)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear classifier on the pooled features."""
        return self.fc(z)


def _norm_option(model: str, norm: object) -> str:
    """`norm`: "batch" (the papers') or "group" (GroupNorm, for sample-level DP-SGD)."""
    if norm not in ("batch", "group"):
        raise ConfigError(f"model {model}: norm must be 'batch' or 'group', got {norm!r}")
    return str(norm)


def _init_option(model: str, init: object) -> str:
    """`init`: "he" (He-normal convs, the papers' choice) or "torch" (PyTorch's layer defaults)."""
    if init not in ("he", "torch"):
        raise ConfigError(f"model {model}: init must be 'he' or 'torch', got {init!r}")
    return str(init)


@register_model("resnet8")
def resnet8(in_channels: int, num_classes: int, image_size: int, init: str = "he", norm: str = "batch",
            **kw: object) -> CifarResNet:
    """ResNet-8 (one basic block per stage, ~78k parameters): FedDF's small CIFAR backbone."""
    check_options("resnet8", kw)
    check_shape("resnet8", in_channels, num_classes, image_size)
    return CifarResNet(1, in_channels, num_classes, _init_option("resnet8", init), _norm_option("resnet8", norm))


@register_model("resnet20")
def resnet20(in_channels: int, num_classes: int, image_size: int, init: str = "he", norm: str = "batch",
             **kw: object) -> CifarResNet:
    """ResNet-20 (three basic blocks per stage, ~0.27M parameters): the standard CIFAR baseline."""
    check_options("resnet20", kw)
    check_shape("resnet20", in_channels, num_classes, image_size)
    return CifarResNet(3, in_channels, num_classes, _init_option("resnet20", init), _norm_option("resnet20", norm))


@register_model("wrn16_4")
def wrn16_4(
    in_channels: int, num_classes: int, image_size: int, dropout: float = 0.0, **kw: object
) -> WideResNet:
    """Wide-ResNet 16-4 (~2.75M parameters): the wider backbone of the distillation experiments."""
    check_options("wrn16_4", kw)
    check_shape("wrn16_4", in_channels, num_classes, image_size)
    if isinstance(dropout, bool) or not isinstance(dropout, (int, float)) or not 0.0 <= dropout < 1.0:
        raise ConfigError(f"model wrn16_4: dropout must be a number in [0, 1), got {dropout!r}")
    return WideResNet(16, 4, in_channels, num_classes, float(dropout))
