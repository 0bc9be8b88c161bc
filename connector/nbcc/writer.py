"""Writing log files: check and conform incoming batches, split them by (partition, bucket), and
append them to one log file per file group, rolling over to a new version past
`max_log_file_bytes`. One `LogWriter` serves one writer (one token) of one instant: a Spark task,
or the Python API. Committing what it wrote is `commit.py`'s job.
"""

from __future__ import annotations

import datetime as _dt
import decimal
import functools
from dataclasses import dataclass, field
from typing import Any, Iterable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from .buckets import file_group_id
from .config import DEFAULT_MAX_LOG_FILE_BYTES, DELETE, TableConfig
from .errors import SchemaError
from .expr import stat_order, supported_type
from .filenames import data_file_path, log_file_name
from .partitions import NULL_PARTITION, check_partition_values, distinct_partitions, split_rows
from .schema import COMMIT_TIME_COL, IS_DELETED_COL, META_PREFIX, RECORD_KEY_COL, conform, constant_strings, file_schema
from .storage import Storage
from .timeline import rolled_back_error

# Spark hands over 10k-row batches; buffer them so that row groups are big enough to read fast.
ROW_GROUP_ROWS = 256 * 1024
ROW_GROUP_BYTES = 64 * 1024 * 1024
COMPRESSION = "snappy"  # as Spark's own Parquet writer: faster to write and read than zstd
# Rows checked, hashed and split at a time: per-call costs dominate below about 64k rows
# (Table.write of 1M rows in 10k-row batches: 0.29 CPU-s; in 64k-row batches: 0.21).
COALESCE_ROWS = 128 * 1024


_SAMPLE_ROWS = 16 * 1024
_DELTA_MAX_STEP = 2**32


def dictionary_columns(schema: pa.Schema, sample: pa.Table | None) -> list[str]:
    """The columns worth dictionary-encoding: not `_nbcc_record_key` (unique per row), and, given
    a `sample` of the first rows, not a data column whose values there are mostly distinct.
    Parquet falls back to plain encoding only once a dictionary passes 1 MiB, so a log file of
    fewer rows than that (125k-row files of the benchmark: 16 buckets of 2M rows) would pay for
    hashing every value of a unique id or measure column and get a larger file for it; measured
    on those 16 files: 0.67 s with every column's dictionary, 0.33 s without the data columns'."""
    names = [n for n in schema.names if n != RECORD_KEY_COL]
    if sample is None or sample.num_rows == 0:
        return names
    head = sample.slice(0, _SAMPLE_ROWS)
    keep = []
    for name in names:
        if name.startswith(META_PREFIX) or name not in head.column_names:
            keep.append(name)
            continue
        col = head.column(name)
        if pa.types.is_nested(col.type) or pa.types.is_boolean(col.type):
            keep.append(name)
            continue
        if pc.count_distinct(col).as_py() * 2 <= head.num_rows:
            keep.append(name)
    return keep


def _delta_friendly(col: pa.ChunkedArray | pa.Array) -> bool:
    """Whether consecutive values of an integer, timestamp or date column differ by less than
    2**32 (sorted keys, event times, ids of one range): DELTA_BINARY_PACKED then stores a value
    in a few bits. Measured on 62.5k-row files (pyarrow 26, snappy): with steps under 2**24 it
    writes in half the CPU of plain encoding, reads in 0.4-0.5x and takes a third of the bytes;
    with steps of 2**48 and more, plain is 3x cheaper to write (snappy gives up at once)."""
    t = col.type
    if not (pa.types.is_timestamp(t) or pa.types.is_date32(t)
            or (pa.types.is_integer(t) and t != pa.uint64())):
        return False
    as_int = pa.int32() if pa.types.is_date32(t) else pa.int64()
    values = pc.cast(col.drop_null(), as_int).to_numpy().astype(np.float64)  # floats: no overflow
    return len(values) > 1 and float(np.abs(np.diff(values)).max()) < _DELTA_MAX_STEP


