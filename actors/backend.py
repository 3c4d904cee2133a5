"""The backend a config asks for: fedsim's local one, or Ray actors (registered as the `ray` entry point of
`fedsim.backends`, so the library finds it without importing this package)."""

from __future__ import annotations


def make_backend(cfg, workers: int | None = None, boot=None):
    """The backend the config asks for; a Ray one starts Ray at once, in the background (or takes over `boot`,
    an actors.boot.RayBoot already under way)."""
    if cfg.runtime.backend == "local":
        from fedsim.runtime.local import LocalBackend

        return LocalBackend(num_workers=workers)
    from actors.boot import RayBoot
    from actors.plugins import job_runtime_env

    # Ray starts while torch and the rest of the backend import; the job ships the run's plugins to its workers
    boot = boot or RayBoot(cfg.runtime.ray_address, job_runtime_env(cfg))
    try:
        from actors.pool import RayBackend
    except BaseException:
        boot.stop(cfg.runtime.startup_timeout_s)
        raise
    return RayBackend(num_workers=workers, boot=boot)
