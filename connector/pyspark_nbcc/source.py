"""The Spark data source `nbcc`: a thin adapter from Spark's Python data source API to the core.

Spark runs every method here in a Python worker, never in the driver's own process: `schema`,
`writer` in a driver-side worker, `partitions` in a planning worker, `read`/`write` in executor
workers, `commit`/`abort` in another worker with the writer as pickled at planning. So every
object here is plain data that pickles, and each step reopens what it needs from storage.
"""

from __future__ import annotations

import datetime
import decimal
import logging
import re
import sys
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable, Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    EqualNullSafe,
    EqualTo,
    Filter,
    GreaterThan,
    GreaterThanOrEqual,
    In,
    InputPartition,
    IsNotNull,
    IsNull,
    LessThan,
    LessThanOrEqual,
    Not,
    StringContains,
    StringEndsWith,
    StringStartsWith,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema, from_arrow_type, to_arrow_schema
from pyspark.sql.types import ArrayType, DataType, MapType, NumericType, StructField, StructType, VariantType

from nbcc import Table
from nbcc.table import ReplaceWhere
from nbcc.commit import WriteTransaction
from nbcc.compaction import maybe_compact
from nbcc.config import (
    DELETE_PARTITION,
    PARTITION_OVERWRITE_MODE,
    READ_OPTIONS,
    REPLACE_WHERE,
    USER_METADATA,
    STATIC,
    TYPE_WIDENING,
    STREAM_READ_OPTIONS,
    WRITE_OPTIONS,
    TableConfig,
    check_overwrite_options,
    check_partition_overwrite_mode,
    check_write_operation,
    parse_options,
    parse_table_options,
)
from nbcc.conditions import parse_replace_where
from nbcc.errors import InvalidOptionError, NbccError, SchemaError, TableNotFoundError
from nbcc.expr import Predicate, check_value, supported_type
from nbcc.filenames import make_token
from nbcc.heartbeat import Heartbeat, interval_s
from nbcc.scan import (
    DEFAULT_MAX_PARTITION_BYTES,
    INCREMENTAL,
    META_OUTPUT_FIELDS,
    ReadOptions,
    ScanPlan,
    ScanTask,
    pack_tasks,
    plan_scan,
    read_schema,
    iter_task,
)
from nbcc.schema import null_array, nullable_schema, widened_type
from nbcc.storage import Storage
from nbcc.writer import LogWriter, coalesced, partitions_named, prepare

log = logging.getLogger(__name__)


# Spark hands a Python data source no options at all when it reads or writes a catalog table
# (CREATE TABLE ... USING nbcc, saveAsTable): not even its location. It adds its own (provider,
# owner, location) when such a table is created without a schema.
_SQL_HINT = ("in SQL, name a table with CREATE TEMPORARY VIEW <name> USING nbcc OPTIONS (path '<uri>'); "
             "an nbcc table cannot be a catalog table (CREATE TABLE ... USING nbcc, saveAsTable, toTable), as "
             "Spark passes a Python data source no location or options when it reads or writes one")


def _table_uri(options: dict[str, Any]) -> str:
    """The table's URI; called before the options are parsed, so a catalog table gets this error
    rather than one about options Spark added."""
    if "provider" in {str(k).strip().lower() for k in options}:
        raise InvalidOptionError(f"no table path Spark can pass on: {_SQL_HINT}")
    path = options.get("path")
    if not path:
        if options.get("paths") not in (None, "[]"):
            raise InvalidOptionError("nbcc reads one table at a time: pass a single path to load()")
        raise InvalidOptionError(f"no table path: use .load(uri) / .save(uri) or .option('path', uri); {_SQL_HINT}")
    return str(path)


# Spark has no unsigned integers: its own Parquet reader widens UINT_8/16/32 to the next signed
# type and UINT_64 to DECIMAL(20, 0), which hold every value. nbcc reads them the same way.
_UNSIGNED_AS = {8: pa.int16(), 16: pa.int32(), 32: pa.int64(), 64: pa.decimal128(20, 0)}


