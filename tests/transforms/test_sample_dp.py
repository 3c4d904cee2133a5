"""Sample-level DP-SGD: one step against a hand computation, each client's epsilon as the accountant gives it for
the steps it took, the same numbers on any worker count and after a resume, target_epsilon's noise bounding every
client, and what cannot be private refused in one line."""

from __future__ import annotations

import dataclasses

import numpy as np
import pandas as pd
import pytest
import torch
from torch import nn

from fedsim import rng
from fedsim.config.schema import TrainConfig
from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.contract import ClientResult
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.training.dpsgd import DPSGD, train_dp_sgd
from fedsim.training.optim import SGD
from fedsim.transforms.accounting import Mechanism, epsilon
from fedsim.transforms.chain import UpdateChain
from fedsim.transforms.sample_dp import SampleLevelDP
from tests.runtime.test_loop import deterministic
from tests.test_hostile_config import TINY, assert_one_line_error, fedsim_run
from tests.transforms.test_privacy import stopped_then_resumed

SAMPLE = ["privacy.level=sample", "privacy.accountant=rdp", "privacy.clip=0.5"]


@pytest.mark.parametrize("z", [0.0, 1.3])
def test_one_step_is_the_clipped_per_sample_gradients_sum_plus_noise_over_the_expected_batch(z):
    """A 3-to-2 linear model, 6 samples, batch 4 (q = 2/3): the Poisson batch from the batch generator, each sample's
    CE gradient in float64 by hand, clipped to C over all parameters, summed, the named noise added, divided by q·n."""
    torch.manual_seed(0)
    model = nn.Linear(3, 2).double()
    x, y = torch.randn(6, 3, dtype=torch.float64), torch.tensor([0, 1, 1, 0, 1, 0])
    w0, b0 = model.weight.detach().clone(), model.bias.detach().clone()
    train = dataclasses.replace(TrainConfig(), batch_size=4, steps=1, lr=0.1, momentum=0.0, weight_decay=0.0)
    train_dp_sgd(model, x, y, train, torch.Generator().manual_seed(5),
                 DPSGD(0.5, z, torch.Generator().manual_seed(9)), SGD(model.parameters(), lr=0.1))

    chosen = np.flatnonzero(torch.rand(6, generator=torch.Generator().manual_seed(5)).numpy() < 4 / 6)
    W, b, X, Y = w0.numpy(), b0.numpy(), x.numpy(), y.numpy()
    total = np.zeros(W.size + b.size)
    for j in chosen:
        logits = W @ X[j] + b
        p = np.exp(logits - logits.max())
        p /= p.sum()
        p[Y[j]] -= 1.0  # dCE/dlogits
        g = np.concatenate([np.outer(p, X[j]).ravel(), p])
        total += g * min(1.0, 0.5 / (np.linalg.norm(g) + 1e-6))
    gen = torch.Generator().manual_seed(9)
    noise = np.concatenate([torch.randn(2, 3, generator=gen, dtype=torch.float64).numpy().ravel(),
                            torch.randn(2, generator=gen, dtype=torch.float64).numpy()])
    step = (total + z * 0.5 * noise) / 4.0
    assert 0 < len(chosen) < 6  # a real Poisson draw, neither empty nor everything
    np.testing.assert_allclose(model.weight.detach().numpy().ravel(), W.ravel() - 0.1 * step[:6], atol=1e-12)
    np.testing.assert_allclose(model.bias.detach().numpy(), b - 0.1 * step[6:], atol=1e-12)


def test_each_client_reports_the_epsilon_of_the_steps_it_took_and_the_round_the_largest(make_config):
    tables = load(run(make_config(*SAMPLE, "privacy.noise_multiplier=1.2", "privacy.delta=1e-4", rounds=3),
                      LocalBackend()))
    clients, rounds = tables["clients"].sort_values(["round", "client"]), tables["rounds"].sort_values("round")
    steps: dict[int, int] = {}
    for _, row in clients.iterrows():  # the accountant, composed by hand over the client's rounds so far
        c = int(row["client"])
        steps[c] = steps.get(c, 0) + int(row["privacy/dp_steps"])
        mech = Mechanism(1.2, "poisson", float(row["privacy/sample_rate"]), 1, 1)
        assert row["privacy/epsilon"] == pytest.approx(epsilon(mech, steps[c], 1e-4, "rdp"), rel=1e-12)
    worst = [clients[clients["round"] <= r].groupby("client")["privacy/epsilon"].last().max() for r in range(3)]
    np.testing.assert_allclose(rounds["privacy/epsilon"], worst)
    np.testing.assert_allclose(rounds["privacy/clipped_fraction"],  # the clients' shares of clipped samples, averaged
                               clients.groupby("round")["privacy/samples_clipped"].mean())
    assert (clients["privacy/dp_steps"] > 0).all() and rounds["privacy/epsilon"].is_monotonic_increasing
    assert clients.groupby("client").size().max() > 1  # some client joined twice: its steps were composed


def test_dp_sgd_gives_the_same_numbers_on_one_and_three_workers_and_resumed(make_config):
    cfg = make_config(*SAMPLE, "privacy.noise_multiplier=1.0", "results.run_id=whole", rounds=3)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = "three"
    three = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    pd.testing.assert_frame_equal(deterministic(one["clients"]).drop(columns=["worker"], errors="ignore"),
                                  deterministic(three["clients"]).drop(columns=["worker"], errors="ignore"))
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(one["rounds"]))
    assert one["clients"]["privacy/samples_clipped"].gt(0).any()  # the clip was met: the test is not vacuous


