"""fedsim's exception tree: every user-facing failure is one of these, with a one-line message."""

from __future__ import annotations


class FedsimError(Exception):
    """Base of all fedsim errors; the CLI prints its message as one line and exits 2."""

    exit_code = 2


class ConfigError(FedsimError):
    """A config file, key or value is wrong; the message names the key or file."""


class DataError(FedsimError):
    """A dataset or data file is missing or malformed; the message names the file and the fix."""


class CheckpointError(FedsimError):
    """A checkpoint or run folder is missing or unreadable."""


class ResourceError(FedsimError):
    """The cluster cannot host the requested actors; the message names the knob to change."""


class AggregationError(FedsimError):
    """A client result does not match what the server expects (keys, shapes, weights)."""


class ClientFailedError(FedsimError):
    """A client step raised; carries round, client id and stage so the failure can be attributed."""

    def __init__(self, message: str, round: int = -1, client_id: int = -1, stage: str = "") -> None:
        super().__init__(message)
        self.round, self.client_id, self.stage = round, client_id, stage

    def __reduce__(self):  # picklable across Ray process boundaries
        return (type(self), (self.args[0], self.round, self.client_id, self.stage))