def _spark_readable(t: pa.DataType) -> pa.DataType:
    """`t` with its unsigned integers, at any depth, widened as `_UNSIGNED_AS` says; `t` itself
    when it has none."""
    if pa.types.is_unsigned_integer(t):
        return _UNSIGNED_AS[t.bit_width]
    if pa.types.is_struct(t):
        fields = [t.field(i) for i in range(t.num_fields)]
        new = [f.with_type(_spark_readable(f.type)) for f in fields]
        return t if new == fields else pa.struct(new)
    if pa.types.is_map(t):
        key, item = _spark_readable(t.key_type), _spark_readable(t.item_type)
        if key == t.key_type and item == t.item_type:
            return t
        return pa.map_(t.key_field.with_type(key), t.item_field.with_type(item), keys_sorted=t.keys_sorted)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        value = _spark_readable(t.value_type)
        if value == t.value_type:
            return t
        item = t.value_field.with_type(value)
        if pa.types.is_large_list(t):
            return pa.large_list(item)
        return pa.list_(item, t.list_size) if pa.types.is_fixed_size_list(t) else pa.list_(item)
    return t


def _spark_schema(arrow_schema: pa.Schema) -> StructType:
    arrow_schema = pa.schema([f.with_type(_spark_readable(f.type)) for f in arrow_schema])
    try:
        return from_arrow_schema(arrow_schema)
    except Exception:  # noqa: BLE001 - PySpark's message does not say which column
        pass
    for f in arrow_schema:
        try:
            from_arrow_schema(pa.schema([f]))
        except Exception as exc:  # noqa: BLE001
            raise SchemaError(f"column {f.name!r} has type {f.type}, which Spark cannot read ({exc}); "
                              "read it with the Python API (nbcc.Table.read)") from None
    return from_arrow_schema(arrow_schema)


def _sub_microsecond(t: pa.DataType) -> bool:
    """Whether `t` holds nanosecond times, at any depth (Polars writes list[datetime[ns]])."""
    if pa.types.is_timestamp(t) or pa.types.is_duration(t):
        return t.unit == "ns"
    if pa.types.is_struct(t):
        return any(_sub_microsecond(t.field(i).type) for i in range(t.num_fields))
    if pa.types.is_map(t):
        return _sub_microsecond(t.key_type) or _sub_microsecond(t.item_type)
    if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        return _sub_microsecond(t.value_type)
    return False


def to_spark_rows(rows: pa.Table, schema: pa.Schema) -> pa.Table:
    """`rows` in the schema Spark took for the read. Spark checks the first batch's schema
    exactly (nullability, timestamp[us, tz=UTC]): a column added since Spark took the schema is
    left out, and one the rows lack (added after the state they were read as of, in a stream's
    micro-batch) reads as null, as §4.2 says for older files. Nanoseconds are cut to the
    microseconds Spark keeps, as Spark's own sources do; unsigned integers widen to the types
    `_spark_schema` gave them (only columns whose type differs are cast, nested ones too)."""
    columns = []
    for f in schema:
        if f.name not in rows.column_names:
            if not f.nullable:  # columns added later are nullable: a missing key is a bug
                raise SchemaError(f"the rows read lack the non-nullable column {f.name!r}")
            columns.append(null_array(rows.num_rows, f.type))
            continue
        col = rows.column(f.name)
        if pa.types.is_struct(col.type) and pa.types.is_struct(f.type) and \
                [c.name for c in col.type] != [c.name for c in f.type]:
            col = _struct_fields_as(col, f.type)
        if col.type != f.type:
            try:
                col = col.cast(f.type, safe=not _sub_microsecond(col.type))
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
                raise SchemaError(f"column {f.name!r} ({col.type}) cannot be read as Spark's {f.type}: {exc}") from None
        columns.append(col)
    return pa.Table.from_arrays(columns, schema=schema)


def _struct_fields_as(col: pa.ChunkedArray, target: pa.StructType) -> pa.ChunkedArray:
    """A struct column with the fields of `target`, by name: a cdc read's `before`/`after` as
    of a time before table columns were added lacks them, and they read as null (Arrow before
    19 cannot cast a struct to one with other fields); fields `target` lacks are left out."""
    chunks = []
    for chunk in col.chunks:
        have = {f.name: i for i, f in enumerate(chunk.type)}
        children = [chunk.field(have[f.name]) if f.name in have else null_array(len(chunk), f.type) for f in target]
        chunks.append(pa.StructArray.from_arrays(children, names=[f.name for f in target],
                                                 mask=chunk.is_null() if chunk.null_count else None))
    return pa.chunked_array(chunks) if chunks else pa.chunked_array([], target)


