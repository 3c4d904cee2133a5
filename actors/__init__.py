"""Ray actors: ClientWorker (many virtual clients per actor) and ServerActor, and the RayBackend.

The backend is imported on first use, so that `actors.boot` can start Ray before torch is imported."""

from typing import Any

__all__ = ["RayBackend", "size_pool"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from actors import pool

        return getattr(pool, name)
    raise AttributeError(f"module 'actors' has no attribute {name!r}")
