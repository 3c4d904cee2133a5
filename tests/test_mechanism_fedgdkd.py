"""FedGDKD's and FedMD's mechanism columns: present, in range, off the training path, and wired to what they
claim; and FedMD's two digest losses."""

from __future__ import annotations

import math

import pytest
import torch

from fedsim.algorithms.fedgdkd import FedGDKD
from fedsim.algorithms.fedmd import FedMD
from fedsim.results.tables import load
from fedsim.runtime.loop import run
from tests.conftest import small_config
from tests.mechanism_check import check_mechanism

GDKD = ["data.client_test=balanced", "algorithm.generator.ngf=8", "algorithm.generator.init_size=2",
        "algorithm.generator.nz=8", "algorithm.kd_size=40", "algorithm.kd_epochs=1", "model.name=cnn_small"]
MD = ["data.client_test=balanced", "model.name=cnn_small", "algorithm.pretrain_public_epochs=1",
      "algorithm.pretrain_private_epochs=1", "algorithm.digest_epochs=1", "algorithm.revisit_epochs=1"]


def _in_unit(value: float) -> bool:
    return 0.0 <= value <= 1.0


def test_fedgdkd_columns_present_in_range_and_off_the_training_path(tmp_path):
    rounds = check_mechanism(tmp_path, "fedgdkd", *GDKD)
    for _, row in rounds.iterrows():
        for col in FedGDKD.mechanism_columns:
            assert _in_unit(row[col]), (col, row[col])
        # the ensemble's accuracy is the method's own ensemble_synthetic_accuracy, measured the same way
        assert row["logits/mech_gen_ensemble_acc"] == pytest.approx(row["logits/ensemble_synthetic_accuracy"])
        assert row["logits/mech_gen_ensemble_maxp"] >= 0.1 - 1e-6  # 10 classes: never below uniform
        # after KD is the personal accuracy the round reports for the same clients
        assert row["codistill/mech_personal_acc_after_kd"] == pytest.approx(
            row["codistill/personal_accuracy_round"], abs=0.02)


def test_fedgdkd_before_after_kd_are_the_clients_own_means(tmp_path):
    """The server columns are the plain means of the client-measured values of the same round."""
    out = run(small_config(tmp_path, "algorithm.name=fedgdkd", *GDKD, rounds=2))
    tables = load(out)
    clients, rounds = tables["clients"], tables["rounds"]
    kd = clients[clients["phase"] == "codistill"]
    for _, row in rounds.iterrows():
        mine = kd[kd["round"] == row["round"]]
        for when in ("before", "after"):
            assert row[f"codistill/mech_personal_acc_{when}_kd"] == pytest.approx(
                mine[f"mech_personal_acc_{when}_kd"].mean())
        after = mine["mech_personal_acc_after_kd"].to_numpy()
        assert after == pytest.approx(mine["personal_accuracy"].to_numpy())


def test_fedgdkd_synthetic_columns_on_crafted_logits(tmp_path):
    """Hand-checked: 3 clients, 4 synthetic samples of 2 classes; the LOO teachers and students scored by hand."""
    cfg = small_config(tmp_path, "algorithm.name=fedgdkd", *GDKD, rounds=1)
    algo = FedGDKD.__new__(FedGDKD)
    algo.env = type("E", (), {"config": cfg})()
    y = torch.tensor([0, 1, 0, 1])
    right = torch.tensor([[2.0, 0.0], [0.0, 2.0], [2.0, 0.0], [0.0, 2.0]])  # all correct
    wrong = -right  # all wrong
    stacked = torch.stack([right, right, wrong])
    teachers = {0: (right + wrong) / 2, 1: (right + wrong) / 2, 2: right}  # LOO means: ties, ties, right
    m = algo._mechanism_synthetic(stacked, teachers, y)
    assert m["mech_student_synth_acc"] == pytest.approx(2 / 3)
    assert m["mech_gen_ensemble_acc"] == 1.0  # mean logits = right / 3
    # ties (all-zero rows) argmax to class 0: half right on [0, 1, 0, 1]
    assert m["mech_loo_teacher_synth_acc"] == pytest.approx((0.5 + 0.5 + 1.0) / 3)
    p = torch.softmax(torch.tensor([2 / 3, 0.0]), 0).max()
    assert m["mech_gen_ensemble_maxp"] == pytest.approx(float(p))