def loaded_columns(schema: StructType, options: ReadOptions, follows_table: bool) -> StructType | None:
    """The table's columns as a query took them when its DataFrame was loaded (a cdc query's are
    in `after`); None for a query given its columns with .schema(...)."""
    if not follows_table:
        return None
    return schema["after"].dataType if options.is_cdc else schema


def widened_since_loaded(table_schema: pa.Schema, columns: StructType) -> list[str]:
    """The columns, of those a DataFrame took from the table when it was loaded, whose type a
    commit widened since (format.md §4.2), each as `name (old -> new)`. Read as the old type,
    their values would be cast down: a long that overflows an int fails the read, and a double
    read as a float loses digits silently."""
    changed = []
    for f in columns.fields:
        if f.name in table_schema.names:
            now = _spark_schema(pa.schema([table_schema.field(f.name)])).fields[0].dataType
            if isinstance(now, NumericType) and isinstance(f.dataType, NumericType) and now != f.dataType:
                # Only wider: a stream's micro-batch of commits from before a widening has the
                # narrower types, which read as the DataFrame's wider ones.
                loaded, wider = to_arrow_schema(StructType([f, StructField(f.name, now)])).types
                if widened_type(loaded, wider) is not None:
                    changed.append(f"{f.name} ({f.dataType.simpleString()} -> {now.simpleString()})")
    return changed


def _check_given_schema(given: StructType, own: StructType, current: list[str]) -> None:
    """A schema given with `.schema(...)` may leave columns out, but every column it names must be
    one the read has (or the table has now: as of an older time, a later column reads as null),
    spelled as the table spells it: a misspelt column would read as null in every row, silently.
    Each column it types must have the read's type or, for a number, another numeric type (as
    Spark's Parquet source reads an int as a bigint or a double; README: a widened column read at
    its old type), which the reader casts, checked. Any other type would change values silently
    (numbers read as text, text as numbers), where Spark's Parquet source fails the read."""
    names = set(own.fieldNames()) | set(current)
    by_case = {n.lower(): n for n in names}
    types = {f.name: f.dataType for f in own.fields}
    for f in given.fields:
        name = f.name
        if name in names:
            if name in types and not _reads_as(types[name], f.dataType):
                have, asked = types[name].simpleString(), f.dataType.simpleString()
                wider = " (or another numeric type)" if isinstance(types[name], NumericType) else ""
                raise SchemaError(f"the schema given with .schema(...) reads column {name!r} as {asked}, but the "
                                  f"table's {name!r} is {have}; give {have}{wider}, or leave .schema(...) out "
                                  f"to read the table's own schema (cast after reading to get {asked})")
            continue
        if name.lower() in by_case:
            raise SchemaError(f"the schema given with .schema(...) names column {name!r}, which the table "
                              f"spells {by_case[name.lower()]!r}; use that spelling")
        raise SchemaError(f"the schema given with .schema(...) names column {name!r}, which this read does "
                          f"not have (its columns: {', '.join(own.fieldNames())}); correct it, or leave "
                          ".schema(...) out to read the table's own schema")


def _reads_as(have: DataType, asked: DataType) -> bool:
    """Whether a column of Spark type `have` may be read as `asked`: the same type (nested
    fields' nullability aside), or, for a number, any numeric type, which the reader casts to
    (checked: a value that does not fit, or would lose digits as an integer, fails the read)."""
    return have.simpleString() == asked.simpleString() or \
        isinstance(have, NumericType) and isinstance(asked, NumericType)


