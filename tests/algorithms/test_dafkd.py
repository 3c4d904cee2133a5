"""DaFKD: α̂ by hand, the personal domain head across absent rounds, App. B's bitwise-equal distillation sets,
byte accounting, stragglers, and the A5/Table 3 switches. Tiny ResNet11 (width 2) on digits, CPU."""

from __future__ import annotations

import math

import pytest
import torch

from fedsim.configure import load_config
from fedsim.errors import ConfigError
from fedsim.method.contract import ClientResult, RoundInfo
from fedsim.models.dafkd_nets import DomainHead
from fedsim.runtime.server import Server
from fedsim.runtime.setup import load_data, make_partition
from fedsim.runtime.store import state_nbytes
from fedsim.runtime.worker import ClientWorker

TINY = ["algorithm.name=dafkd", "data.name=digits", "data.num_clients=4", "data.partition.alpha=1.0",
        "model.name=resnet11", "model.options={width: 2}", "train.optimizer=adam", "train.lr=0.001",
        "train.steps=2", "train.batch_size=32", "algorithm.gen_width=4", "algorithm.noise_dim=8",
        "algorithm.distill_size=40", "algorithm.distill.batch_size=16", "algorithm.distill.epochs=1"]


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny models: one torch thread is fastest, and far faster than two on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def setup(*overrides: str) -> tuple[Server, ClientWorker]:
    cfg = load_config(None, TINY + list(overrides))
    data = load_data(cfg)
    part = make_partition(cfg, data)
    arrays = {"x_train": data.x_train, "y_train": data.y_train, "x_test": data.x_test, "y_test": data.y_test}
    meta = {"num_classes": data.num_classes, "mean": tuple(data.mean), "std": tuple(data.std)}
    return (Server(cfg, arrays, part, meta, device="cpu"),
            ClientWorker(cfg, arrays, part, meta, 0, device="cpu", threads=None))


def run_round(server: Server, worker: ClientWorker, r: int, clients: list[int], late: list[int] | None = None):
    """One round through the real server and worker objects; returns the replies of every phase."""
    late = late or []
    arrived = [c for c in clients if c not in late]
    replies = []
    for pi, phase in enumerate(server.phases(r)):
        info = RoundInfo(r, phase.name, clients, arrived, {c: 1 for c in clients})
        bc = server.broadcast(phase, info).broadcast
        reply = worker.run_phase(r, pi, phase, bc.common, {}, arrived + (late if pi == 0 else []), late)
        assert all(o.status in ("ok", "late") for o in reply.outcomes), [o.error for o in reply.outcomes]
        server.step(phase, [reply], info)
        replies.append(reply)
    return replies


def fixed_scores(algo, values: dict[int, tuple[torch.Tensor, torch.Tensor]]):
    """Replace the networks' scoring by preset (logits, f) per client, keyed by the uploaded head bias."""
    algo.score = lambda model, head, disc, x: values[int(head.fc.bias.item())]


def fake_updates(server: Server, clients: list[int]) -> dict[int, ClientResult]:
    """Uploads with the global weights, each head's bias set to the client id (so fixed_scores finds it)."""
    model = server.state.models["resnet11"]
    out = {}
    for c in clients:
        head = DomainHead(32)
        torch.nn.init.constant_(head.fc.bias, float(c))
        out[c] = ClientResult({"model": model, "generator": server.state.generator, "head": head.state_dict()})
    return out


