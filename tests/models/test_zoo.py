"""The model zoo: every architecture builds for every input shape, exposes a consistent embedding,
and the CIFAR backbones have the published sizes."""

from __future__ import annotations

import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.models import (
    Classifier,
    build_model,
    count_parameters,
    model_names,
    state_nbytes,
)

EMBED_DIMS = {"cnn": 128, "lenet": 84, "mlp": 200, "resnet8": 64, "resnet20": 64, "wrn16_4": 256}
SHAPES = [(1, 8, 10), (1, 28, 10), (3, 32, 100)]  # (in_channels, image_size, num_classes)


def test_registry_lists_the_zoo() -> None:
    assert set(EMBED_DIMS) <= set(model_names())


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "c{}-{}px-{}cls".format(*s))
@pytest.mark.parametrize("name", sorted(EMBED_DIMS))
def test_forward_embed_and_head_agree(name: str, shape: tuple[int, int, int]) -> None:
    channels, size, classes = shape
    torch.manual_seed(0)
    model = build_model(name, in_channels=channels, num_classes=classes, image_size=size).eval()
    assert isinstance(model, Classifier)
    assert model.embed_dim == EMBED_DIMS[name]
    x = torch.randn(3, channels, size, size)
    with torch.no_grad():
        logits = model(x)
        z = model.embed(x)
        assert logits.shape == (3, classes)
        assert z.shape == (3, model.embed_dim)
        assert torch.equal(model.head(z), logits)


def test_trains_in_train_mode() -> None:
    model = build_model("resnet8", in_channels=1, num_classes=10, image_size=8)
    assert model.training  # a new model trains: BatchNorm uses and updates batch statistics
    norms = [m for m in model.modules() if isinstance(m, torch.nn.BatchNorm2d)]
    before = [m.running_mean.clone() for m in norms]
    loss = torch.nn.functional.cross_entropy(model(torch.randn(4, 1, 8, 8)), torch.arange(4))
    loss.backward()
    assert all(p.grad is not None for p in model.parameters())
    assert norms and all(not torch.equal(m.running_mean, b) for m, b in zip(norms, before))


# Published sizes for CIFAR-10 (3×32×32, 10 classes). With option-A (parameter-free) shortcuts ResNet-20
# has 269,722 parameters ("0.27M", He et al. Table 6); our option-B 1×1-conv+BN shortcuts add
# 16·32+2·32 + 32·64+2·64 = 2,752. ResNet-8 is 75,290 + 2,752 ("≈78k", FedDF). WRN-16-4 is "2.7M"
# (Zagoruyko & Komodakis Table 1), 2,748,890 exactly. LeNet-5 on MNIST is the textbook 61,706 and the
# FedAvg 2NN 199,210.
EXACT = {
    ("resnet8", 3, 32): 78_042,
    ("resnet20", 3, 32): 272_474,
    ("wrn16_4", 3, 32): 2_748_890,
    ("lenet", 1, 28): 61_706,
    ("mlp", 1, 28): 199_210,
}
PUBLISHED = {"resnet8": 78_000, "resnet20": 270_000, "wrn16_4": 2_700_000}


@pytest.mark.parametrize("key", sorted(EXACT), ids=lambda k: k[0])
def test_parameter_counts(key: tuple[str, int, int]) -> None:
    name, channels, size = key
    n = count_parameters(build_model(name, in_channels=channels, num_classes=10, image_size=size))
    assert n == EXACT[key]
    if name in PUBLISHED:
        assert abs(n - PUBLISHED[name]) <= 0.05 * PUBLISHED[name]


def test_resnet20_option_a_equivalent_matches_he_et_al() -> None:
    model = build_model("resnet20", in_channels=3, num_classes=10, image_size=32)
    shortcut = sum(p.numel() for k, p in model.named_parameters() if ".shortcut." in k)
    assert count_parameters(model) - shortcut == 269_722


@pytest.mark.parametrize("name", sorted(EMBED_DIMS))
def test_same_seed_same_parameters(name: str) -> None:
    states = []
    for _ in range(2):
        torch.manual_seed(123)
        states.append(build_model(name, in_channels=1, num_classes=10, image_size=8).state_dict())
    assert states[0].keys() == states[1].keys()
    assert all(torch.equal(states[0][k], states[1][k]) for k in states[0])
    torch.manual_seed(124)
    other = build_model(name, in_channels=1, num_classes=10, image_size=8).state_dict()
    assert not all(torch.equal(states[0][k], other[k]) for k in other)


def test_unknown_model_lists_choices() -> None:
    with pytest.raises(ConfigError, match="nope") as info:
        build_model("nope", in_channels=1, num_classes=10, image_size=8)
    for name in EMBED_DIMS:
        assert name in str(info.value)


@pytest.mark.parametrize("name", sorted(EMBED_DIMS))
def test_unknown_option_is_named(name: str) -> None:
    with pytest.raises(ConfigError, match="widht"):
        build_model(name, in_channels=1, num_classes=10, image_size=8, widht=3)


def test_mlp_options() -> None:
    model = build_model("mlp", in_channels=1, num_classes=10, image_size=8, hidden=32, layers=3)
    assert model.embed_dim == 32
    assert sum(isinstance(m, torch.nn.Linear) for m in model.modules()) == 4
    assert model(torch.randn(2, 1, 8, 8)).shape == (2, 10)
    with pytest.raises(ConfigError, match="layers"):
        build_model("mlp", in_channels=1, num_classes=10, image_size=8, layers=0)
    with pytest.raises(ConfigError, match="hidden"):
        build_model("mlp", in_channels=1, num_classes=10, image_size=8, hidden=2.5)


def test_bad_shapes_are_config_errors() -> None:
    with pytest.raises(ConfigError, match="image_size"):
        build_model("cnn", in_channels=1, num_classes=10, image_size=4)
    with pytest.raises(ConfigError, match="num_classes"):
        build_model("resnet8", in_channels=1, num_classes=0, image_size=8)
    with pytest.raises(ConfigError, match="dropout"):
        build_model("wrn16_4", in_channels=1, num_classes=10, image_size=8, dropout=1.5)


def test_state_nbytes_counts_parameters_and_buffers() -> None:
    model = build_model("resnet8", in_channels=3, num_classes=10, image_size=32)
    state = model.state_dict()
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert state_nbytes(state) == 4 * count_parameters(model) + buffers
    assert state_nbytes({"w": torch.zeros(3, dtype=torch.float16)}) == 6


def test_resnet_init_he_or_torch_defaults() -> None:
    def conv_std(init: str) -> float:
        torch.manual_seed(0)
        m = build_model("resnet8", in_channels=3, num_classes=10, image_size=32, init=init)
        return float(m.layers[2].conv2.weight.detach().std())

    fan_out = 64 * 9  # He-normal, fan_out mode: std = sqrt(2 / fan_out); PyTorch's default is ~3x smaller
    assert conv_std("he") == pytest.approx((2 / fan_out) ** 0.5, rel=0.05)
    assert conv_std("torch") == pytest.approx((1 / (3 * fan_out)) ** 0.5, rel=0.05)
    with pytest.raises(ConfigError, match="init must be 'he' or 'torch'"):
        build_model("resnet8", in_channels=3, num_classes=10, image_size=32, init="xavier")
