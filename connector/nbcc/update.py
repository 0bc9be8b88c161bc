"""Updates: SQL's `UPDATE ... SET ... WHERE` (Delta's `DeltaTable.update`) on a merge-on-read
table. The records that match are read from one snapshot, get their new values, and are
written back as one upsert commit: no file is rewritten, and a concurrent write to the same
records is ordered against the update as any two writes are (README: merge modes).

A new value is a literal (a Python value or a pyarrow scalar, cast to the column's type) or a
pyarrow compute expression over the record's columns as read (`pc.field("price") * 1.1`),
evaluated with Arrow, a batch at a time. Record-key and partition columns are not set: a record
with another key or partition is another record (write it, and delete the old one). Nor is the
ordering field of an `event_time` or `partial_update` table: the update keeps the value it read,
so that it wins over that version, and a lower one would lose to it. In a `partial_update` table
the update writes only the columns it sets (and the key, partition and ordering columns): a
null in a write means "unchanged" there, so the other columns keep what concurrent writers give
them, and a null new value leaves its column as it was (a literal null is refused).
"""

from __future__ import annotations

import math
from decimal import Decimal
from typing import Any, Mapping

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds

from .config import COMMIT_TIME, PARTIAL_UPDATE, TableConfig
from .errors import InvalidOptionError
from .expr import cut_description, describe_expression, sql_literal, sql_name
from .schema import is_reserved, map_type

_EXAMPLE = "e.g. {'status': 'shipped', 'price': pc.field('price') * 1.1}"


def check_updates(updates: Any, schema: pa.Schema, config: TableConfig) -> dict[str, pa.Scalar | pc.Expression]:
    """`updates` (column -> new value) with each literal as a scalar of its column's type (an
    expression as given); InvalidOptionError if a column cannot be set, a literal does not fit
    its column without loss, or an expression names what the table lacks."""
    if not isinstance(updates, Mapping) or not updates:
        raise InvalidOptionError(f"updates must be a non-empty mapping of column to new value, {_EXAMPLE}; "
                                 f"got {updates!r}")
    fixed = set(config.record_key) | set(config.partition_by)
    ordered = config.ordering_field if config.merge_mode != COMMIT_TIME else None
    out: dict[str, pa.Scalar | pc.Expression] = {}
    for column, value in updates.items():
        if not isinstance(column, str) or column not in schema.names:
            spelled = {n.lower(): n for n in schema.names}.get(str(column).lower())
            hint = f" (the table spells it {spelled!r})" if spelled else f"; its columns are {schema.names}"
            raise InvalidOptionError(f"update of column {column!r}: the table has no such column{hint}")
        if is_reserved(column):
            raise InvalidOptionError(f"update of column {column!r}: meta columns are nbcc's own")
        if column in fixed:
            what = "record key" if column in config.record_key else "partition"
            raise InvalidOptionError(
                f"update of column {column!r}: a {what} column is not set by an update, since a record with "
                f"another {what} value is another record; write the record with its new value and delete the "
                "old one (Table.delete, nbcc delete)")
        if column == ordered:
            raise InvalidOptionError(
                f"update of column {column!r}: it is the ordering field of this {config.merge_mode} table, which "
                "decides which version of a record wins; an update keeps the value it read so that it wins over "
                "that version (a lower value would lose to it). To change it, write the records with their new "
                "values")
        t = schema.field(column).type
        if isinstance(value, pc.Expression):
            out[column] = value
            continue
        given = value
        if isinstance(value, float) and pa.types.is_decimal(t):
            value = Decimal(repr(value))  # as written, so that the cast refuses digits it would round away
        elif isinstance(value, int) and not isinstance(value, bool) and pa.types.is_decimal(t):
            value = Decimal(value)  # an int64 would need 19 digits before the point
        try:
            original = value if isinstance(value, pa.Scalar) else pa.scalar(value)
            given_type = original.type
            scalar = original.cast(t) if not original.type.equals(t) else original
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, TypeError, ValueError,
                OverflowError) as exc:
            raise InvalidOptionError(f"update of column {column!r}: {given!r} is not a value of its type {t} "
                                     f"({str(exc).splitlines()[0]})") from None
        if _changed_by_cast(original, scalar):
            # Arrow's cast of a datetime to a date drops the time of day, as "safe".
            raise InvalidOptionError(f"update of column {column!r}: {given!r} would be stored as "
                                     f"{scalar.as_py()!r} in its type {t}, losing part of it; give a value of "
                                     "the column's type")
        if pa.types.is_timestamp(t) and pa.types.is_timestamp(given_type) and (t.tz is None) != (given_type.tz is None):
            # As a write refuses it: a time with a zone is an instant, one without a wall-clock reading.
            raise InvalidOptionError(
                f"update of column {column!r} ({t}): {given!r} is a time {'with' if given_type.tz else 'without'} a "
                f"zone, and the column holds times {'with' if t.tz else 'without'} one; they never stand in for "
                "each other: give a datetime " + ("with a tzinfo" if t.tz else "without a tzinfo"))
        if not schema.field(column).nullable and not scalar.is_valid:
            raise InvalidOptionError(f"update of column {column!r}: the column is not nullable; give a value")
        if column == config.ordering_field and not scalar.is_valid:
            raise InvalidOptionError(f"update of column {column!r}: the ordering field needs a value in every "
                                     "written record; give one")
        if config.merge_mode == PARTIAL_UPDATE and not scalar.is_valid:
            raise InvalidOptionError(
                f"update of column {column!r} to null: in a partial_update table a null in a write means "
                "'unchanged', so the column would keep its value; to clear it, delete the record and write it "
                "again without the value")
        out[column] = scalar
    apply_updates(schema.empty_table(), out, config)  # names and types checked now, rows or not
    return out