def column_encodings(schema: pa.Schema, sample: pa.Table | None) -> tuple[list[str], dict[str, str]]:
    """The columns to dictionary-encode (`dictionary_columns`) and, given a `sample` of the
    first rows, the other integer-like columns to delta-encode (`_delta_friendly`). A writer
    decides once, from the first rows it writes: Parquet cannot change a column's encoding per
    value cheaply, and a writer's rows are of one kind."""
    dictionary = dictionary_columns(schema, sample)
    delta: dict[str, str] = {}
    if sample is not None:
        head = sample.slice(0, _SAMPLE_ROWS)
        for name in schema.names:
            if name not in dictionary and name in head.column_names and _delta_friendly(head.column(name)):
                delta[name] = "DELTA_BINARY_PACKED"
    return dictionary, delta


def parquet_writer(sink: Any, schema: pa.Schema,
                   encodings: tuple[list[str], dict[str, str]] | None = None) -> pq.ParquetWriter:
    """A writer for a log or base file, encoding columns as `column_encodings` decided (default:
    without a sample of rows). nbcc keeps its own statistics (commit metadata), so Parquet's are
    written for the data columns only (for other tools); measured on 2M rows this and no
    dictionary for `_nbcc_record_key` halve the encoding time."""
    dictionary, delta = encodings if encodings is not None else column_encodings(schema, None)
    return pq.ParquetWriter(sink, schema, compression=COMPRESSION, use_dictionary=dictionary,
                            column_encoding=delta or None,
                            write_statistics=[n for n in schema.names if not n.startswith(META_PREFIX)])


def _min_max(col: pa.ChunkedArray | pa.Array) -> tuple[Any, Any]:
    """Least and greatest non-null value (None if none), comparable in Python. A timestamp
    stays an integer of its unit: `as_py()` of a nanosecond value off the microsecond fails
    without pandas, and would round it anyway. `_jsonable` gives its text."""
    if pa.types.is_timestamp(col.type):
        col = col.cast(pa.int64())
    mm = pc.min_max(col)
    return mm["min"].as_py(), mm["max"].as_py()


def _timestamp_text(value: int, t: pa.TimestampType) -> str:
    """`isoformat()` of a timestamp given as an integer of its unit, with 9 fraction digits for a
    nanosecond value off the microsecond (Python's datetime stops at microseconds)."""
    if t.unit != "ns":
        return pa.scalar(value, t).as_py().isoformat()
    micros, nanos = divmod(value, 1000)
    moment = pa.scalar(micros, pa.timestamp("us", t.tz)).as_py()
    if not nanos:
        return moment.isoformat()
    naive = moment.replace(tzinfo=None)
    offset = moment.isoformat()[len(naive.isoformat()):]  # "+00:00" with a time zone, else ""
    return f"{naive.isoformat(timespec='microseconds')}{nanos:03d}{offset}"


def _jsonable(value: Any, t: pa.DataType | None = None) -> Any:
    if t is not None and pa.types.is_timestamp(t) and isinstance(value, int):
        return _timestamp_text(value, t)
    if isinstance(value, (_dt.datetime, _dt.date, _dt.time)):
        return value.isoformat()
    if isinstance(value, (decimal.Decimal, bytes)):
        return str(value)
    return value


def record_key_strings(table: pa.Table, record_key: Sequence[str]) -> pa.ChunkedArray | pa.Array:
    """`_nbcc_record_key`: the key as it is hashed; `f1:v1,f2:v2` for composite keys (Hudi's form)."""
    texts = [pc.cast(table.column(k), pa.string()) for k in record_key]
    if len(texts) == 1:
        return texts[0]
    parts: list[Any] = []
    for i, (name, text) in enumerate(zip(record_key, texts)):
        parts += [pa.scalar(("," if i else "") + f"{name}:"), text]
    return pc.binary_join_element_wise(*parts, "")


