"""Conditions written as text, turned into filters that `expr.parse_filter` takes:

- the command line's `--where` (`parse_conditions`): `COL OP VALUE`, `COL in V1,V2`,
  `COL not in V1,V2`, `COL is [not] null`, values as text (quotes optional), joined by AND;
- Delta's `replaceWhere` SQL (`parse_predicate`): such conditions joined by AND, with SQL's
  quoting, `IN (...)`, `BETWEEN`, and typed `DATE`/`TIMESTAMP` literals.

`typed_condition` then puts the values in their column's type. Anything that SQL would read
differently from how nbcc compares it is refused rather than guessed: a misread condition would
delete, or replace, other partitions or records than the user meant.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc

from .errors import InvalidOptionError
from .expr import OPERATOR_ALIASES, PLAIN_NAME, tuple_type

_CONDITION_FORMS = ("COLUMN OP VALUE (OP one of = == != <> < <= > >=), COLUMN in V1,V2, COLUMN not in V1,V2 "
                    "or COLUMN is [not] null")


# A column name: bare, or in backticks as Spark SQL quotes one (`order date`; `` inside is one `).
_QUOTED_NAME = r"`(?:[^`]|``)+`"
_NAME = rf"({_QUOTED_NAME}|[^\s`]+?)"


def _unquoted_name(name: str) -> str:
    return name[1:-1].replace("``", "`") if len(name) > 1 and name[0] == name[-1] == "`" else name


# One value of a list: quoted ('' or "" inside doubles the quote, as in SQL) or bare.
_ITEM = re.compile(r"""\s*(?:'((?:[^']|'')*)'|"((?:[^"]|"")*)"|([^,'"]*?))\s*(,|$)""")


def _values(text: str, single: bool = False, refuse_null: bool = False) -> list[str]:
    """The values of a condition's text: `V`, or a list `V1, 'V 2', (V3, V4)` (SQL's
    parentheses optional); a bare value holding AND or OR is refused (one condition each), and
    with `refuse_null` a bare NULL."""
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
                "the command line, also by repeating --where), and OR is not supported")
        if refuse_null and m[3] is not None and m[3].lower() == "null":
            # SQL's `= NULL` matches nothing, and `--set COL=NULL` sets a null: neither is the text.
            raise InvalidOptionError("NULL is not a value to compare with (in SQL, = NULL matches no row): write "
                                     "'COL is null' or 'COL is not null', or quote 'NULL' to mean the text")
        out.append(m[1].replace("''", "'") if m[1] is not None else m[2].replace('""', '"') if m[2] is not None
                   else m[3])
        pos = m.end()
        if m[4] == "":
            return out


def parse_condition(text: str, refuse_null: bool = True) -> tuple[Any, ...]:
    """A condition as the command line takes it (`day < 2026-09-01`, `region in 'eu west',us`,
    `day is null`, `` `order date` = 2026-11-01 ``): a filter tuple whose values are still
    text. An unquoted NULL value is refused (`refuse_null`; replaceWhere's parser, which masks
    quoted literals, says so itself)."""
    column, *rest = _parse_condition(text, refuse_null)
    return (_unquoted_name(column), *rest)


def parse_conditions(text: str) -> list[tuple[Any, ...]]:
    """The command line's `--where`: one condition (`parse_condition`'s) or several joined by
    AND, as `nbcc history` records a filter (`day >= 2026-11-01 AND status = test`). An AND
    inside quotes is part of a value; a bare value holding one is refused, so nothing that was
    one condition is read as two."""
    masked, literals = _masked(text)
    return [parse_condition(_unmasked(part, literals)) for part in _split_and(masked)]


def _parse_condition(text: str, refuse_null: bool) -> tuple[Any, ...]:
    """`parse_condition`, its column name as written (quoted or not)."""
    m = re.fullmatch(rf"\s*{_NAME}\s+is\s+(not\s+)?null\s*", text, re.IGNORECASE)
    if m:
        return (m[1], "is_not_null" if m[2] else "is_null")
    m = re.fullmatch(rf"\s*{_NAME}\s+(not\s+in|in)\s*(\S.*?)\s*", text, re.IGNORECASE)
    if m:
        return (m[1], "in" if m[2].lower() == "in" else "not_in", _values(m[3], refuse_null=refuse_null))
    # An operator not followed by another operator character: `s >= ` is not `s > '='`.
    m = re.fullmatch(rf"\s*({_QUOTED_NAME}|[^\s<>=!`]+)\s*(<=|>=|!=|<>|==|=|<|>)(?![<>=!])\s*(\S.*?)\s*", text)
    if m:
        return (m[1], {"<>": "!="}.get(m[2], OPERATOR_ALIASES.get(m[2], m[2])),
                _values(m[3], single=True, refuse_null=refuse_null)[0])
    raise InvalidOptionError(f"{text!r}: give {_CONDITION_FORMS}, e.g. 'day < 2026-09-01' (a column name "
                             "holding spaces or operators in backticks: `order date`)")


