"""Spark structured streaming for `nbcc`: the stream writer (sink) and the stream reader (source).
The logic lives in `nbcc.stream`; this module adapts it to Spark's Python data source API.

Sink. Spark creates the stream writer when it plans each micro-batch and again, from the pickled
data source, in the worker that commits it, and never tells either the batch id. Only the tasks
know it (the local property `streaming.sql.batchId`, with the query id in
`sql.streaming.queryId`), so the first task of a batch with rows claims the batch's instant
(`nbcc.stream.claim_batch`), and the commit message carries it to `commit`.

Source. Offsets are `{"completion": <17-digit time>}`. Spark calls the offset methods on one
long-lived reader, and `read` on a pickled copy: the plan of a micro-batch travels in its input
partitions, as for batch reads.
"""

from __future__ import annotations

import logging
import random
from contextlib import ExitStack
from dataclasses import dataclass, field, replace
from typing import Any, Iterable, Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSourceStreamArrowWriter,
    DataSourceStreamReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.streaming.datasource import (
    ReadAllAvailable,
    ReadLimit,
    ReadMaxBytes,
    ReadMaxFiles,
    ReadMaxRows,
    ReadMinRows,
    SupportsTriggerAvailableNow,
)
from pyspark.sql.types import StructType

from nbcc import Table
from nbcc.commit import WriteTransaction
from nbcc.compaction import maybe_compact
from nbcc.config import (
    DELETE_PARTITION,
    PARTITION_OVERWRITE_MODE,
    READ_OPTIONS,
    REPLACE_WHERE,
    USER_METADATA,
    TYPE_WIDENING,
    STREAM_READ_OPTIONS,
    STREAM_WRITE_OPTIONS,
    TableConfig,
    parse_options,
)
from nbcc.errors import CommitError, InvalidOptionError, SchemaError
from nbcc.filenames import make_token
from nbcc.heartbeat import Heartbeat, interval_s
from nbcc.rollback import rollback_instant
from nbcc.scan import (
    DEFAULT_MAX_PARTITION_BYTES,
    INCREMENTAL,
    SNAPSHOT,
    ReadOptions,
    pack_tasks,
    read_schema,
)
from nbcc.storage import Storage
from nbcc.stream import (
    Limits,
    as_changes,
    check_stream_id,
    claim_batch,
    commit_batch,
    initial_offset,
    instant_state,
    latest_claim,
    latest_data_completion,
    next_offset,
    plan_range,
)
from nbcc.timeline import INFLIGHT, REPLACE_COMMIT, REQUESTED
from nbcc.writer import LogWriter, coalesced, prepare

from .source import (NbccReader, TaskPartition, _check_given_schema, _spark_schema, _table_uri, loaded_columns,
                     open_for_write, spark_type_names, warn_if_scattered, widened_since_loaded)

log = logging.getLogger(__name__)

BATCH_ID_PROPERTY = "streaming.sql.batchId"
QUERY_ID_PROPERTY = "sql.streaming.queryId"
OFFSET_KEY = "completion"


# -- sink --------------------------------------------------------------------------------------

@dataclass
class NbccStreamCommitMessage(WriterCommitMessage):
    stream_id: str | None = None
    instant: str | None = None  # None: this task had no rows
    files: list[dict[str, Any]] = field(default_factory=list)
    committed_before: bool = False  # the batch's instant had completed: a replay, nothing written
    query_id: str | None = None  # Spark's query id (the owner of stream_id), known only to tasks


