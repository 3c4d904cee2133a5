"""Client-level DP-FedAvg as the update chain runs it: FedAvg's numbers without noise or clipping, clipping and
noise against a hand computation, the same numbers on any worker count, the accountant never under-reporting, and
the privacy section's bad input refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch
from scipy.optimize import brentq
from scipy.stats import norm

import fedsim
from fedsim import rng
from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.transforms.accounting import Mechanism, calibrate, epsilon
from fedsim.transforms.privacy import CLIPPED_KEY, ClientLevelDP
from tests.runtime.test_loop import deterministic
from tests.test_hostile_config import TINY, assert_one_line_error, fedsim_run

UNIFORM = ["algorithm.weighting=uniform", "participation.clients_per_round=4", "privacy.accountant=rdp"]
DP = [*UNIFORM, "privacy.level=client"]


def test_without_noise_or_clipping_the_run_is_fedavgs_bit_for_bit(make_config):
    plain = run(make_config(*UNIFORM, "results.run_id=plain"), LocalBackend())
    private = run(make_config(*DP, "privacy.noise_multiplier=0", "privacy.clip=.inf", "results.run_id=dp"),
                  LocalBackend())
    ours, theirs = load(private)["rounds"], load(plain)["rounds"]
    privacy = [c for c in ours if c.startswith("privacy/")]
    assert (ours["privacy/epsilon"] == math.inf).all() and (ours["privacy/clipped_fraction"] == 0).all()
    pd.testing.assert_frame_equal(deterministic(ours.drop(columns=privacy)), deterministic(theirs))
    for name, a in load_run_checkpoint(plain / "checkpoints" / "last.pt")["server_state"].models["cnn"].items():
        b = load_run_checkpoint(private / "checkpoints" / "last.pt")["server_state"].models["cnn"][name]
        assert torch.equal(a, b), name


def test_clipping_and_noise_match_a_hand_computation_on_a_linear_model():
    """Three clients' uploads of a 4-weight linear model: each update clipped to C in float64, summed, the named
    stream's noise of std z·C added, divided by the expected cohort, added to the broadcast model."""
    mech = Mechanism(1.5, "poisson", 0.3, 10, 3)
    dp = ClientLevelDP(clip=1.0, mechanism=mech, delta=1e-3, accountant="rdp", expected_cohort=3.0, max_epsilon=None,
                       seed=7)
    ref = {"w": torch.tensor([0.5, -0.25, 1.0, 0.0]), "b": torch.tensor([0.1])}
    uploads = [{"w": torch.tensor([0.6, -0.2, 1.1, 0.0]), "b": torch.tensor([0.1])},  # norm 0.15: kept
               {"w": torch.tensor([3.5, -0.25, 1.0, 4.0]), "b": torch.tensor([0.1])},  # norm 5: clipped
               {"w": torch.tensor([0.5, -0.25, 1.0, 0.0]), "b": torch.tensor([-1.9])}]  # norm 2: clipped
    total: dict[str, torch.Tensor] = {}
    norms = []
    for up in uploads:
        payload = {f"lin/{k}": v for k, v in up.items()} | {"lin/__weight__": torch.ones(())}
        clipped, n = dp.clip_upload(payload, "lin", ref, round=4, client=len(norms), phase="train")
        norms.append(n)
        for k, v in clipped.items():
            total[k] = total.get(k, 0) + v
    flat = lambda d: np.concatenate([np.asarray(d["w"], np.float64), np.asarray(d["b"], np.float64)])  # noqa: E731
    deltas = [flat(u) - flat(ref) for u in uploads]
    np.testing.assert_allclose(norms, [np.linalg.norm(d) for d in deltas])
    clipped_np = [d * min(1.0, 1.0 / np.linalg.norm(d)) for d in deltas]
    out, columns = dp.noisy_mean(total, 3, {"lin": ref}, round=4, phase="train")
    gen = rng.torch_generator(7, "privacy-noise/train", 4)
    noise = np.concatenate([torch.randn(4, generator=gen, dtype=torch.float64).numpy(),
                            torch.randn(1, generator=gen, dtype=torch.float64).numpy()]) * 1.5
    expected = flat(ref) + (np.sum(clipped_np, axis=0) + noise) / 3.0
    weight = out["lin/__weight__"]
    mean = np.concatenate([(out["lin/w"] / weight).numpy(), (out["lin/b"] / weight).numpy()])
    np.testing.assert_allclose(mean, expected, rtol=0, atol=1e-12)
    assert float(total[CLIPPED_KEY]) == 2 and columns["privacy/clipped_fraction"] == pytest.approx(2 / 3)
    assert columns["privacy/noise_std"] == 1.5 and columns["privacy/epsilon"] == epsilon(mech, 5, 1e-3, "rdp")