def check_values(batch: pa.Table, config: TableConfig, table_schema: pa.Schema, operation: str) -> None:
    """Value checks that the schema cannot express. Raises SchemaError; vectorized."""
    for k in config.record_key:
        nulls = batch.column(k).null_count
        if nulls:
            raise SchemaError(f"record key column {k!r} has {nulls} null value(s); every record needs a key")
    if operation == DELETE:
        return
    live = None
    if IS_DELETED_COL in batch.column_names:
        live = pc.invert(pc.cast(batch.column(IS_DELETED_COL), pa.bool_()).fill_null(False))
    if config.ordering_field:
        col = batch.column(config.ordering_field)
        nulls = col.null_count if live is None else pc.sum(pc.and_(col.is_null(), live)).as_py() or 0
        if nulls:
            raise SchemaError(
                f"ordering_field {config.ordering_field!r} has {nulls} null value(s) in rows to upsert; "
                "fill them (only deletes may leave it null)"
            )
    for f in table_schema:
        if not f.nullable and f.name in batch.column_names and batch.column(f.name).null_count:
            raise SchemaError(f"column {f.name!r} is not nullable but the data has "
                              f"{batch.column(f.name).null_count} null value(s)")


def _check_composite_key_text(data: pa.Table, record_key: Sequence[str]) -> None:
    """A composite key's text `f1:v1,f2:v2` names one key only if no value holds `,<f>:` for a
    field `f` after the first: (`x,f2:y`, `z`) and (`x`, `y,f2:z`) would both read
    `f1:x,f2:y,f2:z`, and reads that select records by that text (incremental and change reads)
    would take one for the other. `data` is in the table's types (plain strings)."""
    for k in record_key:
        col = data.column(k)
        if not (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)):
            continue  # integers and dates have no ',' or ':'
        for name in record_key[1:]:
            bad = pc.sum(pc.match_substring(col, f",{name}:")).as_py()
            if bad:
                raise SchemaError(
                    f"record key column {k!r} has {bad} value(s) containing ',{name}:', which would make "
                    f"the composite record key text ({','.join(f'{n}:<value>' for n in record_key)}) "
                    "name two records; change those values"
                )


def check_rows(table: pa.Table, config: TableConfig, table_schema: pa.Schema, operation: str) -> pa.Table:
    """`table`'s rows checked and converted to the table's columns and types (absent ones null):
    every refusal of a write's rows happens here (SchemaError)."""
    check_values(table, config, table_schema, operation)
    data = conform(table, table_schema)
    _check_nested_nulls(data, table_schema)
    check_partition_values(data, config.partition_by)
    if len(config.record_key) > 1:
        _check_composite_key_text(data, config.record_key)
    return data


def _check_nested_nulls(data: pa.Table, table_schema: pa.Schema) -> None:
    """A null inside a list, struct or map where the table's type allows none: Arrow's cast to
    the file schema would refuse it only while the rows are written."""
    for f in table_schema:
        if pa.types.is_nested(f.type):
            try:
                data.column(f.name).cast(f.type)  # checks the nested fields' nullability
            except pa.ArrowInvalid:
                raise SchemaError(
                    f"column {f.name!r} holds a null inside a value where the table's type {f.type} "
                    "allows none (an element, field or map value marked not null); fill it, or drop those rows"
                ) from None


def prepare(batch: pa.RecordBatch | pa.Table, config: TableConfig, table_schema: pa.Schema,
            operation: str) -> pa.Table:
    """Checked rows in the file schema but `_nbcc_commit_time`: table columns (absent ones null),
    `_nbcc_record_key` and `_nbcc_is_deleted`. Every row's commit time is the instant of the
    `LogWriter` that writes it, which adds the column to each file as it writes it: built and
    reordered by bucket with the rows, its 17-byte strings took about a tenth of a Spark write
    task's Python CPU."""
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    data = check_rows(table, config, table_schema, operation)
    n = table.num_rows
    if operation == DELETE:
        deleted = pa.array(np.ones(n, dtype=bool))
    elif IS_DELETED_COL in table.column_names:
        deleted = pc.cast(table.column(IS_DELETED_COL), pa.bool_()).fill_null(False)
    else:
        deleted = pa.array(np.zeros(n, dtype=bool))
    return (data.append_column(RECORD_KEY_COL, record_key_strings(data, config.record_key))
                .append_column(IS_DELETED_COL, deleted)
                .cast(_prepared_schema(table_schema)))


