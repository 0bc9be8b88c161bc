"""Planning and running reads: snapshot, time travel, read-optimized, incremental and CDC.

A read is planned from one listing of the timeline into `ScanTask`s, one per file group (a Spark
input partition each), and each task is read independently.

- Snapshot and time travel (`as_of=T`) read the latest file slice of each file group in the
  table as of T (view.py).
- Incremental (`begin`, `end`]: the data commits that completed in the range say which record
  keys changed; the result is their merged state as of `end` (`latest_state`) or their state as
  of `begin` and as of `end` side by side (`cdc`). Only file groups the range touched are read.
  Because log order is by instant, a record written before `begin` can still win over one
  written in the range, so the merge reads the touched file groups' slices, not just the
  range's files.
- Pruning: partition values, the buckets of record keys pinned by `=`/`in`, and per-file
  min/max/null statistics recorded at write time. Filters are also applied exactly after merging.
- The metadata table (index_view.py), where ready: the files and schema of the instants it
  covers instead of their commit files, statistics, and key filters that leave out the files of
  a point lookup that cannot hold the key (format.md §18.5).
"""

from __future__ import annotations

import atexit
import dataclasses
import itertools
import os
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Mapping

import pyarrow as pa
import pyarrow.compute as pc

from . import bloom
from .buckets import bucket_ids, file_group_id
from .clock import BEFORE_ALL, parse_time_option
from .config import COMMIT_TIME, PARTIAL_UPDATE, TableConfig, _bool_option
from .errors import InvalidOptionError
from .expr import Predicate, conjunction, parse_filter
from .file_slices import FileSlice
from .filenames import parse_data_file
from .index_view import MetadataIndex, load_index
from .metadata_table import COLUMN_STATS, FILES, KEY_FILTERS
from .partitions import NULL_PARTITION, parse_partition_path
from .reader import iter_files, read_columns, read_files
from .schema import (
    COMMIT_TIME_COL,
    RECORD_KEY_COL,
    constant_strings,
    file_schema,
    null_array,
    widest_of_kind,
)
from .storage import Storage
from .timeline import DATA_ACTIONS, OVERWRITES, Timeline, earliest_retained, read_commit_metadata
from .view import (
    TableView,
    known_sizes,
    check_readable,
    earliest_begin,
    overwrite_cutoffs,
    schema_as_of,
    slices_by_group,
    state_lost_at,
    table_view,
)

SNAPSHOT, INCREMENTAL, READ_OPTIMIZED = "snapshot", "incremental", "read_optimized"
QUERY_TYPES = (SNAPSHOT, INCREMENTAL, READ_OPTIMIZED)
LATEST_STATE, CDC = "latest_state", "cdc"
INCREMENTAL_FORMATS = (LATEST_STATE, CDC)
EARLIEST = "earliest"

COMPLETION_TIME_COL = "_nbcc_completion_time"
PARTITION_COL = "_nbcc_partition"
FILE_GROUP_COL = "_nbcc_file_group"
CHANGE_TYPE_COL = "_change_type"
META_OUTPUT_FIELDS = [
    pa.field(COMMIT_TIME_COL, pa.string(), nullable=False),
    pa.field(COMPLETION_TIME_COL, pa.string(), nullable=False),
    pa.field(RECORD_KEY_COL, pa.string(), nullable=False),
    pa.field(PARTITION_COL, pa.string(), nullable=False),
    pa.field(FILE_GROUP_COL, pa.string(), nullable=False),
]


# -- options -----------------------------------------------------------------------------------

