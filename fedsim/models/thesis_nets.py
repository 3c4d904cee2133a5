"""The FedGDKD thesis models (Banerjee 2022, Appendix B): width-parameterised CNNs and the conditional generator.

Classifier (`CNNParameterised`, B.3.2 without its validity head): blocks of Conv2d(k3, s2, p1, no bias) →
InstanceNorm2d(affine) → ReLU (no norm on a 1×1 map), then Flatten → Linear(F, 128) → Linear(128, c) with
no activation between the Linears. Registered as `cnn_small` [8, 8], `cnn_medium` [8, 16, 16], `cnn_large` [32, 32, 32],
`cnn_custom` (option `widths`) and one `cnn_<w1>_<w2>...` name per Table 5.4 client, so a heterogeneous
run is a plain `model.mix`. `CNNDiscriminator` adds B.3.2's validity head (FedDTG, FAug's ACGAN).
Generator (B.3.1): Embedding(c, nz) ⊙ z → Linear(nz, ngf·2^b·s0²) → b × [ConvT(k4, s2, p1) → BN → ReLU]
→ ConvT → Tanh, mapped from [-1, 1] pixels onto the dataset's normalised scale.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn

from fedsim.config.knobs import knob
from fedsim.config.limits import MAX_CHANNELS, MAX_WIDTH
from fedsim.errors import ConfigError
from fedsim.models.registry import (
    Classifier,
    check_options,
    check_shape,
    positive_int,
    register_model,
)

# Table 5.4, "heterogeneous client model architectures" (client index = position).
TABLE_5_4 = [[16, 32], [16, 32, 16], [8, 16, 16], [8, 8, 8], [32, 64, 64], [32, 32, 32], [16, 16], [32, 32],
             [16, 16, 16, 16], [16, 32, 64, 32]]
NAMED = {"cnn_small": [8, 8], "cnn_medium": [8, 16, 16], "cnn_large": [32, 32, 32]}


def _features(in_channels: int, widths: list[int], image_size: int) -> tuple[nn.Sequential, int]:
    """Conv(k3, s2, p1, no bias) → InstanceNorm(affine) → ReLU blocks, flattened; returns (net, F)."""
    layers: list[nn.Module] = []
    size, ch = image_size, in_channels
    for w in widths:
        size = (size - 1) // 2 + 1
        # InstanceNorm of a 1×1 map would zero every feature (only small inputs such as 8×8 digits get there)
        norm = nn.InstanceNorm2d(w, affine=True) if size > 1 else nn.Identity()
        layers += [nn.Conv2d(ch, w, 3, stride=2, padding=1, bias=False), norm, nn.ReLU(inplace=True)]
        ch = w
    layers.append(nn.Flatten())
    return nn.Sequential(*layers), ch * size * size


class CNNParameterised(Classifier):
    """The thesis classifier; `embed` is the 128-d output of the first Linear (no activation follows it)."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int, widths: list[int],
                 hidden: int = 128) -> None:
        super().__init__()
        self.net, flat = _features(in_channels, widths, image_size)
        self.embed_dim = hidden
        self.fc1 = nn.Linear(flat, hidden)
        self.fc2 = nn.Linear(hidden, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Linear(F, 128) of the flattened conv features."""
        return self.fc1(self.net(x))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        """Linear(128, c): the class logits."""
        return self.fc2(z)


class CNNDiscriminator(nn.Module):
    """B.3.2: the thesis CNN with a validity head Linear(F,128) → Linear(128,1) and an optional class head.

    `forward` returns (validity logit [N], class logits [N, c] or None); apply a sigmoid for D(x).
    """

    def __init__(self, in_channels: int, image_size: int, widths: list[int], num_classes: int | None = None,
                 hidden: int = 128) -> None:
        super().__init__()
        self.net, flat = _features(in_channels, widths, image_size)
        self.validity = nn.Sequential(nn.Linear(flat, hidden), nn.Linear(hidden, 1))
        self.classes = nn.Sequential(nn.Linear(flat, hidden), nn.Linear(hidden, num_classes)) if num_classes \
            else None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        h = self.net(x)
        return self.validity(h).squeeze(1), (self.classes(h) if self.classes is not None else None)


def _widths(model: str, widths: object) -> list[int]:
    if not isinstance(widths, (list, tuple)) or not widths:
        raise ConfigError(f"model {model}: widths must be a non-empty list of positive integers, got {widths!r}")
    return [positive_int(model, "widths", w) for w in widths]


def _register_fixed(name: str, widths: list[int]) -> None:
    def build(in_channels: int, num_classes: int, image_size: int, hidden: int = 128,
              **kw: object) -> CNNParameterised:
        check_options(name, kw)
        check_shape(name, in_channels, num_classes, image_size)
        return CNNParameterised(in_channels, num_classes, image_size, widths, positive_int(name, "hidden", hidden))

    build.__doc__ = f"Thesis CNN with conv widths {widths}."
    register_model(name)(build)


for _name, _w in NAMED.items():
    _register_fixed(_name, _w)
for _w in TABLE_5_4:
    _register_fixed("cnn_" + "_".join(map(str, _w)), _w)


@register_model("cnn_custom")
def cnn_custom(in_channels: int, num_classes: int, image_size: int, widths: object = (8, 16, 16),
               hidden: int = 128, **kw: object) -> CNNParameterised:
    """Thesis CNN with the conv widths given as the `widths` option (the author's `cnn_custom`)."""
    check_options("cnn_custom", kw)
    check_shape("cnn_custom", in_channels, num_classes, image_size)
    return CNNParameterised(in_channels, num_classes, image_size, _widths("cnn_custom", widths),
                            positive_int("cnn_custom", "hidden", hidden))


@dataclass
class GeneratorConfig:
    """The conditional generator's size; the defaults are Appendix B.3.1 for 32×32 inputs."""

    nz: int = knob(100, ge=1, le=MAX_WIDTH, doc="latent dimension nz (also the label-embedding width)")
    ngf: int = knob(100, ge=1, le=MAX_CHANNELS,
                    doc="channels entering the output ConvT (the Linear gives ngf·2^blocks)")
    init_size: int = knob(4, ge=1, le=1024,
                          doc="spatial size after the Linear; image_size / init_size must be 2^k, k>=1")


class ConditionalGenerator(nn.Module):
    """Appendix B.3.1: G(z, y) = Tanh(ConvT…(Linear(Embedding(y) ⊙ z))), rescaled to normalised pixels."""

    def __init__(self, num_classes: int, channels: int, image_size: int, cfg: GeneratorConfig,
                 mean: tuple[float, ...] = (), std: tuple[float, ...] = ()) -> None:
        super().__init__()
        ups = math.log2(image_size / cfg.init_size) if image_size % cfg.init_size == 0 else -1
        if ups < 1 or not float(ups).is_integer():
            raise ConfigError(f"generator.init_size: image_size {image_size} must be init_size·2^k with k >= 1, "
                              f"got init_size={cfg.init_size}")
        blocks = int(ups) - 1
        self.nz, self.init_size = cfg.nz, cfg.init_size
        self.first = cfg.ngf * 2 ** blocks
        self.label_emb = nn.Embedding(num_classes, cfg.nz)
        self.l1 = nn.Linear(cfg.nz, self.first * cfg.init_size ** 2)
        layers: list[nn.Module] = []
        ch = self.first
        for _ in range(blocks):
            layers += [nn.ConvTranspose2d(ch, ch // 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ch // 2),
                       nn.ReLU(inplace=True)]
            ch //= 2
        layers += [nn.ConvTranspose2d(ch, channels, 4, 2, 1, bias=False), nn.Tanh()]
        self.main = nn.Sequential(*layers)
        m = torch.tensor(mean or (0.5,) * channels, dtype=torch.float32).view(1, -1, 1, 1)
        s = torch.tensor(std or (0.5,) * channels, dtype=torch.float32).view(1, -1, 1, 1)
        # tanh t ∈ [-1, 1] is the pixel (t+1)/2 ∈ [0, 1]; normalised = (pixel - mean) / std (not state: never sent)
        self.register_buffer("scale", 0.5 / s, persistent=False)
        self.register_buffer("shift", (0.5 - m) / s, persistent=False)

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        h = self.l1(self.label_emb(y) * z).view(-1, self.first, self.init_size, self.init_size)
        return self.main(h) * self.scale + self.shift


def build_generator(num_classes: int, input_shape: tuple[int, ...], cfg: GeneratorConfig,
                    mean: tuple[float, ...] = (), std: tuple[float, ...] = ()) -> ConditionalGenerator:
    """The conditional generator for images of `input_shape` (C, H, W), square H == W."""
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ConfigError(f"generator: needs square C×H×W images, got input shape {tuple(input_shape)}")
    return ConditionalGenerator(num_classes, input_shape[0], input_shape[1], cfg, mean, std)
