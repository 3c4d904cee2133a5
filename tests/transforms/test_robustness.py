"""Attackers and robust aggregators as the update chain runs them: roles recorded, the crafted updates reaching the
defence, the same numbers on any worker count, a resumed run continuing the defence's state, and bad input refused
in one line."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.contract import ClientResult
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.transforms import attacks
from fedsim.transforms.robustness import build_robustness, malicious_clients
from tests.runtime.test_loop import deterministic
from tests.test_hostile_config import TINY, assert_one_line_error, fedsim_run
from tests.transforms.test_privacy import stopped_then_resumed

SIX = ["participation.clients_per_round=6"]  # Krum with f = 1 needs n > 4


def test_without_attack_or_defence_the_run_has_no_new_columns(make_config):
    plain = load(run(make_config("results.run_id=plain"), LocalBackend()))
    mean = load(run(make_config("aggregator.name=mean", "attack.kind=none", "results.run_id=mean"), LocalBackend()))
    pd.testing.assert_frame_equal(deterministic(mean["rounds"]), deterministic(plain["rounds"]))
    assert not {"role", "kept"} & set(mean["clients"])


def test_the_attackers_are_a_fixed_seeded_set_recorded_per_client(make_config):
    cfg = make_config(*SIX, "attack.kind=sign_flip", "attack.fraction=0.3", "aggregator.name=krum", "aggregator.f=1")
    bad = malicious_clients(cfg)
    assert len(bad) == 3 and bad == malicious_clients(cfg)
    clients = load(run(cfg, LocalBackend(num_workers=2)))["clients"]
    roles = clients.groupby("client")["role"].agg(set)
    assert all(roles[c] == {"malicious" if c in bad else "benign"} for c in roles.index)
    assert clients["kept"].isin([True, False]).all() and clients.groupby("round")["kept"].sum().eq(1).all()


def test_krum_with_alie_gives_the_same_tables_on_one_and_three_workers(make_config):
    """Colluders spread over workers: the crafted updates are computed where every update meets, in client-id
    order, so the worker count changes nothing."""
    cfg = make_config(*SIX, "attack.kind=alie", "attack.fraction=0.3", "aggregator.name=multi_krum",
                      "aggregator.f=1")
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    clients = ["round", "client", "role", "kept", "update_norm", "status"]
    pd.testing.assert_frame_equal(one["clients"][clients], three["clients"][clients])
    assert set(one["clients"]["worker"]) != set(three["clients"]["worker"])
    rounds = one["rounds"]
    assert rounds["attack/attackers"].gt(0).all()
    assert list(rounds["attack/z"]) == [attacks.alie_z(6, int(a)) for a in rounds["attack/attackers"]]
    assert one["rounds"]["aggregator/kept"].eq(5).all()  # multi-krum keeps n - f


def test_the_mean_over_each_update_is_the_methods_mean():
    """Multi-Krum keeping every update is the weighted mean: the per-client path rebuilds the upload's form."""
    cfg = load_config(None, ["data.num_clients=4", "aggregator.name=multi_krum", "aggregator.m=3",
                             "participation.clients_per_round=3"])
    stage = build_robustness(cfg)
    assert stage is not None and stage.per_client
    ref = {"w": torch.tensor([1.0, 2.0]), "steps": torch.tensor(7)}
    ups = {c: {"w": torch.tensor(v)} for c, v in {0: [1.5, 2.0], 1: [0.0, 3.0], 2: [1.0, 1.0]}.items()}
    results = {c: stage.client(ClientResult({"a/w": u["w"], "a/steps": torch.tensor(8), "a/__weight__": torch.ones(())},
                                            weight=float(c + 1)), "a", ref) for c, u in ups.items()}
    total, columns, per = stage.aggregate(results, {"a": ref}, round=0, phase="train")
    weights = np.array([1.0, 2.0, 3.0])
    expected = np.array([1.0, 2.0]) + sum(w * (np.array(ups[c]["w"]) - [1.0, 2.0]) for c, w in zip(ups, weights)) \
        / weights.sum()
    np.testing.assert_allclose((total["a/w"] / total["a/__weight__"]).numpy(), expected, rtol=0, atol=1e-12)
    assert int(total["a/steps"] / total["a/__weight__"]) == 7  # a step counter is the broadcast's
    assert columns["aggregator/kept"] == 3 and all(p["kept"] for p in per.values())


