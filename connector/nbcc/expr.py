"""Predicates on top-level columns: what a read can prune with and apply exactly.

Spark's pushed filters and the Python API's `filter=` both become a conjunction of `Predicate`s.
Each predicate can
- be applied exactly to merged rows (`to_arrow`, a pyarrow compute expression);
- say whether a file slice may hold a matching row, from per-file min/max/null statistics
  (`may_match`): every value of a merged row comes from some row of the slice's files (in every
  merge mode), so a slice is skipped only when no file can hold a matching value;
- give the values it pins a column to (`pinned_values`), for partition and bucket pruning.

Only column types whose comparison semantics are the same in Spark, Arrow and JSON statistics are
accepted (integers, strings, dates, booleans); others are left for the engine to evaluate.

The Python API's form: a list of tuples, all of which must hold (AND), like pyarrow.parquet's:
    [("id", "=", 5), ("day", "in", ["2026-11-20", "2026-11-21"]), ("name", "starts_with", "a"),
     ("price", "is_not_null")]
Operators: = == != < <= > >= in not_in is_null is_not_null starts_with ends_with contains.
The list may also hold pyarrow compute expressions, applied exactly after merging.
"""

from __future__ import annotations

import bisect
import datetime as dt
import functools
import operator
import re
from dataclasses import dataclass, field as dataclass_field
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

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
    return (pa.types.is_integer(t) or pa.types.is_string(t) or pa.types.is_large_string(t)
            or pa.types.is_date32(t) or pa.types.is_boolean(t))


def stat_value(value: Any) -> Any:
    """A filter value in the form statistics are recorded in (dates as ISO text)."""
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return value.isoformat()
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
        except TypeError:
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


def check_value(column: str, field: pa.Field, op: str, value: Any) -> Any:
    if op in ("is_null", "is_not_null"):
        return None
    if op in ("in", "not_in"):
        if isinstance(value, (str, bytes)) or not isinstance(value, Iterable):
            raise InvalidOptionError(f"filter on {column!r}: {op} needs a list of values")
        values = tuple(_normalize(field, x) for x in value)
        _cast_check(column, field, [x for x in values if x is not None])
        return values
    if op in ("starts_with", "ends_with", "contains"):
        if not (pa.types.is_string(field.type) or pa.types.is_large_string(field.type)) or not isinstance(value, str):
            raise InvalidOptionError(f"filter on {column!r}: {op} needs a string column and a string value")
        return value
    if value is None:
        raise InvalidOptionError(f"filter on {column!r}: compare with None using is_null / is_not_null")
    value = _normalize(field, value)
    _cast_check(column, field, [value])
    return value


def _normalize(field: pa.Field, value: Any) -> Any:
    """ISO text for a date column is a date."""
    if pa.types.is_date(field.type) and isinstance(value, str):
        try:
            return dt.date.fromisoformat(value)
        except ValueError:
            return value  # reported by the type check
    return value


def _cast_check(column: str, field: pa.Field, values: Sequence[Any]) -> None:
    t = field.type
    kinds = ((pa.types.is_integer, (int,), "integers"), (pa.types.is_boolean, (bool,), "booleans"),
             (pa.types.is_date, (dt.date,), "dates (or ISO text)"),
             (lambda x: pa.types.is_string(x) or pa.types.is_large_string(x), (str,), "strings"))
    for is_kind, py_types, words in kinds:
        if is_kind(t):
            bad = [v for v in values if not isinstance(v, py_types) or isinstance(v, dt.datetime)
                   or (isinstance(v, bool) and bool not in py_types)]
            if bad:
                raise InvalidOptionError(f"filter on {column!r} ({t}): value(s) {bad!r} are not {words}")
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
        if column not in schema.names:
            raise InvalidOptionError(f"filter column {column!r} is not in the table (as of the time read); "
                                     f"its columns are {schema.names}")
        field = schema.field(column)
        if not supported_type(field.type) and op not in ("is_null", "is_not_null"):
            raise InvalidOptionError(
                f"filter column {column!r} has type {field.type}; the tuple form supports integer, "
                "string, date and boolean columns (use a pyarrow expression for others)"
            )
        op, value = _within_range(field.type, op, value)
        preds.append(Predicate(column, op, check_value(column, field, op, value), type=field.type))
    return tuple(preds), functools.reduce(operator.and_, expressions) if expressions else None


def _within_range(t: pa.DataType, op: str, value: Any) -> tuple[str, Any]:
    """(op, value) with integers outside the range of integer type `t` taken out, as SQL
    compares them: `m < 300` on an int8 column holds for every non-null value, `m = 300` for
    none. (Arrow cannot make a scalar of `t` from them.)"""
    if not pa.types.is_integer(t):
        return op, value
    info = np.iinfo(t.to_pandas_dtype())
    lo, hi = int(info.min), int(info.max)

    def outside(v: Any) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and not lo <= v <= hi

    if op in ("in", "not_in") and isinstance(value, (list, tuple)):
        return op, [v for v in value if not outside(v)]
    if op not in COMPARISONS or not outside(value):
        return op, value
    above = value > hi
    every = {"!=": True, "<": above, "<=": above, ">": not above, ">=": not above}.get(op, False)
    return ("is_not_null", None) if every else ("in", [])


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
    """`value` spelled as a SQL literal, for descriptions."""
    if value is None:
        return "NULL"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, dt.date) and not isinstance(value, dt.datetime):
        return f"DATE '{value.isoformat()}'"
    if isinstance(value, (str, dt.datetime)):
        return "'" + str(value).replace("'", "''") + "'"
    return str(value)


def conjunction(preds: Sequence[Predicate], extra: pc.Expression | None = None) -> pc.Expression | None:
    expr = extra
    for p in preds:
        expr = p.to_arrow() if expr is None else expr & p.to_arrow()
    return expr
