"""The model zoo: importing this package registers every built-in architecture."""

from fedsim.models.params import count_parameters, state_nbytes
from fedsim.models.registry import Classifier, build_model, model_names, register_model

__all__ = ["Classifier", "build_model", "count_parameters", "model_names", "register_model", "state_nbytes"]


def _register_all() -> None:
    """Import every module of this package, so everything registered anywhere in it is available."""
    import importlib
    import pkgutil

    for mod in sorted(m.name for m in pkgutil.iter_modules(__path__)):
        if not mod.startswith("_"):
            importlib.import_module(f"{__name__}.{mod}")


_register_all()
