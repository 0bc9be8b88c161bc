"""Predicates on top-level columns: what a read can prune with and apply exactly.

Spark's pushed filters and the Python API's `filter=` both become a conjunction of `Predicate`s.
Each predicate can
- be applied exactly to merged rows (`to_arrow`, a pyarrow compute expression);
- say whether a file slice may hold a matching row, from per-file min/max/null statistics
  (`may_match`): every value of a merged row comes from some row of the slice's files (in every
  merge mode), so a slice is skipped only when no file can hold a matching value;
- give the values it pins a column to (`pinned_values`), for partition and bucket pruning.

Spark's filters and statistics take only column types whose comparison semantics are the same in
Spark, Arrow and JSON statistics (integers, strings, dates, booleans, timestamps, decimals); the
tuple form takes floats too (`tuple_type`); others are left for the engine to evaluate. A value
is compared as SQL compares it with the column: exactly, also when the column's type cannot hold
it (`m < 300` on an int8 column, a microsecond on a millisecond column, `9.995` on a
`decimal(10,2)` column).

The Python API's form: a list of tuples, all of which must hold (AND), like pyarrow.parquet's:
    [("id", "=", 5), ("day", "in", ["2026-11-20", "2026-11-21"]), ("name", "starts_with", "a"),
     ("price", "is_not_null")]
Operators: = == != < <= > >= in not_in is_null is_not_null starts_with ends_with contains.
A timestamp value is a datetime, ISO-8601 text, a NumPy datetime64 or a date (its midnight),
UTC when it has no zone; a decimal value a Decimal, an integer or text (not a float, which holds
another number); a float value a float or an integer.
The list may also hold pyarrow compute expressions, applied exactly after merging.
"""

from __future__ import annotations

import bisect
import datetime as dt
import decimal
import functools
import math
import operator
import re
from fractions import Fraction
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from .clock import parse_iso_time
from .errors import InvalidOptionError

COMPARISONS = ("=", "!=", "<", "<=", ">", ">=")
OPERATORS = COMPARISONS + ("in", "not_in", "is_null", "is_not_null", "starts_with", "ends_with", "contains")
OPERATOR_ALIASES = {"==": "=", "not in": "not_in", "is null": "is_null", "is not null": "is_not_null"}


def canonical_operator(given: Any) -> str:
    """A filter tuple's operator as nbcc names it: in any letter case, `==` as `=`, `not in` as
    `not_in`, ... (OPERATOR_ALIASES)."""
    op = str(given).strip().lower()
    return OPERATOR_ALIASES.get(op, op)


def supported_type(t: pa.DataType) -> bool:
    """Can statistics, and predicates pushed by Spark, use columns of type `t`?"""
    return (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_date32(t) or pa.types.is_boolean(t) or pa.types.is_timestamp(t)
            or pa.types.is_decimal(t))


def tuple_type(t: pa.DataType) -> bool:
    """Can a filter tuple name a column of type `t`? Floats too, compared as Arrow compares them
    (a NaN equals nothing), with no statistics: Spark ranks NaN above every number, and JSON has
    no NaN."""
    return supported_type(t) or pa.types.is_float32(t) or pa.types.is_float64(t)


def stat_value(value: Any) -> Any:
    """A filter value in the form statistics are recorded in (dates as ISO text; a timestamp is
    already an integer of its column's unit)."""
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()
    return value


def stat_order(t: pa.DataType | None) -> Any:
    """The key that orders recorded statistics of a `t` column: a decimal is recorded as text."""
    return _decimal_of if t is not None and pa.types.is_decimal(t) else _same