def stream_writer(options: dict[str, Any], schema: StructType, overwrite: bool) -> "NbccStreamWriter":
    uri = _table_uri(options)
    given = {str(k).strip().lower() for k in options}
    for name, spelled in ((PARTITION_OVERWRITE_MODE, "partitionOverwriteMode"), (REPLACE_WHERE, "replaceWhere")):
        if name in given:
            raise InvalidOptionError(
                f"{spelled} is an option of batch overwrites (df.write.mode(\"overwrite\")): a stream's "
                "micro-batches upsert, or in complete output mode each replaces the whole table; leave it out")
    parsed, storage_options = parse_options(options, STREAM_WRITE_OPTIONS, "streaming write")
    stream_id = check_stream_id(parsed.pop("stream_id")) if "stream_id" in parsed else None
    user_metadata = parsed.pop(USER_METADATA, None)
    type_widening = parsed.pop(TYPE_WIDENING, False)
    parsed.pop("checkpointlocation", None)
    parsed.pop("queryname", None)
    if parsed.get("operation") == DELETE_PARTITION:
        raise InvalidOptionError(
            "operation=delete_partition is for batch writes (df.write): a stream would delete the partitions "
            "of every micro-batch's rows. Delete partitions with a batch write, Table.delete_partitions or "
            "`nbcc delete-partitions`")
    with spark_type_names(uri, storage_options, schema):
        table, arrow_schema, operation, max_bytes, trigger = open_for_write(
            uri, parsed, storage_options, schema, overwrite)
        # Each micro-batch's commit records user_metadata.
        template = table.prepare_write(arrow_schema, operation, overwrite, user_metadata=user_metadata,
                                       type_widening=type_widening)
    template.require_format_version()  # its micro-batches claim their instants without begin()
    return NbccStreamWriter(table.config, template, stream_id, max_bytes, trigger)