def partitions_named(batches: Iterable[pa.RecordBatch | pa.Table], config: TableConfig,
                     table_schema: pa.Schema) -> set[str]:
    """The partitions a partition deletion's rows name: their partition columns' values, in the
    table's types (SchemaError if they do not fit); the rows' other columns are ignored."""
    columns = pa.schema([table_schema.field(c) for c in config.partition_by])
    found: set[str] = set()
    for rows in coalesced(batches):
        found |= _partitions_of(conform(rows.select(columns.names), columns), config)
    return found


def _partitions_of(rows: pa.Table, config: TableConfig) -> set[str]:
    for name in config.partition_by:  # a string naming the null folder would delete the null partition
        col = rows.column(name)
        if (pa.types.is_string(col.type) or pa.types.is_large_string(col.type)) \
                and pc.any(pc.equal(col, NULL_PARTITION)).as_py():
            raise SchemaError(f"partition column {name!r} has the value {NULL_PARTITION!r}, the folder name of "
                              "null values; to delete the null partition, give null")
    return distinct_partitions(rows, config.partition_by)


def check_rows_match(rows: pa.Table, partition_by: Sequence[str], condition: pc.Expression, what: Any) -> None:
    """Every row of `rows` (in the table's types) matches replaceWhere's `condition`, or
    SchemaError naming how many do not and one of them."""
    n = rows.num_rows
    if n == 0:
        return
    numbered = rows.select(list(partition_by)).append_column("_row", pa.array(np.arange(n)))
    matched = numbered.filter(condition).column("_row")
    if len(matched) == n:
        return
    bad = np.setdiff1d(np.arange(n), matched.to_numpy())
    example = ", ".join(f"{c}={rows.column(c)[int(bad[0])].as_py()}" for c in partition_by)
    raise SchemaError(f"{len(bad)} row(s) do not match replaceWhere {what!r} (one has {example}): it replaces "
                      "only the partitions that match it, so every row written must; filter the data with the "
                      "same condition")


def _prepared_schema(table_schema: pa.Schema) -> pa.Schema:
    schema = file_schema(table_schema)
    return schema.remove(schema.get_field_index(COMMIT_TIME_COL))


MAX_STAT_STRING = 256  # longer strings get no min/max (a truncated max would be wrong)


def update_stats(stats: dict[str, dict[str, Any]], chunk: pa.Table, columns: Sequence[str]) -> None:
    """Per column: min and max of the non-null values, and the null count, for skipping files.
    `min`/`max` are None when every value is null; absent when not known (long strings)."""
    for name in columns:
        col = chunk.column(name)
        # A timestamp as an integer of its unit (exact, and ordered as its values are); a
        # decimal as its text, ordered as a number (`stat_order`).
        lo, hi = (v if pa.types.is_timestamp(col.type) else _jsonable(v) for v in _min_max(col))
        cur = stats.setdefault(name, {"min": None, "max": None, "nulls": 0})
        cur["nulls"] += col.null_count
        if "min" not in cur:
            continue
        if isinstance(hi, str) and (len(hi) > MAX_STAT_STRING or len(lo) > MAX_STAT_STRING):
            del cur["min"], cur["max"]
            continue
        if lo is not None:
            order = stat_order(col.type)
            cur["min"] = lo if cur["min"] is None else min(cur["min"], lo, key=order)
            cur["max"] = hi if cur["max"] is None else max(cur["max"], hi, key=order)