def _decimal_of(value: Any) -> Any:
    return None if value is None else decimal.Decimal(str(value))


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True)
class Predicate:
    column: str
    op: str
    value: Any = None  # a scalar, or a tuple for in / not_in
    negated: bool = False  # Not(...) of a comparison the stats cannot use
    # The column's type: values become scalars of it. Left to inference, an int becomes int64,
    # and Arrow then compares a uint64 column as int64 (values >= 2**63 fail the cast).
    type: pa.DataType | None = dataclass_field(default=None, compare=False)

    # -- exact application -------------------------------------------------------------------

    def to_arrow(self) -> pc.Expression:
        f = pc.field(self.column)
        op, v = self.op, self.value
        if self.type is not None and op in COMPARISONS:
            v = pa.scalar(v, self.type)
        if op == "=":
            e = f == v
        elif op == "!=":
            e = f != v
        elif op == "<":
            e = f < v
        elif op == "<=":
            e = f <= v
        elif op == ">":
            e = f > v
        elif op == ">=":
            e = f >= v
        elif op == "in":  # SQL: a null in the list matches nothing
            e = f.isin(self._value_set([x for x in v if x is not None]))
        elif op == "not_in":  # SQL: x NOT IN (..., NULL) is never true
            e = ~f.isin(self._value_set(list(v))) if None not in v else pc.scalar(False)
        elif op == "is_null":
            e = f.is_null()
        elif op == "is_not_null":
            e = f.is_valid()
        elif op == "starts_with":
            e = pc.starts_with(f, v)
        elif op == "ends_with":
            e = pc.ends_with(f, v)
        else:  # contains
            e = pc.match_substring(f, v)
        if op == "not_in":
            # SQL: x NOT IN (...) is null when x is null; keep nulls out.
            e = e & f.is_valid()
        return ~e if self.negated else e

    def _value_set(self, values: list[Any]) -> Any:
        return pa.array(values, self.type) if self.type is not None else values

    # -- pruning -----------------------------------------------------------------------------

    def may_match(self, stats: Mapping[str, Any] | None, rows: int) -> bool:
        """Could a file with these statistics of `self.column` hold a matching value?
        `stats` is {"min", "max", "nulls"} or None when unknown (then: maybe)."""
        if stats is None or self.negated:
            return True
        nulls = stats.get("nulls")
        if self.op == "is_null":
            return nulls is None or nulls > 0
        if self.op == "is_not_null":
            return nulls is None or nulls < rows
        if "min" not in stats:
            return True  # range not recorded
        lo, hi = stats["min"], stats["max"]
        if lo is None or hi is None:
            return False  # every value is null: no comparison can hold
        v = self.value
        try:
            order = stat_order(self.type)
            lo, hi = order(lo), order(hi)
            if self.op == "=":
                return lo <= stat_value(v) <= hi
            if self.op == "<":
                return lo < stat_value(v)
            if self.op == "<=":
                return lo <= stat_value(v)
            if self.op == ">":
                return hi > stat_value(v)
            if self.op == ">=":
                return hi >= stat_value(v)
            if self.op == "in":  # the least value >= min: a lookup per file or row group, not a scan
                values = self._sorted_in_values
                at = bisect.bisect_left(values, lo)
                return at < len(values) and values[at] <= hi
            if self.op == "starts_with" and isinstance(lo, str):
                # Strings with prefix v are one contiguous run from v on: a file misses it only
                # if all its values are below v, or its least value is past the run.
                return not (hi < v or (lo > v and not lo.startswith(v)))
        except (TypeError, decimal.InvalidOperation):
            return True
        return True

    @functools.cached_property
    def _sorted_in_values(self) -> list[Any]:
        return sorted(stat_value(x) for x in self.value if x is not None)

    def pinned_values(self) -> tuple | None:
        """The only values the column may take for the predicate to hold, if it pins them."""
        if self.negated:
            return None
        if self.op == "=":
            return (self.value,)
        if self.op == "in":
            return tuple(x for x in self.value if x is not None)
        return None


def check_value(column: str, field: pa.Field, op: str, value: Any) -> tuple[str, Any]:
    """(op, value) of a filter on `field`, its value(s) checked and in the form a `Predicate`
    holds: a date, a timestamp as an integer of the column's unit, a decimal of the column's
    scale. A value the column's type cannot hold is compared as SQL would (`_held`)."""
    if op in ("is_null", "is_not_null"):
        return op, None
    if op in ("starts_with", "ends_with", "contains"):
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)) or not isinstance(value, str):
            raise InvalidOptionError(f"filter on {column!r}: {op} needs a string column and a string value")
        return op, value
    if op in ("in", "not_in"):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise InvalidOptionError(f"filter on {column!r}: {op} needs a list of values")
        values = [_normalize(column, field, x) for x in value]
    else:
        if value is None:
            raise InvalidOptionError(f"filter on {column!r}: compare with None using is_null / is_not_null")
        values = [_normalize(column, field, value)]
    _cast_check(column, field, [x for x in values if x is not None])
    if pa.types.is_floating(field.type) and op in ("in", "not_in"):
        # A NaN equals nothing, as with `=` (Arrow's is_in would match NaN to NaN).
        values = [x for x in values if not (isinstance(x, float) and math.isnan(x))]
    counted = _counted(field.type)
    if counted is not None:
        lo, hi, as_value = counted
        op, values = _held(op, values, lo, hi)
        values = [x if x is None else as_value(x) for x in values]
    if not values and op not in ("in", "not_in"):
        return op, None  # is_not_null
    return (op, tuple(values)) if op in ("in", "not_in") else (op, values[0])


