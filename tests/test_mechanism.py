"""fedsim.method.mechanism's measures against hand-computed values, and the generated docs/mechanism.md."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.method import mechanism
from fedsim.method.contract import algorithm_names, get_algorithm
from tests.conftest import ROOT
from tests.forked import run_module


def test_accuracy_agreement_and_entropy_by_hand():
    scores = torch.tensor([[2.0, 1.0], [0.0, 3.0], [5.0, 4.0]])
    assert mechanism.accuracy(scores, torch.tensor([0, 1, 1])) == pytest.approx(2 / 3)
    assert mechanism.agreement(scores, torch.tensor([[0.9, 0.1], [0.6, 0.4], [0.2, 0.8]])) == pytest.approx(1 / 3)
    assert mechanism.entropy_bits(torch.tensor([0.5, 0.5])).item() == pytest.approx(1.0)
    assert mechanism.entropy_bits(torch.tensor([[0.25] * 4, [1.0, 0, 0, 0]])).tolist() == pytest.approx([2.0, 0.0])


def test_class_balance_uniform_collapsed_and_partial():
    assert mechanism.class_balance(np.arange(10), 10) == pytest.approx({"entropy_frac": 1.0, "max_share": 0.1})
    assert mechanism.class_balance(np.zeros(7, int), 10) == pytest.approx({"entropy_frac": 0.0, "max_share": 1.0})
    half = mechanism.class_balance(np.array([0, 0, 1, 1]), 4)  # 2 of 4 classes, evenly: 1 bit of 2
    assert half == pytest.approx({"entropy_frac": 0.5, "max_share": 0.5})


def test_concentration_from_uniform_to_one_member():
    assert mechanism.concentration(torch.full((4, 3), 0.25)) == pytest.approx({"max_mean": 0.25, "entropy_frac": 1.0})
    one = torch.zeros(4, 3)
    one[2] = 1.0
    assert mechanism.concentration(one) == pytest.approx({"max_mean": 1.0, "entropy_frac": 0.0})


def test_auc_counts_pairs_and_ties():
    assert mechanism.auc(torch.tensor([0.9, 0.8]), torch.tensor([0.1, 0.2])) == 1.0
    assert mechanism.auc(torch.tensor([0.1]), torch.tensor([0.9])) == 0.0
    # pairs: (0.5 vs 0.5) tie = 0.5, (0.5 vs 0.2) = 1, (0.9 vs both) = 2 -> 3.5 of 4
    assert mechanism.auc(torch.tensor([0.5, 0.9]), torch.tensor([0.5, 0.2])) == pytest.approx(0.875)
    assert math.isnan(mechanism.auc(torch.tensor([]), torch.tensor([0.3])))


def test_probe_set_is_a_fixed_subset_and_off_when_disabled(make_config):
    from fedsim.runtime.setup import build_env, load_data, make_partition

    def probe(*overrides):
        cfg = make_config(*overrides)
        data = load_data(cfg)
        env = build_env(cfg, data, make_partition(cfg, data), torch.device("cpu"))
        env.extras["server_data"] = data
        return mechanism.probe_set(env), data

    (x, y), data = probe("eval.mechanism_samples=50")
    (x2, y2), _ = probe("eval.mechanism_samples=50")
    assert len(y) == 50 and torch.equal(x, x2) and torch.equal(y, y2)
    assert set(y.tolist()) <= set(data.y_test.tolist())
    (xa, _), _ = probe("eval.mechanism_samples=100000")
    assert len(xa) == len(data.y_test)
    assert probe("eval.mechanism=false")[0] is None


def test_docs_mechanism_reference_is_current():
    proc = run_module("jobs.cli", ["mechanism-reference"])
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "`train/mech_" in proc.stdout  # a reference of the columns, not an empty page
    doc = (Path(ROOT) / "docs" / "mechanism.md").read_text()
    assert proc.stdout.strip() in doc, "docs/mechanism.md is stale: regenerate it with `make docs`"
    documented = [n for n in algorithm_names() if get_algorithm(n).mechanism_columns]
    assert {"dafkd", "feddf", "single_image", "fedgdkd", "dosfl"} <= set(documented)
