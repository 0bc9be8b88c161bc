"""Compact an nbcc table on Spark (one task per file group): a spark-submit job configured by
`spark.nbcc.*` confs. Writers keep writing while it runs.

    spark-submit --properties-file spark_conf/nbcc-defaults.conf \\
        --conf spark.nbcc.path=/data/orders examples/compact.py

Job settings: spark.nbcc.path (required), spark.nbcc.instant (re-run a scheduled compaction, e.g.
after a crash), spark.nbcc.schedule_only (true: only schedule); spark.nbcc.storage.* are S3
options. Compactions scheduled earlier (by writes' compaction_delta_commits, or left pending by a
crashed run) are finished first, but for one another process is executing (a fresh heartbeat),
which is left to it (spark.nbcc.instant runs it regardless). The write options and
examples/ingest.py's settings that a shared properties file may set (record_key, buckets, ...,
input, mode) are ignored; any other spark.nbcc.* name fails the job, as a likely typo.
"""

from __future__ import annotations

import sys

from pyspark.sql import SparkSession

import nbcc
from nbcc.config import WRITE_OPTIONS
from pyspark_nbcc import compact, options_from_conf

JOB_SETTINGS = ("path", "instant", "schedule_only")
# Set in spark_conf/nbcc-defaults.conf for writes and for examples/ingest.py: one properties file
# serves every job, so these are no mistake here, just of no use to a compaction.
OTHER_JOBS_SETTINGS = frozenset(WRITE_OPTIONS) | {"input", "input_format", "mode", "repartition_by_bucket"}


def job_settings(options: dict[str, str]) -> tuple[str, str | None, bool, dict[str, str]]:
    """(path, instant, schedule_only, storage.* options) from the `spark.nbcc.*` confs; exits
    with a message saying what to fix if they are wrong."""
    settings = {k.strip().lower(): v for k, v in options.items()}
    path = settings.get("path")
    if not path:
        sys.exit("missing --conf spark.nbcc.path=... (the table to compact)")
    instant = settings.get("instant")
    schedule_only = settings.get("schedule_only", "false").strip().lower()
    if schedule_only not in ("true", "false"):
        sys.exit(f"spark.nbcc.schedule_only={settings['schedule_only']!r}: use true or false")
    if instant is not None and schedule_only == "true":
        sys.exit("set spark.nbcc.instant (run a scheduled compaction) or spark.nbcc.schedule_only=true "
                 "(schedule a new one), not both")
    storage = {k: v for k, v in options.items() if k.strip().lower().startswith("storage.")}
    unknown = sorted(k for k in options
                     if k not in storage and k.strip().lower() not in {*JOB_SETTINGS, *OTHER_JOBS_SETTINGS})
    if unknown:
        sys.exit(f"unknown setting(s) {', '.join('spark.nbcc.' + k for k in unknown)}: no nbcc option has this "
                 f"name. This job reads spark.nbcc.{', spark.nbcc.'.join(JOB_SETTINGS)} and "
                 "spark.nbcc.storage.<S3 option>, and ignores write options")
    return path, instant, schedule_only == "true", storage


def main() -> None:
    spark = SparkSession.builder.appName("nbcc-compact").getOrCreate()
    path, instant, schedule_only, storage = job_settings(options_from_conf(spark))
    try:  # finishes the compactions scheduled earlier first (by writes, or left by a crashed run)
        done = compact(spark, path, instant=instant, schedule_only=schedule_only, **storage)
    except nbcc.NbccError as exc:
        sys.exit(f"compaction of {path} failed: {exc}")
    print(f"compaction {done} {'scheduled' if schedule_only else 'completed'}" if done else "nothing to compact")
    spark.stop()


if __name__ == "__main__":
    main()
