"""FedAvg, fine-tuned locally: the reference a personalised method has to beat (e.g. Collins et al. 2021, §5).

    client k: w_k ← local SGD on D_k from the global w (FedAvg's step; uploaded)
              personal model: the received global w after `finetune_epochs` epochs of SGD on D_k
    server:   w ← Σ_k |D_k|·w_k / Σ_k |D_k|

`finetune_epochs: 0` scores FedAvg's global model itself on each client's own shard: the server scores the current
global model on every client's shard at each evaluation. With more, every client that has trained fine-tunes the
current global model again at each evaluation (the kit's re-scoring pass), so no client's score is stale either.
The fine-tuning draws its batches from a stream of its own, so the global model's training is FedAvg's whatever
it is set to.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedsim.config.limits import MAX_EPOCHS
from fedsim.method import (
    ClientContext,
    ClientResult,
    Message,
    PersonalMethod,
    Phase,
    knob,
    personal,
    register_algorithm,
    train_classifier,
)


@dataclass
class FedAvgFTParams:
    finetune_epochs: int = knob(1, ge=0, le=MAX_EPOCHS, doc="epochs of local SGD on the received global model that "
                                                            "make the personal model; 0 scores the global model")


@register_algorithm
class FedAvgFT(PersonalMethod):
    """FedAvg whose clients report the score of the global model fine-tuned on their own data."""

    name = "fedavg_ft"
    Params = FedAvgFTParams
    global_model = True

    def personal_is_global(self) -> bool:
        return self.params.finetune_epochs == 0

    def rescores(self) -> bool:
        """Fine-tuned, every client that has trained is fine-tuned again from the current global model at each
        evaluation (one fine-tune per client: `eval.every` sets how often); with 0 the server scores them all."""
        return self.params.finetune_epochs > 0

    def rescore(self, ctx: ClientContext, shared: Mapping[str, torch.Tensor], state: dict[str, Any] | None
                ) -> torch.nn.Module:
        return self.fine_tuned(ctx, shared)

    def fine_tuned(self, ctx: ClientContext, glob: Mapping[str, torch.Tensor]) -> torch.nn.Module:
        """The personal model: the global model `glob` after `finetune_epochs` epochs on the client's data."""
        tuned = personal.loaded(ctx, "fedavg_ft/personal", glob)
        if self.params.finetune_epochs > 0:
            train_classifier(tuned, ctx.data.x, ctx.data.y, personal.replace_epochs(ctx.env.config.train,
                                                                                    self.params.finetune_epochs),
                             ctx.stream("fedavg_ft/finetune"))
        return tuned

    def client_step(self, phase: Phase, state: dict[str, Any] | None, msg: Message,
                    ctx: ClientContext) -> ClientResult:
        glob, train = msg.common[ctx.arch], ctx.env.config.train
        tuned = self.fine_tuned(ctx, glob)
        model = ctx.models.get(ctx.arch)
        model.load_state_dict(glob)
        metrics = train_classifier(model, ctx.data.x, ctx.data.y, train, ctx.generator())
        return self.upload(ctx, model, metrics, state, personal=tuned, start=glob)
