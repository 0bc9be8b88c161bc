"""Spark end to end: df.write.format("nbcc") and spark.read.format("nbcc"), on local disk and on a
real S3 API (moto on loopback)."""

from __future__ import annotations

import datetime as dt
import json
import os
import re
import subprocess
import sys
from decimal import Decimal
from pathlib import Path

import pyarrow as pa
import pytest
from chispa import assert_df_equality
from pyspark.sql import Row, functions as F

import nbcc
from nbcc.timeline import read_commit_metadata
from pyspark_nbcc import options_from_conf, repartition_by_bucket

ROOT = Path(__file__).resolve().parents[1]
SCHEMA = "id long, name string, price double, day date, ts timestamp, seq long"


def _rows(ids, name, seq, price=1.5):
    return [(i, f"{name}-{i}", price * i, dt.date(2026, 11, 1 + i % 20),
             dt.datetime(2026, 11, 21, 10, 0, i % 60), seq) for i in ids]


def _writer(df, uri, opts, mode="append"):
    w = df.write.format("nbcc").mode(mode)
    for k, v in opts.items():
        w = w.option(f"storage.{k}", v)
    return w


def _reader(spark, opts):
    r = spark.read.format("nbcc")
    for k, v in opts.items():
        r = r.option(f"storage.{k}", v)
    return r


def test_upsert_and_delete_round_trip(spark, any_table):
    uri, opts = any_table
    first = spark.createDataFrame(_rows(range(0, 40), "a", seq=1), SCHEMA)
    (_writer(first, uri, opts).option("record_key", "id").option("ordering_field", "seq")
     .option("buckets", "4").save(uri))
    # Overlapping keys: 20..39 updated by a newer seq, 40..59 inserted, 0..4 carry an older seq.
    second = spark.createDataFrame(_rows(range(20, 60), "b", seq=2) + _rows(range(0, 5), "old", seq=0), SCHEMA)
    _writer(second, uri, opts).save(uri)
    _writer(spark.createDataFrame([(7,), (45,)], "id long"), uri, opts).option("operation", "delete").save(uri)

    expected = spark.createDataFrame(
        [r for r in _rows(range(0, 20), "a", seq=1) if r[0] != 7]
        + [r for r in _rows(range(20, 60), "b", seq=2) if r[0] != 45], SCHEMA)
    actual = _reader(spark, opts).load(uri)
    assert_df_equality(actual, expected, ignore_row_order=True, ignore_nullable=True)

    table = nbcc.Table.open(uri, opts)
    commits = [i for i in table.timeline() if i.state == "completed"]
    assert len(commits) == 3
    assert all(i.completion > i.instant for i in commits)


def test_a_thread_the_job_starts_writes_and_reads_without_set_active_session(spark, local_table):
    # README "Writing from threads": the thread has no active session of its own.
    import threading

    uri, _ = local_table
    done: list = []

    def job() -> None:
        try:
            spark.createDataFrame([(1, 10), (2, 20)], "id long, v long").write.format("nbcc").mode("append") \
                .option("record_key", "id").save(uri)
            done.append(sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).collect()))
        except Exception as exc:  # noqa: BLE001 - asserted below
            done.append(exc)

    thread = threading.Thread(target=job)
    thread.start()
    thread.join()
    assert done == [[(1, 10), (2, 20)]]


def test_a_first_write_with_the_delete_flag_creates_the_table_without_it(spark, local_table):
    # A table loaded from a change feed: its first batch already flags deleted keys (Hudi's
    # _hoodie_is_deleted). The flag is not a column of the table.
    uri, _ = local_table
    feed = spark.createDataFrame([(1, 10, False), (2, 20, True), (3, 30, None)], "id long, ts long, _nbcc_is_deleted boolean")
    feed.write.format("nbcc").mode("append").option("record_key", "id").option("ordering_field", "ts").save(uri)
    assert nbcc.Table.open(uri).schema().names == ["id", "ts"]
    assert sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).collect()) == [(1, 10), (3, 30)]
    with pytest.raises(nbcc.SchemaError, match="'_nbcc_is_deleted' is not a column a table holds: leave it out"):
        nbcc.Table.create(uri + "-2", pa.schema([("id", pa.int64()), ("_nbcc_is_deleted", pa.bool_())]), "id")


def test_schema_errors_of_a_spark_write_name_spark_types_and_the_cast(spark, local_table):
    # The core's messages name Arrow types (timestamp[us, tz=UTC], list<element: int32>), which a
    # Spark user never sees: the Spark write adds the column's Spark types and the cast that fits.
    uri, _ = local_table
    spark.sql("SELECT 1L AS id, TIMESTAMP '2026-11-20 10:00:00' AS at, array(1, 2) AS xs").write.format("nbcc") \
        .mode("append").option("record_key", "id").save(uri)
    for query, words in [
        ("SELECT 2L AS id, TIMESTAMP_NTZ '2026-11-20 10:00:00' AS at, array(1, 2) AS xs",
         "`at` is timestamp_ntz in the data and timestamp in the table: cast(`at` AS timestamp)"),
        ("SELECT 2L AS id, TIMESTAMP '2026-11-20 10:00:00' AS at, array(1L, 2L) AS xs",
         "`xs` is array<bigint> in the data and array<int> in the table: cast(`xs` AS array<int>)"),
    ]:
        with pytest.raises(Exception, match=re.escape(f"(in Spark's types: {words})")):
            spark.sql(query).write.format("nbcc").mode("append").save(uri)
    # A column of untyped nulls on a first write: there is no table type yet.
    with pytest.raises(Exception, match=re.escape("`n` is void (untyped nulls): give it a type, e.g. cast(null AS string)")):
        spark.sql("SELECT 1L AS id, NULL AS n").write.format("nbcc").mode("append").option("record_key", "id") \
            .save(uri + "-2")
    assert sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).select("id").collect()) == [(1,)]


