"""Client-level DP-FedAvg (McMahan, Ramage, Talwar, Zhang, ICLR 2018), as two stages of the update chain.

- In the worker, each client's update Δ_k (upload − reference) is clipped to L2 norm C before the worker's partial
  sum: Δ̂_k = Δ_k · min(1, C / ‖Δ_k‖).
- On the server, Gaussian noise of std z·C is added once to the round's sum, from the named stream
  `privacy-noise/<phase>` (the same draw on 1 or N workers), and the sum is divided by the *expected* cohort size
  (q·N under Poisson sampling, m for a fixed cohort), not by how many arrived: the fixed denominator that keeps the
  sensitivity at C / (qN).
- Every client weighs the same (algorithm.params.weighting: uniform): with sample weights one client's share of
  the mean is n_k / Σn, not 1/m, and the noise would be miscalibrated.

Local DP (`privacy.level: local`): each client adds noise of std 2·z·C to its own clipped update before it leaves
(any two clipped updates differ by up to 2C), from its own named stream; the server averages what arrives with the
method's weights. Epsilon is then one client's, over every round it could have joined: no sampling amplifies it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from fedsim import rng
from fedsim.config.schema import clients_per_round, sampling_rate
from fedsim.errors import ConfigError
from fedsim.method.aggregate import WEIGHT_KEY
from fedsim.transforms.accounting import Mechanism, calibrate, check_accountable, epsilon
from fedsim.transforms.updates import as_upload, clip_to, noised_entries, update_of

if TYPE_CHECKING:
    from collections.abc import Mapping

    from fedsim.config.schema import RunConfig

CLIPPED_KEY = "__privacy_clipped__"
"""A summed entry beside the update: how many of the round's clients were clipped."""


def default_delta(num_clients: int) -> float:
    """delta = N^-1.1: below 1/N, as the convention asks (a mechanism that publishes one client's data whole would
    meet delta = 1/N)."""
    return float(num_clients) ** -1.1


def cohort_mechanism(cfg: RunConfig, noise_multiplier: float) -> Mechanism:
    """The round's release as the accountant sees it: the cohort's sampling."""
    return Mechanism(noise_multiplier, cfg.participation.sampling, sampling_rate(cfg), cfg.data.num_clients,
                     clients_per_round(cfg))


def expected_cohort(cfg: RunConfig) -> float:
    """The fixed denominator of client-level DP: q·N under Poisson sampling, else the cohort size m."""
    if cfg.participation.sampling == "poisson":
        return sampling_rate(cfg) * cfg.data.num_clients
    return float(clients_per_round(cfg))


def split_noise(noise_multiplier: float, count_noise: float | None, expected_cohort: float) -> tuple[float, float]:
    """(the count's noise std σ_b, the update sum's noise multiplier z_Δ) that together spend what one Gaussian of
    `noise_multiplier` z does: z^-2 = z_Δ^-2 + (2σ_b)^-2 (Andrew et al. 2021, as TFF splits it); σ_b defaults to
    the expected cohort / 20. A ConfigError when σ_b leaves no noise for the update (2σ_b ≤ z)."""
    if noise_multiplier == 0:
        return 0.0, 0.0
    count_std = count_noise if count_noise is not None else expected_cohort / 20
    if 2 * count_std <= noise_multiplier:
        raise ConfigError(f"privacy.count_noise: {count_std:g} spends the whole noise_multiplier {noise_multiplier:g} "
                          f"on the count of unclipped updates (it needs count_noise > noise_multiplier / 2 = "
                          f"{noise_multiplier / 2:g}); raise it, or lower the noise")
    return count_std, (noise_multiplier ** -2 - (2 * count_std) ** -2) ** -0.5


