"""The timeline: one file per instant state under `.nbcc/timeline/`.

    <instant>.<action>.requested     a write has started (holds a small JSON description)
    <instant>.<action>.inflight      it is writing files
    <instant>_<completion>.<action>  it completed; holds the commit metadata (JSON)

An instant is committed if and only if its completed file exists: that file is created with
put-if-absent under the table lock, and nothing else makes data visible. Readers build what they
see from one listing of this folder, never from listing data folders.
"""

from __future__ import annotations

import functools
import getpass
import json
import re
import socket
import threading
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable

from .clock import TIME_LEN, LockGrant
from .errors import CommitError, NbccError, TimelineFileError
from .storage import Storage

TIMELINE_DIR = ".nbcc/timeline"

DELTA_COMMIT = "deltacommit"  # upserts and deletes: log files
REPLACE_COMMIT = "replacecommit"  # overwrite: hides everything that completed before it
# Dynamic partition overwrite: hides, in each partition it wrote files to, everything there that
# completed before it. A name of its own (not a field of the metadata), so that every reader
# learns the scope from the listing alone, metadata table or not.
REPLACE_PARTITIONS = "replacepartitions"
OVERWRITES = (REPLACE_COMMIT, REPLACE_PARTITIONS)
DATA_ACTIONS = (DELTA_COMMIT, *OVERWRITES)  # the commits that change records
COMPACTION = "compaction"  # a pending compaction: <Tc>.compaction.requested holds its plan
COMPACTION_COMMIT = "commit"  # a completed compaction: <Tc>_<completion>.commit lists base files
CLEAN = "clean"  # files deleted: <instant>_<completion>.clean records them and the window kept
# Building metadata table partitions (indexing.py): <Ti>.indexing.requested holds the plan. Adds
# no files and changes no record: readers, slicing and the other services pass it by.
INDEXING = "indexing"

REQUESTED, INFLIGHT, COMPLETED = "requested", "inflight", "completed"
ROLLEDBACK = "rolledback"  # a failed write undone: <instant>.<action>.rolledback
_STATE_RANK = {REQUESTED: 0, INFLIGHT: 1, ROLLEDBACK: 2, COMPLETED: 3}


@dataclass(frozen=True)
class Instant:
    instant: str
    action: str
    state: str
    completion: str | None = None
    archived: bool = field(default=False, compare=False, repr=False)  # lives in .nbcc/history/

    @property
    def is_completed(self) -> bool:
        return self.state == COMPLETED

    @property
    def file_name(self) -> str:
        if self.state == COMPLETED:
            return f"{self.instant}_{self.completion}.{self.action}"
        return f"{self.instant}.{self.action}.{self.state}"


# Every listing parses every name again, and a long timeline has thousands: a name always stands
# for the same (immutable) Instant, so parses are remembered.
@functools.lru_cache(maxsize=1 << 16)
def parse_instant_file(name: str) -> Instant | None:
    """The Instant a timeline file name stands for, or None for names that are not instants."""
    parts = name.split(".")
    if len(parts) == 3 and parts[2] in (REQUESTED, INFLIGHT, ROLLEDBACK):
        instant, action, state = parts
        if len(instant) == TIME_LEN and instant.isdigit():
            return Instant(instant, action, state)
        return None
    if len(parts) == 2:
        times, action = parts
        instant, sep, completion = times.partition("_")
        if sep and len(instant) == TIME_LEN and len(completion) == TIME_LEN and (instant + completion).isdigit():
            return Instant(instant, action, COMPLETED, completion)
    return None