def test_schema_seen_by_spark_is_the_tables(spark, local_table):
    uri, _ = local_table
    df = spark.createDataFrame(_rows(range(3), "a", seq=1), SCHEMA)
    df.write.format("nbcc").mode("append").option("record_key", "id").save(uri)
    read = spark.read.format("nbcc").load(uri)
    assert [(f.name, f.dataType.simpleString()) for f in read.schema] == [
        ("id", "bigint"), ("name", "string"), ("price", "double"), ("day", "date"),
        ("ts", "timestamp"), ("seq", "bigint")]
    assert not read.schema["id"].nullable  # record keys are never null



def test_a_schema_given_to_a_read_may_leave_columns_out_but_not_misname_them(spark, local_table):
    uri, _ = local_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("amount", pa.int64())]), "id") \
        .write(pa.table({"id": [1, 2], "ts": [1, 1], "amount": [10, 20]}))
    some = spark.read.format("nbcc").schema("id long, amount long").load(uri)
    assert sorted(tuple(r) for r in some.collect()) == [(1, 10), (2, 20)]
    with pytest.raises(Exception, match=r"names column 'amount_usd', which this read does not have "
                                        r"\(its columns: id, ts, amount\)"):
        spark.read.format("nbcc").schema("id long, ts long, amount_usd long").load(uri).collect()
    with pytest.raises(Exception, match=r"names column 'ID', which the table spells 'id'"):
        spark.read.format("nbcc").schema("ID long, ts long").load(uri).collect()
    # A column the table has now reads as null as of a time before it was added.
    first = nbcc.Table.open(uri).timeline()[0].completion
    nbcc.Table.open(uri).write(pa.table({"id": [3], "ts": [2], "amount": [30], "note": ["new"]}))
    then = spark.read.format("nbcc").schema("id long, note string").option("as_of", first).load(uri)
    assert sorted(tuple(r) for r in then.collect()) == [(1, None), (2, None)]


def test_a_schema_given_to_a_read_may_read_a_number_as_another_but_not_change_a_columns_kind(spark, local_table):
    # Reading an int column as text, or text as an int, changed values silently; Spark's Parquet
    # source fails such a read. A number may be read as another numeric type, cast and checked.
    uri, _ = local_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("n", pa.int32()), ("x", pa.float32()),
                                      ("s", pa.string()), ("d", pa.decimal128(10, 2)), ("day", pa.date32())]), "id") \
        .write(pa.table({"id": [1], "n": pa.array([7], pa.int32()), "x": pa.array([0.5], pa.float32()), "s": ["a"],
                         "d": pa.array([Decimal("1.25")], pa.decimal128(10, 2)), "day": [dt.date(2026, 11, 28)]}))
    assert spark.read.format("nbcc").schema("id long, n long, x double, s string, d decimal(10,2)").load(uri) \
        .collect() == [Row(id=1, n=7, x=0.5, s="a", d=Decimal("1.25"))]
    assert spark.read.format("nbcc").schema("id int, n double, d decimal(12,2)").load(uri).collect() == \
        [Row(id=1, n=7.0, d=Decimal("1.25"))]
    with pytest.raises(Exception, match=r"column 'd' .* cannot be read as"):  # checked: 1.25 has two decimals
        spark.read.format("nbcc").schema("id long, d decimal(10,1)").load(uri).collect()
    for given, column, asked, have in [("id long, n string", "n", "string", "int"),
                                       ("id long, x float, s int", "s", "int", "string"),
                                       ("id long, day timestamp", "day", "timestamp", "date"),
                                       ("id long, s date", "s", "date", "string")]:
        with pytest.raises(Exception, match=rf"reads column '{column}' as {asked}, but the table's '{column}' is "
                                            rf"{have}; give {have}(?: \(or another numeric type\))?, or leave"):
            spark.read.format("nbcc").schema(given).load(uri).collect()
    with pytest.raises(Exception, match=r"give bigint \(or another numeric type\), or leave \.schema\(\.\.\.\) out"):
        spark.read.format("nbcc").schema("id string").load(uri).collect()


def test_sql_reads_and_upserts_through_a_temporary_view(spark, local_table):
    uri, _ = local_table
    (spark.createDataFrame(_rows(range(3), "a", seq=1), SCHEMA).write.format("nbcc").mode("append")
     .option("record_key", "id").option("ordering_field", "seq").save(uri))
    first = nbcc.Table.open(uri).timeline()[-1].completion
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW nbcc_sql_orders USING nbcc OPTIONS (path '{uri}')")
    spark.sql("INSERT INTO nbcc_sql_orders SELECT id, 'b', price, day, ts, 2 FROM nbcc_sql_orders WHERE id < 2")
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW nbcc_sql_orders USING nbcc OPTIONS (path '{uri}')")  # a view keeps its first query's plan
    spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW nbcc_sql_then USING nbcc OPTIONS (path '{uri}', as_of '{first}')")
    try:
        now = spark.sql("SELECT id, name, seq FROM nbcc_sql_orders ORDER BY id").collect()
        then = spark.sql("SELECT id, name, seq FROM nbcc_sql_then ORDER BY id").collect()
    finally:
        spark.catalog.dropTempView("nbcc_sql_orders")
        spark.catalog.dropTempView("nbcc_sql_then")
    assert [tuple(r) for r in now] == [(0, "b", 2), (1, "b", 2), (2, "a-2", 1)]
    assert [tuple(r) for r in then] == [(0, "a-0", 1), (1, "a-1", 1), (2, "a-2", 1)]


