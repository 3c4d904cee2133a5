"""Networks of DaFKD (Wang et al., CVPR 2023): the "ResNet11" multi-task classifier and the two generators.

- `resnet11`: the official code's MTLResNet trunk (3×3 stem to 16 channels, three stages of two
  "bottleneck" blocks of widths 16/32/64 with ×4 expansion whose three convolutions are all 3×3, global
  average pool to 256 features) with a linear class head. 817,872 trunk parameters on 3-channel input.
  The personal domain head of the multi-task network is a separate `DomainHead` (Linear(embed_dim, 1) +
  sigmoid) on the same embedding, so the class head stays a registry `Classifier` and any architecture of
  the zoo can carry a domain head. `MultiTaskNet` composes the two when one module is wanted.
- `DCGANGenerator`: unconditional g(z) (the paper's equations; the code's GeneratorCifar at 32×32×3:
  1,068,931 parameters at noise 100 and width 64).
- `ConditionalGenerator`: the label-conditional MLP of §4.1 (one embedding layer for the one-hot label,
  one for the noise, then FC + BatchNorm + LeakyReLU), FedGen-style, emitting images.

Input handling (a documented choice; the paper does not say): images are used at their native size and
channel count (1×28×28 for MNIST/EMNIST/FashionMNIST, 1×8×8 for sklearn digits), no resize to 32 and no
channel repetition. The trunk's adaptive pooling accepts any size; the DCGAN generator starts from a
base×base map and doubles it n times with size = base·2^n, n ≤ 3 as large as possible with base ≥ 2
(32 = 4·2³ as in the code, 28 = 7·2², 8 = 2·2²). Generators emit tanh pixels in [-1, 1], read as [0, 1]
intensities and normalised with the dataset's mean/std, so fakes live on the same scale as real inputs.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.registry import Classifier, check_options, check_shape, positive_int, register_model
from fedsim.training.optim import SGD, Adam


def _conv3x3(c_in: int, c_out: int, stride: int = 1) -> nn.Conv2d:
    return nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)


class Bottleneck3x3(nn.Module):
    """The code's Bottleneck: conv3×3(w)-BN-ReLU-conv3×3(w, stride)-BN-ReLU-conv3×3(4w)-BN + shortcut, ReLU."""

    expansion = 4

    def __init__(self, c_in: int, width: int, stride: int) -> None:
        super().__init__()
        out = width * self.expansion
        self.body = nn.Sequential(
            _conv3x3(c_in, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            _conv3x3(width, width, stride), nn.BatchNorm2d(width), nn.ReLU(inplace=True),
            _conv3x3(width, out), nn.BatchNorm2d(out),
        )  # fmt: skip
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, out, 1, stride=stride, bias=False), nn.BatchNorm2d(out))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.body(x) + self.shortcut(x))


