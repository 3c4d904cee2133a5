"""FedDF / single-image mechanism columns (present, in range, off the training path, wired to what they claim),
and the embedded single-image default in which KMeans really removes patches before entropy pruning."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

from fedsim.algorithms._selection import select
from fedsim.algorithms.feddf import FedDF
from fedsim.algorithms.single_image import SingleImage
from fedsim.configure import load_config
from fedsim.results.tables import load
from fedsim.runtime.loop import run
from jobs.sweep import load_sweep, plan
from tests.conftest import small_config
from tests.mechanism_check import check_mechanism

ROOT = Path(__file__).resolve().parents[1]
TINY_SI = ["algorithm.pool_size=300", "algorithm.selection.n=30", "algorithm.selection.k=10",
           "algorithm.distill.steps=5", "algorithm.distill.eval_every=5"]
TINY_DF = ["algorithm.proxy=test_half", "algorithm.selection.n=60", "algorithm.distill.steps=5",
           "algorithm.distill.eval_every=5"]
FRACTIONS = ("student_acc_before", "student_acc_after", "patch_agree_before", "patch_agree_after", "teacher_acc",
             "test_agree_before", "test_agree_after", "sel_balance", "sel_max_share", "unsel_balance")
UPLOAD_ONLY = ("teacher_acc", "test_agree_before", "test_agree_after", "unsel_balance", "unsel_entropy")


def _in_range(row) -> None:
    for name in FRACTIONS:
        v = row[f"train/mech_{name}"]
        assert math.isnan(v) or -1e-12 <= v <= 1.0, name
    for name in ("sel_entropy", "unsel_entropy"):
        v = row[f"train/mech_{name}"]
        assert math.isnan(v) or 0.0 <= v <= math.log2(10) + 1e-9, name


def test_single_image_columns_present_in_range_and_off_the_training_path(tmp_path):
    rounds = check_mechanism(tmp_path, "single_image", *TINY_SI)
    assert SingleImage.mechanism_columns == FedDF.mechanism_columns
    r0, r1 = rounds.iloc[0], rounds.iloc[1]
    for row in (r0, r1):
        _in_range(row)
    # round 0 initialises from FedAvg (the clients upload weights), round 1 does not (fedavg_every=5)
    assert all(not math.isnan(r0[f"train/mech_{k}"]) for k in UPLOAD_ONLY)
    assert all(math.isnan(r1[f"train/mech_{k}"]) for k in UPLOAD_ONLY)
    assert r1["train/mech_student_acc_after"] == pytest.approx(r1["accuracy"])  # what evaluate() then reports


def test_feddf_scores_only_on_the_test_half_it_does_not_distil_on(tmp_path):
    rounds = check_mechanism(tmp_path, "feddf", *TINY_DF)
    for _, row in rounds.iterrows():
        _in_range(row)
        # the probe is the evaluation half (180 digits < eval.mechanism_samples): the same accuracy evaluate() reports
        assert row["train/mech_student_acc_after"] == pytest.approx(row["accuracy"])
    assert not math.isnan(rounds.iloc[0]["train/mech_unsel_balance"])  # 60 of 180 proxy images distilled on


def test_one_client_per_round_is_its_own_teacher(tmp_path):
    """One client, FedAvg every round: the student starts as that client's model and the teacher is its logits,
    so they agree everywhere before distillation and share one test accuracy."""
    cfg = small_config(tmp_path, "algorithm.name=single_image", *TINY_SI, "algorithm.fedavg_every=1",
                       "participation.clients_per_round=1", rounds=2)
    rounds = load(run(cfg))["rounds"]
    assert len(rounds) == 2
    for _, row in rounds.iterrows():
        assert row["train/mech_patch_agree_before"] == 1.0
        assert row["train/mech_test_agree_before"] == 1.0
        assert row["train/mech_teacher_acc"] == pytest.approx(row["train/mech_student_acc_before"])


def test_columns_reflect_a_crafted_teacher(tmp_path, monkeypatch):
    """A teacher that puts every distillation patch in class 3 with certainty: balance 0, one class, no entropy."""
    import fedsim.algorithms.feddf as feddf

    def one_hot(logits, weights=None, T=1.0, mix="logits"):
        out = torch.zeros(logits.shape[1], logits.shape[2])
        out[:, 3] = 1.0
        return out

    monkeypatch.setattr(feddf, "ensemble_teacher", one_hot)
    row = load(run(small_config(tmp_path, "algorithm.name=single_image", *TINY_SI, rounds=1)))["rounds"].iloc[0]
    assert row["train/mech_sel_balance"] == pytest.approx(0.0)
    assert row["train/mech_sel_max_share"] == 1.0
    assert row["train/mech_sel_entropy"] == pytest.approx(0.0)
    assert row["train/mech_unsel_entropy"] == pytest.approx(0.0)


def _arm(sweep_file: Path, name: str):
    runs = [r for r in plan(load_sweep(sweep_file), sweep_file) if r["arm"] == name and r["seed"] == 0]
    assert len(runs) == 1, name
    return load_config(runs[0]["config"], runs[0]["overrides"])


def _selected(cfg, emb: np.ndarray, logits: torch.Tensor) -> np.ndarray:
    params = cfg.algorithm.params
    m = params.selection.candidates(params.pool_size)
    idx, info = select(emb[:m], logits[:m], params.selection, params.pool_size, seed=5)
    assert info["selected"] == len(idx)
    return idx


def test_kmeans_removes_patches_in_the_embedded_default_and_the_ablation_rows_differ():
    """With the embedded base KMeans keeps n/(1-removal) patches out of a larger pool, so the ablation's
    "KMeans + entropy" and "entropy" rows distil on different patches from the same model outputs."""
    sweep = ROOT / "configs/single_image/embedded_ablation.sweep.yaml"
    both, entropy = _arm(sweep, "selection: KMeans + entropy (base)"), _arm(sweep, "selection: entropy")
    sel, pool = both.algorithm.params.selection, both.algorithm.params.pool_size
    assert sel.kmeans and sel.entropy and not entropy.algorithm.params.selection.kmeans
    assert pool == entropy.algorithm.params.pool_size
    kept_by_kmeans = int(sel.n / (1 - sel.removal))
    assert kept_by_kmeans < pool  # KMeans removes patches before entropy pruning
    rng = np.random.default_rng(0)
    centres = rng.normal(size=(10, 16)) * 3
    labels = rng.integers(0, 10, pool)
    emb = (centres[labels] + rng.normal(size=(pool, 16))).astype(np.float32)
    logits = torch.as_tensor(np.eye(10)[labels] * rng.uniform(0.5, 4, (pool, 1)) + rng.normal(size=(pool, 10)),
                             dtype=torch.float32)
    a, b = _selected(both, emb, logits), _selected(entropy, emb, logits)
    assert abs(len(a) - sel.n) <= 10 and abs(len(b) - sel.n) <= 10
    assert not np.array_equal(a, b)
    assert (a >= kept_by_kmeans).any()  # KMeans looks at the whole pool, entropy alone at its first n/(1-removal)


def test_at_the_paper_codes_ratio_the_two_rows_coincide():
    """The companion sweep runs pool = n/(1-removal): KMeans keeps everything and both rows select the same."""
    sweep = ROOT / "configs/single_image/embedded_pool.sweep.yaml"
    names = [a.name for a in load_sweep(sweep).arms]
    both = _arm(sweep, next(n for n in names if n.startswith("selection: KMeans + entropy")))
    entropy = _arm(sweep, next(n for n in names if n.startswith("selection: entropy")))
    sel, pool = both.algorithm.params.selection, both.algorithm.params.pool_size
    assert int(sel.n / (1 - sel.removal)) >= pool
    rng = np.random.default_rng(1)
    emb = rng.normal(size=(pool, 8)).astype(np.float32)
    logits = torch.as_tensor(rng.normal(size=(pool, 10)) * 2, dtype=torch.float32)
    assert np.array_equal(_selected(both, emb, logits), _selected(entropy, emb, logits))


def test_heterogeneous_mirrors_rebuild_the_teacher_from_each_clients_architecture(tmp_path):
    cfg = small_config(tmp_path, "algorithm.name=single_image", *TINY_SI, "model.mix={cnn: 5, mlp: 5}",
                       "participation.clients_per_round=6", rounds=1)
    tables = load(run(cfg))
    row = tables["rounds"].iloc[0]
    assert set(tables["clients"]["arch"]) == {"cnn", "mlp"}  # the teacher's mirrors are of both architectures
    _in_range(row)
    assert all(not math.isnan(row[f"train/mech_{k}"]) for k in UPLOAD_ONLY)
