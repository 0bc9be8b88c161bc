"""Schemas: their JSON form (stored in table.json and commit metadata) and schema evolution."""

from __future__ import annotations

import datetime as dt
import json
import re

import pyarrow as pa
import pytest

from nbcc.errors import SchemaError
from nbcc.schema import conform, evolve_schema, schema_from_json, schema_to_json


def _round_trip(schema: pa.Schema) -> pa.Schema:
    # Through real JSON text, as it is stored.
    return schema_from_json(json.loads(json.dumps(schema_to_json(schema))))


PRIMITIVES = [
    pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(), pa.uint32(),
    pa.uint64(), pa.float16(), pa.float32(), pa.float64(), pa.string(), pa.large_string(), pa.binary(),
    pa.large_binary(), pa.date32(), pa.date64(), pa.binary(16), pa.time32("ms"), pa.time64("us"),
    pa.duration("ns"),
]
TIMESTAMPS = [
    pa.timestamp("s"), pa.timestamp("ms"), pa.timestamp("us"), pa.timestamp("ns"),
    pa.timestamp("us", tz="UTC"), pa.timestamp("ms", tz="Europe/Paris"),
    pa.timestamp("ns", tz="+05:30"), pa.timestamp("us", tz="America/Argentina/Buenos_Aires"),
]
DECIMALS = [pa.decimal128(10, 2), pa.decimal128(38, 0), pa.decimal128(5, -3), pa.decimal256(76, 38)]
NESTED = [
    pa.list_(pa.int64()),
    pa.list_(pa.field("element", pa.string(), nullable=False)),
    pa.large_list(pa.float64()),
    pa.struct([pa.field("x", pa.int32()), pa.field("y", pa.string(), nullable=False)]),
    pa.map_(pa.string(), pa.int64()),
    pa.map_(pa.int32(), pa.list_(pa.timestamp("us", tz="UTC"))),
    pa.list_(pa.struct([pa.field("k", pa.string()),
                        pa.field("v", pa.map_(pa.string(), pa.decimal128(12, 4)))])),
    pa.struct([pa.field("inner", pa.struct([pa.field("deep", pa.list_(pa.date32()))]))]),
]


@pytest.mark.parametrize("dtype", PRIMITIVES + TIMESTAMPS + DECIMALS + NESTED, ids=str)
@pytest.mark.parametrize("nullable", [True, False])
def test_schema_json_round_trip(dtype, nullable):
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("col", dtype, nullable=nullable)])
    back = _round_trip(schema)
    assert back.equals(schema)
    assert back.field("col").type == dtype
    assert back.field("col").nullable is nullable
    assert back.field("id").nullable is False


def test_round_trip_keeps_names_and_nested_field_nullability():
    dtype = pa.struct([pa.field("a", pa.list_(pa.field("item", pa.int8(), nullable=False)), nullable=False),
                       pa.field("b c", pa.string())])
    schema = pa.schema([pa.field("weird name é", dtype)])
    back = _round_trip(schema)
    assert back.names == ["weird name é"]
    t = back.field("weird name é").type
    assert t.field("a").nullable is False
    assert t.field("a").type.value_field.nullable is False
    assert t.field("b c").nullable is True
    assert back.equals(schema)


def test_round_tripped_schema_holds_real_data():
    schema = pa.schema([
        ("ts", pa.timestamp("us", tz="UTC")), ("d", pa.decimal128(10, 2)),
        ("l", pa.list_(pa.int32())), ("s", pa.struct([("x", pa.int16())])), ("m", pa.map_(pa.string(), pa.bool_())),
    ])
    import datetime
    import decimal
    row = {"ts": datetime.datetime(2024, 1, 2, 3, 4, 5, 6, tzinfo=datetime.timezone.utc),
           "d": decimal.Decimal("12.34"), "l": [1, 2], "s": {"x": 3}, "m": [("k", True)]}
    table = pa.Table.from_pylist([row], schema=_round_trip(schema))
    assert table.to_pylist() == [row]