def test_noise_and_clipping_give_the_same_numbers_on_one_and_three_workers(make_config):
    cfg = make_config(*DP, "privacy.noise_multiplier=1.0", "privacy.clip=0.5")
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    assert one["rounds"]["privacy/clipped_fraction"].gt(0).any()  # the clip was met: the test is not vacuous
    assert one["clients"]["privacy/update_norm"].gt(0).all()


def test_local_dp_noises_each_update_in_its_client_and_reports_one_clients_epsilon(make_config):
    """Local DP keeps the method's weights: without noise or clipping it is FedAvg's (sample-weighted) run; with
    noise, each client's release is a Gaussian of multiplier z, every round (no amplification), and the numbers are
    the same on 1 and 3 workers."""
    plain = load(run(make_config("results.run_id=plain"), LocalBackend()))["rounds"]
    clear = load(run(make_config("privacy.level=local", "privacy.noise_multiplier=0", "privacy.clip=.inf",
                                 "results.run_id=clear"), LocalBackend()))["rounds"]
    pd.testing.assert_frame_equal(deterministic(clear.drop(columns=[c for c in clear if c.startswith("privacy/")])),
                                  deterministic(plain))
    cfg = make_config("privacy.level=local", "privacy.noise_multiplier=2", "privacy.clip=0.5", "privacy.accountant=rdp")
    one = load(run(cfg, LocalBackend(num_workers=1)))["rounds"]
    cfg.results.run_id = None
    three = load(run(cfg, LocalBackend(num_workers=3)))["rounds"]
    pd.testing.assert_frame_equal(deterministic(one), deterministic(three))
    assert (one["privacy/noise_std"] == 2.0).all()  # 2 · z · C
    assert one["privacy/clipped_fraction"].between(0, 1).all() and one["privacy/clipped_fraction"].gt(0).any()
    everyone = Mechanism(2.0, "poisson", 1.0, 10, 10)
    assert list(one["privacy/epsilon"]) == [epsilon(everyone, r + 1, 10 ** -1.1, "rdp") for r in one["round"]]
    assert not np.allclose(one["accuracy"], plain["accuracy"])  # the noise reached the model


def test_a_step_counter_survives_a_fractional_expected_cohort():
    """Under Poisson sampling the denominator qN need not be whole: an integer buffer (BatchNorm's batch counter) must
    come back as it was, not one less after the method's mean truncates it."""
    dp = ClientLevelDP(clip=1.0, mechanism=Mechanism(1.0, "poisson", 0.199, 100, 20), delta=1e-3, accountant="rdp",
                       expected_cohort=19.9, max_epsilon=None, seed=0)
    ref = {"w": torch.zeros(3), "num_batches_tracked": torch.tensor(2016)}
    out, _ = dp.noisy_mean({}, 0, {"a": ref}, round=0, phase="train")
    mean = (out["a/num_batches_tracked"] / out["a/__weight__"]).to(torch.int64)
    assert int(mean) == 2016


def _exact_gaussian_epsilon(mu: float, delta: float) -> float:
    """Balle & Wang (2018): the epsilon of a Gaussian mechanism with mu = sensitivity / std, at delta."""
    curve = lambda e: norm.cdf(mu / 2 - e / mu) - math.exp(e) * norm.cdf(-mu / 2 - e / mu) - delta  # noqa: E731
    return brentq(curve, 0.0, 500.0)


@pytest.mark.parametrize("z, rounds", [(1.0, 10), (4.0, 100), (0.8, 1)])
def test_the_accountants_never_under_report_every_client_every_round(z, rounds):
    """q = 1: T rounds of the Gaussian mechanism are one Gaussian with mu = sqrt(T) / z (Dong, Roth, Su)."""
    delta = 1e-5
    exact = _exact_gaussian_epsilon(math.sqrt(rounds) / z, delta)
    mech = Mechanism(z, "poisson", 1.0, 1000, 1000)
    pld = epsilon(mech, rounds, delta, "pld")
    assert exact <= pld <= 1.05 * exact
    assert epsilon(mech, rounds, delta, "rdp") >= exact
    assert epsilon(mech, rounds, delta, "prv") >= exact