_UNITS_PER_SECOND = {"s": 1, "ms": 1000, "us": 10**6, "ns": 10**9}
_EPOCH = dt.datetime(1970, 1, 1)
_INT64 = (-2**63, 2**63 - 1)
_EXACT = decimal.Context(prec=80)  # more digits than any decimal type has (decimal256: 76)


def _counted(t: pa.DataType) -> tuple[int, int, Any] | None:
    """For a type whose values are integer counts (integers; timestamps: of their unit;
    decimals: of their last digit), the least and greatest count it holds and how a count
    becomes the value a predicate compares with; None for other types."""
    if pa.types.is_integer(t):
        info = np.iinfo(t.to_pandas_dtype())
        return int(info.min), int(info.max), int
    if pa.types.is_timestamp(t):
        return (*_INT64, int)
    if pa.types.is_decimal(t):
        most = 10**t.precision - 1
        return -most, most, lambda count: decimal.Decimal(count).scaleb(-t.scale, _EXACT)
    return None


def _held(op: str, values: list[Any], lo: int, hi: int) -> tuple[str, list[Any]]:
    """(op, values) with each value (an exact count: an int or a Fraction) one that the column's
    type holds, as SQL compares them: `m < 300` on an int8 column holds for every non-null value
    and `m = 300` for none; `t < 10:00:00.0005` on a millisecond column is `t <= 10:00:00.000`.
    A comparison that holds for every non-null value becomes `is_not_null`, one that holds for
    none `in ()`."""
    def held(v: Any) -> bool:
        return v.denominator == 1 and lo <= v <= hi

    if op in ("in", "not_in"):  # a value the column cannot hold equals no row's
        return op, [v if v is None else int(v) for v in values if v is None or held(v)]
    v = values[0]
    if held(v):
        return op, [int(v)]
    if lo <= v <= hi:  # between two values of the type: compare with the one below
        below = math.floor(v)
        return {"=": ("in", []), "!=": ("is_not_null", []), "<": ("<=", [below]), "<=": ("<=", [below]),
                ">": (">", [below]), ">=": (">", [below])}[op]
    above = v > hi
    every = {"!=": True, "<": above, "<=": above, ">": not above, ">=": not above}.get(op, False)
    return ("is_not_null", []) if every else ("in", [])


def _normalize(column: str, field: pa.Field, value: Any) -> Any:
    """A filter value in the form `_cast_check` checks: ISO text for a date column is a date; a
    timestamp or decimal is its exact count (`_counted`) as a Fraction. None stays None."""
    t = field.type
    if value is None:
        return None
    if pa.types.is_date(t) and isinstance(value, str):
        try:
            return dt.date.fromisoformat(value)
        except ValueError:
            return value  # reported by the type check
    if pa.types.is_timestamp(t):
        return _timestamp_count(column, t, value)
    if pa.types.is_decimal(t):
        return _decimal_count(column, t, value)
    return value


def _timestamp_count(column: str, t: pa.TimestampType, value: Any) -> Fraction:
    """`value` (a datetime, pandas' Timestamp or ISO-8601 text) as an exact count of `t`'s unit
    since the epoch. A value without a zone is UTC, as an `as_of` time; one with a zone compared
    with a column without one (TIMESTAMP_NTZ) is taken at its UTC wall time."""
    extra = Fraction(0)  # below the microsecond, which a datetime stops at
    when = value
    if isinstance(value, str):
        when, extra = parse_iso_time(value) or (None, extra)
    elif hasattr(value, "nanosecond") and hasattr(value, "to_pydatetime"):  # pandas' Timestamp
        extra = Fraction(value.nanosecond, 10**9)
        when = value.to_pydatetime(warn=False)
    elif isinstance(value, np.datetime64):
        return _datetime64_count(column, t, value)
    elif isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        when = dt.datetime.combine(value, dt.time())  # its midnight, as its ISO text reads
    if not isinstance(when, dt.datetime):
        raise InvalidOptionError(f"filter on {column!r} ({t}): {value!r} is not a timestamp: give ISO-8601 text "
                                 "('2026-11-20T10:00:00Z', '2026-11-20 10:00:00.5+01:00', '2026-11-20'; UTC when "
                                 "it has no zone) or a Python datetime")
    if when.tzinfo is not None:
        when = when.astimezone(dt.timezone.utc).replace(tzinfo=None)
    micros = (when - _EPOCH) // dt.timedelta(microseconds=1)  # exact, in any year a datetime has
    return (Fraction(micros, 10**6) + extra) * _UNITS_PER_SECOND[t.unit]


