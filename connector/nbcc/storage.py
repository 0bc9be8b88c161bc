"""Storage: one fsspec filesystem rooted at a table's URI, plus the atomic put-if-absent that
every metadata change in nbcc is built on.

Put-if-absent is the only primitive the commit protocol needs:
- local disk: write a hidden temporary file, then `os.link` it to its final name; the link fails
  atomically when the name exists (fsspec's own `mode="create"` is check-then-write, racy);
- S3: a conditional PUT (`If-None-Match: *`), which s3fs exposes as `pipe_file(mode="create")`;
- memory (unit tests only): a check-then-write under a process-wide lock.
Data files are written with plain writes: their names are unique per writer and they become
visible only through a completed instant, so a torn data file can never be read.
"""

from __future__ import annotations

import errno
import os
import threading
import uuid
from typing import Any, BinaryIO

import fsspec
import pyarrow.fs as pafs
from tenacity import retry, retry_if_exception, stop_after_attempt, wait_random_exponential
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem

from .errors import StorageError

_MEMORY_LOCK = threading.Lock()


def _is_conditional_conflict(exc: BaseException) -> bool:
    text = str(exc)
    return not isinstance(exc, FileExistsError) and ("ConditionalRequestConflict" in text or "(409)" in text)

TMP_PREFIX = ".nbcc-tmp-"


def _coerce(value: Any) -> Any:
    """Option values arrive as strings from Spark; fsspec wants booleans and numbers."""
    if isinstance(value, str):
        low = value.strip().lower()
        if low in ("true", "false"):
            return low == "true"
        try:
            return int(value)
        except ValueError:
            return value
    return value


class Storage:
    """A table's storage: relative paths (`".nbcc/table.json"`) resolve under the table root."""

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None):
        self.uri = str(uri).rstrip("/") or "/"
        self.storage_options = dict(storage_options or {})
        opts = {k: _coerce(v) for k, v in self.storage_options.items()}
        try:
            self.fs, self.root = fsspec.core.url_to_fs(self.uri, **opts)
        except (ImportError, ValueError, TypeError) as exc:
            raise StorageError(f"cannot open storage for {self.uri!r}: {exc}") from exc
        self.root = self.root.rstrip("/")
        self.is_local = isinstance(self.fs, LocalFileSystem)
        self.is_memory = isinstance(self.fs, MemoryFileSystem)
        self.is_s3 = "s3" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))
        if not (self.is_local or self.is_memory or self.is_s3):
            raise StorageError(
                f"storage {type(self.fs).__name__} for {self.uri!r} has no put-if-absent support "
                "nbcc can use; supported: local paths, file://, s3://, memory://"
            )

    # Pickled into Spark tasks: rebuild the filesystem on the other side.
    def __reduce__(self):
        return (Storage, (self.uri, self.storage_options))

    def full_path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    # -- metadata primitives ---------------------------------------------------------------

    def put_if_absent(self, rel: str, data: bytes) -> bool:
        """Create `rel` holding `data` if no object has that name. True if this call created it."""
        if not data:
            # s3fs turns an empty conditional write into an unconditional touch.
            raise StorageError("put_if_absent needs non-empty content")
        path = self.full_path(rel)
        if self.is_local:
            return self._local_put_if_absent(path, data)
        if self.is_memory:
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        try:
            return self._s3_put_if_absent(path, data)
        finally:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    @retry(retry=retry_if_exception(_is_conditional_conflict), stop=stop_after_attempt(6),
           wait=wait_random_exponential(multiplier=0.02, max=1.0), reraise=True)
    def _s3_put_if_absent(self, path: str, data: bytes) -> bool:
        # S3 answers 409 ConditionalRequestConflict while another conditional write to the same
        # key is in flight: the race is undecided, so ask again.
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        return True

    @staticmethod
    def _local_put_if_absent(path: str, data: bytes) -> bool:
        parent = os.path.dirname(path)
        os.makedirs(parent, exist_ok=True)
        tmp = os.path.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        except OSError as exc:
            if exc.errno == errno.EEXIST:
                return False
            raise
        finally:
            os.unlink(tmp)

    def replace(self, rel: str, data: bytes) -> None:
        """Write `rel` whole, replacing what was there; readers see the old or the new content,
        never a torn one (local: temporary file and rename; S3: one PUT)."""
        path = self.full_path(rel)
        if self.is_local:
            parent = os.path.dirname(path)
            os.makedirs(parent, exist_ok=True)
            tmp = os.path.join(parent, f"{TMP_PREFIX}{uuid.uuid4().hex}")
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
            return
        self.fs.pipe_file(path, data)
        self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    def read_bytes(self, rel: str) -> bytes:
        return self.fs.cat_file(self.full_path(rel))

    def list_names(self, rel_dir: str, prefix: str = "") -> list[str]:
        """Names (not paths) of the entries directly under `rel_dir` that start with `prefix`;
        [] if it does not exist. Always a fresh listing: s3fs caches listings, and a stale
        timeline would hide commits. On S3 the prefix is applied by the server."""
        path = self.full_path(rel_dir)
        if self.is_local:
            try:
                names = os.listdir(path)
            except FileNotFoundError:
                return []
        else:
            self.fs.invalidate_cache(path)
            try:
                if prefix and self.is_s3:
                    entries = self.fs.find(path, maxdepth=1, withdirs=True, prefix=prefix)
                else:
                    entries = self.fs.ls(path, detail=False)
            except FileNotFoundError:
                return []
            names = [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]
        return [n for n in names if n and n.startswith(prefix) and not n.startswith(TMP_PREFIX)]

    def exists(self, rel: str) -> bool:
        path = self.full_path(rel)
        if not self.is_local:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        return self.fs.exists(path)

    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error (deletes are retried after crashes)."""
        path = self.full_path(rel)
        try:
            self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        if not self.is_local:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    # -- data files ------------------------------------------------------------------------

    def open_write(self, rel: str) -> BinaryIO:
        path = self.full_path(rel)
        if self.is_local:
            os.makedirs(os.path.dirname(path), exist_ok=True)
            return open(path, "wb")
        return self.fs.open(path, "wb")

    def arrow_filesystem(self) -> pafs.FileSystem:
        """A pyarrow filesystem for reading Parquet: pyarrow's native one for local disk (fast,
        memory-mapped), fsspec's otherwise."""
        if self.is_local:
            return pafs.LocalFileSystem()
        return pafs.PyFileSystem(pafs.FSSpecHandler(self.fs))


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or (
        isinstance(exc, OSError) and getattr(exc, "errno", None) == errno.ENOENT
    )
