"""The configured update chain, applied by the runtime on both sides of a `model_update` phase."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedsim.errors import ConfigError
from fedsim.method.aggregate import WEIGHT_KEY
from fedsim.method.contract import ClientData, ClientResult, Phase, SummedUpdate
from fedsim.transforms.privacy import CLIPPED_KEY, ClientLevelDP, check_privacy
from fedsim.transforms.robustness import Robustness, build_robustness, check_robustness

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

log = logging.getLogger("fedsim")


@dataclass
class UpdateChain:
    """The stages a run's config turns on (none: every method runs as written)."""

    privacy: ClientLevelDP | None = None
    robustness: Robustness | None = None  # attackers and the robust aggregator (fedsim.transforms.robustness)
    stopped_after: int | None = None  # the round after which privacy.max_epsilon stops the run

    def applies(self, phase: Phase) -> bool:
        """Whether the chain transforms this phase's uploads (a model update summed over clients)."""
        on = self.privacy is not None or (self.robustness is not None and self.robustness.on_updates)
        return on and phase.reduce == "sum" and phase.model_update

    def per_client(self, phase: Phase) -> bool:
        """Whether each client's update reaches the server in this phase, instead of the workers' partial sums."""
        return self.applies(phase) and self.robustness is not None and self.robustness.per_client

    def poison(self, client: int, data: ClientData) -> ClientData:
        """A client's shard as it trains on it: a malicious client's poisoned under a data attack."""
        return data if self.robustness is None else self.robustness.poison(client, data)

    def for_clients(self) -> dict[str, float] | None:
        """What the workers' side needs this round besides the config: the adaptive clip."""
        return {"clip": self.privacy.clip} if self.privacy is not None and self.privacy.adaptive else None

    def resume(self, columns: Mapping[str, float], state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Continue after a saved round, from its `privacy/` columns and the checkpoint's chain state."""
        if self.privacy is not None:
            self.privacy.resume(columns)
        if self.robustness is not None:
            self.robustness.load(state or {})

    def client(self, res: ClientResult, arch: str, reference: Mapping[str, torch.Tensor], round: int,
               client: int, phase: str, clip: float | None = None) -> ClientResult:
        """A client's result as its worker sums it: the clipped (locally noised) update, its norm among its metrics;
        weight 1 under client-level DP, the method's own under local DP. Under a robust aggregator: its update,
        or (norm bounding) its update clipped to the bound."""
        if self.privacy is None:
            assert self.robustness is not None
            return self.robustness.client(res, arch, reference)
        payload, norm = self.privacy.clip_upload(res.payload, arch, reference, round, client, phase, clip)
        weight = res.weight if self.privacy.local else 1.0
        payload[CLIPPED_KEY] = payload[CLIPPED_KEY] / weight  # the sum multiplies it back: a count of clients
        return ClientResult(payload=payload, weight=weight, metrics={**res.metrics, "privacy/update_norm": norm},
                            state=res.state, probe=res.probe)

    def server(self, updates: SummedUpdate, references: Mapping[str, Mapping[str, torch.Tensor]], round: int,
               phase: str) -> tuple[SummedUpdate, dict[str, float]]:
        """The round's sum as the method's server step reads it, and the chain's round columns."""
        if self.privacy is None:  # norm bounding over the workers' partial sums
            assert self.robustness is not None
            total, metrics = self.robustness.bounded_mean(updates.total, references, updates.count, round, phase)
            return SummedUpdate(total, float(updates.count), updates.count), metrics
        total, metrics = self.privacy.noisy_mean(updates.total, updates.count, references, round, phase)
        weight = sum(float(v) for k, v in total.items() if k.endswith(f"/{WEIGHT_KEY}"))
        return SummedUpdate(total, weight, updates.count), metrics

    def server_each(self, results: Mapping[int, ClientResult], references: Mapping[str, Mapping[str, torch.Tensor]],
                    round: int, phase: str) -> tuple[SummedUpdate, dict[str, float], dict[int, dict]]:
        """Each client's update, attacked and robustly aggregated, as the method's server step reads a sum; the
        round's columns and each client's."""
        assert self.robustness is not None
        total, columns, per = self.robustness.aggregate(results, references, round, phase)
        return SummedUpdate(total, float(max(len(results), 1)), len(results)), columns, per

    def state(self) -> dict[str, torch.Tensor]:
        """What a checkpoint keeps of the chain beyond its columns (centred clipping's centre)."""
        return self.robustness.state() if self.robustness is not None else {}

    def finished(self, round: int) -> bool:
        """Whether the run stops after `round` because the next round would spend more than privacy.max_epsilon."""
        if self.privacy is None or not self.privacy.stop_before(round + 1):
            return False
        if self.stopped_after != round:  # asked more than once a round: said once
            self.stopped_after = round
            log.warning("privacy.max_epsilon=%g: the run stops after round %d (round %d would spend epsilon %.4g)",
                        self.privacy.max_epsilon, round, round + 1, self.privacy.epsilon_after(round + 2))
        return True


def check_round(cfg: RunConfig, phases: list[Phase]) -> None:
    """Under DP a round is one phase that sums a model update: another phase's uploads would reach the server
    unclipped and unnoised, and a second release would be one the accountant does not count (a ConfigError)."""
    if cfg.privacy.level == "none":
        return
    if len(phases) != 1 or phases[0].reduce != "sum" or not phases[0].model_update:
        raise ConfigError(f"privacy.level: {cfg.algorithm.name}'s round is not one phase that sums a model update "
                          f"(model_update=True): it has {[p.name for p in phases]}; DP does not apply to it")


def check_availability(cfg: RunConfig, availability: Any) -> None:
    """Under client-level DP every client must be available every round: a device trace's availability makes who
    joins depend on it, which no accountant here models (a ConfigError naming the trace)."""
    if cfg.privacy.level == "client" and (availability < 1).any():
        raise ConfigError(f"stragglers.trace: {cfg.stragglers.trace} gives clients an availability below 1, which "
                          "no accountant here models under privacy.level client; drop its availability column")


def build_chain(cfg: RunConfig, solve: bool = False, data: Any = None) -> UpdateChain:
    """The chain of `cfg` (`solve`: the server's, which solves target_epsilon's noise; `data`: the run's Dataset,
    whose classes and pixel statistics the data attacks read)."""
    privacy = ClientLevelDP.from_config(cfg, solve) if cfg.privacy.level != "none" else None
    return UpdateChain(privacy=privacy, robustness=build_robustness(cfg, data))


def check_chain(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """Refuse, in one line, a chain the rest of the config cannot take (fedsim.configure.validate)."""
    check_privacy(cfg, uploads_model_update)
    check_robustness(cfg, uploads_model_update)


__all__ = ["CLIPPED_KEY", "UpdateChain", "build_chain", "check_availability", "check_chain", "check_round"]
