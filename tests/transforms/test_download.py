"""Compressed downloads: bytes_down counted by hand (a client that sat out pays every change since, or the dense
replica), the replica recursion against a numpy re-derivation with the workers training from it, none leaving a
run as it was, the same numbers on 1 and 2 workers and after a resume, and the refusals."""

from __future__ import annotations

import copy

import numpy as np
import pandas as pd
import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import CheckpointError, ConfigError
from fedsim.persist.checkpoint import load_run_checkpoint
from fedsim.results.tables import load
from fedsim.runtime.callbacks import Callback, RoundRows
from fedsim.runtime.local import LocalBackend
from fedsim.runtime.loop import Inputs, run
from fedsim.transforms import compression as C
from fedsim.transforms.download import PREFIX, Downloads
from tests.runtime.test_loop import deterministic
from tests.transforms.test_privacy import stopped_then_resumed


def last_versions(clients: pd.DataFrame) -> list[tuple[int, int, int]]:
    """(round, client, round it last downloaded before, -1 for never) of every client row, in round order."""
    seen: dict[int, int] = {}
    out = []
    for r in sorted(clients["round"].unique()):
        now = clients[clients["round"] == r]
        for c in now["client"]:
            out.append((int(r), int(c), seen.get(int(c), -1)))
        seen.update({int(c): int(r) for c in now["client"]})
    return out


@pytest.mark.parametrize("kind, per_float", [
    ("topk", lambda d: C.kept_count(0.01, d) * (4 + C.index_bytes(d))),
    ("fp16", lambda d: 2 * d),
])
def test_bytes_down_is_each_clients_catch_up_counted_by_hand(make_config, kind, per_float):
    """Round 0 sends the dense model (M); a client that downloaded the last round pays the encoded change E; one
    that last downloaded g rounds ago pays min(g·E, M): top-k 1% pays 2E after sitting out a round, fp16 (E = M/2)
    the dense cap."""
    out = run(make_config(f"compression.download={kind}", rounds=3), LocalBackend())
    model = load_run_checkpoint(out / "checkpoints" / "last.pt")["server_state"].models["cnn"]
    dense = sum(v.numel() * v.element_size() for v in model.values())
    change = sum(per_float(v.numel()) if v.is_floating_point() else v.numel() * v.element_size()
                 for v in model.values())
    tables = load(out)
    clients = tables["clients"].set_index(["round", "client"])["bytes_down"]
    rows = last_versions(tables["clients"])
    assert any(r - v == 2 for r, _, v in rows)  # a client that sat out one round
    for r, c, v in rows:
        assert clients[(r, c)] == (dense if v < 0 else min((r - v) * change, dense)), (r, c, v)
    per_round = tables["clients"].groupby("round")["bytes_down"].sum()
    assert tables["rounds"].set_index("round")["bytes_down"].equals(per_round)
    assert tables["rounds"]["bytes_down"].iloc[-1] < 4 * dense


class Broadcasts(LocalBackend):
    """The local backend, keeping the models of every phase's broadcast the workers got."""

    def __init__(self) -> None:
        super().__init__()
        self.got: list[dict[str, torch.Tensor]] = []

    def run_phase(self, round, phase_index, phase, bc, *args, **kwargs):  # type: ignore[override]
        self.got.append(copy.deepcopy(bc.common["cnn"]))
        return super().run_phase(round, phase_index, phase, bc, *args, **kwargs)


class Models(Callback):
    """The server's model after each round."""

    def __init__(self, backend: LocalBackend) -> None:
        self.backend, self.after = backend, []

    def on_round_end(self, round: int, rows: RoundRows) -> None:
        self.after.append(copy.deepcopy(self.backend.server.get_state().models["cnn"]))