def test_overwrite_replaces_earlier_commits_only(spark, local_table):
    uri, _ = local_table
    spark.createDataFrame(_rows(range(10), "a", seq=1), SCHEMA).write.format("nbcc").mode("append") \
        .option("record_key", "id").save(uri)
    spark.createDataFrame(_rows(range(100, 103), "o", seq=1), SCHEMA).write.format("nbcc") \
        .mode("overwrite").save(uri)
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == [100, 101, 102]
    # Writes that complete after the overwrite are visible.
    spark.createDataFrame(_rows([5, 101], "n", seq=2), SCHEMA).write.format("nbcc").mode("append").save(uri)
    got = {r.id: r.name for r in spark.read.format("nbcc").load(uri).collect()}
    assert got == {5: "n-5", 100: "o-100", 101: "n-101", 102: "o-102"}
    actions = [i.action for i in nbcc.Table.open(uri).timeline()]
    assert actions == ["deltacommit", "replacecommit", "deltacommit"]


def test_dynamic_partition_overwrite_replaces_only_the_partitions_written(spark, local_table):
    uri, _ = local_table
    df = spark.createDataFrame([(i, f"a-{i}", f"d{i % 3}") for i in range(9)], "id long, v string, day string")
    df.write.format("nbcc").mode("append").option("record_key", "id").option("partition_by", "day").save(uri)
    new = spark.createDataFrame([(0, "o-0", "d0"), (30, "o-30", "d0"), (1, "o-1", "d1")], "id long, v string, day string")
    # Spark's option name, as for its file sources and Delta; values in any letter case.
    new.write.format("nbcc").mode("overwrite").option("partitionOverwriteMode", "DYNAMIC").save(uri)
    got = {(r.id, r.v) for r in spark.read.format("nbcc").load(uri).collect()}
    assert got == {(0, "o-0"), (30, "o-30"), (1, "o-1"), (2, "a-2"), (5, "a-5"), (8, "a-8")}  # d2 kept
    assert nbcc.Table.open(uri).timeline()[-1].action == "replacepartitions"
    with pytest.raises(Exception, match="'partitionOverwriteMode' must be one of static, dynamic; got 'partition'"):
        new.write.format("nbcc").mode("overwrite").option("partitionOverwriteMode", "partition").save(uri)
    assert len(nbcc.Table.open(uri).timeline()) == 2  # nothing written
    with pytest.raises(Exception, match="give either replaceWhere .* or partitionOverwriteMode=dynamic"):
        new.write.format("nbcc").mode("overwrite").option("replaceWhere", "day = 'd0'") \
            .option("partitionOverwriteMode", "dynamic").save(uri)
    with pytest.raises(Exception, match=r"partitionoverwritemode: write option\(s\), for df.write \(in SQL, a "
                                        r"view's OPTIONS are read options too"):
        spark.sql(f"CREATE OR REPLACE TEMPORARY VIEW nbcc_dpo USING nbcc OPTIONS (path '{uri}', "
                  "partitionOverwriteMode 'dynamic')")
    assert len(nbcc.Table.open(uri).timeline()) == 2  # nothing written
    new.filter("id = 1").write.format("nbcc").mode("overwrite").option("partitionOverwriteMode", "static").save(uri)
    assert [r.id for r in spark.read.format("nbcc").load(uri).collect()] == [1]


def test_replace_where_replaces_the_matching_partitions_and_every_row_must_match(spark, local_table):
    uri, _ = local_table
    df = spark.createDataFrame([(i, f"a-{i}", f"d{i % 5}") for i in range(10)], "id long, v string, day string")
    df.write.format("nbcc").mode("append").option("record_key", "id").option("partition_by", "day").save(uri)
    # Delta's form: d1, d2 and d3 are replaced, d3 with no rows (emptied); d0 and d4 keep theirs.
    new = spark.createDataFrame([(100, "n", "d1"), (101, "n", "d2")], "id long, v string, day string").repartition(2)
    new.write.format("nbcc").mode("overwrite").option("replaceWhere", "day BETWEEN 'd1' AND 'd3'") \
        .option("userMetadata", "rebuild d1-d3").save(uri)
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == [0, 4, 5, 9, 100, 101]
    done = nbcc.Table.open(uri).timeline()[-1]
    meta = read_commit_metadata(nbcc.Table.open(uri).storage, done)
    assert (done.action, meta["operation"], meta["replaced_partitions"]) == \
        ("replacepartitions", "overwrite", ["day=d1", "day=d2", "day=d3"])
    [latest] = nbcc.Table.open(uri).history(limit=1)  # what nbcc history shows of it
    assert (latest.instant, latest.rows, latest.partitions, latest.parameters) == (
        done.instant, 2, ("day=d1", "day=d2", "day=d3"),
        {"user_metadata": "rebuild d1-d3", "replace_where": "day BETWEEN 'd1' AND 'd3'",
         "replaced_partitions": ["day=d1", "day=d2", "day=d3"]})
    # A row outside the condition fails the job, and its instant is rolled back: nothing changes.
    timeline = nbcc.Table.open(uri).timeline()
    with pytest.raises(Exception, match=r"[12] row\(s\) do not match replaceWhere \"day = 'd0'\" \(one has day=d[12]\)"):
        new.write.format("nbcc").mode("overwrite").option("replaceWhere", "day = 'd0'").save(uri)
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == [0, 4, 5, 9, 100, 101]
    assert [i.state for i in nbcc.Table.open(uri).timeline()] == [i.state for i in timeline] + ["rolledback"]
    with pytest.raises(Exception, match="replaceWhere goes with mode overwrite"):
        new.write.format("nbcc").mode("append").option("replaceWhere", "day = 'd1'").save(uri)
    with pytest.raises(Exception, match="partitionOverwriteMode=dynamic goes with mode overwrite"):
        new.write.format("nbcc").mode("append").option("partitionOverwriteMode", "dynamic").save(uri)
    with pytest.raises(Exception, match=r"filter column\(s\) \['v'\] are not partition columns"):
        new.write.format("nbcc").mode("overwrite").option("replaceWhere", "v = 'n'").save(uri)
    assert len(nbcc.Table.open(uri).timeline()) == len(timeline) + 1
    # A condition it cannot read is refused before a first write creates the table.
    fresh = os.path.join(os.path.dirname(uri), "fresh")
    with pytest.raises(Exception, match="is not a condition it can read .*replaceWhere takes conditions"):
        new.write.format("nbcc").mode("overwrite").option("record_key", "id").option("partition_by", "day") \
            .option("replaceWhere", "day = 'd1' OR day = 'd2'").save(fresh)
    assert not os.path.exists(fresh)