def test_an_unsupported_type_is_a_clear_error():
    with pytest.raises(SchemaError, match="not supported"):
        schema_to_json(pa.schema([("u", pa.dense_union([pa.field("a", pa.int8())]))]))
    with pytest.raises(SchemaError, match="unknown column type"):
        schema_from_json([{"name": "x", "type": "int128", "nullable": True}])


# -- evolution ----------------------------------------------------------------------------------

TABLE = pa.schema([
    pa.field("id", pa.int64(), nullable=False),
    pa.field("ts", pa.int64()),
    pa.field("name", pa.string()),
])


def test_same_schema_is_unchanged():
    assert evolve_schema(TABLE, TABLE).equals(TABLE)


def test_adding_a_nullable_column_is_allowed():
    incoming = pa.schema(list(TABLE) + [pa.field("score", pa.float64())])
    out = evolve_schema(TABLE, incoming)
    assert out.names == ["id", "ts", "name", "score"]
    assert out.field("score").type == pa.float64() and out.field("score").nullable
    # The existing columns are unchanged.
    assert pa.schema(list(out)[:3]).equals(TABLE)


def test_an_added_column_is_nullable_in_the_table_even_if_the_data_says_not_null():
    # Files written before it have no values for it: they read it as null.
    incoming = pa.schema(list(TABLE) + [pa.field("extra", pa.int32(), nullable=False)])
    out = evolve_schema(TABLE, incoming)
    assert out.field("extra").nullable is True


def test_a_nullable_column_may_be_missing_from_the_data():
    incoming = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("ts", pa.int64())])
    assert evolve_schema(TABLE, incoming).equals(TABLE)


def test_int32_data_widens_into_an_int64_column():
    incoming = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("ts", pa.int32()),
                          pa.field("name", pa.string())])
    out = evolve_schema(TABLE, incoming)
    assert out.field("id").type == pa.int64() and out.field("ts").type == pa.int64()


def _strict(list_type, value=pa.string()):
    return list_type(pa.field("item", value, nullable=False))


@pytest.mark.parametrize("column, incoming", [
    # Nullability aside, equal field for field: large_list widens as list always did.
    (_strict(pa.list_), pa.list_(pa.string())),
    (_strict(pa.large_list), pa.large_list(pa.string())),
    (_strict(pa.large_list), pa.large_list(pa.large_string())),
    # list and large_list differ only in offset width, as string and large_string do.
    (_strict(pa.large_list), pa.list_(pa.string())),
    (pa.list_(pa.int64()), pa.large_list(pa.int64())),
    # At any depth.
    (pa.struct([pa.field("l", _strict(pa.large_list))]), pa.struct([("l", pa.large_list(pa.string()))])),
    (pa.map_(pa.string(), _strict(pa.large_list)), pa.map_(pa.string(), pa.list_(pa.string()))),
    (pa.large_list(pa.struct([pa.field("x", pa.int64(), nullable=False)])),
     pa.large_list(pa.struct([("x", pa.int64())]))),
], ids=str)
def test_large_lists_widen_like_lists(column, incoming):
    table = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("c", column)])
    assert evolve_schema(table, pa.schema([("id", pa.int64()), ("c", incoming)])).equals(table)


def test_a_large_list_of_another_element_type_is_still_refused():
    table = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("c", pa.large_list(pa.int64()))])
    for incoming in (pa.large_list(pa.string()), pa.list_(pa.string()), pa.large_list(pa.large_list(pa.int64()))):
        with pytest.raises(SchemaError, match="column 'c'"):
            evolve_schema(table, pa.schema([("id", pa.int64()), ("c", incoming)]))


def test_list_and_large_list_data_are_written_into_a_large_list_column(tmp_path):
    import nbcc
    t = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("c", _strict(pa.large_list))]), "id")
    t.write(pa.table({"id": [1, 2], "c": pa.array([["a"], None], pa.large_list(pa.string()))}))
    t.write(pa.table({"id": [3], "c": pa.array([["b", "c"]], pa.list_(pa.string()))}))
    assert t.schema().field("c").type == _strict(pa.large_list)
    assert t.read().sort_by("id").column("c").to_pylist() == [["a"], None, ["b", "c"]]


