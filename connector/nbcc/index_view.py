"""Reading the metadata table for a plan (metadata_table.py): the files each instant added, their
statistics and their key filters.

What a reader takes from it, and why the result is the same as from the timeline:
- `files`: only for completed instants of its own timeline listing that have a marker (all their
  files were written with the marker, in one commit); any other completed instant is read from
  its commit file as before. Entries of instants that never completed, or completed after the
  time read, are never looked at. A clean removes the entries of the files it deleted, which no
  readable state needs (format.md §18.5).
- `column_stats` and `key_filters`: an entry describes the file's own content, so it is right
  whenever that file is read; a file without one is "unknown" (kept).
The merged rows of each kind are cached per process and per table by the metadata table's file
list (files never change), so planning again costs two timeline listings, however many tables
the process reads.
"""

from __future__ import annotations

import json
import logging
import threading
from collections import OrderedDict, defaultdict
from typing import Any, Iterable

import pyarrow as pa
import pyarrow.compute as pc

from .errors import DataFileError
from .schema import COMMIT_TIME_COL, IS_DELETED_COL
from .metadata_table import COLUMN_STATS, FILES, KEY_FILTERS, READY, file_key, open_metadata_table, read_states
from .storage import Storage
from .timeline import COMPACTION_COMMIT, Instant, Timeline, read_commit_metadata

log = logging.getLogger(__name__)

_CACHE_LOCK = threading.Lock()
_CACHE_TABLES = 32  # metadata tables cached at once (least recently read dropped): a bound on memory


class _TableCache:
    """What one metadata table's reads keep: per kind and column subset, the merged rows of the
    latest file list read and the files of that list. Only the latest is kept: older lists are
    superseded (a reader still planning one just reads again), so the cache of a table never
    outgrows its snapshot, and no other table's reads evict it."""

    def __init__(self) -> None:
        self.kinds: dict[tuple, tuple[tuple, _Kind]] = {}  # (kind, columns) -> (file list, rows)
        self.files: dict[tuple, dict[str, pa.Table]] = {}  # (partition, columns) -> name -> rows


_TABLES: "OrderedDict[str, _TableCache]" = OrderedDict()


def _table_cache(uri: str) -> _TableCache:
    with _CACHE_LOCK:
        cache = _TABLES.get(uri)
        if cache is None:
            cache = _TABLES[uri] = _TableCache()
            while len(_TABLES) > _CACHE_TABLES:
                _TABLES.popitem(last=False)
        _TABLES.move_to_end(uri)
        return cache


class _Kind:
    """The merged rows of one kind, with lookups by file and the instants it has markers of."""

    def __init__(self, rows: pa.Table):
        self.all_rows = rows
        is_marker = pc.is_null(rows.column("name"))
        markers = rows.filter(is_marker)
        self.markers = dict(zip(markers.column("instant").to_pylist(), range(markers.num_rows)))
        self.marker_rows = markers
        self.rows = rows.filter(pc.invert(is_marker))
        self.index = dict(zip(self.rows.column("key").to_pylist(), range(self.rows.num_rows)))
        self._by_instant: dict[str, list[dict[str, Any]]] | None = None
        self._schemas: dict[str, Any] = {}

    def by_instant(self) -> dict[str, list[dict[str, Any]]]:
        """instant -> descriptors of its files (as in commit metadata), built once."""
        if self._by_instant is None:
            cols = ["instant", "partition", "file_group", "name", "rows", "bytes", "live"]
            out: dict[str, list[dict[str, Any]]] = defaultdict(list)
            for d in self.rows.select(cols).to_pylist():
                out[d["instant"]].append(d)
            self._by_instant = dict(out)
        return self._by_instant

    def schema_of(self, instant: str) -> Any:
        text = self.marker_rows.column("schema")[self.markers[instant]].as_py()
        if text not in self._schemas:  # few distinct schemas: parse each once
            self._schemas[text] = json.loads(text) if text else []
        return self._schemas[text]

    def row(self, partition: str, name: str) -> int | None:
        return self.index.get(file_key(partition, name))


