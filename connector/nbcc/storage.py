"""Storage: one fsspec filesystem rooted at a table's URI, plus the atomic put-if-absent that
every metadata change in nbcc is built on.

Put-if-absent is the only primitive the commit protocol needs:
- local disk (local_disk.py): write a hidden temporary file, then `os.link` it to its final
  name; the link fails atomically when the name exists (fsspec's own `mode="create"` is
  check-then-write, racy);
- S3: a conditional PUT (`If-None-Match: *`), which s3fs exposes as `pipe_file(mode="create")`;
- memory (unit tests only): a check-then-write under a process-wide lock.
Data files are written with plain writes: their names are unique per writer and they become
visible only through a completed instant, so a torn data file can never be read.

Transient errors (a dropped connection, a timeout, S3 throttling) are retried here, a bounded
number of times with jittered exponential backoff; then a `StorageError` names the operation and
the path. Errors that asking again cannot fix (a missing file, access denied, a name taken) are
never retried and reach the caller unchanged. Each public method is one retried call of a
single-attempt primitive (`_*_once`), which is what a test wraps to inject faults. The options a
table's storage is opened with are checked in storage_options.py.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import logging
import os
import random
import sys
import threading
import time
from typing import Any, BinaryIO, Callable, Iterator, Sequence, TypeVar

import fsspec
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
from fsspec.asyn import sync
from fsspec.exceptions import FSTimeoutError
from fsspec.implementations.local import LocalFileSystem
from fsspec.implementations.memory import MemoryFileSystem
from fsspec.spec import AbstractBufferedFile
from tenacity import Retrying, retry_if_exception, stop_after_attempt, wait_random_exponential

from . import local_disk
from .errors import NbccError, StorageError
from .local_disk import TMP_PREFIX
from .storage_options import filesystem_options

log = logging.getLogger(__name__)

# fsspec's memory filesystem is not thread-safe: put-if-absent's check and write, and `ls` (which
# reads each name it found again, and raised KeyError for one a thread deleted in between) and
# deletes, take this lock.
_MEMORY_LOCK = threading.Lock()
_DELETE_BATCH = 1000  # the most keys one S3 DeleteObjects request takes
_T = TypeVar("_T")

# errno values of failures that may pass if asked again. EBUSY is how s3fs reports S3's 503
# SlowDown and 409 conflicts, EREMOTEIO its 500 InternalError. Plain EIO is left out: on a
# local disk it is a hardware error, and s3fs uses it for every S3 error it does not know.
_TRANSIENT_ERRNOS = frozenset(getattr(errno, name) for name in (
    "EAGAIN", "EBUSY", "EINTR", "ETIMEDOUT", "ECONNRESET", "ECONNABORTED", "ECONNREFUSED", "EPIPE",
    "ENETDOWN", "ENETUNREACH", "ENETRESET", "EHOSTUNREACH", "EREMOTEIO") if hasattr(errno, name))

# Network failures of the S3 client stack that s3fs gave up retrying (it retries some itself),
# as (module, class names). Looked up only once the module is loaded, which it is whenever one
# of its errors can be raised: importing aiohttp up front cost 0.12 s of every process's start
# (the nbcc command, each Spark Python worker) that never touches S3.
_CLIENT_TRANSIENT_NAMES = (("botocore.exceptions", ("ConnectionError", "HTTPClientError")),
                           ("aiohttp", ("ClientConnectionError", "ClientPayloadError")))


def _client_transient() -> tuple[type[BaseException], ...]:
    found: tuple[type[BaseException], ...] = (FSTimeoutError,)
    for module_name, names in _CLIENT_TRANSIENT_NAMES:
        module = sys.modules.get(module_name)
        if module is not None:
            found += tuple(c for c in (getattr(module, n, None) for n in names) if isinstance(c, type))
    return found

# S3 endpoints that have answered this process (see Storage._raise_if_unreachable).
_ANSWERED_ENDPOINTS: set[str] = set()

# Errors about the request itself: asking again gets the same answer.
_PERMANENT = (FileNotFoundError, FileExistsError, PermissionError, IsADirectoryError, NotADirectoryError)


def _is_conditional_conflict(exc: BaseException) -> bool:
    """S3's 409 ConditionalRequestConflict: another conditional write to the key is in flight
    and the race is undecided. Our request was refused, so it cannot have taken effect."""
    text = str(exc)
    return not isinstance(exc, FileExistsError) and ("ConditionalRequestConflict" in text or "(409)" in text)


def is_transient(exc: BaseException) -> bool:
    """True for a storage failure that may pass if the same request is made again."""
    if isinstance(exc, _PERMANENT) or not isinstance(exc, Exception) or isinstance(exc, NbccError):
        return False
    if isinstance(exc, (ConnectionError, TimeoutError) + _client_transient()):
        return True
    if isinstance(exc, OSError) and exc.errno in _TRANSIENT_ERRNOS:
        return True
    return _is_conditional_conflict(exc)


@functools.lru_cache(maxsize=None)
def _cat_takes_concurrency(fs_class: type) -> bool:
    import inspect

    return "max_concurrency" in inspect.signature(fs_class._cat_file).parameters


class _PastDeadline(Exception):
    """A retry would start past the caller's deadline (see Storage._retry)."""


