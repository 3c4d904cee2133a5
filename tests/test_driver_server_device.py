"""Where the Ray driver's own server computes: its GPU only when the run's clients train on GPUs and it may use one."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import ray
import torch

from actors import pool


@pytest.fixture
def driver(monkeypatch):
    """A driver process (not inside a Ray actor) whose GPU works, whatever this machine has; tests change what they
    need."""
    monkeypatch.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_actor_id=lambda: None))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_zeros = torch.zeros
    monkeypatch.setattr(torch, "zeros", lambda *a, **kw: real_zeros(*a, **{**kw, "device": "cpu"}))
    return monkeypatch


def test_a_run_without_gpu_clients_keeps_the_server_on_the_cpu(driver):
    assert pool.driver_server_device(0.0) == "cpu"
    assert pool.driver_server_device(0.25) == "cuda"


def test_no_gpu_or_an_unusable_one_leaves_it_on_the_cpu_with_one_warning(driver, caplog):
    driver.setattr(torch.cuda, "is_available", lambda: False)
    assert pool.driver_server_device(0.5) == "cpu"
    driver.setattr(torch.cuda, "is_available", lambda: True)

    def busy(*args, **kwargs):
        raise RuntimeError("CUDA error: all CUDA-capable devices are busy or unavailable\nmore")

    driver.setattr(torch, "zeros", busy)
    with caplog.at_level(logging.WARNING):
        assert pool.driver_server_device(0.5) == "cpu"
    assert [r.getMessage() for r in caplog.records] == [
        "the driver's server evaluates on the CPU: its GPU cannot be used (RuntimeError: CUDA error: all "
        "CUDA-capable devices are busy or unavailable)"]


def test_a_driver_inside_a_ray_trial_takes_a_gpu_only_when_ray_gave_it_one(driver):
    driver.setattr(ray, "get_runtime_context", lambda: SimpleNamespace(get_actor_id=lambda: "a1" * 16))
    driver.setattr(ray, "get_gpu_ids", lambda: [])
    assert pool.driver_server_device(0.5) == "cpu"  # a trial without a GPU of its own sees them all: not its to use
    driver.setattr(ray, "get_gpu_ids", lambda: ["1"])
    assert pool.driver_server_device(0.5) == "cuda"
