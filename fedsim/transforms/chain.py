"""The configured update chain, applied by the runtime on both sides of a `model_update` phase."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from fedsim.errors import ConfigError
from fedsim.method.aggregate import WEIGHT_KEY
from fedsim.method.contract import ClientData, ClientResult, Phase, SummedUpdate
from fedsim.transforms.compression import Compression, check_compression
from fedsim.transforms.download import check_download, compresses
from fedsim.transforms.privacy import CLIPPED_KEY, ClientLevelDP, check_privacy
from fedsim.transforms.robustness import Robustness, build_robustness, check_robustness
from fedsim.transforms.sample_dp import STEPS_KEY, SampleLevelDP, check_model
from fedsim.transforms.secure import SecureAggregation, check_secure, float_keys, summed_upload
from fedsim.transforms.updates import update_of

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig
    from fedsim.method.contract import Env
    from fedsim.training.dpsgd import DPSGD

log = logging.getLogger("fedsim")


@dataclass
class UpdateChain:
    """The stages a run's config turns on (none: every method runs as written)."""

    privacy: ClientLevelDP | None = None
    robustness: Robustness | None = None  # attackers and the robust aggregator (fedsim.transforms.robustness)
    sample: SampleLevelDP | None = None  # DP-SGD in every client and its accountant (fedsim.transforms.sample_dp)
    secure: SecureAggregation | None = None  # quantised, masked uploads and their unmasked sum (transforms.secure)
    compression: Compression | None = None  # compressed uploads, decoded in the worker (transforms.compression)
    stopped_after: int | None = None  # the round after which privacy.max_epsilon stops the run

    def applies(self, phase: Phase) -> bool:
        """Whether the chain transforms this phase's uploads (a model update summed over clients)."""
        on = self.privacy is not None or self.sample is not None or self.secure is not None or (
            self.robustness is not None and self.robustness.on_updates) or self.compression is not None
        return on and phase.reduce == "sum" and phase.model_update

    def per_client(self, phase: Phase) -> bool:
        """Whether each client's update reaches the server in this phase, instead of the workers' partial sums."""
        return self.applies(phase) and self.robustness is not None and self.robustness.per_client

    def poison(self, client: int, data: ClientData) -> ClientData:
        """A client's shard as it trains on it: a malicious client's poisoned under a data attack."""
        return data if self.robustness is None else self.robustness.poison(client, data)

    def for_clients(self, cohort: Sequence[int] = ()) -> dict[str, Any] | None:
        """What the workers' side needs this round besides the config: the adaptive clip, DP-SGD's solved noise,
        the secure sum's cohort (`cohort`: the clients the broadcast goes to)."""
        settings: dict[str, Any] = {"clip": self.privacy.clip} if self.privacy is not None and \
            self.privacy.adaptive else {}
        if self.sample is not None:
            settings["dp_noise_multiplier"] = self.sample.noise_multiplier
        if self.secure is not None:
            settings["secagg_cohort"] = [int(c) for c in cohort]
        return settings or None

    def dp_sgd(self, settings: Mapping[str, float], round: int, client: int, phase: str,
               phase_index: int) -> DPSGD | None:
        """A client's DP-SGD settings under sample-level DP (ClientContext.dp_sgd), else None."""
        return self.sample.for_client(settings, round, client, phase, phase_index) if self.sample else None

    def account(self, trained: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, Any], dict[int, dict]]:
        """Sample-level DP's accountant over the clients that trained this round (their metrics, by id): the round's
        columns and each client's epsilon (none without sample-level DP)."""
        return self.sample.account(trained) if self.sample is not None else ({}, {})

    def resume(self, columns: Mapping[str, float], state: Mapping[str, torch.Tensor] | None = None) -> None:
        """Continue after a saved round, from its `privacy/` columns and the checkpoint's chain state."""
        if self.privacy is not None:
            self.privacy.resume(columns)
        if self.robustness is not None:
            self.robustness.load(state or {})
        if self.sample is not None:
            self.sample.load(state or {})

    def client(self, res: ClientResult, arch: str, reference: Mapping[str, torch.Tensor], round: int,
               client: int, phase: str, clip: float | None = None, cohort: Sequence[int] = ()) -> ClientResult:
        """A client's result as its worker sums it: the clipped (locally noised) update, its norm among its metrics;
        weight 1 under client-level DP, the method's own under local DP. Under a robust aggregator: its update,
        or (norm bounding) its update clipped to the bound."""
        if self.sample is not None and not any(k.endswith(STEPS_KEY) for k in res.metrics):  # its DP-SGD ran
            raise ConfigError(f"privacy.level: sample, and client {client}'s step did not train with fedsim's DP-SGD "
                              "(a method's client step must pass ctx.dp_sgd to train_classifier or LocalTraining)")
        # what the server decodes replaces the upload from here on; under client-level DP it is clipped after, so
        # the clip still bounds what reaches the sum (the residual and a scaled or rounded-up decoding included)
        if self.compression is not None:
            res = self.compression.client(res, arch, reference, round, client, phase)
        if self.privacy is None and self.secure is None:
            return res if self.robustness is None else self.robustness.client(res, arch, reference)
        keys = float_keys({arch: reference})
        if self.privacy is None:  # secure aggregation of w·Δ
            assert self.secure is not None
            masked, metrics = self.secure.encode(update_of(res.payload, arch, reference), res.weight, 0.0, keys, round,
                                                 client, cohort)
            return ClientResult(payload=masked, weight=1.0, metrics={**res.metrics, **metrics}, state=res.state,
                                probe=res.probe)
        payload, norm = self.privacy.clip_upload(res.payload, arch, reference, round, client, phase, clip)
        weight = res.weight if self.privacy.local else 1.0
        metrics = {**res.metrics, "privacy/update_norm": norm}
        if self.secure is not None:  # the clipped (locally noised) update, masked
            payload, more = self.secure.encode(payload, weight, float(payload[CLIPPED_KEY]), keys, round, client,
                                               cohort, clip)
            return ClientResult(payload=payload, weight=1.0, metrics={**metrics, **more}, state=res.state,
                                probe=res.probe)
        payload[CLIPPED_KEY] = payload[CLIPPED_KEY] / weight  # the sum multiplies it back: a count of clients
        return ClientResult(payload=payload, weight=weight, metrics=metrics, state=res.state, probe=res.probe)

    def server(self, updates: SummedUpdate, references: Mapping[str, Mapping[str, torch.Tensor]], round: int,
               phase: str, cohort: Sequence[int] = (), survivors: Sequence[int] = ()
               ) -> tuple[SummedUpdate, dict[str, Any]]:
        """The round's sum as the method's server step reads it, and the chain's round columns (`cohort`, `survivors`:
        who the broadcast went to and whose upload is in the sum, for secure aggregation)."""
        if self.secure is not None:
            clip = self.privacy.clip if self.privacy is not None and self.privacy.adaptive else None
            entries, columns = self.secure.decode(updates.total, references, round, cohort, survivors, clip)
            if entries is None:  # aborted, or nothing arrived: the method keeps its state
                return SummedUpdate({}, 0.0, 0), columns
            if self.privacy is None:
                total, weight = summed_upload(entries, references)
                return SummedUpdate(total, weight, updates.count), columns
            noisy, metrics = self.privacy.noisy_mean(entries, updates.count, references, round, phase)
            weight = sum(float(v) for k, v in noisy.items() if k.endswith(f"/{WEIGHT_KEY}"))
            return SummedUpdate(noisy, weight, updates.count), {**columns, **metrics}
        if self.privacy is None and self.robustness is None:  # sample level: each client's DP-SGD released it
            return updates, {}
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
        state = self.robustness.state() if self.robustness is not None else {}
        return {**state, **self.sample.state()} if self.sample is not None else state

    def finished(self, round: int) -> bool:
        """Whether the run stops after `round` because the next round would spend more than privacy.max_epsilon."""
        if self.sample is not None:
            if not self.sample.stop_before():
                return False
            if self.stopped_after != round:
                self.stopped_after = round
                log.warning("privacy.max_epsilon=%g: the run stops after round %d (a client joining round %d could "
                            "spend more)", self.sample.max_epsilon, round, round + 1)
            return True
        if self.privacy is None or not self.privacy.stop_before(round + 1):
            return False
        if self.stopped_after != round:  # asked more than once a round: said once
            self.stopped_after = round
            log.warning("privacy.max_epsilon=%g: the run stops after round %d (round %d would spend epsilon %.4g)",
                        self.privacy.max_epsilon, round, round + 1, self.privacy.epsilon_after(round + 2))
        return True


