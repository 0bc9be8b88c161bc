"""Ingest files into an nbcc table: a spark-submit job configured entirely by `spark.nbcc.*` confs.

    spark-submit --properties-file spark_conf/nbcc-defaults.conf \\
        --conf spark.nbcc.path=/data/orders \\
        --conf spark.nbcc.input=/data/in/orders.parquet \\
        --conf spark.nbcc.record_key=order_id --conf spark.nbcc.ordering_field=ts \\
        examples/ingest.py

Job settings (read here, not passed to the table):
    spark.nbcc.path          the table URI (required)
    spark.nbcc.input         the file(s) or folder to read (required; Spark path syntax)
    spark.nbcc.input_format  parquet | csv | json (default: from the input's extension)
    spark.nbcc.mode          append (default) | overwrite
    spark.nbcc.repartition_by_bucket  true to write one log file per bucket (large inputs)
Every other `spark.nbcc.<option>` conf becomes a write option; an unknown one fails the job with
the list of valid options (spark_conf/nbcc-defaults.conf documents each, with its default):
    record_key, ordering_field, partition_by, buckets, merge_mode   the table's layout and merging
    lock_lease_ms, heartbeat_timeout_s    the table lock's lease (ms) and when a write counts as
                                          failed (s); like the above, fixed when the table is created
    operation                             upsert (default) | delete | delete_partition
    max_log_file_bytes                    roll a log file over past this size
    compaction_delta_commits, compaction_inline   schedule a compaction after every N delta
                                          commits (and run it in this job too if inline is true)
    partitionOverwriteMode                with mode overwrite: static (default, the whole table)
                                          | dynamic (only the partitions the input has rows in)
    replaceWhere                          with mode overwrite: replace the partitions matching
                                          this condition on partition columns (Delta's)
    userMetadata                          text recorded with the commit (nbcc history shows it)
    type_widening                         true: wider int/float data widens its column
    storage.*                             S3 options, e.g. storage.endpoint_url
"""

from __future__ import annotations

import os
import sys

from pyspark.sql import SparkSession

from pyspark_nbcc import options_from_conf, repartition_by_bucket

JOB_SETTINGS = ("path", "input", "input_format", "mode", "repartition_by_bucket")
FORMATS = {".parquet": "parquet", ".csv": "csv", ".json": "json", ".jsonl": "json"}


def input_format(path: str, explicit: str | None) -> str:
    if explicit:
        fmt = explicit.strip().lower()
        if fmt not in set(FORMATS.values()):
            sys.exit(f"spark.nbcc.input_format={explicit!r}: use parquet, csv or json")
        return fmt
    ext = os.path.splitext(path.rstrip("/"))[1].lower()
    if ext not in FORMATS:
        sys.exit(f"cannot tell the format of {path!r} from its extension: set spark.nbcc.input_format")
    return FORMATS[ext]


def main() -> None:
    spark = SparkSession.builder.appName("nbcc-ingest").getOrCreate()
    options = options_from_conf(spark)
    job = {k: options.pop(k) for k in JOB_SETTINGS if k in options}
    for required in ("path", "input"):
        if required not in job:
            sys.exit(f"missing --conf spark.nbcc.{required}=...")

    fmt = input_format(job["input"], job.get("input_format"))
    reader = spark.read.format(fmt)
    if fmt == "csv":
        reader = reader.option("header", "true").option("inferSchema", "true")
    df = reader.load(job["input"])
    if job.get("repartition_by_bucket", "false").lower() == "true":
        storage = {k[len("storage."):]: v for k, v in options.items() if k.startswith("storage.")}
        df = repartition_by_bucket(df, record_key=options.get("record_key"),
                                   buckets=options.get("buckets"),
                                   partition_by=options.get("partition_by"),
                                   path=job["path"], storage_options=storage)

    df.write.format("nbcc").mode(job.get("mode", "append")).options(**options).save(job["path"])
    print(f"ingested {job['input']} ({fmt}) into {job['path']}")
    spark.stop()


if __name__ == "__main__":
    main()