def read_rows(mdt: Any, kind: str, columns: Iterable[str] | None = None) -> pa.Table:
    """The merged rows of one kind of the metadata table (only `columns` and the key columns, if
    given), markers included."""
    if columns is not None:
        columns = ["kind", "key", "instant", "name"] + [c for c in columns if c not in ("kind", "key", "instant", "name")]
    return _read_kinds(mdt, [kind], columns)[kind].all_rows


def indexed_instants(mdt: Any, kinds: Iterable[str]) -> dict[str, set[str]]:
    """kind -> the instants it has a marker of (the indexer's progress)."""
    read = _read_kinds(mdt, kinds, ("kind", "key", "instant", "name"))
    return {k: set(v.markers) for k, v in read.items()}


def _recent(mdt: Any, kinds: Iterable[str]) -> Timeline:
    """The part of the metadata table's timeline that its latest snapshot of `kinds` depends on.

    Its newest file slices start at the latest completed compaction of each kind's file group
    (Tc): every older file is in an older slice, superseded. So only that compaction and the
    instants that completed after the earliest such Tc, and the pending ones, are needed; the
    metadata of the rest (every delta commit ever made) is never read. A kind never compacted
    needs everything."""
    timeline = Timeline.load(mdt.storage)
    groups = {f"kind={k}" for k in kinds}
    barrier: dict[str, str] = {}
    for inst in sorted((i for i in timeline.completed() if i.action == COMPACTION_COMMIT),
                       key=lambda i: i.instant, reverse=True):
        if barrier.keys() >= groups:
            break
        for f in read_commit_metadata(mdt.storage, inst)["files"]:
            barrier.setdefault(f["partition"], inst.instant)
    if not barrier.keys() >= groups:
        return timeline
    low = min(barrier[g] for g in groups)
    return Timeline(i for i in timeline.instants if not i.is_completed or i.completion > low)


def _read_kinds(mdt: Any, kinds: Iterable[str], columns: Iterable[str] | None = None) -> dict[str, _Kind]:
    """The merged rows of each kind. Each file of the metadata table is read once per process
    (files never change), so a new delta commit costs one small file, not the whole kind."""
    from .merge import merge_records
    from .reader import read_columns
    from .scan import ReadOptions, plan_scan

    storage, config = mdt.storage, mdt.config
    plan = plan_scan(storage, config, ReadOptions(use_metadata_table=False), _recent(mdt, kinds))
    schema = plan.schema if columns is None else pa.schema([plan.schema.field(c) for c in columns])
    names = tuple(schema.names) + (COMMIT_TIME_COL, IS_DELETED_COL)
    cache = _table_cache(mdt.uri)
    out = {}
    for kind in kinds:
        partition = f"kind={kind}"
        tasks = [t for t in plan.tasks if t.partition == partition]
        slot, file_list = (kind, names), tuple((t.file_group_id, t.files) for t in tasks)
        with _CACHE_LOCK:
            hit = cache.kinds.get(slot)
            known = dict(cache.files.get((partition, names), {}))
        if hit is not None and hit[0] == file_list:
            out[kind] = hit[1]
            continue
        parts = []
        for t in tasks:
            for n in t.files:
                if n not in known:  # only files new since the list read last
                    known[n] = read_columns(storage, t.partition, [n], names, sizes=t.file_sizes).select(names)
            rows = pa.concat_tables([known[n] for n in t.files]) if t.files else None
            if rows is not None and not t.merged_already:  # files in log order: merge by key
                rows = merge_records(rows, config.record_key, None, config.merge_mode)
            if rows is not None:
                parts.append(rows.select(schema.names))
        out[kind] = _Kind(pa.concat_tables(parts) if parts else schema.empty_table())
        listed = {n for t in tasks for n in t.files}
        with _CACHE_LOCK:
            cache.kinds[slot] = (file_list, out[kind])
            cache.files[(partition, names)] = {n: v for n, v in known.items() if n in listed}
    return out