def test_operation_delete_partition_deletes_the_partitions_of_the_rows_and_needs_a_table(spark, local_table, tmp_path):
    uri, _ = local_table
    df = spark.createDataFrame([(i, f"a-{i}", f"d{i % 3}") for i in range(9)], "id long, v string, day string")
    df.write.format("nbcc").mode("append").option("record_key", "id").option("partition_by", "day").save(uri)
    version = json.loads((Path(uri) / ".nbcc" / "table.json").read_text())["format_version"]
    # No rows name no partition: nothing is committed, and older nbcc may still read the table.
    spark.createDataFrame([], "day string").write.format("nbcc").mode("append") \
        .option("operation", "delete_partition").save(uri)
    assert [i.action for i in nbcc.Table.open(uri).timeline()] == ["deltacommit"]
    assert not list((Path(uri) / ".nbcc" / "timeline").glob("*replacepartitions*"))
    assert json.loads((Path(uri) / ".nbcc" / "table.json").read_text())["format_version"] == version < 3
    # The README's form: only the partition column, several tasks, a value named twice and one with no rows.
    days = spark.createDataFrame([("d0",), ("d1",), ("d0",), ("d9",)], "day string").repartition(3)
    days.write.format("nbcc").mode("append").option("operation", "DELETE_PARTITION").save(uri)
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == [2, 5, 8]
    done = nbcc.Table.open(uri).timeline()[-1]
    assert done.action == "replacepartitions"
    meta = read_commit_metadata(nbcc.Table.open(uri).storage, done)
    assert (meta["operation"], meta["files"], meta["replaced_partitions"]) == \
        ("delete_partition", [], ["day=d0", "day=d1", "day=d9"])
    spark.createDataFrame([(0, "n-0", "d0")], "id long, v string, day string").write.format("nbcc") \
        .mode("append").save(uri)  # the partition takes rows again
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == [0, 2, 5, 8]
    # It never creates a table, and a table option that differs is refused as for any write.
    missing = str(tmp_path / "missing")
    with pytest.raises(Exception, match=r"operation=delete_partition: .*missing is not an nbcc table \(no "
                                        r"\.nbcc/table\.json\), so it has no partitions to delete"):
        days.write.format("nbcc").mode("append").option("operation", "delete_partition").save(missing)
    assert not os.path.exists(os.path.join(missing, ".nbcc"))
    with pytest.raises(Exception, match="option buckets=3 differs from the table's buckets=16"):
        days.write.format("nbcc").mode("append").option("operation", "delete_partition").option("buckets", "3") \
            .save(uri)
    with pytest.raises(Exception, match="operation=delete_partition cannot be combined with overwrite mode"):
        days.write.format("nbcc").mode("overwrite").option("operation", "delete_partition").save(uri)
    assert len(nbcc.Table.open(uri).timeline()) == 3  # nothing written


def test_delete_where_recipe_one_job_reads_the_matching_keys_and_deletes_them(spark, local_table):
    # The README's DELETE ... WHERE: the read's plan is fixed before the delete's instant begins.
    uri, _ = local_table
    df = spark.createDataFrame([(i, "test" if i % 3 == 0 else "ok", f"d{i % 2}") for i in range(12)],
                               "id long, status string, day string")
    df.write.format("nbcc").mode("append").option("record_key", "id").option("partition_by", "day").save(uri)
    (spark.read.format("nbcc").load(uri).where("status = 'test'").select("id", "day")
        .write.format("nbcc").mode("append").option("operation", "delete").save(uri))
    assert sorted(r.id for r in spark.read.format("nbcc").load(uri).collect()) == \
        [i for i in range(12) if i % 3 != 0]
    assert [i.action for i in nbcc.Table.open(uri).timeline()] == ["deltacommit", "deltacommit"]


def test_restore_recipe_one_job_reads_the_table_as_of_a_time_and_overwrites_it(spark, local_table):
    # The README's restore: the read's plan holds the files as of `good`, which the overwrite
    # leaves in place until it completes and a clean passes them.
    uri, _ = local_table
    spark.createDataFrame(_rows(range(6), "a", seq=1), SCHEMA).write.format("nbcc").mode("append") \
        .option("record_key", "id").option("ordering_field", "seq").save(uri)
    good = nbcc.Table.open(uri).timeline()[-1].completion
    expected = sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).collect())
    spark.createDataFrame(_rows(range(3, 9), "bad", seq=2), SCHEMA).write.format("nbcc").mode("append").save(uri)
    spark.read.format("nbcc").option("as_of", good).load(uri) \
        .write.format("nbcc").mode("overwrite").save(uri)
    assert sorted(tuple(r) for r in spark.read.format("nbcc").load(uri).collect()) == expected
    assert [i.action for i in nbcc.Table.open(uri).timeline()] == ["deltacommit", "deltacommit", "replacecommit"]


