"""How a process that trains or evaluates on a GPU computes: deterministic cuDNN algorithms, and float32 or TF32.

Deterministic by default means the same numbers from the same config and seed. cuDNN may otherwise pick
convolution algorithms that add in a varying order (measured on an H100: two runs of one config parted at round
4). PyTorch also lets cuDNN convolutions use TF32 tensor cores by default; their 10-bit mantissas make a GPU run
differ from the CPU's, and batched from one-after-another training, by far more than float32 rounding, so fedsim
turns them off unless the config asks for them (runtime.tf32)."""

from __future__ import annotations

import torch


def set_cuda_math(device: torch.device, tf32: bool) -> None:
    """For this process's CUDA work: deterministic cuDNN algorithms (no autotuning), and TF32 for convolutions and
    matrix products only when `tf32`. Nothing on a CPU device."""
    if device.type != "cuda":
        return
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False
    torch.backends.cudnn.allow_tf32 = tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
