"""Checkpoints that load with `torch.load(weights_only=True)`: dataclasses and arrays packed as plain data.

A checkpoint is data, never code: it names its dataclasses by tag, and loading rebuilds only the classes
registered with `register_state`, from their own fields, so a crafted file cannot make fedsim call anything else.

A run's checkpoints carry their integrity and identity in `checkpoints/manifest.json`: the run's id (its run.json),
seed, the SHA-256 of the config it started with, and the SHA-256 and round of `last.pt`. torch.load does not check
a file's CRCs, so one flipped bit in a tensor would load; the manifest catches it, and a checkpoint or config copied
in from another run, before anything is loaded. A new checkpoint is listed beside the old one before it replaces it,
and alone after, so a run killed at any moment leaves a manifest that vouches for the file there. The manifest is a
checksum, not a signature: whoever can write the folder can rewrite it too (docs/trust.md).
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import json
from typing import Any, TypeVar

import numpy as np
import torch

from fedsim import registry
from fedsim.errors import CheckpointError
from fedsim.persist.io import atomic_torch_save, atomic_write, atomic_write_text
from fedsim.persist.storage import Location, StorePath

_CLS, _ND = "__dataclass__", "__ndarray__"
_STATES: dict[str, type] = registry.table("state class")
T = TypeVar("T", bound=type)


def state_tag(cls: type) -> str:
    """The name a checkpoint stores for a dataclass: 'module:qualname'."""
    return f"{cls.__module__}:{cls.__qualname__}"


def register_state(cls: T) -> T:
    """Allow dataclass `cls` in checkpoints and spilled client states; use it as a class decorator.

    Only registered classes are packed and rebuilt, so every dataclass an algorithm keeps in its server or
    client state must be registered; a plugin registers its own state classes the same way.
    """
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise TypeError(f"register_state takes a dataclass, got {cls!r}")
    _STATES[state_tag(cls)] = cls  # a re-imported module replaces its own entry
    return cls


def register_state_alias(tag: str, cls: type) -> None:
    """Accept an older tag for registered `cls`, so checkpoints written before a class moved still load."""
    if state_tag(cls) not in _STATES:
        raise TypeError(f"register_state_alias: {cls!r} is not registered")
    _STATES[tag] = cls


def registered_states() -> dict[str, type]:
    """Every class a checkpoint may name, by tag."""
    _register_builtin_states()
    return dict(_STATES)


def _register_builtin_states() -> None:
    registry.load_builtins("state class")  # the built-in methods' modules register their state classes


def pack(obj: Any) -> Any:
    """Registered dataclasses -> tagged dicts, numpy arrays -> tagged tensors, recursively."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        cls = type(obj)
        tag = state_tag(cls)
        if _STATES.get(tag) is not cls:
            raise TypeError(f"{tag} is not a registered state class; decorate it with @register_state "
                            "(fedsim.method)")
        return {_CLS: tag, **{f.name: pack(getattr(obj, f.name)) for f in dataclasses.fields(obj)}}
    if isinstance(obj, np.ndarray):
        return {_ND: torch.from_numpy(np.ascontiguousarray(obj))}
    if isinstance(obj, np.generic):
        return obj.item()
    if isinstance(obj, dict):
        return {k: pack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(pack(v) for v in obj)
    return obj


def unpack(obj: Any) -> Any:
    """Inverse of pack; rebuilds only registered classes, anything else is a CheckpointError."""
    _register_builtin_states()
    return _unpack(obj)


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _unpack(obj: Any) -> Any:
    if isinstance(obj, dict):
        if _ND in obj:
            if len(obj) != 1 or not isinstance(obj[_ND], torch.Tensor):
                raise CheckpointError("has a malformed array entry")
            return obj[_ND].numpy()
        if _CLS in obj:
            return _rebuild(obj)
        return {k: _unpack(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(_unpack(v) for v in obj)
    return obj


def _rebuild(obj: dict) -> Any:
    tag = obj[_CLS]
    cls = _STATES.get(tag) if isinstance(tag, str) else None
    if cls is None:
        raise CheckpointError(f"names {_short(tag)}, which is not a registered fedsim state class (a plugin's "
                              "class loads when the run's config lists the plugin under plugins)")
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(_short(k) for k in obj if k != _CLS and k not in names)
    if unknown:
        raise CheckpointError(f"gives {tag} unknown field(s) {', '.join(unknown)}")
    try:
        return cls(**{k: _unpack(v) for k, v in obj.items() if k != _CLS})
    except TypeError as exc:  # a required field is missing
        raise CheckpointError(f"cannot rebuild {tag}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _unpickler_reason(exc: BaseException) -> str:
    """What torch's weights-only unpickler refused (a global, an operand), without its advice around it."""
    import re

    text = " ".join(str(exc).split())
    for pattern in (r"Unsupported global: GLOBAL \S+", r"unsupported GLOBAL \S+", r"Unsupported operand \d+"):
        found = re.search(pattern, text)
        if found:
            return found.group(0).rstrip(".")
    return "a layout it does not read"


def load_packed(path: Location, what: str) -> Any:
    """Read a file written from `pack(...)`: torch.load(weights_only=True), then unpack; any failure is one
    CheckpointError line naming `path` and `what` it was meant to be. A file in a store is read into memory first."""
    import pickle
    import warnings

    try:
        source = io.BytesIO(path.read_bytes()) if isinstance(path, StorePath) else path
        with warnings.catch_warnings():  # torch's notes on a foreign file's pickle protocol: it loads, or fails below
            warnings.simplefilter("ignore")
            raw = torch.load(source, weights_only=True, map_location="cpu")
    except pickle.UnpicklingError as exc:  # torch's advice (load it with weights_only=False) would run its code
        raise CheckpointError(f"{path}: unreadable {what}: torch's weights-only reader refused it "
                              f"({_unpickler_reason(exc)}), and fedsim reads files no other way") from None
    except Exception as exc:  # corrupt or foreign file: name it, no traceback
        raise CheckpointError(f"{path}: unreadable {what} ({type(exc).__name__}: {_first_line(exc)})") from None
    try:
        return unpack(raw)
    except CheckpointError as exc:
        raise CheckpointError(f"{path}: {what} {exc}") from None
    except Exception as exc:  # a well-formed pickle with an unexpected layout
        raise CheckpointError(f"{path}: malformed {what} ({type(exc).__name__}: {_first_line(exc)})") from None


def save_checkpoint(path: Location, payload: dict) -> None:
    """Write a checkpoint atomically."""
    atomic_torch_save(pack(payload), path)


def load_checkpoint(path: Location) -> dict:
    """Read a checkpoint, with a one-line error when it is missing, corrupt or names a class it may not."""
    if not path.is_file():
        raise CheckpointError(f"no checkpoint at {path}")
    payload = load_packed(path, "checkpoint")
    if not isinstance(payload, dict):
        raise CheckpointError(f"{path}: malformed checkpoint (not a dict)")
    return payload


RUN_CHECKPOINT_KEYS = {"round": int, "virtual_time": float, "server_state": object, "client_states": dict}


def _is(value: Any, kind: type) -> bool:
    if kind is object:
        return True
    if isinstance(value, bool):
        return False
    return isinstance(value, (int, float)) if kind is float else isinstance(value, kind)


def load_run_checkpoint(path: Location) -> dict:
    """A run's checkpoint (`round`, `virtual_time`, `server_state`, `client_states` by client id), checked for
    those keys and types, so a foreign or truncated payload is one line instead of a KeyError later."""
    payload = load_checkpoint(path)
    for key, kind in RUN_CHECKPOINT_KEYS.items():
        if key not in payload or not _is(payload[key], kind):
            raise CheckpointError(f"{path}: not a run checkpoint ({key!r} missing or not a {kind.__name__})")
    if not all(_is(c, int) for c in payload["client_states"]):
        raise CheckpointError(f"{path}: not a run checkpoint (client_states keys must be client ids)")
    return payload


def state_mismatch(fresh: Any, saved: Any, path: str = "server_state") -> str | None:
    """Where a saved state departs from what this run's method builds (`fresh`, its initial state), or None: every
    tensor of `fresh` (its models' weights) must be in `saved` at the same place with the same shape and dtype. A
    state grows after its first round (optimizer buffers, histories), and its arrays (selected indices, scores) may
    change length, so what `saved` has beyond `fresh`'s tensors is not judged, except in a model's weights (a dict
    of names to tensors), where a name more is another architecture's and would fail only when the model loads."""
    if isinstance(fresh, np.ndarray):
        return None
    if isinstance(fresh, torch.Tensor):
        if not isinstance(saved, torch.Tensor):
            return f"{path} is a {type(saved).__name__}, not a {type(fresh).__name__}"
        if tuple(saved.shape) != tuple(fresh.shape) or saved.dtype != fresh.dtype:
            return f"{path} is {saved.dtype} {list(saved.shape)}, not {fresh.dtype} {list(fresh.shape)}"
        return None
    if not _holds_tensors(fresh):
        return None
    if dataclasses.is_dataclass(fresh):
        if type(saved) is not type(fresh):
            return f"{path} is a {type(saved).__name__}, not a {type(fresh).__name__}"
        items = [(f"{path}.{f.name}", getattr(fresh, f.name), getattr(saved, f.name))
                 for f in dataclasses.fields(fresh)]
    elif isinstance(fresh, dict):
        if not isinstance(saved, dict):
            return f"{path} is a {type(saved).__name__}, not a dict"
        missing = [k for k, v in fresh.items() if k not in saved and _holds_tensors(v)]
        if missing:
            return f"{path} lacks {missing[0]!r}"
        if _is_weights(fresh):
            extra = [k for k in saved if k not in fresh]
            if extra:
                return f"{path} has {extra[0]!r}, which this run's model lacks"
        items = [(f"{path}[{k!r}]", v, saved[k]) for k, v in fresh.items() if k in saved]
    else:  # a list or tuple
        if not isinstance(saved, (list, tuple)) or len(saved) != len(fresh):
            return f"{path} is not a sequence of {len(fresh)}"
        items = [(f"{path}[{i}]", f, s) for i, (f, s) in enumerate(zip(fresh, saved, strict=True))]
    return next((found for where, f, s in items if (found := state_mismatch(f, s, where))), None)


def _is_weights(value: dict) -> bool:
    """Whether a state dict entry is a model's weights: parameter names to tensors, as state_dict() gives them."""
    return bool(value) and all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in value.items())


def _holds_tensors(value: Any) -> bool:
    """Whether a state value holds any tensor (what `state_mismatch` requires to be kept)."""
    if isinstance(value, torch.Tensor):
        return True
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return any(_holds_tensors(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return any(_holds_tensors(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_holds_tensors(v) for v in value)
    return False


MANIFEST = "manifest.json"
CHECKPOINT = "last.pt"
HASH_CHUNK = 8 * 2**20


def file_sha256(path: Location | str) -> str:
    """The SHA-256 of a file (local or in a store), read in chunks."""
    digest = hashlib.sha256()
    with (path.open("rb") if isinstance(path, StorePath) else open(path, "rb")) as fh:
        while chunk := fh.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def start_manifest(folder: Location, run_id: str, seed: int, config_name: str,
                   plugins: dict[str, dict[str, str]] | None = None) -> None:
    """A new run's manifest, in its checkpoints folder beside the config it started with (no checkpoint yet), with
    what fedsim.plugins.record kept of its plugins (their SHA-256s)."""
    _write_manifest(folder, {"run_id": run_id, "seed": seed,
                             "config": {"file": config_name, "sha256": file_sha256(folder / config_name)},
                             "plugins": plugins or {}, "checkpoints": []})


def read_manifest(folder: Location) -> dict:
    """The manifest of a run's checkpoints folder, checked for its layout; any problem is one CheckpointError."""
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointError(f"{path}: missing, so the run's checkpoints cannot be verified (a run folder written "
                              "before fedsim kept one, or damaged); start a new run")
    try:
        raw = json.loads(path.read_text())
        entries = raw["checkpoints"]
        ok = isinstance(raw["run_id"], str) and isinstance(raw["seed"], int) and \
            isinstance(raw["config"]["file"], str) and isinstance(raw["config"]["sha256"], str) and \
            isinstance(entries, list) and all(isinstance(e["file"], str) and isinstance(e["sha256"], str) and
                                              isinstance(e["round"], int) for e in entries) and \
            isinstance(raw.setdefault("plugins", {}), dict)
    except (OSError, ValueError, RecursionError, UnicodeDecodeError, KeyError, TypeError):
        ok = False
    if not ok:
        raise CheckpointError(f"{path}: unreadable (not the manifest fedsim writes); the run folder is damaged")
    return raw


def verify_manifest(folder: Location, run_id: str) -> dict:
    """Check a run's checkpoints folder before anything in it is read: the manifest is this run's (`run_id`, from
    its run.json), and the config the run started with is there, unchanged. Returns the manifest; a mismatch is one
    CheckpointError naming the file."""
    manifest = read_manifest(folder)
    if manifest["run_id"] != run_id:
        raise CheckpointError(f"{folder / MANIFEST}: of another run (run_id {manifest['run_id'][:32]!r}; this folder's "
                              f"run.json says {run_id[:32]!r}): checkpoints copied in from elsewhere are not resumed")
    config = folder / manifest["config"]["file"]
    if not config.is_file():
        raise CheckpointError(f"{config}: missing (the config the run started with, which a resume is checked "
                              "against); the resume is refused")
    if file_sha256(config) != manifest["config"]["sha256"]:
        raise CheckpointError(f"{config}: its SHA-256 differs from the one in {MANIFEST} (edited or damaged since the "
                              "run started); the resume is refused")
    return manifest


def verify_checkpoint(folder: Location, manifest: dict) -> int | None:
    """The round of the checkpoint in a run's checkpoints folder, once its SHA-256 is found in the manifest (None
    where the run has none yet); a file the manifest does not list is one CheckpointError naming it."""
    checkpoint = folder / CHECKPOINT
    listed = {e["sha256"]: e["round"] for e in manifest["checkpoints"] if e["file"] == CHECKPOINT}
    if not checkpoint.exists():
        if listed:
            raise CheckpointError(f"{checkpoint}: missing, though {MANIFEST} lists it; the run folder is damaged")
        return None
    if not checkpoint.is_file():
        raise CheckpointError(f"{checkpoint}: not a file")
    digest = file_sha256(checkpoint)
    if digest not in listed:
        raise CheckpointError(f"{checkpoint}: its SHA-256 is not the one in {MANIFEST} (damaged, or replaced by "
                              "another file, since the run wrote it); the resume is refused")
    return listed[digest]


def save_run_checkpoint(path: Location, payload: dict, round: int) -> None:
    """Write a run's checkpoint atomically, listed in the manifest beside it with its SHA-256 and `round`: first
    beside the checkpoint it replaces, then alone."""
    folder = path.parent
    manifest = read_manifest(folder)
    kept = [e for e in manifest["checkpoints"] if e["file"] == path.name and (folder / path.name).exists()]

    def write(tmp: str) -> None:
        torch.save(pack(payload), tmp)

    entry = {"file": path.name, "round": round}

    def listed(tmp: str) -> None:  # before the new file replaces the old one: the manifest vouches for either
        entry["sha256"] = file_sha256(tmp)
        _write_manifest(folder, {**manifest, "checkpoints": kept[-1:] + [entry]})

    atomic_write(path, write, ready=listed)
    _write_manifest(folder, {**manifest, "checkpoints": [entry]})


def _write_manifest(folder: Location, manifest: dict) -> None:
    atomic_write_text(folder / MANIFEST, json.dumps(manifest, indent=2) + "\n")


def verified_round(payload: dict, path: Location, expected: int | None) -> None:
    """Refuse a loaded run checkpoint whose round is not the one its manifest entry records."""
    if expected is not None and payload["round"] != expected:
        raise CheckpointError(f"{path}: holds round {payload['round']}, and {MANIFEST} records round {expected} for "
                              "it; the run folder is damaged")