def test_partitioned_table_layout_and_read(spark, any_table):
    uri, opts = any_table
    df = spark.createDataFrame(
        [(i, f"r{i}", "2026-11-21" if i % 2 else "2026/11/22 x") for i in range(20)], "id long, v string, day string")
    _writer(df, uri, opts).option("record_key", "id").option("partition_by", "day").option("buckets", "2").save(uri)
    _writer(spark.createDataFrame([(3, "new", "2026-11-21")], "id long, v string, day string"), uri, opts).save(uri)
    table = nbcc.Table.open(uri, opts)
    partitions = {s.partition for s in table.file_slices()}
    assert partitions == {"day=2026-11-21", "day=2026%2F11%2F22%20x"}
    got = {(r.id, r.v, r.day) for r in _reader(spark, opts).load(uri).collect()}
    expected = {(i, "new" if i == 3 else f"r{i}", "2026-11-21" if i % 2 else "2026/11/22 x") for i in range(20)}
    assert got == expected


def _log_files_of_last_commit(uri):
    table = nbcc.Table.open(uri)
    last = [i for i in table.timeline() if i.state == "completed"][-1]
    meta = json.loads(Path(uri, ".nbcc/timeline", f"{last.instant}_{last.completion}.{last.action}").read_bytes())
    return meta["files"]


def test_one_log_file_per_bucket_per_task_and_repartition_helper(spark, local_table):
    uri, _ = local_table
    df = spark.range(0, 2000).withColumn("v", F.col("id") * 2).repartition(3)
    df.write.format("nbcc").mode("append").option("record_key", "id").option("buckets", "4").save(uri)
    files = _log_files_of_last_commit(uri)
    per_task = {}
    for f in files:
        token = f["name"].rsplit("_", 1)[1]
        per_task.setdefault(token, []).append(f["file_group"])
    assert len(per_task) == 3  # three tasks wrote
    assert all(len(groups) == len(set(groups)) <= 4 for groups in per_task.values())
    # The third number is the task attempt's id, unique in the application: a resubmitted
    # stage numbers its attempts from 0 again, so attempt numbers would repeat a zombie's names.
    assert len({token.split("-")[2] for token in per_task}) == 3, sorted(per_task)

    repartition_by_bucket(df, path=uri).write.format("nbcc").mode("append").save(uri)
    files = _log_files_of_last_commit(uri)
    groups = [f["file_group"] for f in files]
    assert sorted(groups) == sorted(set(groups)) and len(groups) == 4  # one file per bucket
    assert spark.read.format("nbcc").load(uri).count() == 2000


def test_repartition_helper_takes_the_writes_storage_options(spark, s3_table):
    # As compact and build_index do: the README's **opts serve every Spark call on an S3 table.
    uri, opts = s3_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.int64())]), "id", buckets=5, storage_options=opts)
    spark_opts = {f"storage.{k}": v for k, v in opts.items()}
    df = spark.range(0, 500).withColumn("v", F.col("id") * 2).repartition(3)
    repartition_by_bucket(df, path=uri, **spark_opts).write.format("nbcc").options(**spark_opts).mode("append").save(uri)
    table = nbcc.Table.open(uri, opts)
    last = [i for i in table.timeline() if i.state == "completed"][-1]
    groups = [f["file_group"] for f in read_commit_metadata(table.storage, last)["files"]]
    assert sorted(groups) == sorted(set(groups)) and len(groups) == 5  # the table's layout, read from S3
    assert table.read().num_rows == 500
    with pytest.raises(nbcc.InvalidOptionError, match="unknown repartition_by_bucket option"):
        repartition_by_bucket(df, path=uri, endpoint_url=opts["endpoint_url"])


def test_log_files_roll_over(spark, local_table):
    uri, _ = local_table
    df = spark.range(0, 20000).withColumn("payload", F.sha2(F.col("id").cast("string"), 256)).coalesce(1)
    (df.write.format("nbcc").mode("append").option("record_key", "id").option("buckets", "1")
     .option("max_log_file_bytes", "200000").save(uri))
    names = [f["name"] for f in _log_files_of_last_commit(uri)]
    versions = sorted(int(n.split(".log.")[1].split("_")[0]) for n in names)
    assert versions == list(range(1, len(names) + 1)) and len(names) > 1
    assert spark.read.format("nbcc").load(uri).count() == 20000


def test_schema_evolution_adds_nullable_column(spark, local_table):
    uri, _ = local_table
    spark.createDataFrame([(1, "a"), (2, "b")], "id long, v string").write.format("nbcc").mode("append") \
        .option("record_key", "id").save(uri)
    spark.createDataFrame([(3, "c", 3.5)], "id long, v string, extra double").write.format("nbcc") \
        .mode("append").save(uri)
    got = sorted(spark.read.format("nbcc").load(uri).collect(), key=lambda r: r.id)
    assert got == [Row(id=1, v="a", extra=None), Row(id=2, v="b", extra=None), Row(id=3, v="c", extra=3.5)]


