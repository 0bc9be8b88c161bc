"""Table configuration (`.nbcc/table.json`) and the options users pass to reads and writes.

Options are declared once here, with their parser and a one-line description, so that the Python
API and the Spark connector accept exactly the same names and an unknown name is an error that
lists the valid ones.
"""

from __future__ import annotations

import difflib
import json
import math
import numbers
import uuid
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import pyarrow as pa

from .errors import InvalidOptionError, NbccError, SchemaError, TableConfigError
from .schema import IS_DELETED_COL, META_PREFIX, check_column, check_names, is_reserved, plain_type, schema_from_json, schema_to_json

FORMAT_VERSION = 1  # what a table is created with
# Version 2 is version 1 plus the action `replacepartitions` (format.md §3, §8). A table's first
# dynamic partition overwrite raises it, so that an nbcc that predates the action refuses the
# table instead of reading, or compacting, the replaced partitions' old rows back.
PARTITION_REPLACE_VERSION = 2
# Version 3 adds the commit metadata field `replaced_partitions` of `replacepartitions`: a
# partition deletion or a replaceWhere replaces partitions it writes no file to, which a
# version-2 reader (scope = the commit's files) would leave as they were. A table's first such
# write raises it.
PARTITION_DELETE_VERSION = 3
# Version 4 lets a commit widen a column's type (format.md §4.2). A version-3 reader folds the
# schema by added columns only, keeps the narrower type, and casts wider files down to it:
# doubles lose digits silently, and its compaction would write them so. A table's first
# widening write raises it.
TYPE_WIDENING_VERSION = 4
# Version 5 adds savepoints (format.md §14.6): states a clean must keep. A version-4 cleaner
# would delete their files, so a table's first savepoint raises it.
SAVEPOINT_VERSION = 5
READ_FORMAT_VERSIONS = (1, 2, 3, 4, 5)
TABLE_CONFIG_PATH = ".nbcc/table.json"

EVENT_TIME, COMMIT_TIME, PARTIAL_UPDATE = "event_time", "commit_time", "partial_update"
MERGE_MODES = (EVENT_TIME, COMMIT_TIME, PARTIAL_UPDATE)
UPSERT, DELETE = "upsert", "delete"
# The partitions the rows are in lose every row (Hudi's delete_partition): no file is written.
DELETE_PARTITION = "delete_partition"
OPERATIONS = (UPSERT, DELETE, DELETE_PARTITION)
# What mode("overwrite") replaces: the whole table, or only the partitions the write has rows in
# (Spark's and Delta's option of this name; a Python data source never sees the session conf).
STATIC, DYNAMIC = "static", "dynamic"
PARTITION_OVERWRITE_MODES = (STATIC, DYNAMIC)
PARTITION_OVERWRITE_MODE = "partitionoverwritemode"  # option names are matched in lower case
# Delta's option: an overwrite that replaces the partitions matching a condition, which every row
# written must match (partition columns only: nbcc replaces whole partitions).
REPLACE_WHERE = "replacewhere"
USER_METADATA = "usermetadata"  # Delta's userMetadata: text recorded with the commit
# A write may widen a column's type only when told to (Delta's type widening is opt-in too): a
# widening cannot be undone, and raises the table's format version.
TYPE_WIDENING = "type_widening"

DEFAULT_BUCKETS = 16
# File group ids carry the bucket as 8 digits (Hudi's form, §11), so bucket ids stop at 99999999.
MAX_BUCKETS = 10**8
DEFAULT_MAX_LOG_FILE_BYTES = 512 * 1024 * 1024
DEFAULT_LOCK_LEASE_MS = 30_000
# A commit stops unless it holds the lock for less than half the lease; a hold takes a few ms
# alone and up to hundreds of ms on a loaded machine or object store.
MIN_LOCK_LEASE_MS = 1_000
DEFAULT_HEARTBEAT_TIMEOUT_S = 300