def test_a_changed_type_is_refused_and_names_the_column():
    incoming = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("ts", pa.string()),
                          pa.field("name", pa.string())])
    with pytest.raises(SchemaError) as err:
        evolve_schema(TABLE, incoming)
    msg = str(err.value)
    assert "'ts'" in msg and "string" in msg and "int64" in msg
    assert "'name'" not in msg and "'id'" not in msg


@pytest.mark.parametrize("column, incoming", [
    (pa.int32(), pa.int64()), (pa.int8(), pa.int16()), (pa.uint16(), pa.uint64()), (pa.float32(), pa.float64()),
], ids=str)
def test_wider_integer_or_float_data_widens_the_column_when_asked(column, incoming):
    table = pa.schema([pa.field("id", column, nullable=False), pa.field("x", column), pa.field("s", pa.string())])
    data = pa.schema([("id", incoming), ("x", incoming), ("s", pa.string())])
    with pytest.raises(SchemaError, match=f"column 'x' has type {incoming} in the data but {column} in the table; "
                                          f"cast it to {column} before writing, or widen the column to {incoming} "
                                          "with the write option type_widening=true"):
        evolve_schema(table, data)
    out = evolve_schema(table, data, widen=True)
    assert out == pa.schema([pa.field("id", incoming, nullable=False), pa.field("x", incoming),
                             pa.field("s", pa.string())])
    # Narrower data into the widened column is cast up, as before: the type stays.
    assert evolve_schema(out, table, widen=True).equals(out)


@pytest.mark.parametrize("column, incoming", [
    (pa.int32(), pa.float64()),  # another kind of number: an int64 does not fit a double
    (pa.int32(), pa.uint64()),
    (pa.uint32(), pa.int64()),
    (pa.float32(), pa.int64()),
    (pa.decimal128(10, 2), pa.decimal128(12, 2)),
    (pa.decimal128(10, 2), pa.decimal128(4, 3)),  # a digit after the point that the column lacks
    (pa.timestamp("ms", tz="UTC"), pa.timestamp("ns")),  # an instant and a wall-clock reading
    (pa.date32(), pa.timestamp("us")),
    (pa.large_binary(), pa.string()),
    (pa.int32(), pa.string()),
], ids=str)
def test_other_type_changes_are_refused_and_name_the_column(column, incoming):
    table = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("x", column)])
    with pytest.raises(SchemaError, match=rf"column 'x' has type {re.escape(str(incoming))} in the data but "
                                          rf"{re.escape(str(column))} in the table; cast it to"):
        evolve_schema(table, pa.schema([("id", pa.int64()), ("x", incoming)]), widen=True)


def test_a_finer_time_unit_is_stored_in_the_columns_unit_where_every_value_fits():
    # pandas sends nanoseconds; a table made by Spark holds microseconds. The column keeps its
    # unit (the write casts each value safely, refusing one that would lose digits).
    table = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("x", pa.timestamp("us", tz="UTC"))])
    assert evolve_schema(table, pa.schema([("id", pa.int64()), ("x", pa.timestamp("ns", tz="UTC"))])) == table
    with pytest.raises(SchemaError, match="would lose data"):
        conform(pa.table({"id": [1], "x": pa.array([1_001], pa.timestamp("ns", tz="UTC"))}), table)
    assert conform(pa.table({"id": [1], "x": pa.array([2_000], pa.timestamp("ns", tz="UTC"))}), table
                   ).column("x").to_pylist() == [dt.datetime(1970, 1, 1, 0, 0, 0, 2, tzinfo=dt.timezone.utc)]


def test_a_delete_does_not_widen_a_column():
    table = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("x", pa.int32())])
    with pytest.raises(SchemaError, match="'id' has type int64 in the data but int32 in the table; a delete "
                                          "does not widen a column: cast it to int32"):
        evolve_schema(table, pa.schema([("id", pa.int64())]), delete=True, widen=True)


