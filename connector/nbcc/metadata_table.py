"""The metadata table (RFC-45): an nbcc table under `.nbcc/metadata/` that indexes the data files
of its table, so that planning a read needs neither the commit files nor folder listings, and
point lookups and filters skip files that cannot match.

It is an ordinary nbcc table (its own timeline, lock and clock), partitioned by `kind`:

    files         per data file: partition, file group, instant, rows, bytes, live
    column_stats  per data file: min, max, null count per column, and the value count
    key_filters   per data file: a bloom filter of its record keys (bloom.py)

Each kind also holds one *marker* row per indexed instant (key = the instant; `files` markers
carry the commit's action and schema). An instant's marker and its entries are written in one
delta commit of the metadata table, so a marker says "every file of this instant is here".
Entries are a pure function of the instant's commit metadata and of the files themselves: who
writes them (the writer, the indexer, a compaction) and how often does not matter.

Which partitions are in use is recorded in `table.json` (`metadata_table`: kind -> "building",
"ready" or "dropping"), rewritten whole under the table lock. Readers use a partition only when it
is ready; writers add their entries while it is building or ready (indexing.py, commit.py); a
dropping partition is used by no one while its rows are deleted.
"""

from __future__ import annotations

import json
import logging
import threading
from typing import Any, Collection, Iterable, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from . import bloom
from .clock import LockGrant
from .config import DELETE, TABLE_CONFIG_PATH, UPSERT, TableConfig
from .errors import InvalidOptionError, NbccError
from .reader import read_columns
from .schema import RECORD_KEY_COL, constant_strings
from .storage import Storage
from .timeline import CLEAN, COMPACTION_COMMIT, DATA_ACTIONS, ROLLEDBACK, Timeline, read_commit_metadata

log = logging.getLogger(__name__)

METADATA_DIR = ".nbcc/metadata"
FILES, COLUMN_STATS, KEY_FILTERS = "files", "column_stats", "key_filters"
KINDS = (FILES, COLUMN_STATS, KEY_FILTERS)
BUILDING, READY, DROPPING = "building", "ready", "dropping"
STATE_KEY = "metadata_table"  # the field of table.json
INDEXED_ACTIONS = DATA_ACTIONS + (COMPACTION_COMMIT,)  # the instants that add data files

# The metadata table's own upkeep, done by whoever writes it: a compaction once this many delta
# commits piled up (reads then open one base file and a few logs per kind), and past
# ARCHIVE_ABOVE active instants a clean and an archival (reads then list a short timeline).
COMPACT_EVERY = 10
RETAIN_COMMITS = 10
ARCHIVE_ABOVE = 300
HEARTBEAT_TIMEOUT_S = 60  # its writes are short: one small commit each

SCHEMA = pa.schema([
    pa.field("kind", pa.string()),
    pa.field("key", pa.string(), nullable=False),  # "<partition>/<file name>", or an instant (a marker)
    pa.field("instant", pa.string()),  # the data instant that wrote the file (or the marker's)
    pa.field("action", pa.string()),  # markers: the instant's action
    pa.field("schema", pa.string()),  # `files` markers: the commit's schema (JSON)
    pa.field("partition", pa.string()),
    pa.field("name", pa.string()),
    pa.field("file_group", pa.string()),
    pa.field("rows", pa.int64()),  # also the value count of every column
    pa.field("bytes", pa.int64()),
    pa.field("live", pa.bool_()),
    pa.field("columns", pa.list_(pa.string())),  # column_stats, one item per column
    pa.field("mins", pa.list_(pa.string())),  # as text: decimal, ISO date, true/false, the string
    pa.field("maxs", pa.list_(pa.string())),
    pa.field("nulls", pa.list_(pa.int64())),
    pa.field("ranges", pa.list_(pa.bool_())),  # false: min and max were not recorded
    pa.field("bloom", pa.binary()),  # key_filters
    pa.field("probes", pa.int32()),
])


def check_kinds(names: Iterable[str] | str) -> list[str]:
    """Metadata partition names, validated (comma-separated text or a list)."""
    if isinstance(names, str):
        names = names.split(",")
    out = []
    for n in names:
        n = str(n).strip().lower()
        if not n:
            continue
        if n not in KINDS:
            raise InvalidOptionError(
                f"unknown metadata table partition {n!r}; the partitions are {', '.join(KINDS)}")
        if n not in out:
            out.append(n)
    if not out:
        raise InvalidOptionError(f"name at least one metadata table partition: {', '.join(KINDS)}")
    return out


