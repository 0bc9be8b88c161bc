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

The command line's form (`parse_condition`, `typed_condition`): `COL OP VALUE`, `COL in V1,V2`,
`COL not in V1,V2`, `COL is [not] null`, values as text (quotes optional), converted to the
column's type.
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
_ALIASES = {"==": "=", "not in": "not_in", "is null": "is_null", "is not null": "is_not_null"}


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
        column, op = item[0], _ALIASES.get(str(item[1]).strip().lower(), str(item[1]).strip().lower())
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


def conjunction(preds: Sequence[Predicate], extra: pc.Expression | None = None) -> pc.Expression | None:
    expr = extra
    for p in preds:
        expr = p.to_arrow() if expr is None else expr & p.to_arrow()
    return expr


# -- the command line's form ---------------------------------------------------------------------

_CONDITION_FORMS = ("COLUMN OP VALUE (OP one of = == != <> < <= > >=), COLUMN in V1,V2, COLUMN not in V1,V2 "
                    "or COLUMN is [not] null")


# One value of a list: quoted ('' or "" inside doubles the quote, as in SQL) or bare.
_ITEM = re.compile(r"""\s*(?:'((?:[^']|'')*)'|"((?:[^"]|"")*)"|([^,'"]*?))\s*(,|$)""")


def _values(text: str, single: bool = False) -> list[str]:
    """The values of a condition's text: `V`, or a list `V1, 'V 2', (V3, V4)` (SQL's
    parentheses optional); a bare value holding AND or OR is refused (one condition each)."""
    text = text.strip()
    if not single and text.startswith("(") and text.endswith(")"):
        text = text[1:-1]
    out: list[str] = []
    pos = 0
    while True:
        m = _ITEM.match(text, pos)
        bad = m is None or (single and m[4] == ",")
        if not bad and m[3] is not None:
            bad = m[3] == "" or re.search(r"\s(and|or)\s", f" {m[3]} ", re.IGNORECASE) is not None
        if bad:
            raise InvalidOptionError(
                f"{text!r} is not {'a value' if single else 'a list of values V1,V2'}: quote a value that holds "
                "commas, quotes or the word AND or OR ('a, b', 'it''s'); conditions are joined by AND (on "
                "the command line, by repeating --where), and OR is not supported")
        out.append(m[1].replace("''", "'") if m[1] is not None else m[2].replace('""', '"') if m[2] is not None
                   else m[3])
        pos = m.end()
        if m[4] == "":
            return out


def parse_condition(text: str) -> tuple[Any, ...]:
    """A condition as the command line takes it (`day < 2026-09-01`, `region in 'eu west',us`,
    `day is null`): a filter tuple whose values are still text."""
    m = re.fullmatch(r"\s*(\S+?)\s+is\s+(not\s+)?null\s*", text, re.IGNORECASE)
    if m:
        return (m[1], "is_not_null" if m[2] else "is_null")
    m = re.fullmatch(r"\s*(\S+?)\s+(not\s+in|in)\s*(\S.*?)\s*", text, re.IGNORECASE)
    if m:
        return (m[1], "in" if m[2].lower() == "in" else "not_in", _values(m[3]))
    # An operator not followed by another operator character: `s >= ` is not `s > '='`.
    m = re.fullmatch(r"\s*([^\s<>=!]+)\s*(<=|>=|!=|<>|==|=|<|>)(?![<>=!])\s*(\S.*?)\s*", text)
    if m:
        return (m[1], {"<>": "!="}.get(m[2], _ALIASES.get(m[2], m[2])), _values(m[3], single=True)[0])
    raise InvalidOptionError(f"{text!r}: give {_CONDITION_FORMS}, e.g. 'day < 2026-09-01'")


_LITERAL = re.compile(r"""'(?:[^']|'')*'|"(?:[^"]|"")*\"""")
_HOLE = re.compile(r"(?:\x00|\\x00)(\d+)(?:\x00|\\x00)")  # raw, or as repr shows it
_SQL_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class SqlNumber(str):
    """An unquoted numeric literal of a replaceWhere condition (SQL compares it as a number)."""