def test_alpha_and_teacher_match_a_hand_computation() -> None:
    """K=2 clients, N=2 samples, C=2 classes. f_1 = (0.6, 0.2), f_2 = (0.2, 0.6), so
    α̂_1 = (0.75, 0.25), α̂_2 = (0.25, 0.75). With s_1 = ((.8,.2), (.5,.5)) and s_2 = ((.4,.6), (.1,.9)):
    teacher_0 = .75·(.8,.2) + .25·(.4,.6) = (.7, .3);  teacher_1 = .25·(.5,.5) + .75·(.1,.9) = (.2, .8).
    App. B gets the same from Σ_k f_k·s_k / Σ_k f_k; without correlation it is the plain mean."""
    server, _ = setup()
    algo = server.algorithm
    s1, s2 = torch.tensor([[.8, .2], [.5, .5]]), torch.tensor([[.4, .6], [.1, .9]])
    f1, f2 = torch.tensor([.6, .2]), torch.tensor([.2, .6])
    fixed_scores(algo, {1: (s1.log(), f1), 2: (s2.log(), f2)})
    expected = torch.tensor([[.7, .3], [.2, .8]])
    teacher, m = algo.teacher_from_models(fake_updates(server, [1, 2]), torch.zeros(2, 1, 8, 8))
    torch.testing.assert_close(teacher, expected)
    assert m["mech_alpha_max_mean"] == pytest.approx(0.75)
    app_b = {1: ClientResult({"weighted": f1[:, None] * s1, "f": f1}), 2: ClientResult({"weighted": f2[:, None] * s2,
                                                                                       "f": f2})}
    torch.testing.assert_close(algo.teacher_from_scores(app_b)[0], expected)
    algo.params.correlation = False
    torch.testing.assert_close(algo.teacher_from_models(fake_updates(server, [1, 2]), torch.zeros(2, 1, 8, 8))[0],
                               (s1 + s2) / 2)


def test_dropped_straggler_changes_the_normaliser_not_the_validity() -> None:
    """Client 2 is late: α̂ is renormalised over {1, 3}, so client 1's weight rises from f_1/(f_1+f_2+f_3)
    to f_1/(f_1+f_3); the teacher is still a distribution and the distilled model is finite."""
    server, worker = setup()
    algo = server.algorithm
    f = {1: torch.tensor([.5, .1]), 2: torch.tensor([.3, .3]), 3: torch.tensor([.2, .6])}
    s = {c: torch.tensor([[.9, .1], [.3, .7]]) if c != 3 else torch.tensor([[.2, .8], [.6, .4]]) for c in f}
    fixed_scores(algo, {c: (s[c].log(), f[c]) for c in f})
    all3 = algo.teacher_from_models(fake_updates(server, [1, 2, 3]), torch.zeros(2, 1, 8, 8))[0]
    two = algo.teacher_from_models(fake_updates(server, [1, 3]), torch.zeros(2, 1, 8, 8))[0]
    a1 = f[1] / (f[1] + f[3])
    torch.testing.assert_close(two, a1[:, None] * s[1] + (1 - a1)[:, None] * s[3])
    assert not torch.allclose(two, all3)
    torch.testing.assert_close(two.sum(1), torch.ones(2))

    server, worker = setup()  # the real flow: client 2 trains but arrives late
    before = {k: v.clone() for k, v in server.state.generator.items()}
    (reply,) = run_round(server, worker, 0, [1, 2, 3], late=[2])
    ok = {o.client_id: o.result for o in reply.outcomes if o.status == "ok"}
    assert sorted(ok) == [1, 3] and 2 not in worker.store and 1 in worker.store and 3 in worker.store
    mean_gen = {k: ((ok[1].payload["generator"][k].double() + ok[3].payload["generator"][k].double()) / 2)
                .to(v.dtype) for k, v in before.items()}
    for k, v in server.state.generator.items():
        assert torch.equal(v, mean_gen[k]), k
    assert all(torch.isfinite(v.float()).all() for v in server.state.models["resnet11"].values())
    (row,) = server.evaluate().rows
    assert 0.0 <= row["accuracy"] <= 1.0 and math.isfinite(row["loss"])


def test_personal_head_persists_over_rounds_the_client_misses() -> None:
    """Client 0 trains in round 0, is absent in round 1, and in round 2 starts from exactly the head it
    stored in round 0, not from a fresh one; the worker's store keeps it untouched meanwhile."""
    server, worker = setup()
    seen: dict[tuple[int, int], dict] = {}
    train = worker.algorithm.local_train

    def spy(model, head, disc, gen, ctx):
        seen[(ctx.round, ctx.client_id)] = {k: v.clone() for k, v in head.state_dict().items()}
        return train(model, head, disc, gen, ctx)

    worker.algorithm.local_train = spy
    run_round(server, worker, 0, [0, 1])
    after0 = {k: v.clone() for k, v in worker.store.get(0)["head"].items()}
    assert not torch.equal(after0["fc.weight"], seen[(0, 0)]["fc.weight"])  # it trained
    run_round(server, worker, 1, [1, 2])
    assert all(torch.equal(worker.store.get(0)["head"][k], after0[k]) for k in after0)
    run_round(server, worker, 2, [0, 3])
    assert all(torch.equal(seen[(2, 0)][k], after0[k]) for k in after0)
    assert not torch.equal(seen[(2, 3)]["fc.weight"], after0["fc.weight"])


