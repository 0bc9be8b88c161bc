"""Schemas: their JSON form in table.json and commit metadata, how incoming data is checked and
conformed to a table's schema, and how the schema evolves.

Evolution adds and widens: a write may add nullable columns, and may widen a column's integer or
floating-point type (int -> bigint, float -> double), never narrow or otherwise change it, nor
drop a non-nullable column (narrower data is cast losslessly to the table's type). Each commit
records the schema it wrote; the table's current schema is table.json's schema plus the columns
added and the types widened by completed commits, in completion order. Older files read added
columns as null and widened columns cast to the wider type.
"""

from __future__ import annotations

import json
import re
from typing import Any, Callable, Iterable, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .errors import SchemaError

META_PREFIX = "_nbcc_"
COMMIT_TIME_COL = "_nbcc_commit_time"
RECORD_KEY_COL = "_nbcc_record_key"
IS_DELETED_COL = "_nbcc_is_deleted"
META_FIELDS = [
    pa.field(COMMIT_TIME_COL, pa.string(), nullable=False),
    pa.field(RECORD_KEY_COL, pa.string(), nullable=False),
    pa.field(IS_DELETED_COL, pa.bool_(), nullable=False),
]

# -- JSON form of Arrow types ------------------------------------------------------------------

_SIMPLE = {str(t): t for t in (
    pa.null(), pa.bool_(), pa.int8(), pa.int16(), pa.int32(), pa.int64(), pa.uint8(), pa.uint16(),
    pa.uint32(), pa.uint64(), pa.float16(), pa.float32(), pa.float64(), pa.string(), pa.large_string(),
    pa.binary(), pa.large_binary(), pa.date32(), pa.date64(),
)}
_TS = re.compile(r"^timestamp\[(s|ms|us|ns)(?:, tz=(.+))?\]$")
_DEC = re.compile(r"^decimal(128|256)\((\d+), (-?\d+)\)$")
_TIME = re.compile(r"^time(32|64)\[(s|ms|us|ns)\]$")
_DUR = re.compile(r"^duration\[(s|ms|us|ns)\]$")
_FSB = re.compile(r"^fixed_size_binary\[(\d+)\]$")


def type_to_json(t: pa.DataType) -> Any:
    if pa.types.is_struct(t):
        return {"struct": [field_to_json(t.field(i)) for i in range(t.num_fields)]}
    if pa.types.is_map(t):
        return {"map": [field_to_json(t.key_field), field_to_json(t.item_field)]}
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        return {"large_list" if pa.types.is_large_list(t) else "list": field_to_json(t.value_field)}
    text = str(t)
    if text in _SIMPLE or any(p.match(text) for p in (_TS, _DEC, _TIME, _DUR, _FSB)):
        return text
    raise SchemaError(f"column type {t} is not supported by nbcc")


def type_from_json(j: Any) -> pa.DataType:
    if isinstance(j, dict):
        if "struct" in j:
            return pa.struct([field_from_json(f) for f in j["struct"]])
        if "map" in j:
            k, v = (field_from_json(f) for f in j["map"])
            return pa.map_(k, v)
        if "list" in j:
            return pa.list_(field_from_json(j["list"]))
        if "large_list" in j:
            return pa.large_list(field_from_json(j["large_list"]))
    elif isinstance(j, str):
        if j in _SIMPLE:
            return _SIMPLE[j]
        if m := _TS.match(j):
            return pa.timestamp(m.group(1), tz=m.group(2))
        if m := _DEC.match(j):
            ctor = pa.decimal128 if m.group(1) == "128" else pa.decimal256
            return ctor(int(m.group(2)), int(m.group(3)))
        if m := _TIME.match(j):
            return (pa.time32 if m.group(1) == "32" else pa.time64)(m.group(2))
        if m := _DUR.match(j):
            return pa.duration(m.group(1))
        if m := _FSB.match(j):
            return pa.binary(int(m.group(1)))
    raise SchemaError(f"unknown column type {j!r} in table metadata")


def field_to_json(f: pa.Field) -> dict[str, Any]:
    return {"name": f.name, "type": type_to_json(f.type), "nullable": f.nullable}


