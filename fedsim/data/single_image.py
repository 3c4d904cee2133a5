"""Patchification: a seeded pool of augmented patches from one image (Soni et al. 2024, after Asano & Saeed 2023).

Every worker and the server build the same pool from (image, seed) and keep it for the life of the
process, so a round only ships patch indices. Per patch, following the reference generator
(`make_single_img_dataset.py`): a random crop of `init_crop`·min(H, W); a random resized crop with area
scale (`scale_min`, 1) and aspect (3/4, 4/3) to int(√2·size) pixels, bicubic; a random affine of ±`degrees`
rotation and ±`shear` x-shear, bilinear, zero fill; an optional vertical flip; a centre crop to `size`;
colour jitter (0.4, 0.4, 0.4, 0.1) with probability 0.5. Patches are stored as uint8 (the reference writes
them to image files) and converted to the target dataset's channels and normalisation on use.

Determinism: all random parameters come from one numpy Generator seeded by `seed`; the crop+resize runs
per patch on uint8 with torchvision (integer output), the rest runs batched on the CPU in float32 and is
quantised to uint8, so two processes produce bitwise-identical pools (tests/test_single_image.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from fedsim.config.limits import MAX_ARRAY_BYTES
from fedsim.errors import ConfigError, DataError
from fedsim.persist.storage import instead_of_a_file

BUILTIN_IMAGES = ("china", "ihc", "noise")
NOISE_SHAPE = (512, 512, 3)
_CHUNK = 2048
_MAX_REDRAWS = 10_000
MAX_IMAGE_PIXELS = 100_000_000  # checked from the file's header, before it is decoded


def load_image(source: str) -> np.ndarray:
    """An H×W×3 uint8 image: `china` (scikit-learn), `ihc` (scikit-image pathology), `noise`, or a file path."""
    if source == "china":
        from sklearn.datasets import load_sample_image

        return np.ascontiguousarray(load_sample_image("china.jpg"))
    if source == "ihc":
        from skimage import data

        return np.ascontiguousarray(data.immunohistochemistry())
    if source == "noise":
        return np.random.default_rng(0).integers(0, 256, NOISE_SHAPE, dtype=np.uint8)
    path = Path(source).expanduser()
    if not path.is_file():
        found = instead_of_a_file(path) or "file not found"
        raise DataError(f"single image {source!r}: {found}; use one of {list(BUILTIN_IMAGES)} or the path of an "
                        "image file")
    return _read_image_file(source, path)


def _read_image_file(source: str, path: Path) -> np.ndarray:
    """Decode an image file to H×W×3 uint8, refusing more than MAX_IMAGE_PIXELS from the header, before decoding."""
    import re
    import struct
    import warnings
    import zlib

    from PIL import Image, UnidentifiedImageError

    limit = f"the limit is {MAX_IMAGE_PIXELS / 1e6:g} megapixels"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # MAX_IMAGE_PIXELS is checked here
        try:
            with Image.open(path) as im:
                width, height = im.size
                if width * height > MAX_IMAGE_PIXELS:
                    raise DataError(f"single image {source!r}: {width}×{height} pixels "
                                    f"({width * height / 1e6:.1f} megapixels) is too large; {limit}")
                return np.asarray(im.convert("RGB")).copy()
        except Image.DecompressionBombError as exc:  # PIL's own, larger limit fired while reading the header
            pixels = re.search(r"\((\d+) pixels\)", str(exc))
            size = f" ({int(pixels.group(1)) / 1e6:.1f} megapixels)" if pixels else ""
            raise DataError(f"single image {source!r}: the image{size} is too large; {limit}") from None
        except (UnidentifiedImageError, OSError, ValueError, SyntaxError, EOFError, IndexError, TypeError,
                struct.error, zlib.error) as exc:
            reason = " ".join(f"{type(exc).__name__}: {exc}".split())[:200]
            raise DataError(f"single image {source!r}: cannot be read as an image ({reason})") from None


def image_id(source: str) -> str:
    """A cache identity for an image source: the name, or a file's resolved path, size and mtime."""
    if source in BUILTIN_IMAGES:
        return source
    path = Path(source).expanduser()
    try:
        st = path.stat()
    except OSError:
        return str(path)
    return f"{path.resolve()}:{st.st_size}:{st.st_mtime_ns}"


