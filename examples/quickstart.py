"""Quickstart: two writers upsert overlapping keys into one nbcc table at the same time.

One writer is a Spark job (df.write.format("nbcc")), the other the Python API (nbcc.Table), each
in its own thread. Neither waits for the other or retries: records hash to fixed buckets, each
writer appends its own log files, and readers merge by record key. Then the merged snapshot and
the timeline (instant and completion time of every commit) are printed.

    python examples/quickstart.py [--path DIR]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import pyarrow as pa
from pyspark.sql import SparkSession, functions as F

import nbcc
from pyspark_nbcc import configure, set_active_session

os.environ.setdefault("PYSPARK_PYTHON", sys.executable)


def spark_writer(spark: SparkSession, uri: str, errors: list) -> None:
    """Keys 0..5999, three commits, event time 10, 20, 30."""
    try:
        set_active_session(spark)  # some pyspark releases look data sources up per thread
        for ts in (10, 20, 30):
            df = (spark.range(0, 6000).withColumnRenamed("id", "order_id")
                  .withColumn("status", F.lit(f"spark@{ts}"))
                  .withColumn("ts", F.lit(ts).cast("long")))
            df.write.format("nbcc").mode("append").save(uri)
    except Exception as exc:  # noqa: BLE001 - reported after join
        errors.append(exc)


def python_writer(uri: str, errors: list, stats: list) -> None:
    """Keys 3000..8999, three commits, event time 15, 25, 35, made while Spark's first commit
    is in flight: they start after it and complete before it."""
    try:
        table = nbcc.Table.open(uri)
        deadline = time.time() + 120
        while not any(i.state != "completed" for i in table.timeline()) and time.time() < deadline:
            time.sleep(0.01)
        for ts in (15, 25, 35):
            ids = pa.array(range(3000, 9000), pa.int64())
            table.write(pa.table({"order_id": ids,
                                  "status": pa.array([f"python@{ts}"] * len(ids)),
                                  "ts": pa.array([ts] * len(ids), pa.int64())}))
        stats.append(table.clock.stats)
    except Exception as exc:  # noqa: BLE001
        errors.append(exc)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", help="table location (default: a new temporary folder)")
    args = parser.parse_args()
    uri = args.path or os.path.join(tempfile.mkdtemp(prefix="nbcc-quickstart-"), "orders")

    # nbcc's Spark properties (spark_conf/nbcc-defaults.conf, installed with the package).
    spark = (configure(SparkSession.builder.master("local[2]").appName("nbcc-quickstart"))
             .config("spark.ui.enabled", "false").config("spark.ui.showConsoleProgress", "false")
             .getOrCreate())
    spark.sparkContext.setLogLevel("ERROR")
    spark.range(1).count()  # start the JVM's executors before the writers race

    schema = pa.schema([("order_id", pa.int64()), ("status", pa.string()), ("ts", pa.int64())])
    nbcc.Table.create(uri, schema, record_key="order_id", ordering_field="ts", buckets=4)
    print(f"table: {uri}\n")

    errors: list = []
    lock_stats: list = []
    writers = [threading.Thread(target=spark_writer, args=(spark, uri, errors)),
               threading.Thread(target=python_writer, args=(uri, errors, lock_stats))]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    if errors:
        raise errors[0]

    df = spark.read.format("nbcc").load(uri)
    print(f"merged snapshot: {df.count()} rows (keys 0..8999; the greatest ts wins where writers overlap)")
    df.groupBy("status").count().orderBy("status").show(truncate=False)
    df.where("order_id between 2998 and 3001 or order_id between 5998 and 6001").orderBy("order_id").show()

    print("timeline (every commit: its start instant and its completion time; readers go by")
    print("completion time, so a commit that started first but completed last is still seen):")
    print(f"  {'instant':<19}{'action':<14}{'state':<11}completion")
    for i in nbcc.Table.open(uri).timeline():
        print(f"  {i.instant:<19}{i.action:<14}{i.state:<11}{i.completion}")
    for s in lock_stats:
        print(f"\ntable lock, Python writer: {s.acquisitions} lock holds (two per commit: its instant, its completion), longest hold {s.max_hold_ms:.1f} ms, "
              f"longest wait {s.max_wait_ms:.1f} ms, lost races {s.cas_conflicts}")
    spark.stop()


if __name__ == "__main__":
    main()