def field_from_json(j: dict[str, Any]) -> pa.Field:
    return pa.field(j["name"], type_from_json(j["type"]), nullable=bool(j.get("nullable", True)))


def schema_to_json(schema: pa.Schema) -> list[dict[str, Any]]:
    return [field_to_json(f) for f in schema]


def schema_from_json(j: list[dict[str, Any]]) -> pa.Schema:
    return pa.schema([field_from_json(f) for f in j])


# -- compatibility -----------------------------------------------------------------------------

def _widens(src: pa.DataType, dst: pa.DataType) -> bool:
    """Can `src` values be stored in a `dst` column without loss? A finer time unit, or date64,
    only where its values fit, which `conform`'s safe cast checks value by value (pandas sends
    nanoseconds, Spark's tables hold microseconds)."""
    if src.equals(dst):
        return True
    if pa.types.is_timestamp(src) and pa.types.is_timestamp(dst):
        # A time without a zone is a wall-clock reading, one with a zone an instant: storing one
        # as the other would shift it by the session's offset, so neither widens to the other.
        return (src.tz is None) == (dst.tz is None)
    if pa.types.is_date64(src) and pa.types.is_date32(dst):
        return True
    if pa.types.is_decimal(src) and pa.types.is_decimal(dst):  # as many digits each side of the point
        return src.scale <= dst.scale and src.precision - src.scale <= dst.precision - dst.scale
    pairs = (
        (pa.types.is_signed_integer, pa.types.is_signed_integer),
        (pa.types.is_unsigned_integer, pa.types.is_unsigned_integer),
        (pa.types.is_floating, pa.types.is_floating),
    )
    for is_src, is_dst in pairs:
        if is_src(src) and is_dst(dst):
            return src.bit_width <= dst.bit_width
    if pa.types.is_unsigned_integer(src) and pa.types.is_signed_integer(dst):
        return src.bit_width < dst.bit_width
    # The string types, and the binary ones, differ only in how they lay out their offsets.
    strings = (pa.types.is_string, pa.types.is_large_string, pa.types.is_string_view)
    binaries = (pa.types.is_binary, pa.types.is_large_binary, pa.types.is_binary_view)
    for family in (strings, binaries):
        if any(f(src) for f in family) and any(f(dst) for f in family):
            return True
    # list and large_list differ only in offset width, as the string types do; nested ones were
    # already compared as one type (norm below), so the top level must agree.
    lists = (pa.types.is_list, pa.types.is_large_list)
    if (pa.types.is_struct(src) and pa.types.is_struct(dst)) or (
            any(f(src) for f in lists) and any(f(dst) for f in lists)) or (
            pa.types.is_map(src) and pa.types.is_map(dst)):
        # Nested types must match field for field; Arrow's cast checks the details.
        return _nested_equal_ignoring_nullability(src, dst)
    return False


def widened_type(column: pa.DataType, incoming: pa.DataType) -> pa.DataType | None:
    """The type a table column of type `column` widens to for data of type `incoming`, or None.
    Only within a family whose types are totally ordered (signed integers, unsigned integers,
    floats): two writers that widen one column at the same time then agree on the result, the
    wider of the two, in whichever order their commits complete (format.md §4.2)."""
    families = (pa.types.is_signed_integer, pa.types.is_unsigned_integer, pa.types.is_floating)
    for same in families:
        if same(column) and same(incoming) and incoming.bit_width > column.bit_width:
            return incoming
    return None


def widest_of_kind(t: pa.DataType) -> pa.DataType:
    """The widest type `t` may be widened to (`widened_type`): int64 for a signed integer,
    uint64 for an unsigned one, `t` itself otherwise. It holds any value of the column, whatever
    a commit widened it to (an integer's text, its bucket and folder, are the same at any width)."""
    if pa.types.is_signed_integer(t):
        return pa.int64()
    if pa.types.is_unsigned_integer(t):
        return pa.uint64()
    return t


