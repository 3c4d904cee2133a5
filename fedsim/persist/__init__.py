"""Persistence: atomic writes, local paths and fsspec URIs, and checkpoints of registered state classes."""