def check_round(cfg: RunConfig, phases: list[Phase]) -> None:
    """Under DP a round is one phase that sums a model update: another phase's uploads would reach the server
    unclipped and unnoised, and a second release would be one the accountant does not count (a ConfigError).
    Compression needs some phase that sums a model update: it compresses nothing else (a download, the model such
    an update is relative to)."""
    for key, what in (("kind", "a model update"), ("download", "the model a model update is relative to")):
        if getattr(cfg.compression, key) != "none" and not any(compresses(p) for p in phases):
            raise ConfigError(f"compression.{key}: compresses {what}, and {cfg.algorithm.name}'s round uploads "
                              f"none (its phases {[p.name for p in phases]} do not sum one with model_update=True)")
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


def build_chain(cfg: RunConfig, solve: bool = False, data: Any = None, env: Env | None = None) -> UpdateChain:
    """The chain of `cfg` (`solve`: the server's, which solves target_epsilon's noise; `data`: the run's Dataset,
    whose classes and pixel statistics the data attacks read; `env`: the run's, whose shard sizes and models
    sample-level DP reads)."""
    level = cfg.privacy.level
    sample = None
    if level == "sample":
        if env is None:
            raise ValueError("sample-level DP needs the run's Env")
        if solve:  # the server checks the models once
            from fedsim.method.toolkit import new_model

            for arch in env.archs:
                check_model(new_model(env, arch), "model.mix" if cfg.model.mix else "model.name")
        sample = SampleLevelDP.from_config(cfg, env.num_samples, solve)
    privacy = ClientLevelDP.from_config(cfg, solve) if level in ("client", "local") else None
    kind = cfg.privacy.secure_aggregation
    secure = SecureAggregation(cfg, kind) if kind != "none" else None
    compression = Compression(cfg) if cfg.compression.kind != "none" else None
    return UpdateChain(privacy=privacy, robustness=build_robustness(cfg, data), sample=sample, secure=secure,
                       compression=compression)


def check_chain(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """Refuse, in one line, a chain the rest of the config cannot take (fedsim.configure.validate)."""
    check_privacy(cfg, uploads_model_update)
    check_robustness(cfg, uploads_model_update)
    check_secure(cfg, uploads_model_update)
    check_compression(cfg, uploads_model_update)
    check_download(cfg, uploads_model_update)


__all__ = ["CLIPPED_KEY", "UpdateChain", "build_chain", "check_availability", "check_chain", "check_round"]