class DefaultSource(DataSource):
    """`spark.read.format("nbcc").load(uri)` and `df.write.format("nbcc").save(uri)`."""

    @classmethod
    def name(cls) -> str:
        return "nbcc"

    def _read_setup(self) -> tuple[Table, ReadOptions, int]:
        uri = _table_uri(self.options)
        read_options, storage_options = parse_options(self.options, READ_OPTIONS, "read")
        max_bytes = read_options.pop("max_partition_bytes", DEFAULT_MAX_PARTITION_BYTES)
        return Table.open(uri, storage_options), ReadOptions.build(**read_options), max_bytes

    def schema(self) -> StructType:
        _table_uri(self.options)  # the same complaint for a batch read and a stream
        try:
            table, options, _ = self._read_setup()
        except InvalidOptionError as batch_error:
            # schema() serves readStream too, whose options differ; the reader Spark asks for
            # next (reader() or streamReader()) checks its own options strictly.
            from .streaming import stream_read_schema
            try:
                self._own_schema = stream_read_schema(self.options)
                return self._own_schema
            except InvalidOptionError as stream_error:
                # Spark has not said yet which read this is: guess from the option names, and give
                # only that read's complaint. Given an option only one of them knows (as_of,
                # query_type, ... for a batch read; max_commits_per_trigger, ... for a stream),
                # the user meant that one; `begin` or `incremental_format` without query_type means
                # a stream too, as a batch read takes them only with query_type=incremental. Both complaints only when
                # the names do not tell (a typo, or options of both).
                names = {k.strip().lower() for k in self.options}
                batch_only = names & (set(READ_OPTIONS) - set(STREAM_READ_OPTIONS))
                stream_only = names & (set(STREAM_READ_OPTIONS) - set(READ_OPTIONS))
                if not batch_only:
                    stream_only |= names & {"begin", "incremental_format"}
                if str(stream_error) == str(batch_error) or (batch_only and not stream_only):
                    if batch_only & {"query_type", "incremental_format", "end"}:  # a change feed, maybe for a stream
                        from .streaming import STREAM_CHANGES_HINT
                        raise InvalidOptionError(f"{batch_error} (with spark.readStream: {STREAM_CHANGES_HINT})") from None
                    raise batch_error from None
                if stream_only and not batch_only:
                    raise stream_error from None
                raise InvalidOptionError(f"{batch_error}; as spark.readStream: {stream_error}") from None
        self._table_schema = read_schema(table.storage, table.config, options)
        self._own_schema = _spark_schema(self._table_schema)
        return self._own_schema  # pickled with the source: reader() knows Spark took it from here

    def reader(self, schema: StructType) -> "NbccReader":
        table, options, max_bytes = self._read_setup()
        follows_table = schema == getattr(self, "_own_schema", None)
        table_schema = getattr(self, "_table_schema", None)
        if not follows_table:  # given with .schema(...)
            table_schema = read_schema(table.storage, table.config, options)
            _check_given_schema(schema, _spark_schema(table_schema),
                                [] if options.is_cdc else table.schema().names)  # cdc: columns in before/after
        if not _pushdown_enabled():
            return NbccReader(table.uri, table.storage.storage_options, schema, options, max_bytes, follows_table)
        return NbccPushdownReader(table.uri, table.storage.storage_options, schema, options, max_bytes, follows_table,
                                  table_schema)

    def writer(self, schema: StructType, overwrite: bool) -> "NbccWriter":
        uri = _table_uri(self.options)
        options, storage_options = parse_options(self.options, WRITE_OPTIONS, "write")
        partition_overwrite_mode = options.pop(PARTITION_OVERWRITE_MODE, STATIC)
        replace_where = options.pop(REPLACE_WHERE, None)
        user_metadata = options.pop(USER_METADATA, None)
        type_widening = options.pop(TYPE_WIDENING, False)
        check_overwrite_options(replace_where, overwrite, check_partition_overwrite_mode(partition_overwrite_mode))
        if replace_where is not None:
            parse_replace_where(replace_where)  # its syntax, before a first write creates the table
        with spark_type_names(uri, storage_options, schema):
            table, arrow_schema, operation, max_bytes, trigger = open_for_write(
                uri, options, storage_options, schema, overwrite)
            replace = table.replace_filter(replace_where) if replace_where is not None else None
            # A partition deletion writes no file: its instant begins at commit, once its rows have
            # named partitions (none named: nothing is committed, the format version stays).
            start = table.prepare_write if operation == DELETE_PARTITION else table.begin_write
            txn = start(arrow_schema, operation, overwrite=overwrite, partition_overwrite_mode=partition_overwrite_mode,
                        replace_where=replace, user_metadata=user_metadata, type_widening=type_widening)
        return NbccWriter(table.storage, table.config, txn, max_bytes, trigger, replace)

    def streamWriter(self, schema: StructType, overwrite: bool):
        """`df.writeStream.format("nbcc").start(uri)`: one commit per micro-batch (streaming.py)."""
        from .streaming import stream_writer
        return stream_writer(self.options, schema, overwrite)

    def streamReader(self, schema: StructType):
        """`spark.readStream.format("nbcc").load(uri)`: offsets are completion times (streaming.py)."""
        from .streaming import RefusedStreamReader, stream_reader
        try:
            return stream_reader(self.options, schema, getattr(self, "_own_schema", None))
        except NbccError as exc:  # what is wrong, raised at Spark's first call (RefusedStreamReader)
            return RefusedStreamReader(exc)