class Timeline:
    """One consistent listing of the timeline: the latest state of each instant, oldest first."""

    def __init__(self, instants: Iterable[Instant]):
        best: dict[str, Instant] = {}
        for it in instants:
            cur = best.get(it.instant)
            if cur is None or _STATE_RANK[it.state] > _STATE_RANK[cur.state]:
                best[it.instant] = it
        self.instants: list[Instant] = sorted(best.values(), key=lambda i: i.instant)
        self._by_instant = best  # get() in O(1): callers look up every instant of long timelines

    @classmethod
    def load(cls, storage: Storage) -> "Timeline":
        """The active timeline (one listing) plus the archived instants of `.nbcc/history/`."""
        # Active first, then history: archival writes history before deleting active files, so
        # an instant missing from this listing is in the history listed after it. The two are
        # merged by highest state (history first, so it wins ties: its copy cannot vanish).
        parsed = [i for i in (parse_instant_file(n) for n in storage.list_names(TIMELINE_DIR)) if i is not None]
        return cls(load_history(storage) + parsed)

    def completed(self) -> list[Instant]:
        """Completed instants in completion order (the order commits became visible)."""
        return sorted((i for i in self.instants if i.is_completed), key=lambda i: i.completion)

    def pending(self) -> list[Instant]:
        """Instants requested or inflight (not completed, not rolled back)."""
        return [i for i in self.instants if i.state in (REQUESTED, INFLIGHT)]

    def pending_compactions(self) -> list[str]:
        """Compactions scheduled and not completed, oldest first."""
        return [i.instant for i in self.pending() if i.action == COMPACTION]

    def completion_times(self) -> dict[str, str | None]:
        """instant -> completion time, None for pending ones (what file slicing takes)."""
        return {i.instant: i.completion for i in self.instants}

    def get(self, instant: str) -> Instant | None:
        return self._by_instant.get(instant)

    def latest_completion(self) -> str | None:
        done = self.completed()
        return done[-1].completion if done else None

    def latest_data_commit(self) -> Instant | None:
        """The data commit (upsert, delete or overwrite) that completed last."""
        return next((i for i in reversed(self.completed()) if i.action in DATA_ACTIONS), None)


# -- commit metadata (immutable once written, so cached by file name) --------------------------
def committed_by() -> dict[str, str]:
    """Who completes a commit, for its metadata (`nbcc history`): this machine's name and the
    operating system user, where one can be found (a container may run as a user without one)."""
    try:
        user = getpass.getuser()
    except Exception:  # noqa: BLE001 - KeyError, OSError: no name for this uid
        return {"host": socket.gethostname()}
    return {"host": socket.gethostname(), "user": user}



_CACHE: "OrderedDict[tuple[str, str], dict[str, Any]]" = OrderedDict()
_CACHE_LOCK = threading.Lock()
_CACHE_SIZE = 20_000


# The lists a completed file of each action must hold: readers build file slices from them.
_COMMIT_LISTS = {action: ("files",) for action in (*DATA_ACTIONS, COMPACTION_COMMIT)}


def read_timeline_file(storage: Storage, name: str, what: str, lists: Iterable[str] = ()) -> dict[str, Any]:
    """The JSON object of timeline file `name` (`what` it is, for the error), which must hold a
    list under each of `lists`; TimelineFileError, naming the file, if it is damaged
    (FileNotFoundError if it is missing, which callers handle)."""
    path = f"{TIMELINE_DIR}/{name}"
    data = storage.read_bytes(path)
    try:
        doc = json.loads(data)
        problem = None if isinstance(doc, dict) else f"a JSON {type(doc).__name__}, not an object"
    except (ValueError, UnicodeDecodeError) as exc:
        problem = f"not JSON: {exc}" if data.strip() else "empty"
    if problem is None:
        missing = [key for key in lists if not isinstance(doc.get(key), list)]
        problem = f"no list {missing[0]!r}" if missing else None
    if problem is not None:
        raise TimelineFileError(
            f"{storage.uri.rstrip('/')}/{path} is damaged ({problem}); it holds {what}, which reads of the "
            "table need. Put the file back from a backup or the storage's earlier versions of it (S3 object "
            "versioning, a snapshot): nbcc will not guess what it held")
    return doc


def read_commit_metadata(storage: Storage, instant: Instant) -> dict[str, Any]:
    if not instant.is_completed:
        raise CommitError(f"instant {instant.instant} is {instant.state}; only completed instants have metadata")
    if instant.archived:
        return _archived_metadata(storage, instant.instant)
    key = (storage.uri, instant.file_name)
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
        if hit is not None:
            _CACHE.move_to_end(key)
            return hit
    try:
        meta = read_timeline_file(storage, instant.file_name, f"the commit metadata of {instant.action} "
                                  f"{instant.instant}", _COMMIT_LISTS.get(instant.action, ()))
    except FileNotFoundError:
        load_history(storage)  # archived since it was listed
        if (storage.uri, instant.instant) in _HISTORY_METADATA:
            return _archived_metadata(storage, instant.instant)
        raise
    with _CACHE_LOCK:
        _CACHE[key] = meta
        if len(_CACHE) > _CACHE_SIZE:
            _CACHE.popitem(last=False)
    return meta


# Commit files fetched at once from object storage: s3fs's connection pool holds 10
# (botocore's max_pool_connections), so more threads would only queue for a connection.
_PARALLEL_READS = 10


