"""A GPU process computes deterministically, and in float32 unless runtime.tf32 asks for TF32 tensor cores: in every
process that trains or evaluates (the client workers and the server)."""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from fedsim.configure import load_config
from fedsim.runtime import server as server_module
from fedsim.runtime import worker as worker_module
from fedsim.runtime.precision import set_cuda_math
from fedsim.runtime.setup import Partition, Ragged

NAMES = (("cudnn", "allow_tf32"), ("cuda.matmul", "allow_tf32"), ("cudnn", "deterministic"), ("cudnn", "benchmark"))


def _holder(path: str):
    out = torch.backends
    for part in path.split("."):
        out = getattr(out, part)
    return out


@pytest.fixture
def flags():
    """The global flags (cuDNN TF32, matmul TF32, cuDNN deterministic, cuDNN autotuning), restored after the test."""
    before = [getattr(_holder(h), n) for h, n in NAMES]
    yield lambda: tuple(getattr(_holder(h), n) for h, n in NAMES)
    for (h, n), v in zip(NAMES, before):
        setattr(_holder(h), n, v)


def test_a_cuda_device_gets_deterministic_float32_unless_told_otherwise_and_a_cpu_one_is_left_alone(flags) -> None:
    for (h, n), v in zip(NAMES, (True, False, False, True)):  # PyTorch's defaults, and autotuning on
        setattr(_holder(h), n, v)
    set_cuda_math(torch.device("cpu"), True)
    assert flags() == (True, False, False, True)
    set_cuda_math(torch.device("cuda"), False)
    assert flags() == (False, False, True, False)
    set_cuda_math(torch.device("cuda", 0), True)
    assert flags() == (True, True, True, False)


def test_the_setting_is_off_by_default_and_reaches_the_workers_and_the_server(flags) -> None:
    assert load_config(None, []).runtime.tf32 is False
    n = 12
    x = np.zeros((n, 1, 8, 8), np.float32)
    y = (np.arange(n) % 3).astype(np.int64)
    arrays = {"x_train": x, "y_train": y, "x_test": x, "y_test": y}
    part = Partition(Ragged.from_list([np.arange(0, 6), np.arange(6, 12)]),
                     Ragged.from_list([np.array([], int)] * 2), None)
    meta = {"num_classes": 3, "mean": (0.0,), "std": (1.0,)}
    for value in (False, True):
        cfg = load_config(None, ["data.num_clients=2", "model.name=mlp", f"runtime.tf32={str(value).lower()}"])
        with mock.patch.object(worker_module, "set_cuda_math") as w, \
                mock.patch.object(server_module, "set_cuda_math") as s:
            worker_module.ClientWorker(cfg, arrays, part, meta, 0, device="cpu")
            server_module.Server(cfg, arrays, part, meta, device="cpu")
        assert w.call_args.args == (torch.device("cpu"), value)
        assert s.call_args.args == (torch.device("cpu"), value)