@contextmanager
def spark_type_names(uri: str, storage_options: dict[str, Any], data: StructType) -> Iterator[None]:
    """A write's schema errors, which name Arrow types (the core's), with the columns they name
    also in Spark's types and the cast that fits, for the Spark user who never saw the Arrow ones."""
    try:
        yield
    except SchemaError as exc:
        raise SchemaError(f"{exc}{_in_spark_terms(str(exc), uri, storage_options, data)}") from None


def _in_spark_terms(message: str, uri: str, storage_options: dict[str, Any], data: StructType) -> str:
    try:
        table = Table.open(uri, storage_options).schema()
    except NbccError:
        table = None  # a first write: no table yet

    def spark_type(name: str) -> str | None:
        if table is None or name not in table.names:
            return None
        try:
            return from_arrow_type(table.field(name).type).simpleString()
        except Exception:  # noqa: BLE001 - a type Spark has no name for: say nothing of it
            return None

    said = []
    for name in dict.fromkeys(re.findall(r"column '([^']+)'", message)):
        ours = data[name].dataType.simpleString() if name in data.fieldNames() else None
        theirs = spark_type(name)
        if ours == "void":
            said.append(f"`{name}` is void (untyped nulls): give it a type, e.g. cast(null AS {theirs or 'string'})")
        elif ours and theirs and ours != theirs:
            said.append(f"`{name}` is {ours} in the data and {theirs} in the table: cast(`{name}` AS {theirs})")
    return f" (in Spark's types: {'; '.join(said)})" if said else ""


def _check_no_variant(schema: StructType) -> None:
    """Spark's VARIANT reaches Python as a struct of two binaries: stored as such, it would read
    back as that struct, not as a VARIANT."""
    found: list[str] = []

    def walk(t: DataType, path: str) -> None:
        if isinstance(t, VariantType):
            found.append(path)
        elif isinstance(t, StructType):
            for f in t.fields:
                walk(f.dataType, f"{path}.{f.name}" if path else f.name)
        elif isinstance(t, ArrayType):
            walk(t.elementType, f"{path}[]")
        elif isinstance(t, MapType):
            walk(t.keyType, f"{path}{{key}}")
            walk(t.valueType, f"{path}{{value}}")
    walk(schema, "")
    if found:
        raise SchemaError(f"column(s) {', '.join(found)} have Spark's VARIANT type, which nbcc cannot store (it "
                          "would read back as a struct of two binaries); store JSON text instead with "
                          "to_json(col), and read it back with parse_json(col)")


def open_for_write(uri: str, options: dict[str, Any], storage_options: dict[str, Any], schema: StructType,
                   overwrite: bool) -> tuple[Table, pa.Schema, str, int | None, tuple[int | None, bool]]:
    """The table a batch or streaming write goes to (a first write creates it from the table
    options left in `options`), and the write's own options: (table, the data's Arrow schema,
    operation, max_log_file_bytes, compaction trigger)."""
    # Nullable at every depth, for the columns a first write creates and those a later one adds
    # alike: Spark marks literals, array(...) elements and VARIANT's fields not null by accident.
    operation = options.pop("operation", "upsert")
    if operation not in ("delete", DELETE_PARTITION):  # deletes ignore the columns the table lacks
        _check_no_variant(schema)
    arrow_schema = nullable_schema(to_arrow_schema(schema, timezone="UTC"))
    max_bytes = options.pop("max_log_file_bytes", None)
    trigger = (options.pop("compaction_delta_commits", None), options.pop("compaction_inline", False))
    check_write_operation(operation, overwrite)  # before a first write creates the table
    if operation == DELETE_PARTITION:  # never creates a table: it has no rows to hold
        try:
            table = Table.open(uri, storage_options)
        except TableNotFoundError as exc:
            raise TableNotFoundError(f"operation=delete_partition: {exc.args[0].split(';')[0]}, so it has no "
                                     "partitions to delete") from None
        table.config.check_options(parse_table_options(options))
    else:
        table = Table.open_or_create(uri, arrow_schema, storage_options, **options)
    return table, arrow_schema, operation, max_bytes, trigger


