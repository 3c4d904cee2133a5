"""User plugins: modules a config names under `plugins`, imported before anything is built.

A plugin is the user's own code (a `.py` file or a package folder beside the config, or an installed
module). Importing it runs its `register_algorithm` / `register_model` / `register_dataset` /
`register_state` decorators, so the rest of the config may name what it registers. The driver imports
plugins when it loads the config; Ray workers get the files through their runtime environment
(`actors/plugins.py`) and import them by module name before they build anything. Checkpoints never
import anything: a plugin's state classes load because the plugin registered them.

A run folder is data, never code. A new run records each plugin's module name and SHA-256 (its identity, never
its path) and keeps a copy of it in the folder (`record`); a resumed run imports only what the user has, with the
SHA-256 the run recorded: an installed module, a file the user names (`--plugins FILE`), or the file at the
recorded path; the run folder's own copy only when the user says so (`--trust-run-plugins`). See `for_resume` and
docs/trust.md.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.util
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

from fedsim import registry
from fedsim.errors import ConfigError

if TYPE_CHECKING:
    from fedsim.persist.storage import Location


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
    if _is_path(entry):
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


RUN_COPIES = "plugins"  # a run folder's copies of its file plugins


@dataclass(frozen=True)
class PluginSources:
    """Where a resumed run may take the plugins its folder names, beyond their recorded paths: the user's own files
    (`--plugins FILE`, matched by module name) and, only when asked (`--trust-run-plugins`), the run folder's
    copies."""

    files: tuple[Path, ...] = ()
    trust_run_copies: bool = False


def source_sha256(path: Path) -> str:
    """The SHA-256 of a plugin: a file's bytes, or a package folder's files (names and bytes; no __pycache__)."""
    if path.is_file():
        return hashlib.sha256(path.read_bytes()).hexdigest()
    digest = hashlib.sha256()
    for f in _package_files(path):
        digest.update(f.relative_to(path).as_posix().encode() + b"\0" + hashlib.sha256(f.read_bytes()).digest())
    return digest.hexdigest()


def _package_files(folder: Path) -> list[Path]:
    return sorted(f for f in folder.rglob("*") if f.is_file() and "__pycache__" not in f.relative_to(folder).parts)


def record(entries: object, run_dir: Location) -> dict[str, dict[str, str]]:
    """Copy a new run's file and package plugins (resolved entries) into `run_dir/plugins/`, and return what the
    run's manifest keeps of each, by entry: its module name, SHA-256 and the copy's place in the folder."""
    from fedsim.persist.io import atomic_write_bytes

    out = {}
    for plugin in parse_resolved(entries):
        source = plugin.path if plugin.path is not None else _origin(plugin.module)
        if source is None or not source.exists():
            continue
        copy = f"{RUN_COPIES}/{source.name}"
        files = [source] if source.is_file() else _package_files(source)
        for f in files:
            atomic_write_bytes(run_dir / (copy if f == source else f"{copy}/{f.relative_to(source)}"), f.read_bytes())
        out[plugin.entry] = {"module": plugin.module, "sha256": source_sha256(source), "copy": copy}
    return out


def _origin(module: str) -> Path | None:
    """An installed module's source: its .py file, or its package folder (None for a built-in or namespace one)."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin or not spec.origin.endswith(".py"):
        return None
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def short(sha256: str) -> str:
    """A SHA-256 as people compare it: its first 12 hex digits."""
    return sha256[:12]


def identities(entries: object, recorded: dict | None = None) -> list[str]:
    """What a run folder's `plugins` entries are, by what its manifest `recorded`: 'module@<sha256, 12 digits>', or
    the entry as written where it recorded none. Runs are compared by these, never by path (collect, sweeps). Reads
    nothing and imports nothing: a run folder is data."""
    out = []
    for entry in entries if isinstance(entries, list) else []:
        kept = (recorded or {}).get(entry) if isinstance(entry, str) else None
        if isinstance(kept, dict) and isinstance(kept.get("module"), str) and isinstance(kept.get("sha256"), str):
            out.append(f"{kept['module']}@{short(kept['sha256'])}")
        else:
            out.append(str(entry))
    return out


def own_identities(entries: object) -> list[str]:
    """`identities` of the user's own resolved `plugins` (a config about to run): each file's, package's or
    installed module's SHA-256 as `record` will keep it."""
    out = []
    for plugin in parse_resolved(entries):
        source = plugin.path if plugin.path is not None else _origin(plugin.module)
        out.append(f"{plugin.module}@{short(source_sha256(source))}" if source is not None and source.exists()
                   else plugin.entry)
    return out