@dataclass(frozen=True)
class ReadOptions:
    query_type: str = SNAPSHOT
    as_of: str | None = None
    begin: str | None = None  # exclusive; None = earliest
    end: str | None = None  # inclusive; None = latest completion
    incremental_format: str = LATEST_STATE
    include_meta_columns: bool = False
    predicates: tuple[Predicate, ...] = ()
    arrow_filter: pc.Expression | None = None
    use_metadata_table: bool | None = None  # None: use its ready partitions; False: the timeline only
    columns: tuple[str, ...] | None = None  # the output's columns, in this order (None: all)

    @classmethod
    def build(cls, *, query_type: str | None = None, as_of: Any = None, begin: Any = None, end: Any = None,
              incremental_format: str | None = None, include_meta_columns: Any = False,
              use_metadata_table: Any = None) -> "ReadOptions":
        """The options of a read; a filter is added with `with_filter` once the schema it is
        parsed against is known."""
        qt = (query_type or SNAPSHOT).strip().lower()
        if qt not in QUERY_TYPES:
            raise InvalidOptionError(f"query_type must be one of {', '.join(QUERY_TYPES)}; got {query_type!r}")
        fmt = (incremental_format or LATEST_STATE).strip().lower()
        if fmt not in INCREMENTAL_FORMATS:
            raise InvalidOptionError(
                f"incremental_format must be one of {', '.join(INCREMENTAL_FORMATS)}; got {incremental_format!r}")
        if qt != INCREMENTAL:
            given = [n for n, v in (("begin", begin), ("end", end), ("incremental_format", incremental_format))
                     if v is not None]
            if given:
                raise InvalidOptionError(f"{', '.join(given)}: only for query_type=incremental")
        elif as_of is not None:
            raise InvalidOptionError("as_of does not apply to query_type=incremental: use begin and end")
        meta = _bool_option("include_meta_columns")(include_meta_columns)
        if qt == INCREMENTAL and fmt == CDC and meta:
            raise InvalidOptionError("include_meta_columns does not apply to cdc output (it has its own columns)")
        begin_t = None
        if begin is not None and str(begin).strip().lower() != EARLIEST:
            begin_t = parse_time_option(begin, "begin")
        end_t = parse_time_option(end, "end") if end is not None else None
        if begin_t and end_t and begin_t > end_t:
            raise InvalidOptionError(f"begin={begin} is after end={end}: the range (begin, end] is empty")
        use_mdt = _bool_option("use_metadata_table")(use_metadata_table) if use_metadata_table is not None else None
        return cls(qt, parse_time_option(as_of, "as_of") if as_of is not None else None, begin_t, end_t, fmt,
                   meta, (), None, use_mdt)

    def with_filter(self, filter: Any, schema: pa.Schema) -> "ReadOptions":
        """These options with `filter` (see `nbcc.expr.parse_filter`), parsed against `schema`:
        the table's schema at the time read (`schema_read`)."""
        preds, arrow_filter = parse_filter(filter, schema)
        if (preds or arrow_filter is not None) and self.is_cdc:
            raise InvalidOptionError("filter applies to snapshot, read_optimized and latest_state reads, not cdc")
        return dataclasses.replace(self, predicates=preds, arrow_filter=arrow_filter)

    def with_columns(self, columns: Any, schema: pa.Schema) -> "ReadOptions":
        """These options with the output narrowed to `columns` (names of `schema`, the table's
        schema at the time read, or meta columns if asked for), in that order; only those
        columns, the record key's and those the merge and the filter need are read from files."""
        if isinstance(columns, str) or not isinstance(columns, (list, tuple)) or not columns \
                or not all(isinstance(c, str) for c in columns):
            raise InvalidOptionError(f"columns must be a non-empty list of column names, e.g. ['id', 'amount']; "
                                     f"got {columns!r}")
        if self.is_cdc:
            raise InvalidOptionError("columns does not apply to cdc output (each row has the whole record in "
                                     "before and after); select from the result instead")
        repeated = sorted({c for c in columns if list(columns).count(c) > 1})
        if repeated:
            raise InvalidOptionError(f"columns lists {repeated} more than once")
        meta = [f.name for f in META_OUTPUT_FIELDS]
        unknown = [c for c in columns if c not in schema.names and c not in meta]
        if unknown:
            raise InvalidOptionError(f"columns {unknown} are not in the table (as of the time read); its columns "
                                     f"are {schema.names}")
        hidden = [c for c in columns if c in meta and c not in schema.names and not self.include_meta_columns]
        if hidden:
            raise InvalidOptionError(f"columns {hidden} are meta columns: read them with include_meta_columns=True")
        return dataclasses.replace(self, columns=tuple(columns))

    @property
    def is_cdc(self) -> bool:
        return self.query_type == INCREMENTAL and self.incremental_format == CDC


# -- plans -------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ScanTask:
    """One file group's share of a read (a Spark input partition)."""

    partition: str
    file_group_id: str
    files: tuple[str, ...]  # what to merge for the result, in log order
    begin_files: tuple[str, ...] = ()  # cdc: what to merge for the state as of begin
    range_files: tuple[str, ...] = ()  # incremental: log files of the commits in the range
    # Completion of the latest overwrite in the range that replaced this partition: every key
    # of the earlier state changed. None: no overwrite in the range replaced it.
    reset_completion: str | None = None
    merged_already: bool = False  # `files` is one base file with one live row per key
    range_only: bool = False  # incremental: `files` are the range's files, which outrank all older ones
    bytes: int = 0  # size of the files to read (to pack tasks into engine partitions)
    # (name, bytes) of the files above whose commits recorded their size: opening a file of
    # known size on an object store takes no request for it (Storage.open_parquet).
    sizes: tuple[tuple[str, int], ...] = ()

    @property
    def file_sizes(self) -> dict[str, int]:
        return dict(self.sizes)


def _task(partition: str, fg: str, files: tuple[str, ...], sizes: dict[str, int],
          begin_files: tuple[str, ...] = (), **fields: Any) -> ScanTask:
    """A ScanTask whose `bytes` (of `files` and `begin_files`) and `sizes` come from `sizes`
    (view.known_sizes of every file it may open)."""
    return ScanTask(partition, fg, files, begin_files, bytes=sum(sizes.get(n, 0) for n in files + begin_files),
                    sizes=tuple(sizes.items()), **fields)


@dataclass
class ScanPlan:
    options: ReadOptions
    config: TableConfig
    schema: pa.Schema  # the table's schema as of the read
    output_schema: pa.Schema
    tasks: list[ScanTask] = field(default_factory=list)
    completion: dict[str, str] = field(default_factory=dict)  # instant -> completion, for meta columns
    change_completion: dict[str, str] = field(default_factory=dict)  # cdc: instants in the range
    end: str | None = None  # incremental: the end of the range actually read
    metadata_used: tuple[str, ...] = ()  # the metadata table partitions the plan used


def files_to_merge(slices: list[FileSlice], read_optimized: bool, pending: Iterable[str] = ()
                ) -> tuple[str, ...] | None:
    """What a reader merges for a file group: its latest slice, plus the slice before it while
    the latest one waits for a pending compaction (it has no base file yet). The merge orders
    records by their instant, so the order of the files does not change the result."""
    if read_optimized:
        based = [s for s in slices if s.base_file]
        return (based[0].base_file,) if based else None
    latest = slices[0]
    if latest.base_file is None and len(slices) > 1 and latest.base_instant in set(pending):
        return tuple(slices[1].file_names() + latest.file_names())
    return tuple(latest.file_names())


