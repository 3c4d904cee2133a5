"""LG-FedAvg (Liang et al. 2020, https://arxiv.org/abs/2001.01523): local representations, a global head.

    client k: model = (own body, global head g); local SGD on D_k; g_k up, body kept
    server:   g ← Σ_k |D_k|·g_k / Σ_k |D_k|

FedPer's split the other way round: `global_layers` names the shared entries by parameter-name prefix (default:
the model's classifier head) and every other entry stays at its client. [Differs] The paper first trains a global
model with FedAvg and then starts the local bodies from it; here they start from the run's initial model. At each
evaluation a client's personal model is its own body with the server's current head.
"""

from __future__ import annotations

from dataclasses import dataclass

from fedsim.algorithms.fedper import FedPer
from fedsim.method import Env, knob, personal, register_algorithm


@dataclass
class LGFedAvgParams:
    global_layers: list[str] = knob([], doc="parameter-name prefixes of the layers averaged by the server (e.g. "
                                            "['fc']); empty: the model's classifier head; the rest stays local")


@register_algorithm
class LGFedAvg(FedPer):
    """Local SGD on the whole model; the head is averaged, the body stays at the client."""

    name = "lgfedavg"
    Params = LGFedAvgParams

    def personal_keys(self, env: Env, arch: str) -> frozenset[str]:
        shared = personal.split_keys(env, arch, self.params.global_layers, "algorithm.global_layers")
        return frozenset(personal.all_keys(env, arch)) - shared
