"""`nbcc.Table`: the Python API over the core (create, open, write, read, timeline, slices)."""

from __future__ import annotations

import itertools
import json
import logging
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator, Mapping, Sequence

import pyarrow as pa
import pyarrow.compute as pc

from .clock import BEFORE_ALL, TimeGenerator, parse_time_option
from .commit import WriteTransaction
from .archive import archive
from .clean import DEFAULT_RETAIN_COMMITS, clean
from .compaction import (check_parallelism, executing_compactions, maybe_compact, run_compaction, run_compactions,
                         schedule_compaction)
from .heartbeat import Heartbeat, idle_ms, interval_s
from .history import CommitInfo, commit_history
from .rollback import rollback_failed_writes, rollback_instant
from .savepoint import create_savepoint, delete_savepoint, list_savepoints
from .config import (
    _bool_option,
    DEFAULT_BUCKETS,
    DEFAULT_HEARTBEAT_TIMEOUT_S,
    DEFAULT_LOCK_LEASE_MS,
    DELETE,
    DELETE_PARTITION,
    DYNAMIC,
    FORMAT_VERSION,
    PARTITION_DELETE_VERSION,
    TYPE_WIDENING,
    TYPE_WIDENING_VERSION,
    PARTITION_OVERWRITE_MODE,
    PARTITION_REPLACE_VERSION,
    STATIC,
    TABLE_CONFIG_PATH,
    UPSERT,
    WRITE_OPTIONS,
    TableConfig,
    check_overwrite_options,
    check_partition_overwrite_mode,
    check_write_operation,
    parse_options,
    parse_table_options,
)
from .errors import (
    InvalidOptionError,
    LockTimeoutError,
    SchemaError,
    TableConfigError,
    TableExistsError,
    TableNotFoundError,
)
from .conditions import parse_replace_where, typed_condition, with_column_as_spelled
from .expr import conjunction, describe, parse_filter
from .file_slices import FileSlice
from .filenames import LogFile, make_token, parse_data_file
from .index_view import MetadataIndex, load_index
from .inputs import Data, as_arrow, as_batches
from .indexing import DEFAULT_TIMEOUT_S, build_index, drop_index, index_state
from .metadata_table import KINDS
from .partitions import PartitionMatch, matching, partition_values
from .scan import EARLIEST, ReadOptions, ScanPlan, iter_plan, plan_scan, read_plan, read_task, schema_read
from .schema import IS_DELETED_COL, check_is_deleted, evolve_schema, widened_columns
from .update import apply_updates, check_updates, describe_updates
from .storage import Storage
from .storage_options import is_relative_path
from .timeline import (
    DATA_ACTIONS,
    DELTA_COMMIT,
    REPLACE_COMMIT,
    REPLACE_PARTITIONS,
    Instant,
    Timeline,
    earliest_retained,
    savepoint_times,
)
from .view import TableView, check_readable, earliest_begin, oldest_readable, schema_as_of, slices_by_group, table_view
from .writer import LogWriter, check_rows, check_rows_match, coalesced, partitions_named, prepare



log = logging.getLogger(__name__)

_NOTHING_TO_DELETE = "it has no partitions to delete; to delete every row, overwrite it with no rows"
_NOTHING_TO_LIST = "it has no partitions to list"
_DELETE_INSTEAD = "To delete the records that match a condition on other columns, use Table.delete (`nbcc delete`)"
_LIST_INSTEAD = ("To find the rows that match a condition on other columns, read them "
                 "(table.read(filter=...); include_meta_columns=True gives each row's _nbcc_partition)")


@dataclass(frozen=True)
class ReplaceWhere:
    """A replaceWhere condition, checked (`Table.replace_filter`): as given (for messages), as a
    filter (which partitions it replaces, at commit) and as one expression (which rows match)."""

    given: Any
    filter: list[Any]
    condition: pc.Expression

    def check(self, rows: pa.Table, partition_by: Sequence[str]) -> None:
        """Every row written must match (SchemaError otherwise)."""
        check_rows_match(rows, partition_by, self.condition, self.given)

    @property
    def text(self) -> str:
        """As the commit metadata records it (`replace_where`, shown by `nbcc history`)."""
        return describe(self.given if isinstance(self.given, str) else self.filter)



def _file_in_the_way(storage: Storage) -> str:
    """Which file stands where a table's folder (or one of its parents) must be."""
    found = storage.file_in_the_way()
    if found is None or found == storage.root:
        return f"{storage.uri} is a file, not a folder"
    return f"{found} is a file, not a folder (it is on the table path {storage.uri})"