def _nested_equal_ignoring_nullability(a: pa.DataType, b: pa.DataType) -> bool:
    def norm(t: pa.DataType) -> Any:
        if pa.types.is_struct(t):
            return ("struct", tuple((t.field(i).name, norm(t.field(i).type)) for i in range(t.num_fields)))
        if pa.types.is_list(t) or pa.types.is_large_list(t):
            return ("list", norm(t.value_type))
        if pa.types.is_map(t):
            return ("map", norm(t.key_type), norm(t.item_type))
        if pa.types.is_timestamp(t):
            return ("timestamp", t.unit, t.tz is None)
        if pa.types.is_string(t) or pa.types.is_large_string(t):
            return "string"
        if pa.types.is_binary(t) or pa.types.is_large_binary(t):
            return "binary"
        return str(t)
    return norm(a) == norm(b)


_UNIT_RANK = {"s": 0, "ms": 1, "us": 2, "ns": 3}


def map_type(t: pa.DataType, fn: Callable[[pa.DataType], pa.DataType]) -> pa.DataType:
    """`t` with `fn` applied to every type in it, innermost first: the children of a struct,
    list, map or dictionary are mapped (their fields keep names and nullability), then `fn`
    takes the type holding them."""
    if pa.types.is_struct(t):
        t = pa.struct([t.field(i).with_type(map_type(t.field(i).type, fn)) for i in range(t.num_fields)])
    elif pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
        value = t.value_field.with_type(map_type(t.value_type, fn))
        t = (pa.large_list(value) if pa.types.is_large_list(t) else
             pa.list_(value, t.list_size) if pa.types.is_fixed_size_list(t) else pa.list_(value))
    elif pa.types.is_map(t):
        t = pa.map_(t.key_field.with_type(map_type(t.key_type, fn)), t.item_field.with_type(map_type(t.item_type, fn)))
    elif pa.types.is_dictionary(t):
        t = pa.dictionary(t.index_type, map_type(t.value_type, fn), t.ordered)
    return fn(t)


def plain_type(t: pa.DataType) -> pa.DataType:
    """The type values of Arrow type `t` are stored as: a dictionary as its values, a string or
    binary view as a plain string or binary, a fixed-size list as a list (pandas categoricals,
    Polars strings and embedding arrays arrive so; Parquet and Spark have none of these)."""
    def plain(t: pa.DataType) -> pa.DataType:
        if pa.types.is_dictionary(t):
            return t.value_type
        if pa.types.is_string_view(t):
            return pa.string()
        if pa.types.is_binary_view(t):
            return pa.binary()
        if pa.types.is_fixed_size_list(t):
            return pa.list_(t.value_field)
        return t
    return map_type(t, plain)


def check_column(name: str, t: pa.DataType) -> None:
    """SchemaError unless a column of (plain) type `t` can be a table column."""
    if pa.types.is_null(t):
        raise SchemaError(
            f"column {name!r} has type null (none of its values says what type it is, e.g. every "
            "value is None); give it a type, e.g. pa.array(values, pa.string()) or a schema"
        )
    try:
        described = json.dumps(type_to_json(t))
    except SchemaError:
        raise SchemaError(
            f"column {name!r} has type {t}, which nbcc cannot store; cast it to a supported type: "
            "integers, floats, decimals, booleans, strings, binary, dates, times, timestamps, "
            "durations, or structs, lists and maps of them"
        ) from None
    negative = re.search(r"decimal(128|256)\((\d+), -(\d+)\)", described)
    if negative:  # Arrow has them, Parquet not: the write would fail after the commit began
        bits, precision, scale = negative.groups()
        raise SchemaError(f"column {name!r} holds {negative[0]}, a decimal with a negative scale, which Parquet "
                          f"cannot store; cast it to decimal{bits}({int(precision) + int(scale)}, 0)")


def check_names(names: Iterable[str], what: str) -> None:
    """SchemaError if a column name appears twice (Arrow allows it; a table cannot), also when
    the copies differ only in letter case: Spark resolves names case-insensitively, so it could
    read neither column."""
    names = list(names)
    seen: set[str] = set()
    twice = sorted({n for n in names if n in seen or seen.add(n)})
    if twice:
        raise SchemaError(f"column name(s) {twice} appear more than once in {what}; rename or drop the copies")
    by_lower: dict[str, list[str]] = {}
    for n in names:
        by_lower.setdefault(n.lower(), []).append(n)
    cased = [" and ".join(map(repr, ns)) for ns in by_lower.values() if len(ns) > 1]
    if cased:
        raise SchemaError(f"column names {'; '.join(cased)} in {what} differ only in letter case, which Spark "
                          "does not tell apart; rename or drop one of each")


