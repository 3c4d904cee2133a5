"""`fedsim.run`: one call that runs (or resumes) a simulation from Python, as `fedsim run` does from a shell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from fedsim.config.knobs import shown
from fedsim.config.limits import MAX_WORKERS
from fedsim.config.schema import RunConfig, apply_overrides, check_overrides, config_to_dict
from fedsim.configure import build_with_plugins, load_config
from fedsim.errors import ConfigError
from fedsim.persist.storage import Location, location
from fedsim.plugins import PluginSources

if TYPE_CHECKING:
    from fedsim.runtime.backend import Backend
    from fedsim.runtime.callbacks import Callback


def resolve_config(config: str | Path | RunConfig | Mapping[str, Any] | None,
                   overrides: Sequence[str] = ()) -> RunConfig:
    """A RunConfig from a YAML path, a RunConfig (copied, never changed) or a dict shaped like the YAML, with
    `-o`-style overrides ("train.lr=0.01") applied; None gives the defaults."""
    check_overrides(overrides, "fedsim.run: overrides")
    if isinstance(config, RunConfig):  # built again from its values: fields set after it was loaded are checked too
        try:
            raw = config_to_dict(config)
        except Exception as exc:
            raise ConfigError(f"fedsim.run: the RunConfig cannot be read back ({type(exc).__name__}: {exc})"[:300]) \
                from None
        return build_with_plugins(apply_overrides(raw, list(overrides)), Path.cwd())
    if isinstance(config, Mapping):  # relative plugin paths start at the working directory, as for `-o`
        return build_with_plugins(apply_overrides(dict(config), list(overrides)), Path.cwd())
    if config is None or isinstance(config, (str, Path)):
        return load_config(config, list(overrides))
    raise ConfigError(f"fedsim.run: config must be a YAML path, a RunConfig or a dict, got {type(config).__name__}")


def _check_arguments(workers: Any, callbacks: Any, backend: Any) -> None:
    """fedsim.run's own arguments, each refused in one line before anything starts."""
    if workers is not None and (isinstance(workers, bool) or not isinstance(workers, int)
                                or not 1 <= workers <= MAX_WORKERS):
        raise ConfigError(f"fedsim.run: workers must be an integer from 1 to {MAX_WORKERS} (or None), "
                          f"got {shown(workers)}")
    if isinstance(callbacks, (str, bytes)) or not isinstance(callbacks, (list, tuple)):
        raise ConfigError(f"fedsim.run: callbacks must be a list of Callback objects, got {shown(callbacks)}")
    if backend is not None and not isinstance(backend, str) and not all(
            callable(getattr(backend, name, None)) for name in ("start", "run_phase", "shutdown")):
        raise ConfigError(f"fedsim.run: backend must be 'local', 'ray' or a Backend, got {shown(backend)}")


def run(config: str | Path | RunConfig | Mapping[str, Any] | None = None, overrides: Sequence[str] = (), *,
        backend: str | Backend | None = None, workers: int | None = None, callbacks: Sequence[Callback] = (),
        resume: str | Path | None = None, progress: bool = False, plugins: Sequence[str | Path] = (),
        trust_run_plugins: bool = False) -> Location:
    """Run a simulation and return its run folder (tables, config, meta.json, checkpoints): a Path, or a
    fedsim.persist.storage.StorePath when results.root (or `resume`) is a URI such as s3://bucket/prefix.

    config: a YAML path, a RunConfig or a dict shaped like the YAML; overrides: "key=value" strings as `-o` takes.
    backend: "local" or "ray" (overrides runtime.backend), or a Backend you built; Ray is imported only for "ray".
    workers: client workers (default: as many as fit). callbacks: yours (fedsim.runtime.callbacks.Callback), called
    after the trackers of `tracking:` ran; `on_round_end(round, rows)` gets every global model's row in
    `rows.rounds` (the round's files are written by then; a table of a long run keeps its latest rows in a tail
    file until the end, which fedsim.load joins to it).
    resume: a run folder to continue instead (it keeps its saved config, so `config` and `overrides` must be left
    out). plugins, trust_run_plugins: where a resumed run may import the plugins its folder names besides their
    recorded paths (your own copies of them; the run folder's copies), as `--plugins` and `--trust-run-plugins`
    (docs/trust.md). progress: a progress bar on stderr.
    Bad input raises a fedsim.FedsimError with a one-line message.
    """
    from fedsim.runtime.callbacks import ProgressBar
    from fedsim.runtime.loop import run as run_loop
    from fedsim.runtime.rundir import resume_config

    _check_arguments(workers, callbacks, backend)
    if resume is not None:
        if config is not None or overrides:
            raise ConfigError(f"fedsim.run: resume={str(resume)!r} keeps the run's saved config; leave config and "
                              "overrides out")
        sources = PluginSources(tuple(Path(p) for p in plugins), trust_run_plugins)
        cfg = resume_config(location(resume, "resume"), sources)
    else:
        if plugins or trust_run_plugins:
            raise ConfigError("fedsim.run: plugins and trust_run_plugins go with resume; a new run names its plugins "
                              "in its config")
        sources = None
        cfg = resolve_config(config, overrides)
    if isinstance(backend, str):
        if backend not in ("local", "ray"):
            raise ConfigError(f"fedsim.run: backend must be 'local', 'ray' or a Backend, got {backend!r}")
        cfg.runtime.backend = backend  # type: ignore[assignment]  # checked just above
    engine: Backend = backend if backend is not None and not isinstance(backend, str) else make_backend(cfg, workers)
    hooks = [*callbacks, *([ProgressBar()] if progress else [])]
    return run_loop(None if resume is not None else cfg, backend=engine, resume=resume, callbacks=hooks,
                    plugin_sources=sources)


def make_backend(cfg: RunConfig, workers: int | None = None) -> Backend:
    """The backend `runtime.backend` names: fedsim's local one, or one registered under the `fedsim.backends` entry
    point group (the Ray backend of this project's `actors` package registers as `ray`), so the library never
    imports Ray itself."""
    from importlib.metadata import entry_points

    if cfg.runtime.backend == "local":
        from fedsim.runtime.local import LocalBackend

        return LocalBackend(num_workers=workers)
    found = [ep for ep in entry_points(group="fedsim.backends") if ep.name == cfg.runtime.backend]
    if not found:
        raise ConfigError(f"runtime.backend: no backend {cfg.runtime.backend!r} is installed (the fedsim.backends "
                          "entry points; reinstall with `pip install -e .`)")
    return found[0].load()(cfg, workers)
