"""Compressed uploads: each scheme's encoding and decoding against a numpy hand computation, the unbiased ones
unbiased, the encoded bytes counted as bytes_up, error feedback's residual carried, checkpointed and resumed exactly,
the same numbers on 1 and 2 workers, none leaving a run as it was, and bad input refused in one line."""

from __future__ import annotations

import math

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import CheckpointError, ConfigError
from fedsim.method.contract import ClientResult
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import run
from fedsim.transforms import compression as C
from tests.runtime.test_loop import deterministic
from tests.transforms.test_privacy import stopped_then_resumed

V = torch.tensor([0.1, -0.9, 0.3, 0.9, -0.2, 0.05], dtype=torch.float64)


def draws(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def sylvester(D: int) -> np.ndarray:
    H = np.ones((1, 1))
    while len(H) < D:
        H = np.block([[H, H], [H, -H]])
    return H


def f32_up(x: float) -> float:
    f = np.float32(x)
    return float(f if float(f) >= x else np.nextafter(f, np.float32(np.inf)))


def test_casts_round_each_value_and_send_two_bytes_a_coordinate():
    v = torch.tensor([0.5, -1.25, 3.0, 0.1, 1 + 2**-9], dtype=torch.float64)
    half = C.cast(torch.float16)(v, None)
    assert C.encoded_bytes("fp16", 5, 1, 0.5) == C.encoded_bytes("bf16", 5, 1, 0.5) == 10
    assert np.array_equal(half.numpy(), v.numpy().astype(np.float16).astype(np.float64))
    bf = C.cast(torch.bfloat16)(v, None)
    assert bf[:3].tolist() == [0.5, -1.25, 3.0]  # representable: exact
    assert bf[4].item() == 1.0 and abs(bf[3].item() - 0.1) <= 2**-8 * 0.1  # 8 bits of mantissa


def test_int8_rounds_to_the_nearest_step_of_a_per_tensor_scale():
    out = C.int8(V)
    scale = float(np.float32(0.9 / 127))
    want = np.clip(np.round(V.numpy() / scale), -127, 127) * scale
    assert C.encoded_bytes("int8", 6, 1, 0.5) == 6 + 4 and np.array_equal(out.numpy(), want)
    assert C.int8(torch.zeros(3, dtype=torch.float64)).tolist() == [0.0, 0.0, 0.0]


def test_qsgd_is_the_stochastic_rounding_of_the_normalised_magnitudes():
    s = 4
    out = C.qsgd(s)(V, draws(7))
    u = torch.rand(6, generator=draws(7), dtype=torch.float64).numpy()
    v = V.numpy()
    norm = f32_up(float(np.linalg.norm(v)))
    r = np.abs(v) / norm * s
    level = np.floor(r) + (u < r - np.floor(r))
    assert np.array_equal(out.numpy(), np.sign(v) * level * (norm / s))
    # the norm, then a sign and one of 0..4 (3 bits) per coordinate
    assert C.encoded_bytes("qsgd", 6, s, 0.5) == 4 + math.ceil(6 * (1 + 3) / 8)


def test_topk_keeps_the_largest_magnitudes_with_their_indices():
    out = C.topk(0.34)(V, None)  # ceil(0.34·6) = 3: |−0.9|, |0.9|, |0.3|
    assert out.tolist() == [0.0, float(np.float32(-0.9)), float(np.float32(0.3)), float(np.float32(0.9)), 0.0, 0.0]
    assert C.encoded_bytes("topk", 6, 1, 0.34) == C.encoded_bytes("randk", 6, 1, 0.34) == 3 * (4 + 1)
    assert C.topk(0.1)(V, None).nonzero().flatten().tolist() == [1]  # a tie goes to the lower index
    assert [C.index_bytes(d) for d in (1, 256, 257, 65536, 65537, 2**32 + 1)] == [1, 1, 2, 2, 4, 8]


def test_randk_sends_k_drawn_coordinates_scaled_by_d_over_k():
    out = C.randk(0.5)(V, draws(3))
    idx = torch.randperm(6, generator=draws(3))[:3].numpy()
    want = np.zeros(6)
    want[idx] = V.numpy().astype(np.float32)[idx] * 2
    assert np.array_equal(out.numpy(), want)


def test_sign_sends_the_mean_magnitude_and_one_bit_a_coordinate():
    out = C.sign(torch.tensor([1.0, -2.0, 0.0, 3.0], dtype=torch.float64))
    assert out.tolist() == [1.5, -1.5, 1.5, 1.5] and C.encoded_bytes("sign", 4, 1, 0.5) == 4 + 1


def test_rotation_quantises_the_rotated_vector_and_rotates_back():
    v = V[:5]
    out = C.rotation(2)(v, draws(5))
    gen = draws(5)
    signs = (torch.randint(0, 2, (8,), generator=gen) * 2 - 1).double().numpy()
    u = torch.rand(8, generator=gen, dtype=torch.float64).numpy()
    H = sylvester(8) / math.sqrt(8)
    y = H @ (np.pad(v.numpy(), (0, 3)) * signs)
    lo, hi = -f32_up(-y.min()), f32_up(y.max())
    r = (y - lo) / ((hi - lo) / 2)
    level = np.floor(r) + (u < r - np.floor(r))
    want = (signs * (H @ (lo + level * (hi - lo) / 2)))[:5]
    assert np.allclose(out.numpy(), want, rtol=0, atol=1e-12)
    # min and max, then 2 bits (0..2) for each of the 8 padded coordinates
    assert C.encoded_bytes("rotation", 5, 2, 0.5) == 2 * 4 + math.ceil(8 * 2 / 8)
    fine = C.rotation(2**16)(v, draws(5))
    assert np.allclose(fine.numpy(), v.numpy(), atol=1e-4)  # H is orthonormal: its own inverse


@pytest.mark.parametrize("codec, n", [(C.qsgd(2), 2000), (C.randk(0.5), 2000), (C.rotation(1), 2000)])
def test_the_stochastic_schemes_are_unbiased(codec, n):
    """The mean of n draws within 5 standard errors of the input; each draw's variance is at most ‖v‖² per
    coordinate (qsgd: ‖v‖²/4s²; randk: v_i²(d/k − 1); rotation: ‖v‖², its range being ≤ 2‖v‖)."""
    mean = sum(codec(V, draws(seed)) for seed in range(n)) / n
    bound = 5 * float(torch.linalg.vector_norm(V)) / math.sqrt(n)
    assert float((mean - V).abs().max()) < bound
    biased = sum(C.topk(0.5)(V, None) for _ in range(2)) / 2  # the check catches a biased scheme
    assert float((biased - V).abs().max()) > bound


def payload(delta_w: list[float], delta_b: list[float]) -> dict[str, torch.Tensor]:
    return {"m/w": torch.tensor(delta_w, dtype=torch.float32).reshape(2, 2) + 1, "m/b": torch.tensor(delta_b),
            "m/steps": torch.tensor(5), "m/__weight__": torch.ones(())}


REFERENCE = {"w": torch.ones(2, 2), "b": torch.zeros(2), "steps": torch.tensor(4)}


def test_error_feedback_compresses_update_plus_residual_and_keeps_what_was_dropped():
    """Top-k of 4 and 2 entries at k = 1/4: one of each. Round 0 sends the largest; round 1 compresses its update
    plus round 0's residual; a late client's new residual is not kept. Bytes: the kept values with one-byte indices,
    the int64 counter and the float32 weight as they are."""
    cfg = load_config(None, ["compression.kind=topk", "compression.fraction=0.25", "compression.error_feedback=true"])
    comp = C.Compression(cfg)
    res = comp.client(ClientResult(payload([0.5, -0.25, 0.125, 0.0], [0.5, 0.75])), "m", REFERENCE, 0, 3, "train")
    comp.settle(3, True)
    assert res.payload["m/w"].tolist() == [[1.5, 1.0], [1.0, 1.0]] and res.payload["m/b"].tolist() == [0.0, 0.75]
    assert torch.equal(res.payload["m/steps"], torch.tensor(5))
    assert res.metrics[C.BYTES_UP] == (4 + 1) + (4 + 1) + 8 + 4
    assert comp.residuals[3]["m/w"].flatten().tolist() == [0, -0.25, 0.125, 0] and \
        comp.residuals[3]["m/b"].tolist() == [0.5, 0]
    res = comp.client(ClientResult(payload([0.0, -0.125, 0.0, 0.0], [0.0, 0.0])), "m", REFERENCE, 1, 3, "train")
    assert res.payload["m/w"].flatten().tolist() == [1, 1 - 0.375, 1, 1] and res.payload["m/b"].tolist() == [0.5, 0]
    comp.settle(3, False)  # late: the residual stays round 0's
    assert comp.residuals[3]["m/w"].flatten().tolist() == [0, -0.25, 0.125, 0]
    restored = C.Compression(cfg)
    assert restored.load(comp.export({3: None, 4: {"own": torch.ones(1)}})) == {4: {"own": torch.ones(1)}}
    assert torch.equal(restored.residuals[3]["m/w"], comp.residuals[3]["m/w"])
    with pytest.raises(CheckpointError, match="client 3's compression residual is not a dict of float tensors"):
        restored.load({3: {C.RESIDUAL_KEY: {"m/w": "text"}, C.STATE_KEY: None}})
    restored.load({3: {C.RESIDUAL_KEY: {"m/w": torch.zeros(3)}, C.STATE_KEY: None}})
    with pytest.raises(CheckpointError, match="residual for 'm/w' has shape \\(3,\\), its update \\(2, 2\\)"):
        restored.client(ClientResult(payload([0.0] * 4, [0.0, 0.0])), "m", REFERENCE, 2, 3, "train")


def entry_bytes(state: dict[str, torch.Tensor], per_float) -> int:
    return sum(per_float(v.numel()) if v.is_floating_point() else v.numel() * v.element_size()
               for v in state.values()) + 4  # the float32 weight counter


def test_bytes_up_is_the_encoded_size_counted_by_hand(make_config):
    """Top-k 1% of the digits CNN: per tensor ceil(d/100) float32 values and their indices (1, 2 or 4 bytes);
    bf16: 2 bytes a coordinate; the same model, another count."""
    out = run(make_config("compression.kind=topk", rounds=1), LocalBackend())
    model = load_run_checkpoint(out / "checkpoints" / "last.pt")["server_state"].models["cnn"]
    want = entry_bytes(model, lambda d: C.kept_count(0.01, d) * (4 + C.index_bytes(d)))
    clients = load(out)["clients"]
    ok = clients[clients["status"] == "ok"]
    assert len(ok) == 4 and (ok["bytes_up"] == want).all() and (ok[C.BYTES_UP] == want).all()
    assert int(load(out)["rounds"]["bytes_up"].iloc[0]) == 4 * want
    half = load(run(make_config("compression.kind=bf16", "results.run_id=bf16", rounds=1), LocalBackend()))["clients"]
    assert (half["bytes_up"] == entry_bytes(model, lambda d: 2 * d)).all()


def test_compression_none_leaves_the_run_as_it_was(make_config):
    plain = load(run(make_config(rounds=2), LocalBackend()))
    none = load(run(make_config("compression.kind=none", "compression.fraction=0.5", "compression.levels=2",
                                "results.run_id=none", rounds=2), LocalBackend()))
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(deterministic(plain[table]), deterministic(none[table]))


EF = ["compression.kind=rotation", "compression.levels=4", "compression.error_feedback=true"]


def test_the_same_numbers_on_one_and_two_workers(make_config):
    """The rotation's random signs and rounding, and the residuals, do not depend on which worker holds a
    client."""
    cfg = make_config(*EF, rounds=3)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = "two"
    two = load(run(cfg, LocalBackend(num_workers=2)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(two["rounds"]))
    pd.testing.assert_frame_equal(deterministic(one["clients"]).drop(columns=["worker"]),
                                  deterministic(two["clients"]).drop(columns=["worker"]))


def test_a_resumed_run_continues_from_the_checkpointed_residuals(make_config):
    """A stateless method's clients keep their residuals in the checkpoint, and a run stopped after round 2 and
    resumed gives round 3 as the uninterrupted run does."""
    cfg = make_config(*EF, "results.run_id=whole", rounds=3)
    out = run(cfg, LocalBackend())
    whole = load(out)["rounds"]
    states = load_run_checkpoint(out / "checkpoints" / "last.pt")["client_states"]
    ran = set(load(out)["clients"].query("status == 'ok'")["client"])
    assert set(states) == ran and all(C.RESIDUAL_KEY in s and s[C.STATE_KEY] is None for s in states.values())
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(whole))


def test_a_robust_aggregator_reads_the_decoded_updates(make_config):
    rounds = load(run(make_config("compression.kind=sign", "aggregator.name=median", rounds=1), LocalBackend()))
    assert (rounds["clients"]["bytes_up"] < 40_000).all() and rounds["rounds"]["accuracy"].notna().all()


def test_client_level_dp_clips_the_decoded_update(make_config):
    """Compression, then DP's clip: the norm DP clips is the decoded update's (top-k's is below the plain one's for
    the same client and model in round 0), and the accountant's epsilon is the plain DP run's."""
    dp = ["participation.clients_per_round=4", "algorithm.weighting=uniform", "privacy.level=client",
          "privacy.noise_multiplier=1.0", "privacy.clip=0.5", "privacy.accountant=rdp"]
    plain = load(run(make_config(*dp, "results.run_id=plain", rounds=1), LocalBackend()))
    topk = load(run(make_config(*dp, "compression.kind=topk", "compression.fraction=0.05", "results.run_id=topk",
                                rounds=1), LocalBackend()))
    pd.testing.assert_series_equal(plain["rounds"]["privacy/epsilon"], topk["rounds"]["privacy/epsilon"])
    norms = [t["clients"].set_index("client")["privacy/update_norm"] for t in (plain, topk)]
    assert (norms[1] < norms[0]).all() and (topk["clients"]["bytes_up"] < plain["clients"]["bytes_up"] / 5).all()


BAD = "name: bad\nrounds: 1\ndata: {name: digits, num_clients: 4}\nparticipation: {clients_per_round: 2}\n" \
      "runtime: {backend: local, num_workers: 1, threads: 1}\n"


@pytest.mark.parametrize("overrides, message", [
    (["compression.fraction=0"], "compression.fraction: must be > 0, got 0.0"),
    (["compression.fraction=1"], "compression.fraction: must be < 1, got 1.0"),
    (["compression.levels=0"], "compression.levels: must be >= 1, got 0"),
    (["compression.kind=zip"], "compression.kind: must be one of ['none', 'fp16'"),
    (["compression.error_feedback=true"], "compression.error_feedback: needs a compression.kind"),
    (["compression.kind=randk", "compression.error_feedback=true"], "compression.error_feedback: randk is unbiased by "
                                                                   "scaling up what it keeps"),
    (["compression.kind=topk", "algorithm.name=feddf"], "compression.kind: compresses a model update, and feddf's "
                                                        "round is not one phase that uploads one"),
    (["compression.kind=qsgd", "algorithm.name=fednova"], "compression.kind: compresses a model update, and "
                                                          "fednova's round"),
    (["compression.kind=sign", "algorithm.name=dafkd"], "compression.kind: compresses a model update, and dafkd's"),
    (["compression.kind=sign", "algorithm.name=dosfl"], "compression.kind: compresses a model update, and dosfl's"),
    (["compression.kind=qsgd", "privacy.secure_aggregation=secagg", "privacy.secagg_range=1"],
     "compression.kind: secure aggregation masks a dense quantised vector"),
    (["compression.kind=int8", "privacy.level=local", "privacy.noise_multiplier=1"],
     "compression.kind: under privacy.level local each client adds dense noise"),
    (["compression.download=zip"], "compression.download: must be one of ['none', 'fp16'"),
    (["compression.download=randk"], "compression.download: randk is unbiased by scaling up what it keeps"),
    (["compression.download=qsgd", "compression.kind=sign"], "compression.download: qsgd is unbiased"),
    (["compression.download=sign", "algorithm.name=feddf"], "compression.download: compresses the model a model "
                                                            "update is relative to, and feddf's round is not"),
    (["compression.download=topk", "participation.mode=async", "algorithm.name=fedbuff",
      "algorithm.buffer_size=2"],
     "compression.download: async mode sends each client the model of its own arrival"),
])
def test_bad_input_is_one_line_naming_the_key(tmp_path, capsys, overrides, message):
    from jobs.cli import main

    (tmp_path / "c.yaml").write_text(BAD)
    flags = [x for o in overrides for x in ("-o", o)]
    assert main(["run", str(tmp_path / "c.yaml"), "--quiet", "-o", f"results.root={tmp_path}", *flags]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"fedsim: error: {message}"), err


def test_the_virtual_clock_plans_the_compressed_upload(make_config):
    """Uploads are planned as the download's size encoded as one tensor: sign sends 1/32 of it, so each client's
    virtual round is shorter than the plain run's by what those bytes took."""
    cfg = make_config("compression.kind=sign")
    assert C.predicted_upload(cfg, np.array([4000.0, 0.0])).tolist() == [4 + 125, 4]

    def durations(*extra: str) -> pd.Series:
        cfg = make_config(*extra, "stragglers.enabled=true", "stragglers.deadline=none", rounds=1)
        cfg.results.run_id = "_".join(extra) or "plain"
        return load(run(cfg, LocalBackend()))["clients"].set_index("client")["virtual_duration"]

    plain, signed, fp16 = durations(), durations("compression.kind=sign"), durations("compression.kind=fp16")
    assert (signed < fp16).all() and (fp16 < plain).all()
    # (down + up) / bandwidth: fp16 saves half the upload, sign 1 − (4 + d/8)/4d of it, over the same bandwidth
    saved = (plain - fp16) / (plain - signed)
    assert np.allclose(saved, saved.iloc[0]) and 0.5 < saved.iloc[0] < 0.55


def test_a_round_without_a_model_update_is_refused_when_it_runs():
    """A method whose phases are known only once it runs (a plugin's) is checked round by round: compression on a
    round that sums no model update is a ConfigError naming the phases, not an upload silently left alone."""
    from fedsim.method.contract import Phase
    from fedsim.transforms import check_round

    cfg = load_config(None, ["compression.kind=int8"])
    check_round(cfg, [Phase("train", "sum", model_update=True), Phase("distill", "each")])
    with pytest.raises(ConfigError, match="compression.kind: compresses a model update, and fedavg's round uploads "
                                          "none \\(its phases \\['logits'\\]"):
        check_round(cfg, [Phase("logits", "sum")])
    down = load_config(None, ["compression.download=fp16"])
    check_round(down, [Phase("train", "sum", model_update=True)])
    with pytest.raises(ConfigError, match="compression.download: compresses the model a model update is relative "
                                          "to, and fedavg's round uploads none \\(its phases \\['logits'\\]"):
        check_round(down, [Phase("logits", "sum")])