def test_fedmd_columns_present_in_range_and_off_the_training_path(tmp_path):
    rounds = check_mechanism(tmp_path, "fedmd", *MD)
    for _, row in rounds.iterrows():
        for col in FedMD.mechanism_columns:
            assert _in_unit(row[col]), (col, row[col])
        assert row["logits/mech_consensus_public_acc"] == row["logits/consensus_public_accuracy"]
        assert row["digest/mech_personal_acc_after_revisit"] == pytest.approx(
            row["digest/personal_accuracy_round"], abs=0.02)


@pytest.mark.parametrize("loss", ["kl", "ce_mse"])
def test_fedmd_digest_losses_both_train(tmp_path, loss):
    """Both digest losses run and move the model; they are different losses, so they give different models."""
    df = load(run(small_config(tmp_path, "algorithm.name=fedmd", *MD, f"algorithm.digest_loss={loss}",
                               rounds=2)))["rounds"]
    assert all(math.isfinite(v) for v in df["digest/mech_personal_acc_after_digest"])
    assert (df["digest/mech_personal_acc_after_digest"] != df["digest/mech_personal_acc_before_digest"]).any()


def test_fedmd_digest_losses_differ(tmp_path):
    """Same run up to the digest (same consensus), then different losses and different personal models."""
    a = load(run(small_config(tmp_path / "a", "algorithm.name=fedmd", *MD, rounds=1)))
    b = load(run(small_config(tmp_path / "b", "algorithm.name=fedmd", *MD, "algorithm.digest_loss=ce_mse",
                              rounds=1)))
    assert a["rounds"]["logits/consensus_public_accuracy"].iloc[0] == \
        b["rounds"]["logits/consensus_public_accuracy"].iloc[0]
    da, db = (t["clients"][t["clients"]["phase"] == "digest"] for t in (a, b))
    assert (da["digest_loss"].to_numpy() != db["digest_loss"].to_numpy()).all()


def test_fedmd_rejects_an_unknown_digest_loss(tmp_path):
    from fedsim.errors import ConfigError

    with pytest.raises(ConfigError, match="digest_loss"):
        run(small_config(tmp_path, "algorithm.name=fedmd", *MD, "algorithm.digest_loss=mse", rounds=1))


def test_fedgdkd_loo_teacher_on_real_test_data_by_hand(make_config):
    """Two participants: each one's leave-one-out teacher is the other's logits, so the column is the mean of
    their own test-subset accuracies; the logits ride beside the upload (probe), not in it."""
    from fedsim.method.contract import ClientResult
    from fedsim.method.mechanism import probe_set
    from fedsim.runtime.setup import build_env, load_data, make_partition

    cfg = make_config("algorithm.name=fedgdkd", *GDKD)
    data = load_data(cfg)
    env = build_env(cfg, data, make_partition(cfg, data), torch.device("cpu"))
    env.extras["server_data"] = data
    algo = FedGDKD(cfg.algorithm.params, env)
    _, y = probe_set(env)
    right = torch.nn.functional.one_hot(y, 10).float()
    wrong = torch.nn.functional.one_hot((y + 1) % 10, 10).float()
    half = right.clone()
    half[: len(y) // 2] = wrong[: len(y) // 2]
    updates = {0: ClientResult({"logits": torch.zeros(1)}, probe=right),
               1: ClientResult({"logits": torch.zeros(1)}, probe=half)}
    got = algo._mechanism_loo_test(updates)["mech_loo_teacher_test_acc"]
    assert got == pytest.approx((1.0 + (len(y) - len(y) // 2) / len(y)) / 2)
    updates[1].probe = None  # a client that sent none: the column is not guessed
    assert algo._mechanism_loo_test(updates) == {}