@dataclass(frozen=True)
class PatchSpec:
    """The augmentation chain and pool size; together with the image it fixes the pool bit for bit."""

    n: int = 50_000
    size: int = 32
    seed: int = 0
    init_crop: float = 0.5
    scale_min: float = 0.002
    degrees: float = 30.0
    shear: float = 30.0
    jitter: tuple[float, float, float, float] = (0.4, 0.4, 0.4, 0.1)
    jitter_p: float = 0.5
    vflip: bool = False

    def __post_init__(self) -> None:
        if self.n < 1 or self.size < 1:
            raise ConfigError(f"single image pool: n and size must be >= 1, got n={self.n}, size={self.size}")
        if not (0 < self.init_crop <= 1 and 0 < self.scale_min <= 1):
            raise ConfigError("single image pool: init_crop and scale_min must be in (0, 1]")
        nbytes = self.n * 3 * self.size * self.size
        if nbytes > MAX_ARRAY_BYTES:
            raise ConfigError(f"algorithm.pool_size: {self.n} patches of {self.size}×{self.size} pixels would take "
                              f"{nbytes / 2**30:,.0f} GiB (the limit is {MAX_ARRAY_BYTES / 2**30:,.0f} GiB); "
                              "lower algorithm.pool_size or algorithm.patch_size")

    @property
    def mid_size(self) -> int:
        """Side of the resized crop before rotation: √2·size, so the centre crop cuts the black corners."""
        return max(int(math.sqrt(2) * self.size), self.size)


@dataclass
class Params:
    """Per-patch random parameters, drawn all at once from the pool's seed."""

    boxes: np.ndarray  # N × 4 (x0, y0, w, h) in source-image pixels
    angle: np.ndarray
    shear: np.ndarray
    flip: np.ndarray
    jitter: np.ndarray  # bool
    factors: np.ndarray  # N × 4: brightness, contrast, saturation, hue
    order: np.ndarray  # N × 4 permutation of the jitter ops


def draw_params(height: int, width: int, spec: PatchSpec) -> Params:
    """All random choices of the chain, vectorised; torchvision's RandomResizedCrop without its fallback."""
    rng = np.random.default_rng(spec.seed)
    n = spec.n
    side = int(spec.init_crop * min(height, width))
    if side < 1:
        raise DataError(f"single image of {height}×{width} pixels is too small for init_crop={spec.init_crop}")
    y0 = rng.integers(0, height - side + 1, n)
    x0 = rng.integers(0, width - side + 1, n)
    w = np.zeros(n, np.int64)
    h = np.zeros(n, np.int64)
    todo = np.arange(n)
    area, log_r = side * side, (math.log(3 / 4), math.log(4 / 3))
    for _ in range(_MAX_REDRAWS):  # the reference loops until a crop fits
        target = area * rng.uniform(spec.scale_min, 1.0, len(todo))
        aspect = np.exp(rng.uniform(log_r[0], log_r[1], len(todo)))
        w[todo] = np.rint(np.sqrt(target * aspect)).astype(np.int64)
        h[todo] = np.rint(np.sqrt(target / aspect)).astype(np.int64)
        ok = (w[todo] > 0) & (w[todo] <= side) & (h[todo] > 0) & (h[todo] <= side)
        todo = todo[~ok]
        if len(todo) == 0:
            break
    i = (rng.random(n) * (side - h + 1)).astype(np.int64)
    j = (rng.random(n) * (side - w + 1)).astype(np.int64)
    boxes = np.stack([x0 + j, y0 + i, w, h], axis=1)
    angle = rng.uniform(-spec.degrees, spec.degrees, n)
    shear = rng.uniform(-spec.shear, spec.shear, n) if spec.shear > 0 else np.zeros(n)
    flip = (rng.random(n) < 0.5) & spec.vflip
    jitter = rng.random(n) < spec.jitter_p
    b, c, s, hue = spec.jitter
    factors = np.stack([rng.uniform(max(0, 1 - b), 1 + b, n), rng.uniform(max(0, 1 - c), 1 + c, n),
                        rng.uniform(max(0, 1 - s), 1 + s, n), rng.uniform(-hue, hue, n)], axis=1)
    order = np.argsort(rng.random((n, 4)), axis=1)
    return Params(boxes, angle, shear, flip, jitter, factors, order)


