"""The shared model helpers: the reused evaluation model scores every set of weights as a new instance would."""

from __future__ import annotations

import pytest
import torch

import fedsim.method.toolkit as toolkit
from fedsim.method.toolkit import evaluate_models, loaded_model, seeded_model
from fedsim.runtime.setup import build_env, load_data, make_partition
from fedsim.training.train import evaluate_classifier


@pytest.mark.parametrize("arch", ["resnet8", "mlp"])
def test_evaluation_reuses_one_model_and_scores_each_weights_as_new(make_config, monkeypatch, arch):
    cfg = make_config(f"model.name={arch}")
    data = load_data(cfg)
    env = build_env(cfg, data, make_partition(cfg, data), torch.device("cpu"))
    x, y = torch.as_tensor(data.x_test), torch.as_tensor(data.y_test)
    built = []
    new_model = toolkit.new_model
    monkeypatch.setattr(toolkit, "new_model", lambda *a: built.append(a[1]) or new_model(*a))
    states = []
    for seed in (1, 2, 1):  # BatchNorm's running statistics differ between the first two
        model = seeded_model(env, arch, seed)
        if arch == "resnet8":
            model.train()
            with torch.no_grad():
                model(x[:64] * seed)  # running statistics of their own
        states.append({k: v.clone() for k, v in model.state_dict().items()})
    built.clear()
    rows = [evaluate_models(env, {arch: s}, x, y, torch.device("cpu"))[0] for s in states]
    assert built == [arch]  # one instance, reused
    for row, state in zip(rows, states, strict=True):
        fresh = evaluate_classifier(loaded_model(env, arch, state, "cpu"), x, y, cfg.eval.batch_size)
        assert row == {"model": arch, **fresh}
    assert rows[0] != rows[1] and rows[0] == rows[2]
