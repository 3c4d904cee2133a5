"""Built-in algorithms; importing this package registers every module in it.

A module that fails to import (a missing optional dependency, say) does not take the others down: its
error is kept and reported when a config asks for an algorithm that is not registered.
"""

import importlib
import pkgutil

from fedsim.algorithms.base import (
    Algorithm,
    Broadcast,
    ClientContext,
    ClientData,
    ClientResult,
    Env,
    Message,
    Phase,
    RoundInfo,
    SummedUpdate,
    algorithm_names,
    get_algorithm,
    import_failures,
    register_algorithm,
)

for _mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
    if not _mod.startswith("_") and _mod != "base":
        try:
            importlib.import_module(f"{__name__}.{_mod}")
        except Exception as _exc:  # kept for get_algorithm's error message
            import_failures[_mod] = f"{type(_exc).__name__}: {_exc}"

__all__ = ["Algorithm", "Broadcast", "ClientContext", "ClientData", "ClientResult", "Env", "Message", "Phase",
           "RoundInfo", "SummedUpdate", "algorithm_names", "get_algorithm", "register_algorithm"]