def test_wider_data_widens_columns_and_a_dataframe_loaded_before_refuses_to_read(spark, local_table):
    # Spark's DataFrames type their columns by what they compute: an int column of one job is a
    # bigint in the next. Given type_widening, the write widens the column (format.md §4.2).
    uri, _ = local_table
    spark.createDataFrame([(1, 1, 1.5)], "id int, n int, x float").write.format("nbcc").mode("append") \
        .option("record_key", "id").save(uri)
    loaded = spark.read.format("nbcc").load(uri)  # takes the table's columns; plans at its first action
    wider = spark.createDataFrame([(2, 3_000_000_000, 0.1)], "id long, n long, x double")
    with pytest.raises(Exception, match=r"column 'id' has type int64 in the data but int32 in the table; cast it to "
                                        r"int32 before writing, or widen the column to int64 with the write option "
                                        r"type_widening=true"):
        wider.write.format("nbcc").mode("append").save(uri)
    wider.write.format("nbcc").mode("append").option("type_widening", "true").save(uri)
    # Read as its old types, n would overflow and x lose digits: the DataFrame says so instead.
    with pytest.raises(Exception, match=r"the table widened column\(s\) id \(int -> bigint\), n \(int -> "
                                        r"bigint\), x \(float -> double\) since this DataFrame was loaded.*load "
                                        r"the DataFrame again"):
        loaded.collect()
    df = spark.read.format("nbcc").load(uri)
    assert df.schema.simpleString() == "struct<id:bigint,n:bigint,x:double>"
    assert sorted(df.collect()) == [Row(id=1, n=1, x=1.5), Row(id=2, n=3_000_000_000, x=0.1)]
    assert df.filter("id = 2").collect() == [Row(id=2, n=3_000_000_000, x=0.1)]
    # Columns given with .schema(...) are the reader's choice: read as given.
    assert sorted(spark.read.format("nbcc").schema("id long, x double").load(uri).collect()) == \
        [Row(id=1, x=1.5), Row(id=2, x=0.1)]


def test_a_column_added_from_literals_takes_nulls_later(spark, local_table):
    # Spark marks struct(lit(...)) fields and array(lit(...)) elements not null. A column a later
    # write added kept those marks: every read failed on the older rows' null struct, and every
    # write of a null element was refused. Added columns are nullable at every depth, as created ones.
    from pyspark.sql import functions as F

    uri, _ = local_table
    spark.createDataFrame([(1,)], "id long").write.format("nbcc").mode("append").option("record_key", "id").save(uri)
    (spark.createDataFrame([(2,)], "id long").withColumn("st", F.struct(F.lit(1).alias("a")))
        .withColumn("tags", F.array(F.lit("x"))).write.format("nbcc").mode("append").save(uri))
    spark.createDataFrame([(3, None, ["y", None])], "id long, st struct<a int>, tags array<string>") \
        .write.format("nbcc").mode("append").save(uri)
    spark.createDataFrame([(4,)], "id long").write.format("nbcc").mode("append").save(uri)
    got = sorted(spark.read.format("nbcc").load(uri).collect(), key=lambda r: r.id)
    assert got == [Row(id=1, st=None, tags=None), Row(id=2, st=Row(a=1), tags=["x"]),
                   Row(id=3, st=None, tags=["y", None]), Row(id=4, st=None, tags=None)]


def test_a_variant_column_is_refused_and_nothing_is_written(spark, local_table):
    from pyspark.sql import functions as F

    uri, _ = local_table
    df = spark.createDataFrame([(1, '{"a": 1}')], "id long, j string")
    df.write.format("nbcc").mode("append").option("record_key", "id").save(uri)
    before = nbcc.Table.open(uri).timeline()
    with pytest.raises(Exception, match=r"column\(s\) v, m\{value\}\[\] have Spark's VARIANT type.*to_json\(col\)"):
        (df.withColumn("v", F.parse_json("j")).withColumn("m", F.create_map(F.lit("k"), F.array(F.parse_json("j"))))
           .write.format("nbcc").mode("append").save(uri))
    assert nbcc.Table.open(uri).timeline() == before
    df.withColumn("v", F.to_json(F.parse_json("j"))).write.format("nbcc").mode("append").save(uri)  # as it says
    assert [r.v for r in spark.read.format("nbcc").load(uri).collect()] == ['{"a":1}']
    # A delete ignores the columns the table lacks, VARIANT ones too.
    df.withColumn("w", F.parse_json("j")).write.format("nbcc").mode("append").option("operation", "delete").save(uri)
    assert spark.read.format("nbcc").load(uri).count() == 0


def test_partial_update_joins_writers_columns(spark, local_table):
    uri, _ = local_table
    schema = "id long, a string, b string"
    spark.createDataFrame([(1, "a1", None), (2, "a2", None)], schema).write.format("nbcc").mode("append") \
        .option("record_key", "id").option("merge_mode", "partial_update").save(uri)
    spark.createDataFrame([(1, None, "b1"), (3, None, "b3")], schema).write.format("nbcc").mode("append").save(uri)
    got = sorted(spark.read.format("nbcc").load(uri).collect(), key=lambda r: r.id)
    assert got == [Row(id=1, a="a1", b="b1"), Row(id=2, a="a2", b=None), Row(id=3, a=None, b="b3")]


def test_spark_reads_what_the_python_api_wrote(spark, local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, pa.schema([("k", pa.string()), ("n", pa.int32())]), "k", buckets=3)
    table.write(pa.table({"k": ["x", "y", "z"], "n": pa.array([1, 2, 3], pa.int32())}))
    table.write(pa.table({"k": ["y"], "n": pa.array([20], pa.int32())}))
    expected = spark.createDataFrame([("x", 1), ("y", 20), ("z", 3)], "k string, n int")
    assert_df_equality(spark.read.format("nbcc").load(uri), expected, ignore_row_order=True, ignore_nullable=True)


