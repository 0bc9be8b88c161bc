"""What a write accepts and what it refuses before anything is written, through the Python API
and through Spark: nullability that a Spark DataFrame marks by accident, nulls nested where the
table allows none, option combinations checked before a first write creates its table; and the
error a batch read gives for a bad option."""

from __future__ import annotations

import datetime as dt
import re
from decimal import Decimal
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
    with pytest.raises(InvalidOptionError, match=r"or a data frame that exports an Arrow stream \(__arrow_c_stream__"):
        table.write(42)


def test_other_libraries_types_are_stored_as_the_tables(tmp_path):
    # Polars sends categoricals as dictionaries of string views, which Arrow's cast could not
    # decode; binary views were refused by a large_binary column; pandas and DuckDB send decimals
    # of few digits, pandas nanoseconds and date64, which columns of more digits, microseconds and
    # date32 hold without loss.
    schema = pa.schema([("id", pa.int64()), ("color", pa.large_string()), ("tags", pa.struct([("c", pa.string())])),
                        ("blob", pa.large_binary()), ("blobs", pa.list_(pa.large_binary())),
                        ("price", pa.decimal128(10, 2)), ("ts", pa.timestamp("us", "UTC")), ("day", pa.date32()),
                        ("n", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id")
    category = pa.DictionaryArray.from_arrays(pa.array([1, 0, None], pa.uint32()),
                                              pa.array(["red", "blue"], pa.string_view()))
    data = pa.table({
        "id": [1, 2, 3], "color": category, "tags": pa.StructArray.from_arrays([category], names=["c"]),
        "blob": pa.array([b"a", b"", None], pa.binary_view()),
        "blobs": pa.array([[b"x"], [], None], pa.list_(pa.binary_view())),
        "price": pa.array([Decimal("9.99"), Decimal("-1.5"), None], pa.decimal128(3, 2)),
        "ts": pa.array([1_700_000_000_123_456_000, None, 0], pa.timestamp("ns", "UTC")),
        "day": pa.array([86_400_000 * 3, None, 0], pa.date64()),
        "n": pa.array([255, 0, None], pa.uint8())})
    table.write(_ArrowStreamExporter(data))
    assert [(f.name, f.type) for f in table.schema()] == [(f.name, f.type) for f in schema]
    utc = dt.timezone.utc
    assert table.read().sort_by("id").to_pylist() == [
        {"id": 1, "color": "blue", "tags": {"c": "blue"}, "blob": b"a", "blobs": [b"x"], "price": Decimal("9.99"),
         "ts": dt.datetime(2023, 11, 14, 22, 13, 20, 123456, tzinfo=utc), "day": dt.date(1970, 1, 4), "n": 255},
        {"id": 2, "color": "red", "tags": {"c": "red"}, "blob": b"", "blobs": [], "price": Decimal("-1.50"),
         "ts": None, "day": None, "n": 0},
        {"id": 3, "color": None, "tags": {"c": None}, "blob": None, "blobs": None, "price": None,
         "ts": dt.datetime(1970, 1, 1, tzinfo=utc), "day": dt.date(1970, 1, 1), "n": None}]

    # What would not fit is refused, naming the column, and nothing is written.
    before = table.read().sort_by("id")
    for column, values, problem in [
            ("ts", pa.array([1_700_000_000_123_456_789], pa.timestamp("ns", "UTC")), "would lose data"),
            ("day", pa.array([86_400_000 + 1], pa.date64()), "would lose data"),
            ("price", pa.array([Decimal("1.234")], pa.decimal128(4, 3)), "has type decimal128(4, 3) in the data"),
            ("price", pa.array([Decimal("123456789.1")], pa.decimal128(10, 1)), "has type decimal128(10, 1)"),
            ("n", pa.array([2**63], pa.uint64()), "has type uint64 in the data but int64"),
            ("ts", pa.array([0], pa.timestamp("ns")), "has type timestamp[ns] in the data")]:
        with pytest.raises(SchemaError, match=f"column '{column}'.*{re.escape(problem)}"):
            table.write(pa.table({"id": [9], column: values}))
    assert [i.state for i in table.timeline()] == ["completed"]
    assert table.read().sort_by("id").equals(before)


def test_pyarrow_datasets_and_iterables_of_tables_are_written(tmp_path):
    import pyarrow.dataset as ds
    import pyarrow.parquet as pq

    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.string())]), "id")
    pq.write_table(pa.table({"id": [1, 2], "v": ["a", "b"]}), tmp_path / "in.parquet")
    table.write(ds.dataset(tmp_path / "in.parquet"))
    table.write(ds.dataset(tmp_path / "in.parquet").scanner(filter=ds.field("id") == 2, columns=["id"]),
                operation="delete")
    table.write([pa.table({"id": [3], "v": ["c"]}), pa.table({"id": [4], "v": ["d"]})])
    assert table.read().sort_by("id").to_pylist() == [{"id": 1, "v": "a"}, {"id": 3, "v": "c"}, {"id": 4, "v": "d"}]


