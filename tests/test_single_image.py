"""The single-image patch pool: determinism across processes, the augmentation chain against torchvision,
target channels/normalisation, and clear errors for bad image files."""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from torchvision.transforms import InterpolationMode
from torchvision.transforms.v2 import functional as TF

from fedsim.data.single_image import (
    PatchSpec,
    batched_affine,
    clear_cache,
    color_jitter,
    draw_params,
    generate_patches,
    inverse_affine,
    load_image,
    patch_pool,
)
from fedsim.errors import DataError

ROOT = Path(__file__).resolve().parents[1]
SPEC = PatchSpec(n=300, size=8, seed=3)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest()


@pytest.mark.slow  # a fresh interpreter imports torch/torchvision: ~5-10 s on 2 busy cores
def test_two_generations_are_bitwise_identical_across_processes():
    here = generate_patches(load_image("china"), SPEC)
    again = generate_patches(load_image("china"), SPEC)
    assert torch.equal(here, again)
    code = ("import hashlib, torch; torch.set_num_threads(1);"
            "from fedsim.data.single_image import PatchSpec, generate_patches, load_image;"
            "t = generate_patches(load_image('china'), PatchSpec(n=300, size=8, seed=3));"
            "print(hashlib.sha256(t.contiguous().numpy().tobytes()).hexdigest())")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT), "PATH": ""})
    assert out.stdout.strip() == _digest(here)
    other = generate_patches(load_image("china"), PatchSpec(n=300, size=8, seed=4))
    assert not torch.equal(here, other)


def test_pool_shape_channels_and_normalisation():
    clear_cache()
    pool = patch_pool("noise", SPEC, channels=1, mean=(0.3,), std=(0.5,))
    assert pool.pixels.shape == (300, 1, 8, 8) and pool.pixels.dtype == torch.uint8
    assert patch_pool("noise", SPEC, channels=1, mean=(0.3,), std=(0.5,)) is pool  # cached per process
    x = pool.take(np.array([5, 2]))
    torch.testing.assert_close(x, (pool.pixels[[5, 2]].float() / 255 - 0.3) / 0.5)
    rgb = patch_pool("noise", SPEC, channels=3, mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    gray = TF.rgb_to_grayscale(rgb.pixels.float(), 1).round().to(torch.uint8)
    assert torch.equal(gray, pool.pixels)  # 1-channel pools are the grayscale of the RGB pool
    assert rgb.take().shape == (300, 3, 8, 8)


def test_params_respect_the_chain_bounds():
    spec = PatchSpec(n=2000, size=32, seed=0)
    p = draw_params(427, 640, spec)
    side = int(0.5 * 427)
    x, y, w, h = p.boxes.T
    assert (w >= 1).all() and (w <= side).all() and (h >= 1).all() and (h <= side).all()
    assert (x >= 0).all() and (x + w <= 640).all() and (y >= 0).all() and (y + h <= 427).all()
    area = w * h / side**2
    assert area.min() < 0.01 and area.max() > 0.9  # scale (0.002, 1) is covered
    assert np.abs(p.angle).max() <= 30 and np.abs(p.shear).max() <= 30
    assert not p.flip.any()  # vertical flip is off by default, as in the paper runs
    assert 0.45 < p.jitter.mean() < 0.55
    assert spec.mid_size == 45


def test_batched_affine_matches_torchvision_per_patch():
    x = torch.rand(3, 3, 11, 11, generator=torch.Generator().manual_seed(0))
    angle, shear = np.array([17.0, -25.0, 3.0]), np.array([12.0, -28.0, 0.0])
    out = batched_affine(x, torch.from_numpy(inverse_affine(angle, shear)).float())
    for k in range(3):
        ref = TF.affine(x[k], angle=float(angle[k]), translate=[0, 0], scale=1.0, shear=[float(shear[k]), 0.0],
                        interpolation=InterpolationMode.BILINEAR)
        torch.testing.assert_close(out[k], ref, atol=1e-6, rtol=0)


def test_batched_color_jitter_matches_torchvision_ops_in_order():
    x = torch.rand(4, 3, 6, 6, generator=torch.Generator().manual_seed(1))
    factors = torch.tensor([[1.3, 0.7, 1.2, 0.05], [0.6, 1.4, 0.8, -0.1], [1.0, 1.0, 1.0, 0.0], [0.9, 1.1, 0.6, 0.08]])
    order = torch.tensor([[0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1]])
    out = color_jitter(x, factors, order)
    ops = (TF.adjust_brightness, TF.adjust_contrast, TF.adjust_saturation, TF.adjust_hue)
    for k in range(4):
        ref = x[k]
        for op in order[k].tolist():
            ref = ops[op](ref, float(factors[k, op]))
        torch.testing.assert_close(out[k], ref, atol=1e-5, rtol=0)


def test_images_and_errors(tmp_path):
    assert load_image("china").shape == (427, 640, 3)
    assert load_image("ihc").shape == (512, 512, 3)
    assert np.array_equal(load_image("noise"), load_image("noise"))
    from PIL import Image

    path = tmp_path / "gray.png"
    Image.fromarray(np.arange(64 * 80, dtype=np.uint16).reshape(64, 80).astype(np.uint8)).save(path)
    img = load_image(str(path))
    assert img.shape == (64, 80, 3) and img.dtype == np.uint8
    assert patch_pool(str(path), PatchSpec(n=10, size=8)).pixels.shape == (10, 3, 8, 8)
    with pytest.raises(DataError, match="file not found"):
        load_image(str(tmp_path / "missing.jpg"))
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not an image")
    with pytest.raises(DataError, match="cannot be read as an image"):
        load_image(str(bad))