class SqlDate(str):
    """A `DATE '...'` literal of a replaceWhere condition."""


class SqlTimestamp(str):
    """A `TIMESTAMP '...'` literal of a replaceWhere condition."""


def _split_and(text: str) -> list[str]:
    """`text` (its quoted literals masked) split at each AND outside parentheses."""
    parts, depth, start, i = [], 0, 0, 0
    while i < len(text):
        c = text[i]
        if c == "(":
            depth += 1
        elif c == ")":
            depth -= 1
        elif depth == 0 and text[i].isspace() and (m := re.match(r"\s+and\s+", text[i:], re.IGNORECASE)):
            parts.append(text[start:i])
            i += m.end()
            start = i
            continue
        i += 1
    parts.append(text[start:])
    return parts


def parse_predicate(text: str) -> list[tuple[Any, ...]]:
    """A SQL condition of Delta's replaceWhere form, conditions joined by AND:
    `day >= '2026-11-01' AND day < '2026-11-08'`, `region IN ('eu', 'us')`,
    `day BETWEEN DATE '2026-11-01' AND DATE '2026-11-07'`, `d IS NULL`: filter tuples whose
    values are still text (see `typed_condition`; an unquoted number is a `SqlNumber`). OR and
    NOT (but NOT IN) are refused, and so is any value that is neither a quoted literal, a number
    nor true/false (a column, a function, NULL, arithmetic): read as text, it would match other
    partitions than SQL's."""
    literals: list[str] = []

    def hole(m: re.Match) -> str:
        literals.append(m[0])
        return f"\x00{len(literals) - 1}\x00"

    # Keywords are looked for only outside quoted literals: 'by date' is no DATE literal.
    body = _LITERAL.sub(hole, text.strip())
    if "'" in body or '"' in body:
        raise InvalidOptionError(f"{text!r} has an unbalanced quote")
    typed_literals: dict[int, type] = {}  # literal -> its SQL type, for those given one

    def typed_literal(m: re.Match) -> str:
        typed_literals[int(m[2])] = SqlDate if m[1].lower() == "date" else SqlTimestamp
        return f"\x00{m[2]}\x00"

    body = re.sub(r"\b(date|timestamp|timestamp_ntz)\s*\x00(\d+)\x00", typed_literal, body, flags=re.IGNORECASE)
    between = re.compile(r"(\S+)\s+between\s+(\S+)\s+and\s+(\S+)", re.IGNORECASE)
    body = between.sub(r"\1 >= \2 AND \1 <= \3", body)
    conditions = []
    for part in _split_and(body):
        part = part.strip()
        while part.startswith("(") and part.endswith(")") and _split_and(part[1:-1]) == [part[1:-1]]:
            part = part[1:-1].strip()
        if re.match(r"not\s", part, re.IGNORECASE):
            part = _HOLE.sub(lambda m: literals[int(m[1])], part)
            raise InvalidOptionError(f"{part!r}: NOT is not supported here (NOT IN and != are); give conditions "
                                     "joined by AND")
        try:
            shape = parse_condition(part)  # values still masked: which were quoted
        except InvalidOptionError:
            raise InvalidOptionError(
                f"{_HOLE.sub(lambda m: literals[int(m[1])], part)!r} is not a condition it can read (COLUMN OP "
                "'literal', COLUMN [NOT] IN ('a', 'b'), COLUMN BETWEEN 'a' AND 'b', COLUMN IS [NOT] NULL; OR, LIKE and "
                "functions are not supported)") from None
        if not re.fullmatch(r"`[^`]+`|[A-Za-z_][A-Za-z0-9_]*", shape[0]):
            raise InvalidOptionError(f"{_HOLE.sub(lambda m: literals[int(m[1])], shape[0])!r} is not a column name: "
                                     "functions and expressions are not supported, only a partition column")
        column, *rest = parse_condition(_HOLE.sub(lambda m: literals[int(m[1])], part))
        if len(rest) == 2:
            masked = shape[2] if isinstance(shape[2], list) else [shape[2]]
            values = rest[1] if isinstance(rest[1], list) else [rest[1]]
            typed = []
            for m, v in zip(masked, values):
                if _HOLE.fullmatch(m):
                    kind = typed_literals.get(int(_HOLE.fullmatch(m)[1]))
                    typed.append(kind(v) if kind else v)
                elif _SQL_NUMBER.fullmatch(m):
                    typed.append(SqlNumber(v))
                elif m.lower() in ("true", "false"):
                    typed.append(v)
                else:
                    raise InvalidOptionError(
                        f"{_HOLE.sub(lambda x: literals[int(x[1])], m)!r} is not a literal: quote a string or "
                        "date ('2026-11-01'); a column, a function, NULL (use IS NULL) or arithmetic is not "
                        "supported")
            rest[1] = typed if isinstance(rest[1], list) else typed[0]
        conditions.append((column.strip("`"), *rest))
    return conditions


