"""Built-in algorithms; importing this package registers every module in it."""

import importlib
import pkgutil

from fedsim.algorithms.base import (Algorithm, Broadcast, ClientContext, ClientData, ClientResult, Env, Phase,
                                    RoundInfo, SummedUpdate, algorithm_names, get_algorithm, register_algorithm)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _mod.startswith("_") and _mod != "base":
        importlib.import_module(f"{__name__}.{_mod}")

__all__ = ["Algorithm", "Broadcast", "ClientContext", "ClientData", "ClientResult", "Env", "Phase", "RoundInfo",
           "SummedUpdate", "algorithm_names", "get_algorithm", "register_algorithm"]