def read_commit_metadatas(storage: Storage, instants: Iterable[Instant]) -> dict[str, dict[str, Any]]:
    """`read_commit_metadata` of each of `instants`, by instant. On S3 every commit file not in
    the cache is one request, a round trip each: those are fetched 10 at a time, so planning
    from a long timeline waits for a tenth of the round trips (local files: one by one)."""
    instants = list(instants)
    with _CACHE_LOCK:
        fetch = [i for i in instants if not i.archived and (storage.uri, i.file_name) not in _CACHE]
    fetched = dict(zip((i.instant for i in fetch), _fetch_all(storage, fetch, read_commit_metadata)))
    return {i.instant: fetched[i.instant] if i.instant in fetched else read_commit_metadata(storage, i)
            for i in instants}


def read_rollback_marks(storage: Storage, instants: Iterable[Instant]) -> dict[str, dict[str, Any]]:
    """The rollback mark of each rolled-back one of `instants`, by instant (`_read_mark`)."""
    marked = [i for i in instants if i.state == ROLLEDBACK]
    return dict(zip((i.instant for i in marked), _fetch_all(storage, marked, _read_mark) or
                    [_read_mark(storage, i) for i in marked]))


def _read_mark(storage: Storage, inst: Instant) -> dict[str, Any]:
    """The rollback mark of rolled-back `inst`: when it was rolled back (`rolled_back_at`) and
    why (`reason`), as the rollback wrote them; {} for a mark that is gone (archived since the
    listing), damaged or unreadable: a mark only informs."""
    try:
        if inst.archived:
            return json.loads(_HISTORY_MARKS[(storage.uri, inst.instant)])
        return read_timeline_file(storage, inst.file_name, f"the rollback mark of {inst.instant}")
    except (OSError, KeyError, ValueError, NbccError):
        return {}


def _fetch_all(storage: Storage, items: list[Any], read: Callable[[Storage, Any], Any]) -> list[Any]:
    """`read(storage, item)` of each item, 10 at a time on object storage (each is a round
    trip); [] where that does not pay (local files, fewer than two) or cannot be done (no new
    threads once the interpreter shuts down, atexit): the caller then reads one by one."""
    if len(items) < 2 or storage.is_local:
        return []
    try:
        with ThreadPoolExecutor(max_workers=min(_PARALLEL_READS, len(items)), thread_name_prefix="nbcc-read") as pool:
            return list(pool.map(lambda item: read(storage, item), items))
    except RuntimeError as exc:
        if "shutdown" not in str(exc):
            raise
        return []


# -- writing the instant lifecycle -------------------------------------------------------------

def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def is_completed(storage: Storage, instant: str) -> bool:
    """Whether `instant` is completed now (asked by a run that failed or lost a race: another
    run may have completed it)."""
    inst = Timeline.load(storage).get(instant)
    return inst is not None and inst.is_completed


def create_requested(storage: Storage, instant: str, action: str, info: dict[str, Any],
                     grant: LockGrant | None = None) -> None:
    """`grant`: the table lock, when it is made under it (LockGrant.put_if_absent)."""
    rel, data = f"{TIMELINE_DIR}/{instant}.{action}.{REQUESTED}", _json(info)
    if not (grant.put_if_absent(storage, rel, data) if grant else storage.put_if_absent(rel, data)):
        raise CommitError(f"instant {instant} already exists on the timeline")


def create_inflight(storage: Storage, instant: str, action: str, info: dict[str, Any]) -> None:
    if not storage.put_if_absent(f"{TIMELINE_DIR}/{instant}.{action}.{INFLIGHT}", _json(info)):
        raise CommitError(f"instant {instant} is already inflight")


def _rolled_back(storage: Storage, instant: str, names: Iterable[str]) -> CommitError | None:
    """The error of a writer of `instant` once a rollback marked it (one of `names`, the
    timeline's names that start with it); None if none did."""
    for name in names:
        if name.startswith(f"{instant}.") and name.endswith(f".{ROLLEDBACK}"):
            why = _read_mark(storage, parse_instant_file(name)).get("reason")  # manual, heartbeat expired, ...
            why = (f": {why.strip()}" if isinstance(why, str) and why.strip()
                   else " (its heartbeat expired, or its job aborted)")
            return CommitError(f"instant {instant} was rolled back{why}; its files are gone: write the data again")
    return None