def test_spark_reads_nanosecond_times_the_python_api_wrote_as_microseconds(spark, local_table):
    # pandas and Polars write timestamp[ns]; Spark keeps microseconds and cuts the rest, as its
    # own sources do (the read used to fail: "would lose data").
    uri, _ = local_table
    ns = pa.timestamp("ns", tz="UTC")
    table = nbcc.Table.create(uri, pa.schema([("k", pa.int64()), ("at", ns), ("took", pa.duration("ns"))]), "k")
    table.write(pa.table({"k": [1], "at": pa.array([1_700_000_000_123_456_789], ns),
                          "took": pa.array([1_500_999], pa.duration("ns"))}))
    (row,) = spark.read.format("nbcc").load(uri).collect()
    assert row.at == dt.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=dt.timezone.utc).astimezone().replace(tzinfo=None)
    assert row.took == dt.timedelta(microseconds=1500)


def test_a_column_spark_cannot_read_is_named(spark, local_table):
    uri, _ = local_table
    nbcc.Table.create(uri, pa.schema([("k", pa.int64()), ("t", pa.time32("s"))]), "k")
    with pytest.raises(Exception, match=r"column 't' has type time32\[s\], which Spark cannot read"):
        spark.read.format("nbcc").load(uri).collect()


def test_options_from_conf(spark):
    spark.conf.set("spark.nbcc.record_key", "id")
    spark.conf.set("spark.nbcc.storage.endpoint_url", "http://127.0.0.1:1")
    try:
        opts = options_from_conf(spark)
        assert opts["record_key"] == "id"
        assert opts["storage.endpoint_url"] == "http://127.0.0.1:1"
        assert not any(k.startswith("spark.") for k in opts)
    finally:
        spark.conf.unset("spark.nbcc.record_key")
        spark.conf.unset("spark.nbcc.storage.endpoint_url")


def test_ingest_job_with_spark_submit(tmp_path):
    """examples/ingest.py as a real spark-submit job configured by --conf spark.nbcc.*."""
    (tmp_path / "in.csv").write_text("id,v,ts\n1,a,1\n2,b,1\n2,B,2\n3,c,1\n")
    uri = str(tmp_path / "t")
    spark_submit = Path(sys.executable).with_name("spark-submit")
    cmd = [str(spark_submit), "--master", "local[1]", "--properties-file", str(ROOT / "spark_conf/nbcc-defaults.conf"),
           "--conf", f"spark.nbcc.path={uri}", "--conf", f"spark.nbcc.input={tmp_path / 'in.csv'}",
           "--conf", "spark.nbcc.record_key=id", "--conf", "spark.nbcc.ordering_field=ts",
           "--conf", "spark.nbcc.buckets=2", str(ROOT / "examples/ingest.py")]
    env = dict(os.environ, PYSPARK_PYTHON=sys.executable)
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    got = nbcc.Table.open(uri).read().sort_by("id").to_pydict()
    assert got == {"id": [1, 2, 3], "v": ["a", "B", "c"], "ts": [1, 2, 1]}
    assert nbcc.Table.open(uri).config.buckets == 2


def test_a_write_task_slow_to_produce_rows_is_not_taken_for_dead(local_table):
    # A Spark write task keeps the write's heartbeat alive while it runs, rows or not: a cleaner
    # looking for expired heartbeats all the while finds none. The task's code is run here in
    # this process (as Spark's Python worker runs it), so no process start-up is timed.
    import threading
    import time

    from pyspark.sql.types import LongType, StringType, StructField, StructType

    from pyspark_nbcc.source import DefaultSource

    # 3 s: the task beats several times per timeout, and a beat late by a second or two on a
    # loaded machine must not make a live task look dead.
    HEARTBEAT_TIMEOUT_S = 3
    uri, _ = local_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id",
                              heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S)
    writer = DefaultSource({"path": uri}).writer(
        StructType([StructField("id", LongType()), StructField("v", StringType())]), False)

    def slow_rows():
        time.sleep(2.5 * HEARTBEAT_TIMEOUT_S)  # more than two heartbeat timeouts before the first row
        yield pa.record_batch({"id": [1, 2], "v": ["a", "b"]})

    stop, rolled_back = threading.Event(), []

    def cleaner():
        while not stop.wait(0.1):
            rolled_back.extend(table.rollback_failed_writes())

    looking = threading.Thread(target=cleaner)
    looking.start()
    try:
        message = writer.write(slow_rows())
    finally:
        stop.set()
        looking.join()
    writer.commit([message])
    assert rolled_back == []
    assert table.read().num_rows == 2


def test_small_file_groups_are_packed_into_few_spark_partitions(spark, local_table):
    uri, _ = local_table
    spark.range(0, 3000).selectExpr("id", "id % 7 as v").write.format("nbcc").mode("append") \
        .option("record_key", "id").option("buckets", "8").save(uri)
    packed = spark.read.format("nbcc").load(uri)
    one_each = spark.read.format("nbcc").option("max_partition_bytes", "1").load(uri)
    assert packed.rdd.getNumPartitions() == 1  # a few KiB: one input partition
    assert one_each.rdd.getNumPartitions() == 8  # one per file group
    assert sorted(packed.collect()) == sorted(one_each.collect()) == [(i, i % 7) for i in range(3000)]


def test_pack_tasks_groups_by_size_in_plan_order():
    from nbcc.scan import ScanTask, pack_tasks

    mib = 1024 * 1024
    tasks = [ScanTask("", f"fg{i}", (), bytes=size * mib) for i, size in enumerate([10, 10, 10, 40, 5, 100, 1])]
    groups = pack_tasks(tasks, max_bytes=64 * mib, parallelism=1)
    # target = min(64, max(32, 176 / 1)) = 64 MiB per group
    assert [[t.file_group_id for t in g] for g in groups] == [["fg0", "fg1", "fg2"], ["fg3", "fg4"], ["fg5"], ["fg6"]]
    assert pack_tasks([], 1) == []


