"""fedsim's exception tree: every user-facing failure is one of these, with a one-line message."""

from __future__ import annotations


class FedsimError(Exception):
    """Base of all fedsim errors; the CLI prints its message as one line and exits 2."""

    exit_code = 2


class ConfigError(FedsimError):
    """A config file, key or value is wrong; the message names the key or file."""


class MissingExtraError(FedsimError):
    """An optional dependency a method or dataset needs is not installed; the message names the extra to install."""


class DataError(FedsimError):
    """A dataset or data file is missing or malformed; the message names the file and the fix."""


class CheckpointError(FedsimError):
    """A checkpoint or run folder is missing or unreadable."""


class ResourceError(FedsimError):
    """The cluster cannot host the requested actors; the message names the knob to change."""


class AggregationError(FedsimError):
    """A client result does not match what the server expects (keys, shapes, weights)."""


class AlgorithmError(FedsimError):
    """A method's code breaks the Algorithm contract (a phase naming a handler it lacks, a client state from a method
    whose clients are declared stateless): a fault of the method, not of one client, so the run stops."""


class ClientFailedError(FedsimError):
    """A client step raised: which client, round and phase, and the original error's type, message and the last
    frames of its traceback. Plain strings only, so it pickles across Ray's process boundary unchanged."""

    def __init__(self, client_id: int, round: int, phase: str, error_type: str, error_message: str,
                 traceback: str = "") -> None:
        first = (error_message.strip().splitlines() or [""])[0]
        super().__init__(f"client {client_id} failed in round {round}, phase {phase!r}: {error_type}: {first}")
        self.client_id, self.round, self.phase = client_id, round, phase
        self.error_type, self.error_message, self.traceback = error_type, error_message, traceback

    @classmethod
    def wrap(cls, exc: BaseException, client_id: int, round: int, phase: str, frames: int = 5) -> ClientFailedError:
        """The failure of `client_id` in (`round`, `phase`) that `exc` caused, with its innermost `frames` frames."""
        import traceback

        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__, limit=-frames))
        return cls(client_id, round, phase, type(exc).__name__, str(exc)[:2000], tb[-4000:])

    def __reduce__(self):  # picklable across Ray process boundaries
        return (type(self), (self.client_id, self.round, self.phase, self.error_type, self.error_message,
                             self.traceback))


class RunFailedError(FedsimError):
    """Every client of a round failed, so the run cannot go on: the message names the round and the first client's
    error. Exit code 1: the run was well-formed, its method or data failed."""

    exit_code = 1


class OutOfMemory(FedsimError):
    """A client's training ran out of memory: the run stops (exit 1), its finished rounds kept, and the message
    names the round, the client and the model."""

    exit_code = 1


class CallbackError(FedsimError):
    """A run callback raised; the message names the callback, the hook, the round and the original error."""