def for_resume(entries: object, recorded: dict, run_dir: Location, sources: PluginSources) -> list[str]:
    """The plugins a resumed run imports for the `plugins` its folder names: each a module installed here (not
    inside the run folder), or a file whose SHA-256 is the one the run recorded: the user's own (`sources.files`),
    the run folder's copy (only with `sources.trust_run_copies`), or the file at the recorded absolute path (outside
    the run folder). Anything else is a ConfigError naming the plugin (and both SHA-256s) and how to allow it;
    nothing is imported here."""
    if not isinstance(entries, list) or not all(isinstance(e, str) and e.strip() for e in entries):
        raise ConfigError(f"plugins: expected a list of module names or .py paths, got {entries!r}"[:300])
    given = {_module_name(str(f), f.stem if f.suffix == ".py" else f.name): f for f in sources.files}
    named = {kept.get("module") for e, kept in recorded.items() if e in entries and isinstance(kept, dict)}
    unused = sorted(set(given) - named)
    if unused:
        raise ConfigError(f"--plugins {given[unused[0]]}: names no plugin of this run (its plugins: "
                          f"{', '.join(entries) or 'none'})")
    chosen = []
    for entry in entries:
        if not _is_path(entry):
            chosen.append(_installed(entry, run_dir, recorded.get(entry)))
            continue
        if not Path(entry).is_absolute():
            raise ConfigError(f"plugins: {entry!r} is a relative path, which a run never records (its configs name "
                              "plugins by absolute path): the run folder was edited; nothing imported")
        kept = recorded.get(entry)
        if not isinstance(kept, dict) or not all(isinstance(kept.get(k), str) for k in ("module", "sha256", "copy")):
            raise ConfigError(f"plugins: {entry!r}: the run recorded no SHA-256 for it, so it is not a plugin the run "
                              "started with; nothing imported")
        chosen.append(str(_source(entry, kept, given, run_dir, sources)))
    return chosen


def _changed(entry: str, where: str, path: Path, found: str, kept: dict) -> ConfigError:
    return ConfigError(f"plugins: {entry!r}: {where} {path} is not the file the run started with (SHA-256 "
                       f"{short(found)}, the run recorded {short(kept['sha256'])}); {_how_to_allow(kept)}")


def _is_path(entry: str) -> bool:
    return entry.endswith(".py") or "/" in entry or "\\" in entry


def _installed(entry: str, run_dir: Location, kept: object) -> str:
    """A module-name entry, found where the config loader will look for it, never inside the run folder, and with
    the SHA-256 the run recorded for it (if it recorded one)."""
    origin = _locate(entry, Path.cwd()).path or _origin(entry)
    if origin is not None and isinstance(run_dir, Path) and origin.resolve().is_relative_to(run_dir.resolve()):
        raise ConfigError(f"plugins: {entry!r} would be imported from inside the run folder ({origin}); a run's files "
                          "are data, not code; nothing imported")
    if origin is not None and isinstance(kept, dict) and isinstance(kept.get("sha256"), str):
        found = source_sha256(origin)
        if found != kept["sha256"]:
            raise ConfigError(f"plugins: {entry!r}: module {entry} here ({origin}) is not the one the run started with "
                              f"(SHA-256 {short(found)}, the run recorded {short(kept['sha256'])}); install that "
                              "version, or start a new run")
    return entry


def _source(entry: str, kept: dict, given: dict[str, Path], run_dir: Location, sources: PluginSources) -> Path:
    """The file to import for a recorded plugin, by the order in `for_resume`, checked for the recorded SHA-256."""
    if kept["module"] in given:
        mine = given[kept["module"]].resolve()
        if not mine.exists():
            raise ConfigError(f"--plugins {given[kept['module']]}: no such file or package folder")
        return _checked(entry, "--plugins", mine, kept)
    if sources.trust_run_copies:
        parts = Path(kept["copy"]).parts
        if len(parts) != 2 or parts[0] != RUN_COPIES or parts[1] in ("..", "."):  # a copy fedsim made, nothing else
            raise ConfigError(f"plugins: {entry!r}: the manifest puts its copy at {kept['copy']!r}, outside the run "
                              f"folder's {RUN_COPIES}/; nothing imported")
        copy = run_dir / kept["copy"]
        if not copy.exists():
            raise ConfigError(f"plugins: {entry!r}: --trust-run-plugins: the run folder has no copy of it ({copy})")
        return _checked(entry, "the run folder's copy", _local(copy), kept)
    path = Path(entry)
    if isinstance(run_dir, Path) and path.resolve().is_relative_to(run_dir.resolve()):
        raise ConfigError(f"plugins: {entry!r} lies inside the run folder; a run's files are data, not code: "
                          f"{_how_to_allow(kept)}")
    if not path.exists():  # a job's plugin was Ray's temporary copy: the user names theirs with --plugins
        raise ConfigError(f"plugins: {entry!r}: no such file here; {_how_to_allow(kept)}")
    return _checked(entry, "the file at", path, kept)


def _checked(entry: str, where: str, path: Path, kept: dict) -> Path:
    found = source_sha256(path)
    if found != kept["sha256"]:
        raise _changed(entry, where, path, found, kept)
    return path


def _how_to_allow(kept: dict) -> str:
    return (f"to allow it, pass --plugins FILE (your copy of {kept['module']}, as the run started with it) or "
            f"--trust-run-plugins (import the run folder's copy, {kept['copy']})")


_DOWNLOADED: dict[str, Path] = {}  # a store's plugin copies, downloaded once a process (a module keeps its file)


def _local(copy: Location) -> Path:
    """A run folder's copy of a plugin as a local path (a copy in a store is downloaded to a temporary folder)."""
    if isinstance(copy, Path):
        return copy
    if str(copy) in _DOWNLOADED:
        return _DOWNLOADED[str(copy)]
    import tempfile

    from fedsim.persist.storage import StorePath

    local = _DOWNLOADED[str(copy)] = Path(tempfile.mkdtemp(prefix="fedsim-plugins-")) / copy.name
    if copy.is_file():
        local.write_bytes(copy.read_bytes())
        return local
    for found in copy.fs.find(copy.path):
        target = local / found[len(copy.path):].lstrip("/")
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(StorePath(copy.fs, found, copy.scheme).read_bytes())
    return local