def inverse_affine(angle: np.ndarray, shear_x: np.ndarray) -> np.ndarray:
    """N × 2 × 3 inverse matrices of rotation `angle` and x-shear (degrees), about the centre, no translation.

    Same convention as torchvision's `_get_inverse_affine_matrix` with scale 1 and y-shear 0.
    """
    rot, sx = np.radians(angle), np.radians(shear_x)
    a, b = np.cos(rot), -np.cos(rot) * np.tan(sx) - np.sin(rot)
    c, d = np.sin(rot), -np.sin(rot) * np.tan(sx) + np.cos(rot)
    det = a * d - b * c
    m = np.zeros((len(angle), 2, 3))
    m[:, 0, 0], m[:, 0, 1], m[:, 1, 0], m[:, 1, 1] = d / det, -b / det, -c / det, a / det
    return m


def batched_affine(x: torch.Tensor, theta: torch.Tensor) -> torch.Tensor:
    """Per-sample inverse affine maps (N × 2 × 3, pixel units about the centre), bilinear, zero padding."""
    n, _, h, w = x.shape
    xs = torch.linspace((1.0 - w) * 0.5, (w - 1.0) * 0.5, w, dtype=x.dtype)
    ys = torch.linspace((1.0 - h) * 0.5, (h - 1.0) * 0.5, h, dtype=x.dtype)
    base = torch.stack([xs.expand(h, w), ys[:, None].expand(h, w), torch.ones(h, w, dtype=x.dtype)], -1)
    scaled = theta.to(x.dtype).transpose(1, 2) / torch.tensor([0.5 * w, 0.5 * h], dtype=x.dtype)
    grid = base.reshape(1, h * w, 3).expand(n, -1, -1).bmm(scaled).reshape(n, h, w, 2)
    return F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)


def _tf():
    """torchvision's v2 functional ops, imported on first use: a worker that never builds a pool skips ~170 MB."""
    from torchvision.transforms.v2 import functional

    return functional


def _gray(x: torch.Tensor) -> torch.Tensor:
    return _tf().rgb_to_grayscale(x, num_output_channels=1)


def _blend(x: torch.Tensor, other: torch.Tensor, ratio: torch.Tensor) -> torch.Tensor:
    r = ratio.view(-1, 1, 1, 1).to(x.dtype)
    return (x * r + other * (1 - r)).clamp_(0, 1)