def _pushdown_enabled() -> bool:
    """Is spark.sql.python.filterPushdown.enabled on for this read?

    Spark (4.1-4.3) fails a read whose reader implements pushFilters while the conf is off, and
    does not tell the source which it is. The planning worker that calls `reader()` holds the
    flag in a local variable (`enable_pushdown`), and the worker that pushes filters is its own
    module; look for either up the stack. If Spark changes this, reads fall back to no pushdown:
    the results are the same, only slower."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename.endswith("data_source_pushdown_filters.py"):
            return True
        flag = frame.f_locals.get("enable_pushdown")
        if isinstance(flag, bool):
            return flag
        frame = frame.f_back
    return False


# -- reading -----------------------------------------------------------------------------------

class TaskPartition(InputPartition):
    """Read tasks (file groups) with what reading them needs: read() runs on an executor from
    a copy of the reader pickled before partitions() was called, so nothing planned reaches it
    except through the partition."""

    def __init__(self, plan: ScanPlan, tasks: list[ScanTask]):
        super().__init__(f"{tasks[0].partition}/{tasks[0].file_group_id}+{len(tasks) - 1}")
        self.plan = plan
        self.tasks = tasks


class NbccReader(DataSourceReader):
    def __init__(self, uri: str, storage_options: dict[str, Any], schema: StructType, options: ReadOptions,
                 max_partition_bytes: int = DEFAULT_MAX_PARTITION_BYTES, follows_table: bool = False):
        self.uri = uri
        self.storage_options = storage_options
        self.options = options
        self.max_partition_bytes = max_partition_bytes
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        # The query's columns are those Spark took from the table at load (no .schema(...)).
        self.columns = loaded_columns(schema, options, follows_table)

    def partitions(self) -> list[InputPartition]:
        table = Table.open(self.uri, self.storage_options)
        plan = plan_scan(table.storage, table.config, self.options)
        widened = widened_since_loaded(plan.schema, self.columns) if self.columns is not None else []
        if widened:
            raise SchemaError(
                f"the table widened column(s) {', '.join(widened)} since this DataFrame was loaded, and "
                "reading them as the old type could lose digits or overflow; load the DataFrame again "
                "(spark.read...load()) to read the table's types")
        shared = replace(plan, tasks=[])
        return [TaskPartition(shared, group) for group in pack_tasks(plan.tasks, self.max_partition_bytes)]

    def read(self, partition: InputPartition,
             convert: Callable[[ScanPlan, pa.Table], pa.Table] | None = None) -> Iterator[pa.RecordBatch]:
        """The partition's rows; `convert` (plan, rows) -> rows: a stream's, before Spark's types."""
        if not isinstance(partition, TaskPartition):
            return  # Spark's placeholder partition for an empty plan
        storage = Storage(self.uri, self.storage_options)
        for task in partition.tasks:
            for rows in iter_task(storage, partition.plan, task):
                rows = convert(partition.plan, rows) if convert else rows
                yield from to_spark_rows(rows, self.arrow_schema).to_batches(max_chunksize=64 * 1024)


class NbccPushdownReader(NbccReader):
    """The reader when filter pushdown is on: filters become predicates that prune partitions,
    buckets and files and are applied exactly; the others go back to Spark."""

    def __init__(self, uri: str, storage_options: dict[str, Any], schema: StructType, options: ReadOptions,
                 max_partition_bytes: int, follows_table: bool, table_schema: pa.Schema):
        super().__init__(uri, storage_options, schema, options, max_partition_bytes, follows_table)
        # The columns' own types, which statistics are recorded in: Spark's have timestamps in
        # microseconds and no unsigned integers.
        self.table_schema = table_schema

    def pushFilters(self, filters: list[Filter]) -> Iterable[Filter]:
        if self.options.query_type == INCREMENTAL and self.options.is_cdc:
            yield from filters
            return
        data_columns = set(self.arrow_schema.names) - {f.name for f in META_OUTPUT_FIELDS}
        accepted = []
        for f in filters:
            pred = to_predicate(f, self.table_schema, data_columns)
            if pred is None:
                yield f
            else:
                accepted.append(pred)
        self.options = replace(self.options, predicates=self.options.predicates + tuple(accepted))


