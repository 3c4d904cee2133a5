"""Shared check for a method's mechanism columns (fedsim.method.mechanism): run a tiny config with the columns on and
off, require every documented column (and no undocumented one), and the same training numbers either way."""

from __future__ import annotations

import math

import pandas as pd

from fedsim.method.contract import get_algorithm
from fedsim.method.mechanism import PREFIX
from fedsim.results.tables import load
from fedsim.runtime.loop import run
from tests.conftest import small_config


def _training_columns(df: pd.DataFrame) -> pd.DataFrame:
    """Every column but wall-clock times (they end in _s) and the mechanism columns."""
    keep = [c for c in df.columns if not c.endswith("_s") and PREFIX not in c]
    return df[keep].reset_index(drop=True)


def check_mechanism(tmp_path, algorithm: str, *overrides: str, rounds: int = 2) -> pd.DataFrame:
    """Run `algorithm` twice (mechanism columns on, then off); return the rounds table of the first run."""
    documented = get_algorithm(algorithm).mechanism_columns
    assert documented, f"{algorithm} documents no mechanism columns"
    args = [f"algorithm.name={algorithm}", *overrides]
    on = load(run(small_config(tmp_path / "on", *args, rounds=rounds)))["rounds"]
    off = load(run(small_config(tmp_path / "off", *args, "eval.mechanism=false", rounds=rounds)))["rounds"]
    reported = {c for c in on.columns if PREFIX in c}
    assert reported == set(documented), (f"undocumented: {sorted(reported - set(documented))}, "
                                         f"missing: {sorted(set(documented) - reported)}")
    for col in documented:
        values = [v for v in on[col] if not (isinstance(v, float) and math.isnan(v))]
        assert values, f"{col} is never measured in {rounds} rounds"
    assert not [c for c in off.columns if PREFIX in c], "eval.mechanism=false still reports mechanism columns"
    pd.testing.assert_frame_equal(_training_columns(on), _training_columns(off))
    return on