def test_the_replica_steps_by_the_decoded_change_and_the_clients_train_from_it(make_config):
    """Scaled sign: θ̂_0 = θ_0, θ̂_t = float32(θ̂_{t−1} + mean|δ|·sign(δ)) with δ = θ_t − θ̂_{t−1} in float64, θ_t the
    server's model after round t − 1; what the workers get each round is θ̂_t, not θ_t."""
    start: list[dict[str, torch.Tensor]] = []
    backend = Broadcasts()
    models = Models(backend)

    def initial(state):
        start.append(copy.deepcopy(state.models["cnn"]))
        return state

    run(make_config("compression.download=sign", rounds=3), backend, callbacks=[models],
        inputs=Inputs(initial_state=initial))
    theta = [start[0], *models.after[:-1]]  # the model each round's broadcast is built from
    held = {k: v.numpy() for k, v in theta[0].items()}
    for t, got in enumerate(backend.got):
        if t:
            for k, v in held.items():
                if not np.issubdtype(v.dtype, np.floating):
                    held[k] = theta[t][k].numpy()
                    continue
                delta = theta[t][k].numpy().astype(np.float64) - v.astype(np.float64)
                scale = np.float64(np.float32(np.abs(delta).mean()))
                held[k] = (v.astype(np.float64) + np.where(delta >= 0, scale, -scale)).astype(v.dtype)
        for k, v in held.items():
            assert np.array_equal(got[k].numpy(), v), (t, k)
        if t:  # the compression error is real: the clients' model is not the server's
            assert not all(torch.equal(got[k], theta[t][k]) for k in got)
    assert len(backend.got) == 3


def test_download_none_leaves_the_run_as_it_was(make_config):
    plain = run(make_config(rounds=2), LocalBackend())
    none = run(make_config("compression.download=none", "compression.fraction=0.5", "compression.levels=2",
                           "results.run_id=none", rounds=2), LocalBackend())
    for table in ("rounds", "clients"):
        pd.testing.assert_frame_equal(deterministic(load(plain)[table]), deterministic(load(none)[table]))
    assert not any(k.startswith(PREFIX) for k in load_run_checkpoint(none / "checkpoints" / "last.pt")["chain_state"])


def test_the_same_numbers_on_two_workers_and_after_a_resume(make_config):
    """The rotation's signs and rounding, the replica and the clients' versions do not depend on the workers, and
    come back from the checkpoint: a run stopped after round 1 and resumed gives round 2 as the whole run does."""
    cfg = make_config("compression.download=rotation", "compression.levels=4", "results.run_id=one", rounds=3)
    one = load(run(cfg, LocalBackend(num_workers=1)))
    cfg.results.run_id = "two"
    two = load(run(cfg, LocalBackend(num_workers=2)))
    pd.testing.assert_frame_equal(deterministic(one["rounds"]), deterministic(two["rounds"]))
    pd.testing.assert_frame_equal(deterministic(one["clients"]).drop(columns=["worker"]),
                                  deterministic(two["clients"]).drop(columns=["worker"]))
    pd.testing.assert_frame_equal(deterministic(stopped_then_resumed(cfg)), deterministic(one["rounds"]))


def test_a_broadcast_without_models_and_a_damaged_checkpoint_are_refused():
    cfg = load_config(None, ["compression.download=fp16"])
    down = Downloads(cfg, ["m"], 3)
    with pytest.raises(ConfigError, match="compression.download: fedavg's broadcast in phase 'train' is a list"):
        down.send([torch.zeros(2)], 0, "train", [0])
    model = {"w": torch.tensor([1.0, 2.0]), "n": torch.tensor(3)}
    common, sent, extra = down.send({"m": model, "other": torch.zeros(1)}, 0, "train", [0, 2])
    assert sent == 8 + 8 and extra == {} and torch.equal(common["m"]["w"], model["w"])
    down.synced_now([2])
    common, sent, extra = down.send({"m": {"w": torch.tensor([1.5, 2.0]), "n": torch.tensor(4)}}, 1, "train",
                                    [0, 1, 2])
    assert common["m"]["w"].tolist() == [1.5, 2.0] and sent == 2 * 2 + 8 and extra == {0: 4, 1: 4}
    restored = Downloads(cfg, ["m"], 3)
    restored.load(down.state())
    assert restored.sizes == [16, 12] and restored.synced.tolist() == [-1, -1, 0]
    assert torch.equal(restored.replica["m"]["w"], down.replica["m"]["w"])
    bad = {**down.state(), f"{PREFIX}synced": torch.tensor([0, 5, 0])}
    with pytest.raises(CheckpointError, match="compressed-download state"):
        restored.load(bad)
    with pytest.raises(CheckpointError, match="names no architecture of this run"):
        restored.load({**down.state(), f"{PREFIX}replica/x/w": torch.zeros(2)})
