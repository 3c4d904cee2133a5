"""fedsim: federated-learning simulation on Ray.

The library (this package) is pure PyTorch/numpy and never imports Ray; the actors/ and jobs/ packages
put it on a cluster. The public entry points are below.
"""

__version__ = "0.1.0"

from fedsim.config import RunConfig, load_config  # noqa: E402
from fedsim.errors import ConfigError, DataError, FedsimError  # noqa: E402

_LAZY = {"collect", "load"}  # results readers need pandas, which client workers never import


def __getattr__(name: str):
    if name in _LAZY:
        from fedsim import results

        return getattr(results, name)
    raise AttributeError(f"module 'fedsim' has no attribute {name!r}")


__all__ = ["RunConfig", "load_config", "load", "collect", "FedsimError", "ConfigError", "DataError", "__version__"]