def test_a_sign_flip_reaches_the_defence_as_its_formula():
    cfg = load_config(None, ["data.num_clients=4", "attack.kind=sign_flip", "attack.clients=[1]", "attack.scale=2",
                             "aggregator.name=median", "participation.clients_per_round=3"])
    stage = build_robustness(cfg)
    assert stage is not None
    ref = {"w": torch.zeros(3)}
    ups = {0: [1.0, 0.0, 0.0], 1: [0.5, 0.5, 0.5], 2: [2.0, 1.0, -1.0]}
    results = {c: stage.client(ClientResult({"a/w": torch.tensor(v)}), "a", ref) for c, v in ups.items()}
    total, columns, per = stage.aggregate(results, {"a": ref}, round=0, phase="train")
    crafted = -2.0 * np.array(ups[1])
    expected = np.median(np.stack([ups[0], crafted, ups[2]]), axis=0)
    np.testing.assert_allclose((total["a/w"] / total["a/__weight__"]).numpy(), expected)
    assert float(total["a/__weight__"]) == 3  # the summed form of the round's 3 updates
    assert per[1]["update_norm"] == pytest.approx(np.linalg.norm(crafted)) and columns["attack/attackers"] == 1


def test_a_backdoor_is_scored_on_the_triggered_test_set_and_norm_bounding_runs_on_partial_sums(make_config):
    cfg = make_config("attack.kind=backdoor", "attack.fraction=0.3", "attack.target=3", "aggregator.name=norm_bound",
                      "aggregator.bound=0.5", "aggregator.noise=0.001")
    stage = build_robustness(cfg)
    assert stage is not None and not stage.per_client and stage.clips  # the workers still pre-sum
    out = load(run(cfg, LocalBackend(num_workers=2)))
    rounds, clients = out["rounds"], out["clients"]
    assert rounds["attack/success_rate"].between(0, 1).all() and rounds["accuracy"].notna().all()
    assert clients["update_norm"].gt(0).all() and "kept" not in clients  # norm bounding keeps every update
    cfg.results.run_id = None
    again = load(run(cfg, LocalBackend(num_workers=1)))["rounds"]
    pd.testing.assert_frame_equal(deterministic(rounds), deterministic(again))


def test_the_backdoor_trigger_and_label_flip_reach_only_the_attackers_shards():
    from fedsim.data import load_dataset

    data = load_dataset("digits")
    cfg = load_config(None, ["data.num_clients=4", "attack.kind=backdoor", "attack.clients=[2]", "attack.target=1",
                             "attack.poison_fraction=1.0"])
    stage = build_robustness(cfg, data)
    assert stage is not None and stage.raw_max == pytest.approx(1.0)
    from fedsim.method.contract import ClientData

    x = torch.from_numpy(data.x_train[:10])
    y = torch.from_numpy(data.y_train[:10])
    shard = ClientData(x, y, x[:0], y[:0])
    assert stage.poison(0, shard) is shard
    poisoned = stage.poison(2, shard)
    assert (poisoned.y == 1).all()
    expected = attacks.add_trigger(x, 2, 1.0, data.mean, data.std)
    torch.testing.assert_close(poisoned.x, expected)
    flip = build_robustness(load_config(None, ["data.num_clients=4", "attack.kind=label_flip", "attack.clients=[3]"]),
                            data)
    assert flip is not None and flip.poison(2, shard) is shard
    assert torch.equal(flip.poison(3, shard).y, 9 - y) and flip.poison(3, shard).x is x


def test_centred_clipping_resumes_from_its_saved_centre(make_config):
    cfg = make_config(*SIX, "aggregator.name=centered_clip", "aggregator.tau=0.05", "results.run_id=whole")
    whole = load(run(cfg, LocalBackend()))["rounds"]
    assert whole["aggregator/clipped"].gt(0).all()  # the radius bites: the centre matters
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(whole))


def test_fltrust_trains_on_a_root_set_held_out_of_the_test_set(make_config):
    cfg = make_config(*SIX, "attack.kind=sign_flip", "attack.fraction=0.3", "aggregator.name=fltrust",
                      "aggregator.root_samples=50", rounds=2)
    out = load(run(cfg, LocalBackend()))
    rounds, clients = out["rounds"], out["clients"]
    assert rounds["accuracy"].notna().all()
    flipped = clients[clients["role"] == "malicious"]
    assert len(flipped) and not flipped["kept"].any()  # a sign-flipped update points away from the root update