@pytest.mark.parametrize("distill_from", ["aggregated", "start"])
def test_app_b_distillation_sets_are_bitwise_equal_on_server_and_clients(distill_from: str) -> None:
    """App. B: every client regenerates D̂_g from the broadcast generator and seed; the server's set is the
    same bits. 'aggregated' needs a second phase after aggregation, 'start' (code) rides on the train phase."""
    server, worker = setup("algorithm.upload=scores", f"algorithm.distill_from={distill_from}")
    assert [p.name for p in server.phases(0)] == (["train", "score"] if distill_from == "aggregated" else ["train"])
    sets: dict[str, list[torch.Tensor]] = {"client": [], "server": []}
    for side, algo in (("client", worker.algorithm), ("server", server.algorithm)):
        original = algo.distill_set
        algo.distill_set = lambda gen, seed, o=original, s=side: sets[s].append(o(gen, seed)) or sets[s][-1]
    replies = run_round(server, worker, 0, [0, 1, 2])
    assert len(sets["client"]) == 3 and len(sets["server"]) == 1
    assert all(torch.equal(x, sets["server"][0]) for x in sets["client"])
    uploaded = {k for reply in replies for o in reply.outcomes for k in o.result.payload}
    assert uploaded == {"model", "generator", "weighted", "f"}  # no discriminator head goes up


def test_byte_accounting_shows_what_each_mode_uploads() -> None:
    """Main text: classifier + generator + domain head (33 floats at width 2). App. B: classifier + generator,
    then |D̂_g|·(C + 1) floats of f·s and f; the discriminator never leaves the client."""
    server, worker = setup()
    (main,) = run_round(server, worker, 0, [0])
    model_b = state_nbytes(server.state.models["resnet11"])
    gen_b = state_nbytes(server.state.generator)
    assert main.outcomes[0].bytes_up == model_b + gen_b + 33 * 4
    server, worker = setup("algorithm.upload=scores")
    train, score = run_round(server, worker, 0, [0])
    assert train.outcomes[0].bytes_up == model_b + gen_b
    assert score.outcomes[0].bytes_up == 40 * (10 + 1) * 4
    assert "pending" not in worker.store.get(0)  # the round's trained model is dropped after scoring


def test_no_sharing_keeps_a_personal_discriminator_network() -> None:
    server, worker = setup("algorithm.sharing=false")
    (reply,) = run_round(server, worker, 0, [0])
    state = worker.store.get(0)
    assert set(state) == {"head", "disc"} and "disc" in reply.outcomes[0].result.payload
    assert any(not torch.equal(state["disc"][k], reply.outcomes[0].result.payload["model"][k])
               for k in state["disc"] if k.startswith("trunk") and state["disc"][k].is_floating_point())


def test_code_schedule_freezes_discriminator_and_generator_after_the_early_rounds() -> None:
    """A5 with the code's values: no D loss from round 3, no G update from round 5 (alternating, λ_gp 0.3)."""
    server, worker = setup("algorithm.schedule=alternating", "algorithm.disc_rounds=3", "algorithm.gen_rounds=5",
                           "algorithm.gp_weight=0.3", "algorithm.generator=conditional")
    train = server.algorithm.phases(0)[0]
    bc = server.broadcast(train, RoundInfo(0, "train", [0], [0], {0: 1})).broadcast
    early = worker.run_phase(0, 0, train, bc.common, {}, [0]).outcomes[0]
    late = worker.run_phase(5, 0, train, bc.common, {}, [1]).outcomes[0]
    assert {"d_loss", "g_loss"} <= set(early.result.metrics) and early.status == "ok"
    assert not {"d_loss", "g_loss"} & set(late.result.metrics)
    assert all(torch.equal(late.result.payload["generator"][k], v) for k, v in bc.common["generator"].items())


