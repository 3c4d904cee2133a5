"""fedsim's data layer: named dataset loaders (registered on import) and client partitioning."""

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


def _register_all() -> None:
    """Import every module of this package, so everything registered anywhere in it is available."""
    import importlib
    import pkgutil

    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not mod.startswith("_"):
            importlib.import_module(f"{__name__}.{mod}")


_register_all()