def _partition_values(config: TableConfig, schema: pa.Schema, partition: str) -> pa.Table:
    """The values the rows of `partition` may have, one row per combination: the null folder
    holds nulls and, in a string column, the string `__HIVE_DEFAULT_PARTITION__` too (§12.9)."""
    texts = parse_partition_path(partition)
    options = []
    for name in config.partition_by:
        t = schema.field(name).type
        text = texts.get(name)
        stringy = pa.types.is_string(t) or pa.types.is_large_string(t)
        options.append([None, NULL_PARTITION] if text is None and stringy else [text])
    rows = list(itertools.product(*options))
    cols = {}
    for i, name in enumerate(config.partition_by):
        try:
            cols[name] = pa.array([r[i] for r in rows], pa.string()).cast(schema.field(name).type)
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
            return pa.table({})  # cannot type it: do not prune on it
    return pa.table(cols)


class FileStats:
    """Per-file statistics for skipping: the descriptors of commit metadata; for files that the
    metadata table's `files` partition described (no `stats`), its `column_stats`, or else the
    commit file of the file's instant (read only for the files of groups still in question)."""

    def __init__(self, storage: Storage, view: TableView, index: MetadataIndex | None):
        self.storage, self.view, self.index = storage, view, index
        self.info = view.file_info()
        self.commit_columns = {i: {f["name"] for f in m.get("schema", [])} for i, m in view.metas.items()}
        self.types = {f.name: f.type for f in view.schema}
        self._full: dict[tuple[str, str], Mapping[str, Any] | None] = {}
        self._instants = {i.instant: i for i in view.completed}

    def rows(self, partition: str, name: str) -> int:
        return int(self.info.get((partition, name), {}).get("rows", 1))

    def of(self, partition: str, name: str, column: str) -> Mapping[str, Any] | None:
        f = self.info.get((partition, name))
        if f is not None and "stats" not in f and self.index is not None:
            key = (partition, name)
            if key not in self._full:
                self._full[key] = self._with_stats(partition, name, f)
            f = self._full[key]
        return _file_stats(f, name, column, self.commit_columns)

    def _with_stats(self, partition: str, name: str, f: Mapping[str, Any]) -> Mapping[str, Any] | None:
        instant = f.get("instant") or parse_data_file(name).instant
        stats = self.index.file_stats(partition, name, self.types)
        if stats is not None:
            return {**f, "stats": stats}
        if self.index.covers_stats(instant):
            return f  # indexed without statistics: none were recorded
        inst = self._instants.get(instant)
        if inst is None:
            return f
        meta = read_commit_metadata(self.storage, inst)
        return next((d for d in meta["files"] if d["partition"] == partition and d["name"] == name), f)


def _keep(config: TableConfig, schema: pa.Schema, preds: tuple[Predicate, ...], partition: str, fg: str,
          files: Iterable[str], stats: FileStats, allowed_groups: set[str] | None) -> bool:
    if allowed_groups is not None and fg not in allowed_groups:
        return False
    part_preds = [p for p in preds if p.column in config.partition_by]
    if part_preds:
        values = _partition_values(config, schema, partition)
        if values.num_columns == len(config.partition_by):
            if values.filter(conjunction(part_preds)).num_rows == 0:
                return False
    files = list(files)
    for p in preds:
        if p.column in config.partition_by:
            continue
        if not any(p.may_match(stats.of(partition, n, p.column), stats.rows(partition, n)) for n in files):
            return False
    return True


def _file_stats(f: Mapping[str, Any] | None, name: str, column: str, commit_columns: Mapping[str, set[str]]):
    if f is None or "stats" not in f:
        return None  # unknown: keep
    if column in f["stats"]:
        return f["stats"][column]
    cols = commit_columns.get(parse_data_file(name).instant)
    if cols is not None and column not in cols:
        return {"min": None, "max": None, "nulls": int(f["rows"])}  # column added after this file
    return None


def _pinned_keys(config: TableConfig, preds: tuple[Predicate, ...]) -> tuple | None:
    """The only record-key values a row may have (single-column keys, `=` / `in`), or None.
    Each is a value the key column's type holds."""
    if len(config.record_key) != 1:
        return None
    key_type = _key_type(config)
    pinned = None
    for p in preds:
        values = p.pinned_values() if p.column == config.record_key[0] else None
        if values is not None:
            held = set(_as_key_type(values, p.type, key_type).to_pylist())
            pinned = held if pinned is None else pinned & held
    return None if pinned is None else tuple(pinned)


def _key_type(config: TableConfig) -> pa.DataType:
    """A type that holds every value of the (single) record key column, whatever a commit
    widened it to since table.json (format.md §4.2): an integer key as the widest of its kind.
    A key's text, and so its bucket and key filter entry, is the same at every width."""
    return widest_of_kind(config.schema.field(config.record_key[0]).type)


