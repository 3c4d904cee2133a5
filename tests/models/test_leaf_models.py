"""LEAF's models: output shapes, parameter counts equal to LEAF's TensorFlow models (counted by hand here), the
one-bias LSTM against a hand-written BasicLSTMCell, and Sent140's frozen or trainable table."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.errors import ConfigError
from fedsim.models import build_model, count_parameters
from fedsim.models.leaf import OneBiasLSTM


def lstm_cell(inputs: int, hidden: int) -> int:
    """TF BasicLSTMCell: kernel [(inputs + hidden), 4·hidden] and one bias [4·hidden]."""
    return (inputs + hidden) * 4 * hidden + 4 * hidden


def dense(inputs: int, units: int) -> int:
    return inputs * units + units


def test_femnist_cnn_has_leafs_size_and_shape() -> None:
    model = build_model("leaf_cnn", 1, 62, 28)
    conv1, conv2 = 5 * 5 * 1 * 32 + 32, 5 * 5 * 32 * 64 + 64
    assert count_parameters(model) == conv1 + conv2 + dense(7 * 7 * 64, 2048) + dense(2048, 62) == 6_603_710
    assert model(torch.zeros(3, 1, 28, 28)).shape == (3, 62)
    assert model.embed(torch.zeros(1, 1, 28, 28)).shape == (1, 2048)


def test_shakespeare_lstm_has_leafs_size_and_shape() -> None:
    model = build_model("leaf_lstm", 1, 80, 0)
    expected = 80 * 8 + lstm_cell(8, 256) + lstm_cell(256, 256) + dense(256, 80)
    assert count_parameters(model) == expected == 817_872
    assert model(torch.randint(0, 80, (2, 80))).shape == (2, 80)


def test_sent140_lstm_trainable_table_has_leafs_size() -> None:
    model = build_model("leaf_sent140", 1, 2, 0, vocab_size=1000)
    expected = 1001 * 100 + lstm_cell(100, 100) + lstm_cell(100, 100) + dense(100, 128) + dense(128, 2)
    assert count_parameters(model) == expected
    assert model(torch.full((4, 25), 1000)).shape == (4, 2)
    with pytest.raises(ConfigError, match="word id 1001 is past its 1001-row embedding"):
        model(torch.full((1, 25), 1001))


def test_sent140_lstm_over_a_glove_file_keeps_it_frozen(tmp_path: Path) -> None:
    glove = tmp_path / "g.txt"
    glove.write_text("a 1 2 3\nb 4 5 6\n")
    model = build_model("leaf_sent140", 1, 2, 0, embedding=str(glove))
    assert count_parameters(model) == lstm_cell(3, 100) + lstm_cell(100, 100) + dense(100, 128) + dense(128, 2)
    assert "table" not in model.state_dict()
    np.testing.assert_array_equal(model.table.numpy(), [[1, 2, 3], [4, 5, 6], [0, 0, 0]])  # unknown: zeros
    assert model(torch.tensor([[0, 1] + [2] * 23])).shape == (1, 2)


def test_one_bias_lstm_is_tensorflows_basic_lstm_cell() -> None:
    torch.manual_seed(0)
    lstm = OneBiasLSTM(3, 4, 2)
    first = lstm.layers[0].weight_ih_l0
    assert torch.equal(first[:, -1], torch.tensor([0.0] * 4 + [1.0] * 4 + [0.0] * 8))  # forget bias 1, else 0
    with torch.no_grad():
        for layer in lstm.layers:
            layer.weight_ih_l0[:, -1].normal_()  # a trained bias
    x = torch.randn(2, 5, 3)
    out = x
    for layer in lstm.layers:
        w, u = layer.weight_ih_l0.detach(), layer.weight_hh_l0.detach()
        kernel, bias = w[:, :-1], w[:, -1]
        h, c, steps = torch.zeros(2, 4), torch.zeros(2, 4), []
        for t in range(out.shape[1]):
            i, f, g, o = (out[:, t] @ kernel.T + h @ u.T + bias).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
            steps.append(h)
        out = torch.stack(steps, 1)
    torch.testing.assert_close(lstm(x), out[:, -1], atol=1e-5, rtol=1e-5)