def file_key(partition: str, name: str) -> str:
    return f"{partition}/{name}"


# -- which partitions are in use (table.json) ----------------------------------------------------

def read_states(storage: Storage, dropping: bool = False) -> dict[str, str]:
    """kind -> "building" | "ready", read fresh from table.json ({} for tables without it); with
    `dropping`, partitions being dropped too (whoever rewrites the field must keep them)."""
    doc = json.loads(storage.read_bytes(TABLE_CONFIG_PATH))
    states = doc.get(STATE_KEY) or {}
    known = (BUILDING, READY, DROPPING) if dropping else (BUILDING, READY)
    return {k: v for k, v in states.items() if k in KINDS and v in known}


def write_states(storage: Storage, grant: LockGrant, states: Mapping[str, str]) -> None:
    """Rewrite table.json's metadata_table field; only under the table lock (`grant`), so that
    two rewrites never interleave. One replace: readers see the old or the new file whole."""
    doc = json.loads(storage.read_bytes(TABLE_CONFIG_PATH))
    if states:
        doc[STATE_KEY] = dict(sorted(states.items()))
    else:
        doc.pop(STATE_KEY, None)
    grant.replace(storage, TABLE_CONFIG_PATH, json.dumps(doc, indent=2).encode())


def active_kinds(storage: Storage) -> list[str]:
    """The partitions a writer must add its entries to (building or ready)."""
    try:
        return sorted(read_states(storage))
    except FileNotFoundError:
        return []


# -- the metadata table itself -------------------------------------------------------------------

_OPEN: dict[tuple, Any] = {}
_OPEN_LOCK = threading.Lock()


def metadata_storage(storage: Storage) -> Storage:
    return storage.child(METADATA_DIR)


def open_metadata_table(storage: Storage, create: bool = False):
    """The metadata table of the table at `storage` (a `Table`), None if it has none."""
    from .errors import TableExistsError, TableNotFoundError
    from .table import Table

    mdt_storage = metadata_storage(storage)
    key = mdt_storage.identity()
    with _OPEN_LOCK:
        if key in _OPEN:  # its table.json never changes: open it once per process
            return _OPEN[key]
    try:
        table = Table.open_at(mdt_storage)
    except TableNotFoundError:
        if not create:
            return None
        try:
            table = Table.create_at(mdt_storage, TableConfig.build(
                SCHEMA, "key", partition_by="kind", buckets=1, merge_mode="commit_time",
                heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))
        except TableExistsError:  # another indexer created it first
            table = Table.open_at(mdt_storage)
    with _OPEN_LOCK:
        _OPEN[key] = table
    return table


# -- entries -------------------------------------------------------------------------------------

def _text(value: Any) -> str | None:
    """A statistic as text (JSON values of commit metadata: numbers, strings, booleans)."""
    if value is None:
        return None
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


def _count(value: Any) -> int | None:
    """A null count; None (null) when the writer did not record one: unknown, not zero, or an
    `is_null` filter would skip files holding nulls."""
    return None if value is None else int(value)


def entries(storage: Storage, metadata: Mapping[str, Any], kinds: Sequence[str]) -> list[dict[str, Any]]:
    """The rows that index one completed (or completing) instant: its markers and, per kind, one
    row per file. `key_filters` reads each file's record keys; a file that is gone (cleaned
    meanwhile) gets no filter, which only means "may hold any key"."""
    instant, action = metadata["instant"], metadata["action"]
    out: list[dict[str, Any]] = []
    for kind in kinds:
        marker = {"kind": kind, "key": instant, "instant": instant, "action": action}
        if kind == FILES:
            marker["schema"] = json.dumps(metadata.get("schema", []), sort_keys=True)
        out.append(marker)
    for f in metadata.get("files", []):
        base = {"key": file_key(f["partition"], f["name"]), "instant": instant, "partition": f["partition"],
                "name": f["name"], "file_group": f["file_group"], "rows": int(f["rows"])}
        if FILES in kinds:
            out.append({**base, "kind": FILES, "bytes": int(f["bytes"]), "live": bool(f.get("live", False))})
        if COLUMN_STATS in kinds and "stats" in f:
            cols = sorted(f["stats"])
            st = [f["stats"][c] for c in cols]
            out.append({**base, "kind": COLUMN_STATS, "columns": cols,
                        "mins": [_text(s.get("min")) for s in st], "maxs": [_text(s.get("max")) for s in st],
                        "nulls": [_count(s.get("nulls")) for s in st], "ranges": ["min" in s for s in st]})
        if KEY_FILTERS in kinds:
            try:
                keys = read_columns(storage, f["partition"], [f["name"]], [RECORD_KEY_COL],
                                    sizes={f["name"]: int(f.get("bytes", 0))}).column(RECORD_KEY_COL)
            except NbccError as exc:
                if not storage.exists(f"{f['partition']}/{f['name']}" if f["partition"] else f["name"]):
                    continue  # deleted by a clean: no read will open it
                raise exc
            out.append({**base, "kind": KEY_FILTERS, "bloom": bloom.build(keys), "probes": bloom.PROBES})
    return out


