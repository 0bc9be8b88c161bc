"""What a write accepts and what it refuses before anything is written, through the Python API
and through Spark: nullability that a Spark DataFrame marks by accident, nulls nested where the
table allows none, option combinations checked before a first write creates its table; and the
error a batch read gives for a bad option."""

from __future__ import annotations

import datetime as dt
from pathlib import Path

import pyarrow as pa
import pytest

import nbcc
from nbcc.errors import InvalidOptionError, SchemaError


def test_a_table_created_by_spark_does_not_keep_the_dataframes_incidental_not_null_marks(spark, tmp_path):
    # Literals and array(...) elements are "not null" in Spark; Spark's Parquet and Delta tables
    # make written columns nullable, and so does a table created by a first Spark write.
    uri = str(tmp_path / "t")
    first = spark.sql("select 1L id, 1L ts, date'2024-01-01' d, array(1, 2) xs, named_struct('a', 1) s")
    first.write.format("nbcc").option("record_key", "id").option("ordering_field", "ts").mode("append").save(uri)
    later = spark.sql("select 2L id, 2L ts, cast(null as date) d, array(3, null) xs, named_struct('a', cast(null as int)) s")
    later.write.format("nbcc").mode("append").save(uri)
    spark.sql("select 3L id, 3L ts").write.format("nbcc").mode("append").save(uri)  # d, xs, s left out
    rows = {r["id"]: r for r in spark.read.format("nbcc").load(uri).collect()}
    assert rows[1]["d"] == dt.date(2024, 1, 1) and rows[1]["xs"] == [1, 2] and rows[1]["s"]["a"] == 1
    assert rows[2]["d"] is None and rows[2]["xs"] == [3, None] and rows[2]["s"]["a"] is None
    assert rows[3]["d"] is None and rows[3]["xs"] is None


def test_a_null_nested_where_the_table_allows_none_writes_nothing(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("xs", pa.list_(pa.field("item", pa.int64(), nullable=False)))])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id")
    table.write(pa.table({"id": [1], "xs": [[1, 2]]}, schema=schema))
    with pytest.raises(SchemaError, match="column 'xs' holds a null inside a value where the table's type"):
        table.write(pa.table({"id": [2], "xs": pa.array([[3, None]], pa.list_(pa.int64()))}))
    assert [i.state for i in table.timeline()] == ["completed"]  # refused before an instant began
    assert table.read().to_pylist() == [{"id": 1, "xs": [1, 2]}]


def test_a_first_spark_write_with_options_that_cannot_go_together_creates_no_table(spark, tmp_path):
    uri = tmp_path / "t"
    df = spark.sql("select 1L id, 1L ts")
    with pytest.raises(Exception, match="operation=delete cannot be combined with overwrite mode"):
        df.write.format("nbcc").option("record_key", "id").option("operation", "delete").mode("overwrite").save(str(uri))
    with pytest.raises(Exception, match="option 'operation' must be one of upsert, delete, delete_partition; got 'merge'"):
        df.write.format("nbcc").option("record_key", "id").option("operation", "merge").mode("append").save(str(uri))
    assert not Path(uri).exists() or not any(Path(uri).rglob("*"))
    with pytest.raises(InvalidOptionError, match="operation=delete cannot be combined"):
        nbcc.Table.create(str(tmp_path / "py"), pa.schema([("id", pa.int64())]), "id").write(
            pa.table({"id": [1]}), operation="delete", mode="overwrite")


def test_a_batch_read_option_error_is_not_mixed_with_the_stream_readers(spark, tmp_path):
    # schema() serves readStream too; a batch-only option (as_of) means a batch read was meant.
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id").write(pa.table({"id": [1]}))
    with pytest.raises(Exception, match="as_of='yesterday' is not a time") as err:
        spark.read.format("nbcc").option("as_of", "yesterday").load(uri).collect()
    assert "readStream" not in str(err.value) and "unknown streaming read option" not in str(err.value)


class _ArrowStreamExporter:
    """Data of another library (Polars, pandas 2.2+, DuckDB): it only exports an Arrow stream
    through the PyCapsule interface."""

    def __init__(self, table: pa.Table):
        self.table = table

    def __arrow_c_stream__(self, requested_schema=None):
        return self.table.__arrow_c_stream__(requested_schema)


def test_data_that_exports_an_arrow_stream_is_written_as_one(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("name", pa.string()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts")
    table.write(_ArrowStreamExporter(pa.table({"id": [1, 2], "name": ["a", "b"], "ts": [1, 1]}, schema=schema)))
    table.write(_ArrowStreamExporter(pa.table({"id": [2], "name": ["b2"], "ts": [2]}, schema=schema)))
    assert sorted(table.read().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "name": "a", "ts": 1}, {"id": 2, "name": "b2", "ts": 2}]
    # Read as a stream: a bad row rolls the write back, and the rows stay as they were.
    with pytest.raises(SchemaError, match="record key column 'id' has 1 null value"):
        table.write(_ArrowStreamExporter(pa.table({"id": [None], "name": ["x"], "ts": [3]}, schema=schema)))
    assert table.timeline()[-1].state == "rolledback" and table.read().num_rows == 2
    with pytest.raises(InvalidOptionError, match=r"or export an Arrow stream \(__arrow_c_stream__"):
        table.write(42)