class _TakenThenFreed(Exception):
    """put-if-absent found its name taken, but the file was gone when read: put again."""


def _retryable(exc: BaseException) -> bool:
    return isinstance(exc, _TakenThenFreed) or is_transient(exc)


def _normal_key_path(uri: str, rest: str, scheme: str) -> str:
    """`bucket/key` of an object store URI without empty, "." and ".." segments, as Hadoop's Path
    (Spark's, Delta's) reads it: S3 keeps them in keys literally, so `s3://lake//t` was another
    table than `s3://lake/t`, whose listings s3fs then mixed up. Local paths are the OS's."""
    if scheme in ("file", "local"):
        return rest
    bucket, _, key = rest.partition("/")
    parts: list[str] = []
    for segment in key.split("/"):
        if segment == "..":
            if not parts:
                raise StorageError(f"{uri!r} goes above its bucket ('..'); give the table's path without it")
            parts.pop()
        elif segment not in ("", "."):
            parts.append(segment)
    return "/".join([bucket, *parts])


class Storage:
    """A table's storage: relative paths (`".nbcc/table.json"`) resolve under the table root."""

    # Retries of transient errors: at most RETRY_ATTEMPTS calls, the n-th wait drawn uniformly
    # from [0, RETRY_WAIT_S * 2^(n-1)] capped at RETRY_MAX_WAIT_S ("full jitter", so that
    # writers that failed together do not retry together). About 1.5 s of waiting at most:
    # s3fs already retried the network errors it knows, and a commit holds the table lock
    # while it lists and writes its completed file.
    RETRY_ATTEMPTS = 6
    RETRY_WAIT_S = 0.05
    RETRY_MAX_WAIT_S = 2.0

    def __init__(self, uri: str, storage_options: dict[str, Any] | None = None):
        self.uri = str(uri).rstrip("/") or "/"
        scheme, sep, rest = self.uri.partition("://")
        if sep and scheme.isalnum():  # URI schemes are case-insensitive (RFC 3986); fsspec's names are lowercase
            self.uri = scheme.lower() + sep + _normal_key_path(str(uri), rest, scheme.lower())
        self.storage_options = dict(storage_options or {})
        opts = filesystem_options(self.uri, self.storage_options)
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
        client = opts.get("client_kwargs")
        self._endpoint = str(opts.get("endpoint_url") or (client.get("endpoint_url") if isinstance(client, dict)
                                                           else None) or "AWS S3").rstrip("/")
        self._bulk_deletes = True  # until the store refuses a DeleteObjects request (delete_many)

    # Pickled into Spark tasks: rebuild the filesystem on the other side.
    def __reduce__(self):
        return (Storage, (self.uri, self.storage_options))

    def full_path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def child(self, rel: str) -> "Storage":
        """The storage of the folder `rel` (the metadata table's, a table of its own), reached
        the same way as this one."""
        return Storage(f"{self.uri}/{rel}", self.storage_options)

    def file_in_the_way(self) -> str | None:
        """On local disk, the regular file standing where the table's folder or one of its
        parents must be (what a NotADirectoryError means there); None if there is none."""
        if not self.is_local:
            return None
        at = self.root
        while not os.path.isdir(at):
            if os.path.isfile(at):
                return at
            parent = os.path.dirname(at)
            if parent == at:
                break
            at = parent
        return None

    def identity(self) -> tuple:
        """What tells two Storage objects apart for caches of per-table state."""
        return (self.uri, tuple(sorted((k, repr(v)) for k, v in self.storage_options.items())))

    def _retry(self, what: str, path: str, call: Callable[[], _T],
               retry_on: Callable[[BaseException], bool] = is_transient,
               outcome: Callable[[], str] = lambda: "", deadline: float | None = None,
               opening: bool = False) -> _T:
        """`call()`, again after each transient error; StorageError once the attempts run out
        (`outcome()` then says what may have happened), or when a retry would start at or after
        `deadline` (a `time.monotonic()` value: a write under the table lock must not start once
        the lock may have been taken over). `opening`: the call that opens or creates a table,
        where a wrong endpoint shows first (`_raise_if_unreachable`)."""
        attempts = 0
        last: list[Exception] = []  # the latest attempt's failure

        def attempt() -> _T:
            nonlocal attempts
            if attempts and deadline is not None and time.monotonic() >= deadline:
                raise _PastDeadline()
            attempts += 1
            try:
                result = call()
            except Exception as exc:
                last[:] = [exc]
                raise
            if self.is_s3:
                _ANSWERED_ENDPOINTS.add(self._endpoint)
            return result

        try:
            return attempt()  # the common case, without building the retry machinery
        except Exception as exc:
            if not retry_on(exc):
                self._raise_if_misconfigured(exc, what, path)
                raise  # not transient: the caller decides (e.g. on FileNotFoundError)
            if opening:
                self._raise_if_unreachable(exc, what, path)
            error = exc
        if self.RETRY_ATTEMPTS > 1:
            log.debug("%s %s: attempt 1 failed (%s), retrying", what, path, error)
            time.sleep(random.uniform(0, min(self.RETRY_WAIT_S, self.RETRY_MAX_WAIT_S)))
            retrying = Retrying(  # attempts 2..N; their waits go on doubling from the first
                retry=retry_if_exception(retry_on),
                stop=stop_after_attempt(self.RETRY_ATTEMPTS - 1),
                wait=wait_random_exponential(multiplier=2 * self.RETRY_WAIT_S, max=self.RETRY_MAX_WAIT_S),
                before_sleep=lambda state: log.debug("%s %s: attempt %d failed (%s), retrying", what, path,
                                                     state.attempt_number + 1, state.outcome.exception()),
                reraise=True,
            )
            try:
                return retrying(attempt)
            except _PastDeadline:
                error = last[0]
                raise StorageError(
                    f"{what} {path} failed {attempts} time{'s' if attempts > 1 else ''} "
                    f"({type(error).__name__}: {error}) and was not tried again: the table lock it was "
                    f"made under may have been taken over by now{outcome()}. Retry the operation."
                ) from error
            except Exception as exc:
                if not retry_on(exc):
                    self._raise_if_misconfigured(exc, what, path)
                    raise
                error = exc
        raise StorageError(
            f"{what} {path} failed {attempts} time{'s in a row' if attempts > 1 else ''} "
            f"({type(error).__name__}: {error}); the storage is unreachable or overloaded{outcome()}. "
            "Retry the operation later."
        ) from error

    def _raise_if_unreachable(self, exc: BaseException, what: str, path: str) -> None:
        """A StorageError at once when a table is being opened or created and its S3 endpoint
        cannot be connected to and has not answered this process yet: most likely a wrong
        endpoint_url, region or network, which retrying cannot fix. botocore has already retried
        the connection (about 7 s); retrying that six times more kept a typo waiting 45 s for its
        error. Any later call (a Spark task's, a commit's) and an endpoint that answered before
        ride out an outage with the usual retries."""
        if not self.is_s3 or self._endpoint in _ANSWERED_ENDPOINTS:
            return
        botocore = sys.modules.get("botocore.exceptions")
        if botocore is None or not isinstance(exc, (botocore.EndpointConnectionError, botocore.ConnectTimeoutError)):
            return
        raise StorageError(f"{what} {path} failed: cannot connect to the S3 endpoint {self._endpoint} ({exc}); "
                           "check the storage options endpoint_url and region_name, the network, and that "
                           "the service is up") from exc

    def _raise_if_misconfigured(self, exc: BaseException, what: str, path: str) -> None:
        """A StorageError saying what to fix, for failures that no file and no retry can change:
        a missing bucket (which s3fs reports as a missing file, so that a table in it would
        look merely absent) and the S3 client's own errors (no credentials, a bad bucket name)."""
        if not self.is_s3:
            return
        if isinstance(exc, FileNotFoundError) and "bucket does not exist" in str(exc):
            raise StorageError(f"{what} {path} failed: the bucket of {self.uri} does not exist; create it "
                               "or correct the URI") from exc
        if isinstance(exc, PermissionError):  # s3fs's form of 403, InvalidAccessKeyId, ...
            raise StorageError(f"{what} {path} failed: access denied ({exc}); check the storage options "
                               "key, secret and profile (or the AWS_* variables), and that they may use "
                               f"{self.uri}") from exc
        botocore = sys.modules.get("botocore.exceptions")
        if botocore is not None and isinstance(exc, botocore.BotoCoreError):
            hint = ""
            if isinstance(exc, (botocore.NoCredentialsError, botocore.PartialCredentialsError)):
                hint = ("; give storage options key and secret, or set AWS_ACCESS_KEY_ID and "
                        "AWS_SECRET_ACCESS_KEY, or an AWS profile")
                # fsspec keeps filesystems by their options: the next open with the same ones
                # would reuse this one, which looks for credentials no more.
                type(self.fs).clear_instance_cache()
            raise StorageError(f"{what} {path} failed: {type(exc).__name__}: {exc}{hint}") from exc

    # -- metadata primitives ---------------------------------------------------------------

    def put_if_absent(self, rel: str, data: bytes, durable: bool = True, deadline: float | None = None,
                      give_up_at: float | None = None, opening: bool = False) -> bool:
        """Create `rel` holding `data` if no object has that name. True if this call created it.

        `data` must be content that no other caller would put under this name (nbcc's files
        carry their writer's times, holder id or a nonce): that is how a retry recognises its
        own earlier attempt, below. On local disk the file survives a power failure once this
        returns; with `durable=False` its name may not (it is never torn), which suits state
        whose loss only costs a wait, such as a lock release. `deadline`, `opening` and
        `give_up_at`: see `_retry` and `_bounded`."""
        if not data:
            # s3fs turns an empty conditional write into an unconditional touch.
            raise StorageError("put_if_absent needs non-empty content")
        path = self.full_path(rel)
        uncertain = False  # an earlier attempt failed in a way that may have created the file

        def attempt() -> bool:
            nonlocal uncertain
            try:
                created = self._put_once(path, data, durable, give_up_at)
            except Exception as exc:
                # A timeout or a dropped connection can come after the store made the write
                # (the classic S3 timeout); a 409 conflict is a refusal, so it cannot.
                if is_transient(exc) and not _is_conditional_conflict(exc):
                    uncertain = True
                raise
            if created or not (uncertain or self.is_s3):
                return created
            # The name is taken, perhaps by our own earlier attempt whose reply was lost. On S3
            # that can happen inside one attempt: botocore and s3fs retry a PUT whose reply was
            # lost (a dropped connection, a 500) themselves, and the retry gets 412.
            # Answering False would make a writer give up a file that it did create (a lock
            # state it then holds, an instant, a table it created); answering True for another
            # writer's file would let two writers each think they won. The content decides: it
            # is unique to its writer.
            try:
                own = self._read_once(path) == data  # a read lands nothing: not given up
            except FileNotFoundError:
                raise _TakenThenFreed(path) from None  # deleted since: the name is free again
            if own and durable and self.is_local:
                local_disk.fsync_created(path)  # the earlier attempt may have failed before doing so
            return own

        return self._retry("put-if-absent", path, attempt, retry_on=_retryable,
                           outcome=lambda: "; an attempt may have created the file" if uncertain else "",
                           deadline=deadline, opening=opening)

    def _bounded(self, give_up_at: float | None) -> dict[str, float]:
        """The keyword that makes one S3 call give up (cancelled, `FSTimeoutError`) at the
        `time.monotonic()` value `give_up_at`. A write under the table lock must not land after
        its lease ran out, when another process may hold the lock; botocore's and s3fs's own
        retries of one request can otherwise last minutes. A call cancelled in flight may still
        land a moment later, which the protocol tolerates (format.md §15.5); what this bounds is
        the common case. Local disk and memory calls are not cancellable, nor slow to stall."""
        if give_up_at is None or not self.is_s3:
            return {}
        return {"timeout": max(give_up_at - time.monotonic(), 0.001)}  # fsspec takes 0 for "none"

    def _put_once(self, path: str, data: bytes, durable: bool = True, give_up_at: float | None = None) -> bool:
        if self.is_local:
            return local_disk.put_if_absent(path, data, durable)
        if self.is_memory:
            with _MEMORY_LOCK:
                if self.fs.exists(path):
                    return False
                self.fs.pipe_file(path, data)
                return True
        try:
            self._pipe(path, data, give_up_at, mode="create")
        except FileExistsError:
            return False
        return True

    def replace(self, rel: str, data: bytes, durable: bool = True, deadline: float | None = None,
                give_up_at: float | None = None) -> None:
        """Write `rel` whole, replacing what was there; readers see the old or the new content,
        never a torn one (local: temporary file and rename; S3: one PUT). On local disk the new
        content survives a power failure once this returns; with `durable=False` a power
        failure may leave the old content or an empty file (heartbeats, which read both as
        "no recent beat")."""
        path = self.full_path(rel)
        self._retry("replace", path, lambda: self._replace_once(path, data, durable, give_up_at), deadline=deadline,
                    outcome=lambda: "; an attempt may have replaced the file")

    def _replace_once(self, path: str, data: bytes, durable: bool = True, give_up_at: float | None = None) -> None:
        if self.is_local:
            local_disk.replace(path, data, durable)
            return
        self._pipe(path, data, give_up_at)

    def _pipe(self, path: str, data: bytes, give_up_at: float | None, **kwargs: Any) -> None:
        """One fsspec put of a whole object (S3 or memory), given up at `give_up_at` on S3."""
        bound = self._bounded(give_up_at)
        try:
            self.fs.pipe_file(path, data, **kwargs, **bound)
        except FSTimeoutError as exc:
            if not bound:
                raise
            raise FSTimeoutError("no reply before the table lock's lease ran out; the call was cancelled") from exc
        finally:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    def read_bytes(self, rel: str, opening: bool = False) -> bytes:
        """The content of `rel`; FileNotFoundError if there is none. `opening`: see `_retry`."""
        path = self.full_path(rel)
        return self._retry("read", path, lambda: self._read_once(path), opening=opening)

    def _read_once(self, path: str) -> bytes:
        if self.is_s3 and _cat_takes_concurrency(type(self.fs)):
            # One GET. s3fs (2026.3 on) first asks for the size (a HEAD) to read big files in
            # parallel ranges; with its listing cache off that doubled the requests of every plan
            # that reads commit files (nbcc's files read whole are small).
            return self.fs.cat_file(path, max_concurrency=1)
        return self.fs.cat_file(path)

    def list_names(self, rel_dir: str, prefix: str = "") -> list[str]:
        """Names (not paths) of the entries directly under `rel_dir` that start with `prefix`;
        [] if it does not exist. Always a fresh listing: s3fs caches listings, and a stale
        timeline would hide commits. On S3 the prefix is applied by the server."""
        path = self.full_path(rel_dir)
        names = self._retry("list", path, lambda: self._list_once(path, prefix))
        return [n for n in names if n and n.startswith(prefix) and not n.startswith(TMP_PREFIX)]

    def _list_once(self, path: str, prefix: str) -> list[str]:
        if self.is_local:
            try:
                return os.listdir(path)
            except FileNotFoundError:
                return []
        self.fs.invalidate_cache(path)
        try:
            if self.is_s3:
                # One request per page, the prefix applied by S3. fs.ls lists the parent folder
                # once more when a folder is empty (to tell a file from nothing), a request lost
                # on every load of an empty .nbcc/history, savepoints or heartbeats folder.
                try:
                    entries = [e["name"] for e in sync(self.fs.loop, self.fs._lsdir, path, refresh=True, prefix=prefix)]
                finally:  # older s3fs versions cache a partial (prefix) listing: it must answer no later call
                    self.fs.invalidate_cache(path)
            else:
                with _MEMORY_LOCK if self.is_memory else contextlib.nullcontext():
                    entries = self.fs.ls(path, detail=False)
        except FileNotFoundError:
            return []
        return [e.rstrip("/").rsplit("/", 1)[-1] for e in entries]

    def exists(self, rel: str) -> bool:
        path = self.full_path(rel)
        return self._retry("exists", path, lambda: self._exists_once(path))

    def _exists_once(self, path: str) -> bool:
        if not self.is_local:
            self.fs.invalidate_cache(path.rsplit("/", 1)[0])
        return self.fs.exists(path)

    def delete(self, rel: str) -> None:
        """Delete one file; a missing file is not an error (deletes are retried after crashes,
        and a retried delete whose first reply was lost finds the file gone)."""
        path = self.full_path(rel)
        self._retry("delete", path, lambda: self._delete_once(path))

    def _delete_once(self, path: str) -> None:
        try:
            with _MEMORY_LOCK if self.is_memory else contextlib.nullcontext():
                self.fs.rm_file(path)
        except FileNotFoundError:
            pass
        finally:
            if not self.is_local:
                self.fs.invalidate_cache(path.rsplit("/", 1)[0])

    def delete_many(self, rels: Sequence[str], progress: Callable[[int, int], None] | None = None) -> None:
        """Delete files, as `delete` does each (a missing one is not an error). On S3 one
        request deletes up to 1,000 (DeleteObjects), in no particular order: a caller that needs
        one file gone before another calls this twice. Keys that S3 failed to delete are deleted
        again one by one, so that their error is retried and, if it lasts, raised.
        `progress(done, total)` is called after every 1,000 files and at the end."""
        for start in range(0, len(rels), _DELETE_BATCH):
            batch = rels[start:start + _DELETE_BATCH]
            bulk = self.is_s3 and len(batch) > 1 and self._bulk_deletes
            for rel in self._delete_batch(batch) if bulk else batch:
                self.delete(rel)
            if progress is not None:
                progress(start + len(batch), len(rels))

    def _delete_batch(self, rels: Sequence[str]) -> list[str]:
        """One DeleteObjects request, retried; the files left to delete one by one: those S3
        reported it failed to delete, or all of them if the request failed."""
        by_path = {self.full_path(rel): rel for rel in rels}
        try:
            failed = self._retry("delete", f"{len(rels)} files under {self.uri}",
                                 lambda: self._delete_batch_once(list(by_path)))
        except Exception as exc:  # noqa: BLE001 - the single deletes raise what lasts
            if self._bulk_deletes and not isinstance(exc, StorageError):
                # Refused, not failed: some S3-compatible stores do not take DeleteObjects (or
                # not botocore's checksum header for it).
                self._bulk_deletes = False
                log.warning("the store of %s refused to delete %d files in one request (%s: %s); "
                            "deleting files one by one from now on", self.uri, len(rels), type(exc).__name__, exc)
            return list(rels)
        return [by_path[path] for path in failed]

    def _delete_batch_once(self, paths: list[str]) -> list[str]:
        """One DeleteObjects request; the paths S3 reported it failed to delete."""
        bucket = self.fs.split_path(paths[0])[0]
        keys = {"Objects": [{"Key": self.fs.split_path(p)[1]} for p in paths], "Quiet": True}
        try:
            out = sync(self.fs.loop, self.fs._call_s3, "delete_objects", Bucket=bucket, Delete=keys)
        finally:
            for parent in {p.rsplit("/", 1)[0] for p in paths}:
                self.fs.invalidate_cache(parent)
        errors = out.get("Errors") or []
        if errors:
            log.debug("S3 failed to delete %d of %d files (%s), deleting them one by one", len(errors),
                      len(paths), errors[0].get("Code"))
        return [f"{bucket}/{e['Key']}" for e in errors]

    # -- data files ------------------------------------------------------------------------

    def open_write(self, rel: str) -> BinaryIO:
        """A new data file, open for writing. Opening is retried; a failure while writing is
        not (the content streams through), it raises a StorageError naming the file, and the
        write is rolled back."""
        path = self.full_path(rel)
        return _DataSink(self._retry("open for writing", path, lambda: self._open_write_once(path)), path)

    def _open_write_once(self, path: str) -> BinaryIO:
        if self.is_local:
            return local_disk.open_new(path)
        return self.fs.open(path, "wb")

    def make_durable(self, rels: Sequence[str]) -> None:
        """Make written and closed data files durable, before a commit points at them: on local
        disk, fsync them and their folders (local_disk.py). A file closed on an object store is
        durable already."""
        if self.is_local and rels:
            local_disk.make_durable([self.full_path(rel) for rel in rels])

    def arrow_filesystem(self) -> pafs.FileSystem:
        """A pyarrow filesystem for reading Parquet: pyarrow's native one for local disk (fast,
        memory-mapped; a local disk has no transient errors to retry), otherwise fsspec's, with
        transient errors retried."""
        if self.is_local:
            return pafs.LocalFileSystem()
        return self._retrying_arrow_filesystem()

    @property
    def arrow_threads(self) -> bool:
        """Whether Arrow may read ahead and decode on its own threads a file opened through
        `arrow_filesystem()`: only on local disk. Through fsspec (S3, memory) every read returns
        Python bytes, and Arrow's threads can hold them past the call; one that drops the last
        of them after the interpreter began to exit needs the GIL, and the process aborts
        ("terminate called without an active exception") after its work is done. Without
        pre-buffering or threads, every such buffer is read and released on the calling thread."""
        return self.is_local

    @contextlib.contextmanager
    def open_parquet(self, rel: str, size: int | None = None, **options: Any) -> Iterator[pq.ParquetFile]:
        """The Parquet file `rel`, open through `arrow_filesystem()` until the block ends.
        Its reads pre-buffer and use Arrow's threads only where `arrow_threads` allows, so
        no caller has to remember to; `options` go to pq.ParquetFile. `size`: the file's size in
        bytes, as its commit recorded it, which spares an object store the request that asks
        for it (a HEAD per file: half the requests of a read of small log files)."""
        path = self.full_path(rel)
        if size and not self.is_local:
            raw = self._retry("open for reading", path, lambda: self._open_read_once(path, size))
            source = pa.PythonFile(_RetryingReader(self, path, raw), mode="r")
            try:
                pf = _ParquetFile(source, self.arrow_threads, **options)
            except Exception as exc:  # noqa: BLE001 - any but a missing file or a storage failure
                source.close()
                if is_not_found(exc) or isinstance(exc, StorageError):
                    raise
                # A file another writer described wrongly, or put back by hand: its content
                # counts, not the size on record.
                log.warning("%s is not a Parquet file of %d bytes, the size its commit recorded (%s); "
                            "reading it at the size the store gives", path, size, exc)
            else:
                with source:
                    yield pf
                return
        with self.arrow_filesystem().open_input_file(path) as source:
            yield _ParquetFile(source, self.arrow_threads, **options)

    def read_parquet(self, rel: str) -> pa.Table:
        """The whole Parquet file `rel` (a small one: it is read at once)."""
        with self.open_parquet(rel) as pf:
            return pf.read()

    def _retrying_arrow_filesystem(self) -> pafs.FileSystem:
        return pafs.PyFileSystem(_RetryingHandler(self))

    def _open_read_once(self, path: str, size: int | None = None) -> Any:
        """A file open for reading (FileNotFoundError if there is none; with its `size` given,
        at the first read)."""
        if size is None:
            return self.fs.open(path, mode="rb")
        raw = self.fs.open(path, mode="rb", size=size)
        if isinstance(raw, AbstractBufferedFile) and raw._details is None:
            # s3fs asks for the object's details (a HEAD) at the first read, for an ETag check
            # that an immutable data file does not need; these are the details it would use.
            raw.details = {"name": path, "size": size, "type": "file"}
        return raw