# Quoted literals, and column names in backticks (masked alike: a quote inside one is no literal).
_LITERAL = re.compile(r"""'(?:[^']|'')*'|"(?:[^"]|"")*"|`(?:[^`]|``)*`""")
_HOLE = re.compile(r"\x00(\d+)\x00")


def _masked(text: str) -> tuple[str, list[str]]:
    """`text` with each quoted literal and name in backticks replaced by a numbered hole, and
    those literals (so that keywords and ANDs are looked for outside them)."""
    literals: list[str] = []

    def hole(m: re.Match) -> str:
        literals.append(m[0])
        return f"\x00{len(literals) - 1}\x00"

    return _LITERAL.sub(hole, text), literals


def _unmasked(masked: str, literals: list[str]) -> str:
    return _HOLE.sub(lambda m: literals[int(m[1])], masked)


_SQL_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")


class SqlNumber(str):
    """An unquoted numeric literal of a replaceWhere condition (SQL compares it as a number)."""


class SqlBoolean(str):
    """An unquoted true or false of a replaceWhere condition (SQL casts a string column to it)."""


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
    def unmasked(masked: str) -> str:
        return _unmasked(masked, literals)

    # Keywords are looked for only outside quoted literals: 'by date' is no DATE literal.
    body, literals = _masked(text.strip())
    if "'" in body or '"' in body or "`" in body:
        raise InvalidOptionError(f"{text!r} has an unbalanced quote")
    typed_literals: dict[int, type] = {}  # literal -> its SQL type, for those given one

    def typed_literal(m: re.Match) -> str:
        typed_literals[int(m[2])] = SqlDate if m[1].lower() == "date" else SqlTimestamp
        return f"\x00{m[2]}\x00"

    def value(masked: str) -> str:
        """A value of the masked text: its literal unquoted (and typed), or a number or boolean."""
        if (m := _HOLE.fullmatch(masked)) and not literals[int(m[1])].startswith("`"):
            quoted = literals[int(m[1])]
            kind = typed_literals.get(int(m[1]), str)
            return kind(quoted[1:-1].replace(quoted[0] * 2, quoted[0]))
        if _SQL_NUMBER.fullmatch(masked):
            return SqlNumber(masked)
        if masked.lower() in ("true", "false"):
            return SqlBoolean(masked)
        raise InvalidOptionError(
            f"{unmasked(masked)!r} is not a literal: quote a string or date ('2026-11-01'); a column, a "
            "function, NULL (use IS NULL) or arithmetic is not supported")

    body = re.sub(r"\b(date|timestamp|timestamp_ntz)\s*\x00(\d+)\x00", typed_literal, body, flags=re.IGNORECASE)
    between = re.compile(r"(\S+)\s+between\s+(\S+)\s+and\s+(\S+)", re.IGNORECASE)
    body = between.sub(r"\1 >= \2 AND \1 <= \3", body)
    conditions = []
    for part in _split_and(body):
        part = part.strip()
        while part.startswith("(") and part.endswith(")") and _split_and(part[1:-1]) == [part[1:-1]]:
            part = part[1:-1].strip()
        if re.match(r"not\s", part, re.IGNORECASE):
            raise InvalidOptionError(f"{unmasked(part)!r}: NOT is not supported here (NOT IN and != are); give "
                                     "conditions joined by AND")
        try:
            column, *rest = _parse_condition(part, refuse_null=False)  # literals still masked: which were quoted
        except InvalidOptionError:
            raise InvalidOptionError(
                f"{unmasked(part)!r} is not a condition it can read (COLUMN OP 'literal', COLUMN [NOT] IN ('a', "
                "'b'), COLUMN BETWEEN 'a' AND 'b', COLUMN IS [NOT] NULL, a COLUMN holding spaces in backticks: "
                "`order day`; OR, LIKE and functions are not supported)") from None
        column = unmasked(column)
        if not (re.fullmatch(_QUOTED_NAME, column) or PLAIN_NAME.fullmatch(column)):
            raise InvalidOptionError(f"{column!r} is not a column name: functions and expressions are "
                                     "not supported, only a partition column (in backticks if its name holds "
                                     "spaces: `order date`)")
        if len(rest) == 2:
            rest[1] = [value(v) for v in rest[1]] if isinstance(rest[1], list) else value(rest[1])
        conditions.append((_unquoted_name(column), *rest))
    return conditions


def with_column_as_spelled(item: tuple[Any, ...], schema: pa.Schema) -> tuple[Any, ...]:
    """`item` naming its column as `schema` spells it: SQL, and so a condition written as text,
    names columns in any letter case (a table's names never differ only in case)."""
    names = {n.lower(): n for n in schema.names}
    return (names.get(item[0].lower(), item[0]), *item[1:])


