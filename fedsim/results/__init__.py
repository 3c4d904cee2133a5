"""A run's tables as DataFrames: `load` one run folder, `collect` many (with their configs as columns)."""

from fedsim.results.tables import collect, load

__all__ = ["collect", "load"]
