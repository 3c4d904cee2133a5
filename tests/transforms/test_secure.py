"""Secure aggregation as the runtime runs it: the unmasked sum is the plain sum of the clients' quantised updates bit
for bit (however the workers group them, with stragglers dropping out), a round with too few survivors aborts and
keeps the model, the protocol's bytes are counted, and what cannot be summed securely is refused in one line."""

from __future__ import annotations

import math

import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.sums import WeightedSum
from fedsim.models import build_model
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.transforms import secagg
from fedsim.transforms.secure import MASKED_KEY, SecureAggregation, float_keys, secagg_generator
from fedsim.transforms.updates import flatten
from tests.runtime.test_loop import deterministic

SECAGG = ["privacy.secure_aggregation=secagg+", "privacy.secagg_range=40", "privacy.secagg_neighbours=4",
          "participation.clients_per_round=8"]


def test_the_unmasked_sum_is_the_plain_sum_of_the_quantised_updates_bit_for_bit(make_config):
    """Seven clients of a 2-entry model (two drop out after key setup) encoded as the workers do, summed in two
    groupings, unmasked by the server: Σ quantise(w·Δ) over the survivors, dequantised, and Σ w exactly."""
    cfg = make_config(*SECAGG)
    secure = SecureAggregation(cfg, "secagg+")
    reference = {"w": torch.zeros(3, 2), "b": torch.zeros(2)}
    keys = float_keys({"m": reference})
    cohort, survivors = [1, 3, 4, 6, 8, 9, 11], [1, 4, 6, 8, 11]
    gen = torch.Generator().manual_seed(0)
    updates = {c: {"m/w": 0.3 * torch.randn(3, 2, generator=gen, dtype=torch.float64),
                   "m/b": 0.3 * torch.randn(2, generator=gen, dtype=torch.float64)} for c in cohort}
    weights = {c: float(10 + c) for c in cohort}
    encoded = {c: secure.encode(updates[c], weights[c], 0.0, keys, 5, c, cohort) for c in survivors}
    uploads = {c: payload for c, (payload, _) in encoded.items()}
    assert all(metrics["secagg/clamped"] == 0 for _, metrics in encoded.values())
    groupings = ([[1, 4], [6, 8, 11]], [[11, 6, 1, 4, 8]])
    totals = []
    for groups in groupings:
        total = WeightedSum()
        for group in groups:
            part = WeightedSum()
            for c in group:
                part.add(uploads[c], 1.0, c)
            total.merge(part)
        totals.append(total.totals())
    assert torch.equal(totals[0][MASKED_KEY], totals[1][MASKED_KEY])
    entries, columns = secure.decode(totals[0], {"m": reference}, 5, cohort, survivors)
    spec = secure.spec(cohort)
    plain = sum(secagg.quantise(flatten(updates[c], keys) * weights[c], spec, secagg_generator(spec, 5, c))[0]
                for c in survivors)
    want = secagg.dequantise(plain, len(survivors), spec)
    assert entries is not None and columns == {"secagg/aborted": 0.0, "secagg/dropouts": 2.0}
    assert torch.equal(torch.cat([entries["m/b"], entries["m/w"].reshape(-1)]), want)
    assert float(entries["m/__weight__"]) == sum(weights[c] for c in survivors)
    exact = sum(flatten(updates[c], keys) * weights[c] for c in survivors)
    assert (want - exact).abs().max() <= len(survivors) * 2 * 40 / 65536  # the only error: quantisation