def is_reserved(name: str) -> bool:
    """Meta column names are reserved in any letter case (Spark would not tell them apart)."""
    return name.lower().startswith(META_PREFIX)


def _is_deleted_problem(incoming: pa.Schema) -> str | None:
    deleted = incoming.field(IS_DELETED_COL).type if IS_DELETED_COL in incoming.names else None
    if deleted is not None and not (pa.types.is_boolean(deleted) or pa.types.is_null(deleted)):
        return f"column {IS_DELETED_COL!r} has type {deleted}; it must be boolean (true deletes the row's key)"
    return None


def check_is_deleted(incoming: pa.Schema) -> None:
    """SchemaError unless the data's `_nbcc_is_deleted` column, if any, is boolean (or untyped)."""
    if problem := _is_deleted_problem(incoming):
        raise SchemaError(problem)


def evolve_schema(table_schema: pa.Schema, incoming: pa.Schema, *, delete: bool = False,
                  partition_by: Sequence[str] = (), widen: bool = False) -> pa.Schema:
    """The table schema after writing data of schema `incoming`, or SchemaError.

    A `delete` batch needs only keys (and partition values): it may lack any column, and
    columns the table lacks are ignored rather than added (its rows carry no data); nor does
    it widen a column. With `widen`, wider integer or float data widens its column
    (`widened_type`); a floating-point `partition_by` column never: its values name folders,
    and a float's text changes as a double (1.1 becomes 1.100000023841858).
    """
    check_names(incoming.names, "the data")
    problems = [p] if (p := _is_deleted_problem(incoming)) else []
    widened = {}
    for f in table_schema:
        idx = incoming.get_field_index(f.name)
        if idx < 0:
            if not f.nullable and not delete:
                problems.append(f"column {f.name!r} ({f.type}, not nullable) is missing from the data")
            continue
        src = incoming.field(idx).type
        if pa.types.is_null(src) or _widens(plain_type(src), f.type):
            continue
        wider = widened_type(f.type, plain_type(src))
        if wider is not None and delete:
            problems.append(f"column {f.name!r} has type {src} in the data but {f.type} in the table; a delete "
                            f"does not widen a column: cast it to {f.type} (a value that does not fit is in "
                            "no row)")
        elif wider is not None and f.name in partition_by and pa.types.is_floating(wider):
            problems.append(f"partition column {f.name!r} has type {src} in the data but {f.type} in the table; "
                            "its values name folders, and a value's text changes with its width, so the "
                            f"column cannot widen: cast it to {f.type} before writing")
        elif wider is not None and not widen:
            problems.append(
                f"column {f.name!r} has type {src} in the data but {f.type} in the table; cast it to {f.type} "
                f"before writing, or widen the column to {wider} with the write option type_widening=true "
                "(it raises the table's format version to 4: upgrade every nbcc that uses the table first)")
        elif wider is not None:
            widened[f.name] = wider
        else:
            problems.append(
                f"column {f.name!r} has type {src} in the data but {f.type} in the table; "
                f"cast it to {f.type} before writing"
            )
    if problems:
        raise SchemaError("data does not fit the table schema: " + "; ".join(problems))
    if delete:
        return table_schema
    if widened:
        table_schema = pa.schema([f.with_type(widened[f.name]) if f.name in widened else f for f in table_schema],
                                 metadata=table_schema.metadata)
    added = [f.with_type(plain_type(f.type)).with_nullable(True) for f in incoming
             if f.name not in table_schema.names and f.name != IS_DELETED_COL]
    existing = {n.lower(): n for n in table_schema.names}
    recased = [(f.name, existing[f.name.lower()]) for f in added if f.name.lower() in existing]
    if recased:
        raise SchemaError("; ".join(f"column {new!r} differs only in letter case from the table's column {old!r}"
                                    for new, old in recased)
                          + ": Spark does not tell the two apart, so adding it would leave both unreadable "
                          "there. Write it under the table's spelling")
    reserved = [f.name for f in added if is_reserved(f.name)]
    if reserved:
        raise SchemaError(f"column name(s) {reserved} use the reserved prefix {META_PREFIX!r}; drop or rename them")
    for f in added:
        check_column(f.name, f.type)
    return pa.schema(list(table_schema) + added) if added else table_schema


