"""The Spark data source `nbcc`: a thin adapter from Spark's Python data source API to the core.

Spark runs every method here in a Python worker, never in the driver's own process: `schema`,
`writer` in a driver-side worker, `partitions` in a planning worker, `read`/`write` in executor
workers, `commit`/`abort` in another worker with the writer as pickled at planning. So every
object here is plain data that pickles, and each step reopens what it needs from storage.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterator

import pyarrow as pa
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceReader,
    InputPartition,
    WriterCommitMessage,
)
from pyspark.sql.pandas.types import from_arrow_schema, to_arrow_schema
from pyspark.sql.types import StructType

from nbcc import Table
from nbcc.commit import WriteTransaction
from nbcc.config import READ_OPTIONS, WRITE_OPTIONS, TableConfig, parse_options
from nbcc.errors import InvalidOptionError, SchemaError
from nbcc.file_slices import FileSlice
from nbcc.filenames import make_token
from nbcc.reader import read_slice
from nbcc.storage import Storage
from nbcc.writer import LogWriter, prepare


def _table_uri(options: dict[str, Any]) -> str:
    path = options.get("path")
    if not path:
        if options.get("paths") not in (None, "[]"):
            raise InvalidOptionError("nbcc reads one table at a time: pass a single path to load()")
        raise InvalidOptionError("no table path: use .load(uri) / .save(uri) or .option('path', uri)")
    return str(path)


def _spark_schema(arrow_schema: pa.Schema) -> StructType:
    unsupported = [f"{f.name} ({f.type})" for f in arrow_schema if pa.types.is_unsigned_integer(f.type)]
    if unsupported:
        raise SchemaError(f"Spark has no unsigned integer types; columns {unsupported} cannot be read by Spark")
    return from_arrow_schema(arrow_schema)


class DefaultSource(DataSource):
    """`spark.read.format("nbcc").load(uri)` and `df.write.format("nbcc").save(uri)`."""

    @classmethod
    def name(cls) -> str:
        return "nbcc"

    def schema(self) -> StructType:
        uri = _table_uri(self.options)
        _, storage_options = parse_options(self.options, READ_OPTIONS, "read")
        return _spark_schema(Table.open(uri, storage_options).schema())

    def reader(self, schema: StructType) -> "NbccReader":
        uri = _table_uri(self.options)
        read_options, storage_options = parse_options(self.options, READ_OPTIONS, "read")
        return NbccReader(uri, storage_options, schema, read_options)

    def writer(self, schema: StructType, overwrite: bool) -> "NbccWriter":
        uri = _table_uri(self.options)
        options, storage_options = parse_options(self.options, WRITE_OPTIONS, "write")
        arrow_schema = to_arrow_schema(schema, timezone="UTC")
        operation = options.pop("operation", "upsert")
        max_bytes = options.pop("max_log_file_bytes", None)
        table = Table.open_or_create(uri, arrow_schema, storage_options, **options)
        txn = table.begin_write(arrow_schema, operation, overwrite=overwrite)
        return NbccWriter(table.storage, table.config, txn, max_bytes)


# -- reading -----------------------------------------------------------------------------------

class SlicePartition(InputPartition):
    """One input partition per file slice."""

    def __init__(self, file_slice: FileSlice):
        super().__init__(file_slice.file_group_id)
        self.file_slice = file_slice


class NbccReader(DataSourceReader):
    def __init__(self, uri: str, storage_options: dict[str, Any], schema: StructType,
                 read_options: dict[str, Any]):
        self.uri = uri
        self.storage_options = storage_options
        self.read_options = read_options
        self.arrow_schema = to_arrow_schema(schema, timezone="UTC")
        self._table: Table | None = None
        self._snapshot_schema: pa.Schema | None = None

    def _open(self) -> Table:
        if self._table is None:
            self._table = Table.open(self.uri, self.storage_options)
        return self._table

    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        state["_table"] = None
        return state

    def partitions(self) -> list[InputPartition]:
        snapshot = self._open().snapshot()
        self._snapshot_schema = snapshot.schema
        return [SlicePartition(s) for s in snapshot.slices]

    def read(self, partition: SlicePartition) -> Iterator[pa.RecordBatch]:
        table = self._open()
        schema = self._snapshot_schema or table.schema()
        merged = read_slice(table.storage, table.config, schema, partition.file_slice)
        # Spark checks the first batch's schema exactly (nullability, timestamp[us, tz=UTC]).
        yield from merged.cast(self.arrow_schema).to_batches(max_chunksize=64 * 1024)


# -- writing -----------------------------------------------------------------------------------

@dataclass
class NbccCommitMessage(WriterCommitMessage):
    files: list[dict[str, Any]] = field(default_factory=list)
    partitions: list[str] = field(default_factory=list)


class NbccWriter(DataSourceArrowWriter):
    def __init__(self, storage: Storage, config: TableConfig, txn: WriteTransaction,
                 max_log_file_bytes: int | None):
        self.storage = storage
        self.config = config
        self.txn = txn
        self.max_log_file_bytes = max_log_file_bytes

    def write(self, iterator: Iterator[pa.RecordBatch]) -> NbccCommitMessage:
        from pyspark import TaskContext

        ctx = TaskContext.get()
        token = make_token(ctx.partitionId(), ctx.stageId(), ctx.attemptNumber()) if ctx else make_token(0, 0, 0)
        writer = LogWriter(self.storage, self.config, self.txn.schema, self.txn.instant, token,
                           self.max_log_file_bytes)
        for batch in iterator:
            if batch.num_rows:
                writer.write(prepare(batch, self.config, self.txn.schema, self.txn.operation, self.txn.instant))
        files = writer.close()
        return NbccCommitMessage(files=files, partitions=sorted({f["partition"] for f in files}))

    def commit(self, messages: list[NbccCommitMessage | None]) -> None:
        self.txn.commit([f for m in messages if m is not None for f in m.files])

    def abort(self, messages: list[NbccCommitMessage | None]) -> None:
        files = [f for m in messages if m is not None for f in m.files]
        self.txn.rollback(files, partitions=_partition_folders(self.storage, len(self.config.partition_by)))


def _partition_folders(storage: Storage, depth: int) -> list[str]:
    """Every partition folder (found by listing: only a rollback does this, never a read)."""
    level = [""]
    for _ in range(depth):
        nxt = []
        for parent in level:
            for name in storage.list_names(parent):
                if "=" in name and not name.startswith("."):
                    nxt.append(f"{parent}/{name}" if parent else name)
        level = nxt
    return level