def test_a_poisson_subsampled_run_is_the_librarys_own_event_composition():
    import dp_accounting as dpa
    from dp_accounting import pld, rdp

    mech = Mechanism(1.1, "poisson", 0.05, 500, 25)
    event = dpa.SelfComposedDpEvent(dpa.PoissonSampledDpEvent(0.05, dpa.GaussianDpEvent(1.1)), 40)
    fine = pld.PLDAccountant()  # dp-accounting's own finer discretisation
    fine.compose(event)
    reference = fine.get_epsilon(1e-4)
    ours = epsilon(mech, 40, 1e-4, "pld")
    assert reference <= ours <= 1.001 * reference  # coarser, and pessimistic: never below
    exact_rdp = rdp.RdpAccountant()
    exact_rdp.compose(event)
    assert epsilon(mech, 40, 1e-4, "rdp") == exact_rdp.get_epsilon(1e-4)
    assert epsilon(mech, 20, 1e-4, "pld") < ours < epsilon(Mechanism(1.1, "poisson", 0.1, 500, 50), 40, 1e-4, "pld")


def test_target_epsilon_solves_the_noise_for_the_planned_rounds(make_config):
    mech = Mechanism(0.0, "poisson", 0.4, 10, 4)
    z = calibrate(mech, 3, 1e-3, "pld", 8.0)
    spent = epsilon(Mechanism(z, "poisson", 0.4, 10, 4), 3, 1e-3, "pld")
    assert 0.99 * 8.0 <= spent <= 8.0
    cfg = make_config(*DP, "participation.sampling=poisson", "privacy.accountant=pld", "privacy.target_epsilon=8",
                      "privacy.delta=1e-3")
    rounds = load(run(cfg, LocalBackend()))["rounds"]
    assert rounds["privacy/noise_multiplier"].eq(z).all()
    assert rounds["privacy/epsilon"].iloc[-1] == spent and rounds["privacy/epsilon"].is_monotonic_increasing
    assert rounds["participants"].nunique() > 1 or rounds["participants"].iloc[0] != 4  # Poisson cohorts


def test_max_epsilon_stops_the_run_before_a_round_would_pass_it(make_config, caplog):
    cfg = make_config(*DP, "privacy.noise_multiplier=1.0", rounds=5)
    first_two = [ClientLevelDP.from_config(cfg, solve=True).epsilon_after(t) for t in (2, 3)]
    cfg.privacy.max_epsilon = (first_two[0] + first_two[1]) / 2
    run_dir = run(cfg, LocalBackend())
    rounds = load(run_dir)["rounds"]
    assert list(rounds["round"]) == [0, 1] and rounds["privacy/epsilon"].iloc[-1] == first_two[0]
    assert "privacy.max_epsilon" in caplog.text and "stops after round 1" in caplog.text


def stopped_then_resumed(cfg) -> pd.DataFrame:
    """The rounds of `cfg` (3 rounds) run as 2 rounds, then resumed with rounds raised to 3 in its config.yaml."""
    import yaml

    cfg.rounds, cfg.results.run_id = 2, "resumed"
    first = run(cfg, LocalBackend())
    raw = yaml.safe_load((first / "config.yaml").read_text())
    (first / "config.yaml").write_text(yaml.safe_dump({**raw, "rounds": 3}))
    fedsim.run(resume=str(first), backend="local")
    return load(first)["rounds"]


def test_a_resumed_run_continues_the_accountant(make_config, tmp_path):
    cfg = make_config(*DP, "privacy.noise_multiplier=1.0", "privacy.clip=0.5", "results.run_id=whole", rounds=3)
    whole = load(run(cfg, LocalBackend()))["rounds"]
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(whole))


