"""Helpers for Spark jobs that write nbcc tables."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any, Sequence

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession, functions as F

from nbcc import Table
from nbcc.buckets import bucket_ids_for_columns
from nbcc.config import DEFAULT_BUCKETS
from nbcc.compaction import (compact_file_group, compaction_heartbeat, compaction_to_run,
                             complete_compaction, run_compactions)
from nbcc.config import parse_options
from nbcc.errors import InvalidOptionError, TableNotFoundError
from nbcc.filenames import make_token
from nbcc.indexing import DEFAULT_TIMEOUT_S, build_index as _build_index, index_instants
from nbcc.metadata_table import KINDS
from nbcc.timeline import is_completed, read_compaction_plan

CONF_PREFIX = "spark.nbcc."
_BUCKET_COL = "_nbcc_bucket"


def set_active_session(spark: SparkSession) -> None:
    """Make `spark` the JVM's active session in the calling thread.

    Spark finds Python data sources through the JVM's active session, which is per thread. pyspark
    4.3 falls back to the default session in a thread started by the job (threading.Thread); where
    a release does not, `format("nbcc")` fails there with DATA_SOURCE_NOT_FOUND: call this first
    in such a thread."""
    spark._jvm.org.apache.spark.sql.SparkSession.setActiveSession(spark._jsparkSession)


def spark_conf_path() -> Path:
    """The Spark properties file for nbcc jobs (the repository's `spark_conf/nbcc-defaults.conf`),
    installed with the package: `spark-submit --properties-file "$(python -c 'import
    pyspark_nbcc; print(pyspark_nbcc.spark_conf_path())')" ...`."""
    return Path(__file__).with_name("nbcc-defaults.conf")


def spark_conf() -> dict[str, str]:
    """The Spark properties that `spark_conf_path()` sets (its comments say why each)."""
    conf = {}
    for line in spark_conf_path().read_text().splitlines():
        # A properties file's line: key, then whitespace, `=` or `:`, then the value.
        prop = re.fullmatch(r"([^\s=:#!][^\s=:]*)\s*[\s=:]\s*(.*?)\s*", line)
        if prop:
            conf[prop[1]] = prop[2]
    return conf


def configure(builder: SparkSession.Builder) -> SparkSession.Builder:
    """`builder` with nbcc's Spark properties (`spark_conf()`) set, as a `--properties-file` of
    them would set them, for a session started from Python (delta-spark's
    `configure_spark_with_delta_pip` works the same way). Call it before the process starts its
    first session: the driver's Java options take effect only when its JVM starts.
    `spark_conf()["spark.driver.extraJavaOptions"]` replaces any set before; set yours after this,
    with its two flags added."""
    for key, value in spark_conf().items():
        builder = builder.config(key, value)
    return builder


def options_from_conf(spark: SparkSession, prefix: str = CONF_PREFIX) -> dict[str, str]:
    """`spark.nbcc.<option>` session confs as data source options (`<option>` -> value).

    A Python data source never sees `--conf` values, only `.option()` ones; a job calls this on
    the driver and passes the result to `.options(**...)`."""
    return {k[len(prefix):]: v for k, v in spark.conf.getAll.items() if k.startswith(prefix) and len(k) > len(prefix)}


def repartition_by_bucket(df: DataFrame, *, record_key: str | Sequence[str] | None = None,
                          buckets: int | None = None, partition_by: str | Sequence[str] | None = None,
                          path: str | None = None, storage_options: dict[str, Any] | None = None,
                          num_partitions: int | None = None, **options: Any) -> DataFrame:
    """`df` repartitioned so that every (table partition, bucket) is in exactly one Spark
    partition: a write then makes one log file per bucket (plus rollovers), not one per task.

    The table layout comes from the table at `path` if it exists, else from the arguments.
    `options`: `storage.*` options, as the write's (`**opts` of the README's S3 section), or
    `storage_options` without the prefix."""
    storage_options = {**(storage_options or {}), **parse_options(options, {}, "repartition_by_bucket")[1]}
    if path is not None:
        try:
            cfg = Table.open(path, storage_options).config
            record_key = record_key or list(cfg.record_key)
            buckets = buckets or cfg.buckets
            partition_by = partition_by if partition_by is not None else list(cfg.partition_by)
        except TableNotFoundError:
            pass
    keys = [record_key] if isinstance(record_key, str) else list(record_key or [])
    keys = [k.strip() for key in keys for k in key.split(",") if k.strip()]
    if not keys:
        raise InvalidOptionError("repartition_by_bucket needs record_key (or the path of an existing table)")
    parts = [partition_by] if isinstance(partition_by, str) else list(partition_by or [])
    parts = [p.strip() for part in parts for p in part.split(",") if p.strip()]
    n_buckets = int(buckets or DEFAULT_BUCKETS)

    # An Arrow UDF (no pandas needed) computing the bucket exactly as the writer does.
    @F.arrow_udf("int")
    def bucket_of(keys: pa.Array) -> pa.Array:
        columns = [keys.field(i) for i in range(keys.type.num_fields)]
        return pa.array(bucket_ids_for_columns(columns, n_buckets), pa.int32())

    with_bucket = df.withColumn(_BUCKET_COL, bucket_of(F.struct(*keys)))
    n = num_partitions or n_buckets
    return with_bucket.repartition(n, *parts, _BUCKET_COL).drop(_BUCKET_COL)


def compact(spark: SparkSession, uri: str, *, instant: str | None = None, schedule_only: bool = False,
            **options: Any) -> str | None:
    """Compact the table at `uri` on Spark, one task per file group, as `Table.compact` does in
    one process: finish the compactions scheduled earlier (by a write's compaction_delta_commits,
    by schedule_only, or left by a run that crashed), oldest first, but for one that another
    process is executing (a fresh heartbeat: left to it, with a warning), then schedule and run
    a new one. Returns the instant of the last compaction run (None if there was nothing to
    compact).

    `schedule_only=True` only schedules one (on the driver, under the table lock) and returns its
    instant; `instant=tc` runs (or finishes) that one alone, whatever its heartbeat says, and
    returns it at once if it is completed already. Each task merges one file group into a base
    file with a token of its own (a run id, the task index and its task attempt id), and the
    driver completes the instant.
    `options` are `storage.*` options (as for reads and writes)."""
    if instant is not None and schedule_only:
        raise InvalidOptionError("give instant (run a scheduled compaction) or schedule_only=True (schedule "
                                 "a new one), not both")
    _, storage_options = parse_options(options, {}, "compaction")
    table = Table.open(uri, storage_options)
    if instant is not None:
        return _run_on_spark(spark, table, compaction_to_run(table.storage, instant).instant)
    if schedule_only:
        return table.schedule_compaction()
    ran = run_compactions(table.storage, table.config, table.clock, lambda tc, _: _run_on_spark(spark, table, tc))
    return ran[-1] if ran else None


def _run_on_spark(spark: SparkSession, table: Table, tc: str) -> str:
    """Execute scheduled compaction `tc`, one Spark task per file group (unless another run
    completed it meanwhile); `tc`."""
    if is_completed(table.storage, tc):
        return tc
    operations = read_compaction_plan(table.storage, tc)["operations"]
    storage, config, run_id = table.storage, table.config, random.randrange(2**31)

    def merge_group(indexed: tuple[int, dict]) -> dict:
        from pyspark import TaskContext

        index, op = indexed
        ctx = TaskContext.get()
        token = make_token(run_id, index, ctx.taskAttemptId() if ctx else 0)  # unique in the application
        return compact_file_group(storage, config, tc, op, token)

    rdd = spark.sparkContext.parallelize(list(enumerate(operations)), max(1, len(operations)))
    with compaction_heartbeat(table.storage, config, tc):  # the driver's, for the whole job
        try:
            files = rdd.map(merge_group).collect()
        except Exception:
            if is_completed(table.storage, tc):
                return tc  # another run completed it, and a clean deleted the inputs: nothing was lost
            raise
        complete_compaction(table.storage, table.clock, tc, files)  # None: another run completed it
    return tc


def build_index(spark: SparkSession, uri: str, partitions: str | Sequence[str] = KINDS, *,
                timeout_s: float = DEFAULT_TIMEOUT_S, **options: Any) -> dict[str, Any]:
    """Build metadata table partitions of the table at `uri` on Spark (see `Table.build_index`):
    the driver schedules the indexing (or resumes a pending one); the instants written before it
    are indexed by Spark tasks, a chunk of instants each, every task writing its entries as its
    own commit of the metadata table (its writers never conflict); the driver then catches up
    with the writes that completed meanwhile and completes it. `options`: `storage.*` options."""
    _, storage_options = parse_options(options, {}, "indexing")
    table = Table.open(uri, storage_options)
    storage = table.storage

    def execute(kinds: Sequence[str], chunks: list[list[str]], indexed: dict[str, set[str]]) -> None:
        wanted = list(kinds)
        # Each task gets what is covered of its own chunk only, and indexes just the partitions
        # an instant lacks (not every partition again).
        work = [(chunk, {k: indexed[k] & set(chunk) for k in wanted}) for chunk in chunks]
        rdd = spark.sparkContext.parallelize(work, len(work))
        rdd.map(lambda w: index_instants(storage, wanted, w[0], w[1])).collect()

    return _build_index(storage, table.clock, partitions, timeout_s, execute=execute)
