"""Attacks as pure functions: the updates malicious clients send (model poisoning) and what they do to their own
data (data poisoning). The runtime decides who attacks, when, and what each attack may read.

Model poisoning works on model UPDATES Δ = upload − broadcast model, flattened to rows in float64, which the server
ADDS to the model. Papers that state a rule on gradients (descent subtracts them; Δ = −lr·g) are converted to the
equivalent rule on updates, and each function says so: a gradient-space μ − zσ is μ + zσ on updates, a perturbation
computed from the mean (unit vector, sign) keeps its form μ − γp with p taken from the mean update, and the
std perturbation flips sign.

Data poisoning works on what fedsim.data stores: normalised float N×C×H×W images, normalised per channel with the
Dataset's `mean`/`std`, and integer labels. Trigger values are given before normalisation, in the space `mean`/`std`
describe: every built-in image set is scaled to [0, 1] first (pixels / 255, digits / 16), so the brightest pixel
is 1.0 there.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from statistics import NormalDist

import torch

MODEL_ATTACKS = ("sign_flip", "gaussian", "scaling", "alie", "min_max", "min_sum", "ipm")
PERTURBATIONS = ("unit_vec", "sign", "std")

Stats = Sequence[float] | torch.Tensor


# ---------------------------------------------------------------- model poisoning


def craft(kind: str, own: torch.Tensor, reference: torch.Tensor, n: int, *, scale: float | None = None,
          sigma: float = 1.0, z: float | None = None, perturbation: str = "std", epsilon: float = 0.1,
          generator: torch.Generator | None = None) -> tuple[torch.Tensor, dict[str, float]]:
    """The (a, d) float64 updates the a attackers send this round, and the attack's diagnostics (floats).

    `own`: the attackers' own honest updates, (a, d), in client-id order. `reference`: the (b, d) benign updates the
    attack may read (every honest update of the round, or the attackers' own: the caller decides). `n`: how many
    clients' updates the round aggregates, benign and malicious. With no attacker (a = 0) the result is (0, d) and
    the diagnostics empty. Unknown kinds and missing or invalid arguments are a one-line ValueError.
    """
    if kind not in MODEL_ATTACKS:
        raise ValueError(f"unknown attack {kind!r}; choose one of {', '.join(MODEL_ATTACKS)}")
    own, reference = _rows(own, "own"), _rows(reference, "reference")
    a, d = own.shape
    if reference.shape[1] != d:
        raise ValueError(f"reference has {reference.shape[1]} columns, own has {d}: both must be flat updates")
    if n < max(a, 1):
        raise ValueError(f"n = {n} clients in the round cannot hold {a} attackers")
    if a == 0:
        return own.clone(), {}
    if kind == "sign_flip":
        c = 1.0 if scale is None else float(scale)
        return -c * own, {"attack/scale": c}
    if kind == "gaussian":
        return _gaussian(a, d, sigma, generator, own.device), {"attack/sigma": float(sigma)}
    if kind == "scaling":
        gamma = n / a if scale is None else float(scale)
        return gamma * own, {"attack/scale": gamma}
    if kind == "alie":
        return _alie(reference, a, n, z)
    if kind == "ipm":
        if reference.shape[0] < 1:
            raise ValueError("ipm needs at least one reference update")
        return (-epsilon * reference.mean(0)).expand(a, d).clone(), {"attack/epsilon": float(epsilon)}
    return _min_max_sum(kind, reference, a, perturbation)


def _rows(x: torch.Tensor, name: str) -> torch.Tensor:
    """`x` as a float64 matrix of flat updates, or a ValueError."""
    if not isinstance(x, torch.Tensor) or x.ndim != 2 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"{name} must be a 2-d floating-point tensor of flat updates, got {shape}")
    return x.to(torch.float64)


def _gaussian(a: int, d: int, sigma: float, generator: torch.Generator | None,
              device: torch.device) -> torch.Tensor:
    """Rows N(0, σ²) drawn one after another from `generator`: row i is the same whatever a is."""
    if generator is None:
        raise ValueError("gaussian needs a generator (the attackers' named random stream)")
    if not sigma >= 0:
        raise ValueError(f"gaussian: sigma must be >= 0, got {sigma}")
    rows = [torch.randn(d, generator=generator, dtype=torch.float64, device=generator.device) for _ in range(a)]
    return (sigma * torch.stack(rows)).to(device)


def alie_z(n: int, a: int) -> float:
    """ALIE's z_max (Baruch et al. 2019): s = ⌊n/2 + 1⌋ − a benign supporters are needed for a majority, and z is
    Φ^{-1}((n − s)/n). When the attackers are a majority already (s ≤ 0, where the formula's z is infinite) s is
    taken as 1, the largest finite value; a probability at or below 1/2 (n ≤ 2) gives z = 0."""
    supporters = max(math.floor(n / 2 + 1) - a, 1)
    p = (n - supporters) / n
    return NormalDist().inv_cdf(p) if p > 0.5 else 0.0


def _alie(reference: torch.Tensor, a: int, n: int, z: float | None) -> tuple[torch.Tensor, dict[str, float]]:
    """μ + z·σ per coordinate (the update-space form of the paper's μ − zσ on gradients), σ the unbiased std."""
    if reference.shape[0] < 2:
        raise ValueError(f"alie needs at least 2 reference updates for a std, got {reference.shape[0]}")
    zz = alie_z(n, a) if z is None else float(z)
    mu, sd = reference.mean(0), reference.std(0, unbiased=True)
    return (mu + zz * sd).expand(a, -1).clone(), {"attack/z": zz}


def _perturbation(kind: str, reference: torch.Tensor) -> torch.Tensor:
    """The direction p of m(γ) = μ − γp, in update space: μ/‖μ‖ (0 when μ = 0), sign(μ), or −σ (unbiased std; the
    paper's +σ on gradients)."""
    mu = reference.mean(0)
    if kind == "unit_vec":
        norm = torch.linalg.vector_norm(mu)
        return mu / norm if norm > 0 else torch.zeros_like(mu)
    if kind == "sign":
        return torch.sign(mu)
    if kind == "std":
        if reference.shape[0] < 2:
            raise ValueError(f"perturbation 'std' needs at least 2 reference updates, got {reference.shape[0]}")
        return -reference.std(0, unbiased=True)
    raise ValueError(f"unknown perturbation {kind!r}; choose one of {', '.join(PERTURBATIONS)}")


def squared_distances(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """‖x_i − y_j‖² for every pair of rows, exactly (row differences, not the Gram expansion, which cancels)."""
    return torch.stack([(x - row).pow(2).sum(1) for row in y], dim=1) if len(y) else x.new_zeros(len(x), 0)


def _min_max_sum(kind: str, reference: torch.Tensor, a: int,
                 perturbation: str) -> tuple[torch.Tensor, dict[str, float]]:
    """Shejwalkar & Houmansadr (NDSS 2021): the largest γ the paper's halving search finds with m(γ) = μ − γp no
    farther from the benign updates than they are from each other. Min-max: max_i ‖m − v_i‖² ≤ max_{i,j}
    ‖v_i − v_j‖²; min-sum: Σ_i ‖m − v_i‖² ≤ min_i Σ_j ‖v_i − v_j‖². The search starts at γ = 10 with step 10 and
    stops when a step moves γ less than 1e-5, so γ < 20; if no γ passes, γ = 0 and m = μ."""
    if reference.shape[0] < 1:
        raise ValueError(f"{kind} needs at least one reference update")
    mu, p = reference.mean(0), _perturbation(perturbation, reference)
    pairwise = squared_distances(reference, reference)
    bound = pairwise.max() if kind == "min_max" else pairwise.sum(1).min()

    def holds(gamma: float) -> bool:
        dist = (reference - (mu - gamma * p)).pow(2).sum(1)
        return bool((dist.max() if kind == "min_max" else dist.sum()) <= bound)

    gamma, step, gamma_succ = 10.0, 10.0, 0.0
    while abs(gamma_succ - gamma) > 1e-5:
        if holds(gamma):
            gamma_succ = gamma
            gamma += step / 2
        else:
            gamma -= step / 2
        step /= 2
    return (mu - gamma_succ * p).expand(a, -1).clone(), {"attack/gamma": gamma_succ}


# ---------------------------------------------------------------- data poisoning


def flip_labels(y: torch.Tensor, num_classes: int) -> torch.Tensor:
    """l → C − 1 − l (as BRO's label flipping, 9 − l for 10 classes), as a new tensor."""
    if y.is_floating_point() or y.is_complex():
        raise ValueError(f"labels must be integers, got {y.dtype}")
    if num_classes < 1 or (y.numel() and (int(y.min()) < 0 or int(y.max()) >= num_classes)):
        raise ValueError(f"labels must lie in 0..{num_classes - 1}")
    return num_classes - 1 - y


def add_trigger(x: torch.Tensor, size: int, value: float, mean: Stats, std: Stats) -> torch.Tensor:
    """`x` (normalised N×C×H×W images, as fedsim.data stores them) with a size×size square in the bottom-right
    corner of every channel set to `value` before normalisation, i.e. (value − mean_c) / std_c; a new tensor.
    `mean`/`std`: the Dataset's, one value per channel or one for all. A shape that cannot carry a square patch
    (flat rows, token ids, a patch larger than the image) is a ValueError."""
    if not isinstance(x, torch.Tensor) or x.ndim != 4 or not x.is_floating_point():
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise ValueError(f"a trigger needs normalised float N×C×H×W images, got {shape}")
    channels, height, width = x.shape[1:]
    if not 1 <= size <= min(height, width):
        raise ValueError(f"trigger size must be in 1..{min(height, width)} for {height}×{width} images, got {size}")
    m, s = _stats(mean, "mean", channels), _stats(std, "std", channels)
    if not bool((s > 0).all()):
        raise ValueError("trigger: every std must be > 0")
    patch = ((value - m) / s).to(x.dtype).to(x.device)
    out = x.clone()
    out[:, :, height - size:, width - size:] = patch.view(1, -1, 1, 1)
    return out


def _stats(values: Stats, name: str, channels: int) -> torch.Tensor:
    """Per-channel statistics as a float64 vector of length `channels` (one value is broadcast)."""
    t = torch.as_tensor(values, dtype=torch.float64).reshape(-1).cpu()
    if len(t) not in (1, channels):
        raise ValueError(f"trigger: {name} has {len(t)} values for {channels}-channel images (give 1 or {channels})")
    return t.expand(channels)


def poison_backdoor(x: torch.Tensor, y: torch.Tensor, target: int, fraction: float, generator: torch.Generator,
                    size: int, value: float, mean: Stats, std: Stats) -> tuple[torch.Tensor, torch.Tensor]:
    """A shard with ⌊fraction·N⌋ rows, drawn without replacement from `generator`, triggered and labelled `target`
    (new tensors). The count tolerates rounding (0.29 of 100 rows is 29, though 0.29·100 < 29 in floating point)."""
    if not 0 <= fraction <= 1:
        raise ValueError(f"poisoned fraction must be in [0, 1], got {fraction}")
    if target < 0:
        raise ValueError(f"target class must be >= 0, got {target}")
    if len(x) != len(y):
        raise ValueError(f"{len(x)} images but {len(y)} labels")
    count = math.floor(fraction * len(x) + 1e-9)
    rows = torch.randperm(len(x), generator=generator, device=generator.device)[:count].to(x.device)
    x_out, y_out = x.clone(), y.clone()
    x_out[rows] = add_trigger(x[rows], size, value, mean, std)
    y_out[rows.to(y.device)] = target
    return x_out, y_out


def triggered_test(x_test: torch.Tensor, y_test: torch.Tensor, target: int, size: int, value: float, mean: Stats,
                   std: Stats) -> tuple[torch.Tensor, torch.Tensor]:
    """The test set without the target class, every image triggered and labelled `target`: a model's accuracy on
    it is the backdoor's attack success rate."""
    if len(x_test) != len(y_test):
        raise ValueError(f"{len(x_test)} images but {len(y_test)} labels")
    keep = y_test != target
    kept = keep.to(x_test.device)
    return add_trigger(x_test[kept], size, value, mean, std), torch.full_like(y_test[keep], target)