def _as_key_type(values: tuple, value_type: pa.DataType | None, key_type: pa.DataType) -> pa.Array:
    """`values` as the key column's type, leaving out those it cannot hold, which no row has.
    A Spark filter's values have Spark's type for the column: -1 on a uint32 key (Spark's
    bigint) is one, and converting it would fail, or with an unsafe cast pick a wrong bucket."""
    given = pa.array(list(values), value_type)
    try:
        return given.cast(key_type)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
        held = []
        for i in range(len(given)):  # only when some value does not fit: find which
            try:
                held.append(given.slice(i, 1).cast(key_type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, OverflowError):
                pass
        return pa.concat_arrays(held) if held else pa.array([], key_type)


def _by_key_filters(config: TableConfig, index: MetadataIndex, keys: tuple, task: ScanTask,
                    stats: FileStats) -> ScanTask | None:
    """The task with only the files whose key filter may hold one of `keys` (None if no file
    may). Safe: a file without the key holds only rows of other keys, which the key predicate
    removes after the merge anyway; every row of the key is still merged."""
    texts = pc.cast(pa.array(list(keys), _key_type(config)), pa.string())
    h1, h2 = bloom.key_hashes(texts)
    kept = []
    for name in task.files:
        found = index.key_filter(task.partition, name)
        if found is None or bloom.may_contain(found[0], h1, h2, found[1]).any():
            kept.append(name)
    if len(kept) == len(task.files):
        return task
    if not kept:
        return None
    single_live = len(kept) == 1 and bool(stats.info.get((task.partition, kept[0]), {}).get("live"))
    return _task(task.partition, task.file_group_id, tuple(kept), task.file_sizes, merged_already=single_live)


def _key_buckets(config: TableConfig, keys: tuple | None) -> set[str] | None:
    """The file groups (buckets) of the record keys `_pinned_keys` found, or None."""
    if keys is None:
        return None
    key_type = _key_type(config)
    return {file_group_id(int(b)) for b in bucket_ids(pa.array(list(keys), key_type), config.buckets)} if keys else set()


def output_schema(config: TableConfig, schema: pa.Schema, options: ReadOptions) -> pa.Schema:
    if options.is_cdc:
        keys = [schema.field(k) for k in config.record_key]
        data = pa.struct([f.with_nullable(True) for f in schema])
        return pa.schema(keys + [pa.field(CHANGE_TYPE_COL, pa.string(), nullable=False),
                                 pa.field(COMPLETION_TIME_COL, pa.string(), nullable=False),
                                 pa.field("before", data, nullable=True),
                                 pa.field("after", data, nullable=True)])
    out = pa.schema(list(schema) + (META_OUTPUT_FIELDS if options.include_meta_columns else []))
    return out if options.columns is None else pa.schema([out.field(c) for c in options.columns])


def _columns_to_read(plan: ScanPlan) -> pa.Schema:
    """The table columns a task reads from files: all of them, or, for a read narrowed to some
    columns, those plus the record key's, the ordering field and the filter's columns (an
    opaque pyarrow filter may name any column: then all)."""
    options, config = plan.options, plan.config
    if options.columns is None or options.arrow_filter is not None:
        return plan.schema
    needed = {*options.columns, *config.record_key, *(p.column for p in options.predicates)}
    if config.ordering_field:
        needed.add(config.ordering_field)
    return pa.schema([f for f in plan.schema if f.name in needed])


def schema_read(storage: Storage, config: TableConfig, options: ReadOptions, timeline: Timeline,
                index: MetadataIndex | None) -> pa.Schema:
    """The table's schema at the time a read reads: `as_of`, an incremental read's end, or now."""
    when = options.as_of if options.query_type != INCREMENTAL else (options.end or timeline.latest_completion())
    return schema_as_of(storage, config, timeline, when, index)


def read_schema(storage: Storage, config: TableConfig, options: ReadOptions) -> pa.Schema:
    """The output schema of a read, without planning it."""
    index = load_index(storage, options.use_metadata_table)  # before the listing (format.md §18.5)
    return output_schema(config, schema_read(storage, config, options, Timeline.load(storage), index), options)


def _index_for(storage: Storage, config: TableConfig, options: ReadOptions,
               pinned: tuple | None) -> MetadataIndex | None:
    """The metadata table partitions this read can use (statistics only for predicates on data
    columns, key filters only for point lookups: `pinned`, the keys they pin)."""
    kinds = [FILES]
    if any(p.column not in config.partition_by for p in options.predicates):
        kinds.append(COLUMN_STATS)
    if options.query_type != INCREMENTAL and pinned is not None:
        kinds.append(KEY_FILTERS)
    return load_index(storage, options.use_metadata_table, kinds)


def plan_scan(storage: Storage, config: TableConfig, options: ReadOptions, timeline: Timeline | None = None
              ) -> ScanPlan:
    """Plan a read. A `timeline` given is used as the listing; it must be listed after the
    metadata table is read, so pass one only with `use_metadata_table=False` (format.md §18.5)."""
    # The metadata table is read before the timeline is listed: a clean that made it forget files
    # then shows on the listing with its retained window, so no time the read accepts needs them.
    pinned = _pinned_keys(config, options.predicates)
    index = _index_for(storage, config, options, pinned)
    timeline = timeline or Timeline.load(storage)
    if options.query_type == INCREMENTAL:
        return _plan_incremental(storage, config, options, timeline, index, pinned)
    if options.as_of is not None and check_readable(storage, timeline, options.as_of, "as_of"):
        index = None  # a savepoint's read before the window: from the commit files (check_readable)
    view = table_view(storage, config, timeline, options.as_of, index)
    plan = ScanPlan(options, config, view.schema, output_schema(config, view.schema, options),
                    completion={i.instant: i.completion for i in view.completed},
                    metadata_used=index.used if index is not None else ())
    stats = FileStats(storage, view, index)
    allowed = _key_buckets(config, pinned)
    keys = pinned if index is not None and index.has(KEY_FILTERS) else None
    for (partition, fg), slices in slices_by_group(storage, view).items():
        files = files_to_merge(slices, options.query_type == READ_OPTIMIZED, view.pending_compactions)
        if files and _keep(config, view.schema, options.predicates, partition, fg, files, stats, allowed):
            single_live = len(files) == 1 and bool(stats.info.get((partition, files[0]), {}).get("live"))
            task = _task(partition, fg, files, known_sizes(stats.info, partition, files), merged_already=single_live)
            if keys is not None:
                task = _by_key_filters(config, index, keys, task, stats)
            if task is not None:
                plan.tasks.append(task)
    return plan


def _plan_incremental(storage: Storage, config: TableConfig, options: ReadOptions, timeline: Timeline,
                      index: MetadataIndex | None, pinned: tuple | None) -> ScanPlan:
    latest = timeline.latest_completion()
    if latest is None:
        raise InvalidOptionError("incremental read: the table has no completed commits yet")
    begin = options.begin or BEFORE_ALL
    # An end past the latest completion is read as the latest completion: every commit that
    # completes later gets a later completion time, so the range read is final and a consumer
    # that resumes from `plan.end` never misses one. A range given in full that begins after
    # the latest completion (a quiet window) is read as (begin, begin]: empty.
    end = min(options.end, max(latest, begin)) if options.end else latest
    if begin > end:
        raise InvalidOptionError(f"begin={begin} is after end={end}: the range (begin, end] is empty")
    end_view = table_view(storage, config, timeline, end, index)
    in_range = [i for i in end_view.completed if i.completion > begin and i.action in DATA_ACTIONS]
    reset = any(i.action in OVERWRITES for i in in_range)
    # Per partition, the completion of the latest overwrite in the range that replaced it.
    resets = overwrite_cutoffs(in_range, end_view.replaced)
    retained = earliest_retained(storage, timeline)
    if retained is not None:
        first = earliest_begin(timeline, retained, options.is_cdc or reset)
        lost = state_lost_at(timeline, retained, begin) if begin < first else None
        if lost:  # no data commit of the range is missing
            raise InvalidOptionError(
                f"begin={options.begin or EARLIEST}: this read needs the table's state at begin "
                f"({'a cdc read' if options.is_cdc else 'the range holds an overwrite'}), and "
                f"{lost} (the window the cleaner retained starts at {retained}). Use begin >= {first}."
            )
        if begin < first:
            raise InvalidOptionError(
                f"begin={options.begin or EARLIEST} reaches before the oldest retained commit (completed at "
                f"{retained}): the changes before it were cleaned, so this range cannot be answered in "
                f"full. Use begin >= {first}."
            )
    # The state at begin is needed only for cdc and after an overwrite in the range.
    begin_view = (table_view(storage, config, timeline, begin, index)
                  if begin != BEFORE_ALL and (options.is_cdc or reset) else None)
    plan = ScanPlan(options, config, end_view.schema, output_schema(config, end_view.schema, options),
                    completion={i.instant: i.completion for i in end_view.completed},
                    change_completion={i.instant: i.completion for i in in_range}, end=end,
                    metadata_used=index.used if index is not None else ())
    range_files: dict[tuple[str, str], list[str]] = defaultdict(list)
    for inst in in_range:
        for f in end_view.metas[inst.instant]["files"]:
            range_files[(f["partition"], f["file_group"])].append(f["name"])
    end_groups = slices_by_group(storage, end_view)
    begin_groups = slices_by_group(storage, begin_view) if begin_view else {}
    touched = set(range_files) | {g for g in begin_groups if resets.of(g[0])}
    stats = FileStats(storage, end_view, index)
    info = stats.info
    allowed = _key_buckets(config, pinned)
    for partition, fg in sorted(touched):
        end_files = (files_to_merge(end_groups[(partition, fg)], False, end_view.pending_compactions)
                     if (partition, fg) in end_groups else ())
        begin_files = ()
        if (options.is_cdc or resets.of(partition)) and (partition, fg) in begin_groups:
            begin_files = files_to_merge(begin_groups[(partition, fg)], False, begin_view.pending_compactions)
        if not options.is_cdc and not _keep(config, end_view.schema, options.predicates, partition, fg,
                                            end_files or (), stats, allowed):
            continue
        group_range = tuple(range_files.get((partition, fg), ()))
        # For cdc too: the merge of the range's files alone is then the state at end of every
        # key they touch, and only the state at begin needs the older files.
        range_only = not resets.of(partition) and _range_outranks_older(
            config, end_view.schema, partition, end_files or (), group_range, stats)
        files = group_range if range_only else tuple(end_files or ())
        begin_files = tuple(begin_files or ())
        sizes = known_sizes(info, partition, files + begin_files + group_range)
        plan.tasks.append(_task(partition, fg, files, sizes, begin_files, range_files=group_range,
                                reset_completion=resets.of(partition), range_only=range_only))
    return plan


def _range_outranks_older(config: TableConfig, schema: pa.Schema, partition: str, end_files: Iterable[str],
                          in_range: tuple[str, ...], stats: FileStats) -> bool:
    """Whether every record of the range's files outranks every older record of the file group
    (format.md §12.3), so that their merge alone is the state as of `end` of every key they touch
    and the older files need not be read. The usual case: commits whose instants and ordering
    values grow with time. It holds when the range's files are all in the slice read as of `end`
    (no compaction folded them), every other file of it has an older instant (a base file's rows
    are older than its compaction's instant), and, with an ordering field, the range's ordering
    values are no smaller than the greatest of the older files (equal values: the later record
    wins). A null one is a natural delete (writers refuse it in upserts), which cuts every older
    record anyway. Unknown statistics: no."""
    if config.merge_mode == PARTIAL_UPDATE or not in_range:
        return False  # partial_update builds a row from every older record's columns
    end_set = set(end_files)
    if not end_set.issuperset(in_range):
        return False
    older = end_set.difference(in_range)
    if not older:
        return True
    if max(parse_data_file(n).instant for n in older) >= min(parse_data_file(n).instant for n in in_range):
        return False  # a commit completed late: log order is by instant
    if config.merge_mode == COMMIT_TIME:
        return True
    ordering = config.ordering_field
    if not pa.types.is_integer(schema.field(ordering).type):
        return False  # statistics compare exactly only as integers
    range_min = None
    for n in in_range:
        st = stats.of(partition, n, ordering)
        if st is None or "min" not in st:
            return False
        if st["min"] is not None:
            range_min = st["min"] if range_min is None else min(range_min, st["min"])
    if range_min is None:
        return True  # only natural deletes
    for n in older:
        st = stats.of(partition, n, ordering)
        if st is None or "max" not in st:
            return False
        if st["max"] is not None and st["max"] > range_min:
            return False
    return True


# -- running a task ----------------------------------------------------------------------------

def _merged(storage: Storage, config: TableConfig, schema: pa.Schema, task: ScanTask, files: Iterable[str],
            keys: pa.Array | None = None) -> pa.Table:
    """The merged records of `files` (of `task`'s file group; with the meta columns if keys are
    matched on `_nbcc_record_key`); only those whose match column value is in `keys`, if given."""
    match = _match_column(config)
    key_filter = None if keys is None else pc.field(match).isin(keys)
    return read_files(storage, config, schema, task.partition, list(files), include_meta=match == RECORD_KEY_COL,
                      key_filter=key_filter, sizes=task.file_sizes)


def _with_meta(plan: ScanPlan, task: ScanTask, merged: pa.Table) -> pa.Table:
    n = merged.num_rows
    instants = merged.column(COMMIT_TIME_COL).combine_chunks().dictionary_encode()
    completions = pa.array([plan.completion.get(v) for v in instants.dictionary.to_pylist()], pa.string())
    out = merged.append_column(COMPLETION_TIME_COL, completions.take(instants.indices))
    out = out.append_column(PARTITION_COL, constant_strings(task.partition, n))
    return out.append_column(FILE_GROUP_COL, constant_strings(task.file_group_id, n))


_PRE_MERGE_KEY_SET = 100_000


def iter_task(storage: Storage, plan: ScanPlan, task: ScanTask) -> Iterator[pa.Table]:
    """The rows of one task, in `plan.output_schema`, piece by piece (memory stays bounded for a
    large file slice: see reader.py)."""
    config, options = plan.config, plan.options
    if options.is_cdc:
        yield _read_cdc(storage, plan, task)
        return
    # Predicates on record key columns, and an incremental read's touched keys, select whole
    # keys: they filter the files' rows before the merge (reader.iter_files). The rest can only
    # be applied to merged rows (an older version of a key may match where the winner does not).
    key_predicates = [p for p in options.predicates if p.column in config.record_key]
    key_filter = None
    expr = conjunction([p for p in options.predicates if p.column not in config.record_key], options.arrow_filter)
    match = _match_column(config)
    if options.query_type == INCREMENTAL and not task.range_only:  # else every key in the files changed
        keys = _touched_keys(storage, plan, task)
        touched = pc.field(match).isin(keys)
        # Each filter call hashes the key set again (once per file, or per spilled batch): with
        # a huge set, filter the merged rows once instead.
        if len(keys) <= _PRE_MERGE_KEY_SET:
            key_filter = touched
        else:
            expr = touched if expr is None else touched & expr
    # Incremental reads keep the meta columns for touched keys matched on `_nbcc_record_key`, and
    # for a pyarrow filter, which may name them.
    meta = options.query_type == INCREMENTAL and ((not task.range_only and match == RECORD_KEY_COL)
                                                  or options.arrow_filter is not None)
    for merged in iter_files(storage, config, _columns_to_read(plan), task.partition, list(task.files),
                             include_meta=options.include_meta_columns or meta,
                             merged_already=task.merged_already, key_predicates=key_predicates,
                             key_filter=key_filter, sizes=task.file_sizes):
        if options.include_meta_columns:
            merged = _with_meta(plan, task, merged)
        if expr is not None and merged.num_rows:
            try:
                merged = merged.filter(expr)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                hint = ("; pyarrow's decimal arithmetic cannot widen past the result's precision here: cast "
                        "the decimal column first (pc.field(...).cast(pa.float64())), or compare with a "
                        "decimal scalar of the result's type" if "Precision is not great enough" in str(exc) else "")
                raise InvalidOptionError(f"the filter cannot be applied to the rows read (columns "
                                         f"{merged.column_names}): {exc}{hint}") from None
        yield merged.select(plan.output_schema.names).cast(plan.output_schema)


def read_task(storage: Storage, plan: ScanPlan, task: ScanTask) -> pa.Table:
    """The rows of one task, in `plan.output_schema`, as one table."""
    parts = list(iter_task(storage, plan, task))
    return parts[0] if len(parts) == 1 else pa.concat_tables(parts)


def _match_column(config: TableConfig) -> str:
    """The column that tells records' keys apart in an incremental read: a single key column's
    own values (hashing an integer is cheaper than hashing its text, and the files' key text
    need not be decoded), else `_nbcc_record_key`. Key types (string, integer, date) have one
    text per value, so both select the same records."""
    return config.record_key[0] if len(config.record_key) == 1 else RECORD_KEY_COL


def _range_rows(storage: Storage, plan: ScanPlan, task: ScanTask) -> pa.Table:
    """Record keys (the match column) and instants written in the range to this file group
    (none in a file group that only an overwrite in the range touched)."""
    return read_columns(storage, task.partition, task.range_files, [_match_column(plan.config), COMMIT_TIME_COL],
                        file_schema(plan.schema), task.file_sizes)


def _touched_keys(storage: Storage, plan: ScanPlan, task: ScanTask) -> pa.Array:
    """The distinct keys (the match column's values) that the range changed in this file group."""
    match = _match_column(plan.config)
    keys = _range_rows(storage, plan, task).column(match)
    if task.reset_completion and task.begin_files:
        before = _merged(storage, plan.config, plan.schema, task, task.begin_files)
        keys = pa.chunked_array(keys.chunks + before.column(match).chunks, keys.type)
    return pc.unique(keys.combine_chunks())


def _equal(b: pa.ChunkedArray, a: pa.ChunkedArray) -> pa.Array:
    """Row-wise "same value" (null equals null, NaN equals NaN), for any column type."""
    t = b.type
    if pa.types.is_nested(t):
        # No Arrow kernel compares nested values: compare them as Python values (changed keys only).
        return pa.array([_same_value(x, y) for x, y in zip(b.to_pylist(), a.to_pylist())], pa.bool_())
    eq = pc.or_kleene(pc.equal(b, a), pc.and_(b.is_null(), a.is_null()))
    if pa.types.is_floating(t):
        eq = pc.or_kleene(eq, pc.and_(pc.is_nan(b), pc.is_nan(a)))
    return eq.fill_null(False)


def _same_value(x: Any, y: Any) -> bool:
    """`_equal` for one nested value as Python gives it (lists, dicts, a map's (key, value)
    tuples): NaN equals NaN at any depth, as at the top level."""
    if isinstance(x, float) and isinstance(y, float):
        return x == y or (x != x and y != y)
    if isinstance(x, (list, tuple)) and isinstance(y, (list, tuple)):
        return len(x) == len(y) and all(_same_value(u, v) for u, v in zip(x, y))
    if isinstance(x, dict) and isinstance(y, dict):
        return x.keys() == y.keys() and all(_same_value(x[k], y[k]) for k in x)
    return x == y


def _taken(rows: pa.Table, idx: pa.Array) -> pa.Table:
    """`rows` at `idx`; a null index takes a row of placeholders, which the null `before` or
    `after` struct holding it hides. (A take's null row would leave a struct's fields null, and
    Arrow's cast refuses that for a field marked not null, see schema.null_array; a copy of a
    real row would cost its size once per missing key.)"""
    filler = pa.Table.from_arrays([null_array(1, f.type) for f in rows.schema], schema=rows.schema)
    return pa.concat_tables([rows, filler]).take(idx.fill_null(rows.num_rows))


def _read_cdc(storage: Storage, plan: ScanPlan, task: ScanTask) -> pa.Table:
    config, schema = plan.config, plan.schema
    match = _match_column(config)
    rows = _range_rows(storage, plan, task)
    # When each key last changed: the greatest completion time among the range's commits.
    instants = rows.column(COMMIT_TIME_COL).combine_chunks().dictionary_encode()
    completions = pa.array([plan.change_completion[v] for v in instants.dictionary.to_pylist()], pa.string())
    if len(completions) == 1:  # one commit wrote here (the usual consumer's range): no grouping
        keys = pc.unique(rows.column(match).combine_chunks())
        last_change = constant_strings(completions[0].as_py(), len(keys))
    else:
        changed = pa.table({"k": rows.column(match), "c": completions.take(instants.indices)}) \
            .group_by("k").aggregate([("c", "max")])
        keys = changed.column("k").combine_chunks()
        last_change = changed.column("c_max").combine_chunks()
    # Only the changed keys' records are merged (a merge is per key): a small change to a large
    # file group no longer merges the whole group twice. After an overwrite every key at begin
    # changed, and a huge key set is cheaper to look up in the merged rows than in every file's.
    only = None if task.reset_completion or len(keys) > _PRE_MERGE_KEY_SET else keys
    columns = list(dict.fromkeys([*schema.names, match]))
    before = _merged(storage, config, schema, task, task.begin_files, only).select(columns)
    # range_only: `files` are the range's files, which hold exactly the changed keys.
    after = _merged(storage, config, schema, task, task.files,
                    None if task.range_only else only).select(columns)
    if task.reset_completion:  # an overwrite in the range changed every earlier key
        extra = pc.filter(before.column(match), pc.invert(pc.is_in(before.column(match), value_set=keys)))
        keys = pa.concat_arrays([keys, extra.combine_chunks()])
        # A key written in the range before the overwrite changed last at the overwrite (which
        # may have removed it), not at its write.
        reset = pa.scalar(task.reset_completion, pa.string())
        last_change = pc.if_else(pc.less(last_change, reset), reset, last_change)
        last_change = pa.concat_arrays([last_change, constant_strings(task.reset_completion, len(extra))])
    b_idx = pc.index_in(keys, value_set=before.column(match).combine_chunks())
    a_idx = pc.index_in(keys, value_set=after.column(match).combine_chunks())
    b_rows, a_rows = _taken(before, b_idx), _taken(after, a_idx)
    has_b, has_a = b_idx.is_valid(), a_idx.is_valid()
    same = pc.and_(has_b, has_a)
    for name in schema.names:
        same = pc.and_(same, _equal(b_rows.column(name), a_rows.column(name)))
    keep = pc.and_(pc.or_(has_b, has_a), pc.invert(same))
    change = pc.if_else(pc.invert(has_b), "insert", pc.if_else(pc.invert(has_a), "delete", "update"))
    struct_type = plan.output_schema.field("before").type

    def as_struct(t: pa.Table, present: pa.Array) -> pa.Array:
        arrays = [t.column(f.name).combine_chunks() for f in struct_type]
        return pa.StructArray.from_arrays(arrays, fields=list(struct_type), mask=pc.invert(present))

    cols = {k: pc.if_else(has_a, a_rows.column(k), b_rows.column(k)) for k in config.record_key}
    out = pa.table({**cols, CHANGE_TYPE_COL: change, COMPLETION_TIME_COL: last_change,
                    "before": as_struct(b_rows, has_b), "after": as_struct(a_rows, has_a)})
    return out.filter(keep).cast(plan.output_schema)


def iter_plan(storage: Storage, plan: ScanPlan, read_ahead: int = 0) -> Iterator[pa.RecordBatch]:
    """The rows of a plan as record batches, task after task and piece by piece, so that
    memory holds one piece of one file group at a time (iter_task). With `read_ahead` and more
    than one task, a thread reads up to that many pieces ahead while the caller consumes one
    (memory: that many pieces more)."""
    pieces = (rows for task in plan.tasks for rows in iter_task(storage, plan, task))
    for rows in (_read_ahead(pieces, read_ahead) if read_ahead and len(plan.tasks) > 1 else pieces):
        yield from rows.to_batches()


# The stop events of the read-ahead threads running: stopped and waited for at exit, since a
# daemon thread frozen inside Arrow's C++ code as the interpreter ends aborts the process.
_READING_AHEAD: dict[threading.Thread, threading.Event] = {}
_READING_AHEAD_LOCK = threading.Lock()


@atexit.register
def _stop_reading_ahead() -> None:
    with _READING_AHEAD_LOCK:
        running = list(_READING_AHEAD.items())
    for thread, stop in running:
        stop.set()
    for thread, _ in running:
        thread.join()  # at most the piece it is reading


def _read_ahead(items: Iterator[Any], depth: int) -> Iterator[Any]:
    """`items`, computed by a thread up to `depth` ahead of the one the caller holds. Reading and
    merging (Parquet decoding, Arrow kernels) release the GIL, so they overlap with what the
    caller does with the previous piece. An error reaches the caller where it took place; a
    caller that drops the iterator early, or the interpreter's exit, stops the thread."""
    slots = threading.Semaphore(depth + 1)  # the piece the caller holds, and `depth` ahead of it
    ahead: queue.Queue = queue.Queue()
    stop = threading.Event()
    end = object()

    def produce() -> None:
        try:
            for item in _slotted(items, slots, stop):
                ahead.put((item, None))
            ahead.put((end, None))
        except BaseException as exc:  # handed to the caller, raised there
            ahead.put((end, exc))
        finally:
            with _READING_AHEAD_LOCK:
                _READING_AHEAD.pop(threading.current_thread(), None)

    thread = threading.Thread(target=produce, name="nbcc-read-ahead", daemon=True)
    with _READING_AHEAD_LOCK:
        _READING_AHEAD[thread] = stop
    try:
        thread.start()
    except RuntimeError:  # no new threads at interpreter shutdown (Python 3.12): read inline
        with _READING_AHEAD_LOCK:
            _READING_AHEAD.pop(thread, None)
        yield from items
        return
    try:
        while True:
            item, error = ahead.get()
            if error is not None:
                raise error
            if item is end:
                return
            yield item
            slots.release()  # the caller is done with it
    finally:
        stop.set()


def _slotted(items: Iterator[Any], slots: threading.Semaphore, stop: threading.Event) -> Iterator[Any]:
    """`items`, each computed only once a slot is free; ends when `stop` is set."""
    done = object()
    while True:
        while not slots.acquire(timeout=0.1):
            if stop.is_set():
                return
        if stop.is_set():
            return
        item = next(items, done)
        if item is done:
            return
        yield item


def read_plan(storage: Storage, plan: ScanPlan, threads: int = 4) -> pa.Table:
    from concurrent.futures import ThreadPoolExecutor

    if not plan.tasks:
        return plan.output_schema.empty_table()
    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(plan.tasks)))) as pool:
        parts = list(pool.map(lambda t: read_task(storage, plan, t), plan.tasks))
    return pa.concat_tables(parts)


