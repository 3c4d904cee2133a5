"""Federated learning with a single shared image (Soni, Saeed & Asano 2024, https://arxiv.org/abs/2406.12658).

FedDF whose proxy set is a pool of augmented patches of one image (fedsim.data.single_image), regenerated
by every client and the server from (image, seed), with the best patches re-selected every round by the
current global model: KMeans class balancing, then entropy pruning (fedsim.algorithms._selection). Everything else
(FedAvg-initialisation schedule, mirrors for heterogeneous clients, the cosine-with-restarts distillation
schedule, clipping, FedProx) is FedDF's engine in feddf.py.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim import rng
from fedsim.algorithms.feddf import DistillFLParams, FedDF
from fedsim.config.limits import MAX_SAMPLES, MAX_SEED
from fedsim.data.single_image import PatchPool, PatchSpec, patch_pool
from fedsim.method import Env, knob, register_algorithm


@dataclass
class SingleImageParams(DistillFLParams):
    image: str = knob("china", doc="the shared image: china (scikit-learn), ihc (scikit-image pathology), noise, "
                      "or a path (the paper used ameyoko_small.jpg / colonpath_sample.jpg, not shipped)")
    pool_size: int = knob(50_000, ge=1, le=MAX_SAMPLES,
                          doc="patches generated from the image (the authors' runs: 50,000; the paper does not say)")
    patch_size: int | None = knob(None, ge=1, le=1024, doc="patch side in pixels; default: the dataset's image size")
    pool_seed: int | None = knob(None, ge=0, le=MAX_SEED, doc="seed of the patch generation; default: stream "
                                 "'single_image/pool' of the run seed")
    init_crop: float = knob(0.5, gt=0, le=1, doc="first random crop, as a fraction of the image's shorter side")
    scale_min: float = knob(0.002, gt=0, le=1, doc="smallest area fraction of the random resized crop (1/500)")
    degrees: float = knob(30.0, ge=0, le=180, doc="random rotation range, ± degrees")
    shear: float = knob(30.0, ge=0, lt=90, doc="random x-shear range, ± degrees")
    jitter_p: float = knob(0.5, ge=0, le=1, doc="probability of ColorJitter(0.4, 0.4, 0.4, 0.1)")
    vflip: bool = knob(False, doc="random vertical flips (off in the paper runs)")


def pool_spec(env: Env, p: SingleImageParams) -> PatchSpec:
    """The patch pool this run uses, from its params and the dataset's image size."""
    size = p.patch_size or int(env.input_shape[-1])
    seed = rng.seed(env.config.seed, "single_image/pool") if p.pool_seed is None else p.pool_seed
    return PatchSpec(n=p.pool_size, size=size, seed=seed, init_crop=p.init_crop, scale_min=p.scale_min,
                     degrees=p.degrees, shear=p.shear, jitter_p=p.jitter_p, vflip=p.vflip)


@register_algorithm
class SingleImage(FedDF):
    """FedDF on per-round selected patches of one shared image."""

    name = "single_image"
    Params = SingleImageParams
    mechanism_columns = FedDF.mechanism_columns  # recorded by the shared distillation step

    def pool(self, env: Env) -> PatchPool:
        channels = int(env.input_shape[0]) if len(env.input_shape) == 3 else 1
        return patch_pool(self.params.image, pool_spec(env, self.params), channels, env.mean, env.std)
