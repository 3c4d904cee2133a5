"""GAN pieces shared by FedGDKD, FedDTG and FD + FAug (Banerjee 2022, FedGDKD thesis; spec seed004).

The synthetic distillation set every participant rebuilds from (θ_G, noise seed), an internal-only
Fréchet distance for generator quality, and the BCE/ACGAN losses of the comparators' discriminators.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from fedsim.algorithms._personal import balanced_labels
from fedsim.method import SGD, Adam, batch_indices, knob
from fedsim.models.thesis_nets import GeneratorConfig


@dataclass
class GanParams:
    """The conditional generator and its optimiser (Table 5.1; [C] details from the author's code)."""

    generator: GeneratorConfig = knob(factory=GeneratorConfig)
    gen_lr: float = knob(1e-3, gt=0, doc="generator Adam learning rate (Table 5.1)")
    gen_betas: list[float] = knob([0.5, 0.999], doc="[C] generator Adam betas")
    gen_weight_decay: float = knob(1e-2, ge=0, doc="[C] generator Adam weight decay")
    gen_amsgrad: bool = knob(True, doc="[C] generator Adam uses AMSGrad")

    def __post_init__(self) -> None:
        if len(self.gen_betas) != 2 or not all(0 <= b < 1 for b in self.gen_betas):
            raise ValueError(f"gen_betas must be two numbers in [0, 1), got {self.gen_betas}")


def gen_optimizer(G: torch.nn.Module, p: GanParams) -> Adam:
    """A fresh generator Adam (re-created every round, as in the author's code)."""
    return Adam(G.parameters(), lr=p.gen_lr, betas=(p.gen_betas[0], p.gen_betas[1]), eps=1e-8,
                            weight_decay=p.gen_weight_decay, amsgrad=p.gen_amsgrad)


def same_state(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    """Whether two state dicts hold the same tensors (by identity or value)."""
    return a is b or (a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a))


def randn(shape: tuple[int, ...], gen: torch.Generator, device: torch.device) -> torch.Tensor:
    """Standard normal noise drawn from a CPU generator (device-independent draws), moved to `device`."""
    return torch.randn(shape, generator=gen).to(device)


@torch.no_grad()
def synthetic_set(G: torch.nn.Module, seed: int, size: int, num_classes: int, nz: int, noise: str,
                  device: torch.device, batch: int = 512) -> tuple[torch.Tensor, torch.Tensor]:
    """The round's distillation set from (θ_G, seed), G in eval mode, in a fixed class-interleaved order.

    shared: sample r·c + k is G(z_r, k) for r < ⌈N/c⌉ (eq. 4.10); independent: G(z_i, i mod c), i < N.
    """
    g = torch.Generator().manual_seed(int(seed))
    if noise == "shared":
        rows = math.ceil(size / num_classes)
        z = torch.randn(rows, nz, generator=g).repeat_interleave(num_classes, dim=0)
        y = balanced_labels(rows * num_classes, num_classes)
    else:
        z, y = torch.randn(size, nz, generator=g), balanced_labels(size, num_classes)
    G.eval()
    z, y = z.to(device), y.to(device)
    x = torch.cat([G(z[i:i + batch], y[i:i + batch]) for i in range(0, len(y), batch)])
    return x, y


def step(opt: SGD | Adam, loss: torch.Tensor) -> float:
    """Zero the optimiser's gradients, back-propagate `loss`, step; returns the loss value."""
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return float(loss.detach())


def bce(logit: torch.Tensor, target: float) -> torch.Tensor:
    """BCE(sigmoid(logit), target) against a constant (soft) label, e.g. 0.9 for real [C], 0 for fake."""
    return F.binary_cross_entropy_with_logits(logit, torch.full_like(logit, target))


def train_acgan(G: torch.nn.Module, D: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, p: GanParams,
                epochs: int, batch_size: int, disc_lr: float, real_label: float, num_classes: int,
                gen: torch.Generator) -> dict[str, float]:
    """[C] FedGAN-style ACGAN (FAug's central GAN): per batch a D step, then a G step on the same fake batch.

    L_D = ½[½(BCE(D(x), real) + CE(x, y)) + ½(BCE(D(x̃), 0) + CE(x̃, ŷ))], L_G = ½(BCE(D(x̃), real) + CE(x̃, ŷ)).
    """
    opt_g, opt_d = gen_optimizer(G, p), SGD(D.parameters(), lr=disc_lr)
    G.train()
    D.train()
    sums, steps = [0.0, 0.0], 0
    for idx in batch_indices(len(y), batch_size, gen, epochs, device=x.device):
        z = randn((len(idx), p.generator.nz), gen, x.device)
        y_gen = torch.randint(0, num_classes, (len(idx),), generator=gen).to(x.device)
        fake = G(z, y_gen)
        (v_real, c_real), (v_fake, c_fake) = D(x[idx]), D(fake.detach())
        sums[0] += step(opt_d, 0.25 * (bce(v_real, real_label) + F.cross_entropy(c_real, y[idx])
                                       + bce(v_fake, 0.0) + F.cross_entropy(c_fake, y_gen)))
        v, c = D(fake)
        sums[1] += step(opt_g, 0.5 * (bce(v, real_label) + F.cross_entropy(c, y_gen)))
        steps += 1
    return {"loss_d": sums[0] / max(steps, 1), "loss_g": sums[1] / max(steps, 1), "steps": float(steps)}


def frechet_distance(a: torch.Tensor, b: torch.Tensor) -> float:
    """‖μ_a − μ_b‖² + tr(Σ_a + Σ_b − 2(Σ_a^½ Σ_b Σ_a^½)^½) between two feature samples (rows)."""
    mu_a, mu_b = a.mean(0), b.mean(0)
    ca, cb = torch.cov(a.T), torch.cov(b.T)
    w, v = torch.linalg.eigh(ca)
    root = v @ torch.diag(w.clamp_min(0).sqrt()) @ v.T
    cross = torch.linalg.eigvalsh(root @ cb @ root).clamp_min(0).sqrt().sum()
    return float((mu_a - mu_b).pow(2).sum() + torch.trace(ca) + torch.trace(cb) - 2 * cross)


class FeatureFD:
    """INTERNAL-ONLY generator quality: Fréchet distance between embeddings of the real test images and a
    synthetic set, under a cnn_medium trained on the pooled real training data (which no FL server has).

    Compare values between runs of this code only, never with published FIDs (Inception features).
    """

    def __init__(self, env: Any, device: torch.device) -> None:
        from fedsim import rng
        from fedsim.method.toolkit import seeded_model
        from fedsim.training.train import train_classifier

        data = env.extras["server_data"]
        self.net = seeded_model(env, "cnn_medium", rng.seed(env.config.seed, "fid/init")).to(device)
        x, y = torch.as_tensor(data.x_train).to(device), torch.as_tensor(data.y_train).to(device)
        train_classifier(self.net, x, y, env.config.train, rng.torch_generator(env.config.seed, "fid/train"))
        self.net.eval()
        with torch.no_grad():
            self.real = self.net.embed(torch.as_tensor(data.x_test).to(device)).double()

    @torch.no_grad()
    def __call__(self, fake: torch.Tensor) -> float:
        return frechet_distance(self.real, self.net.embed(fake).double())