class Table:
    """An nbcc table at a URI. Cheap to construct; every read plans from a fresh timeline."""

    def __init__(self, storage: Storage, config: TableConfig):
        self.storage = storage
        self.config = config
        self.clock = TimeGenerator(storage, lease_ms=config.lock_lease_ms)

    # -- opening -----------------------------------------------------------------------------

    @classmethod
    def create(cls, uri: str, schema: pa.Schema, record_key: str | Sequence[str] | None, *,
               ordering_field: str | None = None, partition_by: str | Sequence[str] = (),
               buckets: int = DEFAULT_BUCKETS, merge_mode: str | None = None,
               storage_options: Mapping[str, Any] | None = None,
               lock_lease_ms: int = DEFAULT_LOCK_LEASE_MS,
               heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S) -> "Table":
        """Create a table; TableExistsError if the URI already holds one.

        lock_lease_ms: how long a crashed process can hold the table lock before others take it.
        heartbeat_timeout_s: how long a write may go without a heartbeat before the cleaner
        treats it as failed and rolls it back."""
        config = TableConfig.build(schema, record_key, ordering_field=ordering_field,
                                   partition_by=partition_by, buckets=buckets, merge_mode=merge_mode,
                                   lock_lease_ms=lock_lease_ms, heartbeat_timeout_s=heartbeat_timeout_s)
        return cls.create_at(Storage(uri, dict(storage_options or {})), config)

    @classmethod
    def create_at(cls, storage: Storage, config: TableConfig) -> "Table":
        """`create` with a storage and a config already made (the metadata table's)."""
        try:
            created = storage.put_if_absent(TABLE_CONFIG_PATH, config.to_json(), opening=True)
        except NotADirectoryError:
            raise InvalidOptionError(f"{_file_in_the_way(storage)}; give a folder path for the table") from None
        if not created:
            raise TableExistsError(f"{storage.uri} already holds an nbcc table; open it with nbcc.Table.open")
        return cls(storage, config)

    @classmethod
    def open(cls, uri: str, storage_options: Mapping[str, Any] | None = None) -> "Table":
        return cls.open_at(Storage(uri, dict(storage_options or {})))

    @classmethod
    def open_at(cls, storage: Storage) -> "Table":
        """`open` with a storage already made (the metadata table's)."""
        uri = storage.uri
        try:
            raw = storage.read_bytes(TABLE_CONFIG_PATH, opening=True)
        except NotADirectoryError:
            raise TableNotFoundError(f"{uri} is not an nbcc table: {_file_in_the_way(storage)}; "
                                     "give the table's folder path") from None
        except FileNotFoundError:
            # A relative path is a folder under the current one: an S3 URI without its s3://?
            where = (f" (a local path: {os.path.abspath(uri)}; an S3 table's URI starts with s3://)"
                     if storage.is_local and is_relative_path(uri) else "")
            raise TableNotFoundError(
                f"{uri} is not an nbcc table{where} (no {TABLE_CONFIG_PATH}); create it with nbcc.Table.create "
                "or by a first write with the record_key option"
            ) from None
        try:
            return cls(storage, TableConfig.from_json(raw))
        except SchemaError as exc:  # a format version this nbcc does not read: nothing is damaged
            raise TableConfigError(f"the nbcc table at {uri} cannot be opened: {exc}; use the nbcc that "
                                   "wrote it, or a newer one") from None
        except TableConfigError as exc:
            raise TableConfigError(
                f"the nbcc table at {uri} cannot be opened: {exc}. The file is written when the table "
                "is created and changed only by index builds and a first dynamic partition overwrite; "
                "restore it from a backup or your storage's object versions"
            ) from None

    @classmethod
    def open_or_create(cls, uri: str, schema: pa.Schema, storage_options: Mapping[str, Any] | None = None,
                       **table_options: Any) -> "Table":
        """Open the table at `uri`, creating it from `schema` and `table_options` if it does not
        exist (a first write). `table_options` are `create`'s; given for an existing table, they
        must match it. A `_nbcc_is_deleted` column of `schema` (a first write's deletes) is not
        one of the table's."""
        options = parse_table_options(table_options)
        if IS_DELETED_COL in schema.names:
            check_is_deleted(schema)  # before the table exists: a bad write must leave none
            schema = schema.remove(schema.get_field_index(IS_DELETED_COL))
        try:
            table = cls.open(uri, storage_options)
        except TableNotFoundError:
            try:
                settings = dict(options)  # `options` stays whole for the check below
                return cls.create(uri, schema, settings.pop("record_key", None),
                                  storage_options=storage_options, **settings)
            except TableExistsError:  # another first writer won the race
                table = cls.open(uri, storage_options)
        try:
            table.config.check_options(options)
        except InvalidOptionError as e:
            if Timeline.load(table.storage).completed():
                raise
            # A first write that failed leaves the table it created, with that write's options.
            raise InvalidOptionError(
                f"{e}. The table has no commit yet: if a failed first write left it and nothing writes "
                f"it now, delete {table.uri} and write again to create it with the new options"
            ) from None
        return table

    @property
    def uri(self) -> str:
        return self.storage.uri

    # -- writing -----------------------------------------------------------------------------

    def prepare_write(self, incoming_schema: pa.Schema, operation: str = UPSERT,
                      overwrite: bool = False, partition_overwrite_mode: str = STATIC,
                      replace_where: Any = None, user_metadata: str | None = None,
                      type_widening: bool = False) -> WriteTransaction:
        """Check `incoming_schema` against the table's schema and make the transaction that writes
        it, not begun (a streaming sink begins one instant per micro-batch from it). An overwrite
        with `partition_overwrite_mode="dynamic"` replaces only the partitions it writes rows to
        (on a table without partition columns: the whole table, as in Spark); one with
        `replace_where` (`replace_filter`), the partitions that match it (the caller checks the
        rows and names them at commit). `user_metadata`: text its commit records. `type_widening`:
        wider integer or float data widens its column instead of being refused (format.md §4.2)."""
        check_write_operation(operation, overwrite)
        if user_metadata is not None and not isinstance(user_metadata, str):
            raise InvalidOptionError(f"user_metadata must be text (a job name, a ticket); got {user_metadata!r}")
        partition_overwrite_mode = check_partition_overwrite_mode(partition_overwrite_mode)
        check_overwrite_options(replace_where, overwrite, partition_overwrite_mode)
        current = self.schema()
        if operation == DELETE_PARTITION:
            self._check_partitioned(_NOTHING_TO_DELETE)
            missing = [c for c in self.config.partition_by if c not in incoming_schema.names]
            if missing:
                raise InvalidOptionError(f"operation=delete_partition: the data lacks partition column(s) {missing}; "
                                         "its rows name the partitions to delete")
            # Only the partition columns count; their types are checked as a write's.
            evolve_schema(current, pa.schema([incoming_schema.field(c) for c in self.config.partition_by]),
                          delete=True)
            return WriteTransaction(self.storage, self.clock, REPLACE_PARTITIONS, DELETE_PARTITION, current,
                                    partition_depth=len(self.config.partition_by),
                                    format_version=PARTITION_DELETE_VERSION, user_metadata=user_metadata)
        missing = [c for c in self.config.record_key + self.config.partition_by if c not in incoming_schema.names]
        if missing:
            raise InvalidOptionError(
                f"the data lacks record key / partition column(s) {missing}; every row needs them"
            )
        ordering = self.config.ordering_field
        if ordering and operation != DELETE and ordering not in incoming_schema.names:
            raise SchemaError(
                f"the data lacks the ordering_field column {ordering!r}; upserts need it to decide "
                "which version of a record wins (deletes may leave it out)"
            )
        new_schema = evolve_schema(current, incoming_schema, delete=operation == DELETE,
                                   partition_by=self.config.partition_by, widen=type_widening)
        action, version = DELTA_COMMIT, FORMAT_VERSION
        if replace_where is not None:
            if not isinstance(replace_where, ReplaceWhere):
                self.replace_filter(replace_where, new_schema)  # refused before anything is written
            # It names partitions it may write no file to (§8): version 3.
            action, version = REPLACE_PARTITIONS, PARTITION_DELETE_VERSION
        elif overwrite:
            dynamic = partition_overwrite_mode == DYNAMIC and self.config.partition_by
            action = REPLACE_PARTITIONS if dynamic else REPLACE_COMMIT
            version = PARTITION_REPLACE_VERSION if dynamic else FORMAT_VERSION
        widened = [f"{n}: {current.field(n).type} -> {new_schema.field(n).type}"
                   for n in widened_columns(current, new_schema)]
        if widened:
            version = TYPE_WIDENING_VERSION  # versions are cumulative: it has 2's and 3's actions too
        return WriteTransaction(
            self.storage, self.clock, action, "overwrite" if overwrite else operation, new_schema,
            added_columns=[n for n in new_schema.names if n not in current.names],
            partition_depth=len(self.config.partition_by), format_version=version, user_metadata=user_metadata,
            type_widening=type_widening, widened=widened,
        )

    def replace_filter(self, replace_where: Any, schema: pa.Schema | None = None) -> "ReplaceWhere":
        """A replaceWhere condition as a filter on partition columns (InvalidOptionError if it
        is not one): SQL text in Delta's form (`day >= '2026-11-01' AND day < '2026-11-08'`,
        `region IN ('eu', 'us')`, BETWEEN, IS NULL), or a filter as `read` takes."""
        self._check_partitioned("replaceWhere, which replaces the partitions that match it, needs some; "
                                "overwrite the whole table instead")
        schema = schema or self.schema()
        if isinstance(replace_where, str) and not replace_where.strip():
            raise InvalidOptionError("replaceWhere is empty; give a condition on partition columns")
        if isinstance(replace_where, str):
            try:
                spec = [typed_condition(with_column_as_spelled(c, schema), schema)
                        for c in parse_replace_where(replace_where)]
            except InvalidOptionError as exc:
                raise InvalidOptionError(f"replaceWhere: {exc}") from None
        else:
            spec = replace_where if isinstance(replace_where, list) else [replace_where]
        if not spec:
            raise InvalidOptionError("replaceWhere is empty; give a condition on partition columns")
        condition = self.partition_condition(spec, schema, "replaceWhere replaces whole partitions; to replace the "
                                                       "rows that match a condition on other columns, delete them "
                                                       "(Table.delete, `nbcc delete`) and append the new rows")
        return ReplaceWhere(replace_where, spec, condition)

    def partition_condition(self, spec: Any, schema: pa.Schema,
                            instead: str = _DELETE_INSTEAD) -> pc.Expression | None:
        """`spec` (a filter as `read` takes) as one expression, or InvalidOptionError if it names
        a column that is not a partition column (`instead`: what to do then)."""
        preds, extra = parse_filter(spec, schema)
        others = sorted({p.column for p in preds} - set(self.config.partition_by))
        if others:
            raise InvalidOptionError(
                f"filter column(s) {others} are not partition columns ({list(self.config.partition_by)}): "
                f"whole partitions are matched by their partition values. {instead}")
        expression = conjunction(preds, extra)
        if expression is not None:
            try:  # a pyarrow expression naming another column fails here, not later
                partition_values([], self.config.partition_by, schema).filter(expression)
            except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as exc:
                missing = re.search(r"No match for FieldRef.Name\((.*?)\)", str(exc))
                what = (f"column {missing[1]!r} is not a partition column ({list(self.config.partition_by)})"
                        if missing else str(exc).splitlines()[0])
                raise InvalidOptionError(
                    f"the filter cannot be applied to the partition columns {list(self.config.partition_by)} "
                    f"alone (whole partitions are matched by their partition values): {what}. {instead}"
                ) from None
        return expression

    def begin_write(self, incoming_schema: pa.Schema, operation: str = UPSERT, overwrite: bool = False,
                    check_first: Callable[[pa.Schema], None] | None = None,
                    partition_overwrite_mode: str = STATIC, replace_where: Any = None,
                    user_metadata: str | None = None, type_widening: bool = False) -> WriteTransaction:
        """Check `incoming_schema` and start an instant (the first half of a write; used by the
        Spark connector, whose tasks write the files). `check_first(table_schema)` runs after the
        schema checks and before the instant exists, so a failing check writes nothing."""
        txn = self.prepare_write(incoming_schema, operation, overwrite, partition_overwrite_mode, replace_where,
                                 user_metadata, type_widening)
        if check_first is not None:
            check_first(txn.schema)
        txn.begin()
        return txn

    def log_writer(self, txn: WriteTransaction, token: str, max_log_file_bytes: int | None = None) -> LogWriter:
        return LogWriter(self.storage, self.config, txn.schema, txn.instant, token, max_log_file_bytes)

    def write(self, data: Data, operation: str = UPSERT, *, mode: str = "append",
              partition_overwrite_mode: str = STATIC, max_log_file_bytes: int | None = None,
              compaction_delta_commits: int | None = None, compaction_inline: bool = False,
              replace_where: Any = None, user_metadata: str | None = None, type_widening: bool = False) -> str | None:
        """Write `data` as one commit; returns its instant (None: a partition deletion of no rows,
        which writes nothing). `data`: a pyarrow Table, RecordBatch, RecordBatchReader, Dataset or
        iterable of RecordBatch (or Table), or anything that exports an Arrow stream (a Polars
        data frame, a DuckDB result), read as a stream; a pandas data frame without its index,
        unless the index is named (`set_index("id")`), whose columns it then gives.

        `operation`: "upsert" (rows with a true `_nbcc_is_deleted` column delete their key),
        "delete" (the rows' keys are deleted) or "delete_partition" (every row of the partitions
        the rows are in is deleted, with a commit that writes no files; only their partition
        columns are read, see `delete_partitions`). `mode="overwrite"` replaces the table's contents;
        with `partition_overwrite_mode="dynamic"`, only those of the partitions `data` has rows in;
        with `replace_where` (Delta's replaceWhere: SQL text such as "day >= '2026-11-01' AND day <
        '2026-11-08'", or a filter as `read` takes, on partition columns), those of the partitions
        that match it, rows or not; every row of `data` must match it.
        Bad data raises before anything is written when `data` is a Table; a stream that turns
        bad part-way, or a write failing for any other reason, is rolled back at once.
        `compaction_delta_commits=N` schedules a compaction once N delta commits completed since
        the last one (and runs it here too with `compaction_inline=True`). `user_metadata`: text
        recorded with the commit (Delta's userMetadata), shown by `history()`. `type_widening=True`:
        integer or float data wider than its column widens the column (int32 -> int64, float ->
        double) instead of being refused; the table's format version becomes 4."""
        data = as_arrow(data)
        schema, batches = as_batches(data)
        whole = pa.Table.from_batches([data]) if isinstance(data, pa.RecordBatch) else data
        return self._write(schema, batches, operation, mode, partition_overwrite_mode, max_log_file_bytes,
                           compaction_delta_commits, compaction_inline,
                           check_first=whole if isinstance(whole, pa.Table) else None, replace_where=replace_where,
                           user_metadata=user_metadata, type_widening=type_widening)

    def _write(self, schema: pa.Schema, pieces: Iterator[pa.RecordBatch | pa.Table], operation: str, mode: str,
               partition_overwrite_mode: str, max_log_file_bytes: int | None, compaction_delta_commits: int | None,
               compaction_inline: bool, check_first: pa.Table | None = None, by_file_group: bool = False,
               commit_extra: dict[str, Any] | None = None, replace_where: Any = None,
               user_metadata: str | None = None, type_widening: bool = False) -> str | None:
        """`write` of `pieces` (record batches of `schema`). `check_first`: the whole data, to
        check before the instant begins. `by_file_group`: each piece is one file group's rows (a
        restore's or a delete's, read one file group at a time), whose log file is closed before
        the next, so that memory holds one file group's rows. `commit_extra`: fields added to
        (or replacing) the commit metadata's."""
        if mode not in ("append", "overwrite"):
            raise InvalidOptionError(f"mode must be 'append' or 'overwrite'; got {mode!r}")
        # Checked as the Spark options are: `operation` in any letter case, among the others.
        given, _ = parse_options({"operation": operation, "compaction_delta_commits": compaction_delta_commits,
                                  "compaction_inline": compaction_inline, "max_log_file_bytes": max_log_file_bytes,
                                  PARTITION_OVERWRITE_MODE: partition_overwrite_mode, TYPE_WIDENING: type_widening},
                                 WRITE_OPTIONS, "write")
        operation = given.get("operation", UPSERT)

        def compact_if_due(instant: str) -> str:
            maybe_compact(self.storage, self.config, self.clock, given.get("compaction_delta_commits"),
                          given.get("compaction_inline", False), f"commit {instant}", log)
            return instant

        if operation == DELETE_PARTITION:
            txn = self.prepare_write(schema, operation, overwrite=mode == "overwrite", replace_where=replace_where,
                                     user_metadata=user_metadata,
                                     partition_overwrite_mode=given.get(PARTITION_OVERWRITE_MODE, STATIC))
            found = partitions_named(pieces, self.config, txn.schema)  # every bad row, before the instant begins
            return compact_if_due(self.commit_deletion(txn, found)) if found else None
        replace = self.replace_filter(replace_where) if replace_where is not None else None

        def check_all(table_schema: pa.Schema) -> None:
            # A bad table writes nothing at all: its rows are checked and converted before the
            # instant begins, and converted again as they are written, one chunk at a time (so
            # memory holds one converted chunk, not a converted copy of the table). Conversion
            # costs nothing for columns already of the table's types.
            for rows in coalesced(check_first.to_batches()):
                converted = check_rows(rows, self.config, table_schema, operation)
                if replace is not None:
                    replace.check(converted, self.config.partition_by)

        txn = self.begin_write(schema, operation, overwrite=mode == "overwrite",
                               check_first=check_all if check_first is not None else None,
                               partition_overwrite_mode=given.get(PARTITION_OVERWRITE_MODE, STATIC),
                               replace_where=replace, user_metadata=user_metadata,
                               type_widening=given.get(TYPE_WIDENING, False))
        writer = self.log_writer(txn, make_token(0, 0, 0), given.get("max_log_file_bytes"))
        try:
            # begin_write beat just now (on S3, a request less).
            with Heartbeat(self.storage, txn.instant, interval_s(self.config.heartbeat_timeout_s),
                           beat_first=False) as beating:
                try:
                    for rows in (pieces if by_file_group else coalesced(pieces)):
                        prepared = prepare(rows, self.config, txn.schema, operation)
                        if replace is not None:
                            replace.check(prepared, self.config.partition_by)
                        writer.write(prepared)
                        if by_file_group:
                            writer.close_open_files()
                    files = writer.close()
                except BaseException:
                    writer.abort()  # no half-written file may surface later (S3 uploads on close)
                    raise
                # replaceWhere names the partitions that match it as of its completion (§8).
                extra = {**(commit_extra or {}), **({"replace_where": replace.text} if replace else {})}
                txn.commit(files, extra, match=self.match_partitions(replace.filter) if replace else None,
                           beating=beating)
        except BaseException as failure:
            # Undone at once, as a failed Spark job's abort does, rather than left for the cleaner
            # once its heartbeat expires (a commit that completed is never rolled back). Not when
            # the lock could not be taken: the rollback needs it too, and would wait as long again.
            if not isinstance(failure, LockTimeoutError):
                txn.rollback_or_log(failure)
            raise
        return compact_if_due(txn.instant)

    def _check_partitioned(self, consequence: str) -> None:
        if not self.config.partition_by:
            raise InvalidOptionError(f"the table has no partition columns, so {consequence}")

    def commit_deletion(self, txn: WriteTransaction, partitions: Iterable[str] = (),
                         match: PartitionMatch | None = None, condition: str | None = None) -> str:
        """Begin and complete a partition deletion prepared by `prepare_write`: one commit, no
        files (format.md §8), of the `partitions` named, or those a filter's `match` found;
        `condition`: that filter, as recorded in the commit metadata. Its instant begins only
        here: it writes no file, so it needs none before."""
        txn.begin()
        try:
            txn.commit([], {"condition": condition} if condition is not None else None,
                       partitions=partitions, match=match)
        except BaseException as failure:
            if not isinstance(failure, LockTimeoutError):
                txn.rollback_or_log(failure)
            raise
        return txn.instant

    def partitions(self, filter: Any = None) -> list[str]:
        """The partitions (folder paths, `day=2026-11-20`) that have files in the current snapshot;
        with `filter` (as `read`'s, on partition columns only), those whose values match it. An
        unpartitioned table has none."""
        if filter is None:
            return _partition_paths(self.storage, self._view(None)) if self.config.partition_by else []
        return list(self.match_partitions(filter, listing=True).listed)

    def match_partitions(self, filter: Any, listing: bool = False) -> PartitionMatch:
        """The partitions `partitions(filter)` gives, with what a commit that replaces them needs
        to add those that commits completing meanwhile create (`WriteTransaction.commit`).
        `listing`: errors say what a listing, not a deletion, can do instead."""
        self._check_partitioned(_NOTHING_TO_LIST if listing else _NOTHING_TO_DELETE)
        view = self._view(None)
        expression = self.partition_condition(filter, view.schema, _LIST_INSTEAD if listing else _DELETE_INSTEAD)
        paths = matching(_partition_paths(self.storage, view), expression, self.config.partition_by, view.schema)
        return PartitionMatch(tuple(paths), expression,
                              self.config.partition_by, frozenset(i.instant for i in view.completed))

    def delete_partitions(self, filter: Any, *, user_metadata: str | None = None) -> str | None:
        """Delete every row of the partitions whose values match `filter` (as `read`'s, on
        partition columns only, e.g. `[("day", "<", "2026-09-01")]`), with one commit that writes
        no files (Hudi's delete_partition); returns its instant, or None if no partition matched
        (nothing is written). Writes to those partitions that complete after it are kept. The old
        files stay readable with `as_of` until a clean deletes them. `user_metadata`: as
        `write`'s."""
        self._check_partitioned(_NOTHING_TO_DELETE)
        if filter is None or (isinstance(filter, list) and not filter):
            raise InvalidOptionError("delete_partitions needs a filter on partition columns, e.g. "
                                     "[('day', '<', '2026-09-01')]; to delete every row, overwrite the table "
                                     "with no rows")
        matched = self.match_partitions(filter)
        if not matched.listed:
            return None
        current = self.schema()
        txn = self.prepare_write(pa.schema([current.field(c) for c in self.config.partition_by]), DELETE_PARTITION,
                                 user_metadata=user_metadata)
        return self.commit_deletion(txn, match=matched, condition=describe(filter))

    # -- table services ----------------------------------------------------------------------

    def rollback(self, instant: str) -> bool:
        """Roll back a write that is not completed (its files are deleted and the instant is
        marked rolled back); False if it completed or does not exist."""
        return rollback_instant(self.storage, self.clock, instant, len(self.config.partition_by),
                                reason="a manual rollback (`nbcc rollback` or Table.rollback)")

    def rollback_failed_writes(self, heartbeat_timeout_s: float | None = None) -> list[str]:
        """Roll back every write whose heartbeat expired; the instants rolled back."""
        timeout = self.config.heartbeat_timeout_s if heartbeat_timeout_s is None else heartbeat_timeout_s
        return list(rollback_failed_writes(self.storage, self.clock, len(self.config.partition_by), timeout))

    def schedule_compaction(self) -> str | None:
        """Plan a compaction of every file group with log files; its instant, or None if there is
        nothing to compact. Writers keep writing; nothing waits for the compaction."""
        return schedule_compaction(self.storage, self.config, self.clock)

    def run_compaction(self, instant: str, progress: Callable[[int, int], None] | None = None, *,
                       parallelism: int | None = None) -> str | None:
        """Execute a scheduled compaction in this process; its completion time (None if another
        execution completed it first). Safe to re-run after a crash. `progress(done, total)` is
        called per file group. `parallelism`: file groups merged at once, by threads (default:
        one per CPU, at most 4); each holds its own merge's memory, so lower it to lower the
        peak."""
        return run_compaction(self.storage, self.config, self.clock, instant, progress, parallelism)

    def pending_compactions(self) -> list[str]:
        """Compactions scheduled and not completed (e.g. one whose run crashed: re-run it)."""
        return Timeline.load(self.storage).pending_compactions()

    def clean(self, retain_commits: int | None = None, heartbeat_timeout_s: float | None = None,
              progress: Callable[[int, int], None] | None = None, *,
              retain_hours: float | None = None, dry_run: bool = False) -> dict[str, Any]:
        """Roll back writes whose heartbeat expired, then delete the files that no read of the
        last `retain_commits` data commits (default 10) needs, or, with `retain_hours`, no read
        as of a time in the last `retain_hours` hours (Delta's retention duration, Hudi's
        KEEP_LATEST_BY_HOURS); given both, what either needs is kept, and so is what reads as
        of a savepoint's state need. Returns what was done (`rolled_back`, `deleted`:
        [partition, file name] pairs, `earliest_retained`, `savepoints`: those it planned with,
        `finished_cleans`: the cleans an earlier run left part-way, finished first, each with
        its `instant` and `deleted`; a dry run also `rolled_back_files`).
        Time travel to before that window, but to a savepoint, fails afterwards with a clear
        error. `dry_run=True` changes nothing and returns what would be done."""
        return clean(self.storage, self.config, self.clock, retain_commits, heartbeat_timeout_s, progress,
                     retain_hours, dry_run)

    def savepoint(self, as_of: Any = None, *, user_metadata: str | None = None) -> str:
        """Keep the table's state as of `as_of` (None: now) readable, with `read(as_of=...)` and
        `restore`, whatever the cleaner's window, until `delete_savepoint` (Hudi's savepoints,
        Iceberg's tags). Returns the savepoint's time: the completion time of the last instant
        (a commit, compaction or clean) completed by `as_of`. Its files stay on storage
        meanwhile. Refused for a state before the cleaner's window (its files may be gone), and
        if a clean running meanwhile deletes its files. Making a savepoint of a state kept
        already returns it. `user_metadata`: why it is kept."""
        return create_savepoint(self.storage, self.config, self.clock, as_of, user_metadata)

    def savepoints(self) -> list[dict[str, Any]]:
        """The savepoints, oldest first: `as_of` (the savepoint's time), `created`, `host`,
        `user`, `user_metadata` if given, and `confirmed` (False while one is being made, or
        if its making was cut short: cleans keep its files until `delete_savepoint`)."""
        return list_savepoints(self.storage)

    def delete_savepoint(self, as_of: Any, *, pending: bool = False) -> bool:
        """Stop keeping the savepoint with time `as_of` (the next clean may delete files only
        it kept); False if there is no such savepoint. `pending=True`: its pending files too
        (those of a making cut short), but only when no process is making it: a running
        maker's pending file is what keeps its state until its savepoint is made."""
        return delete_savepoint(self.storage, as_of, pending)

    def archive(self, retain_commits: int = DEFAULT_RETAIN_COMMITS) -> dict[str, Any]:
        """Move instants older than the retained window into .nbcc/history/ (reads stay the same;
        listing the active timeline stays fast as the table ages)."""
        return archive(self.storage, retain_commits)

    def compact(self, progress: Callable[[int, int], None] | None = None, *,
                parallelism: int | None = None) -> str | None:
        """Finish the compactions scheduled earlier (by a write's compaction_delta_commits, by
        schedule_compaction, or left by a run that failed or crashed), oldest first, then
        schedule and execute a new one; the instant of the last compaction run, or None if there
        was nothing to compact. One that another process is executing (a fresh heartbeat) is
        left to it, with a warning; `run_compaction(instant)` runs it regardless. `progress(done,
        total)` is called per file group of each; `parallelism` as for run_compaction."""
        check_parallelism(parallelism)  # before anything is scheduled

        def run(tc: str, _: bool) -> str:
            self.run_compaction(tc, progress, parallelism=parallelism)
            return tc

        ran = run_compactions(self.storage, self.config, self.clock, run)
        return ran[-1] if ran else None

    # -- the metadata table ------------------------------------------------------------------

    def build_index(self, partitions: str | Sequence[str] = KINDS, timeout_s: float = DEFAULT_TIMEOUT_S,
                    progress: Callable[[int, int], None] | None = None) -> dict[str, Any]:
        """Build metadata table partitions (`files`, `column_stats`, `key_filters`) while writers
        keep writing; resumes an indexing that a crash or a timeout left pending. Returns
        {"instants": indexing instants run, "ready": every ready partition}. `timeout_s`: how
        long to wait for writes in flight before giving up (re-run to resume)."""
        return build_index(self.storage, self.clock, partitions, timeout_s, progress)

    def drop_index(self, partitions: str | Sequence[str]) -> dict[str, Any]:
        """Stop using metadata table partitions and delete them; reads plan from the timeline."""
        return drop_index(self.storage, self.clock, partitions)

    def index_state(self) -> dict[str, Any]:
        """{"partitions": kind -> "building" | "ready" | "dropping", "pending": indexing instants pending}."""
        return index_state(self.storage)

    # -- reading -----------------------------------------------------------------------------

    def _index(self, use_metadata_table: Any) -> MetadataIndex | None:
        """The metadata table's ready `files` partition, read (None: plan from the timeline)."""
        use = _bool_option("use_metadata_table")(use_metadata_table) if use_metadata_table is not None else None
        return load_index(self.storage, use)

    def _view(self, when: str | None, check: str | None = None) -> TableView:
        """The table as of `when`: the metadata table is read before the timeline is listed
        (format.md §18.5); with `check` (the option's name for errors), `when` must be readable."""
        index = self._index(None)
        timeline = Timeline.load(self.storage)
        if check and when is not None and check_readable(self.storage, timeline, when, check):
            index = None  # a savepoint's read before the window: from the commit files (check_readable)
        return table_view(self.storage, self.config, timeline, when, index)

    def plan(self, *, as_of: Any = None, query_type: str | None = None, begin: Any = None, end: Any = None,
             incremental_format: str | None = None, include_meta_columns: Any = False,
             filter: Any = None, use_metadata_table: Any = None, columns: Sequence[str] | None = None) -> ScanPlan:
        """Plan a read (see `read`): its output schema and its tasks, one per file group read."""
        options = ReadOptions.build(query_type=query_type, as_of=as_of, begin=begin, end=end,
                                    incremental_format=incremental_format,
                                    include_meta_columns=include_meta_columns,
                                    use_metadata_table=use_metadata_table)
        if filter is not None or columns is not None:  # against the schema at the time read, as Spark's are
            index = self._index(use_metadata_table)  # before the listing (format.md §18.5)
            schema = schema_read(self.storage, self.config, options, Timeline.load(self.storage), index)
            if filter is not None:
                options = options.with_filter(filter, schema)
            if columns is not None:
                later = [c for c in columns if isinstance(c, str) and c not in schema.names
                         and c in self.schema().names]
                if later:  # say why, rather than that the table lacks a column it has
                    raise InvalidOptionError(f"columns {later} were added to the table after the time this read "
                                             f"reads ({options.as_of or options.end}); leave them out")
                options = options.with_columns(columns, schema)
        return plan_scan(self.storage, self.config, options)

    def read(self, *, as_of: Any = None, query_type: str | None = None, begin: Any = None, end: Any = None,
             incremental_format: str | None = None, include_meta_columns: Any = False,
             filter: Any = None, use_metadata_table: Any = None, columns: Sequence[str] | None = None) -> pa.Table:
        """Read the table; with no arguments, the merged snapshot (one row per live record key).

        as_of: a 17-digit instant time or ISO-8601 timestamp: the state made of the commits that
            completed at or before it (time travel).
        query_type: "snapshot" (default), "read_optimized" (base files only: fast, maybe stale)
            or "incremental" (the keys changed by commits that completed in (begin, end]).
        begin, end: the incremental range of completion times; begin may be "earliest", end
            defaults to the latest completion.
        incremental_format: "latest_state" (default: each changed key's state as of end, deleted
            keys absent) or "cdc" (one row per changed key: _change_type, before, after).
        include_meta_columns: add _nbcc_commit_time, _nbcc_completion_time, _nbcc_record_key,
            _nbcc_partition and _nbcc_file_group.
        filter: a list of (column, op, value) tuples (all must hold; used to skip partitions,
            buckets and files, see nbcc.expr) or a pyarrow compute expression (applied to rows).
        use_metadata_table: False plans from the timeline alone; by default the metadata table's
            ready partitions are used (same rows, fewer files read to plan).
        columns: the columns to return, in this order (default: all). Only these, the record
            key's, the ordering field and the tuple filters' columns are read from the files (with
            a pyarrow expression filter, which may name any column, every column is read; not
            for cdc).
        """
        plan = self.plan(as_of=as_of, query_type=query_type, begin=begin, end=end,
                         incremental_format=incremental_format, include_meta_columns=include_meta_columns,
                         filter=filter, use_metadata_table=use_metadata_table, columns=columns)
        return read_plan(self.storage, plan)

    def read_batches(self, *, as_of: Any = None, query_type: str | None = None, begin: Any = None,
                     end: Any = None, incremental_format: str | None = None, include_meta_columns: Any = False,
                     filter: Any = None, use_metadata_table: Any = None,
                     columns: Sequence[str] | None = None) -> pa.RecordBatchReader:
        """`read` as a stream of record batches, for tables larger than memory: file group after
        file group, so memory holds about two file groups' merged rows (pieces of them, for file
        groups over the merge budget): the one being taken, and the next, which a thread reads
        meanwhile. `read` holds the whole result. The read is planned now; its files are read as
        the batches are taken. To stop early, drop the reader (pyarrow's `close()` keeps it, and
        the file group read ahead, until then). DuckDB, Polars and pandas consume a
        RecordBatchReader directly (`duckdb.sql("SELECT ... FROM reader")`)."""
        plan = self.plan(as_of=as_of, query_type=query_type, begin=begin, end=end,
                         incremental_format=incremental_format, include_meta_columns=include_meta_columns,
                         filter=filter, use_metadata_table=use_metadata_table, columns=columns)
        return pa.RecordBatchReader.from_batches(plan.output_schema, iter_plan(self.storage, plan, read_ahead=1))

    def restore(self, as_of: Any, *, user_metadata: str | None = None) -> str:
        """Make the table's rows those it had as of `as_of` (as `read(as_of=...)` gives them), in
        one overwrite commit; returns its instant. Nothing is lost: the commits that completed
        after `as_of` stay on the timeline, readable with `as_of` until a clean passes them, and
        writes that complete after the restore merge with its rows as usual. Columns added
        since `as_of` stay in the table, null in the restored rows. Reads one file group at a
        time, so memory holds one file group's rows. `user_metadata`: as `write`'s."""
        if as_of is None or str(as_of).strip() == "":
            raise InvalidOptionError("restore needs the time to restore, as_of (an instant time or ISO-8601)")
        plan = self.plan(as_of=as_of)  # refuses a time before the oldest readable state
        latest = Timeline.load(self.storage).latest_data_commit().completion  # the plan found one
        if plan.options.as_of >= latest:
            raise InvalidOptionError(
                f"as_of={plan.options.as_of}: no commit completed after it (the latest completed at "
                f"{latest}), so a restore would change nothing. Give the completion time of "
                "the last good commit (`nbcc timeline`'s COMPLETION column), or a time before the first bad "
                "one completed")
        groups = (read_task(self.storage, plan, task) for task in plan.tasks)
        # An overwrite to readers; the timeline shows what it restored (Delta's history: RESTORE).
        return self._write(plan.output_schema, groups, UPSERT, "overwrite", STATIC, max_log_file_bytes=None,
                           compaction_delta_commits=None, compaction_inline=False, by_file_group=True,
                           commit_extra={"operation": "restore", "restored_as_of": plan.options.as_of},
                           user_metadata=user_metadata)

    def delete(self, filter: Any, *, user_metadata: str | None = None) -> str | None:
        """Delete the records that match `filter` (as `read`'s: on any columns; SQL's DELETE ...
        WHERE) with one delete commit of their keys; returns its instant, or None if no record
        matches (nothing is written). The records are those of the snapshot this call reads:
        one that a concurrent write makes match afterwards is kept. Deletes carry no ordering
        value, so they win over every version written before them (README: merge modes),
        including that of a concurrent write that began before this delete and completes after
        it, whether or not it still matches. Reads one file group at a time; memory holds one
        file group's matching rows. `user_metadata`: as `write`'s."""
        if filter is None or (isinstance(filter, list) and not filter):
            raise InvalidOptionError("delete needs a filter, e.g. [('status', '=', 'test')]; to delete every row, "
                                     "overwrite the table with no rows")
        keys = list(dict.fromkeys(self.config.record_key + self.config.partition_by))
        plan = self.plan(filter=filter, columns=keys)  # the files' other columns are not read
        groups = (rows for rows in (read_task(self.storage, plan, task) for task in plan.tasks) if rows.num_rows)
        first = next(groups, None)
        if first is None:
            return None
        condition = describe(filter)
        return self._write(first.schema, itertools.chain([first], groups), DELETE, "append", STATIC,
                           max_log_file_bytes=None, compaction_delta_commits=None, compaction_inline=False,
                           by_file_group=True, commit_extra={"condition": condition}, user_metadata=user_metadata)

    def update(self, updates: Mapping[str, Any], filter: Any = None, *,
               user_metadata: str | None = None) -> str | None:
        """Set columns of the records that match `filter` (as `read`'s; None: every record) to
        new values (SQL's UPDATE ... SET ... WHERE, Delta's `update`), with one upsert commit of
        those records; returns its instant, or None if no record matches (nothing is written).
        `updates`: column -> a literal (cast to the column's type) or a pyarrow expression over
        the record's columns (`{"price": pc.field("price") * 1.1}`); record-key and partition
        columns are not set. The records and their new values come from the snapshot this call
        reads; a concurrent write to them is ordered against the update as any two writes are
        (by ordering value, then by instant: README, merge modes), so one that this read did not
        see may be overwritten. Reads one file group at a time. `user_metadata`: as `write`'s."""
        if isinstance(filter, (list, tuple)) and not filter:  # an empty list is more often a bug than "all"
            raise InvalidOptionError("update got an empty filter list; give filter=None to update every record, "
                                     "or conditions, e.g. [('status', '=', 'open')]")
        plan = self.plan(filter=filter)  # lists no data file yet
        exprs = check_updates(updates, plan.schema, self.config)  # before anything is read
        groups = (apply_updates(rows, exprs, self.config) for rows in (read_task(self.storage, plan, task) for task in plan.tasks)
                  if rows.num_rows)
        first = next(groups, None)
        if first is None:
            return None
        extra = {"operation": "update", "updates": describe_updates(exprs),  # recorded as an update
                 **({"condition": describe(filter)} if filter is not None else {})}
        return self._write(first.schema, itertools.chain([first], groups), UPSERT, "append", STATIC,
                           max_log_file_bytes=None, compaction_delta_commits=None, compaction_inline=False,
                           by_file_group=True, commit_extra=extra, user_metadata=user_metadata)

    def schema(self, as_of: Any = None) -> pa.Schema:
        """The schema: the created one plus the columns that completed commits added and the
        types they widened (by `as_of`)."""
        when = parse_time_option(as_of, "as_of") if as_of is not None else None
        return schema_as_of(self.storage, self.config, Timeline.load(self.storage), when,
                            index_of=lambda: self._index(None))

    def timeline(self) -> list[Instant]:
        """Every instant on the timeline, oldest first."""
        return list(Timeline.load(self.storage).instants)

    def history(self, limit: int | None = None) -> list[CommitInfo]:
        """What each completed instant did (operation, rows, files, partitions, parameters),
        latest completion first (Delta's `history()`); with `limit`, the latest `limit` only.
        Archived instants included."""
        return commit_history(self.storage, limit)

    def file_slices(self, as_of: Any = None) -> list[FileSlice]:
        """The latest file slice of every file group, by partition and file group."""
        return self._file_slices(as_of, "as_of")

    def _file_slices(self, as_of: Any, name: str) -> list[FileSlice]:
        """`file_slices`, its errors naming the time `name` (the CLI's flag, say)."""
        when = parse_time_option(as_of, name) if as_of is not None else None
        view = self._view(when, check=name)
        return [slices[0] for _, slices in sorted(slices_by_group(self.storage, view).items())]

    def describe(self) -> dict[str, Any]:
        """The table at a glance (what `nbcc describe` prints): its settings, its columns now,
        its instants counted by action and state, how far back reads may go, what a snapshot
        read opens, and the metadata table's partitions."""
        plan = plan_scan(self.storage, self.config, ReadOptions.build())
        timeline = Timeline.load(self.storage)  # listed after the plan: it knows the plan's commits
        instants: dict[str, dict[str, int]] = {}
        for i in timeline.instants:
            by_state = instants.setdefault(i.action, {})
            by_state[i.state] = by_state.get(i.state, 0) + 1
        data = [i for i in timeline.completed() if i.action in DATA_ACTIONS]
        window = earliest_retained(self.storage, timeline)
        files = [f for task in plan.tasks for f in task.files]
        logs = sum(isinstance(parse_data_file(f.rsplit("/", 1)[-1]), LogFile) for f in files)
        c = self.config
        pending = timeline.pending_compactions()
        # Read afresh: another process's first dynamic partition overwrite may have raised it.
        version = json.loads(self.storage.read_bytes(TABLE_CONFIG_PATH))["format_version"]
        return {
            "uri": self.uri, "format_version": version, "record_key": list(c.record_key),
            "ordering_field": c.ordering_field, "merge_mode": c.merge_mode,
            "partition_by": list(c.partition_by), "buckets": c.buckets,
            "lock_lease_ms": c.lock_lease_ms, "heartbeat_timeout_s": c.heartbeat_timeout_s,
            "columns": [{"name": f.name, "type": str(f.type), "nullable": f.nullable} for f in plan.schema],
            "instants": instants,
            "archived_instants": sum(i.archived for i in timeline.instants),
            "latest_commit": ({"instant": data[-1].instant, "action": data[-1].action,
                               "completion": data[-1].completion} if data else None),
            "pending_compactions": pending,
            # Those another process is executing now (a fresh heartbeat): a compaction job
            # leaves them to it. The others wait for a job (or a writer's inline trigger).
            "compactions_executing": [{"instant": tc, "idle_s": round(idle, 1)} for tc, idle in
                                      executing_compactions(self.storage, pending, c.heartbeat_timeout_s).items()],
            # Writes not completed, with how long since each last beat: past heartbeat_timeout_s,
            # a clean rolls it back (its writer died, or stalled that long).
            "writes_in_flight": [{"instant": i.instant, "action": i.action,
                                  "idle_s": round(idle_ms(self.storage, i.instant) / 1000, 1)}
                                 for i in timeline.pending() if i.action in DATA_ACTIONS],
            # as_of may not be older (but for savepoints' states); None: no commit yet
            "oldest_as_of": oldest_readable(self.storage, timeline),
            "savepoints": savepoint_times(self.storage),
            # an incremental begin may not be older (format.md §12.7); None: any begin, as no
            # clean deleted a commit's changes. "cdc": for reads that need the state at begin
            # (cdc, an overwrite in the range)
            "earliest_begin": _earliest_begins(timeline, window) if data else None,
            "snapshot_read": {"partitions": len({t.partition for t in plan.tasks}), "file_groups": len(plan.tasks),
                              "base_files": len(files) - logs, "log_files": logs,
                              "bytes": sum(t.bytes for t in plan.tasks)},
            "metadata_table": index_state(self.storage)["partitions"],
        }

    def __repr__(self) -> str:
        c = self.config
        return (f"Table({self.uri!r}, record_key={list(c.record_key)}, ordering_field={c.ordering_field!r}, "
                f"partition_by={list(c.partition_by)}, buckets={c.buckets}, merge_mode={c.merge_mode!r})")


def _earliest_begins(timeline: Timeline, window: str | None) -> dict[str, str] | None:
    """describe's earliest incremental begins, for latest_state and for reads that need the
    state at begin; None when any begin is read, as no clean left a data commit before its window."""
    begins = {"latest_state": earliest_begin(timeline, window, False), "cdc": earliest_begin(timeline, window, True)} \
        if window is not None else {}
    if all(b == BEFORE_ALL for b in begins.values()):
        return None
    return {read: EARLIEST if b == BEFORE_ALL else b for read, b in begins.items()}


def _partition_paths(storage: Storage, view: TableView) -> list[str]:
    """The partitions with files in `view` (folder paths), sorted."""
    return sorted({partition for partition, _ in slices_by_group(storage, view)})
