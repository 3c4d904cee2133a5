"""A sweep file's random search space: distributions named in YAML, drawn with Ray Tune's samplers.

    space:
      train.lr: {loguniform: [0.001, 0.1]}
      train.momentum: {uniform: [0.0, 0.9]}
      train.epochs: {randint: [1, 4]}          # 1, 2 or 3: the upper end is left out
      model.name: {choice: [cnn, mlp]}
    samples: 4                                  # settings drawn from the space
    space_seed: 0                               # the draws' seed

The draws are made once, in the driver, from `space_seed`: every seed of a setting trains the same values,
a resumed or rerun sweep draws the same settings, and the table can average a setting over its seeds.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import numpy as np

from fedsim.errors import ConfigError

KINDS = ("choice", "uniform", "loguniform", "randint")
INT64 = (-(2**63), 2**63 - 1)  # what randint can draw between


def _bounds(key: str, kind: str, arg: Any, integer: bool = False) -> tuple[float, float]:
    where = f"space.{key}.{kind}"
    if not (isinstance(arg, list) and len(arg) == 2 and all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                           and math.isfinite(v) for v in arg)):
        raise ConfigError(f"{where}: expected [low, high] (two finite numbers), got {arg!r}")
    low, high = arg
    if integer and not all(float(v).is_integer() for v in arg):
        raise ConfigError(f"{where}: expected two integers, got {arg!r}")
    if not low < high:
        raise ConfigError(f"{where}: low must be below high, got {arg!r}")
    if kind == "loguniform" and low < sys.float_info.min:  # subnormal lows lose their precision on a log scale
        raise ConfigError(f"{where}: low must be > 0 on a log scale (at least {sys.float_info.min:.3g}), got {low!r}")
    if integer and not (INT64[0] <= low and high <= INT64[1]):
        raise ConfigError(f"{where}: bounds must lie within 64-bit integers, got {arg!r}")
    if kind == "uniform" and not math.isfinite(high - low):
        raise ConfigError(f"{where}: high - low must be a finite number, got {arg!r}")
    return low, high


def domain(key: str, spec: Any) -> Any:
    """The Ray Tune domain of one space entry, e.g. {loguniform: [0.001, 0.1]}; a bad entry is a ConfigError."""
    from ray import tune

    if not (isinstance(spec, dict) and len(spec) == 1 and next(iter(spec)) in KINDS):
        raise ConfigError(f"space.{key}: expected one of {', '.join('{' + k + ': ...}' for k in KINDS)}, "
                          f"got {spec!r}")
    kind, arg = next(iter(spec.items()))
    if kind == "choice":
        if not isinstance(arg, list) or not arg:
            raise ConfigError(f"space.{key}.choice: expected a non-empty list of values, got {arg!r}")
        return tune.choice(arg)
    if kind == "randint":
        low, high = _bounds(key, kind, arg, integer=True)
        return tune.randint(int(low), int(high))
    low, high = _bounds(key, kind, arg)
    return tune.uniform(low, high) if kind == "uniform" else tune.loguniform(low, high)


def draw(space: dict[str, Any], samples: int, seed: int) -> list[dict[str, Any]]:
    """`samples` settings drawn from the space in key order, from one stream seeded by `seed` ([{}] if empty)."""
    if not space:
        return [{}]
    domains = {key: domain(key, spec) for key, spec in space.items()}
    rng = np.random.default_rng(seed)
    return [{key: _plain(d.sample(random_state=rng)) for key, d in domains.items()} for _ in range(samples)]


def _plain(value: Any) -> Any:
    """A drawn value as a plain Python value (numpy scalars become int or float)."""
    return value.item() if isinstance(value, np.generic) else value


def override(key: str, value: Any) -> str:
    """`key=value` for a drawn value, spelled so the config parser reads back the same value (JSON is YAML)."""
    return f"{key}={json.dumps(value)}"