class NbccStreamWriter(DataSourceStreamArrowWriter):
    """Each micro-batch is one commit (a deltacommit; a replacecommit in complete output mode),
    committed at most once whatever Spark replays."""

    def __init__(self, config: TableConfig, template: WriteTransaction, stream_id: str | None,
                 max_log_file_bytes: int | None, compaction_trigger: tuple[int | None, bool] = (None, False)):
        self.config = config
        self.template = template  # not begun: every batch begins its own instant
        self.stream_id = stream_id
        self.max_log_file_bytes = max_log_file_bytes
        self.compaction_trigger = compaction_trigger

    @property
    def storage(self) -> Storage:
        return self.template.storage

    def write(self, iterator: Iterator[pa.RecordBatch]) -> NbccStreamCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        batch_id = ctx.getLocalProperty(BATCH_ID_PROPERTY) if ctx else None
        query_id = ctx.getLocalProperty(QUERY_ID_PROPERTY) if ctx else None
        stream_id = self.stream_id or query_id
        if batch_id is None or stream_id is None:
            raise CommitError("the nbcc stream writer runs only in a Spark streaming micro-batch "
                              f"(the task has no {BATCH_ID_PROPERTY} / {QUERY_ID_PROPERTY} property)")
        # The instant of a batch is reused when Spark replays the batch, maybe by a new application
        # whose stage ids start at 0 again: a random middle number keeps file names unique.
        token = make_token(ctx.partitionId(), random.randrange(2**31), ctx.taskAttemptId())
        txn, claim, writer = self.template, None, None
        # The heartbeat starts with the claim, at the first row, so it is entered on a stack.
        with ExitStack() as alive:
            try:
                for rows in coalesced(iterator):
                    if claim is None:
                        claim = claim_batch(self.storage, txn.clock, stream_id, int(batch_id), txn.action,
                                            {"operation": txn.operation}, query_id)
                        if claim.committed:
                            return NbccStreamCommitMessage(stream_id, claim.instant, committed_before=True,
                                                           query_id=query_id)
                        # Beats until the task ends, rows or not (a slow stretch is not a dead write).
                        alive.enter_context(Heartbeat(self.storage, claim.instant,
                                                      interval_s(self.config.heartbeat_timeout_s), keep=True))
                        writer = LogWriter(self.storage, self.config, txn.schema, claim.instant, token,
                                           self.max_log_file_bytes)
                    writer.write(prepare(rows, self.config, txn.schema, txn.operation))
                if writer is None:
                    return NbccStreamCommitMessage(stream_id, query_id=query_id)
                return NbccStreamCommitMessage(stream_id, claim.instant, writer.close(), query_id=query_id)
            except BaseException:
                if writer is not None:
                    writer.abort()  # no half-written file may surface later (S3 uploads on close)
                raise

    def commit(self, messages: list[NbccStreamCommitMessage | None], batchId: int) -> None:
        written = [m for m in messages if m is not None and m.instant]
        if not written and self.template.action == REPLACE_COMMIT:
            written = self._empty_result(messages, batchId)
        if not written:
            return  # no task had a row: an empty micro-batch makes no commit in append mode
        instants = sorted({m.instant for m in written})
        if len(instants) > 1:
            raise CommitError(
                f"the tasks of streaming batch {batchId} wrote into different instants {instants}: one "
                "was rolled back while the batch ran. The batch is aborted; restarting the query "
                "writes it again")
        files = [f for m in written for f in m.files]
        completion = commit_batch(self.template, written[0].stream_id, batchId, instants[0], files)
        if completion is None:
            log.info("streaming batch %s of stream %s was committed before (instant %s): skipped",
                     batchId, written[0].stream_id, instants[0])
            return
        what = f"streaming batch {batchId} of stream {written[0].stream_id}"
        warn_if_scattered(files, what, log)
        every, inline = self.compaction_trigger
        maybe_compact(self.storage, self.config, self.template.clock, every, inline,
                      f"{what} (instant {instants[0]})", log)

    def _empty_result(self, messages: list[NbccStreamCommitMessage | None], batchId: int
                      ) -> list[NbccStreamCommitMessage]:
        """Complete mode, no task had a row: the batch's result is empty, so the table must become
        empty. The claim is made here (replays find it like any other); the tasks' messages
        carry the stream id and the query id, which only tasks can see."""
        told = [m for m in messages if m is not None and m.stream_id]
        if not told:
            log.warning("streaming batch %s in complete mode had no rows and no task reported its stream: "
                        "the table keeps its rows", batchId)
            return []
        t = self.template
        claim = claim_batch(self.storage, t.clock, told[0].stream_id, batchId, t.action,
                            {"operation": t.operation}, told[0].query_id)
        return [NbccStreamCommitMessage(told[0].stream_id, claim.instant, committed_before=claim.committed)]

    def abort(self, messages: list[NbccStreamCommitMessage | None], batchId: int) -> None:
        written = [m for m in messages if m is not None and m.instant and not m.committed_before]
        instants = {m.instant for m in written}
        # A task that failed sends no message, so when the only tasks with rows failed, the
        # batch's instant is known from its claim alone (the stream id given, or told by a task).
        stream_ids = {m.stream_id for m in messages if m is not None and m.stream_id} | {self.stream_id} - {None}
        for stream_id in sorted(stream_ids):
            claim = latest_claim(self.storage, stream_id, batchId)
            if claim and instant_state(self.storage, claim["instant"]) in (REQUESTED, INFLIGHT):
                instants.add(claim["instant"])
        for instant in sorted(instants):
            files = [f for m in written if m.instant == instant for f in m.files]
            # Never undoes a completed instant (rollback checks under the table lock).
            rollback_instant(self.storage, self.template.clock, instant, self.template.partition_depth, files,
                             reason=f"Spark aborted streaming batch {batchId}")


# -- source ------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _ReadSetup:
    table: Table
    begin: str | None
    limits: Limits
    max_partition_bytes: int
    # Each micro-batch's incremental read: incremental_format, include_meta_columns, and
    # use_metadata_table (None: the metadata table's ready partitions, as batch reads).
    options: ReadOptions


# What a stream delivers, for users who reach for the batch reads' change options.
STREAM_CHANGES_HINT = ("a stream delivers, per micro-batch, the latest state of the keys its commits wrote "
                       "(deleted keys absent), or with incremental_format=cdc one row per change, deletes and "
                       "overwrites included; as_of, query_type and end are for batch reads (spark.read)")


def _batch_only_hint(names: Iterable[str]) -> str:
    """A note for a streaming read given options only batch reads take (as_of, query_type, ...)."""
    given = sorted({n.strip().lower() for n in names} & (set(READ_OPTIONS) - set(STREAM_READ_OPTIONS)))
    if not given:
        return ""
    what = "is a batch read option" if len(given) == 1 else "are batch read options"
    return f" ({', '.join(given)} {what}: {STREAM_CHANGES_HINT})"