DEFAULT_MAX_PARTITION_BYTES = 128 * 1024 * 1024
MIN_PARTITION_BYTES = 32 * 1024 * 1024


def pack_tasks(tasks: list[ScanTask], max_bytes: int = DEFAULT_MAX_PARTITION_BYTES,
               parallelism: int | None = None) -> list[list[ScanTask]]:
    """Group tasks into engine partitions. Each engine partition has a fixed cost (a Spark
    Python data source task: 35-50 ms, measured), so small file groups are read together, as
    Spark's own file sources pack small files: about total / parallelism bytes each (one wave),
    at least 32 MiB and at most `max_bytes`. The number of groups is rounded up to a multiple of
    the parallelism and bytes are spread evenly over them, so the last wave of tasks is not one
    small group running alone (16 file groups of 6.5 MiB on 2 cores: 2 groups of 8, not
    5+5+5+1). Measured on a 64 MiB compacted table on 2 cores: 0.48 s in 2 partitions, 0.58 s in
    4 (Spark's Parquet source: 0.44 s). Tasks keep their plan order."""
    if not tasks:
        return []
    cores = parallelism or os.cpu_count() or 2
    total = sum(t.bytes for t in tasks)
    target = min(max_bytes, max(MIN_PARTITION_BYTES, -(-total // cores)))
    wanted = -(-total // target) if total else 1
    if wanted > 1:
        wanted = min(len(tasks), -(-wanted // cores) * cores)
    groups: list[list[ScanTask]] = [[]]
    size = done = 0
    for t in tasks:
        # The group a task's middle byte falls in, when bytes are cut into `wanted` equal shares;
        # never more than `max_bytes` in one group.
        share = (done + t.bytes / 2) * wanted // total if total else 0
        if groups[-1] and (len(groups) <= share or size + t.bytes > max_bytes):
            groups.append([])
            size = 0
        groups[-1].append(t)
        size += t.bytes
        done += t.bytes
    return groups