def nullable_schema(schema: pa.Schema) -> pa.Schema:
    """`schema` with every field nullable, at every depth but map keys. A table created from a
    Spark DataFrame takes this: Spark marks literals and array(...) elements not null, and those
    incidental marks would refuse every later null, as Spark's own Parquet and Delta do not."""
    def loosen(t: pa.DataType) -> pa.DataType:
        if pa.types.is_struct(t):
            return pa.struct([t.field(i).with_type(loosen(t.field(i).type)).with_nullable(True)
                              for i in range(t.num_fields)])
        if pa.types.is_map(t):
            return pa.map_(t.key_field.with_type(loosen(t.key_type)),
                           t.item_field.with_type(loosen(t.item_type)).with_nullable(True))
        if pa.types.is_list(t):
            return pa.list_(t.value_field.with_type(loosen(t.value_type)).with_nullable(True))
        if pa.types.is_large_list(t):
            return pa.large_list(t.value_field.with_type(loosen(t.value_type)).with_nullable(True))
        return t
    return pa.schema([f.with_type(loosen(f.type)).with_nullable(True) for f in schema], metadata=schema.metadata)


def merge_commit_schemas(base: pa.Schema, later: Iterable[pa.Schema]) -> pa.Schema:
    """table.json's schema, then what each later commit's schema changed, in commit order: the
    columns it added (nullable), and the types it widened (`widened_type`). A narrower type,
    that of a writer that began before a widening, changes nothing."""
    fields = {f.name: f for f in base}
    for s in later:
        for f in s:
            have = fields.get(f.name)
            if have is None:
                fields[f.name] = f.with_nullable(True)
            elif widened_type(have.type, f.type) is not None:
                fields[f.name] = have.with_type(f.type)
    return pa.schema(list(fields.values()))


def widened_columns(before: pa.Schema, after: pa.Schema) -> list[str]:
    """The columns of `before` whose type `after` widened."""
    return [f.name for f in before if f.name in after.names and not after.field(f.name).type.equals(f.type)]


def null_array(n: int, t: pa.DataType) -> pa.Array:
    """`n` nulls of type `t`, for a column a file or a write does not have. pa.nulls leaves a
    struct's fields null too, and Arrow's cast refuses that for a field marked not null even
    under a null struct ("nulls in input cannot be viewed as non-nullable"): such fields hold
    zeros or empty values here instead, as Parquet gives them back under a null struct."""
    return _castable(pa.nulls(n, t), nullable=True)


def _strict_struct_field(t: pa.DataType) -> bool:
    """Does `t` have a struct field marked not null, at any depth of structs?"""
    return pa.types.is_struct(t) and any(not f.nullable or _strict_struct_field(f.type) for f in t)


def _settled(col: pa.Array, t: pa.DataType) -> pa.Array:
    """`col` (of type `t` up to nullability) with placeholders for the nulls that null structs
    hold in fields `t` marks not null: Spark sends a null struct's fields as nulls, which the
    cast to `t` would refuse though the struct, not its field, is null."""
    if not _strict_struct_field(t):
        return col
    children = [_settled(col.field(i), f.type) for i, f in enumerate(t)]
    if col.null_count:
        present = col.is_valid()
        for i, f in enumerate(t):
            if not f.nullable and children[i].null_count:
                filler = _castable(pa.nulls(len(col), f.type), nullable=False).cast(children[i].type)
                children[i] = pc.if_else(present, children[i], filler)
    return pa.StructArray.from_arrays(children, fields=list(col.type), mask=col.is_null() if col.null_count else None)