class _ParquetFile(pq.ParquetFile):
    """pq.ParquetFile whose reads use Arrow's threads only if `threads` (Storage.arrow_threads)."""

    def __init__(self, source: pa.NativeFile, threads: bool, **options: Any):
        super().__init__(source, pre_buffer=threads, **options)
        self._threads = threads

    def read(self, *args: Any, **kwargs: Any) -> pa.Table:
        return super().read(*args, **{"use_threads": self._threads, **kwargs})

    def read_row_group(self, *args: Any, **kwargs: Any) -> pa.Table:
        return super().read_row_group(*args, **{"use_threads": self._threads, **kwargs})

    def read_row_groups(self, *args: Any, **kwargs: Any) -> pa.Table:
        return super().read_row_groups(*args, **{"use_threads": self._threads, **kwargs})

    def iter_batches(self, *args: Any, **kwargs: Any) -> Iterator[pa.RecordBatch]:
        return super().iter_batches(*args, **{"use_threads": self._threads, **kwargs})


class _RetryingHandler(pafs.FSSpecHandler):
    """fsspec's pyarrow handler, with each storage call retried like every other one."""

    def __init__(self, storage: Storage):
        super().__init__(storage.fs)
        self._storage = storage

    def get_file_info(self, paths: list[str]) -> list[pafs.FileInfo]:
        return self._storage._retry("stat", ", ".join(paths), lambda: super(_RetryingHandler, self).get_file_info(paths))

    def open_input_file(self, path: str) -> pa.NativeFile:
        raw = self._storage._retry("open for reading", path, lambda: self._storage._open_read_once(path))
        return pa.PythonFile(_RetryingReader(self._storage, path, raw), mode="r")

    open_input_stream = open_input_file


