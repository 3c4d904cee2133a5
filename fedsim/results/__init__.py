"""A run's tables as DataFrames: `load` one run folder, `collect` many (with their configs as columns), and the
partition report of one (`partition_report`)."""

from fedsim.results.partition_report import PartitionReport, partition_report
from fedsim.results.tables import collect, load

__all__ = ["collect", "load", "partition_report", "PartitionReport"]