# Spark hands filter values to a Python data source as Python dates through the hybrid
# Julian/Gregorian calendar, which lacks the ten days 1582-10-05..14: each of them arrives as
# 1582-10-15. Taken as that date, `d = DATE '1582-10-10'` matched 1582-10-15's rows, and `<`
# and `>` were off by those days.
_GAP_DATE = datetime.date(1582, 10, 15)
# TIMESTAMP values go through that calendar too: those in the skipped days arrive on 1582-10-15.
# Before 1900 time zones kept local mean time, which that conversion may also take otherwise than
# Spark (TIMESTAMP_NTZ values arrive exact).
_SAFE_TIMESTAMPS_FROM = datetime.datetime(1900, 1, 1, tzinfo=datetime.timezone.utc)
# PySpark makes a pushed DECIMAL value in Python's default decimal context, which rounds it to 28
# digits: one of 28 or more may be another number than the query's.
_EXACT_DECIMAL_DIGITS = 28


def _maybe_altered(t: pa.DataType, values: Iterable[Any]) -> bool:
    """May Spark's hand-over have made one of a filter's `values` on a column of type `t`
    another value than the query's? Such a filter is left to Spark."""
    if pa.types.is_date(t):
        return _GAP_DATE in values
    if pa.types.is_timestamp(t) and t.tz is not None:
        return any(isinstance(v, datetime.datetime) and v.tzinfo is not None and v < _SAFE_TIMESTAMPS_FROM
                   for v in values)
    if pa.types.is_decimal(t):
        return any(isinstance(v, decimal.Decimal) and len(v.as_tuple().digits) >= _EXACT_DECIMAL_DIGITS
                   for v in values)
    return False


def _whole(value: Any) -> Any:
    """A pushed value for an unsigned integer column as an int when it is a whole Decimal (uint64
    columns are DECIMAL(20, 0) in Spark); any other value as it came."""
    if isinstance(value, decimal.Decimal) and value.is_finite() and value == value.to_integral_value():
        return int(value)
    return value


def to_predicate(f: Filter, schema: pa.Schema, columns: set[str]) -> Predicate | None:
    """The predicate for a Spark filter, or None if nbcc cannot apply it exactly."""
    negated = isinstance(f, Not)
    inner = f.child if negated else f
    attr = getattr(inner, "attribute", None)
    if not attr or len(attr) != 1 or attr[0] not in columns:
        return None
    column = attr[0]
    field = schema.field(column)
    if not supported_type(field.type):
        return None
    if pa.types.is_timestamp(field.type) and field.type.unit == "ns":
        return None  # Spark compares the values cut to microseconds, which nbcc does not see
    if isinstance(inner, (EqualTo, EqualNullSafe)):
        if inner.value is None:
            op, value = ("is_null" if isinstance(inner, EqualNullSafe) else None), None
            if op is None:
                return None
        else:
            op, value = "=", inner.value
    elif isinstance(inner, In):
        if None in inner.value and negated:
            return None  # NOT IN (..., NULL): let Spark apply SQL's three-valued logic
        op, value = "in", tuple(v for v in inner.value if v is not None)
    elif isinstance(inner, IsNull):
        op, value = "is_null", None
    elif isinstance(inner, IsNotNull):
        op, value = "is_not_null", None
    else:
        ops = {GreaterThan: ">", GreaterThanOrEqual: ">=", LessThan: "<", LessThanOrEqual: "<=",
               StringStartsWith: "starts_with", StringEndsWith: "ends_with", StringContains: "contains"}
        op = ops.get(type(inner))
        if op is None:
            return None
        value = inner.value
    if _maybe_altered(field.type, value if op == "in" else (value,)):
        return None
    if pa.types.is_unsigned_integer(field.type):  # a uint64 is Spark's DECIMAL(20, 0): whole numbers
        value = tuple(map(_whole, value)) if op == "in" else _whole(value)
    if negated:
        flipped = {"=": "!=", "in": "not_in", "is_null": "is_not_null", "is_not_null": "is_null"}
        if op not in flipped:
            return None
        if isinstance(inner, EqualNullSafe):
            return None  # NOT (a <=> v) keeps nulls; != would drop them
        op = flipped[op]
    try:
        op, value = check_value(column, field, op, value)
    except InvalidOptionError:
        return None
    return Predicate(column, op, value, type=field.type)


# -- writing -----------------------------------------------------------------------------------

_SCATTERED_FILES = 64  # fewer files than this are not worth a warning, however many tasks wrote them