def _read_setup(options: dict[str, Any]) -> _ReadSetup:
    uri = _table_uri(options)
    try:
        parsed, storage_options = parse_options(options, STREAM_READ_OPTIONS, "streaming read")
    except InvalidOptionError as exc:
        raise InvalidOptionError(f"{exc}{_batch_only_hint(options)}") from None
    begin = parsed.get("begin")
    table = Table.open(uri, storage_options)
    initial_offset(table.storage, begin)  # a bad begin fails now, not at the first batch
    read_options = ReadOptions.build(query_type=INCREMENTAL, incremental_format=parsed.get("incremental_format"),
                                     include_meta_columns=parsed.get("include_meta_columns", False),
                                     use_metadata_table=parsed.get("use_metadata_table"))
    limits = Limits(max_commits=parsed.get("max_commits_per_trigger"), max_rows=parsed.get("max_rows_per_trigger"))
    return _ReadSetup(table, begin, limits, parsed.get("max_partition_bytes", DEFAULT_MAX_PARTITION_BYTES),
                      read_options)


def stream_read_schema(options: dict[str, Any]) -> StructType:
    """The schema of `spark.readStream.format("nbcc").load(uri)`: the table's current columns
    (plus the meta columns if asked for). A micro-batch of commits that added columns since
    fails the query, whose restart reads them (NbccStreamReader.partitions)."""
    return _own_schema(_read_setup(options))


def _own_schema(setup: _ReadSetup) -> StructType:
    return _spark_schema(read_schema(setup.table.storage, setup.table.config, setup.options))


def stream_reader(options: dict[str, Any], schema: StructType | None,
                  taken: StructType | None = None) -> "NbccStreamReader":
    """The reader of a query with `schema`: given with .schema(...), or the one Spark took from
    DefaultSource.schema(), `taken` (None: the table's current columns)."""
    setup = _read_setup(options)
    own = _own_schema(setup)
    schema = own if schema is None else schema
    follows_table = taken is not None and schema == taken  # maybe older than `own`: loaded before
    if schema != own and not follows_table:  # given with .schema(...): checked as a batch read's is
        _check_given_schema(schema, own, [] if setup.options.is_cdc else setup.table.schema().names)
    return NbccStreamReader(setup.table.uri, setup.table.storage.storage_options, schema, setup.begin,
                            setup.limits, setup.options, setup.max_partition_bytes, follows_table=follows_table)


class RefusedStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Stands in for a reader that could not be set up (a bad option, no table): it raises that
    error at Spark's first call. PySpark's stream runner stops the reader in a `finally` around
    `streamReader()`, so an error raised there reached the user buried under an
    UnboundLocalError about the reader it never got; raised from a call, it comes alone."""

    def __init__(self, error: Exception):
        self.error = error

    def _raise(self) -> Any:
        raise self.error

    def initialOffset(self) -> dict:
        return self._raise()

    def getDefaultReadLimit(self) -> ReadLimit:
        return self._raise()

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        return self._raise()

    def prepareForTriggerAvailableNow(self) -> None:
        self._raise()

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        return self._raise()

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        return self._raise()

    def commit(self, end: dict) -> None:
        self._raise()

    def stop(self) -> None:
        pass


class NbccStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """Micro-batches of the commits that completed after the last offset, oldest first."""

    def __init__(self, uri: str, storage_options: dict[str, Any], schema: StructType, begin: str | None,
                 limits: Limits, options: ReadOptions, max_partition_bytes: int, follows_table: bool = False):
        self.uri = uri
        self.storage_options = storage_options
        self.schema = schema
        self.begin = begin
        self.limits = limits
        self.options = options  # each micro-batch's incremental read (_ReadSetup.options)
        self.max_partition_bytes = max_partition_bytes
        # The query reads the table's own columns (no .schema(...)): a column added later stops it.
        self.follows_table = follows_table
        self.target: str | None = None  # Trigger.AvailableNow: read nothing that completed later
        self._initial: str | None = None

    def _storage(self) -> Storage:
        return Storage(self.uri, self.storage_options)

    def initialOffset(self) -> dict:
        # Spark asks more than once (planning batch 0, then running it): with begin=latest, a
        # second answer would skip the commits that completed in between.
        if self._initial is None:
            self._initial = initial_offset(self._storage(), self.begin)
        return {OFFSET_KEY: self._initial}

    def getDefaultReadLimit(self) -> ReadLimit:
        # Spark knows only its own limit types; it hands the limit back to latestOffset, which
        # applies both options whatever the type (a commit counts as one "file").
        if self.limits.max_rows is not None:
            return ReadMaxRows(self.limits.max_rows)
        if self.limits.max_commits is not None:
            return ReadMaxFiles(self.limits.max_commits)
        return ReadAllAvailable()

    def _limits(self, limit: ReadLimit) -> Limits:
        if isinstance(limit, ReadAllAvailable):  # e.g. Trigger.Once: Spark asks for everything
            return Limits()
        commits, rows = self.limits.max_commits, self.limits.max_rows
        if isinstance(limit, ReadMaxFiles):
            commits = min(commits or limit.max_files, limit.max_files)
        if isinstance(limit, ReadMaxRows):
            rows = min(rows or limit.max_rows, limit.max_rows)
        return Limits(commits, rows, limit.max_bytes if isinstance(limit, ReadMaxBytes) else None,
                      limit.min_rows if isinstance(limit, ReadMinRows) else None)

    def latestOffset(self, start: dict, limit: ReadLimit) -> dict:
        return {OFFSET_KEY: next_offset(self._storage(), _offset(start), self._limits(limit), self.target)}

    def prepareForTriggerAvailableNow(self) -> None:
        self.target = latest_data_completion(self._storage())

    def partitions(self, start: dict, end: dict) -> list[InputPartition]:
        begin, until = _offset(start), _offset(end)
        if begin >= until:
            return []
        table = Table.open(self.uri, self.storage_options)
        o = self.options
        plan = plan_range(table.storage, table.config, begin, until, o.include_meta_columns, o.use_metadata_table,
                          o.incremental_format)
        columns = loaded_columns(self.schema, o, self.follows_table)
        added = [n for n in plan.schema.names if n not in columns.fieldNames()] if columns else []
        widened = widened_since_loaded(plan.schema, columns) if columns else []
        if added or widened:
            # Delivered without them (or cast down), their values would be lost downstream: a
            # restarted query reads the table's columns anew, and replays this micro-batch with them.
            changes = [f"gained column(s) {', '.join(added)}"] if added else []
            changes += [f"widened column(s) {', '.join(widened)}"] if widened else []
            raise SchemaError(
                f"the table {' and '.join(changes)} since this streaming query's DataFrame was "
                f"loaded (in a commit of its micro-batch ({begin}, {until}]); restart the query from a "
                "DataFrame loaded anew (spark.readStream...load()) to read them: it takes the table's "
                "columns then, and replays this micro-batch with them (a DataFrame loaded before keeps its "
                "columns, and stops here again). To read a fixed set of columns instead, give them with "
                ".schema(...)")
        shared = replace(plan, tasks=[])
        return [TaskPartition(shared, group) for group in pack_tasks(plan.tasks, self.max_partition_bytes)]

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        # A cdc stream's first micro-batch from the beginning is a snapshot: its rows as inserts.
        first_changes = (self.options.is_cdc and isinstance(partition, TaskPartition)
                         and partition.plan.options.query_type == SNAPSHOT)
        yield from NbccReader(self.uri, self.storage_options, self.schema, ReadOptions(), self.max_partition_bytes
                              ).read(partition, as_changes if first_changes else None)


def _offset(offset: dict | None) -> str:
    value = (offset or {}).get(OFFSET_KEY)
    if not isinstance(value, str) or len(value) != 17 or not value.isdigit():
        raise InvalidOptionError(f"not an nbcc stream offset: {offset!r} (expected {{'{OFFSET_KEY}': <17-digit time>}})")
    return value

