"""Text classifiers over a frozen word-embedding table: a TextCNN (Kim 2014) and a one-layer Bi-LSTM.

DOSFL (Zhou et al. 2020) trains them on sentences of GloVe vectors; its distilled sentences are continuous
L×D matrices, so `forward` takes token ids (N×L integers, looked up in the table) or already-embedded
inputs (N×L×D floats) alike. The table is a non-persistent buffer: it is neither trained nor part of the
state dict, so FedAvg payloads carry only the trainable weights. The Bi-LSTM is written with plain matmuls
so that second derivatives (DOSFL's unrolled meta-gradients) exist on every device, cuDNN included.
Options: `embedding` (path to a GloVe-format .txt, a .npy table, or a .npz with an `embedding` array; the
same file the text dataset was tokenised with), `max_vocab`, and the architecture sizes below.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fedsim.errors import ConfigError
from fedsim.models.registry import Classifier, check_options, positive_int, register_model


class TextModel(Classifier):
    """Common part: the frozen table and the id-or-vector input convention."""

    table: torch.Tensor  # a buffer

    def __init__(self, table: torch.Tensor) -> None:
        super().__init__()
        self.register_buffer("table", table.float(), persistent=False)
        self.word_dim = int(table.shape[1])

    def lookup(self, x: torch.Tensor) -> torch.Tensor:
        """N×L token ids -> N×L×D vectors; float inputs are taken as already embedded."""
        return x if x.is_floating_point() else F.embedding(x, self.table)

    def continuous_input_shape(self, input_shape: tuple[int, ...]) -> tuple[int, ...]:
        """Shape of one input after the embedding layer, where distilled sentences live: (L, D)."""
        return (*input_shape, self.word_dim)


class TextCNN(TextModel):
    """Embedding -> parallel conv1d (kernel sizes 3/4/5, `filters` each) -> ReLU -> max over time -> linear."""

    def __init__(self, table: torch.Tensor, num_classes: int, filters: int = 100,
                 kernel_sizes: tuple[int, ...] = (3, 4, 5), dropout: float = 0.0) -> None:
        super().__init__(table)
        self.convs = nn.ModuleList(nn.Conv1d(self.word_dim, filters, k) for k in kernel_sizes)
        self.embed_dim = filters * len(kernel_sizes)
        self.drop = nn.Dropout(dropout)
        self.fc = nn.Linear(self.embed_dim, num_classes)

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Max-pooled n-gram features, (N, filters·len(kernel_sizes))."""
        e = self.lookup(x).transpose(1, 2)  # N×D×L
        return self.drop(torch.cat([F.relu(conv(e)).amax(-1) for conv in self.convs], 1))

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


class BiLSTM(TextModel):
    """Embedding -> one bidirectional LSTM layer -> [last forward state, last backward state] -> linear."""

    def __init__(self, table: torch.Tensor, num_classes: int, hidden: int = 128) -> None:
        super().__init__(table)
        self.hidden = hidden
        self.ih = nn.ModuleList(nn.Linear(self.word_dim, 4 * hidden) for _ in range(2))
        self.hh = nn.ModuleList(nn.Linear(hidden, 4 * hidden, bias=False) for _ in range(2))
        self.embed_dim = 2 * hidden
        self.fc = nn.Linear(self.embed_dim, num_classes)

    def _run(self, e: torch.Tensor, d: int) -> torch.Tensor:
        n, length, _ = e.shape
        h = e.new_zeros(n, self.hidden)
        c = e.new_zeros(n, self.hidden)
        pre = self.ih[d](e)  # N×L×4H, all time steps at once
        steps = range(length) if d == 0 else range(length - 1, -1, -1)
        for t in steps:
            i, f, g, o = (pre[:, t] + self.hh[d](h)).chunk(4, dim=1)
            c = torch.sigmoid(f) * c + torch.sigmoid(i) * torch.tanh(g)
            h = torch.sigmoid(o) * torch.tanh(c)
        return h

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        """Final hidden states of both directions, (N, 2·hidden)."""
        e = self.lookup(x)
        return torch.cat([self._run(e, 0), self._run(e, 1)], 1)

    def head(self, z: torch.Tensor) -> torch.Tensor:
        return self.fc(z)


def resolve_table(model: str, embedding: Any, max_vocab: int | None) -> torch.Tensor:
    """The embedding table from a file path (via fedsim.data.text) or an array."""
    if embedding is None:
        raise ConfigError(f"model {model}: set model.options.embedding to the embedding file the text dataset "
                          "uses (GloVe .txt, .npy or .npz)")
    if isinstance(embedding, (np.ndarray, torch.Tensor)):
        return torch.as_tensor(np.asarray(embedding, dtype=np.float32))
    from fedsim.data.text import load_embedding_table

    return torch.from_numpy(load_embedding_table(str(embedding), max_vocab)[1])


@register_model("textcnn")
def textcnn(in_channels: int, num_classes: int, image_size: int, embedding: Any = None,
            max_vocab: int | None = None, filters: int = 100, kernel_sizes: list[int] | None = None,
            dropout: float = 0.0, **kw: object) -> TextCNN:
    """TextCNN over a frozen embedding table (DOSFL's IMDB model; its exact shape is not in the paper)."""
    check_options("textcnn", kw)
    positive_int("textcnn", "num_classes", num_classes)
    sizes = tuple(positive_int("textcnn", "kernel_sizes", k) for k in (kernel_sizes or (3, 4, 5)))
    if not 0 <= dropout < 1:
        raise ConfigError(f"model textcnn: dropout must be in [0, 1), got {dropout}")
    return TextCNN(resolve_table("textcnn", embedding, max_vocab), num_classes,
                   positive_int("textcnn", "filters", filters), sizes, dropout)


@register_model("bilstm")
def bilstm(in_channels: int, num_classes: int, image_size: int, embedding: Any = None,
           max_vocab: int | None = None, hidden: int = 128, **kw: object) -> BiLSTM:
    """Bi-LSTM over a frozen embedding table (DOSFL's TREC-6 model; its exact shape is not in the paper)."""
    check_options("bilstm", kw)
    positive_int("bilstm", "num_classes", num_classes)
    return BiLSTM(resolve_table("bilstm", embedding, max_vocab), num_classes,
                  positive_int("bilstm", "hidden", hidden))
