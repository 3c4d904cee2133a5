"""fedsim: federated-learning simulation on Ray.

The library (this package) is pure PyTorch/numpy and never imports Ray; the actors/ and jobs/ packages
put it on a cluster. The public entry points are below.
"""

__version__ = "0.1.0"

from fedsim.config import RunConfig, load_config  # noqa: E402
from fedsim.errors import ConfigError, DataError, FedsimError  # noqa: E402
from fedsim.results import collect, load  # noqa: E402

__all__ = ["RunConfig", "load_config", "load", "collect", "FedsimError", "ConfigError", "DataError", "__version__"]
