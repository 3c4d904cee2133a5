"""Where runs are kept: a local folder, or a URI on any filesystem fsspec knows (s3://, gs://, memory://, ...).

`location(text)` turns results.root, a `--resume` argument or a run named to `fedsim.load` into a `Path` (plain
paths, shared file systems and file:// URIs) or a `StorePath` (any other URI). Both offer the part of pathlib that
fedsim's tables, configs and checkpoints use, so the code that writes and reads a run does not care where it is.
Writes stay atomic (fedsim.persist.io): a local file is written under a temporary name and renamed; a store's file is
written locally, then uploaded in one put, which an object store shows whole or not at all.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

from fedsim.errors import CheckpointError, ConfigError, MissingExtraError
from fedsim.extras import install_hint

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
EXTRAS = {"s3": ("s3fs", "s3"), "s3a": ("s3fs", "s3"), "gs": ("gcsfs", "gcs"), "gcs": ("gcsfs", "gcs")}
"""URI scheme -> (the package fsspec needs for it, the fedsim extra that installs it)."""


class StorePath:
    """A file or folder on an fsspec filesystem, with the pathlib methods fedsim uses; str() gives its URI."""

    def __init__(self, fs: Any, path: str, scheme: str) -> None:
        self.fs, self.scheme = fs, scheme
        self.path = path.rstrip("/") or fs.root_marker

    @property
    def bucketed(self) -> bool:
        """Whether paths start with a bucket (object stores): folders there exist only through their files."""
        return self.fs.root_marker == ""

    def __truediv__(self, name: str | Path) -> StorePath:
        return StorePath(self.fs, f"{self.path.rstrip('/')}/{name}", self.scheme)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rpartition("/")[2]

    @property
    def parent(self) -> StorePath:
        """The enclosing folder; a bucket, or the store's root, is its own parent."""
        head = self.path.rstrip("/").rpartition("/")[0]
        return StorePath(self.fs, head or self.fs.root_marker or self.path, self.scheme)

    def __str__(self) -> str:
        if _SCHEME.match(self.path):  # filesystems that keep the whole URL as the path (http://)
            return self.path
        return f"{self.scheme}://{self.path.lstrip('/')}"

    def __repr__(self) -> str:
        return f"StorePath({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, StorePath) and (self.fs, self.path) == (other.fs, other.path)

    def __hash__(self) -> int:
        return hash((type(self.fs).__name__, self.path))

    def _ask(self, method: str, *args: Any) -> Any:
        """`fs.<method>(path, ...)`, with a store that cannot be reached (credentials, network) as one line."""
        try:
            return getattr(self.fs, method)(self.path, *args)
        except (FileNotFoundError, PermissionError):  # the store answered: as a local file would
            raise
        except Exception as exc:
            raise CheckpointError(f"{self}: cannot reach the store ({type(exc).__name__}: {_first_line(exc)})") \
                from None

    def exists(self) -> bool:
        return bool(self._ask("exists"))

    def is_file(self) -> bool:
        return bool(self._ask("isfile"))

    def is_dir(self) -> bool:
        return bool(self._ask("isdir"))

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Create the folder (and its parents); nothing to do on an object store, and never a new bucket."""
        if not self.bucketed:
            self.fs.makedirs(self.path, exist_ok=True)

    def iterdir(self) -> Iterator[StorePath]:
        for child in self._ask("ls", False):
            if child.rstrip("/") != self.path:
                yield StorePath(self.fs, child, self.scheme)

    def open(self, mode: str = "rb") -> IO[Any]:
        return self.fs.open(self.path, mode)

    def read_bytes(self) -> bytes:
        return bytes(self._ask("cat_file"))

    def read_text(self, encoding: str = "utf-8") -> str:
        return self.read_bytes().decode(encoding)

    def create(self, data: bytes) -> bool:
        """Write `data` here unless a file is here already (False then): a conditional put where the store offers
        one (S3's If-None-Match, the memory store), else fsspec's look-then-write."""
        try:
            self.fs.pipe_file(self.path, data, mode="create")
        except FileExistsError:  # s3fs too, for S3's 412 Precondition Failed
            return False
        except Exception as exc:
            raise CheckpointError(f"{self}: cannot reach the store ({type(exc).__name__}: {_first_line(exc)})") \
                from None
        return True

    def upload(self, local_file: str) -> None:
        """Put a local file here in one transfer."""
        self.fs.put_file(local_file, self.path)

    def unlink(self, missing_ok: bool = False) -> None:
        if missing_ok and not self.exists():
            return
        self.fs.rm_file(self.path)

    def rmdir(self) -> None:
        """Remove an empty folder (OSError if it holds anything); folders of an object store need no removal."""
        if not self.bucketed:
            self.fs.rmdir(self.path)

    def rmtree(self) -> None:
        if self.exists():
            self.fs.rm(self.path, recursive=True)


Location = Path | StorePath


def is_uri(text: str | Path | StorePath) -> bool:
    return isinstance(text, str) and _SCHEME.match(text) is not None


def location(text: str | Path | StorePath, key: str = "path") -> Location:
    """The folder or file `text` names: a Path for plain paths and file:// URIs, a StorePath for other URIs.

    An unknown scheme, or one whose package is not installed, is a ConfigError naming `key` and the URI."""
    if isinstance(text, (Path, StorePath)):
        return text
    if not isinstance(text, str):  # os.PathLike too: a folder named by another library's path type
        if not hasattr(text, "__fspath__") or not isinstance(text.__fspath__(), str):
            raise ConfigError(f"{key}: expected a path or URI, got {type(text).__name__} {str(text)[:60]!r}")
        text = text.__fspath__()
    match = _SCHEME.match(text)
    if match is None:
        return Path(text)
    scheme = match.group(1).lower()
    from fsspec.core import url_to_fs
    from fsspec.implementations.local import LocalFileSystem

    try:
        fs, path = url_to_fs(text)
    except ImportError as exc:
        package, extra = EXTRAS.get(scheme, (None, None))
        if extra is None:
            raise MissingExtraError(f"{key}: {text}: {scheme}:// needs a package that is not installed "
                                    f"({_first_line(exc)})") from None
        raise MissingExtraError(f"{key}: {text}: {scheme}:// needs {package}, which is not installed: "
                                f"{install_hint(extra)}") from None
    except ValueError as exc:
        if "not known" not in str(exc):
            raise ConfigError(f"{key}: {text}: {_first_line(exc)}") from None
        raise ConfigError(f"{key}: {text}: unknown URI scheme {scheme}:// (a folder, or s3://, gs://, file://, "
                          "memory://, or another scheme fsspec knows)") from None
    except Exception as exc:  # a filesystem that refuses its URI: say so in one line
        raise ConfigError(f"{key}: {text}: {type(exc).__name__}: {_first_line(exc)}") from None
    if isinstance(fs, LocalFileSystem):
        return Path(path)
    fs.invalidate_cache()  # listings cached earlier in this process miss what other machines wrote since
    return StorePath(fs, path, scheme)


def check_reachable(root: Location, key: str) -> None:
    """Refuse a store root whose bucket is missing or out of reach, before a run writes anything there; the line
    tells a missing bucket from a store that refused or could not be reached (credentials, endpoint)."""
    if not isinstance(root, StorePath) or not root.bucketed:
        return
    bucket = root.path.lstrip("/").partition("/")[0]
    where = store_endpoint(root)
    try:
        root.fs.info(bucket)
    except FileNotFoundError:
        raise ConfigError(f"{key}: {root}: no bucket {bucket!r} at {where}; create it first") from None
    except PermissionError as exc:
        raise ConfigError(f"{key}: {root}: {where} refused access to bucket {bucket!r} ({_first_line(exc)}); check "
                          "the credentials") from None
    except Exception as exc:  # no credentials, no endpoint, network: one line naming the key and what to set
        hint = ("; set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, and AWS_ENDPOINT_URL for a store that is not AWS "
                "(MinIO, Ceph, moto); in a Ray job, in the runtime env's env_vars") if root.scheme in ("s3", "s3a") \
            else ""
        raise ConfigError(f"{key}: {root}: cannot reach the store at {where} ({type(exc).__name__}: "
                          f"{_first_line(exc)}){hint}") from None


def store_endpoint(root: StorePath) -> str:
    """Where a store root's requests go, as a person would check it: an S3-compatible store's endpoint URL (AWS's
    when none is set), else the scheme."""
    if root.scheme not in ("s3", "s3a"):
        return f"{root.scheme}://"
    kwargs = getattr(root.fs, "client_kwargs", None) or {}
    endpoint = kwargs.get("endpoint_url") or getattr(root.fs, "endpoint_url", None) or \
        os.environ.get("AWS_ENDPOINT_URL")
    return f"endpoint {endpoint}" if endpoint else "AWS (no AWS_ENDPOINT_URL set)"


def instead_of_a_file(path: Location) -> str | None:
    """What is at `path`, which should be a file: 'a folder' or 'a device or pipe, not a regular file'; None when
    nothing is (a message then says the file is not found)."""
    if path.is_dir():
        return "a folder, not a file"
    return "not a regular file (a device or a pipe)" if path.exists() else None


def remove_tree(path: Location) -> None:
    """Delete a folder and everything in it, wherever it is; a missing one is fine."""
    import shutil

    if isinstance(path, StorePath):
        path.rmtree()
    else:
        shutil.rmtree(path, ignore_errors=True)


def glob_folders(pattern: str) -> list[Location]:
    """The folders a glob pattern matches, locally or in a store, sorted."""
    import glob

    loc = location(pattern)
    if isinstance(loc, Path):
        return [Path(m) for m in sorted(glob.glob(str(loc))) if Path(m).is_dir()]
    return [StorePath(loc.fs, m, loc.scheme) for m in sorted(loc.fs.glob(loc.path)) if loc.fs.isdir(m)]


def _first_line(exc: BaseException) -> str:
    return (str(exc).strip().splitlines() or [type(exc).__name__])[0][:200]
