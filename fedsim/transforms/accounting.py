"""Epsilon after a run's rounds, from a well-kept accountant library: dp-accounting's PLD and RDP accountants,
prv-accountant's PRV upper bound. Nothing here composes privacy losses by hand.

The event of one round follows how its cohort is drawn (participation.sampling):
- poisson, rate q: `PoissonSampledDpEvent(q, GaussianDpEvent(z))`, add-or-remove-one-client adjacency;
- fixed, m of N without replacement: `SampledWithoutReplacementDpEvent(N, m, GaussianDpEvent(z / 2))` under
  replace-one adjacency (the sum's sensitivity is 2C there), which only the RDP accountant models;
- every client every round (q = 1, or m = N): `GaussianDpEvent(z)`.
"""

from __future__ import annotations

import functools
import logging
import math
from dataclasses import dataclass
from typing import Any

from fedsim.errors import ConfigError

PLD_INTERVAL = 1e-3
"""The PLD accountant's value discretisation: 10-40x faster than dp-accounting's 1e-4 on a run's rounds, its epsilon
0.01% looser (still pessimistic: it never under-reports)."""
MAX_NOISE = 1000.0
"""The largest noise multiplier target_epsilon may solve for: beyond it no model learns."""


@dataclass(frozen=True)
class Mechanism:
    """One round's release: Gaussian noise z·C on the sum of clipped updates of a sampled cohort."""

    noise_multiplier: float
    sampling: str  # "poisson" or "fixed"
    rate: float  # q, for poisson
    population: int  # N
    cohort: int  # m, for fixed

    @property
    def everyone(self) -> bool:
        return self.rate >= 1.0 if self.sampling == "poisson" else self.cohort >= self.population

    def event(self, rounds: int) -> Any:
        import dp_accounting as dpa

        z = self.noise_multiplier
        if self.everyone:
            one = dpa.GaussianDpEvent(z)
        elif self.sampling == "poisson":
            one = dpa.PoissonSampledDpEvent(self.rate, dpa.GaussianDpEvent(z))
        else:
            one = dpa.SampledWithoutReplacementDpEvent(self.population, self.cohort, dpa.GaussianDpEvent(z / 2))
        return dpa.SelfComposedDpEvent(one, rounds)


def check_accountable(mech: Mechanism, accountant: str) -> None:
    """A ConfigError when `accountant` cannot model the cohort sampling (a number it gave would not be a bound)."""
    if mech.sampling == "fixed" and not mech.everyone and accountant != "rdp":
        raise ConfigError(f"privacy.accountant: {accountant} cannot account fixed-size cohorts ({mech.cohort} of "
                          f"{mech.population} clients without replacement); use accountant: rdp, or "
                          "participation.sampling: poisson")


def epsilon(mech: Mechanism, rounds: int, delta: float, accountant: str) -> float:
    """The epsilon at `delta` after `rounds` rounds of `mech` (infinite without noise, 0 after no round)."""
    if rounds <= 0:
        return 0.0
    if mech.noise_multiplier <= 0:
        return math.inf
    if accountant == "prv":
        return _prv_epsilon(mech, rounds, delta)
    if accountant == "rdp":  # RDP composes linearly: T rounds are T times one round's RDP, at every order
        from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

        orders, one = _one_round_rdp(mech)
        return float(compute_epsilon(orders, [rounds * v for v in one], delta)[0])
    if mech.everyone:  # T Gaussians are one of multiplier z/√T: the accountant's own exact composition
        from dp_accounting import pld

        acc = pld.PLDAccountant(value_discretization_interval=PLD_INTERVAL)
        acc.compose(mech.event(rounds))
        return float(acc.get_epsilon(delta))
    return float(_one_round_pld(mech).self_compose(rounds).get_epsilon_for_delta(delta))


@functools.lru_cache(maxsize=64)
def _one_round_rdp(mech: Mechanism) -> tuple[tuple[float, ...], tuple[float, ...]]:
    """(orders, one round's RDP at each) from dp-accounting's RDP accountant (the per-round cost of the accountant:
    0.2 to 0.6 s, paid once per mechanism instead of every round)."""
    from dp_accounting import rdp
    from dp_accounting.privacy_accountant import NeighboringRelation

    replace = mech.sampling == "fixed" and not mech.everyone
    acc = rdp.RdpAccountant(neighboring_relation=NeighboringRelation.REPLACE_ONE if replace
                            else NeighboringRelation.ADD_OR_REMOVE_ONE)
    level = logging.getLogger("absl").level  # dp-accounting logs each RDP order it skips
    logging.getLogger("absl").setLevel(logging.ERROR)
    try:
        acc.compose(mech.event(1))
    finally:
        logging.getLogger("absl").setLevel(level)
    return tuple(acc.orders), tuple(float(v) for v in acc.rdp)


@functools.lru_cache(maxsize=64)
def _one_round_pld(mech: Mechanism) -> Any:
    """One Poisson-subsampled Gaussian round's privacy-loss distribution, as dp-accounting's PLD accountant builds
    it (add-or-remove adjacency); T rounds are its self-composition (0.05 s for 100 rounds, against 0.65 s for the
    accountant's whole event each round)."""
    from dp_accounting.pld import privacy_loss_distribution

    return privacy_loss_distribution.from_gaussian_mechanism(
        standard_deviation=mech.noise_multiplier, value_discretization_interval=PLD_INTERVAL,
        sampling_prob=mech.rate)


def _prv_epsilon(mech: Mechanism, rounds: int, delta: float) -> float:
    from prv_accountant import PRVAccountant
    from prv_accountant.privacy_random_variables import PoissonSubsampledGaussianMechanism

    rate = 1.0 if mech.everyone else mech.rate
    acc = PRVAccountant(prvs=[PoissonSubsampledGaussianMechanism(noise_multiplier=mech.noise_multiplier,
                                                                 sampling_probability=rate)],
                        max_self_compositions=[rounds], eps_error=0.01, delta_error=delta / 1000)
    _, _, upper = acc.compute_epsilon(delta=delta, num_self_compositions=[rounds])
    return float(upper)  # the upper bound, never the estimate


def calibrate(mech: Mechanism, rounds: int, delta: float, accountant: str, target: float) -> float:
    """The smallest noise multiplier (to 0.1%, on the safe side) whose `rounds` rounds spend at most `target`
    epsilon; a ConfigError naming the smallest reachable epsilon when even MAX_NOISE spends more."""
    def spent(z: float) -> float:
        return epsilon(Mechanism(z, mech.sampling, mech.rate, mech.population, mech.cohort), rounds, delta,
                       accountant)

    low, high = 0.0, 1.0
    while spent(high) > target:
        low, high = high, high * 4
        if high > MAX_NOISE:
            least = spent(MAX_NOISE)
            if least > target:
                raise ConfigError(f"privacy.target_epsilon: {target:g} is out of reach in {rounds} rounds at delta "
                                  f"{delta:.3g}: even noise_multiplier {MAX_NOISE:g} spends epsilon {least:.4g}")
            high = MAX_NOISE
            break
    while high - low > 1e-3 * high:
        mid = (low + high) / 2
        low, high = (low, mid) if spent(mid) <= target else (mid, high)
    return high
