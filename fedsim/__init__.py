"""fedsim: federated-learning simulation on Ray.

The library (this package) is pure PyTorch/numpy and never imports Ray; the actors/ and jobs/ packages
put it on a cluster. The public entry points are below.
"""

__version__ = "0.1.0"

from fedsim.config.schema import RunConfig
from fedsim.errors import ConfigError, DataError, FedsimError  # noqa: E402

# imported on first use: they need pandas (or the registries), which client workers never import
_LAZY = {"collect": "results", "load": "results", "partition_report": "results.partition_report", "run": "api",
         "load_config": "configure"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(f"fedsim.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'fedsim' has no attribute {name!r}")


__all__ = ["RunConfig", "load_config", "run", "load", "collect", "partition_report", "FedsimError", "ConfigError",
           "DataError", "__version__"]
