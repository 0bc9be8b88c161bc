"""Compact an nbcc table on Spark (one task per file group): a spark-submit job configured by
`spark.nbcc.*` confs. Writers keep writing while it runs.

    spark-submit --properties-file spark_conf/nbcc-defaults.conf \\
        --conf spark.nbcc.path=/data/orders examples/compact.py

Job settings: spark.nbcc.path (required), spark.nbcc.instant (re-run a scheduled compaction, e.g.
after a crash), spark.nbcc.schedule_only (true: only schedule); spark.nbcc.storage.* go to
fsspec. Compactions left pending by a crashed run are finished first.
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession

import nbcc
from pyspark_nbcc import compact, options_from_conf


def main() -> None:
    spark = SparkSession.builder.appName("nbcc-compact").getOrCreate()
    options = options_from_conf(spark)
    path = options.pop("path", None)
    if not path:
        sys.exit("missing --conf spark.nbcc.path=...")
    instant = options.pop("instant", None)
    schedule_only = options.pop("schedule_only", "false").strip().lower() == "true"
    storage = {k: v for k, v in options.items() if k.startswith("storage.")}
    unknown = sorted(set(options) - set(storage))
    if unknown:
        sys.exit(f"unknown settings for this job: {', '.join('spark.nbcc.' + k for k in unknown)}")
    if instant is None and not schedule_only:
        table = nbcc.Table.open(path, {k[len("storage."):]: v for k, v in storage.items()})
        for pending in table.pending_compactions():
            print(f"finishing compaction {pending}, left pending by an earlier run")
            compact(spark, path, instant=pending, **storage)
    done = compact(spark, path, instant=instant, schedule_only=schedule_only, **storage)
    print(f"compaction {done} {'scheduled' if schedule_only else 'completed'}" if done else "nothing to compact")
    spark.stop()


if __name__ == "__main__":
    main()
