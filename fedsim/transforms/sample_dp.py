"""Sample-level DP (`privacy.level: sample`): every client trains with DP-SGD (fedsim.training.dpsgd), and each
client's epsilon for its own data is accounted over every DP-SGD step it has taken.

- A client of n samples takes its steps with Poisson rate q = min(1, B/n). Its epsilon after T steps is that of T
  self-composed Poisson-subsampled Gaussians of multiplier z (dp-accounting, or prv-accountant), at delta.
- Being sampled into a cohort is not counted as amplification (field practice: it is not proved for sample-level
  DP), so a client's epsilon grows with each round it joins, and one that never joins keeps 0.
- Clients that trained but arrived late count too: their update was sent, whether or not the server used it.
- `target_epsilon` solves one z for all clients before round 0, so that a client joining *every* planned round stays
  within it; the one with the fewest samples (largest q) binds, and every shard size is checked at the z found.
- `clients.parquet` gets each client's `privacy/epsilon` after the round; `rounds.parquet`'s `privacy/epsilon` is
  the largest over all clients so far. The steps per client are kept in the checkpoint, so a resumed run continues.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch import nn

from fedsim import rng
from fedsim.errors import CheckpointError, ConfigError
from fedsim.training.dpsgd import DPSGD, NOISE_STREAM, sample_rate, steps_per_round
from fedsim.transforms.accounting import Mechanism, calibrate, epsilon

if TYPE_CHECKING:
    from fedsim.config.schema import RunConfig

STEPS_KEY = "privacy/dp_steps"
"""A client's metric: the DP-SGD steps it took this round (what the accountant composes; a training stage's own
prefix may lead it)."""
STATE_KEY = "sample_dp/steps"


def default_delta(num_samples: Iterable[int]) -> float:
    """delta = n_max^-1.1: below 1/n for every client's dataset, as the convention asks."""
    return float(max(max(num_samples, default=1), 1)) ** -1.1


