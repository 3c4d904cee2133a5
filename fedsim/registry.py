"""Every name a config can use, in one place: algorithms, state classes, datasets and models.

The tables live here; `fedsim.method`'s `register_*` decorators fill them, and configs, checkpoints and plugins
look names up through this module's functions. Built-in algorithms are imported the first time a name is looked
up (importing the authoring kit imports no method); built-in datasets and models register when their packages
are imported.
"""

from __future__ import annotations

import importlib
import importlib.util
import pkgutil
from typing import Any

KINDS = ("algorithm", "state class", "dataset", "model")
_TABLES: dict[str, dict[str, Any]] = {kind: {} for kind in KINDS}
_BUILTIN_PACKAGES = {"algorithm": "fedsim.algorithms", "state class": "fedsim.algorithms",
                     "dataset": "fedsim.data", "model": "fedsim.models"}
_loaded: set[str] = set()
import_failures: dict[str, str] = {}  # built-in module -> its import error, named when a lookup fails


def table(kind: str) -> dict[str, Any]:
    """The live table of `kind` (one of KINDS): name -> registered object."""
    return _TABLES[kind]


def register(kind: str, name: str, obj: Any) -> None:
    """Make `obj` available under `name`; a module imported again replaces its own entry."""
    _TABLES[kind][name] = obj


def lookup(kind: str, name: str) -> Any | None:
    """The object registered under `name`, importing the built-ins of `kind` first if it is not there yet: the
    module of that name alone where there is one (fedsim.algorithms.fedavg for fedavg), else all of them."""
    if name not in _TABLES[kind] and kind == "algorithm" and name.isidentifier() and not name.startswith("_"):
        module = f"{_BUILTIN_PACKAGES[kind]}.{name}"
        try:
            if importlib.util.find_spec(module) is not None:
                importlib.import_module(module)
        except Exception as exc:  # named by the lookup below, which then tries every module
            import_failures[module] = f"{type(exc).__name__}: {exc}"
    if name not in _TABLES[kind]:
        load_builtins(kind)
    return _TABLES[kind].get(name)


def names(kind: str) -> list[str]:
    """Every name of `kind`, built-ins included, sorted."""
    load_builtins(kind)
    return sorted(_TABLES[kind])


def load_builtins(kind: str) -> None:
    """Import every public module of the built-in package for `kind` (once); a module that fails to import is kept
    in `import_failures`, so the others still register."""
    package = _BUILTIN_PACKAGES[kind]
    if package in _loaded:
        return
    _loaded.add(package)
    pkg = importlib.import_module(package)
    for info in sorted(pkgutil.iter_modules(pkg.__path__), key=lambda m: m.name):
        if not info.name.startswith("_"):
            try:
                importlib.import_module(f"{package}.{info.name}")
            except Exception as exc:  # named by the lookup that misses its names
                import_failures[f"{package}.{info.name}"] = f"{type(exc).__name__}: {exc}"


def snapshot() -> dict[str, dict[str, Any]]:
    """Copies of every table, for `restore` after a plugin that failed half-way."""
    return {kind: dict(t) for kind, t in _TABLES.items()}


def restore(saved: dict[str, dict[str, Any]]) -> None:
    """Put every table back as `snapshot` saw it."""
    for kind, t in _TABLES.items():
        t.clear()
        t.update(saved[kind])


def registered_by(module: str) -> list[str]:
    """What `module` (or a submodule of it) registered, as 'kind name' strings."""
    out = []
    for kind, t in _TABLES.items():
        for name, obj in t.items():
            owner = getattr(obj, "__module__", "") or ""
            if owner == module or owner.startswith(module + "."):
                out.append(f"{kind} {name}")
    return out
