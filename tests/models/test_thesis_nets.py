"""The FedGDKD thesis models have the exact Appendix B shapes and the sizes derived from them (spec §3.5–3.6)."""

from __future__ import annotations

import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.models import Classifier, build_model, count_parameters, state_nbytes
from fedsim.models.thesis_nets import (
    TABLE_5_4,
    CNNDiscriminator,
    GeneratorConfig,
    build_generator,
)


# Classifier-only parameter counts on MNIST at 32×32, 10 classes (spec §3.5, derived from Table 5.4).
# E.g. [8, 8, 8]: convs 72+576+576, IN 3·16, F=8·4·4=128, Linear(128,128)+Linear(128,10) = 16,512+1,290.
@pytest.fixture(autouse=True)
def one_thread():
    """The 2 CPUs are shared by parallel jobs; oversubscribed OpenMP threads spin for whole seconds."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


TABLE_5_4_PARAMS = [268_410, 43_674, 37_794, 19_074, 188_394, 85_866, 135_002, 273_194, 16_794, 59_706]


@pytest.mark.parametrize("client", range(10))
def test_table_5_4_architectures_have_the_derived_sizes(client: int) -> None:
    name = "cnn_" + "_".join(map(str, TABLE_5_4[client]))
    assert count_parameters(build_model(name, 1, 10, 32)) == TABLE_5_4_PARAMS[client]


def test_named_cnns_match_the_author_code_widths() -> None:
    assert count_parameters(build_model("cnn_medium", 1, 10, 32)) == TABLE_5_4_PARAMS[2]  # [8, 16, 16]
    assert count_parameters(build_model("cnn_large", 1, 10, 32)) == TABLE_5_4_PARAMS[5]  # [32, 32, 32]
    # cnn_small [8, 8]: convs 72+576, IN 32, F=8·8·8=512, Linear(512,128)=65,664, Linear(128,10)=1,290
    assert count_parameters(build_model("cnn_small", 1, 10, 32)) == 72 + 576 + 32 + 65_664 + 1_290
    custom = build_model("cnn_custom", 1, 10, 32, widths=[16, 32])
    assert count_parameters(custom) == TABLE_5_4_PARAMS[0]


def test_block_layout_and_embedding() -> None:
    model = build_model("cnn_medium", 1, 47, 32).eval()
    assert isinstance(model, Classifier) and model.embed_dim == 128
    convs = [m for m in model.modules() if isinstance(m, torch.nn.Conv2d)]
    assert [(c.kernel_size, c.stride, c.padding, c.bias) for c in convs] == [((3, 3), (2, 2), (1, 1), None)] * 3
    assert all(m.affine for m in model.modules() if isinstance(m, torch.nn.InstanceNorm2d))
    x = torch.randn(2, 1, 32, 32)
    with torch.no_grad():  # no activation between the two Linears: head(embed(x)) is the whole model
        assert model(x).shape == (2, 47)
        assert torch.equal(model.head(model.embed(x)), model(x))
    assert model.fc1.in_features == 256  # 16 filters × 4 × 4


@pytest.mark.parametrize("size", [8, 28, 32])
def test_every_depth_builds_for_small_images(size: int) -> None:
    for widths in TABLE_5_4:
        out = build_model("cnn_" + "_".join(map(str, widths)), 1, 10, size)(torch.randn(2, 1, size, size))
        assert out.shape == (2, 10)


def test_generator_is_appendix_b31() -> None:
    # Embedding 10×100 + Linear(100, 6400) 646,400 + ConvT 400→200 1,280,000 + BN 400 + ConvT 200→100 320,000
    # + BN 200 + ConvT 100→1 1,600 = 2,249,600 (spec §1.8); EMNIST's 47-row embedding adds 3,700.
    g = build_generator(10, (1, 32, 32), GeneratorConfig())
    assert count_parameters(g) == 2_249_600
    assert count_parameters(build_generator(47, (1, 32, 32), GeneratorConfig())) == 2_253_300
    # the state that travels: parameters + BN running mean/var (600) + 2 counters; not the rescaling buffers
    assert state_nbytes(g.state_dict()) == (2_249_600 + 600) * 4 + 2 * 8
    g.eval()
    with torch.no_grad():
        x = g(torch.randn(5, 100), torch.arange(5))
    assert x.shape == (5, 1, 32, 32) and x.abs().max() <= 1.0  # mean = std = 0.5: exactly Tanh's [-1, 1]


def test_generator_output_lands_on_the_dataset_scale() -> None:
    g = build_generator(10, (1, 8, 8), GeneratorConfig(nz=16, ngf=8, init_size=2), mean=(0.25,), std=(0.5,))
    g.eval()
    with torch.no_grad():
        x = g(torch.randn(64, 16), torch.arange(64) % 10)
        t = g.main(g.l1(g.label_emb(torch.arange(64) % 10) * torch.zeros(64, 16)).view(-1, 16, 2, 2))
    assert x.shape == (64, 1, 8, 8)
    assert x.min() >= (0.0 - 0.25) / 0.5 and x.max() <= (1.0 - 0.25) / 0.5  # pixels in [0, 1], normalised
    torch.testing.assert_close(g(torch.zeros(64, 16), torch.arange(64) % 10), ((t + 1) / 2 - 0.25) / 0.5)


def test_generator_rejects_sizes_it_cannot_reach() -> None:
    with pytest.raises(ConfigError, match="init_size"):
        build_generator(10, (1, 28, 28), GeneratorConfig())  # 28 = 4·7
    assert build_generator(10, (1, 28, 28), GeneratorConfig(init_size=7))(
        torch.randn(2, 100), torch.tensor([0, 1])).shape == (2, 1, 28, 28)


def test_discriminator_heads() -> None:
    d = CNNDiscriminator(1, 32, [8, 16, 16], num_classes=10)
    v, c = d(torch.randn(3, 1, 32, 32))
    assert v.shape == (3,) and c.shape == (3, 10)
    v, c = CNNDiscriminator(1, 8, [8, 16, 16])(torch.randn(3, 1, 8, 8))
    assert v.shape == (3,) and c is None


def test_bad_options_name_the_key() -> None:
    with pytest.raises(ConfigError, match="widths"):
        build_model("cnn_custom", 1, 10, 32, widths=[])
    with pytest.raises(ConfigError, match="unknown option 'widths'"):
        build_model("cnn_small", 1, 10, 32, widths=[8])


def test_a_one_pixel_map_is_not_instance_normalised() -> None:
    """On 8×8 digits cnn_medium goes 8→4→2→1; InstanceNorm of the 1×1 map would make every logit constant."""
    model = build_model("cnn_medium", 1, 10, 8).eval()
    assert sum(isinstance(m, torch.nn.InstanceNorm2d) for m in model.modules()) == 2
    with torch.no_grad():
        out = model(torch.randn(4, 1, 8, 8))
    assert (out - out[0]).abs().max() > 0