def test_data_that_is_not_a_table_is_refused_with_what_to_give(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.string())]), "id")
    for data, message in [
            ({"id": [1], "v": ["a"]}, "not a dict of columns: give pa.table(data)"),
            ([{"id": 1, "v": "a"}], "not rows as dicts: give pa.Table.from_pylist(rows)"),
            (pa.array([1]), "got a single Int64Array: give pa.table("),
            (pa.chunked_array([[1]]), "got a single ChunkedArray"),
            (_ArrowStreamExporter(pa.chunked_array([[1]])), "got a single column (_ArrowStreamExporter)"),
            ("id,v\n1,a", "got str")]:
        with pytest.raises(InvalidOptionError) as err:
            table.write(data)
        assert message in str(err.value), (message, str(err.value))
    assert table.timeline() == []
    # A stream that turns out not to be one is rolled back.
    with pytest.raises(InvalidOptionError, match="item 1 of the iterable is a str, not a RecordBatch"):
        table.write(iter([pa.record_batch({"id": [1]}), "id"]))
    assert [i.state for i in table.timeline()] == ["rolledback"] and table.read().num_rows == 0


def test_a_stream_whose_batches_change_schema_names_the_change_and_commits_nothing(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.string())]), "id")
    table.write(pa.table({"id": [1], "v": ["a"]}))
    for second, change in [(pa.record_batch({"id": [3], "v": ["c"], "w": [1]}), "'w' is added"),
                           (pa.record_batch({"id": [3]}), "'v' is missing"),
                           (pa.record_batch({"id": ["3"], "v": ["c"]}), "'id' is string, not int64"),
                           (pa.record_batch({"v": ["c"], "id": [3]}), "the columns are in another order")]:
        with pytest.raises(InvalidOptionError, match=f"item 1 of the data has another schema than the first "
                                                     f"\\({change}\\)"):
            table.write(iter([pa.record_batch({"id": [2], "v": ["b"]}), second]))
        assert table.timeline()[-1].state == "rolledback"
    assert table.read().to_pylist() == [{"id": 1, "v": "a"}]


def test_a_pandas_frames_index_is_not_written_unless_named(tmp_path):
    # pandas's own Arrow export wrote a filtered frame's index as a column __index_level_0__,
    # added to the table for good, and a named index of evenly spaced numbers as metadata only:
    # set_index("id") then lost the record key.
    import pandas as pd

    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.int64())]), "id")
    frame = pd.DataFrame({"id": [1, 2, 3, 4], "v": [10, 20, 30, 40]})
    table.write(frame[frame.v != 20])  # index 0, 2, 3
    assert table.schema().names == ["id", "v"]
    table.write(pd.DataFrame({"id": [20, 21], "v": [1, 2]}).set_index("id"))  # a RangeIndex named id
    table.write(pd.DataFrame({"id": [2], "v": [5]}).set_index("id", drop=False))  # both: the column
    with pytest.raises(InvalidOptionError, match="lacks record key"):
        table.write(pd.DataFrame({"v": [7]}, index=pd.Index([9])))  # an unnamed index is not the key
    # A named level beside unnamed ones is data too; one named as a column must hold its values.
    table.write(pd.DataFrame({"id": [30], "v": [3]}).set_index("v", append=True))
    with pytest.raises(InvalidOptionError, match="the pandas frame's index level 'v' has the name of a column but "
                                                 "other values: rename one, or drop the index"):
        table.write(pd.DataFrame({"id": [31], "v": [3]}, index=pd.Index([100], name="v")))
    with pytest.raises(InvalidOptionError, match=r"got a single column \(Series\): give series.to_frame\(\)"):
        table.write(pd.Series([1], name="id"))
    assert table.schema().names == ["id", "v"]
    assert table.read().sort_by("id").to_pylist() == [
        {"id": 1, "v": 10}, {"id": 2, "v": 5}, {"id": 3, "v": 30}, {"id": 4, "v": 40}, {"id": 20, "v": 1},
        {"id": 21, "v": 2}, {"id": 30, "v": 3}]