def _changed_by_cast(given: pa.Scalar, stored: pa.Scalar) -> bool:
    """Does `stored` (`given` cast to a column's type) not give `given` back? A cast that cannot
    be undone changed nothing a reader could compare (5 stored as '5'); nor does text read as
    its column's type, which Arrow parses strictly or refuses ('1e3' is 1000.0); nor a float
    stored in a narrower float, at any depth (0.1 in a float32 column is the float32 nearest it,
    as in a write), unless it overflows to infinity."""
    if given.type.equals(stored.type) or not given.is_valid or _is_text(given.type):
        return False
    if _floats_as_doubles(given.type).equals(_floats_as_doubles(stored.type)):
        return pa.types.is_floating(stored.type) and math.isinf(stored.as_py()) and not math.isinf(given.as_py())
    try:
        back = stored.cast(given.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError):
        return False
    return back != given


def _is_text(t: pa.DataType) -> bool:
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _floats_as_doubles(t: pa.DataType) -> pa.DataType:
    """`t` with every float, at any depth, a double, and every list a plain one: types that
    differ only in float widths map to one."""
    def doubled(t: pa.DataType) -> pa.DataType:
        if pa.types.is_floating(t):
            return pa.float64()
        if pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t):
            return pa.list_(t.value_type)
        return pa.map_(t.key_type, t.item_type) if pa.types.is_map(t) else t
    return map_type(t, doubled)


def apply_updates(rows: pa.Table, updates: Mapping[str, pa.Scalar | pc.Expression], config: TableConfig
                  ) -> pa.Table:
    """`rows` with the updated columns' new values (`check_updates`'): every other column as it
    was or, in a `partial_update` table, null ("unchanged") but for the key, partition and
    ordering columns."""
    kept = set(config.record_key) | set(config.partition_by) | {config.ordering_field}
    partial = config.merge_mode == PARTIAL_UPDATE

    def new_value(field: pa.Field) -> pc.Expression:
        if field.name in updates:
            value = updates[field.name]
            return value.cast(field.type) if isinstance(value, pc.Expression) else pc.scalar(value)
        return pc.field(field.name) if not partial or field.name in kept else pc.scalar(None).cast(field.type)

    projection = {f.name: new_value(f) for f in rows.schema}
    try:
        new = ds.dataset(rows).to_table(columns=projection, use_threads=False)  # keeps the row order
        return new.cast(rows.schema)  # types as the table's (a cast expression gives them; nullability)
    except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError, ValueError) as exc:
        problem = str(exc).splitlines()[0]
        if "Precision is not great enough" in problem:  # `pc.field("price") * 2` on a decimal(10, 2)
            problem += (" (Arrow takes a Python integer as a decimal of 19 digits or more: in an expression over "
                        "a decimal column, give numbers as decimals, pa.scalar(Decimal('2')))")
        elif "Rescaling Decimal value would cause data loss" in problem and (scales := {  # price * Decimal('1.1')
                f.name: f.type.scale for f in rows.schema if f.name in updates and pa.types.is_decimal(f.type)}):
            problem += (" (a result has more digits after the point than its column holds: round it to the "
                        "column's scale, " + ", ".join(f"{c}: pc.round(..., {n})" for c, n in scales.items()) + ")")
        raise InvalidOptionError(f"an update's new values could not be computed: {problem}") from None


def describe_updates(updates: Mapping[str, pa.Scalar | pc.Expression]) -> str:
    """`check_updates`' updates as one line for people (commit metadata's `updates`, `nbcc
    history`): literals as written, `status = 'shipped', price = multiply_checked(price, 1.1)`."""
    def text(value: Any) -> str:
        if isinstance(value, pc.Expression):
            return describe_expression(value)
        return sql_literal(value.as_py() if isinstance(value, pa.Scalar) else value)
    return cut_description(", ".join(f"{sql_name(column)} = {text(value)}" for column, value in updates.items()))
