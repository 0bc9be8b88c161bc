"""The floor of Spark's Python data source API, measured in the same run as nbcc.

Do-nothing-else sources: a writer that only counts the Arrow batches Spark hands it (or, given
option `path`, only writes them to one Parquet file per task, encoded as nbcc encodes a data
column), and a reader that only reads a list of Parquet files and yields their batches, in as
many input partitions as nbcc uses. nbcc's figure minus the floor's is what nbcc itself costs;
the floor against Spark's own Parquet source is what any Python source costs (issue 5's targets
(1) and (3) are ratios to Spark's Parquet source, so this shows how much of each ratio is the
API's, and for writes how much is writing Parquet from Python at all).
"""

from __future__ import annotations

import json
import os
import uuid
from typing import Iterator

import pyarrow as pa
import pyarrow.parquet as pq
from pyspark.sql.datasource import (DataSource, DataSourceArrowWriter, DataSourceReader, InputPartition,
                                    WriterCommitMessage)

from nbcc.writer import column_encodings, parquet_writer

NAME = "nbcc_bench_floor"


class _Files(InputPartition):
    def __init__(self, paths: list[str]):
        self.paths = paths


class _Reader(DataSourceReader):
    def __init__(self, paths: list[str], columns: list[str], nullable: list[bool], partitions: int):
        self.paths, self.columns, self.nullable, self.n = paths, columns, nullable, partitions

    def partitions(self) -> list[InputPartition]:
        return [_Files(self.paths[i::self.n]) for i in range(self.n) if self.paths[i::self.n]]

    def read(self, partition: _Files) -> Iterator[pa.RecordBatch]:
        for path in partition.paths:
            table = pq.read_table(path, columns=self.columns, memory_map=True)
            # Spark checks nullability too (the files' columns are all nullable, the key is not).
            schema = pa.schema([f.with_nullable(n) for f, n in zip(table.schema, self.nullable)])
            yield from table.cast(schema).to_batches()


class _Writer(DataSourceArrowWriter):
    def __init__(self, path: str | None):
        self.path = path

    def write(self, iterator: Iterator[pa.RecordBatch]) -> WriterCommitMessage:
        if self.path is None:
            rows = 0
            for batch in iterator:
                rows += batch.num_rows
            return WriterCommitMessage()
        writer = None
        for batch in iterator:
            if writer is None:  # encoded as nbcc encodes its data columns
                writer = parquet_writer(os.path.join(self.path, f"{uuid.uuid4().hex}.parquet"), batch.schema,
                                        column_encodings(batch.schema, pa.Table.from_batches([batch])))
            writer.write_batch(batch)
        if writer is not None:
            writer.close()
        return WriterCommitMessage()


class FloorSource(DataSource):
    """Reading: a schema given with `.schema()`, and options `paths` (JSON list of Parquet files)
    and `partitions`. Writing: option `path` (an existing folder) to write Parquet files there."""

    @classmethod
    def name(cls) -> str:
        return NAME

    def reader(self, schema):
        return _Reader(json.loads(self.options["paths"]), schema.fieldNames(), [f.nullable for f in schema.fields],
                       int(self.options["partitions"]))

    def writer(self, schema, overwrite):
        return _Writer(self.options.get("path"))


def register(spark) -> None:
    """Register the source, pickled by value: Spark's Python workers cannot import bench/."""
    import sys

    from pyspark import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    spark.dataSource.register(FloorSource)