class ResNet11(Classifier):
    """MTLResNet's shared trunk (stem + [2, 2, 2] bottleneck stages) and its class head."""

    def __init__(self, in_channels: int, num_classes: int, width: int = 16) -> None:
        super().__init__()
        layers: list[nn.Module] = [_conv3x3(in_channels, width), nn.BatchNorm2d(width), nn.ReLU(inplace=True)]
        c_in = width
        for stage, w in enumerate((width, 2 * width, 4 * width)):
            for i in range(2):
                layers.append(Bottleneck3x3(c_in, w, 2 if stage > 0 and i == 0 else 1))
                c_in = w * Bottleneck3x3.expansion
        self.trunk = nn.Sequential(*layers, nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.embed_dim = c_in
        self.fc = nn.Linear(c_in, num_classes)
        for m in self.modules():
            if isinstance(m, nn.Conv2d):
                nn.init.kaiming_normal_(m.weight, mode="fan_out", nonlinearity="relu")
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """The pooled trunk features shared by the class and domain heads, (N, 16·width)."""
        return self.trunk(x)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


@register_model("resnet11")
def resnet11(in_channels: int, num_classes: int, image_size: int, width: int = 16, **kw: object) -> ResNet11:
    """DaFKD's "ResNet11" (official MTLResNet trunk + class head); `width` scales 16/32/64 (×4 expansion)."""
    check_options("resnet11", kw)
    check_shape("resnet11", in_channels, num_classes, image_size)
    return ResNet11(in_channels, num_classes, positive_int("resnet11", "width", width))


class DomainHead(nn.Module):
    """The personal discriminator head f(θ_k^d; x) = sigmoid(Linear(embed(x))); `forward` returns the logit."""

    def __init__(self, embed_dim: int) -> None:
        super().__init__()
        self.fc = nn.Linear(embed_dim, 1)

    def forward(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z).squeeze(1)

    def reset(self, generator: torch.Generator) -> None:
        """nn.Linear's default init, drawn from `generator` so a client's first head is seeded."""
        bound = self.fc.in_features ** -0.5
        with torch.no_grad():
            for p in (self.fc.weight, self.fc.bias):
                p.copy_(torch.rand(p.shape, generator=generator) * 2 * bound - bound)


class MultiTaskNet(nn.Module):
    """Shared trunk with two heads (Eq. 9): returns (class logits, domain logit)."""

    def __init__(self, classifier: Classifier) -> None:
        super().__init__()
        self.classifier, self.domain = classifier, DomainHead(classifier.embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        z = self.classifier.embed(x)
        return self.classifier.head(z), self.domain(z)


class ImageGenerator(nn.Module):
    """Shared part of the generators: noise drawing and mapping tanh pixels to the dataset's scale."""

    conditional = False
    mean: torch.Tensor  # buffers
    std: torch.Tensor

    def __init__(self, noise_dim: int, num_classes: int, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__()
        self.noise_dim, self.num_classes = noise_dim, num_classes
        c = len(mean)
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32).view(1, c, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32).view(1, c, 1, 1), persistent=False)

    def noise(self, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor | None]:
        """z ~ N(0, I) (and uniform labels when conditional), drawn on the CPU so every device sees the same."""
        z = torch.randn(n, self.noise_dim, generator=generator)
        y = torch.randint(0, self.num_classes, (n,), generator=generator) if self.conditional else None
        dev = self.mean.device
        return z.to(dev), (None if y is None else y.to(dev))

    def sample(self, n: int, generator: torch.Generator) -> torch.Tensor:
        z, y = self.noise(n, generator)
        return self(z, y)

    def _scale(self, t: torch.Tensor) -> torch.Tensor:
        return ((t + 1) / 2 - self.mean) / self.std


def dcgan_layout(image_size: int) -> tuple[int, int]:
    """(base, doublings): image_size = base·2^n with n ≤ 3 as large as possible and base ≥ 2."""
    for n in (3, 2, 1):
        if image_size % (2 ** n) == 0 and image_size // 2 ** n >= 2:
            return image_size // 2 ** n, n
    raise ConfigError(f"algorithm.generator: dcgan needs an even image size of at least 4, got {image_size}")


class DCGANGenerator(ImageGenerator):
    """ConvT(z→base×base, 2^(n-1)·width) then n-1 ConvT×2 stages halving the width, BN+ReLU, ConvT×2 to
    `channels` with tanh; at 3×32×32, width 64 this is the code's GeneratorCifar (256/128/64 features)."""

    def __init__(self, noise_dim: int, num_classes: int, channels: int, image_size: int, width: int,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__(noise_dim, num_classes, mean, std)
        base, n = dcgan_layout(image_size)
        widths = [width * 2 ** (n - 1 - i) for i in range(n)]
        layers: list[nn.Module] = [nn.ConvTranspose2d(noise_dim, widths[0], base, bias=False),
                                   nn.BatchNorm2d(widths[0]), nn.ReLU(True)]
        for a, b in zip(widths, widths[1:]):
            layers += [nn.ConvTranspose2d(a, b, 4, 2, 1, bias=False), nn.BatchNorm2d(b), nn.ReLU(True)]
        layers += [nn.ConvTranspose2d(widths[-1], channels, 4, 2, 1), nn.Tanh()]
        self.net = nn.Sequential(*layers)
        for m in self.modules():  # the code's weights_init
            if isinstance(m, nn.ConvTranspose2d):
                nn.init.xavier_normal_(m.weight)
            elif isinstance(m, nn.BatchNorm2d):
                nn.init.normal_(m.weight, 1.0, 0.02)
                nn.init.zeros_(m.bias)

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self._scale(self.net(z.view(z.shape[0], -1, 1, 1)))


class ConditionalGenerator(ImageGenerator):
    """§4.1's generator: Linear embeddings of one-hot y and of z (width each), concatenated, then
    FC(2·width→2·width)-BN-LeakyReLU(0.2) and FC to C·H·W pixels with tanh."""

    conditional = True

    def __init__(self, noise_dim: int, num_classes: int, channels: int, image_size: int, width: int,
                 mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        super().__init__(noise_dim, num_classes, mean, std)
        self.shape = (channels, image_size, image_size)
        self.embed_y, self.embed_z = nn.Linear(num_classes, width), nn.Linear(noise_dim, width)
        self.fc = nn.Sequential(nn.Linear(2 * width, 2 * width), nn.BatchNorm1d(2 * width), nn.LeakyReLU(0.2),
                                nn.Linear(2 * width, channels * image_size * image_size), nn.Tanh())

    def forward(self, z: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        if y is None:
            raise ValueError("the conditional generator needs labels y")
        onehot = nn.functional.one_hot(y, self.num_classes).to(z.dtype)
        h = torch.cat([self.embed_y(onehot), self.embed_z(z)], 1)
        return self._scale(self.fc(h).view(z.shape[0], *self.shape))


def build_generator(kind: str, noise_dim: int, num_classes: int, input_shape: tuple[int, ...], width: int,
                    mean: tuple[float, ...], std: tuple[float, ...]) -> ImageGenerator:
    """'dcgan' (unconditional) or 'conditional' (label-conditional MLP) for C×H×W images."""
    if len(input_shape) != 3 or input_shape[1] != input_shape[2]:
        raise ConfigError(f"algorithm.generator: DaFKD generates square C×H×W images; the data is {input_shape}")
    channels, size = input_shape[0], input_shape[2]
    mean = tuple(mean) or (0.0,) * channels
    std = tuple(std) or (1.0,) * channels
    cls = {"dcgan": DCGANGenerator, "conditional": ConditionalGenerator}.get(kind)
    if cls is None:
        raise ConfigError(f"algorithm.generator: must be 'dcgan' or 'conditional', got {kind!r}")
    return cls(noise_dim, num_classes, channels, size, width, mean, std)


def generator_step(gen: ImageGenerator, opt: SGD | Adam,
                   discriminate: Callable[[torch.Tensor], torch.Tensor], n: int, rng: torch.Generator) -> float:
    """One non-saturating generator step (Eq. 3): minimise BCE(D(g(z)), 1); `discriminate` returns logits."""
    gen.train()
    logit = discriminate(gen.sample(n, rng))
    loss = F.binary_cross_entropy_with_logits(logit, torch.ones_like(logit))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def gradient_penalty(discriminate: Callable[[torch.Tensor], torch.Tensor], real: torch.Tensor, fake: torch.Tensor,
                     rng: torch.Generator) -> torch.Tensor:
    """(‖∇_x̂ sigmoid(D(x̂))‖₂ − 1)² on random interpolates x̂ of real and fake samples (the official code's term)."""
    t = torch.rand(len(real), 1, 1, 1, generator=rng).to(real.device)
    xi = (t * real + (1 - t) * fake).requires_grad_(True)
    (grad,) = torch.autograd.grad(torch.sigmoid(discriminate(xi)).sum(), xi, create_graph=True)
    return ((grad.flatten(1).norm(2, dim=1) - 1) ** 2).mean()