def coalesced(batches: Iterable[pa.RecordBatch], rows: int = COALESCE_ROWS) -> Iterator[pa.Table]:
    """`batches` regrouped in tables of about `rows` rows (no copy); empty batches are dropped.
    Spark hands over batches of spark.sql.execution.arrow.maxRecordsPerBatch rows (10k by
    default), a Parquet reader one batch per row group."""
    pending: list[pa.RecordBatch] = []
    count = 0
    for batch in batches:
        if batch.num_rows:
            pending.append(batch)
            count += batch.num_rows
        if count >= rows:
            yield pa.Table.from_batches(pending)
            pending, count = [], 0
    if pending:
        yield pa.Table.from_batches(pending)


@dataclass
class _OpenLog:
    partition: str
    file_group: str
    version: int
    pending: list[pa.Table] = field(default_factory=list)
    pending_rows: int = 0
    pending_bytes: int = 0
    sink: Any = None
    writer: pq.ParquetWriter | None = None
    name: str = ""
    rows: int = 0
    ordering: list[tuple[Any, Any]] = field(default_factory=list)
    stats: dict[str, dict[str, Any]] = field(default_factory=dict)


def _told_if_rolled_back(method: Any) -> Any:
    """A LogWriter method whose OSError, when a rollback of the instant deleted its files
    meanwhile (a cleaner took the write for dead), is raised as the CommitError its commit would
    get, saying so, rather than as a file that vanished."""
    @functools.wraps(method)
    def wrapper(self: "LogWriter", *args: Any, **kwargs: Any) -> Any:
        try:
            return method(self, *args, **kwargs)
        except OSError as failure:
            stopped = rolled_back_error(self.storage, self.instant)
            if stopped is None:
                raise
            raise stopped from failure
    return wrapper


