"""Reads across time: time travel, incremental and CDC queries, read-optimized reads, meta columns
and filters, through Spark and through the Python API.

    python examples/time_travel.py [--path DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import pyarrow as pa
from pyspark.sql import SparkSession

import nbcc

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="table location (default: a new temporary folder)")
    uri = parser.parse_args().path or os.path.join(tempfile.mkdtemp(prefix="nbcc-time-travel-"), "accounts")

    spark = (SparkSession.builder.master("local[2]").appName("nbcc-time-travel")
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .config("spark.sql.session.timeZone", "UTC")
             .config("spark.sql.python.filterPushdown.enabled", "true")  # pruning by key, partition, stats
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")

    schema = pa.schema([("id", pa.int64()), ("owner", pa.string()), ("balance", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(uri, schema, record_key="id", ordering_field="ts", buckets=4)
    table.write(pa.table({"id": [1, 2, 3], "owner": ["ann", "bob", "cy"], "balance": [100, 200, 300], "ts": [1, 1, 1]}))
    table.write(pa.table({"id": [2, 4], "owner": ["bob", "dee"], "balance": [250, 400], "ts": [2, 2]}))
    first, second = [i.completion for i in table.timeline()]
    table.write(pa.table({"id": [1]}), operation="delete")
    table.compact()
    table.write(pa.table({"id": [3], "owner": ["cy"], "balance": [330], "ts": [3]}))

    def show(title, df):
        print(f"\n== {title}")
        df.orderBy(df.columns[0]).show(truncate=False)

    def read():  # a fresh reader each time: DataFrameReader options accumulate
        return spark.read.format("nbcc")

    show("snapshot", read().load(uri))
    show(f"as_of {first} (time travel to the first commit)", read().option("as_of", first).load(uri))
    show("incremental: keys changed after the first commit, as they are now",
         read().option("query_type", "incremental").option("begin", first).load(uri))
    show("cdc: the same changes, before and after",
         read().option("query_type", "incremental").option("begin", first).option("incremental_format", "cdc")
         .load(uri).selectExpr("id", "_change_type", "before.balance AS balance_before", "after.balance AS balance_after",
                     "_nbcc_completion_time"))
    show("read_optimized: base files only (the last commit is not compacted yet)",
         read().option("query_type", "read_optimized").load(uri))
    show("meta columns", read().option("include_meta_columns", "true").load(uri)
         .select("id", "_nbcc_commit_time", "_nbcc_completion_time", "_nbcc_file_group"))
    lookup = read().load(uri).where("id = 3")
    print(f"\n== point lookup id = 3 reads {lookup.rdd.getNumPartitions()} of {table.config.buckets} file groups")
    lookup.show()

    print("== the same through the Python API")
    print("as_of:", table.read(as_of=second).sort_by("id").to_pylist())
    print("filter:", table.read(filter=[("balance", ">=", 300)]).sort_by("id").to_pylist())
    spark.stop()


if __name__ == "__main__":
    main()