_DATETIME64_SECONDS = {"D": 86400, "h": 3600, "m": 60, "s": 1, "ms": Fraction(1, 10**3), "us": Fraction(1, 10**6),
                       "ns": Fraction(1, 10**9)}


def _datetime64_count(column: str, t: pa.TimestampType, value: np.datetime64) -> Fraction:
    """A NumPy datetime64 (a count of its unit since the epoch, no zone: UTC) as an exact count of
    `t`'s unit."""
    unit, step = np.datetime_data(value.dtype)
    if np.isnat(value) or unit not in _DATETIME64_SECONDS:
        raise InvalidOptionError(f"filter on {column!r} ({t}): {value!r} is not a time (NaT, or a unit of "
                                 "months or years); compare with None using is_null / is_not_null")
    seconds = int(value.astype(np.int64)) * step * _DATETIME64_SECONDS[unit]
    return Fraction(seconds) * _UNITS_PER_SECOND[t.unit]


def _decimal_count(column: str, t: pa.Decimal128Type, value: Any) -> Fraction:
    """`value` (a Decimal, an integer or text) as an exact count of `t`'s last digit; one far
    outside the type's range (1e999999999) as a count just outside it, which compares alike."""
    number = value
    if isinstance(value, str):
        try:
            number = decimal.Decimal(value.strip())
        except decimal.InvalidOperation:
            number = None
    if isinstance(number, bool) or not isinstance(number, (int, decimal.Decimal)) or (
            isinstance(number, decimal.Decimal) and not number.is_finite()):
        hint = " (a float holds another number than the one it prints: give Decimal('9.99') or '9.99')" \
            if isinstance(value, float) else ""
        raise InvalidOptionError(f"filter on {column!r} ({t}): {value!r} is not a decimal number{hint}")
    number = decimal.Decimal(number)
    if number and number.adjusted() > t.precision - t.scale:  # beyond every value of the type
        return Fraction(10**t.precision if number > 0 else -10**t.precision)
    if number and number.adjusted() < -t.scale - 1:  # strictly between 0 and the last digit's unit
        return Fraction(1 if number > 0 else -1, 2)
    return Fraction(number) * Fraction(10) ** t.scale


def _cast_check(column: str, field: pa.Field, values: Sequence[Any]) -> None:
    t = field.type
    kinds = ((pa.types.is_integer, (int,), "integers"), (pa.types.is_boolean, (bool,), "booleans"),
             (pa.types.is_floating, (int, float), "numbers"),
             (pa.types.is_date, (dt.date,), "dates (or ISO text)"),
             (lambda x: pa.types.is_string(x) or pa.types.is_large_string(x), (str,), "strings"))
    for is_kind, py_types, words in kinds:
        if is_kind(t):
            bad = [v for v in values if not isinstance(v, py_types) or isinstance(v, dt.datetime)
                   or (isinstance(v, bool) and bool not in py_types)]
            if bad:
                raise InvalidOptionError(f"filter on {column!r} ({t}): value(s) {bad!r} are not {words}")
    if _counted(t) is not None:
        return  # any count: `_held` compares those the type cannot hold
    try:
        pa.array(values, type=field.type)
    except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as exc:
        raise InvalidOptionError(
            f"filter on {column!r} ({field.type}): value(s) {list(values)!r} do not fit the column: {exc}"
        ) from None