class LogWriter:
    """Appends prepared rows to the log files of one (instant, token)."""

    def __init__(self, storage: Storage, config: TableConfig, table_schema: pa.Schema, instant: str,
                 token: str, max_log_file_bytes: int | None = None):
        self.storage = storage
        self.config = config
        self.schema = file_schema(table_schema)
        self.instant = instant
        self.token = token
        self.max_bytes = int(max_log_file_bytes or DEFAULT_MAX_LOG_FILE_BYTES)
        self.row_group_bytes = min(ROW_GROUP_BYTES, max(self.max_bytes // 4, 1))
        self._open: dict[tuple[str, int], _OpenLog] = {}
        self.stats_columns = [f.name for f in table_schema if supported_type(f.type)]
        self.files: list[dict[str, Any]] = []
        self._unsynced: list[str] = []  # closed files not yet made durable
        self._encodings: tuple[list[str], dict[str, str]] | None = None

    @_told_if_rolled_back
    def write(self, rows: pa.Table) -> None:
        """Append rows as `prepare` returns them; `_flush` adds this instant's commit time."""
        # One estimate per call: `nbytes` of a slice costs about 14 us, paid per bucket and piece.
        row_bytes = rows.nbytes / max(rows.num_rows, 1)
        for partition, bucket, group in split_rows(rows, self.config.partition_by, self.config.record_key,
                                                   self.config.buckets):
            log = self._open.get((partition, bucket))
            if log is None:
                log = self._open[(partition, bucket)] = _OpenLog(partition, file_group_id(bucket), 1)
            # Append in pieces of at most one row group, so that rollover is checked often
            # enough for a file to stay within max_log_file_bytes (give or take a row group).
            step = max(1, min(ROW_GROUP_ROWS, int(self.row_group_bytes // max(row_bytes, 1))))
            for start in range(0, group.num_rows, step):
                piece = group.slice(start, step)
                log.pending.append(piece)
                log.pending_rows += piece.num_rows
                log.pending_bytes += int(piece.num_rows * row_bytes)
                if log.pending_rows >= ROW_GROUP_ROWS or log.pending_bytes >= self.row_group_bytes:
                    self._flush(log)

    def _flush(self, log: _OpenLog) -> None:
        if not log.pending:
            return
        chunk = pa.concat_tables(log.pending)
        chunk = chunk.add_column(self.schema.get_field_index(COMMIT_TIME_COL), self.schema.field(COMMIT_TIME_COL),
                                 constant_strings(self.instant, chunk.num_rows))
        log.pending, log.pending_rows, log.pending_bytes = [], 0, 0
        if log.writer is None:
            log.name = log_file_name(log.file_group, self.instant, log.version, self.token)
            path = data_file_path(log.partition, log.name)
            log.sink = self.storage.open_write(path)
            if self._encodings is None:  # decided once: every bucket gets rows of one kind
                self._encodings = column_encodings(self.schema, chunk)
            log.writer = parquet_writer(log.sink, self.schema, self._encodings)
        log.writer.write_table(chunk, row_group_size=max(chunk.num_rows, 1))
        log.rows += chunk.num_rows
        if self.config.ordering_field:
            log.ordering.append(_min_max(chunk.column(self.config.ordering_field)))
        update_stats(log.stats, chunk, self.stats_columns)
        if log.sink.tell() >= self.max_bytes:
            self._close_file(log)
            # Durable now: a write error of a file left closed for long can be lost by the time
            # of a late fsync. The files still open at close() are synced there, together.
            self._make_durable()
            log.version += 1

    def _close_file(self, log: _OpenLog) -> None:
        if log.writer is None:
            return
        log.writer.close()
        size = log.sink.tell()
        log.sink.close()
        self._unsynced.append(data_file_path(log.partition, log.name))
        info: dict[str, Any] = {
            "partition": log.partition,
            "file_group": log.file_group,
            "name": log.name,
            "rows": log.rows,
            "bytes": size,
        }
        values = [v for pair in log.ordering for v in pair if v is not None]
        if values:
            t = self.schema.field(self.config.ordering_field).type
            info["ordering_min"] = _jsonable(min(values), t)
            info["ordering_max"] = _jsonable(max(values), t)
        info["stats"] = log.stats
        self.files.append(info)
        log.writer, log.sink, log.rows, log.ordering, log.stats = None, None, 0, [], {}

    def _make_durable(self) -> None:
        """fsync the files closed since the last call (local disk), before a commit names them."""
        self.storage.make_durable(self._unsynced)
        self._unsynced = []

    @_told_if_rolled_back
    def close_open_files(self) -> None:
        """Flush and close the files open now, for a caller that writes one file group at a
        time (memory then holds one file group's rows); a later row of such a file group goes
        to its next version."""
        try:
            for log in self._open.values():
                self._flush(log)
                if log.writer is not None:
                    self._close_file(log)
                    log.version += 1
            self._make_durable()  # as at a rollover: a file closed for long is synced at once
        except BaseException:
            self.abort()
            raise

    @_told_if_rolled_back
    def close(self) -> list[dict[str, Any]]:
        """Flush and close every file; returns what was written (for the commit metadata)."""
        try:
            for log in self._open.values():
                self._flush(log)
                self._close_file(log)
            self._make_durable()
        except BaseException:
            self.abort()
            raise
        self._open.clear()
        return self.files

    def abort(self) -> None:
        """Drop every file still open: the write failed. On S3 an open file would otherwise be
        uploaded whenever it is closed, even by the garbage collector after a rollback. Each
        Parquet writer is closed here too, into its aborted file (which drops what it gets):
        left to the garbage collector, its close would fail on the closed file and print
        'Exception ignored ... stays pending until it is rolled back' after the rollback."""
        for log in self._open.values():
            if log.sink is not None:
                try:
                    log.sink.abort()
                except Exception:  # noqa: BLE001 - the write's own failure is what matters
                    pass
            if log.writer is not None:
                try:
                    log.writer.close()
                except Exception:  # noqa: BLE001 - as above
                    pass
                log.writer = None
        self._open.clear()