def _hue(x: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    try:
        from torchvision.transforms.v2.functional._color import _hsv_to_rgb, _rgb_to_hsv
    except ImportError:  # private helpers moved: fall back to the public per-image op
        return torch.stack([_tf().adjust_hue(img, float(s)) for img, s in zip(x, shift, strict=True)])
    hsv = _rgb_to_hsv(x)
    h, s, v = hsv.unbind(1)
    h = (h + shift.view(-1, 1, 1).to(x.dtype)).remainder(1.0)
    return _hsv_to_rgb(torch.stack((h, s, v), 1))


def color_jitter(x: torch.Tensor, factors: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """torchvision's ColorJitter with per-sample factors and op order, batched (float images in [0, 1])."""
    ops = (
        lambda t, f: (t * f.view(-1, 1, 1, 1).to(t.dtype)).clamp_(0, 1),
        lambda t, f: _blend(t, _gray(t).mean(dim=(-3, -2, -1), keepdim=True), f),
        lambda t, f: _blend(t, _gray(t), f),
        _hue,
    )
    x = x.clone()
    for pos in range(4):
        for op in range(4):
            sel = torch.nonzero(order[:, pos] == op).flatten()
            if len(sel):
                x[sel] = ops[op](x[sel], factors[sel, op])
    return x


def generate_patches(image: np.ndarray, spec: PatchSpec) -> torch.Tensor:
    """The pool as uint8 RGB N × 3 × size × size, deterministic in (image, spec).

    Runs single-threaded: the work is many tiny ops, for which extra intra-op threads only add contention
    (on a busy 2-core machine 2 threads were 10× slower than 1).
    """
    if image.ndim != 3 or image.shape[2] != 3 or image.dtype != np.uint8:
        raise DataError(f"single image: expected an H×W×3 uint8 array, got {image.dtype} {image.shape}")
    from fedsim.threads import torch_threads

    with torch_threads(1):
        return _generate(image, spec)


def _generate(image: np.ndarray, spec: PatchSpec) -> torch.Tensor:
    from torchvision.transforms import InterpolationMode

    tf = _tf()
    src = torch.from_numpy(np.ascontiguousarray(image.transpose(2, 0, 1)))
    p = draw_params(image.shape[0], image.shape[1], spec)
    mid = spec.mid_size
    theta = torch.from_numpy(inverse_affine(p.angle, p.shear)).float()
    factors = torch.from_numpy(p.factors).float()
    order = torch.from_numpy(p.order)
    out = torch.empty(spec.n, 3, spec.size, spec.size, dtype=torch.uint8)
    for start in range(0, spec.n, _CHUNK):
        stop = min(start + _CHUNK, spec.n)
        crops = torch.stack([
            tf.resize(src[:, y:y + h, x:x + w], [mid, mid], interpolation=InterpolationMode.BICUBIC, antialias=True)
            for x, y, w, h in p.boxes[start:stop].tolist()])
        t = batched_affine(crops.float() / 255.0, theta[start:stop])
        flip = torch.from_numpy(p.flip[start:stop])
        t[flip] = t[flip].flip(-2)
        t = tf.center_crop(t, [spec.size, spec.size])
        jit = torch.nonzero(torch.from_numpy(p.jitter[start:stop])).flatten()
        if len(jit):
            t[jit] = color_jitter(t[jit], factors[start:stop][jit], order[start:stop][jit])
        out[start:stop] = (t * 255.0).round_().clamp_(0, 255).to(torch.uint8)
    return out


class PatchPool:
    """A generated pool in the target dataset's channels, with its normalisation applied on use."""

    def __init__(self, pixels: torch.Tensor, mean: tuple[float, ...], std: tuple[float, ...]) -> None:
        self.pixels = pixels  # uint8 N × C × s × s
        self.mean, self.std = tuple(float(m) for m in mean), tuple(float(s) for s in std)

    def __len__(self) -> int:
        return int(self.pixels.shape[0])

    def take(self, indices: torch.Tensor | np.ndarray | None = None,
             device: torch.device | str = "cpu") -> torch.Tensor:
        """Normalised float32 patches at `indices` (all when None), on `device`."""
        px = self.pixels if indices is None else self.pixels[torch.as_tensor(indices, dtype=torch.long)]
        x = px.to(device).float().div_(255.0)
        if not self.mean:
            return x
        mean = torch.tensor(self.mean, device=x.device).view(-1, 1, 1)
        std = torch.tensor(self.std, device=x.device).view(-1, 1, 1)
        return x.sub_(mean).div_(std)


_CACHE: dict[tuple, PatchPool] = {}


def patch_pool(source: str, spec: PatchSpec, channels: int = 3, mean: tuple[float, ...] = (),
               std: tuple[float, ...] = ()) -> PatchPool:
    """The process-wide pool for (image, spec, channels, normalisation): generated once, then reused."""
    if channels not in (1, 3):
        raise ConfigError(f"single image pool: datasets with {channels} channels are not supported (1 or 3)")
    if mean and (len(mean) != channels or len(std) != channels):
        raise ConfigError(f"single image pool: mean/std have {len(mean)} entries for {channels} channels")
    key = (image_id(source), spec, channels, tuple(mean), tuple(std))
    if key not in _CACHE:
        px = generate_patches(load_image(source), spec)
        if channels == 1:
            px = (_gray(px.float()).round_().clamp_(0, 255)).to(torch.uint8)
        _CACHE[key] = PatchPool(px, mean, std)
    return _CACHE[key]


def clear_cache() -> None:
    """Drop every cached pool (tests, or to free memory)."""
    _CACHE.clear()

