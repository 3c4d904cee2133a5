"""fedsim's data layer: named dataset loaders (registered on import) and client partitioning."""

from fedsim.data import datasets as _datasets  # noqa: F401  (registers the built-in loaders)
from fedsim.data.partition import (
    client_test_shards,
    label_histograms,
    partition,
    split_validation,
)
from fedsim.data.registry import Dataset, dataset_names, load_dataset, register_dataset

__all__ = [
    "Dataset",
    "client_test_shards",
    "dataset_names",
    "label_histograms",
    "load_dataset",
    "partition",
    "register_dataset",
    "split_validation",
]
