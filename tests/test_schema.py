"""Schemas: their JSON form (stored in table.json and commit metadata) and schema evolution."""

from __future__ import annotations

import json

import pyarrow as pa
import pytest

from nbcc.errors import SchemaError
from nbcc.schema import evolve_schema, schema_from_json, schema_to_json


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


def test_a_changed_type_is_refused_and_names_the_column():
    incoming = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("ts", pa.string()),
                          pa.field("name", pa.string())])
    with pytest.raises(SchemaError) as err:
        evolve_schema(TABLE, incoming)
    msg = str(err.value)
    assert "'ts'" in msg and "string" in msg and "int64" in msg
    assert "'name'" not in msg and "'id'" not in msg


def test_narrowing_is_refused_and_names_the_column():
    table = pa.schema([pa.field("id", pa.int32(), nullable=False)])
    with pytest.raises(SchemaError, match="'id'"):
        evolve_schema(table, pa.schema([pa.field("id", pa.int64(), nullable=False)]))


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

