"""Bad input gets a clear error that says what is wrong, and nothing is written or lost."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa
import pytest

import nbcc
from nbcc.errors import DataFileError, InvalidOptionError, SchemaError, TableNotFoundError

SCHEMA = pa.schema([("id", pa.int64()), ("name", pa.string()), ("ts", pa.int64())])


def _files(root: str) -> set[str]:
    """Every file under the table root (data and metadata), relative to it."""
    out = set()
    for folder, _, names in os.walk(root):
        for n in names:
            out.add(os.path.relpath(os.path.join(folder, n), root))
    return {f for f in out if not f.startswith(".nbcc/lock/")}  # lock state moves with every time issued


@pytest.fixture
def table(local_table):
    uri, _ = local_table
    t = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=2)
    t.write(pa.table({"id": [1, 2], "name": ["a", "b"], "ts": [1, 1]}))
    return t


def _unchanged(table, before_files, before_rows):
    assert _files(table.uri) == before_files
    assert table.read().sort_by("id").to_pylist() == before_rows


def test_create_without_record_key(local_table):
    uri, _ = local_table
    with pytest.raises(SchemaError, match="record_key is required"):
        nbcc.Table.create(uri, SCHEMA, None)
    assert not Path(uri).exists()


def test_null_record_key_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="record key column 'id' has 1 null"):
        table.write(pa.table({"id": [3, None], "name": ["c", "d"], "ts": [1, 1]}))
    _unchanged(table, files, rows)


def test_missing_ordering_field_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="ordering_field column 'ts'"):
        table.write(pa.table({"id": [3], "name": ["c"]}))
    _unchanged(table, files, rows)


def test_null_ordering_value_in_upsert_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="ordering_field 'ts' has 1 null"):
        table.write(pa.table({"id": [3, 4], "name": ["c", "d"], "ts": [1, None]}))
    _unchanged(table, files, rows)


def test_changed_type_writes_nothing(table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    with pytest.raises(SchemaError, match="column 'name' has type int64 in the data but string in the table"):
        table.write(pa.table({"id": [3], "name": [5], "ts": [1]}))
    _unchanged(table, files, rows)


def test_missing_non_nullable_column_writes_nothing(local_table):
    uri, _ = local_table
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("must", pa.string(), nullable=False)])
    t = nbcc.Table.create(uri, schema, "id")
    t.write(pa.table({"id": [1], "must": ["x"]}, schema=schema))
    files = _files(uri)
    with pytest.raises(SchemaError, match="column 'must' .*not nullable.* missing"):
        t.write(pa.table({"id": [2]}))
    assert _files(uri) == files


def test_null_in_non_nullable_column_writes_nothing(local_table):
    uri, _ = local_table
    schema = pa.schema([pa.field("id", pa.int64()), pa.field("must", pa.string(), nullable=False)])
    t = nbcc.Table.create(uri, schema, "id")
    files = _files(uri)
    with pytest.raises(SchemaError, match="column 'must' is not nullable"):
        t.write(pa.table({"id": [1, 2], "must": ["x", None]}))
    assert _files(uri) == files


def test_new_nullable_column_is_added_and_older_rows_read_null(table):
    table.write(pa.table({"id": [3], "name": ["c"], "ts": [1], "extra": [2.5]}))
    got = table.read().sort_by("id")
    assert got.schema.names == ["id", "name", "ts", "extra"]
    assert got.column("extra").to_pylist() == [None, None, 2.5]


def test_reserved_column_name_is_refused(table):
    with pytest.raises(SchemaError, match="reserved prefix '_nbcc_'"):
        table.write(pa.table({"id": [3], "name": ["c"], "ts": [1], "_nbcc_commit_time": ["x"]}))


def test_reading_a_uri_that_is_not_a_table(tmp_path):
    with pytest.raises(TableNotFoundError, match="is not an nbcc table"):
        nbcc.Table.open(str(tmp_path))


def _data_files(table):
    return [(s.partition, n) for s in table.file_slices() for n in s.file_names()]


def test_missing_committed_file_fails_the_read_and_names_it(table):
    _, name = _data_files(table)[0]
    os.remove(os.path.join(table.uri, name))
    with pytest.raises(DataFileError, match=f"{name} is missing"):
        table.read()


def test_corrupt_committed_file_fails_the_read_and_names_it(table):
    _, name = _data_files(table)[0]
    path = os.path.join(table.uri, name)
    Path(path).write_bytes(Path(path).read_bytes()[: 40])
    with pytest.raises(DataFileError, match=f"{name} cannot be read"):
        table.read()


def test_stream_that_fails_part_way_leaves_its_instant_inflight_and_invisible(table):
    rows = table.read().sort_by("id").to_pylist()

    def batches():
        yield pa.record_batch({"id": [10, 11], "name": ["x", "y"], "ts": [5, 5]})
        yield pa.record_batch({"id": [12, None], "name": ["z", "w"], "ts": [5, 5]})

    with pytest.raises(SchemaError, match="null"):
        table.write(batches())
    states = [(i.action, i.state) for i in table.timeline()]
    assert states == [("deltacommit", "completed"), ("deltacommit", "inflight")]
    assert table.read().sort_by("id").to_pylist() == rows


def test_option_that_contradicts_the_table(table):
    with pytest.raises(InvalidOptionError, match="buckets=4 differs from the table's buckets=2"):
        nbcc.Table.open_or_create(table.uri, SCHEMA, buckets=4)


# -- through Spark -----------------------------------------------------------------------------

def test_spark_unknown_option_lists_valid_ones_and_writes_nothing(spark, tmp_path):
    uri = str(tmp_path / "t")
    df = spark.createDataFrame([(1, "a")], "id long, name string")
    with pytest.raises(Exception, match=r"unknown write option\(s\): recordkey\. Valid write options: .*record_key"):
        df.write.format("nbcc").mode("append").option("recordkey", "id").save(uri)
    assert not Path(uri).exists()
    df.write.format("nbcc").mode("append").option("record_key", "id").save(uri)
    with pytest.raises(Exception, match=r"unknown read option\(s\): as_of_typo"):
        spark.read.format("nbcc").option("as_of_typo", "1").load(uri).collect()


def test_spark_first_write_without_record_key(spark, tmp_path):
    uri = str(tmp_path / "t")
    with pytest.raises(Exception, match="record_key is required"):
        spark.createDataFrame([(1, "a")], "id long, name string").write.format("nbcc").mode("append").save(uri)
    assert not Path(uri, ".nbcc").exists()


def test_spark_read_of_a_uri_that_is_not_a_table(spark, tmp_path):
    with pytest.raises(Exception, match="is not an nbcc table"):
        spark.read.format("nbcc").load(str(tmp_path)).collect()


def test_spark_write_failing_in_a_task_is_rolled_back(spark, table):
    files, rows = _files(table.uri), table.read().sort_by("id").to_pylist()
    bad = spark.createDataFrame([(3, "c", 1), (None, "d", 1)], "id long, name string, ts long")
    with pytest.raises(Exception, match="record key column 'id' has 1 null"):
        bad.write.format("nbcc").mode("append").save(table.uri)
    # abort rolled the instant back at once: no data file left, the same rows, and the instant
    # marked rolled back on the timeline (its only trace).
    marks = _files(table.uri) - files
    assert len(marks) == 1 and next(iter(marks)).endswith(".deltacommit.rolledback")
    assert [i.state for i in table.timeline()] == ["completed", "rolledback"]
    assert table.read().sort_by("id").to_pylist() == rows


def test_spark_read_of_a_missing_file_names_it(spark, table):
    _, name = _data_files(table)[0]
    os.remove(os.path.join(table.uri, name))
    with pytest.raises(Exception, match=f"{name} is missing"):
        spark.read.format("nbcc").load(table.uri).collect()
