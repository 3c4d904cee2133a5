"""FedPer (Arivazhagan et al. 2019, https://arxiv.org/abs/1912.00818): federated base layers, personal head.

    client k: model = (global body, own head θ_k); local SGD on D_k; body up, head kept
    server:   body ← Σ_k |D_k|·body_k / Σ_k |D_k|;   the heads never leave their clients

`personal_layers` names the personal entries by parameter-name prefix (default: the classifier head, the module
owning the model's last parameter, `fc` for the built-in models). A client's head starts from the run's initial
model, as every client's would in the paper's code. The personal model scored on the client's own test shard, at
each evaluation, is the server's current body with the client's own head (the kit's re-scoring pass), whether or not
the client trained that round.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

import torch

from fedsim.method import (
    ClientContext,
    ClientResult,
    Env,
    LocalTraining,
    Message,
    PersonalMethod,
    Phase,
    knob,
    personal,
    register_algorithm,
)


@dataclass
class FedPerParams:
    personal_layers: list[str] = knob([], doc="parameter-name prefixes of the layers each client keeps (e.g. "
                                              "['fc']); empty: the model's classifier head")


@register_algorithm
class FedPer(PersonalMethod):
    """Local SGD on the whole model; the body is averaged, the head stays at the client."""

    name = "fedper"
    Params: ClassVar[type] = FedPerParams  # FedBN and LG-FedAvg bring their own

    def personal_keys(self, env: Env, arch: str) -> frozenset[str]:
        return personal.split_keys(env, arch, self.params.personal_layers, "algorithm.personal_layers")

    def local_training(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                       ctx: ClientContext) -> LocalTraining:
        """Local SGD from (broadcast body, own head); the body goes up, the head is kept."""
        start = personal.start_state(ctx, msg.common[ctx.arch], (state or {}).get("personal"))

        def finish(model: torch.nn.Module, metrics: dict[str, float], optimizer: dict | None) -> ClientResult:
            return self.upload(ctx, model, metrics, state, start=start)

        return LocalTraining.of(ctx, start, finish)