def check_write_operation(operation: str, overwrite: bool) -> None:
    """The write's operation and mode, checked before anything (a first write's table) exists."""
    if operation not in OPERATIONS:
        raise InvalidOptionError(f"operation must be one of {', '.join(OPERATIONS)}; got {operation!r}")
    if operation in (DELETE, DELETE_PARTITION) and overwrite:
        raise InvalidOptionError(f"operation={operation} cannot be combined with overwrite mode; give mode append")


def check_overwrite_options(replace_where: Any, overwrite: bool, partition_overwrite_mode: str) -> None:
    """replaceWhere and partitionOverwriteMode=dynamic go with mode overwrite (an append that
    names them most likely forgot it), and replaceWhere is its own partition overwrite mode."""
    if partition_overwrite_mode == DYNAMIC and not overwrite:
        raise InvalidOptionError("partitionOverwriteMode=dynamic goes with mode overwrite: it replaces the partitions "
                                 "the data has rows in (an append upserts the rows, replacing nothing)")
    if replace_where is None:
        return
    if not overwrite:
        raise InvalidOptionError("replaceWhere goes with mode overwrite: it replaces the matching partitions")
    if partition_overwrite_mode == DYNAMIC:
        raise InvalidOptionError("give either replaceWhere (replace the partitions that match it) or "
                                 "partitionOverwriteMode=dynamic (replace those the data has rows in), not both")


def check_partition_overwrite_mode(value: Any) -> str:
    """`static` (None too) or `dynamic`, in any letter case; anything else is an error."""
    return STATIC if value is None else WRITE_OPTIONS[PARTITION_OVERWRITE_MODE].parse(value)


def raise_format_version(storage: Any, grant: Any, version: int) -> None:
    """Raise table.json's `format_version` to `version` (never lower it). Only under the table
    lock (`grant`), as every rewrite of table.json: one replace, every other key kept."""
    doc = json.loads(storage.read_bytes(TABLE_CONFIG_PATH))
    if doc.get("format_version", 0) < version:
        doc["format_version"] = version
        grant.replace(storage, TABLE_CONFIG_PATH, json.dumps(doc, indent=2).encode())


def _names(value: str | Sequence[str] | None) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [v.strip() for v in value.split(",") if v.strip()]
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise InvalidOptionError(
            f"column names must be a string (comma-separated) or a list of strings; got {value!r}"
        )
    return list(value)


def _at_least(name: str, least: int, what: str) -> Callable[[Any], int]:
    def parse(value: Any) -> int:
        # int("2.7") fails but int(2.7) truncates and int(True) is 1: neither is what was meant.
        if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
            n = None
        else:
            try:
                n = int(value)
            except (TypeError, ValueError):
                n = None
        if n is None or n < least:
            raise InvalidOptionError(f"option {name!r} must be {what}, got {value!r}")
        return n
    return parse