def _castable(nulls: pa.Array, nullable: bool) -> pa.Array:
    t = nulls.type
    if pa.types.is_struct(t):
        children = [_castable(nulls.field(i), t.field(i).nullable) for i in range(t.num_fields)]
        mask = pa.array(np.ones(len(nulls), dtype=bool)) if nullable else None
        return pa.StructArray.from_arrays(children, fields=list(t), mask=mask)
    if nullable:
        return nulls
    n = len(nulls)
    if pa.types.is_map(t):  # empty maps and lists: their element fields hold nothing
        offsets = pa.array(np.zeros(n + 1, dtype=np.int32))
        return pa.MapArray.from_arrays(offsets, pa.array([], t.key_type), pa.array([], t.item_type), type=t)
    if pa.types.is_list(t) or pa.types.is_large_list(t):
        offsets = pa.array(np.zeros(n + 1, dtype=np.int64 if pa.types.is_large_list(t) else np.int32))
        return type(nulls).from_arrays(offsets, pa.array([], t.value_type), type=t)
    # A flat type: pa.nulls's buffers hold zeros (numbers, times) and zero offsets (strings).
    return pa.Array.from_buffers(t, n, [None] + nulls.buffers()[1:])


def _without_view_dictionaries(t: pa.DataType) -> pa.DataType:
    """`t` with the values of its dictionaries, at any depth, of `plain_type`: Arrow cannot decode
    a dictionary of string views (Polars' categoricals) but can cast it to one of strings,
    which it then decodes."""
    return map_type(t, lambda t: pa.dictionary(t.index_type, plain_type(t.value_type), t.ordered)
                    if pa.types.is_dictionary(t) else t)


def conform(batch: pa.RecordBatch | pa.Table, schema: pa.Schema) -> pa.Table:
    """`batch`'s columns in `schema`'s order and types; absent columns become nulls.
    Fields are nullable in the result: delete markers carry nulls in data columns."""
    table = batch if isinstance(batch, pa.Table) else pa.Table.from_batches([batch])
    cols = []
    for f in schema:
        idx = table.schema.get_field_index(f.name)
        if idx < 0 or pa.types.is_null(table.schema.field(idx).type):  # absent, or None in every row
            cols.append(null_array(table.num_rows, f.type))
            continue
        col = table.column(idx)
        if pa.types.is_dictionary(col.type) or pa.types.is_nested(col.type):  # flat ones have no dictionary
            decodable = _without_view_dictionaries(col.type)
            col = col if decodable.equals(col.type) else pc.cast(col, decodable)
        if _strict_struct_field(f.type) and pa.types.is_struct(col.type):
            col = pa.chunked_array([_settled(c, f.type) for c in col.chunks], type=col.type)
        if not col.type.equals(f.type):
            try:
                col = pc.cast(col, f.type, safe=True)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError) as exc:
                raise SchemaError(f"column {f.name!r}: its {col.type} values cannot be stored as the "
                                  f"table's {f.type}: {exc}") from None
        cols.append(col)
    return pa.Table.from_arrays(cols, schema=pa.schema([f.with_nullable(True) for f in schema]))


def file_schema(table_schema: pa.Schema) -> pa.Schema:
    """The Parquet schema of a log or base file: data columns (nullable) plus meta columns."""
    return pa.schema([f.with_nullable(True) for f in table_schema] + META_FIELDS)


def constant_strings(value: str, n: int) -> pa.Array:
    """`n` copies of `value`, built without a Python object per row: the offsets and the
    repeated bytes directly (4x faster than casting a one-entry dictionary array, which the
    writer paid for every row of every commit)."""
    data = value.encode()
    if (n + 1) * len(data) >= 2**31:  # past 32-bit offsets: let Arrow build (or refuse) it
        return pa.DictionaryArray.from_arrays(pa.array(np.zeros(n, dtype=np.int32)), pa.array([value])).cast(pa.string())
    # Written into buffers Arrow owns, not wrapped around NumPy's or Python's memory: an Arrow
    # thread (a filter's, after it returned) must never hold the last reference to a Python
    # object, since releasing it needs the GIL and aborts a process that is already exiting.
    offsets, chars = pa.allocate_buffer(4 * (n + 1)), pa.allocate_buffer(max(n * len(data), 1))
    np.multiply(np.arange(n + 1, dtype=np.int32), np.int32(len(data)), out=np.frombuffer(offsets, np.int32))
    if data:
        np.frombuffer(chars, np.uint8)[: n * len(data)].reshape(n, len(data))[:] = np.frombuffer(data, np.uint8)
    return pa.Array.from_buffers(pa.string(), n, [None, offsets, chars])