def check_privacy(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """The privacy section against the rest of the config, in one line per problem (ConfigError): what the accountant
    cannot model is refused, never reported as a number. `uploads_model_update`: whether the method's phases upload a
    model update to a sum (None: not known before the run builds it)."""
    p = cfg.privacy
    if p.level == "none":
        return
    name = cfg.algorithm.name
    local = p.level == "local"
    if p.level == "sample":
        check_sample_level(cfg, uploads_model_update)
        return
    if uploads_model_update is False:
        raise ConfigError(f"privacy.level: DP clips and noises a model update summed over clients; {name}'s round "
                          "is not one phase that uploads one (model_update=True), so it would not be private")
    if not local and getattr(cfg.algorithm.params, "weighting", "uniform") != "uniform":
        raise ConfigError(f"privacy.level client weighs every client alike (its sensitivity bound needs it): set "
                          f"algorithm.params.weighting: uniform (it is {cfg.algorithm.params.weighting!r})")
    if p.adaptive_clip and (local or math.isinf(p.clip)):
        raise ConfigError("privacy.adaptive_clip: needs level client and a finite clip to start from")
    if math.isinf(p.clip) and (p.noise_multiplier or 0) > 0:
        raise ConfigError("privacy.clip: .inf with noise would make the noise infinite; clip to a finite norm")
    if len(set(cfg.model.mix) or {cfg.model.name}) > 1:
        raise ConfigError("privacy.level: clients of several architectures (model.mix) are not supported with DP")
    n = cfg.data.num_clients
    if p.delta is not None and p.delta >= 1 / n:
        raise ConfigError(f"privacy.delta: {p.delta:g} is not below 1/data.num_clients = {1 / n:.3g}: a mechanism "
                          "that publishes one client's data whole meets it; the convention is delta < 1/N (the "
                          "default is N^-1.1)")
    if local:  # each client's release is private on its own: how the cohort is drawn does not enter
        return
    availability = cfg.participation.availability
    if isinstance(availability, str):  # diurnal or a trace: who can join changes over time
        raise ConfigError(f"privacy.level: participation.availability {availability!r} makes who joins depend on "
                          "availability over time, which no accountant here models; set it to 1")
    if availability < 1:
        raise ConfigError("privacy.level: participation.availability < 1 makes who joins depend on availability, "
                          "which no accountant here models; set it to 1")
    s = cfg.stragglers
    if s.enabled and s.over_select > 0:  # keeping the fastest K: one client more can push another out
        raise ConfigError("stragglers.over_select: keeping the fastest of the clients drawn lets one client change "
                          "who else is kept, past the sensitivity the accountant assumes; set it to 0 under "
                          "privacy.level client")
    if s.enabled and s.deadline == "quantile":  # the deadline then moves with every participant's duration
        raise ConfigError("stragglers.deadline: a quantile deadline lets one client change who else arrives in time, "
                          "past the sensitivity the accountant assumes; use deadline: fixed or none under "
                          "privacy.level client")
    check_accountable(cohort_mechanism(cfg, 1.0), p.accountant)
    if p.adaptive_clip and p.noise_multiplier:
        split_noise(p.noise_multiplier, p.count_noise, expected_cohort(cfg))


def check_sample_level(cfg: RunConfig, uploads_model_update: bool | None) -> None:
    """Sample-level DP against the rest of the config (what depends on the model and the shards is checked when the
    run builds them: fedsim.transforms.sample_dp)."""
    p = cfg.privacy
    if uploads_model_update is False:
        raise ConfigError(f"privacy.level: sample-level DP trains with DP-SGD in a method whose round is one phase "
                          f"that uploads a model update; {cfg.algorithm.name}'s clients also release other results "
                          "of their data, which would not be private")
    if p.adaptive_clip:
        raise ConfigError("privacy.adaptive_clip: adapts the clip of client-level DP; under level sample the "
                          "per-sample clip is fixed")
    if math.isinf(p.clip) and (p.noise_multiplier or 0) > 0:
        raise ConfigError("privacy.clip: .inf with noise would make the noise infinite; clip to a finite norm")


@dataclass
class ClientLevelDP:
    """Clipping in the workers, noise and the fixed denominator on the server, and the accountant's epsilon."""

    clip: float
    mechanism: Mechanism
    delta: float
    accountant: str
    expected_cohort: float  # the fixed denominator
    max_epsilon: float | None
    seed: int
    local: bool = False  # each client noises its own update (level local) instead of the server the sum
    adaptive: bool = False  # the clip follows a quantile of the update norms (Andrew et al. 2021)
    quantile: float = 0.5  # the share of updates the adaptive clip leaves unclipped, at its fixed point
    clip_lr: float = 0.2
    count_std: float = 0.0  # std of the noise on the count of unclipped updates (coded ±1/2)
    update_multiplier: float | None = None  # the noise multiplier of the update sum, once the count's share is paid
    spent: dict[int, float] = field(default_factory=dict)  # epsilon after so many rounds (each computed once)

    @classmethod
    def from_config(cls, cfg: RunConfig, solve: bool) -> ClientLevelDP:
        """The stages of `cfg.privacy`; `solve`: solve target_epsilon's noise multiplier (the server; a worker only
        clips) and refuse a max_epsilon that round 0 would exceed."""
        p = cfg.privacy
        delta = p.delta if p.delta is not None else default_delta(cfg.data.num_clients)
        local = p.level == "local"
        n = cfg.data.num_clients

        def mechanism(z: float) -> Mechanism:  # a local release is one client's own, every round it may join
            return Mechanism(z, "poisson", 1.0, n, n) if local else cohort_mechanism(cfg, z)

        mech = mechanism(p.noise_multiplier or 0.0)
        if p.target_epsilon is not None and (solve or local):  # a local worker noises with the solved z too
            mech = mechanism(calibrate(mech, cfg.rounds, delta, p.accountant, p.target_epsilon))
        expected = expected_cohort(cfg)
        dp = cls(p.clip, mech, delta, p.accountant, expected, p.max_epsilon, cfg.seed, local)
        if p.adaptive_clip:
            dp.adaptive, dp.quantile, dp.clip_lr = True, p.target_quantile, p.clip_lr
            dp.count_std, dp.update_multiplier = split_noise(mech.noise_multiplier, p.count_noise, expected)
        if solve and p.max_epsilon is not None and dp.epsilon_after(1) > p.max_epsilon:
            raise ConfigError(f"privacy.max_epsilon: {p.max_epsilon:g} is spent by round 0 alone (epsilon "
                              f"{dp.epsilon_after(1):.4g} at delta {delta:.3g})")
        return dp

    @property
    def noise_std(self) -> float:
        """The std of the noise on the round's sum (client) or on each client's update (local: sensitivity 2C)."""
        z = self.mechanism.noise_multiplier if self.update_multiplier is None else self.update_multiplier
        if z == 0:
            return 0.0
        return z * self.clip * (2 if self.local else 1) if math.isfinite(self.clip) else math.inf

    def epsilon_after(self, rounds: int) -> float:
        if rounds not in self.spent:
            self.spent[rounds] = epsilon(self.mechanism, rounds, self.delta, self.accountant)
        return self.spent[rounds]

    def clip_upload(self, payload: Mapping[str, torch.Tensor], arch: str, reference: Mapping[str, torch.Tensor],
                    round: int, client: int, phase: str = "train",
                    clip: float | None = None) -> tuple[dict[str, torch.Tensor], float]:
        """The client's update clipped to `clip` (the round's adaptive clip; default the configured one) and noised
        by the client itself under local DP, summable with a weight counter of 1 (plus a count of whether it was
        clipped), and the update's norm before clipping."""
        clip = self.clip if clip is None else clip
        out, norm = clip_to(update_of(payload, arch, reference), clip)
        if self.local and self.noise_std > 0:
            gen = rng.torch_generator(self.seed, f"privacy-local-noise/{phase}", round, client)
            out = {k: v + self.noise_std * torch.randn(v.shape, generator=gen, dtype=torch.float64).to(v.device)
                   for k, v in sorted(out.items())}
        device = next(iter(out.values())).device if out else None
        out[f"{arch}/{WEIGHT_KEY}"] = torch.ones((), dtype=torch.float64, device=device)
        out[CLIPPED_KEY] = torch.tensor(float(norm > clip), dtype=torch.float64, device=device)
        return out, norm

    def noisy_mean(self, total: Mapping[str, torch.Tensor], arrived: int,
                   references: Mapping[str, Mapping[str, torch.Tensor]], round: int,
                   phase: str) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
        """The round's release: noise on the sum of clipped updates, in the upload's form for the method's server
        step: entries m̃·(reference) + (Σ Δ̂_k + noise), weight m̃, so the method's mean is reference + that / m̃."""
        # client level: the fixed denominator; local: the method's own weights over what arrived
        m = self.expected_cohort if not self.local else sum(
            float(v) for k, v in total.items() if k.endswith(f"/{WEIGHT_KEY}")) or 1.0
        gen = rng.torch_generator(self.seed, f"privacy-noise/{phase}", round)
        central = self.noise_std if self.mechanism.noise_multiplier > 0 and not self.local else 0.0
        noised = noised_entries(total, references, central, gen)
        out = as_upload(noised, references, m)
        clipped = float(total[CLIPPED_KEY]) if CLIPPED_KEY in total else 0.0
        metrics = {"privacy/epsilon": self.epsilon_after(round + 1), "privacy/delta": self.delta,
                   "privacy/noise_multiplier": self.mechanism.noise_multiplier, "privacy/noise_std": self.noise_std,
                   "privacy/clip": self.clip, "privacy/clipped_fraction": clipped / arrived if arrived else 0.0}
        if self.adaptive:
            metrics.update(self.adapt_clip(arrived - clipped, arrived, gen))
        return out, metrics

    def adapt_clip(self, unclipped: float, arrived: int, gen: torch.Generator) -> dict[str, float]:
        """The next round's clip from this round's noisy count of unclipped updates, as TF Privacy's quantile
        estimator (Andrew et al. 2021): b = clamp((Σ(b_k − ½) + N(0, σ_b²)) / m̃ + ½, 0, 1), divided by the *expected*
        cohort m̃; clip ← clip · exp(−clip_lr · (b − target_quantile)): more updates clipped than the target, and the
        clip grows."""
        noise = self.count_std * float(torch.randn((), generator=gen, dtype=torch.float64)) if self.count_std else 0.0
        share = min(1.0, max(0.0, (unclipped - arrived / 2 + noise) / self.expected_cohort + 0.5))
        self.clip = self.clip * math.exp(-self.clip_lr * (share - self.quantile))
        return {"privacy/unclipped_estimate": share, "privacy/next_clip": self.clip}

    def resume(self, columns: Mapping[str, float]) -> None:
        """Continue after a saved round: its adaptive clip for the next round."""
        if self.adaptive and "privacy/next_clip" in columns:
            self.clip = float(columns["privacy/next_clip"])

    def stop_before(self, round: int) -> bool:
        """Whether round `round` would take epsilon past max_epsilon."""
        return self.max_epsilon is not None and self.epsilon_after(round + 1) > self.max_epsilon
