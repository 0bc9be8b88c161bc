"""Compaction on Spark (one task per file group), as a spark-submit job, and the inline trigger."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pyarrow as pa
import pytest

import nbcc
import pyspark_nbcc

ROOT = Path(__file__).resolve().parents[1]


def _rows(spark, uri):
    return sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).collect())


def _write(spark, uri, lo, hi, factor, **options):
    w = spark.range(lo, hi).selectExpr("id", f"id * {factor} as v").write.format("nbcc").mode("append")
    for k, v in options.items():
        w = w.option(k, str(v))
    w.save(uri)


def test_distributed_compaction_one_task_per_file_group(spark, local_table):
    uri, _ = local_table
    _write(spark, uri, 0, 1000, 2, record_key="id", buckets=4)
    _write(spark, uri, 500, 1500, 3)
    expected = [(i, i * 2) for i in range(500)] + [(i, i * 3) for i in range(500, 1500)]
    assert _rows(spark, uri) == expected
    tc = pyspark_nbcc.compact(spark, uri)
    table = nbcc.Table.open(uri)
    done = table.timeline()[-1]
    assert (done.instant, done.action, done.state) == (tc, "commit", "completed")
    slices = table.file_slices()
    assert len(slices) == 4 and all(s.base_file and s.base_instant == tc and not s.log_files for s in slices)
    assert len({s.base_file.split("_")[1] for s in slices}) == 4  # one token per task
    assert _rows(spark, uri) == expected
    assert pyspark_nbcc.compact(spark, uri) is None  # nothing left to compact


def test_scheduled_compaction_is_finished_by_a_later_run(spark, local_table):
    uri, _ = local_table
    _write(spark, uri, 0, 100, 1, record_key="id", buckets=2)
    tc = pyspark_nbcc.compact(spark, uri, schedule_only=True)
    _write(spark, uri, 50, 150, 5)  # a write lands while the compaction is pending
    expected = [(i, i) for i in range(50)] + [(i, i * 5) for i in range(50, 150)]
    assert _rows(spark, uri) == expected
    assert nbcc.Table.open(uri).pending_compactions() == [tc]
    assert pyspark_nbcc.compact(spark, uri, instant=tc) == tc
    assert nbcc.Table.open(uri).pending_compactions() == []
    assert _rows(spark, uri) == expected


def test_compaction_job_leaves_a_compaction_being_executed_elsewhere(spark, local_table, caplog):
    uri, _ = local_table
    _write(spark, uri, 0, 100, 1, record_key="id", buckets=2)
    table = nbcc.Table.open(uri)
    tc = table.schedule_compaction()
    nbcc.heartbeat.beat(table.storage, tc)  # another process executes it
    with caplog.at_level("WARNING", logger="nbcc.compaction"):
        assert pyspark_nbcc.compact(spark, uri) is None
    assert f"compaction {tc} is being executed by another process" in caplog.text
    assert table.pending_compactions() == [tc]
    assert pyspark_nbcc.compact(spark, uri, instant=tc) == tc  # asked for by name: run
    assert table.pending_compactions() == []
    assert _rows(spark, uri) == [(i, i) for i in range(100)]


def test_inline_trigger_through_spark_and_python(spark, local_table):
    uri, _ = local_table
    for n in range(3):
        _write(spark, uri, n * 10, n * 10 + 20, n + 1, record_key="id", buckets=2, compaction_delta_commits=3)
    actions = [(i.action, i.state) for i in nbcc.Table.open(uri).timeline()]
    assert actions[-1] == ("compaction", "requested")  # scheduled after the 3rd commit, not run
    table = nbcc.Table.open(uri)
    [scheduled] = table.pending_compactions()
    # The compaction job finishes it; its plan covers every log file, so there is nothing new.
    assert pyspark_nbcc.compact(spark, uri) == scheduled
    assert table.pending_compactions() == [] and all(not s.log_files for s in table.file_slices())
    table.write(pa.table({"id": [1000], "v": [1]}), compaction_delta_commits=1, compaction_inline=True)
    last = table.timeline()[-1]
    assert (last.action, last.state) == ("commit", "completed")
    assert dict(_rows(spark, uri))[1000] == 1 and len(_rows(spark, uri)) == 41


def test_compaction_job_with_spark_submit(tmp_path):
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id", buckets=2)
    table.write(pa.table({"id": [1, 2, 3], "v": ["a", "b", "c"]}))
    table.write(pa.table({"id": [2], "v": ["B"]}))
    # The shared properties file with its table options uncommented, as README tells users to:
    # the compaction job ignores them.
    properties = tmp_path / "nbcc.conf"
    properties.write_text((ROOT / "spark_conf/nbcc-defaults.conf").read_text()
                          + "spark.nbcc.record_key id\nspark.nbcc.buckets 2\nspark.nbcc.compaction_inline true\n")
    spark_submit = Path(sys.executable).with_name("spark-submit")
    cmd = [str(spark_submit), "--master", "local[1]", "--properties-file", str(properties),
           "--conf", f"spark.nbcc.path={uri}", str(ROOT / "examples/compact.py")]
    done = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PYSPARK_PYTHON=sys.executable),
                          timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "completed" in done.stdout
    assert [s.base_file is not None for s in table.file_slices()] == [True, True]
    assert table.read().sort_by("id").to_pydict() == {"id": [1, 2, 3], "v": ["a", "B", "c"]}


def test_compact_checks_the_instant_before_using_spark(tmp_path):
    """A wrong `instant` is a clear error, found on the driver before Spark is used (spark=None)."""
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id", buckets=2)
    written = table.write(pa.table({"id": [1, 2], "v": ["a", "b"]}))
    failed = table.begin_write(table.schema())
    table.rollback(failed.instant)
    tc = table.compact()
    before = table.timeline()
    for bad, message in [("yesterday", "instant='yesterday' is not a time"),
                         ("20000101000000000", f"no instant 20000101000000000 on the timeline of {uri}"),
                         (written, f"instant {written} is a completed deltacommit, not a scheduled compaction"),
                         (failed.instant, f"instant {failed.instant} is a rolledback deltacommit, not a scheduled "
                                          "compaction")]:
        with pytest.raises(nbcc.InvalidOptionError, match=re.escape(message)):
            pyspark_nbcc.compact(None, uri, instant=bad)
    with pytest.raises(nbcc.InvalidOptionError, match="not both"):
        pyspark_nbcc.compact(None, uri, instant=tc, schedule_only=True)
    assert pyspark_nbcc.compact(None, uri, instant=tc) == tc  # completed already: nothing to run
    assert table.timeline() == before