class MetadataIndex:
    """The ready partitions of a table's metadata table, as read for one plan."""

    def __init__(self, kinds: dict[str, _Kind]):
        self.kinds = kinds

    def has(self, kind: str) -> bool:
        return kind in self.kinds

    @property
    def used(self) -> tuple[str, ...]:
        return tuple(sorted(self.kinds))

    # -- files -----------------------------------------------------------------------------------

    def file_metas(self, instants: Iterable[Instant], files: bool = True) -> dict[str, dict[str, Any]]:
        """Commit metadata (schema and files) of the given instants that the index covers; with
        `files=False` without `files` (the markers alone: no file rows turned into Python)."""
        kind = self.kinds[FILES]
        metas = {i.instant: {"instant": i.instant, "action": i.action, "schema": kind.schema_of(i.instant)}
                 for i in instants if i.instant in kind.markers}
        if files:
            by_instant = kind.by_instant()
            for instant, meta in metas.items():
                meta["files"] = by_instant.get(instant, [])
        return metas

    # -- column statistics -------------------------------------------------------------------------

    def covers_stats(self, instant: str) -> bool:
        return COLUMN_STATS in self.kinds and instant in self.kinds[COLUMN_STATS].markers

    def file_stats(self, partition: str, name: str, types: dict[str, pa.DataType]) -> dict[str, Any] | None:
        """{column: {"min", "max", "nulls"}} of one file as commit metadata records it; None if
        the index has no statistics of it."""
        kind = self.kinds.get(COLUMN_STATS)
        i = kind.row(partition, name) if kind is not None else None
        if i is None:
            return None
        r = {c: kind.rows.column(c)[i].as_py() for c in ("columns", "mins", "maxs", "nulls", "ranges")}
        out = {}
        for col, lo, hi, nulls, ranged in zip(r["columns"], r["mins"], r["maxs"], r["nulls"], r["ranges"]):
            st: dict[str, Any] = {} if nulls is None else {"nulls": nulls}  # null: not recorded
            if ranged:
                st["min"], st["max"] = _value(lo, types.get(col)), _value(hi, types.get(col))
            out[col] = st
        return out

    # -- key filters -----------------------------------------------------------------------------

    def key_filter(self, partition: str, name: str) -> tuple[bytes, int] | None:
        kind = self.kinds.get(KEY_FILTERS)
        i = kind.row(partition, name) if kind is not None else None
        if i is None:
            return None
        return kind.rows.column("bloom")[i].as_py(), kind.rows.column("probes")[i].as_py()


def _value(text: str | None, t: pa.DataType | None) -> Any:
    """A statistic back in the form of commit metadata (dates and decimals stay text)."""
    if text is None or t is None:
        return text
    if pa.types.is_integer(t) or pa.types.is_timestamp(t):
        return int(text)
    if pa.types.is_boolean(t):
        return text == "true"
    return text


def load_index(storage: Storage, use: bool | None, kinds: Iterable[str] = (FILES,)) -> MetadataIndex | None:
    """The ready partitions among `kinds`, read; None if there are none (or `use` is False), in
    which case the reader goes by the timeline alone. A metadata table that cannot be read (its
    cleaner deleted a file this read planned to open) is read again once, then left out; one
    that fails otherwise (a corrupt file, a storage error) is left out at once: it is only an
    optimisation, and the timeline answers every read without it."""
    if use is False:
        return None
    ready = {k for k, v in read_states(storage).items() if v == READY}
    wanted = [k for k in kinds if k in ready]
    if not wanted:
        return None
    for attempt in (1, 2):
        try:
            mdt = open_metadata_table(storage)
            return None if mdt is None else MetadataIndex(_read_kinds(mdt, wanted))
        except (DataFileError, FileNotFoundError) as exc:
            if attempt == 2:
                _fall_back(storage, exc)
        except Exception as exc:  # noqa: BLE001 - reading again would fail the same way
            _fall_back(storage, exc)
            break
    return None


def _fall_back(storage: Storage, exc: BaseException) -> None:
    log.warning("the metadata table of %s could not be read (%s: %s); planning from the timeline",
                storage.uri, type(exc).__name__, exc)