def rolled_back_error(storage: Storage, instant: str) -> CommitError | None:
    """`_rolled_back`, listing the timeline: why a write of `instant` that failed to write a file
    failed, when a rollback deleted its files meanwhile (a cleaner took it for dead); None if it
    was not rolled back, or the timeline cannot be listed (the first failure is the one to tell)."""
    try:
        return _rolled_back(storage, instant, storage.list_names(TIMELINE_DIR, prefix=instant))
    except Exception:  # noqa: BLE001
        return None


def create_completed(storage: Storage, instant: str, grant: LockGrant, action: str,
                     metadata: dict[str, Any]) -> str:
    """Publish a commit under the table lock `grant`, whose time is its completion time (returned).

    The completed file's name holds the completion time, so put-if-absent alone cannot stop a
    retried commit from completing the instant twice; under the lock, looking first is safe. The
    same look refuses an instant that was rolled back (rollback marks it under the same lock)."""
    completion = grant.time
    names = storage.list_names(TIMELINE_DIR, prefix=instant)
    for name in names:
        if name.startswith(f"{instant}_"):
            raise CommitError(f"instant {instant} is already completed ({name})")
    stopped = _rolled_back(storage, instant, names)
    if stopped is not None:
        raise stopped
    # Its requested file must still be there: one rolled back and then archived has lost its
    # mark, and only its requested file is never made again (a writer that stalled through the
    # rollback can still put its inflight file afterwards).
    pending_action = COMPACTION if action == COMPACTION_COMMIT else action
    if f"{instant}.{pending_action}.{REQUESTED}" not in names:
        again = "; write the data again" if action in DATA_ACTIONS else ""
        raise CommitError(f"instant {instant} is not pending on the timeline (its requested file is gone: "
                          f"it was rolled back, and its mark archived){again}")
    name = f"{instant}_{completion}.{action}"
    # Checked after the listing: the put has the rest of half a lease to land.
    # A data write that fails is rolled back at once: its completed file must not land later.
    if not grant.put_if_absent(storage, f"{TIMELINE_DIR}/{name}", _json(metadata),
                               give_up=action not in DATA_ACTIONS):
        raise CommitError(f"instant {instant} is already completed")
    grant.published(f"{action} {instant} (completed at {completion})")
    return completion


def pending_files(instant: str, action: str) -> list[str]:
    """The requested and inflight files of `instant`: after completion (or rollback) no longer
    needed. In either order: the completed file or rollback mark outranks both (`_STATE_RANK`)."""
    return [f"{TIMELINE_DIR}/{instant}.{action}.{state}" for state in (INFLIGHT, REQUESTED)]


def remove_pending_files(storage: Storage, instant: str, action: str) -> None:
    storage.delete_many(pending_files(instant, action))


def read_compaction_plan(storage: Storage, instant: str) -> dict[str, Any]:
    """The plan of compaction `instant` (immutable once written, so cached; archived plans are
    kept in the history files)."""
    key = (storage.uri, f"{instant}.{COMPACTION}.{REQUESTED}")
    with _CACHE_LOCK:
        hit = _CACHE.get(key)
    if hit is not None:
        return hit
    try:
        plan = read_timeline_file(storage, f"{instant}.{COMPACTION}.{REQUESTED}",
                                  f"the plan of compaction {instant}")
    except FileNotFoundError:
        load_history(storage)
        if (storage.uri, instant) not in _HISTORY_PLANS:
            raise
        plan = _HISTORY_PLANS[(storage.uri, instant)]
    with _CACHE_LOCK:
        _CACHE[key] = plan
    return plan


# -- the archived timeline (.nbcc/history/*.parquet, written by archive.py) ------------------------

HISTORY_DIR = ".nbcc/history"
_HISTORY_FILES: dict[tuple[str, str], list[Instant]] = {}
_HISTORY_LOAD_LOCKS: dict[tuple[str, str], threading.Lock] = {}  # one per file: files load in parallel
# Metadata of archived instants: JSON text until first asked for (a plan from the metadata table
# needs only the instants and completion times of the history, not thousands of parsed commits).
_HISTORY_METADATA: dict[tuple[str, str], dict[str, Any] | str] = {}
_HISTORY_PLANS: dict[tuple[str, str], dict[str, Any]] = {}
_HISTORY_MARKS: dict[tuple[str, str], str] = {}  # rollback marks of archived rolled-back writes, as JSON text


def _archived_metadata(storage: Storage, instant: str) -> dict[str, Any]:
    key = (storage.uri, instant)
    meta = _HISTORY_METADATA[key]
    if isinstance(meta, str):
        meta = _HISTORY_METADATA[key] = json.loads(meta)  # a race parses it twice: harmless
    return meta


