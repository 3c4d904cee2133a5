"""Optional dependencies: fedsim installs without FAISS or MedMNIST, and what needs one names the extra to add."""

from __future__ import annotations

import importlib
from types import ModuleType

from fedsim.errors import MissingExtraError

DISTRIBUTION = "fedsim-ray"  # the name on the package index; the import name stays fedsim


def install_hint(extra: str) -> str:
    """The command that installs fedsim with `extra`."""
    return f'pip install "{DISTRIBUTION}[{extra}]"'


def require(module: str, extra: str, what: str) -> ModuleType:
    """Import optional dependency `module`, or one MissingExtraError saying that `what` needs the extra `extra`."""
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        if exc.name is not None and exc.name != module and not exc.name.startswith(module + "."):
            first = (str(exc).strip().splitlines() or [""])[0]
            raise MissingExtraError(f"{what} needs {module}, which is installed but fails to import ({first}); "
                                    f"reinstall it: {install_hint(extra)}") from None
        raise MissingExtraError(f"{what} needs {module}, which is not installed: {install_hint(extra)}") from None