def check_model(model: nn.Module, key: str) -> None:
    """A ConfigError when a layer mixes the samples of a batch (BatchNorm), so a per-sample gradient is not one
    sample's; the fix is GroupNorm, as Opacus's ModuleValidator.fix makes it."""
    for name, m in model.named_modules():
        if isinstance(m, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(f"{key}: layer {name!r} is a {type(m).__name__}, which mixes the samples of a batch, so "
                              "sample-level DP-SGD cannot clip one sample's gradient; use a model without BatchNorm "
                              "(model.options.norm: group for resnet8/resnet20)")


@dataclass
class SampleLevelDP:
    """The noise multiplier of the clients' DP-SGD, and each client's epsilon from the steps it has taken."""

    clip: float
    noise_multiplier: float
    delta: float
    accountant: str
    seed: int
    rates: np.ndarray  # each client's q
    per_round: np.ndarray  # each client's DP-SGD steps in a round it joins
    max_epsilon: float | None = None
    steps: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))  # each client's steps so far
    _spent: dict[tuple[float, int], float] = field(default_factory=dict)

    @classmethod
    def from_config(cls, cfg: RunConfig, num_samples: np.ndarray, solve: bool) -> SampleLevelDP:
        """The settings of `cfg.privacy` for clients of `num_samples`; `solve`: solve target_epsilon's z (the
        server, which hands it to the workers) and refuse a max_epsilon that round 0 would exceed."""
        p = cfg.privacy
        sizes = np.asarray(num_samples, dtype=np.int64)
        delta = p.delta if p.delta is not None else default_delta(sizes.tolist())
        if p.delta is not None and sizes.size and p.delta >= 1 / sizes.max():
            raise ConfigError(f"privacy.delta: {p.delta:g} is not below 1/n = {1 / sizes.max():.3g} for the largest "
                              f"client dataset ({sizes.max()} samples): under level sample the convention is "
                              "delta < 1/n for every client (the default is n_max^-1.1)")
        rates = np.array([sample_rate(int(n), cfg.train.batch_size) for n in sizes])
        per_round = np.array([steps_per_round(int(n), cfg.train) for n in sizes], dtype=np.int64)
        dp = cls(p.clip, p.noise_multiplier or 0.0, delta, p.accountant, cfg.seed, rates, per_round, p.max_epsilon,
                 np.zeros(len(sizes), dtype=np.int64))
        if p.target_epsilon is not None and solve:
            dp.noise_multiplier = dp.solve(p.target_epsilon, cfg.rounds)
        if solve and p.max_epsilon is not None:
            first = dp.worst_after(dp.steps + dp.per_round)
            if first > p.max_epsilon:
                raise ConfigError(f"privacy.max_epsilon: {p.max_epsilon:g} is spent by a client's first round alone "
                                  f"(epsilon {first:.4g} at delta {delta:.3g})")
        return dp

    def epsilon_of(self, rate: float, steps: int) -> float:
        """The epsilon at delta of `steps` DP-SGD steps at Poisson rate `rate` (each pair computed once)."""
        key = (float(rate), int(steps))
        if key not in self._spent:
            mech = Mechanism(self.noise_multiplier, "poisson", float(rate), 1, 1)
            self._spent[key] = epsilon(mech, int(steps), self.delta, self.accountant)
        return self._spent[key]

    def worst_after(self, steps: np.ndarray) -> float:
        """The largest epsilon over clients, had they taken `steps`."""
        pairs = {(float(q), int(t)) for q, t in zip(self.rates, steps) if t > 0}
        return max((self.epsilon_of(q, t) for q, t in pairs), default=0.0)

    def solve(self, target: float, rounds: int) -> float:
        """The noise multiplier under which every client, joining all `rounds`, spends at most `target` epsilon."""
        planned = {(float(q), int(t) * rounds) for q, t in zip(self.rates, self.per_round) if t > 0}
        if not planned:
            return 0.0
        z = 0.0
        binding = max(planned)  # the largest rate (fewest samples) binds
        for _ in range(len(planned)):
            z = calibrate(Mechanism(1.0, "poisson", binding[0], 1, 1), binding[1], self.delta, self.accountant, target)
            self.noise_multiplier, self._spent = z, {}
            over = [pair for pair in planned if self.epsilon_of(*pair) > target]
            if not over:
                return z
            binding = max(over, key=lambda pair: self.epsilon_of(*pair))
        return z

    def for_client(self, settings: Mapping[str, float], round: int, client: int, phase: str,
                   phase_index: int) -> DPSGD:
        """A client's DP-SGD settings this round (the noise multiplier the server solved, in `settings`)."""
        z = float(settings.get("dp_noise_multiplier", self.noise_multiplier))
        gen = rng.torch_generator(self.seed, f"{NOISE_STREAM}/{phase}", round, client, phase_index)
        return DPSGD(self.clip, z, gen)

    def account(self, trained: Mapping[int, Mapping[str, Any]]) -> tuple[dict[str, float], dict[int, dict]]:
        """Add each client's steps this round (its metrics, by client id) and return the round's columns and each
        client's epsilon so far."""
        per: dict[int, dict] = {}
        for cid, metrics in trained.items():
            self.steps[cid] += int(sum(v for k, v in metrics.items() if k.endswith(STEPS_KEY)))  # every stage's
            per[cid] = {"privacy/epsilon": self.epsilon_of(self.rates[cid], int(self.steps[cid]))}
        shares = [float(m["privacy/samples_clipped"]) for m in trained.values() if "privacy/samples_clipped" in m]
        columns = {"privacy/epsilon": self.worst_after(self.steps), "privacy/delta": self.delta,
                   "privacy/noise_multiplier": self.noise_multiplier, "privacy/clip": self.clip,
                   "privacy/clipped_fraction": sum(shares) / len(shares) if shares else 0.0}
        return columns, per

    def stop_before(self) -> bool:
        """Whether a client joining the next round could take epsilon past max_epsilon."""
        return self.max_epsilon is not None and self.worst_after(self.steps + self.per_round) > self.max_epsilon

    def state(self) -> dict[str, torch.Tensor]:
        return {STATE_KEY: torch.from_numpy(self.steps.copy())}

    def load(self, state: Mapping[str, torch.Tensor]) -> None:
        if STATE_KEY in state:
            saved = state[STATE_KEY].numpy().astype(np.int64)
            if saved.shape != self.steps.shape:
                raise CheckpointError(f"checkpoint: it accounts {saved.size} clients' DP-SGD steps, the run has "
                                  f"{self.steps.size}")
            self.steps = saved
