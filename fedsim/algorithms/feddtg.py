"""FedDTG (Zhang et al. 2022, "Fine-tuning global model via data-free knowledge distillation..." /
"Federated Learning with GAN-based Data Synthesis for Non-IID Clients", as Algorithm 3 of Banerjee 2022's
FedGDKD thesis): a data-free three-player GAN with co-distillation.

Each client trains a shared generator G_k, a shared discriminator D_k (B.3.2's CNN, validity head only)
and its private classifier C_k; the server averages G and D with uniform 1/|S_t| weights; then, as in
FedGDKD, every participant uploads logits on the synthetic set and distils towards the leave-one-out mean
of the others'. No catch-up. [C] losses (the code's gradient-reversal hook is removed before backward):
  L_G = ½[BCE(D(x̃), 0.9) + CE(C(x̃), ŷ)],  L_D = ½[BCE(D(x), 0.9) + BCE(D(x̃), 0)],  L_C = ½[CE(C(x), y) + CE(C(x̃), ŷ)]
per batch in that order, D and C on the detached fake batch; N noise rows with balanced labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch
import torch.nn.functional as F

from fedsim.algorithms._gan import bce, gen_optimizer, randn, step
from fedsim.algorithms.fedgdkd import GEN, FedGDKD, FedGDKDParams
from fedsim.config.limits import MAX_CHANNELS
from fedsim.method import SGD, ClientContext, batch_indices, knob, make_optimizer, register_algorithm
from fedsim.models.thesis_nets import CNNDiscriminator

DISC = "discriminator"


@dataclass
class FedDTGParams(FedGDKDParams):
    catch_up: bool = knob(False, doc="FedDTG has no catch-up distillation")
    kd_noise: Literal["shared", "independent"] = knob("independent", doc="[C] N noise rows, balanced labels")
    half_losses: bool = knob(True, doc="[C] the ½ factors of the author's FedDTG losses")
    disc_widths: list[int] = knob([8, 16, 16], ge=1, le=MAX_CHANNELS,
                                  doc="[C] discriminator conv widths (cnn_medium, B.3.2)")
    disc_lr: float = knob(0.01, gt=0, doc="discriminator SGD learning rate (Table 5.1)")
    real_label: float = knob(0.9, gt=0, le=1, doc="[C] soft BCE target for real samples")


@register_algorithm
class FedDTG(FedGDKD):
    """Three-player federated GAN (G, D shared and uniformly averaged; C private) plus LOO co-distillation."""

    name = "feddtg"
    Params = FedDTGParams
    shared_names = (GEN, DISC)

    def build(self, name: str) -> torch.nn.Module:
        if name == DISC:
            shape = self.env.input_shape
            return CNNDiscriminator(shape[0], shape[-1], list(self.params.disc_widths))
        return super().build(name)

    def client_weight(self, ctx: ClientContext) -> float:
        """G and D are averaged uniformly over the arrived clients (Algorithm 3)."""
        return 1.0

    def local_gan(self, C: torch.nn.Module, mods: dict[str, torch.nn.Module], ctx: ClientContext) -> dict[str, float]:
        p, tr, d = self.params, ctx.env.config.train, ctx.data
        G, D = mods[GEN], mods[DISC]
        half = 0.5 if p.half_losses else 1.0
        opt_g = gen_optimizer(G, p)
        opt_d = SGD(D.parameters(), lr=p.disc_lr)
        opt_c = make_optimizer(C.parameters(), tr)
        gen = ctx.generator()
        for m in (G, D, C):
            m.train()
        sums, steps = [0.0, 0.0, 0.0], 0
        for idx in batch_indices(d.num_samples, tr.batch_size, gen, tr.epochs, tr.steps, d.x.device):
            z = randn((len(idx), p.generator.nz), gen, d.x.device)
            y_gen = torch.randint(0, ctx.env.num_classes, (len(idx),), generator=gen).to(d.x.device)
            x, y = d.x[idx], d.y[idx]
            fake = G(z, y_gen)
            loss_g = step(opt_g, half * (bce(D(fake)[0], p.real_label) + F.cross_entropy(C(fake), y_gen)))
            fake = fake.detach()
            loss_d = step(opt_d, half * (bce(D(x)[0], p.real_label) + bce(D(fake)[0], 0.0)))
            loss_c = step(opt_c, half * (F.cross_entropy(C(x), y) + F.cross_entropy(C(fake), y_gen)))
            sums = [sums[0] + loss_g, sums[1] + loss_d, sums[2] + loss_c]
            steps += 1
        k = max(steps, 1)
        return {"loss_g": sums[0] / k, "loss_d": sums[1] / k, "loss_c": sums[2] / k, "gan_steps": float(steps)}