def typed_condition(item: tuple[Any, ...], schema: pa.Schema) -> tuple[Any, ...] | pc.Expression:
    """`parse_condition`'s tuple with its text values in the column's type: a filter tuple for
    the types the tuple form takes (`tuple_type`), else a pyarrow expression. A column not in
    `schema` is left for `parse_filter` to report."""
    if len(item) < 3 or item[0] not in schema.names:
        return item
    column, op, given = item
    t = schema.field(column).type
    texts = given if isinstance(given, list) else [given]
    numbers = [v for v in texts if isinstance(v, SqlNumber)]
    if numbers and (pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_temporal(t)):
        raise InvalidOptionError(f"condition on {column!r} ({t}): {numbers[0]} is a number, which SQL compares "
                                 f"numerically; quote it ('{numbers[0]}') to compare it as a {t} value")
    if not pa.types.is_boolean(t) and any(isinstance(v, SqlBoolean) for v in texts):
        raise InvalidOptionError(f"condition on {column!r} ({t}): {given!r} is a boolean, which SQL compares as "
                                 f"one (casting the column); quote it to compare it as a {t} value")
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
    if tuple_type(t):
        def value(v: str) -> Any:
            if pa.types.is_integer(t):
                return int(v)
            if pa.types.is_floating(t):
                try:
                    return float(v)  # NaN, inf and -inf too, as Arrow reads them
                except ValueError:
                    return v  # `parse_filter` says what is wrong
            if pa.types.is_boolean(t):
                return v.lower() == "true"
            if pa.types.is_decimal(t):
                try:
                    return Decimal(v.strip())  # a number, as history then shows it
                except InvalidOperation:
                    return v  # `parse_filter` says what is wrong
            return v  # dates and timestamps as text, read by `parse_filter`
        return (column, op, [value(v) for v in given] if isinstance(given, list) else value(given))
    try:
        values = _cast_texts(texts, t)
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidOptionError(f"condition on {column!r}: {given!r} is not a value of type {t} ({exc})") from None
    f = pc.field(column)
    if op in ("in", "not_in"):
        found = f.isin(values)
        return found if op == "in" else ~found & f.is_valid()  # SQL: a null is not NOT IN
    return {"=": f == values[0], "!=": f != values[0], "<": f < values[0], "<=": f <= values[0],
            ">": f > values[0], ">=": f >= values[0]}[op]


def _cast_texts(texts: list[str], t: pa.DataType) -> pa.Array:
    """Values written as text, in type `t` (Arrow's parsing: numbers, ISO dates and times)."""
    try:
        return pc.cast(pa.array(texts, pa.string()), t)
    except pa.ArrowInvalid:
        if not pa.types.is_timestamp(t):
            raise
        # A time without a zone is UTC, as the `as_of` option's; one with a zone, compared
        # with a column without one (Spark's TIMESTAMP_NTZ), is taken at its UTC wall time.
        other = pa.timestamp(t.unit) if t.tz else pa.timestamp(t.unit, "UTC")
        return pc.cast(pc.cast(pa.array(texts, pa.string()), other), t)


def parse_assignment(text: str) -> tuple[str, str | None]:
    """`COLUMN=VALUE` as the command line's `nbcc update --set` takes it: the column (in
    backticks if its name holds spaces or =) and the value's text, unquoted ('it''s' and "a, b"
    as in a condition), or None for an unquoted NULL."""
    m = re.fullmatch(rf"\s*({_QUOTED_NAME}|[^=`]*?)\s*=(.*)", text, re.DOTALL)
    column, value = (_unquoted_name(m[1]), m[2].strip()) if m else ("", "")
    if not column.strip() or not value:
        raise InvalidOptionError(f"{text!r}: give COLUMN=VALUE, e.g. status=shipped, note='a, b', note=NULL, "
                                 "note='' (the empty text) or `order date`=2026-11-01")
    if value.lower() == "null":
        return column, None
    for quote in ("'", '"'):
        if len(value) >= 2 and value[0] == value[-1] == quote:
            return column, value[1:-1].replace(quote * 2, quote)
    return column, value


def typed_value(column: str, text: str | None, schema: pa.Schema) -> tuple[str, pa.Scalar]:
    """`parse_assignment`'s column (as `schema` spells it, names in any letter case as SQL's) and
    its value in the column's type; a column not in `schema` is left for the caller to report."""
    column = with_column_as_spelled((column,), schema)[0]
    if column not in schema.names:
        return column, pa.scalar(text)
    t = schema.field(column).type
    if text is None:
        return column, pa.scalar(None, t)
    try:
        if pa.types.is_timestamp(t) and t.tz is None:
            # A value to store, not to compare: a time with a zone is an instant, and a column
            # without one (TIMESTAMP_NTZ) holds wall-clock times, as a write refuses it too.
            return column, pc.cast(pa.array([text], pa.string()), t)[0]
        return column, _cast_texts([text], t)[0]
    except (pa.ArrowInvalid, pa.ArrowNotImplementedError) as exc:
        raise InvalidOptionError(f"--set {column}: {text!r} is not a value of type {t} "
                                 f"({str(exc).splitlines()[0]})") from None


def parse_replace_where(text: str) -> list[tuple[Any, ...]]:
    """`parse_predicate` of a replaceWhere option, its errors saying what the option takes (the
    Spark connector checks the text before a first write creates the table)."""
    try:
        return parse_predicate(text)
    except InvalidOptionError as exc:
        raise InvalidOptionError(
            f"{exc}. replaceWhere takes conditions on partition columns joined by AND: = != <> < <= > >= "
            "IN NOT IN BETWEEN IS [NOT] NULL") from None