def commit_rows(mdt: Any, data: pa.Table, operation: str = UPSERT) -> str:
    """One delta commit of the metadata table (what `Table.write` does, less the schema fold over
    its whole timeline: its schema is SCHEMA for ever). Its instant."""
    from .commit import WriteTransaction
    from .filenames import make_token
    from .heartbeat import Heartbeat, interval_s
    from .timeline import DELTA_COMMIT
    from .writer import LogWriter, prepare

    txn = WriteTransaction(mdt.storage, mdt.clock, DELTA_COMMIT, operation, SCHEMA, partition_depth=1)
    txn.begin()
    writer = LogWriter(mdt.storage, mdt.config, SCHEMA, txn.instant, make_token(0, 0, 0))
    # begin() beat just now.
    with Heartbeat(mdt.storage, txn.instant, interval_s(mdt.config.heartbeat_timeout_s), beat_first=False) as beating:
        writer.write(prepare(data, mdt.config, SCHEMA, operation))
        txn.commit(writer.close(), beating=beating)
    return txn.instant


def write_rows(storage: Storage, rows: list[dict[str, Any]], maintain: bool = True) -> str | None:
    """Write index rows into the metadata table as one delta commit; its instant (None if the
    table has no metadata table)."""
    mdt = open_metadata_table(storage)
    if mdt is None or not rows:
        return None
    instant = commit_rows(mdt, pa.Table.from_pylist(rows, schema=SCHEMA))
    if maintain:
        upkeep(mdt)
    return instant


def delete_rows(mdt: Any, kind: str, keys: pa.Array | pa.ChunkedArray) -> str | None:
    """Delete rows of one kind by key, in one delta commit."""
    if not len(keys):
        return None
    return commit_rows(mdt, pa.table({"kind": constant_strings(kind, len(keys)), "key": keys}), DELETE)


def forget(storage: Storage, files: Iterable[tuple[str, str]], kinds: Sequence[str]) -> str | None:
    """Delete the entries of `files` (deleted by a clean) in one delta commit."""
    keys = pa.array([file_key(p, n) for p, n in files], pa.string())
    mdt = open_metadata_table(storage)
    if not len(keys) or not kinds or mdt is None:
        return None
    data = pa.table({"kind": pa.concat_arrays([constant_strings(k, len(keys)) for k in kinds]),
                     "key": pa.concat_arrays([keys] * len(kinds))})
    return commit_rows(mdt, data, DELETE)


def completed_cleans(timeline: Timeline) -> set[str]:
    return {inst.instant for inst in timeline.completed() if inst.action == CLEAN}


def cleaned_files(storage: Storage, timeline: Timeline, skip: Collection[str] = ()) -> set[tuple[str, str]]:
    """Files that completed cleans deleted (archived cleans too): no read opens them again.
    `skip`: cleans whose files the caller has already (their commit files are not read again)."""
    gone: set[tuple[str, str]] = set()
    for inst in timeline.completed():
        if inst.action == CLEAN and inst.instant not in skip:
            gone.update(tuple(d) for d in read_commit_metadata(storage, inst).get("deleted", []))
    return gone


def _delete_matching(mdt: Any, kinds: Sequence[str], files: set[str], instants: set[str]) -> str | None:
    """Delete, in one delta commit, the entries whose key is in `files` and every row (markers
    included) of `instants`, in `kinds`; its instant, None if nothing matched."""
    from .index_view import read_rows  # it imports this module

    file_set, instant_set = pa.array(sorted(files), pa.string()), pa.array(sorted(instants), pa.string())
    kind_cols, key_cols = [], []
    for kind in kinds:
        got = read_rows(mdt, kind, ())
        hit = pc.or_(pc.and_(pc.is_valid(got.column("name")), pc.is_in(got.column("key"), value_set=file_set)),
                     pc.is_in(got.column("instant"), value_set=instant_set))
        keys = got.column("key").filter(hit).combine_chunks()
        if len(keys):
            kind_cols.append(constant_strings(kind, len(keys)))
            key_cols.append(keys)
    if not key_cols:
        return None
    return commit_rows(mdt, pa.table({"kind": pa.concat_arrays(kind_cols), "key": pa.concat_arrays(key_cols)}),
                       DELETE)