def parse_filter(spec: Any, schema: pa.Schema) -> tuple[tuple[Predicate, ...], pc.Expression | None]:
    """The Python API's `filter=`: (predicates used for pruning and applied exactly, or an opaque
    pyarrow expression applied exactly after merging)."""
    if spec is None:
        return (), None
    if isinstance(spec, pc.Expression):
        return (), spec
    if isinstance(spec, tuple) and spec and isinstance(spec[0], str):
        spec = [spec]
    if not isinstance(spec, list) or not all(isinstance(t, (tuple, pc.Expression)) for t in spec):
        raise InvalidOptionError(
            "filter must be a pyarrow compute expression or a list of (column, op, value) tuples, "
            f"e.g. [('id', '=', 5), ('day', 'in', ['2026-11-21'])]; ops: {', '.join(OPERATORS)}"
        )
    expressions = [t for t in spec if isinstance(t, pc.Expression)]
    spec = [t for t in spec if isinstance(t, tuple)]
    preds = []
    for item in spec:
        if len(item) not in (2, 3):
            raise InvalidOptionError(f"filter item {item!r} must be (column, op) or (column, op, value)")
        column, op = item[0], canonical_operator(item[1])
        value = item[2] if len(item) == 3 else None
        if op not in OPERATORS:
            raise InvalidOptionError(f"filter operator {item[1]!r} is unknown; use one of {', '.join(OPERATORS)}")
        if (len(item) == 3) != (op not in ("is_null", "is_not_null")):  # a value left out or one ignored
            raise InvalidOptionError(f"filter item {item!r}: {op} takes " + (
                "no value: give (column, op)" if len(item) == 3 else "a value: give (column, op, value)"))
        if column not in schema.names:
            raise InvalidOptionError(f"filter column {column!r} is not in the table (as of the time read); "
                                     f"its columns are {schema.names}")
        field = schema.field(column)
        if not tuple_type(field.type) and op not in ("is_null", "is_not_null"):
            raise InvalidOptionError(
                f"filter column {column!r} has type {field.type}; the tuple form supports integer, float, "
                "string, date, boolean, timestamp and decimal columns (use a pyarrow expression for others)"
            )
        op, value = check_value(column, field, op, value)
        preds.append(Predicate(column, op, value, type=field.type))
    return tuple(preds), functools.reduce(operator.and_, expressions) if expressions else None


_LISTED_VALUES = 10  # of a longer IN list, the first ones are written out
_DESCRIBED_CHARS = 1000  # a described filter is cut here: it goes into a commit file every plan reads


def describe(spec: Any) -> str:
    """A filter as given to `parse_filter` (which has accepted it), as one line of text for people
    (the commit metadata's `condition`, `nbcc history`): tuples in SQL's spelling, their values as
    given (not as nbcc rewrites them to apply them), joined by AND; a pyarrow expression as
    pyarrow prints it, on one line. A long IN list is abbreviated and the whole is cut at 1000
    characters: deleting 50,000 keys must not make a 300 KB commit file. SQL text (replaceWhere's)
    is kept as given, cut alike."""
    if isinstance(spec, str):
        return cut_description(spec)
    items = [spec] if isinstance(spec, (tuple, pc.Expression)) else list(spec)
    parts = []
    for item in items:
        if isinstance(item, pc.Expression):
            parts.append(describe_expression(item))
            continue
        column, op = sql_name(item[0]), canonical_operator(item[1])
        value = item[2] if len(item) == 3 else None
        if op in COMPARISONS:
            parts.append(f"{column} {op} {sql_literal(value)}")
        elif op in ("in", "not_in"):
            values = list(value)
            shown = ", ".join(sql_literal(v) for v in values[:_LISTED_VALUES])
            more = f", ... {len(values)} values" if len(values) > _LISTED_VALUES else ""
            parts.append(f"{column} {'IN' if op == 'in' else 'NOT IN'} ({shown}{more})")
        elif op in ("is_null", "is_not_null"):
            parts.append(f"{column} IS {'NULL' if op == 'is_null' else 'NOT NULL'}")
        else:  # starts_with, ends_with, contains: as pyarrow names them (no wildcards to escape)
            parts.append(f"{op}({column}, {sql_literal(value)})")
    return cut_description(" AND ".join(parts))


def cut_description(text: str) -> str:
    """`text` cut to the length a description in commit metadata may have."""
    return text if len(text) <= _DESCRIBED_CHARS else text[:_DESCRIBED_CHARS - 3] + "..."


def describe_expression(expression: pc.Expression) -> str:
    """A pyarrow expression as pyarrow prints it, on one line."""
    return " ".join(str(expression).split())


# A column name SQL reads without backticks.
PLAIN_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def sql_name(column: str) -> str:
    """`column` as SQL (and nbcc's conditions) read it back: in backticks unless a plain name."""
    return column if PLAIN_NAME.fullmatch(column) else "`" + column.replace("`", "``") + "`"


def sql_literal(value: Any) -> str:
    """`value` spelled as a literal of nbcc's conditions (`nbcc delete --where` reads it back),
    for descriptions: times and dates as quoted ISO text, which a date or timestamp column
    reads as the value given."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        value = value.isoformat()
    elif isinstance(value, np.datetime64):
        value = np.datetime_as_string(value)
    if isinstance(value, (str, dt.datetime)):
        return "'" + str(value).replace("'", "''") + "'"
    return str(value)


def conjunction(preds: Sequence[Predicate], extra: pc.Expression | None = None) -> pc.Expression | None:
    expr = extra
    for p in preds:
        expr = p.to_arrow() if expr is None else expr & p.to_arrow()
    return expr
