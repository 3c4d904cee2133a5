"""Local training: loading a client's start weights (the same result as load_state_dict), and how many batches a
number of epochs or steps draws."""

from __future__ import annotations

import pytest
import torch

from fedsim.models import build_model
from fedsim.training.local import load_weights


def _models(name: str) -> tuple[torch.nn.Module, torch.nn.Module, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    target, reference = build_model(name, 3, 10, 32), build_model(name, 3, 10, 32)
    reference.load_state_dict(target.state_dict())
    torch.manual_seed(1)
    start = {k: (v.double() if v.is_floating_point() else v + 3) for k, v in build_model(name, 3, 10, 32)
             .state_dict().items()}  # other values, some of another dtype, as load_state_dict accepts
    return target, reference, start


@pytest.mark.parametrize("name", ["mlp", "resnet8"])
def test_load_weights_copies_into_the_models_own_tensors_as_load_state_dict_does(name: str) -> None:
    target, reference, start = _models(name)
    storage = {k: v.data_ptr() for k, v in target.state_dict().items()}
    views = load_weights(target, start)
    reference.load_state_dict(start)
    got, want = target.state_dict(), reference.state_dict()
    assert got.keys() == want.keys() == views.keys()
    assert all(torch.equal(got[k], want[k]) and got[k].dtype == want[k].dtype for k in want)
    assert {k: v.data_ptr() for k, v in got.items()} == storage  # the model's tensors, not new ones
    first = next(iter(target.parameters()))
    with torch.no_grad():
        first.add_(1.0)
    assert torch.equal(views[next(iter(views))], first)  # the returned state dict sees later training


def test_load_weights_leaves_anything_but_a_plain_copy_to_load_state_dict() -> None:
    target, _, start = _models("mlp")
    missing = dict(list(start.items())[1:])
    with pytest.raises(RuntimeError, match="Missing key"):
        load_weights(target, missing)
    wrong = {**start, "fc.bias": torch.zeros(11)}
    with pytest.raises(RuntimeError, match="size mismatch"):
        load_weights(target, wrong)
    seen: list[str] = []
    target.fc.register_load_state_dict_pre_hook(lambda module, state, prefix, *rest: seen.append(prefix))
    load_weights(target, start)
    assert seen == ["fc."] and torch.equal(target.fc.bias, start["fc.bias"].float())


def test_a_gpu_clients_loss_total_and_finite_check_wait_once_with_the_same_answers() -> None:
    """On a GPU, train_classifier keeps its loss total on the device and check_finite sums all weights before
    reading one number; run here on CPU tensors, both give what the per-step and per-tensor reads give."""
    from fedsim.training.local import all_finite_at_once
    from fedsim.training.train import LossTotal

    g = torch.Generator().manual_seed(5)
    losses = [torch.rand((), generator=g) * 10 ** float(torch.randint(-3, 3, (1,), generator=g)) for _ in range(40)]
    sizes = [int(n) for n in torch.randint(1, 33, (40,), generator=g)]
    kept, read = LossTotal(torch.device("cpu"), on_device=True), LossTotal(torch.device("cpu"))
    assert kept.on_device and not read.on_device
    for loss, n in zip(losses, sizes):
        kept.add(loss, n)
        read.add(loss, n)
    assert kept.value() == read.value() and isinstance(kept.value(), float)
    weights = [torch.randn(30, generator=g), torch.randn(4, 3, generator=g).double()]
    assert all_finite_at_once(weights)
    for bad in (float("nan"), float("inf"), -float("inf")):
        broken = [weights[0].clone(), weights[1]]
        broken[0][7] = bad
        assert not all_finite_at_once(broken)
    huge = torch.full((4,), 3e38)  # finite entries whose float32 sum overflows: not all finite "at once"
    assert not all_finite_at_once([huge]) and bool(torch.isfinite(huge).all())


def test_zero_epochs_draw_no_batch_and_each_epoch_a_full_pass() -> None:
    from fedsim.training.train import batch_indices

    g = torch.Generator().manual_seed(0)
    assert list(batch_indices(10, 3, g, epochs=0)) == []
    two = [b.tolist() for b in batch_indices(10, 3, g, epochs=2)]
    assert [len(b) for b in two] == [3, 3, 3, 1] * 2 and sorted(sum(two[:4], [])) == list(range(10))
    assert len(list(batch_indices(10, 3, g, epochs=0, steps=5))) == 5  # steps, when set, win


def test_a_run_with_zero_local_epochs_trains_nothing(make_config) -> None:
    """train.epochs: 0 (allowed) means no local step: every client reports 0 steps and FedAvg's model stays put."""
    from fedsim.results.tables import load
    from fedsim.runtime.local import LocalBackend
    from fedsim.runtime.loop import run

    tables = load(run(make_config("train.epochs=0", rounds=2), LocalBackend(num_workers=1)))
    assert (tables["clients"]["steps"] == 0).all()
    accuracy, loss = tables["rounds"]["accuracy"].tolist(), tables["rounds"]["loss"].tolist()
    assert accuracy[0] == accuracy[1] and loss[0] == loss[1]