def test_pack_tasks_fills_every_core_in_the_last_wave():
    from nbcc.scan import ScanTask, pack_tasks

    mib = 1024 * 1024

    def sizes(task_mib: list[float], cores: int) -> list[int]:
        tasks = [ScanTask("", f"fg{i}", (), bytes=int(m * mib)) for i, m in enumerate(task_mib)]
        groups = pack_tasks(tasks, parallelism=cores)
        assert [t for g in groups for t in g] == tasks  # every task once, in plan order
        return [len(g) for g in groups]

    # 104 MiB over 2 cores: one wave of 2 even groups.
    assert sizes([6.5] * 16, 2) == [8, 8]
    # 67 MiB over 2 cores, 20 MiB at most: 4 even groups, not 5 + 5 + 5 + 1 (where the last two
    # run one after the other on one core).
    tasks = [ScanTask("", f"fg{i}", (), bytes=int(4.2 * mib)) for i in range(16)]
    assert [len(g) for g in pack_tasks(tasks, max_bytes=20 * mib, parallelism=2)] == [4, 4, 4, 4]
    assert sizes([50] * 16, 2) == [2] * 8  # 128 MiB at most: 7 groups rounded up to 8
    assert sizes([0.01] * 8, 2) == [8]  # small: one partition
    assert sizes([0] * 3, 2) == [3]


def test_spark_reads_nanosecond_times_nested_in_lists_and_structs(spark, local_table):
    uri, _ = local_table
    ns = pa.timestamp("ns", tz="UTC")
    schema = pa.schema([("k", pa.int64()), ("ats", pa.list_(ns)), ("s", pa.struct([("at", ns)]))])
    table = nbcc.Table.create(uri, schema, "k")
    at = 1_700_000_000_123_456_789
    table.write(pa.table({"k": [1], "ats": pa.array([[at]], pa.list_(ns)),
                          "s": pa.array([{"at": at}], pa.struct([("at", ns)]))}, schema=schema))
    (row,) = spark.read.format("nbcc").load(uri).collect()
    expected = dt.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=dt.timezone.utc).astimezone().replace(tzinfo=None)
    assert row.ats == [expected] and row.s.at == expected


def test_spark_reads_unsigned_integers_widened_as_its_parquet_reader_does(spark, local_table):
    # Python writes may create or add unsigned columns; Spark has no unsigned types, and every
    # read of such a table failed. Spark's Parquet reader widens them: so does nbcc.
    from decimal import Decimal

    from pyspark.sql.types import DecimalType, IntegerType, LongType, ShortType

    uri, _ = local_table
    inner = pa.struct([("a", pa.uint32()), ("l", pa.list_(pa.uint16()))])
    schema = pa.schema([("k", pa.int64()), ("u8", pa.uint8()), ("s", inner),
                        ("m", pa.map_(pa.string(), pa.uint64()))])
    table = nbcc.Table.create(uri, schema, "k", buckets=2)
    table.write(pa.table({"k": [1, 2], "u8": [255, None], "s": [{"a": 2**32 - 1, "l": [65535, 0]}, None],
                          "m": [[("x", 2**64 - 1)], None]}, schema=schema))
    # A later write adds a uint64 column (rows before it read it as null).
    table.write(pa.table({"k": [3], "u64": pa.array([2**64 - 1], pa.uint64())}))
    df = spark.read.format("nbcc").load(uri)
    types = {f.name: f.dataType for f in df.schema.fields}
    assert types["u8"] == ShortType() and types["u64"] == DecimalType(20, 0)
    assert types["s"]["a"].dataType == LongType() and types["s"]["l"].dataType.elementType == IntegerType()
    assert types["m"].valueType == DecimalType(20, 0)
    rows = {r.k: r for r in df.collect()}
    assert (rows[1].u8, rows[1].s.a, rows[1].s.l, rows[1].m) == (255, 2**32 - 1, [65535, 0], {"x": Decimal(2**64 - 1)})
    assert rows[1].u64 is None and rows[2].u8 is None and rows[2].s is None
    assert rows[3].u64 == Decimal(2**64 - 1)
    pushdown = "spark.sql.python.filterPushdown.enabled"  # filters on widened columns reach nbcc
    previous = spark.conf.get(pushdown)
    spark.conf.set(pushdown, "true")
    try:
        assert [r.k for r in df.where("u8 = 255").collect()] == [1]
        assert [r.k for r in df.where("u64 > 5").collect()] == [3]
        assert [r.k for r in df.where("s.a > 5").collect()] == [1]
    finally:
        spark.conf.set(pushdown, previous)


@pytest.mark.parametrize("files, groups, warned", [(160, 16, True), (16, 16, False), (60, 4, False),
                                                   (1000, 400, False), (3200, 16, True)])
def test_a_commit_of_many_small_files_per_file_group_warns_and_says_what_to_do(caplog, files, groups, warned):
    # A shuffle before the sink (dropDuplicates in a stream) made 3,200 files a micro-batch for
    # 16 buckets, silently: every read then merged them all.
    import logging

    from pyspark_nbcc.source import warn_if_scattered

    written = [{"partition": "", "file_group": f"g{n % groups}", "name": f"f{n}"} for n in range(files)]
    logger = logging.getLogger("pyspark_nbcc.test")
    with caplog.at_level("WARNING", logger="pyspark_nbcc.test"):
        warn_if_scattered(written, "streaming batch 3 of stream s", logger)
    messages = [r.getMessage() for r in caplog.records]
    assert bool(messages) == warned
    if warned:
        assert messages[0].startswith(f"streaming batch 3 of stream s wrote {files} log files into {groups} file groups")
        assert "repartition_by_bucket" in messages[0]