def load_history(storage: Storage) -> list[Instant]:
    """Archived instants, from every history file (each read once per process: they never change)."""
    names = sorted(n for n in storage.list_names(HISTORY_DIR) if n.endswith(".parquet"))
    with _CACHE_LOCK:
        missing = [n for n in names if (storage.uri, n) not in _HISTORY_FILES]
    _fetch_all(storage, missing, _load_history_file)  # a fresh process on S3: many files to read
    out: list[Instant] = []
    for name in names:
        with _CACHE_LOCK:
            cached = _HISTORY_FILES.get((storage.uri, name))
        out.extend(cached if cached is not None else _load_history_file(storage, name))
    return out


def _load_history_file(storage: Storage, name: str) -> list[Instant]:
    """One history file's instants, read once even when threads that all found an instant
    archived since their listing ask for it together."""
    key = (storage.uri, name)
    with _CACHE_LOCK:
        lock = _HISTORY_LOAD_LOCKS.setdefault(key, threading.Lock())
    with lock:
        with _CACHE_LOCK:
            cached = _HISTORY_FILES.get(key)
        if cached is None:
            # Not parsed from read_bytes: Arrow's threads could hold those Python bytes past the
            # read, and releasing them at interpreter exit aborts the process (Storage.arrow_threads).
            rows = storage.read_parquet(f"{HISTORY_DIR}/{name}").to_pylist()
            cached = []
            for r in rows:
                cached.append(Instant(r["instant"], r["action"], r["state"], r["completion"], archived=True))
                if r["state"] == COMPLETED:
                    _HISTORY_METADATA[(storage.uri, r["instant"])] = r["metadata"]
                elif r["state"] == ROLLEDBACK and r["metadata"]:
                    _HISTORY_MARKS[(storage.uri, r["instant"])] = r["metadata"]
                if r.get("plan"):
                    _HISTORY_PLANS[(storage.uri, r["instant"])] = json.loads(r["plan"])
            with _CACHE_LOCK:
                _HISTORY_FILES[key] = cached
    return cached


# <S>_<created>.json: a state kept readable past the window; <S>_<created>.pending.json: one being
# made, whose state cleans keep too (savepoint.py, format.md §14.6).
SAVEPOINT_DIR = ".nbcc/savepoints"
_SAVEPOINT_FILE = re.compile(rf"(\d{{{TIME_LEN}}})_(\d{{{TIME_LEN}}})(\.pending)?\.json")


def savepoint_files(storage: Storage) -> list[tuple[str, str, bool]]:
    """(S, created, confirmed) of every savepoint file, in name order (savepoint.py)."""
    found = [_SAVEPOINT_FILE.fullmatch(n) for n in storage.list_names(SAVEPOINT_DIR)]
    return [(m[1], m[2], m[3] is None) for m in found if m]


def savepoint_times(storage: Storage, pending: bool = False) -> list[str]:
    """The states the table's savepoints keep readable, by their times, oldest first; with
    `pending`, those of savepoints being made too (which cleans keep as well)."""
    return sorted({s for s, _, confirmed in savepoint_files(storage) if confirmed or pending})


def read_cleans(storage: Storage, timeline: Timeline, _attempts: int = 3) -> list[tuple[Instant, dict[str, Any]]]:
    """Every clean on `timeline` with its record: a completed one's metadata, a pending one's
    plan (`<Tcl>.clean.requested`: `earliest_retained`, `delete`, `savepoints`). A plan gone
    since the listing means that clean completed meanwhile: the timeline is listed again."""
    out = []
    for inst in timeline.instants:
        if inst.action != CLEAN:
            continue
        if inst.is_completed:
            out.append((inst, read_commit_metadata(storage, inst)))
            continue
        try:
            out.append((inst, read_timeline_file(storage, f"{inst.instant}.{CLEAN}.{REQUESTED}",
                                                 f"the plan of clean {inst.instant}")))
        except FileNotFoundError:
            if _attempts > 0:
                return read_cleans(storage, Timeline.load(storage), _attempts - 1)
            raise
    return out


def earliest_retained(storage: Storage, timeline: Timeline) -> str | None:
    """The start of the window the cleaner retained (None if no clean ran): the greatest
    `earliest_retained` of every clean, pending ones included (a pending clean may already be
    deleting). Reads before it are refused."""
    return max((w for _, record in read_cleans(storage, timeline) if (w := record.get("earliest_retained"))),
               default=None)