def test_a_float_partition_column_does_not_widen_but_an_integer_one_does():
    table = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("f", pa.float32()),
                       pa.field("n", pa.int16())])
    with pytest.raises(SchemaError, match="partition column 'f' has type double in the data but float in the "
                                          "table; its values name folders"):
        evolve_schema(table, pa.schema([("id", pa.int64()), ("f", pa.float64()), ("n", pa.int16())]),
                      partition_by=["f", "n"], widen=True)
    out = evolve_schema(table, pa.schema([("id", pa.int64()), ("f", pa.float32()), ("n", pa.int64())]),
                        partition_by=["f", "n"], widen=True)
    assert out.field("n").type == pa.int64()


def test_commit_schemas_widen_to_the_widest_in_any_completion_order():
    from nbcc.schema import merge_commit_schemas
    base = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("v", pa.float32())])
    wide = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float32()),
                      pa.field("added", pa.int16())])
    wider = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("v", pa.float64())])
    want = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("v", pa.float64()),
                      pa.field("added", pa.int16())])
    # A writer that began before a widening commits its narrower schema later: it narrows nothing.
    assert merge_commit_schemas(base, [wide, wider, base]) == want
    assert merge_commit_schemas(base, [base, wider, wide]) == want


def test_a_missing_non_nullable_column_is_refused_and_names_the_column():
    incoming = pa.schema([pa.field("ts", pa.int64()), pa.field("name", pa.string())])
    with pytest.raises(SchemaError) as err:
        evolve_schema(TABLE, incoming)
    msg = str(err.value)
    assert "'id'" in msg and "missing" in msg
    assert "'ts'" not in msg and "'name'" not in msg


def test_every_problem_is_reported_at_once():
    incoming = pa.schema([pa.field("ts", pa.string()), pa.field("name", pa.string())])
    with pytest.raises(SchemaError) as err:
        evolve_schema(TABLE, incoming)
    assert "'id'" in str(err.value) and "'ts'" in str(err.value)



# -- names Spark cannot tell apart; times with and without a zone --------------------------------

ZONED = pa.schema([("id", pa.int64()), ("name", pa.string()), ("at", pa.timestamp("us", tz="UTC")),
                   ("wall", pa.timestamp("us"))])


def test_a_column_differing_from_a_table_column_only_in_case_is_refused():
    with pytest.raises(SchemaError, match="'Name' differs only in letter case from the table's column 'name'"):
        evolve_schema(ZONED, pa.schema([("id", pa.int64()), ("Name", pa.string())]))
    with pytest.raises(SchemaError, match="'x' and 'X'"):
        evolve_schema(ZONED, pa.schema([("id", pa.int64()), ("x", pa.string()), ("X", pa.string())]))
    with pytest.raises(SchemaError, match="reserved prefix"):
        evolve_schema(ZONED, pa.schema([("id", pa.int64()), ("_NBCC_commit_time", pa.string())]))
    # The table's own spelling, and a genuinely new name, are fine.
    assert evolve_schema(ZONED, pa.schema([("id", pa.int64()), ("name", pa.string()), ("names", pa.string())])
                         ).names == ["id", "name", "at", "wall", "names"]


def test_a_table_cannot_be_created_with_names_spark_cannot_tell_apart(tmp_path):
    import nbcc
    with pytest.raises(SchemaError, match="'v' and 'V'"):
        nbcc.Table.create(str(tmp_path / "a"), pa.schema([("id", pa.int64()), ("v", pa.int64()), ("V", pa.int64())]), "id")
    with pytest.raises(SchemaError, match="reserved prefix"):
        nbcc.Table.create(str(tmp_path / "b"), pa.schema([("id", pa.int64()), ("_Nbcc_x", pa.int64())]), "id")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