def test_a_secure_run_is_the_same_on_one_and_three_workers_with_stragglers_dropping_out(make_config):
    cfg = make_config(*SECAGG, "stragglers.enabled=true", "results.run_id=one")
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = "three"
    three = load(run(cfg, LocalBackend(num_workers=3)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(three["rounds"]))
    rounds = one["rounds"]
    assert rounds["secagg/dropouts"].gt(0).any() and (rounds["secagg/aborted"] == 0).all()
    assert rounds["accuracy"].notna().all()


def test_the_protocols_bytes_replace_the_plain_upload_and_add_to_the_download(make_config):
    plain = load(run(make_config("participation.clients_per_round=8", "results.run_id=plain"), LocalBackend()))
    secure = load(run(make_config(*SECAGG, "results.run_id=secure"), LocalBackend()))
    ours, theirs = secure["clients"], plain["clients"]
    cohort = 8
    spec = secagg.SecAggSpec(32, 65536, 40.0, 4, 0.5, 0)
    floats = sum(p.numel() for p in build_model("cnn", 1, 10, 8).parameters())  # digits' cnn: no integer buffer
    cost = secagg.costs(spec, cohort, 4, floats + 2)
    assert (ours["bytes_up"] == cost["masked_bytes"] + cost["extra_up_bytes"]).all()
    assert (ours["bytes_down"] == theirs["bytes_down"].iloc[0] + cost["extra_down_bytes"]).all()


def test_too_few_survivors_abort_the_round_and_keep_the_model(make_config):
    cfg = make_config(*SECAGG, "stragglers.enabled=true", "privacy.secagg_threshold=1.0", rounds=1)
    out = run(cfg, LocalBackend())
    rounds = load(out)["rounds"]
    assert (rounds["secagg/aborted"] == 1).all() and rounds["secagg/abort_reason"].str.contains(
        "neighbours survived").all()
    cfg.results.run_id, cfg.rounds = "untrained", 1
    cfg.privacy.secure_aggregation, cfg.stragglers.enabled = "none", False
    cfg.train.lr = 0.0  # a round that changes nothing: the initial model
    untouched = load_run_checkpoint(run(cfg, LocalBackend()) / "checkpoints" / "last.pt")["server_state"].models
    aborted = load_run_checkpoint(out / "checkpoints" / "last.pt")["server_state"].models
    for name, value in untouched["cnn"].items():
        assert torch.equal(value, aborted["cnn"][name]), name


@pytest.mark.parametrize("overrides, message", [
    (["privacy.secagg_bits=16"], "privacy.secagg_bits: a cohort of 8 at privacy.secagg_levels 65536 sums to up to "
                                 "524288, which wraps the field of 2**16; the largest cohort that fits is 0"),
    (["aggregator.name=median"], "privacy.secure_aggregation: the server sees only the sum, so it cannot run a "
                                 "robust aggregator"),
    (["algorithm.name=feddf"], "privacy.secure_aggregation: sums a model update, and feddf's round is not one phase"),
])
def test_what_cannot_be_summed_securely_is_one_line_naming_the_key(overrides, message):
    with pytest.raises(ConfigError) as info:
        load_config(None, ["data.num_clients=10", *SECAGG, *overrides])
    assert message in str(info.value) and "\n" not in str(info.value)


def test_without_dp_the_range_must_be_given():
    with pytest.raises(ConfigError, match="privacy.secagg_range: set the range"):
        load_config(None, ["privacy.secure_aggregation=secagg"])
    assert math.isfinite(load_config(None, ["privacy.secure_aggregation=secagg", "privacy.level=client",
                                            "privacy.noise_multiplier=1", "algorithm.weighting=uniform",
                                            "privacy.accountant=rdp"]).privacy.clip)


def test_client_level_dp_under_secure_aggregation_differs_from_plain_dp_by_quantisation_alone(make_config):
    """The clipped updates' sum unmasked, then noised by the server as without SecAgg: the same epsilon, and a model
    within the quantisation error of each coordinate (range = the clip; m̃ = 8 clients)."""
    dp = ["participation.clients_per_round=8", "algorithm.weighting=uniform", "privacy.level=client",
          "privacy.noise_multiplier=0.5", "privacy.clip=0.5", "privacy.accountant=rdp"]
    plain = run(make_config(*dp, "results.run_id=plain", rounds=1), LocalBackend())
    secure = run(make_config(*dp, "privacy.secure_aggregation=secagg", "results.run_id=secure", rounds=1),
                 LocalBackend())
    a, b = load(plain)["rounds"], load(secure)["rounds"]
    pd.testing.assert_series_equal(a["privacy/epsilon"], b["privacy/epsilon"])
    ours = load_run_checkpoint(secure / "checkpoints" / "last.pt")["server_state"].models["cnn"]
    theirs = load_run_checkpoint(plain / "checkpoints" / "last.pt")["server_state"].models["cnn"]
    step = 2 * 0.5 / 65536  # one quantisation level: the mean of 8 updates moves by at most 8 of them / 8
    gaps = {name: float((ours[name].double() - value.double()).abs().max()) for name, value in theirs.items()}
    assert max(gaps.values()) > 0 and all(gap <= step + 1e-7 for gap in gaps.values()), gaps


def test_scaffolds_model_and_control_variate_updates_go_through_the_secure_sum(make_config):
    """SCAFFOLD's upload holds its model update and its control-variate difference (relative to zeros): both are
    quantised, masked and unmasked; the run is the plain run's to quantisation, so it learns as the plain one does."""
    plain = load(run(make_config("algorithm.name=scaffold", "participation.clients_per_round=8", "results.run_id=a",
                                 rounds=2), LocalBackend()))["rounds"]
    secure = load(run(make_config("algorithm.name=scaffold", *SECAGG, "results.run_id=b", rounds=2),
                      LocalBackend()))["rounds"]
    assert (secure["secagg/aborted"] == 0).all()
    assert abs(float(secure["accuracy"].iloc[-1]) - float(plain["accuracy"].iloc[-1])) <= 0.02


def test_the_protocols_messages_enter_the_virtual_clock(make_config):
    """stragglers.latency_s per message round trip: a plain round has one, SecAgg three more."""
    def durations(*extra: str) -> pd.Series:
        cfg = make_config(*extra, "participation.clients_per_round=8", "stragglers.enabled=true",
                          "stragglers.deadline=none", rounds=1)
        cfg.results.run_id = "_".join(e.replace("=", "-").replace("/", "") for e in extra) or "plain"
        return load(run(cfg, LocalBackend()))["clients"].set_index("client")["virtual_duration"]

    plain, plain_slow = durations(), durations("stragglers.latency_s=2")
    secure, secure_slow = durations(*SECAGG[:3]), durations(*SECAGG[:3], "stragglers.latency_s=2")
    assert ((plain_slow - plain).round(9) == 2.0).all() and ((secure_slow - secure).round(9) == 8.0).all()
    assert (secure > plain).all()  # the keys and shares' bytes too