def test_bad_choices_name_the_key() -> None:
    with pytest.raises(ConfigError, match="algorithm.mix"):
        load_config(None, TINY + ["algorithm.mix=average"])
    with pytest.raises(ConfigError, match="algorithm.generator: dcgan needs an even image size"):
        setup("data.options={size: 9}")


def test_end_to_end_app_b_run_records_both_phases(tmp_path) -> None:
    """Two rounds through the local runtime: per-phase metrics, the logged seed and the bytes land in the tables."""
    from fedsim.results.tables import load
    from fedsim.runtime.loop import run

    cfg = load_config(None, TINY + ["rounds=2", "participation.clients_per_round=3", "algorithm.upload=scores",
                                    "runtime.backend=local", f"results.root={tmp_path}", "results.checkpoint_every=0"])
    tables = load(run(cfg))
    rounds, clients = tables["rounds"], tables["clients"]
    assert list(rounds["round"]) == [0, 1] and rounds["accuracy"].between(0, 1).all()
    assert rounds["score/distill_seed"].tolist() == rounds["train/distill_seed"].tolist()
    assert rounds["score/distill_steps"].tolist() == [3.0, 3.0]
    score_up = clients.loc[clients["phase"] == "score", "bytes_up"]
    assert (score_up == 40 * 11 * 4).all() and len(score_up) == 6


def test_warmup_rounds_only_average_and_the_state_checkpoints(tmp_path) -> None:
    """distill_from_round=1 (code): round 0 is one phase of plain averaging, round 1 has the App. B score
    phase; the server state survives a weights_only checkpoint."""
    from fedsim.algorithms.dafkd import DaFKDState
    from fedsim.method.aggregate import weighted_average
    from fedsim.persist.checkpoint import load_checkpoint, save_checkpoint

    server, worker = setup("algorithm.upload=scores", "algorithm.distill_from_round=1")
    assert [p.name for p in server.phases(0)] == ["train"] and len(server.phases(1)) == 2
    (reply,) = run_round(server, worker, 0, [0, 2])
    assert set(reply.outcomes[0].result.payload) == {"model", "generator"} and "pending" not in worker.store.get(0)
    mean = weighted_average({o.client_id: o.result.payload["model"] for o in reply.outcomes}, {0: 1.0, 2: 1.0})
    assert all(torch.equal(server.state.models["resnet11"][k], v) for k, v in mean.items())
    save_checkpoint(tmp_path / "ck.pt", {"state": server.state})
    back = load_checkpoint(tmp_path / "ck.pt")["state"]
    assert isinstance(back, DaFKDState) and back.pending == {}
    assert all(torch.equal(back.generator[k], v) for k, v in server.state.generator.items())


def test_generated_batches_leave_the_batchnorm_statistics_of_real_data() -> None:
    """One local step (D loss on, BatchNorm trunk): the running statistics come from the real batch alone,
    so they are the same bits whatever the generator draws; before the fix, fakes pulled them along."""
    stats = []
    for shift in (-50.0, 50.0):
        server, worker = setup("train.steps=1", "algorithm.gp_weight=0.3")
        sample = worker.algorithm.new_generator().sample

        def shifted(n, rng, s=shift, sample=sample):
            return sample(n, rng) + s

        gen = worker.models.get("dafkd/generator", build=worker.algorithm.new_generator)
        gen.sample = shifted
        (reply,) = run_round(server, worker, 0, [0])
        stats.append({k: v for k, v in reply.outcomes[0].result.payload["model"].items() if "running" in k})
    assert stats[0] and all(torch.equal(stats[0][k], stats[1][k]) for k in stats[0])


def test_distillation_defaults_to_sgd_at_the_papers_rate() -> None:
    server, _ = setup()
    d = server.algorithm.params.distill
    assert (d.optimizer, d.lr) == ("sgd", 0.01)
