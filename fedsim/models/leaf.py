"""LEAF's reference models (TalwalkarLab/leaf `models/*/`), with LEAF's parameter counts.

LEAF's LSTMs are TensorFlow `BasicLSTMCell`s: one bias per gate (torch's LSTM has two) and a constant forget bias
of 1. Here each layer is a torch LSTM without biases fed its input plus a constant-1 column, whose weights are the
one bias, starting at 1 for the forget gate and 0 elsewhere: the same function and parameter count as LEAF's,
and the fused (cuDNN) LSTM still runs. Initial weights are torch's defaults, not TensorFlow's Glorot ones.

  - `leaf_cnn` (FEMNIST): conv 5×5 32 same + ReLU → maxpool 2 → conv 5×5 64 same + ReLU → maxpool 2 → dense 2048
    + ReLU → classes.
  - `leaf_lstm` (Shakespeare): embedding of the 80 symbols → 8, 2-layer LSTM 256, dense on the last step.
  - `leaf_sent140`: embedding → 2-layer LSTM 100 → last step → dense 128 (no activation) → classes. With
    `embedding` (the GloVe file the dataset read, same `max_vocab`) the table is that file's, frozen, as the issue
    asks (a buffer outside the state dict); without it a trainable [vocab_size + 1, 100] table, as LEAF's code
    (which uses GloVe only for the vocabulary: give the data `embedding` and the model `vocab_size` = V for that).
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.registry import Classifier, check_options, positive_int, register_model


class LeafCNN(Classifier):
    """LEAF's FEMNIST CNN."""

    def __init__(self, in_channels: int, num_classes: int, image_size: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, 32, 5, padding=2)
        self.conv2 = nn.Conv2d(32, 64, 5, padding=2)
        side = image_size // 4
        self.fc1 = nn.Linear(64 * side * side, 2048)
        self.fc2 = nn.Linear(2048, num_classes)
        self.embed_dim = 2048

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        x = F.max_pool2d(F.relu(self.conv1(x)), 2)
        x = F.max_pool2d(F.relu(self.conv2(x)), 2)
        return F.relu(self.fc1(x.flatten(1)))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc2(z)


class OneBiasLSTM(nn.Module):
    """Stacked LSTM layers with TensorFlow's BasicLSTMCell parameters: kernel [(in + hidden), 4·hidden] and one
    bias, carried by a constant-1 input column (see the module docstring). Returns the top layer's last output."""

    def __init__(self, input_size: int, hidden: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.LSTM(input_size + 1 if i == 0 else hidden + 1, hidden, bias=False, batch_first=True)
            for i in range(layers))
        with torch.no_grad():
            for lstm in self.layers:
                weight: torch.Tensor = lstm.weight_ih_l0  # type: ignore[assignment]
                bias = weight[:, -1]  # gates i, f, g, o: the forget bias of BasicLSTMCell is 1
                bias.zero_()
                bias[hidden: 2 * hidden] = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ones = x.new_ones(*x.shape[:2], 1)
        for lstm in self.layers:
            x, _ = lstm(torch.cat([x, ones], 2))
        return x[:, -1]


class LeafShakespeareLSTM(Classifier):
    """LEAF's Shakespeare model: 8-d character embedding, 2-layer LSTM, dense on the last step."""

    def __init__(self, num_classes: int, symbols: int = 80, embed: int = 8, hidden: int = 256) -> None:
        super().__init__()
        self.embedding = nn.Embedding(symbols, embed)
        self.lstm = OneBiasLSTM(embed, hidden, 2)
        self.fc = nn.Linear(hidden, num_classes)
        self.embed_dim = hidden

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(self.embedding(x))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


class LeafSent140LSTM(Classifier):
    """LEAF's Sent140 model: word embedding, 2-layer LSTM, dense 128 without activation, dense to the classes."""

    table: torch.Tensor | None

    def __init__(self, num_classes: int, table: torch.Tensor | None, vocab_size: int, hidden: int = 100) -> None:
        super().__init__()
        self.embedding: nn.Embedding | None = None
        if table is not None:
            self.register_buffer("table", table.float(), persistent=False)
        else:
            self.embedding = nn.Embedding(vocab_size + 1, hidden)
            self.table = None
        self.rows = int(table.shape[0]) if table is not None else vocab_size + 1
        self.lstm = OneBiasLSTM(int(table.shape[1]) if table is not None else hidden, hidden, 2)
        self.fc1 = nn.Linear(hidden, 128)
        self.fc2 = nn.Linear(128, num_classes)
        self.embed_dim = 128

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        if x.numel() and (int(x.min()) < 0 or int(x.max()) >= self.rows):
            raise ConfigError(f"model leaf_sent140: word id {int(x.max())} is past its {self.rows}-row embedding; "
                              "give it the data's embedding/max_vocab, or vocab_size")
        if self.embedding is not None:
            e = self.embedding(x)
        else:
            assert self.table is not None
            e = F.embedding(x, self.table)
        return self.fc1(self.lstm(e))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc2(z)


@register_model("leaf_cnn")
def leaf_cnn(in_channels: int, num_classes: int, image_size: int, **kw: object) -> LeafCNN:
    """LEAF's FEMNIST CNN (6,603,710 parameters for 1×28×28 and 62 classes)."""
    check_options("leaf_cnn", kw)
    positive_int("leaf_cnn", "num_classes", num_classes)
    if image_size < 4:
        raise ConfigError(f"model leaf_cnn: needs images of at least 4×4 pixels, got {image_size}")
    return LeafCNN(in_channels, num_classes, image_size)


@register_model("leaf_lstm")
def leaf_lstm(in_channels: int, num_classes: int, image_size: int, **kw: object) -> LeafShakespeareLSTM:
    """LEAF's Shakespeare LSTM over the 80-symbol table (817,872 parameters for 80 classes)."""
    check_options("leaf_lstm", kw)
    return LeafShakespeareLSTM(positive_int("leaf_lstm", "num_classes", num_classes))


@register_model("leaf_sent140")
def leaf_sent140(in_channels: int, num_classes: int, image_size: int, embedding: str | None = None,
                 max_vocab: int | None = None, vocab_size: int = 10_000, **kw: object) -> LeafSent140LSTM:
    """LEAF's Sent140 LSTM: over the frozen table of `embedding`, else a trainable [vocab_size + 1, 100] one."""
    check_options("leaf_sent140", kw)
    positive_int("leaf_sent140", "num_classes", num_classes)
    table = None
    if embedding is not None:
        from fedsim.data.text import load_embedding_table

        words, rows = load_embedding_table(str(embedding), max_vocab)
        if not words:
            raise ConfigError("model leaf_sent140: embedding must be the GloVe-format .txt file the data read")
        table = torch.from_numpy(np.concatenate([rows[2:], np.zeros((1, rows.shape[1]), np.float32)]))
    return LeafSent140LSTM(num_classes, table, positive_int("leaf_sent140", "vocab_size", vocab_size))
