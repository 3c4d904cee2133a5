"""DaFKD's networks: the official code's sizes, the generator layouts for 32/28/8-pixel inputs, the heads."""

from __future__ import annotations

import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.models import build_model, count_parameters
from fedsim.models.dafkd_nets import MultiTaskNet, build_generator, dcgan_layout


def test_sizes_match_the_official_code() -> None:
    """MTLResNet's `sharedlayer` has 817,872 parameters on 3-channel input (spec §2.3), its class head
    256·10+10 and its discriminator head 257; GeneratorCifar (noise 100, 64 features) has 1,068,931."""
    net = MultiTaskNet(build_model("resnet11", in_channels=3, num_classes=10, image_size=32))
    assert count_parameters(net.classifier.trunk) == 817_872
    assert count_parameters(net.classifier.fc) == 2_570 and count_parameters(net.domain) == 257
    gen = build_generator("dcgan", 100, 10, (3, 32, 32), 64, (0.5,) * 3, (0.5,) * 3)
    assert count_parameters(gen) == 1_068_931


@pytest.mark.parametrize("size,layout", [(32, (4, 3)), (28, (7, 2)), (8, (2, 2)), (64, (8, 3)), (6, (3, 1))])
def test_dcgan_layout(size: int, layout: tuple[int, int]) -> None:
    assert dcgan_layout(size) == layout


def test_dcgan_layout_rejects_odd_sizes() -> None:
    with pytest.raises(ConfigError, match="even image size"):
        dcgan_layout(7)


@pytest.mark.parametrize("kind", ["dcgan", "conditional"])
@pytest.mark.parametrize("shape", [(1, 8, 8), (1, 28, 28), (3, 32, 32)])
def test_generators_emit_the_data_shape_on_its_scale(kind: str, shape: tuple[int, int, int]) -> None:
    """Tanh pixels in [-1, 1] read as [0, 1] and normalised: the range is [-mean/std, (1-mean)/std]."""
    mean, std = (0.25,) * shape[0], (0.5,) * shape[0]
    gen = build_generator(kind, 8, 10, shape, 4, mean, std)
    x = gen.sample(5, torch.Generator().manual_seed(0))
    assert x.shape == (5, *shape)
    assert x.min() >= -0.5 - 1e-6 and x.max() <= 1.5 + 1e-6
    again = gen.sample(5, torch.Generator().manual_seed(0))
    assert torch.equal(x, again)


def test_multitask_net_shares_the_trunk() -> None:
    torch.manual_seed(0)
    net = MultiTaskNet(build_model("resnet11", in_channels=1, num_classes=10, image_size=28, width=4)).eval()
    x = torch.randn(2, 1, 28, 28)
    logits, d = net(x)
    z = net.classifier.embed(x)
    assert logits.shape == (2, 10) and d.shape == (2,) and z.shape == (2, 64)
    assert torch.equal(d, net.domain(z)) and torch.equal(logits, net.classifier.head(z))


def test_non_square_or_flat_inputs_are_rejected() -> None:
    with pytest.raises(ConfigError, match="square"):
        build_generator("dcgan", 8, 10, (100,), 4, (), ())