class _RetryingReader:
    """A file open for reading whose reads are retried: each one re-seeks to where it started,
    so a read that failed half-way is simply made again."""

    def __init__(self, storage: Storage, path: str, raw: Any):
        self._storage, self._path, self._raw = storage, path, raw

    def read(self, size: int = -1) -> bytes:
        start = self._raw.tell()

        def once() -> bytes:
            self._raw.seek(start)
            return self._raw.read(size)
        return self._storage._retry("read", self._path, once)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._raw.seek(offset, whence)

    def tell(self) -> int:
        return self._raw.tell()

    def close(self) -> None:
        self._raw.close()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True


class _DataSink:
    """A data file being written: the file object, with every failure turned into a
    StorageError that names the file (pyarrow's writers call it like any file)."""

    def __init__(self, raw: Any, path: str):
        self._raw, self._path = raw, path
        self._aborted = False

    def _failed(self, what: str, exc: Exception) -> StorageError:
        self.abort()
        # Raised before the writer rolls the write back: it cannot say whether that worked.
        return StorageError(f"{what} data file {self._path} failed ({type(exc).__name__}: {exc}); "
                            "the write stopped and is rolled back: at once by its writer where the "
                            "storage allows, else by the next clean once its heartbeat expires")

    def abort(self) -> None:
        """Drop the file: its write failed (done here on any failure of this file; a writer
        should do it for its other open files too). An fsspec buffered file (S3) would
        otherwise upload what it holds whenever it is closed, even by the garbage collector,
        possibly after a rollback deleted the instant's files. What is written to it afterwards
        (a Parquet writer's footer, when it is closed) goes nowhere, without an error: the
        failure was reported once already."""
        self._aborted = True
        raw = self._raw
        try:
            if isinstance(raw, AbstractBufferedFile):
                raw.discard()  # S3: aborts a multipart upload
                raw.closed = True
            else:
                raw.close()
        except Exception as exc:  # noqa: BLE001 - the failure being reported matters more
            log.debug("aborting data file %s: %s", self._path, exc)

    def write(self, data: Any) -> int:
        if self._aborted:
            return memoryview(data).nbytes
        try:
            return self._raw.write(data)
        except NbccError:
            raise
        except Exception as exc:
            raise self._failed("writing", exc) from exc

    def flush(self) -> None:
        if self._aborted:
            return
        try:
            self._raw.flush()
        except NbccError:
            raise
        except Exception as exc:
            raise self._failed("flushing", exc) from exc

    def close(self) -> None:
        if self._aborted:
            return  # closed or discarded by abort; S3 must not upload it now
        try:
            self._raw.close()  # S3: uploads the rest
        except NbccError:
            raise
        except Exception as exc:
            raise self._failed("closing", exc) from exc

    def tell(self) -> int:
        return self._raw.tell()

    def fileno(self) -> int:
        return self._raw.fileno()

    @property
    def closed(self) -> bool:
        return self._raw.closed

    def writable(self) -> bool:
        return True

    def __enter__(self) -> "_DataSink":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def is_not_found(exc: BaseException) -> bool:
    return isinstance(exc, FileNotFoundError) or (
        isinstance(exc, OSError) and getattr(exc, "errno", None) == errno.ENOENT
    )