def typed_condition(item: tuple[Any, ...], schema: pa.Schema) -> tuple[Any, ...] | pc.Expression:
    """`parse_condition`'s tuple with its text values in the column's type: a filter tuple for
    the types the tuple form takes (integers, strings, dates, booleans), else a pyarrow
    expression (timestamps, decimals, floats). A column not in `schema` is left for
    `parse_filter` to report."""
    if len(item) < 3 or item[0] not in schema.names:
        return item
    column, op, given = item
    t = schema.field(column).type
    texts = given if isinstance(given, list) else [given]
    numbers = [v for v in texts if isinstance(v, SqlNumber)]
    if numbers and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_temporal(t)):
        raise InvalidOptionError(f"condition on {column!r} ({t}): {numbers[0]} is a number, which SQL compares "
                                 f"numerically; quote it ('{numbers[0]}') to compare it as a {t} value")
    # A DATE or TIMESTAMP literal compared with a column of another type is compared as SQL casts
    # them (a string as a date, '2026-11-7' included), not as nbcc would compare text: refused.
    for kind, fits, name in ((SqlDate, pa.types.is_date, "DATE"), (SqlTimestamp, pa.types.is_timestamp, "TIMESTAMP")):
        given_kind = [v for v in texts if isinstance(v, kind)]
        if given_kind and not fits(t):
            raise InvalidOptionError(f"condition on {column!r} ({t}): {name} '{given_kind[0]}' is compared as SQL casts "
                                     f"it, which nbcc does not do; compare with a plain quoted value of the column's "
                                     f"type ('{given_kind[0]}')")
    if pa.types.is_boolean(t) and any(v.lower() not in ("true", "false") for v in texts):
        raise InvalidOptionError(f"condition on {column!r}: {given!r} is not true or false")
    if pa.types.is_integer(t) and not all(re.fullmatch(r"[+-]?\d+", v.strip()) for v in texts):
        raise InvalidOptionError(f"condition on {column!r}: {given!r} is not an integer")
    if supported_type(t):
        def value(v: str) -> Any:
            return int(v) if pa.types.is_integer(t) else v.lower() == "true" if pa.types.is_boolean(t) else v
        return (column, op, [value(v) for v in given] if isinstance(given, list) else value(given))
    try:
        try:
            values = pc.cast(pa.array(texts, pa.string()), t)
        except pa.ArrowInvalid:
            if not pa.types.is_timestamp(t):
                raise
            # A time without a zone is UTC, as the `as_of` option's; one with a zone, compared
            # with a column without one (Spark's TIMESTAMP_NTZ), is taken at its UTC wall time.
            other = pa.timestamp(t.unit) if t.tz else pa.timestamp(t.unit, "UTC")
            values = pc.cast(pc.cast(pa.array(texts, pa.string()), other), t)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidOptionError(f"condition on {column!r}: {given!r} is not a {t} value ({exc})") from None
    f = pc.field(column)
    if op in ("in", "not_in"):
        found = f.isin(values)
        return found if op == "in" else ~found & f.is_valid()  # SQL: a null is not NOT IN
    return {"=": f == values[0], "!=": f != values[0], "<": f < values[0], "<=": f <= values[0],
            ">": f > values[0], ">=": f >= values[0]}[op]
