"""Ray actors: ClientWorker (many virtual clients per actor) and ServerActor, and the RayBackend."""

from actors.pool import RayBackend, size_pool

__all__ = ["RayBackend", "size_pool"]