def test_concurrent_writers_adding_one_column_in_two_spellings_commit_only_the_first(tmp_path):
    import nbcc
    from nbcc.writer import prepare
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, pa.schema([("id", pa.string()), ("ts", pa.int64())]), "id", ordering_field="ts")

    def begin(rows):  # a writer of its own, begun before either commits: neither sees the other's column
        t = nbcc.Table.open(uri)
        data = pa.table(rows)
        txn = t.begin_write(data.schema)
        writer = t.log_writer(txn, "0-0-0")
        writer.write(prepare(data, t.config, txn.schema, "upsert"))
        return txn, writer

    first_txn, first_writer = begin({"id": ["a"], "ts": [1], "Foo": [1], "bar": [1.5]})
    second_txn, second_writer = begin({"id": ["b"], "ts": [2], "foo": [2]})
    third_txn, third_writer = begin({"id": ["c"], "ts": [3], "bar": [3.5]})
    first_txn.commit(first_writer.close())
    with pytest.raises(SchemaError, match=rf"column 'foo' was added as 'Foo' by commit {first_txn.instant} .*"
                                          r"Spark does not tell the two apart.*write it as 'Foo'"):
        second_txn.commit(second_writer.close())
    second_txn.rollback()
    third_txn.commit(third_writer.close())  # the same spelling and type added twice is no conflict
    table = nbcc.Table.open(uri)
    assert table.schema().names == ["id", "ts", "Foo", "bar"]
    assert table.read().sort_by("id").to_pylist() == [{"id": "a", "ts": 1, "Foo": 1, "bar": 1.5},
                                                      {"id": "c", "ts": 3, "Foo": None, "bar": 3.5}]
    # Written again under the table's spelling, as the error says, it commits.
    table.write(pa.table({"id": ["b"], "ts": [2], "foo": [2]}).rename_columns(["id", "ts", "Foo"]))
    assert table.read().sort_by("id").column("Foo").to_pylist() == [1, 2, None]


@pytest.mark.parametrize("column, incoming", [
    ("at", pa.timestamp("us")),  # a wall-clock time into an instant column
    ("wall", pa.timestamp("us", tz="UTC")),  # an instant into a wall-clock column
    ("wall", pa.timestamp("ms", tz="Europe/Paris")),
])
def test_times_with_and_without_a_zone_do_not_widen_to_each_other(column, incoming):
    with pytest.raises(SchemaError, match=re.escape(f"column '{column}' has type {incoming} in the data")):
        evolve_schema(ZONED, pa.schema([("id", pa.int64()), (column, incoming)]))
    nested = pa.schema([("s", pa.struct([("t", pa.timestamp("us", tz="UTC"))]))])
    with pytest.raises(SchemaError, match="column 's'"):
        evolve_schema(nested, pa.schema([("s", pa.struct([("t", pa.timestamp("us"))]))]))


def test_times_widen_to_a_finer_unit_and_across_zones():
    got = evolve_schema(ZONED, pa.schema([("id", pa.int64()), ("at", pa.timestamp("ms", tz="Asia/Tokyo")),
                                          ("wall", pa.timestamp("s"))]))
    assert got == ZONED