def check_count(name: str, value: Any, what: str) -> int:
    """A Python API argument that counts `what` (commits, ...): a whole number, 1 or more. Not a
    text or a float: unlike a Spark option's value, an argument has its type, and "5" here is a
    mistake made elsewhere."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
        raise InvalidOptionError(f"{name} must be a whole number of {what}, 1 or more; got {value!r}")
    return int(value)


def check_duration(name: str, value: Any, unit: str) -> float:
    """A Python API argument that is a span of time in `unit`: a finite number, 0 or more."""
    if (isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value)
            or value < 0):
        raise InvalidOptionError(f"{name} must be a number of {unit}, 0 or more; got {value!r}")
    return float(value)


def _positive_int(name: str) -> Callable[[Any], int]:
    return _at_least(name, 1, "a positive integer")


def _buckets(value: Any) -> int:
    n = _positive_int("buckets")(value)
    if n > MAX_BUCKETS:
        raise InvalidOptionError(
            f"option 'buckets' must be at most {MAX_BUCKETS} (file group ids hold the bucket as 8 digits), "
            f"got {value!r}; give a smaller number")
    return n


def _choice(name: str, choices: Sequence[str]) -> Callable[[Any], str]:
    def parse(value: Any) -> str:
        v = str(value).strip().lower()
        if v not in choices:
            raise InvalidOptionError(f"option {name!r} must be one of {', '.join(choices)}; got {value!r}")
        return v
    return parse


def _bool_option(name: str) -> Callable[[Any], bool]:
    def parse(value: Any) -> bool:
        if isinstance(value, bool):
            return value
        text = str(value).strip().lower()
        if text in ("true", "false"):
            return text == "true"
        raise InvalidOptionError(f"option {name!r} must be true or false, got {value!r}")
    return parse


def _optional_name(value: Any) -> str | None:
    v = str(value).strip()
    return v or None


@dataclass(frozen=True)
class OptionSpec:
    parse: Callable[[Any], Any]
    doc: str


# Options that create a table (used on the first write) and are checked against it afterwards.
TABLE_OPTIONS: dict[str, OptionSpec] = {
    "record_key": OptionSpec(_names, "record key column(s), comma-separated; required to create a table"),
    "ordering_field": OptionSpec(_optional_name, "column whose greatest value wins a merge (event_time mode)"),
    "partition_by": OptionSpec(_names, "partition column(s), comma-separated (Hive-style folders)"),
    "buckets": OptionSpec(_buckets, f"number of buckets (file groups) per partition, default {DEFAULT_BUCKETS}, "
                                    f"at most {MAX_BUCKETS}"),
    "merge_mode": OptionSpec(_choice("merge_mode", MERGE_MODES), "event_time | commit_time | partial_update"),
    "lock_lease_ms": OptionSpec(_at_least("lock_lease_ms", MIN_LOCK_LEASE_MS,
                                          f"an integer of at least {MIN_LOCK_LEASE_MS} (milliseconds)"),
                                f"lease of the table lock, default {DEFAULT_LOCK_LEASE_MS} ms"),
    "heartbeat_timeout_s": OptionSpec(_positive_int("heartbeat_timeout_s"),
                                      "seconds without a heartbeat before a write counts as failed, "
                                      f"default {DEFAULT_HEARTBEAT_TIMEOUT_S}"),
}
def _text(value: Any) -> str:
    return str(value).strip()


WRITE_OPTIONS: dict[str, OptionSpec] = {
    **TABLE_OPTIONS,
    "operation": OptionSpec(_choice("operation", OPERATIONS),
                           "upsert (default) | delete (the rows' keys) | delete_partition (every row of "
                           "the partitions the rows are in)"),
    "max_log_file_bytes": OptionSpec(_positive_int("max_log_file_bytes"), "roll a log file over to a new version past this size"),
    "compaction_delta_commits": OptionSpec(_positive_int("compaction_delta_commits"),
                                           "schedule a compaction after every N delta commits"),
    "compaction_inline": OptionSpec(_bool_option("compaction_inline"),
                                    "true to also execute the scheduled compaction right after the commit"),
    PARTITION_OVERWRITE_MODE: OptionSpec(
        _choice("partitionOverwriteMode", PARTITION_OVERWRITE_MODES),
        "with mode overwrite: static (default) replaces the whole table | dynamic replaces only the "
        "partitions the data has rows in"),
    REPLACE_WHERE: OptionSpec(_text, "with mode overwrite: replace the partitions that match this condition on "
                                     "partition columns, e.g. day >= '2026-11-01' AND day < '2026-11-08'; every row "
                                     "written must match it"),
    USER_METADATA: OptionSpec(_text, "text recorded with the commit (each micro-batch's, for a stream), shown by "
                                     "nbcc history: a job name, a ticket"),
    TYPE_WIDENING: OptionSpec(_bool_option(TYPE_WIDENING),
                              "true to let this write widen a column's integer or float type to its data's wider "
                              "one (int -> bigint, float -> double); raises the table's format version to 4"),
}
READ_OPTIONS: dict[str, OptionSpec] = {
    "as_of": OptionSpec(_text, "time travel: a 17-digit instant time or an ISO-8601 timestamp (UTC if no zone)"),
    "query_type": OptionSpec(_text, "snapshot (default) | read_optimized | incremental"),
    "begin": OptionSpec(_text, "incremental: exclusive start (completion time), or 'earliest'"),
    "end": OptionSpec(_text, "incremental: inclusive end (completion time), default the latest"),
    "incremental_format": OptionSpec(_text, "incremental: latest_state (default) | cdc"),
    "include_meta_columns": OptionSpec(_text, "true to add _nbcc_commit_time, _nbcc_completion_time, ..."),
    "max_partition_bytes": OptionSpec(_positive_int("max_partition_bytes"),
                                      "Spark: most bytes of files read by one input partition (default 128 MiB)"),
    "use_metadata_table": OptionSpec(_bool_option("use_metadata_table"),
                                     "true (default): plan with the metadata table's ready partitions; "
                                     "false: from the timeline alone"),
}

# Streaming (Spark's writeStream / readStream). Their own registries: `begin` means something
# else for a stream, and batch-only options (as_of, end, ...) make no sense there.
STREAM_ID_DOC = ("the stream's identity, recorded in every commit with the batch id (default: Spark's "
                 "query id, kept in the checkpoint); letters, digits, '.', '_', '-'")
STREAM_WRITE_OPTIONS: dict[str, OptionSpec] = {
    **{k: v for k, v in WRITE_OPTIONS.items() if k not in (PARTITION_OVERWRITE_MODE, REPLACE_WHERE)},  # batch only
    "stream_id": OptionSpec(_text, STREAM_ID_DOC),
    "checkpointlocation": OptionSpec(_text, "Spark: the streaming query's checkpoint (Spark passes it on)"),
    "queryname": OptionSpec(_text, "Spark: the streaming query's name, writeStream.queryName (Spark passes it on)"),
}
STREAM_READ_OPTIONS: dict[str, OptionSpec] = {
    "begin": OptionSpec(_text, "where a new stream starts: earliest (default: every row), latest (only "
                               "commits completing after the start), or a completion time (exclusive)"),
    "max_commits_per_trigger": OptionSpec(_positive_int("max_commits_per_trigger"),
                                          "most commits per micro-batch (at least one is always read)"),
    "max_rows_per_trigger": OptionSpec(_positive_int("max_rows_per_trigger"),
                                       "most written rows per micro-batch, counted from commit metadata "
                                       "(at least one commit is always read)"),
    "incremental_format": OptionSpec(_text, "latest_state (default): the latest state of the keys each "
                                            "micro-batch's commits wrote | cdc: one row per change, deletes included"),
    "include_meta_columns": READ_OPTIONS["include_meta_columns"],
    "max_partition_bytes": READ_OPTIONS["max_partition_bytes"],
    "use_metadata_table": READ_OPTIONS["use_metadata_table"],
}

# Options matched in lower case whose users know them in Spark's spelling: error messages use it.
_SPELLED = {"checkpointlocation": "checkpointLocation", "queryname": "queryName",
            PARTITION_OVERWRITE_MODE: "partitionOverwriteMode",
            REPLACE_WHERE: "replaceWhere", USER_METADATA: "userMetadata"}

STORAGE_PREFIX = "storage."
# Spark adds these itself for load(path) / save(path).
SPARK_PATH_OPTIONS = ("path", "paths")


def parse_options(options: Mapping[str, Any], specs: Mapping[str, OptionSpec], kind: str
                  ) -> tuple[dict[str, Any], dict[str, Any]]:
    """Split `options` into (parsed nbcc options, storage options); unknown names are an error."""
    parsed: dict[str, Any] = {}
    storage: dict[str, Any] = {}
    unknown = []
    for raw_key, value in options.items():
        key = str(raw_key).strip()
        low = key.lower()
        if low.startswith(STORAGE_PREFIX) and len(low) > len(STORAGE_PREFIX):
            storage[key[len(STORAGE_PREFIX):]] = value
        elif low in specs:
            if value is not None:
                parsed[low] = specs[low].parse(value)
        elif low not in SPARK_PATH_OPTIONS:
            unknown.append(key)
    if unknown:
        valid = ", ".join(sorted(_SPELLED.get(k, k) for k in specs)) + (", " if specs else "") + "storage.<S3 option>"
        raise InvalidOptionError(
            f"unknown {kind} option(s): {', '.join(sorted(unknown))}. Valid {kind} options: {valid}"
            + _misplaced_hint(unknown, specs)
        )
    return parsed, storage


# Delta's and Hudi's names for nbcc's options, in lower case (as Spark hands them over).
_FOREIGN = {"versionasof": "as_of", "timestampasof": "as_of", "startingversion": "begin",
            "startingtimestamp": "begin", "hoodie.datasource.write.recordkey.field": "record_key",
            "hoodie.datasource.write.precombine.field": "ordering_field",
            "hoodie.table.ordering.fields": "ordering_field",
            "hoodie.datasource.write.partitionpath.field": "partition_by",
            "hoodie.datasource.write.operation": "operation", "hoodie.bucket.index.num.buckets": "buckets",
            "hoodie.datasource.query.type": "query_type",
            "hoodie.datasource.read.begin.instanttime": "begin", "hoodie.datasource.read.end.instanttime": "end"}


def _misplaced_hint(unknown: list[str], specs: Mapping[str, OptionSpec]) -> str:
    """What the unknown options that users bring from elsewhere are, and what to do instead;
    the valid option a misspelled one is near (Spark hands options over in lower case, so
    `orderingField` arrives as `orderingfield`)."""
    hints = []
    squeezed = {k.replace("_", "").replace(".", ""): _SPELLED.get(k, k) for k in specs}
    for k in unknown:
        if _FOREIGN.get(k.lower()) in specs:
            hints.append(f"{k}: nbcc's is {_FOREIGN[k.lower()]}" + (" (a time: nbcc has no version numbers)"
                                                                   if "version" in k.lower() else ""))
        elif near := difflib.get_close_matches(k.lower().replace("_", "").replace(".", ""), list(squeezed),
                                               n=1, cutoff=0.8):
            hints.append(f"{k}: did you mean {squeezed[near[0]]}?")
    writes = sorted(k for k in unknown if k.lower() in WRITE_OPTIONS and k.lower() not in specs)
    if writes and specs is READ_OPTIONS:
        hints.append(f"{', '.join(writes)}: write option(s), for df.write (in SQL, a view's OPTIONS are read "
                     "options too: INSERT through a view takes only path and storage.* options)")
    return "".join(f". {h}" for h in hints)


def _check_partition_column(name: str, t: pa.DataType) -> None:
    # A partition value becomes a folder name `name=value` (partitions.py): the name is not
    # escaped, and the value must be text, as in Hive and Spark.
    if not name or "/" in name or "=" in name or name.startswith("."):
        raise SchemaError(
            f"partition column {name!r}: a partition column's name becomes a folder name, so it may "
            "not be empty, contain '/' or '=', or start with '.'; rename the column"
        )
    scalar = (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
              or pa.types.is_boolean(t) or pa.types.is_date(t) or pa.types.is_timestamp(t)
              or pa.types.is_decimal(t) or pa.types.is_floating(t))
    if not scalar:
        raise SchemaError(
            f"partition column {name!r} has type {t}; partition by a string, integer, boolean, date, "
            "timestamp, decimal or float column"
        )


def parse_table_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """`Table.create`'s settings given by name (a first write's), parsed; unknown names are an error."""
    unknown = sorted(str(k) for k in options if k not in TABLE_OPTIONS)
    if unknown:
        raise InvalidOptionError(f"unknown table option(s): {', '.join(unknown)}. "
                                 f"Valid table options: {', '.join(TABLE_OPTIONS)}")
    return {k: TABLE_OPTIONS[k].parse(v) for k, v in options.items() if v is not None}


@dataclass(frozen=True)
class TableConfig:
    schema: pa.Schema
    record_key: tuple[str, ...]
    ordering_field: str | None = None
    partition_by: tuple[str, ...] = ()
    buckets: int = DEFAULT_BUCKETS
    merge_mode: str = COMMIT_TIME
    lock_lease_ms: int = DEFAULT_LOCK_LEASE_MS
    heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S
    format_version: int = FORMAT_VERSION
    # Metadata table partitions in use: kind -> "building" | "ready" (metadata_table.py). The one
    # field that is rewritten (under the table lock); absent in tables that never had one.
    metadata_table: dict[str, str] = field(default_factory=dict)
    # A UUID its creator chose: it makes every table.json's content unique, which is how
    # put-if-absent tells a retried create that did land from another creator's (storage.py).
    table_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def build(cls, schema: pa.Schema, record_key: str | Sequence[str] | None, *,
              ordering_field: str | None = None, partition_by: str | Sequence[str] = (),
              buckets: int = DEFAULT_BUCKETS, merge_mode: str | None = None,
              lock_lease_ms: int = DEFAULT_LOCK_LEASE_MS,
              heartbeat_timeout_s: int = DEFAULT_HEARTBEAT_TIMEOUT_S) -> "TableConfig":
        """Validate the settings of a new table."""
        if not isinstance(schema, pa.Schema):
            raise InvalidOptionError(f"schema must be a pyarrow.Schema (e.g. pa.schema([...]) or "
                                     f"table.schema); got {type(schema).__name__}")
        keys = tuple(_names(record_key))
        if not keys:
            raise SchemaError(
                "record_key is required to create a table: name the column(s) that identify a "
                "record, e.g. record_key='id' (Spark: .option('record_key', 'id'))"
            )
        parts = tuple(_names(partition_by))
        ordering_field = _optional_name(ordering_field) if ordering_field is not None else None
        check_names(schema.names, "the schema")
        # As a write stores them: a schema taken from a pandas or Polars table is accepted.
        schema = pa.schema([f.with_type(plain_type(f.type)) for f in schema], metadata=schema.metadata)
        names = set(schema.names)
        reserved = [n for n in schema.names if is_reserved(n)]
        if IS_DELETED_COL in reserved:
            raise SchemaError(f"{IS_DELETED_COL!r} is not a column a table holds: leave it out of the schema, and "
                              "give it with the rows a write deletes (true deletes the row's key)")
        if reserved:
            raise SchemaError(f"column name(s) {reserved} use the reserved prefix {META_PREFIX!r}; rename them")
        for f in schema:
            check_column(f.name, f.type)
        for role, cols in (("record_key", keys), ("partition_by", parts),
                           ("ordering_field", (ordering_field,) if ordering_field else ())):
            missing = [c for c in cols if c not in names]
            if missing:
                raise SchemaError(f"{role} column(s) {missing} are not in the schema; columns are: {schema.names}")
            if len(set(cols)) < len(cols):
                raise InvalidOptionError(f"{role} names a column more than once: {list(cols)}")
        for k in keys:
            t = schema.field(k).type
            if not (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_integer(t)
                    or pa.types.is_date(t)):
                raise SchemaError(f"record key column {k!r} has type {t}; supported: string, integer, date")
        for c in parts:
            _check_partition_column(c, schema.field(c).type)
        if ordering_field:
            t = schema.field(ordering_field).type
            if not (pa.types.is_integer(t) or pa.types.is_floating(t) or pa.types.is_string(t)
                    or pa.types.is_large_string(t) or pa.types.is_timestamp(t) or pa.types.is_date(t)
                    or pa.types.is_decimal(t)):
                raise SchemaError(f"ordering_field {ordering_field!r} has type {t}, which has no order nbcc can use")
        mode = TABLE_OPTIONS["merge_mode"].parse(merge_mode or (EVENT_TIME if ordering_field else COMMIT_TIME))
        if mode == EVENT_TIME and not ordering_field:
            raise SchemaError("merge_mode event_time needs an ordering_field: name the column whose greatest value wins")
        # Record keys are never null (a null partition value goes to __HIVE_DEFAULT_PARTITION__).
        fields = [f.with_nullable(False) if f.name in keys else f for f in schema]
        return cls(pa.schema(fields), keys, ordering_field, parts, TABLE_OPTIONS["buckets"].parse(buckets), mode,
                   TABLE_OPTIONS["lock_lease_ms"].parse(lock_lease_ms),
                   TABLE_OPTIONS["heartbeat_timeout_s"].parse(heartbeat_timeout_s), table_id=str(uuid.uuid4()))

    def _shaping(self) -> dict[str, Any]:
        """The table-shaping options, fixed when the table is created, as table.json has them."""
        return {
            "record_key": list(self.record_key),
            "ordering_field": self.ordering_field,
            "partition_by": list(self.partition_by),
            "buckets": self.buckets,
            "merge_mode": self.merge_mode,
            "lock_lease_ms": self.lock_lease_ms,
            "heartbeat_timeout_s": self.heartbeat_timeout_s,
        }

    def to_json(self) -> bytes:
        doc = {
            "format_version": self.format_version,
            "schema": schema_to_json(self.schema),
            **self._shaping(),
            **({"metadata_table": dict(self.metadata_table)} if self.metadata_table else {}),
            **({"table_id": self.table_id} if self.table_id else {}),
            **self.extra,
        }
        return json.dumps(doc, indent=2).encode()

    @classmethod
    def from_json(cls, data: bytes, where: str = TABLE_CONFIG_PATH) -> "TableConfig":
        try:
            doc = json.loads(data)
            version = doc.get("format_version")
        except (ValueError, AttributeError) as exc:
            raise TableConfigError(f"{where} is not a JSON object ({exc})") from None
        if type(version) is not int or version not in READ_FORMAT_VERSIONS:
            raise SchemaError(f"table format version {version} is not supported by this nbcc (supports "
                              f"{min(READ_FORMAT_VERSIONS)} to {max(READ_FORMAT_VERSIONS)})")
        known = {"format_version", "schema", "record_key", "ordering_field", "partition_by", "buckets",
                 "merge_mode", "lock_lease_ms", "heartbeat_timeout_s", "metadata_table", "table_id"}
        try:
            config = cls(
                schema=schema_from_json(doc["schema"]),
                record_key=tuple(_names(doc["record_key"])),
                ordering_field=doc.get("ordering_field"),
                partition_by=tuple(_names(doc.get("partition_by") or ())),
                buckets=_positive_int("buckets")(doc["buckets"]),
                merge_mode=_choice("merge_mode", MERGE_MODES)(doc["merge_mode"]),
                # Not TABLE_OPTIONS' parser: tables created before MIN_LOCK_LEASE_MS may have less.
                lock_lease_ms=_positive_int("lock_lease_ms")(doc.get("lock_lease_ms", DEFAULT_LOCK_LEASE_MS)),
                heartbeat_timeout_s=_positive_int("heartbeat_timeout_s")(
                    doc.get("heartbeat_timeout_s", DEFAULT_HEARTBEAT_TIMEOUT_S)),
                format_version=version,
                metadata_table=dict(doc.get("metadata_table") or {}),
                table_id=doc.get("table_id"),
                extra={k: v for k, v in doc.items() if k not in known},
            )
        except KeyError as exc:
            raise TableConfigError(f"{where} lacks the required field {exc}") from None
        except (NbccError, TypeError, ValueError, AttributeError) as exc:
            raise TableConfigError(f"{where} holds an invalid value: {exc}") from None
        named = config.record_key + config.partition_by + ((config.ordering_field,) if config.ordering_field else ())
        absent = [c for c in named if c not in config.schema.names]
        if not config.record_key or absent:
            raise TableConfigError(f"{where} names columns its schema lacks: {absent}" if absent
                                   else f"{where} has an empty record_key")
        return config

    def check_options(self, options: Mapping[str, Any]) -> None:
        """Table-shaping options given to a write of an existing table must match it."""
        current = self._shaping()
        for name, value in options.items():
            if name in current and value not in (None, [], "") and value != current[name]:
                raise InvalidOptionError(
                    f"option {name}={value!r} differs from the table's {name}={current[name]!r}; "
                    f"a table's {name} is fixed when it is created: drop the option or write to a new table"
                )
