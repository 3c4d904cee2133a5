"""DaFKD's mechanism columns: present, in range, off the training path, and wired to what they claim."""

from __future__ import annotations

import pytest
import torch

from fedsim.algorithms.dafkd import DaFKD
from fedsim.results.tables import load
from fedsim.runtime.loop import run
from tests.conftest import small_config
from tests.mechanism_check import check_mechanism

TINY = ["algorithm.gen_width=4", "algorithm.noise_dim=8", "algorithm.distill_size=40",
        "algorithm.distill.batch_size=16", "algorithm.distill.epochs=1", "train.optimizer=adam", "train.lr=0.001"]


def test_columns_present_in_range_and_off_the_training_path(tmp_path):
    rounds = check_mechanism(tmp_path, "dafkd", *TINY, "algorithm.distill_from_round=1")
    r0, r1 = rounds.iloc[0], rounds.iloc[1]
    assert r0["train/mech_acc_after_distill"] != r0["train/mech_acc_after_distill"]  # NaN: round 0 only averages
    assert r1["train/mech_acc_after_distill"] == pytest.approx(r1["accuracy"])  # what evaluate() then reports
    for col in ("teacher_acc", "teacher_acc_uniform", "disc_auc", "acc_before_distill", "gen_class_entropy",
                "alpha_entropy"):
        assert 0.0 <= r1[f"train/mech_{col}"] <= 1.0
    assert 1 / 4 - 1e-6 <= r1["train/mech_alpha_max_mean"] <= 1.0  # 4 arrivals


def test_equal_domain_scores_make_the_two_teachers_equal(tmp_path, monkeypatch):
    """With every f_k(x) equal, α̂ is uniform: the weighted teacher is the uniform one, α̂ has full entropy."""
    plain = DaFKD.score

    def flat(self, model, head, disc, x):
        logits, f = plain(self, model, head, disc, x)
        return logits, torch.full_like(f, 0.5)

    monkeypatch.setattr(DaFKD, "score", flat)
    df = load(run(small_config(tmp_path, "algorithm.name=dafkd", *TINY, rounds=1)))["rounds"]
    row = df.iloc[0]
    assert row["train/mech_teacher_acc"] == row["train/mech_teacher_acc_uniform"]
    assert row["train/mech_alpha_max_mean"] == pytest.approx(0.25)
    assert row["train/mech_alpha_entropy"] == pytest.approx(1.0)
    assert row["train/mech_disc_auc"] == pytest.approx(0.5)  # constant scores: every pair ties