def prune(storage: Storage) -> str | None:
    """Delete what no read needs, whoever wrote it and whenever: the entries of every file that
    a completed clean deleted, and every row of rolled-back instants. Idempotent over the whole
    timeline, so rows that came back after they were first forgotten (an indexer that read the
    timeline before a clean completed, a slow writer whose instant was rolled back meanwhile)
    go at the next run. A clean runs it after completing (format.md §18.7)."""
    kinds = active_kinds(storage)
    mdt = open_metadata_table(storage) if kinds else None
    if mdt is None:
        return None
    timeline = Timeline.load(storage)
    gone = {file_key(p, n) for p, n in cleaned_files(storage, timeline)}
    dead = {i.instant for i in timeline.instants if i.state == ROLLEDBACK}
    return _delete_matching(mdt, kinds, gone, dead)


def forget_rolled_back(storage: Storage, instant: str) -> None:
    """A rollback's part: delete the rows of the rolled-back `instant` (a writer writes them
    before completing). Never fails the rollback: readers never look at them (format.md §18.5),
    and the next clean's prune() deletes any left."""
    try:
        kinds = active_kinds(storage)
        mdt = open_metadata_table(storage) if kinds else None
        if mdt is not None:
            _delete_matching(mdt, kinds, set(), {instant})
    except Exception as exc:  # noqa: BLE001
        log.warning("rollback of %s: deleting its metadata table rows failed (the next clean does it): %s",
                    instant, exc)


def index_commit(storage: Storage, metadata: Mapping[str, Any], maintain: bool = True) -> bool:
    """A writer's part: add the entries of its commit to the partitions being built or ready
    (table.json, read now). Never fails the commit: a gap only makes readers read that instant's
    commit file, and the indexer fills it in. True if entries were written. Without `maintain`
    the caller runs maintain() itself (a data write: once its commit completed)."""
    if metadata.get("action") not in INDEXED_ACTIONS:
        return False
    try:
        kinds = active_kinds(storage)
        if not kinds:
            return False
        write_rows(storage, entries(storage, metadata, kinds), maintain=maintain)
        return True
    except Exception as exc:  # noqa: BLE001 - the data commit must not fail because of its index
        log.warning("instant %s: writing its metadata table entries failed (%s); readers read its "
                    "commit file until the indexer adds them", metadata.get("instant"), exc)
        return False


def maintain(storage: Storage) -> None:
    """upkeep() of the metadata table of `storage`, for a writer whose data commit completed:
    it never raises (the commit is done; the next writer or service retries)."""
    try:
        mdt = open_metadata_table(storage)
        if mdt is not None:
            upkeep(mdt)
    except Exception as exc:  # noqa: BLE001
        log.warning("upkeep of the metadata table of %s failed (retried later): %s", storage.uri, exc)


def upkeep(mdt: Any, force: bool = False) -> None:
    """Keep the metadata table cheap to read: compact it, clean it and archive its timeline once
    enough has piled up (every time with `force`). Failures are logged: the next run retries."""
    from .compaction import delta_commits_since_compaction
    from .timeline import Timeline

    try:
        timeline = Timeline.load(mdt.storage)
        pending = timeline.pending_compactions()
        # A pending compaction: another writer is compacting it (or crashed doing so: a service
        # finishes it), so only compacting waits; cleaning and archival go on (format.md §18.7).
        if force or not pending:
            for tc in pending:
                mdt.run_compaction(tc, parallelism=1)  # small, and inside a writer's commit
            if delta_commits_since_compaction(timeline) >= (1 if force else COMPACT_EVERY):
                mdt.compact(parallelism=1)
        if force or sum(1 for i in timeline.instants if not i.archived) > ARCHIVE_ABOVE:
            mdt.clean(retain_commits=RETAIN_COMMITS)  # archival goes up to the window it retains
            mdt.archive(retain_commits=RETAIN_COMMITS)
    except Exception as exc:  # noqa: BLE001 - upkeep is best effort
        log.warning("upkeep of the metadata table %s failed (retried later): %s", mdt.uri, exc)