def test_target_epsilon_bounds_every_client_that_joins_every_round(make_config):
    cfg = make_config(*SAMPLE, "privacy.target_epsilon=3", "privacy.delta=1e-4", rounds=4)
    cfg.train.batch_size = 8
    sizes = np.array([9, 20, 20, 64, 130])
    dp = SampleLevelDP.from_config(cfg, sizes, solve=True)
    spent = [dp.epsilon_of(q, 4 * t) for q, t in zip(dp.rates, dp.per_round)]
    assert max(spent) <= 3 and max(spent) == pytest.approx(3, rel=0.01)  # the binding client is at the target
    assert spent[0] == max(spent)  # the fewest samples, the largest q, binds


def test_a_client_step_without_dp_sgd_stops_the_run_in_one_line():
    chain = UpdateChain(sample=SampleLevelDP(1.0, 1.0, 1e-5, "rdp", 0, np.ones(2), np.ones(2, dtype=np.int64)))
    with pytest.raises(ConfigError, match="client 1's step did not train with fedsim's DP-SGD"):
        chain.client(ClientResult(payload={}, weight=1.0, metrics={"steps": 3.0}), "cnn", {}, 0, 1, "train")


def test_the_noise_is_the_clients_own_named_stream():
    dp = SampleLevelDP(1.0, 2.0, 1e-5, "rdp", 11, np.ones(3), np.ones(3, dtype=np.int64))
    mine = dp.for_client({"dp_noise_multiplier": 0.7}, 4, 2, "train", 0)
    assert mine.noise_multiplier == 0.7
    expected = rng.torch_generator(11, "privacy-sample-noise/train", 4, 2, 0)
    assert torch.equal(torch.randn(5, generator=mine.noise), torch.randn(5, generator=expected))


@pytest.mark.parametrize("overrides, message", [
    (["algorithm.name=feddf"], "privacy.level: sample-level DP trains with DP-SGD in a method whose round is one "
                               "phase that uploads a model update; feddf's clients"),
    (["privacy.adaptive_clip=true"], "privacy.adaptive_clip: adapts the clip of client-level DP"),
    (["privacy.clip=.inf"], "privacy.clip: .inf with noise would make the noise infinite"),
])
def test_bad_sample_level_settings_are_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, [*SAMPLE, "privacy.noise_multiplier=1", *overrides])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_batchnorm_model_is_refused_with_the_fix_named(tmp_path):
    proc, root = fedsim_run(tmp_path, TINY, *SAMPLE, "privacy.noise_multiplier=1", "model.name=resnet8")
    assert_one_line_error(proc, root, "model.name: layer 'stem.1' is a BatchNorm2d, which mixes the samples of a "
                                      "batch, so sample-level DP-SGD cannot clip one sample's gradient; use a model "
                                      "without BatchNorm (model.options.norm: group for resnet8/resnet20)")


@pytest.mark.parametrize("method", ["fedprox", "scaffold"])
def test_the_fedavg_family_trains_with_dp_sgd_and_late_clients_spend_epsilon_too(make_config, method):
    """FedProx's proximal term and SCAFFOLD's correction add their gradients after the noise; with stragglers, a
    client that trained but arrived late has spent its epsilon all the same."""
    extra = ["algorithm.mu=0.1"] if method == "fedprox" else []
    tables = load(run(make_config(*SAMPLE, "privacy.noise_multiplier=1.0", f"algorithm.name={method}", *extra,
                                  "stragglers.enabled=true", "participation.clients_per_round=6", rounds=2),
                      LocalBackend()))
    clients = tables["clients"]
    assert (clients["status"] == "late").any() and clients["privacy/epsilon"].gt(0).all()
    assert clients["privacy/dp_steps"].gt(0).all() and tables["rounds"]["accuracy"].notna().all()


def test_max_epsilon_stops_before_a_client_joining_the_next_round_could_pass_it():
    dp = SampleLevelDP(1.0, 1.0, 1e-5, "rdp", 0, np.array([0.5, 0.1]), np.array([4, 20]), max_epsilon=None,
                       steps=np.zeros(2, dtype=np.int64))
    one_round = dp.worst_after(dp.per_round)
    dp.max_epsilon = one_round * 1.3  # one round fits, two do not (7.41, then 10.33)
    assert not dp.stop_before()
    dp.account({0: {"privacy/dp_steps": 4.0}, 1: {"pretrain_privacy/dp_steps": 10.0, "privacy/dp_steps": 10.0}})
    assert list(dp.steps) == [4, 20] and dp.stop_before()


def test_sample_level_dp_composes_with_a_robust_aggregator(make_config):
    """Each client's update is private by its own DP-SGD, so Multi-Krum on the server is post-processing: both run,
    each client's epsilon and whether it was kept in its row."""
    tables = load(run(make_config(*SAMPLE, "privacy.noise_multiplier=1.0", "aggregator={name: multi_krum, f: 1}",
                                  "participation.clients_per_round=6", rounds=1), LocalBackend()))
    clients = tables["clients"]
    assert clients["privacy/epsilon"].gt(0).all() and clients["kept"].notna().all()
    assert 0 < clients["kept"].sum() < len(clients)
