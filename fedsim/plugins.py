"""User plugins: modules a config names under `plugins`, imported before anything is built.

A plugin is the user's own code (a `.py` file or a package folder beside the config, or an installed
module). Importing it runs its `register_algorithm` / `register_model` / `register_dataset` /
`register_state` decorators, so the rest of the config may name what it registers. The driver imports
plugins when it loads the config; Ray workers get the files through their runtime environment
(`actors/plugins.py`) and import them by module name before they build anything. Checkpoints never
import anything: a plugin's state classes load because the plugin registered them.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType

from fedsim import registry
from fedsim.errors import ConfigError


@dataclass(frozen=True)
class Plugin:
    """One entry of `plugins`: the module name it is imported as, and its file or package folder (None for
    an installed module, imported from the Python path)."""

    entry: str
    module: str
    path: Path | None


def resolve(entries: object, base: Path) -> list[str]:
    """The `plugins` entries as a resolved config keeps them: the absolute path of a file or package found
    relative to `base` (the config's folder), else the name of an importable module."""
    return [str(p.path) if p.path is not None else p.module for p in _parse(entries, base)]


def parse(entries: object) -> list[Plugin]:
    """Resolved `plugins` entries (see `resolve`) as Plugins; a malformed entry is a ConfigError."""
    return _parse(entries, Path.cwd())


def _parse(entries: object, base: Path) -> list[Plugin]:
    if entries is None:
        return []
    if not isinstance(entries, list) or not all(isinstance(e, str) and e.strip() for e in entries):
        raise ConfigError(f"plugins: expected a list of module names or .py paths, got {entries!r}"[:300])
    out = [_locate(e.strip(), base) for e in entries]
    seen: dict[str, str] = {}
    for p in out:
        if p.module in seen:
            raise ConfigError(f"plugins: {seen[p.module]!r} and {p.entry!r} are both module {p.module!r}")
        seen[p.module] = p.entry
    return out


def _locate(entry: str, base: Path) -> Plugin:
    """Find an entry: a path (`x.py`, `dir/x.py`, a package folder), else a module name that is looked for
    beside the config first, then on the Python path."""
    is_path = entry.endswith(".py") or "/" in entry or "\\" in entry
    if is_path:
        path = (base / Path(entry).expanduser()).resolve()
        if path.is_file() and path.suffix == ".py":
            return Plugin(entry, _module_name(entry, path.stem), path)
        if path.is_dir() and (path / "__init__.py").is_file():
            return Plugin(entry, _module_name(entry, path.name), path)
        name = path.stem if path.suffix == ".py" else path.name
        if name.isidentifier() and _shipped(name, path):  # a run's plugin on a Ray node that has Ray's copy only
            return Plugin(entry, name, path)
        raise ConfigError(f"plugins: {entry!r}: no such .py file or package folder ({path})")
    if not all(part.isidentifier() for part in entry.split(".")):
        raise ConfigError(f"plugins: {entry!r} is neither a module name nor a path to a .py file")
    if "." not in entry:
        for found in (base / f"{entry}.py", base / entry):
            if found.is_file() or (found / "__init__.py").is_file():
                return Plugin(entry, entry, found.resolve())
    try:
        spec = importlib.util.find_spec(entry)
    except (ImportError, ValueError):
        spec = None
    if spec is None:
        raise ConfigError(f"plugins: no module {entry!r}: not beside the config ({base / (entry + '.py')}) "
                          "nor on the Python path")
    return Plugin(entry, entry, None)


def _module_name(entry: str, name: str) -> str:
    if not name.isidentifier():
        raise ConfigError(f"plugins: {entry!r}: {name!r} is not a valid Python module name; rename it")
    return name


def load_plugins(entries: object) -> list[ModuleType]:
    """Import every plugin (resolved entries) in the driver; each must register something. A missing file, an
    error inside the plugin, a module name already taken, or a plugin that registers nothing (or replaces
    something already registered) is one ConfigError naming the entry."""
    plugins = parse(entries)
    if not plugins:
        return []
    for kind in registry.KINDS:  # built-ins first, so a plugin cannot silently replace them
        registry.load_builtins(kind)

    return [_load(p) for p in plugins]


def _load(plugin: Plugin) -> ModuleType:
    loaded = sys.modules.get(plugin.module)
    if loaded is not None:
        if plugin.path is not None and not _same_source(loaded, plugin.path):
            where = getattr(loaded, "__file__", None) or "a built-in module"
            raise ConfigError(f"plugins: {plugin.entry!r}: module name {plugin.module!r} is already taken by "
                              f"{where}; rename the plugin")
        _check_registers(plugin)
        return loaded
    before = registry.snapshot()
    try:
        module = _import(plugin)
    except KeyboardInterrupt:
        raise
    except BaseException as exc:  # the user's code: any failure (SystemExit too) is one line naming the plugin
        registry.restore(before)
        raise ConfigError(f"plugins: {plugin.entry!r} failed to import: {_where(exc, plugin)}"
                          f"{type(exc).__name__}: {_first_line(exc)}") from None
    replaced = [f"{kind} {name!r}" for kind, table in before.items() for name, old in table.items()
                if registry.snapshot()[kind].get(name) is not old]
    if replaced:
        registry.restore(before)
        sys.modules.pop(plugin.module, None)
        raise ConfigError(f"plugins: {plugin.entry!r} registers {', '.join(replaced)}, which fedsim already has; "
                          "give it another name")
    _check_registers(plugin)
    return module


def _import(plugin: Plugin) -> ModuleType:
    if plugin.path is None or not plugin.path.exists():  # an installed module, or Ray's copy of the file
        return importlib.import_module(plugin.module)
    is_package = plugin.path.is_dir()
    source = plugin.path / "__init__.py" if is_package else plugin.path
    spec = importlib.util.spec_from_file_location(plugin.module, source,
                                                  submodule_search_locations=[str(plugin.path)] if is_package
                                                  else None)
    if spec is None or spec.loader is None:
        raise ConfigError(f"plugins: {plugin.entry!r}: cannot be imported from {source}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[plugin.module] = module  # dataclasses and pickle look the module up by name
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop(plugin.module, None)
        raise
    return module


def import_in_worker(entries: object) -> None:
    """Import the run's plugins in a worker process, by module name (the runtime environment put them on the
    path; a path that exists here, on the driver's machine, is the fallback)."""
    for plugin in parse_resolved(entries):
        if plugin.module in sys.modules:
            continue
        try:
            importlib.import_module(plugin.module)
        except ModuleNotFoundError as exc:
            if exc.name != plugin.module or plugin.path is None or not plugin.path.exists():
                raise ConfigError(f"plugins: {plugin.entry!r} cannot be imported on this worker "
                                  f"({type(exc).__name__}: {_first_line(exc)})") from None
            _import(plugin)


def parse_resolved(entries: object) -> list[Plugin]:
    """Resolved entries as Plugins without looking anything up: an absolute path is a file or package, anything
    else a module name (what a worker on another machine can know)."""
    if not entries:
        return []
    out = []
    for e in entries if isinstance(entries, list) else []:
        path = Path(e)
        if path.is_absolute():
            out.append(Plugin(e, path.stem if path.suffix == ".py" else path.name, path))
        else:
            out.append(Plugin(e, e, None))
    return out


def shipped_paths(entries: object) -> list[str]:
    """The files and package folders among resolved entries: what Ray's `py_modules` must carry to workers."""
    return [str(p.path) for p in parse_resolved(entries) if p.path is not None]


def _check_registers(plugin: Plugin) -> None:
    if not registry.registered_by(plugin.module):
        raise ConfigError(f"plugins: {plugin.entry!r} registers nothing; decorate its method with "
                          "fedsim.method.register_algorithm (or a model with register_model, a dataset with "
                          "register_dataset)")


def _same_source(module: ModuleType, path: Path) -> bool:
    """Whether `module` was loaded from the plugin at `path`, or, where `path` does not exist (a Ray node), from a
    file or package of the same name (Ray's copy of it)."""
    file = getattr(module, "__file__", None)
    if not file:
        return False
    source = Path(file).resolve()
    if not path.exists():
        return _copy_of(source, path)
    return source == path.resolve() or source == (path / "__init__.py").resolve()


def _copy_of(source: Path, path: Path) -> bool:
    """Whether the module file `source` is a file or package named like the plugin at `path`."""
    return source.name == path.name if path.suffix == ".py" else (source.name == "__init__.py"
                                                                  and source.parent.name == path.name)


def _shipped(name: str, path: Path) -> bool:
    """Whether module `name` is importable here from a copy of the plugin at `path` (Ray's py_modules)."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return False
    return spec is not None and spec.origin is not None and _copy_of(Path(spec.origin), path)


def _where(exc: BaseException, plugin: Plugin) -> str:
    """'file.py line N: ' for the innermost frame of the traceback inside the plugin, else ''."""
    import traceback

    if isinstance(exc, SyntaxError) and exc.filename:
        return f"{Path(exc.filename).name} line {exc.lineno}: "
    root = str(plugin.path) if plugin.path is not None else None
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if root and f.filename.startswith(root)]
    return f"{Path(frames[-1].filename).name} line {frames[-1].lineno}: " if frames else ""


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0][:300] if lines else ""