@pytest.mark.parametrize("overrides, message", [
    (["aggregator.name=krum", "aggregator.f=1"], "aggregator.f: krum needs n > 2f + 2"),
    (["aggregator.name=bulyan", "aggregator.f=1"],
     "aggregator.f: bulyan needs n >= 4f + 3"),
    (["aggregator.name=trimmed_mean", "aggregator.beta=0.5"], "aggregator.beta: must be < 0.5"),
    (["attack.kind=sign_flip", "attack.fraction=1"], "attack.fraction: must be < 1"),
    (["attack.kind=sign_flip", "attack.fraction=-0.1"], "attack.fraction: must be >= 0"),
    (["attack.kind=sign_flip"], "attack.kind: sign_flip with no attacker"),
    (["attack.kind=sign_flip", "attack.clients=[9]"], "attack.clients: client 9 is not among the run's 4"),
    (["algorithm.name=dafkd", "aggregator.name=median"], "aggregator.name: median works on each client's model "
                                                          "update, and dafkd's server does not aggregate"),
    (["algorithm.name=dosfl", "attack.kind=alie", "attack.fraction=0.25"], "attack.kind: alie works on each "
                                                                           "client's model update, and dosfl's"),
    (["aggregator.name=norm_bound"], "aggregator.bound: norm_bound needs the L2 norm"),
    (["aggregator.name=median", "privacy.level=client", "privacy.noise_multiplier=1", "algorithm.weighting=uniform",
      "privacy.accountant=rdp"], "privacy.level: client-level DP's noise is calibrated to the clipped mean"),
])
def test_bad_robustness_settings_are_one_line_naming_the_key(overrides, message):
    base = ["data.num_clients=4", "participation.clients_per_round=3"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, *overrides])
    assert message in str(info.value) and "\n" not in str(info.value), str(info.value)


def test_a_backdoor_target_outside_the_classes_is_one_line_and_leaves_no_run_folder(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY, "attack.kind=backdoor", "attack.fraction=0.25", "attack.target=10")
    assert_one_line_error(proc, root, "attack.target: 10 is not a class of digits (labels 0..9)")


def test_a_round_with_fewer_arrivals_than_the_rule_needs_leaves_the_model_where_it_was():
    """Stragglers can leave Krum (f = 1) with 4 updates, not more than 2f + 2: the round is skipped and recorded."""
    cfg = load_config(None, ["data.num_clients=8", "aggregator.name=krum", "aggregator.f=1",
                             "participation.clients_per_round=6"])
    stage = build_robustness(cfg)
    assert stage is not None
    ref = {"w": torch.tensor([0.5, -1.0])}
    results = {c: stage.client(ClientResult({"a/w": torch.tensor([float(c), 1.0])}), "a", ref) for c in range(4)}
    total, columns, per = stage.aggregate(results, {"a": ref}, round=3, phase="train")
    torch.testing.assert_close(total["a/w"] / total["a/__weight__"], ref["w"].double())
    assert columns["aggregator/skipped"] == 1 and columns["aggregator/kept"] == 0
    assert not any(p["kept"] for p in per.values()) and len(per) == 4


@pytest.mark.parametrize("algorithm", ["scaffold", "fedavg"])
def test_multi_krum_keeping_every_update_is_the_methods_own_run(make_config, algorithm):
    """The robust aggregate reaches the method as its summed upload: SCAFFOLD reads the sum of the control deltas
    (Σ dc / N), FedAvg the mean; Multi-Krum keeping all n updates must give the method's own numbers (to the float
    rounding of a float64 mean instead of the exact sum)."""
    own = load(run(make_config(f"algorithm.name={algorithm}", "results.run_id=own"), LocalBackend()))["rounds"]
    kept = load(run(make_config(f"algorithm.name={algorithm}", "aggregator.name=multi_krum", "aggregator.m=4",
                                "results.run_id=krum"), LocalBackend()))["rounds"]
    assert (kept["aggregator/kept"] == 4).all()
    np.testing.assert_allclose(kept["accuracy"], own["accuracy"], atol=0.02)
    np.testing.assert_allclose(kept["loss"], own["loss"], rtol=1e-3)


def test_a_lone_colluder_without_a_spread_to_hide_in_sends_its_own_update():
    """ALIE from the colluders' own statistics needs two of them in the round: one alone sends its honest update,
    and the round records that nothing was crafted."""
    cfg = load_config(None, ["data.num_clients=6", "attack.kind=alie", "attack.clients=[2]",
                             "attack.knowledge=colluders", "aggregator.name=median",
                             "participation.clients_per_round=3"])
    stage = build_robustness(cfg)
    assert stage is not None
    ref = {"w": torch.zeros(2)}
    ups = {0: [1.0, 0.0], 2: [0.5, 0.5], 4: [2.0, 1.0]}
    results = {c: stage.client(ClientResult({"a/w": torch.tensor(v)}), "a", ref) for c, v in ups.items()}
    total, columns, per = stage.aggregate(results, {"a": ref}, round=0, phase="train")
    assert columns["attack/crafted"] == 0 and columns["attack/attackers"] == 1
    np.testing.assert_allclose((total["a/w"] / total["a/__weight__"]).numpy(), np.median(list(ups.values()), axis=0))
