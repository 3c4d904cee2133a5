"""TextCNN and Bi-LSTM over a frozen embedding table: token ids and embedded inputs are interchangeable,
the table is neither trained nor shipped, and DOSFL's second-order meta-gradients exist."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedsim.algorithms._meta_distill import Distiller, DistillSettings, trainable, xavier_init_
from fedsim.errors import ConfigError
from fedsim.models import build_model
from fedsim.models import text as _text  # noqa: F401  (registers textcnn / bilstm)

TABLE = np.random.default_rng(0).standard_normal((20, 6)).astype(np.float32)


@pytest.mark.parametrize("name,opts", [("textcnn", {"filters": 4, "kernel_sizes": [2, 3]}), ("bilstm", {"hidden": 5})])
def test_ids_and_embedded_inputs_agree_and_table_is_frozen(name, opts, tmp_path) -> None:
    path = tmp_path / "table.npy"
    np.save(path, TABLE)
    torch.manual_seed(0)
    model = build_model(name, 1, 3, 0, embedding=str(path), **opts)
    ids = torch.tensor([[2, 5, 7, 0], [19, 1, 3, 4]])
    vectors = torch.from_numpy(TABLE)[ids]
    torch.testing.assert_close(model(ids), model(vectors))
    assert model(ids).shape == (2, 3)
    assert model.continuous_input_shape((4,)) == (4, 6)
    assert "table" not in model.state_dict()  # FedAvg payloads carry only trained weights
    assert all("table" not in n for n, _ in model.named_parameters())
    torch.testing.assert_close(model.table, torch.from_numpy(TABLE))
    before = model.table.clone()
    xavier_init_(model, 0)
    assert torch.equal(model.table, before)


def test_missing_embedding_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="model.options.embedding"):
        build_model("textcnn", 1, 2, 0)
    with pytest.raises(ConfigError, match="unknown option"):
        build_model("bilstm", 1, 2, 0, embedding=TABLE, width=3)


def test_bilstm_meta_gradient_matches_finite_differences() -> None:
    """Distilled sentences (continuous L×D) get exact second-order gradients through the hand-written LSTM."""
    torch.manual_seed(0)
    model = build_model("bilstm", 1, 2, 0, embedding=TABLE, hidden=3).double()
    xavier_init_(model, 1)
    theta0, rest = trainable(model)
    s = DistillSettings(steps=2, batch=1, epochs=1, lr0=0.5, soft_labels=True)
    d = Distiller(s, model.continuous_input_shape((4,)), 2, torch.Generator().manual_seed(0), dtype=torch.float64)
    ids = torch.tensor([[2, 3, 4, 0], [5, 6, 0, 0], [7, 8, 9, 10]])
    y = torch.tensor([0, 1, 1])
    d.meta_loss(model, theta0, rest, ids, y).backward()
    eps, flat = 1e-6, d.x.data.view(-1)
    for i in (0, 7, 30):
        old = flat[i].item()
        flat[i] = old + eps
        up = d.meta_loss(model, theta0, rest, ids, y).item()
        flat[i] = old - eps
        down = d.meta_loss(model, theta0, rest, ids, y).item()
        flat[i] = old
        assert d.x.grad.view(-1)[i].item() == pytest.approx((up - down) / (2 * eps), rel=1e-5, abs=1e-9)
    assert d.x.grad.abs().max() > 0