def test_a_partition_value_equal_to_the_null_folder_name_writes_nothing(tmp_path):
    import nbcc
    schema = pa.schema([("id", pa.int64()), ("p", pa.string()), ("x", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", partition_by="p")
    table.write(pa.table({"id": [1], "p": [None], "x": [10]}, schema=schema))
    with pytest.raises(SchemaError, match="partition column 'p' has 1 value.* equal to '__HIVE_DEFAULT_PARTITION__'"):
        table.write(pa.table({"id": [1, 2], "p": ["__HIVE_DEFAULT_PARTITION__", "a"], "x": [20, 30]}, schema=schema))
    assert table.read().to_pylist() == [{"id": 1, "p": None, "x": 10}]
    assert [i.action for i in table.timeline()] == ["deltacommit"]


# A struct whose field is marked not null: the rows that lack the struct (written before the
# column was added, or by writes that leave it out, or deletes) hold a null struct, which Arrow
# refused to cast ("nulls in input cannot be viewed as non-nullable") and every read failed.
STRICT = pa.struct([pa.field("a", pa.int32(), nullable=False),
                    pa.field("inner", pa.struct([pa.field("d", pa.string(), nullable=False)]), nullable=False)])


def _strict_rows(rows):
    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("ts", pa.int64()), ("st", STRICT)])
    return pa.Table.from_pylist(rows, schema=schema)


def test_a_struct_with_a_not_null_field_reads_null_where_rows_lack_it(tmp_path):
    import nbcc

    t = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("ts", pa.int64())]), "id",
                          ordering_field="ts", buckets=2)
    first = t.write(pa.table({"id": [1, 2, 3], "ts": [1, 1, 1]}))
    t.write(_strict_rows([{"id": 2, "ts": 2, "st": {"a": 7, "inner": {"d": "x"}}},
                          {"id": 4, "ts": 2, "st": None}]))  # the column is added here
    added = t.timeline()[-1].completion
    t.write(pa.table({"id": [5], "ts": [3]}))  # a write that leaves it out
    t.write(pa.table({"id": [3]}), operation="delete")
    # A range whose start state holds rows: an insert (no `before`) and a delete (no `after`).
    later = t.read(query_type="incremental", begin=str(int(added) + 1), incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["before"], r["after"]) for r in later.to_pylist()) == [
        (3, "delete", {"id": 3, "ts": 1, "st": None}, None), (5, "insert", None, {"id": 5, "ts": 3, "st": None})]
    expected = [{"id": 1, "ts": 1, "st": None}, {"id": 2, "ts": 2, "st": {"a": 7, "inner": {"d": "x"}}},
                {"id": 4, "ts": 2, "st": None}, {"id": 5, "ts": 3, "st": None}]
    assert t.schema().field("st").type == STRICT
    assert t.read().sort_by("id").to_pylist() == expected
    changes = t.read(query_type="incremental", begin=first, incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["after"] and r["after"]["st"]) for r in changes.to_pylist()) == [
        (1, "insert", None), (2, "insert", {"a": 7, "inner": {"d": "x"}}), (4, "insert", None), (5, "insert", None)]
    t.compact()
    assert t.read().sort_by("id").to_pylist() == expected
    with pytest.raises(SchemaError, match="column 'st' holds a null inside a value"):  # still checked where present
        t.write(_strict_rows([{"id": 6, "ts": 4, "st": {"a": None, "inner": {"d": "y"}}}]))


def test_a_null_struct_whose_fields_are_null_too_fits_a_field_marked_not_null(tmp_path):
    # Spark sends a null struct's fields as nulls; only the struct is null, so the row fits.
    import nbcc

    t = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("st", STRICT)]),
                          "id", ordering_field="ts")
    loose = pa.struct([("a", pa.int32()), ("inner", pa.struct([("d", pa.string())]))])
    inner = pa.StructArray.from_arrays([pa.array(["x", None, None])], fields=[loose.field("inner").type.field(0)],
                                       mask=pa.array([False, True, True]))
    st = pa.StructArray.from_arrays([pa.array([1, None, 3], pa.int32()), inner], fields=list(loose),
                                    mask=pa.array([False, True, False]))
    assert st.field(0).null_count == 1 and st.field(1).null_count == 2  # nulls under the null struct
    rows = pa.table({"id": [1, 2, 3], "ts": [1, 1, 1], "st": st})
    with pytest.raises(SchemaError, match="'st'"):  # row 3's inner struct is null: a real violation
        t.write(rows)
    t.write(rows.slice(0, 2))
    t.write(pa.table({"id": [4], "ts": [1], "st": pa.nulls(1)}))  # None in every row: Arrow's null type
    assert t.read().sort_by("id").to_pylist() == [{"id": 1, "ts": 1, "st": {"a": 1, "inner": {"d": "x"}}},
                                                  {"id": 2, "ts": 1, "st": None}, {"id": 4, "ts": 1, "st": None}]