def warn_if_scattered(files: list[dict[str, Any]], what: str, logger: logging.Logger) -> None:
    """Log a warning when several Spark tasks wrote each file group (a shuffle before the write
    makes spark.sql.shuffle.partitions tasks, each writing every bucket): the commit's many
    small files slow every read until a compaction."""
    groups = len({(f["partition"], f["file_group"]) for f in files})
    if len(files) > max(_SCATTERED_FILES, 4 * groups):
        logger.warning(
            "%s wrote %d log files into %d file groups: several Spark tasks wrote each one (a shuffle before "
            "the write, such as a join, dropDuplicates or an aggregation, makes spark.sql.shuffle.partitions "
            "tasks), and reads merge every file until a compaction. Repartition the DataFrame with "
            "pyspark_nbcc.repartition_by_bucket before writing (README: One log file per bucket)",
            what, len(files), groups)


@dataclass
class NbccCommitMessage(WriterCommitMessage):
    files: list[dict[str, Any]] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)


class NbccWriter(DataSourceArrowWriter):
    def __init__(self, storage: Storage, config: TableConfig, txn: WriteTransaction,
                 max_log_file_bytes: int | None, compaction_trigger: tuple[int | None, bool] = (None, False),
                 replace_where: ReplaceWhere | None = None):
        self.storage = storage
        self.config = config
        self.txn = txn
        self.max_log_file_bytes = max_log_file_bytes
        self.compaction_trigger = compaction_trigger
        self.replace_where = replace_where  # its rows are checked, its partitions named at commit

    def write(self, iterator: Iterator[pa.RecordBatch]) -> NbccCommitMessage:
        from pyspark import TaskContext

        if self.txn.operation == DELETE_PARTITION:  # names partitions, writes no file
            return NbccCommitMessage(partitions=sorted(partitions_named(iterator, self.config, self.txn.schema)))
        ctx = TaskContext.get()
        # The task attempt's id, unique in the application: a resubmitted stage numbers its task
        # attempts from 0 again, and a zombie task of the earlier attempt may still be writing.
        token = make_token(ctx.partitionId(), ctx.stageId(), ctx.taskAttemptId()) if ctx else make_token(0, 0, 0)
        writer = LogWriter(self.storage, self.config, self.txn.schema, self.txn.instant, token,
                           self.max_log_file_bytes)
        # Beats while the task runs, rows or not: a task whose rows take long to compute must not
        # let a cleaner take the write for dead.
        try:
            with Heartbeat(self.storage, self.txn.instant, interval_s(self.config.heartbeat_timeout_s), keep=True):
                for rows in coalesced(iterator):
                    prepared = prepare(rows, self.config, self.txn.schema, self.txn.operation)
                    if self.replace_where is not None:
                        self.replace_where.check(prepared, self.config.partition_by)
                    writer.write(prepared)
                files = writer.close()
        except BaseException:
            writer.abort()  # no half-written file may surface later (S3 uploads on close)
            raise
        return NbccCommitMessage(files=files, partitions=sorted({f["partition"] for f in files}))

    def commit(self, messages: list[NbccCommitMessage | None]) -> None:
        partitions = [p for m in messages if m is not None for p in m.partitions]
        if self.txn.operation == DELETE_PARTITION:
            self._commit_deletion(sorted(set(partitions)))
            return
        extra, match = None, None
        if self.replace_where is not None:  # the partitions that match it as of its completion (format.md §8)
            match = Table(self.storage, self.config).match_partitions(self.replace_where.filter)
            extra = {"replace_where": self.replace_where.text}
        files = [f for m in messages if m is not None for f in m.files]
        self.txn.commit(files, extra, partitions=partitions, match=match)
        what = f"the Spark write's commit {self.txn.instant}"
        warn_if_scattered(files, what, log)
        self._compact_if_due(what)

    def _commit_deletion(self, partitions: list[str]) -> None:
        if not partitions:
            log.info("operation=delete_partition: the DataFrame has no rows, so it names no partition; "
                     "nothing was deleted or committed")
            return
        instant = Table(self.storage, self.config).commit_deletion(self.txn, partitions)
        self._compact_if_due(f"the Spark partition deletion {instant}")

    def _compact_if_due(self, after: str) -> None:
        """Schedule (and run, inline) a compaction if the write's trigger options say it is due."""
        every, inline = self.compaction_trigger
        maybe_compact(self.storage, self.config, self.txn.clock, every, inline, after, log)

    def abort(self, messages: list[NbccCommitMessage | None]) -> None:
        if not self.txn.instant:  # a partition deletion, which begins at commit: nothing to undo
            return
        files = [f for m in messages if m is not None for f in m.files]
        self.txn.rollback(files, reason="the Spark job failed and aborted the write")