@pytest.mark.parametrize("overrides, message", [
    (["privacy.clip=0"], "privacy.clip: must be > 0, got 0.0"),
    (["privacy.noise_multiplier=1"], "privacy.level client weighs every client alike (its sensitivity bound needs "
                                     "it): set algorithm.params.weighting: uniform (it is 'samples')"),
    (["algorithm.name=feddf", "privacy.noise_multiplier=1"],
     "privacy.level: DP clips and noises a model update summed over clients; feddf's round is not one phase that "
     "uploads one (model_update=True)"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "stragglers.enabled=true"], "stragglers.deadline: a quantile deadline "
                                                                          "lets one client change who else arrives"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "stragglers.enabled=true", "stragglers.deadline=fixed",
      "stragglers.deadline_value=5", "stragglers.over_select=0.5"], "stragglers.over_select: keeping the fastest"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "privacy.clip=.inf"], "privacy.clip: .inf with noise would make the "
                                                                    "noise infinite"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "privacy.delta=0.5"], "privacy.delta: 0.5 is not below "
                                                                   "1/data.num_clients = 0.25"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "privacy.accountant=pld"],
     "privacy.accountant: pld cannot account fixed-size cohorts (2 of 4 clients without replacement); use "
     "accountant: rdp, or participation.sampling: poisson"),
    ([*UNIFORM, "privacy.noise_multiplier=1", "participation.availability=0.5"], "participation.availability < 1"),
    ([*UNIFORM], "privacy: level client: set noise_multiplier or target_epsilon (one of them)"),
])
def test_bad_privacy_settings_are_one_line_naming_the_key(overrides, message):
    base = ["data.num_clients=4", "participation.clients_per_round=2", "privacy.level=client"]
    with pytest.raises(ConfigError) as info:
        load_config(None, [*base, *[o for o in overrides if not o.startswith("participation.clients_per_round")]])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_an_unreachable_target_epsilon_is_one_line_and_leaves_no_run_folder(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY, "algorithm.weighting=uniform", "privacy.level=client",
                            "privacy.accountant=rdp", "privacy.target_epsilon=1e-9", "privacy.delta=1e-3")
    assert_one_line_error(proc, root, "privacy.target_epsilon: 1e-09 is out of reach in 1 rounds at delta 0.001: "
                                      "even noise_multiplier 1000 spends epsilon ")


def test_a_device_trace_with_availability_is_refused_under_client_level_dp(tmp_path):
    trace = tmp_path / "trace.csv"
    trace.write_text("client,speed,bandwidth_mbps,availability\n" + "".join(f"{c},1.0,20,0.5\n" for c in range(4)))
    proc, root = fedsim_run(tmp_path, TINY, "algorithm.weighting=uniform", "privacy.level=client",
                            "privacy.accountant=rdp", "privacy.noise_multiplier=1", f"stragglers.trace={trace}")
    assert_one_line_error(proc, root, f"stragglers.trace: {trace} gives clients an availability below 1, which no "
                                      "accountant here models under privacy.level client")


def test_the_adaptive_clip_grows_when_updates_are_clipped_and_shrinks_when_none_are():
    """TF Privacy's direction (Flower's strategy applies the rule to the share *clipped*, whose fixed point is
    unstable): with every update clipped the clip must rise."""
    dp = ClientLevelDP(clip=1.0, mechanism=Mechanism(0.0, "poisson", 1.0, 10, 10), delta=1e-3, accountant="rdp",
                       expected_cohort=10.0, max_epsilon=None, seed=0, adaptive=True, quantile=0.5, clip_lr=0.2)
    gen = torch.Generator().manual_seed(0)
    assert dp.adapt_clip(0, 10, gen) == {"privacy/unclipped_estimate": 0.0, "privacy/next_clip": math.exp(0.1)}
    dp.clip = 1.0
    assert dp.adapt_clip(10, 10, gen)["privacy/next_clip"] == math.exp(-0.1)


def test_the_count_query_takes_its_share_of_the_noise():
    from fedsim.transforms.privacy import split_noise

    count_std, update = split_noise(1.0, 1.0, 20)
    assert count_std == 1.0 and update == pytest.approx((1 - 0.25) ** -0.5)
    assert split_noise(1.0, None, 40) == (2.0, pytest.approx((1 - 1 / 16) ** -0.5))  # sigma_b = m / 20
    with pytest.raises(ConfigError, match=r"privacy.count_noise: 0.5 spends the whole noise_multiplier 1"):
        split_noise(1.0, 0.5, 20)


def test_an_adaptive_clip_run_is_the_same_on_any_worker_count_and_resumed(make_config):
    cfg = make_config(*DP, "privacy.noise_multiplier=0.5", "privacy.clip=0.05", "privacy.adaptive_clip=true",
                      "privacy.count_noise=1", "results.run_id=whole", rounds=3)
    whole = load(run(cfg, LocalBackend(num_workers=1)))["rounds"]
    assert whole["privacy/clip"].iloc[0] == 0.05 and whole["privacy/clip"].nunique() == 3  # it moved every round
    assert (whole["privacy/clip"].iloc[1:].to_numpy() == whole["privacy/next_clip"].iloc[:-1].to_numpy()).all()
    cfg.results.run_id = "three"
    three = load(run(cfg, LocalBackend(num_workers=3)))["rounds"]
    pd.testing.assert_frame_equal(deterministic(whole), deterministic(three))
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(whole))
