"""Table.update: SQL's UPDATE ... SET ... WHERE as one upsert commit of the matching records with
their new values (literals, or pyarrow expressions over the record's columns)."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import nbcc
from nbcc.errors import InvalidOptionError
from nbcc.filenames import make_token
from nbcc.writer import prepare

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), ("day", pa.string()), ("ts", pa.int64()),
                    ("price", pa.float64()), ("status", pa.string())])


def new_table(uri: str, merge_mode: str) -> nbcc.Table:
    t = nbcc.Table.create(uri, SCHEMA, "id", partition_by="day", buckets=2, merge_mode=merge_mode,
                          ordering_field=None if merge_mode == "commit_time" else "ts")
    t.write(pa.table({"id": list(range(6)), "day": ["a", "b"] * 3, "ts": [1] * 6,
                      "price": [10.0, 20.0, None, 40.0, 50.0, 60.0], "status": ["new"] * 6}, schema=SCHEMA))
    return t


def rows(t: nbcc.Table, **kw) -> dict[int, tuple]:
    return {r["id"]: (r["day"], r["ts"], r["price"], r["status"]) for r in t.read(**kw).to_pylist()}


@pytest.mark.parametrize("merge_mode", ["event_time", "commit_time", "partial_update"])
def test_update_sets_literals_and_expressions_of_the_matching_records_in_one_commit(tmp_path, merge_mode):
    t = new_table(str(tmp_path / "t"), merge_mode)
    before = rows(t)
    written = t.history(1)[0].completion
    instant = t.update({"status": "shipped", "price": pc.field("price") * 2}, [("day", "=", "a"), ("id", "<", 4)])
    assert t.history(1)[0].instant == instant
    want = {**before, 0: ("a", 1, 20.0, "shipped"), 2: ("a", 1, None, "shipped")}  # null * 2 is null
    assert rows(t) == want
    assert rows(t, as_of=written) == before
    info = t.history(1)[0]
    assert (info.operation, info.rows, info.partitions) == ("update", 2, ("day=a",))
    assert info.parameters == {"condition": "day = 'a' AND id < 4",
                               "updates": "status = 'shipped', price = multiply_checked(price, 2)"}
    # A null is a value to set, except where a null in a write means "unchanged".
    if merge_mode == "partial_update":
        with pytest.raises(InvalidOptionError, match="in a partial_update table a null in a write means 'unchanged'"):
            t.update({"status": None}, pc.field("price") > 45)
        t.update({"status": "gone"}, pc.field("price") > 45, user_metadata="ticket 7")
        want.update({4: ("a", 1, 50.0, "gone"), 5: ("b", 1, 60.0, "gone")})
    else:
        t.update({"status": None}, pc.field("price") > 45, user_metadata="ticket 7")
        want.update({4: ("a", 1, 50.0, None), 5: ("b", 1, 60.0, None)})
    assert rows(t) == want and t.history(1)[0].parameters["user_metadata"] == "ticket 7"
    # No filter: every record. Nothing matching: nothing written.
    t.update({"price": pc.field("price") + 1})
    want = {k: (day, ts, None if price is None else price + 1, status) for k, (day, ts, price, status) in want.items()}
    assert rows(t) == want
    timeline = t.timeline()
    assert t.update({"status": "x"}, [("id", "=", 99)]) is None and t.timeline() == timeline
    # The update's rows merge with later writes as any upsert's do.
    t.compact()
    t.write(pa.table({"id": [0], "day": ["a"], "ts": [3], "price": [1.0], "status": ["later"]}, schema=SCHEMA))
    assert rows(t)[0] == ("a", 3, 1.0, "later") and rows(t)[4] == want[4]


@pytest.mark.parametrize("updates, problem, by_row", [
    ({"id": 9}, "update of column 'id': a record key column is not set by an update", False),
    ({"day": "c"}, "update of column 'day': a partition column is not set by an update", False),
    ({"Price": 1.0}, "update of column 'Price': the table has no such column (the table spells it 'price')", False),
    ({"nope": 1}, "update of column 'nope': the table has no such column; its columns are", False),
    ({"_nbcc_commit_time": "x"}, "update of column '_nbcc_commit_time': the table has no such column", False),
    ({"price": "cheap"}, "update of column 'price': 'cheap' is not a value of its type double", False),
    ({"price": 10**400}, "update of column 'price': 1000000000", False),
    ({"ts": 7}, "update of column 'ts': it is the ordering field of this event_time table, which decides which "
                "version of a record wins", False),
    ({}, "updates must be a non-empty mapping of column to new value", False),
    ([("status", "x")], "updates must be a non-empty mapping", False),
    ({"status": pc.field("nope")}, "an update's new values could not be computed: No match for FieldRef", False),
    ({"price": pc.field("status")}, "an update's new values could not be computed", True),  # text to a double: by row
])
def test_a_bad_update_is_refused_and_nothing_is_written(tmp_path, updates, problem, by_row):
    t = new_table(str(tmp_path / "t"), "event_time")
    before, timeline = rows(t), t.timeline()
    with pytest.raises(InvalidOptionError, match=problem.replace("(", r"\(").replace(")", r"\)")):
        t.update(updates, [("day", "=", "a")])
    if not by_row:  # found before any row is read: refused all the same
        with pytest.raises(InvalidOptionError, match=problem.replace("(", r"\(").replace(")", r"\)")):
            t.update(updates, [("id", "=", 99)])
    assert rows(t) == before and t.timeline() == timeline


def test_an_empty_filter_list_is_refused_rather_than_taken_for_every_record(tmp_path):
    # As delete refuses one: a list that a bug left empty must not update the whole table.
    t = new_table(str(tmp_path / "t"), "event_time")
    before, timeline = rows(t), t.timeline()
    for empty in ([], ()):
        with pytest.raises(InvalidOptionError, match=r"update got an empty filter list; give filter=None to update "
                                                     "every record"):
            t.update({"status": "cancelled"}, empty)
    assert rows(t) == before and t.timeline() == timeline


@pytest.mark.parametrize("merge_mode", ["event_time", "commit_time"])
def test_a_concurrent_write_that_the_update_did_not_read_is_ordered_as_any_write(tmp_path, merge_mode):
    # The write begins before the update and completes after it. event_time: its greater
    # ordering value wins over the value the update read and kept. commit_time: the update's
    # later instant wins, and the concurrent change of that record is overwritten (README).
    t = new_table(str(tmp_path / "t"), merge_mode)
    late = t.begin_write(SCHEMA)
    writer = t.log_writer(late, make_token(0, 0, 0))
    writer.write(prepare(pa.table({"id": [0], "day": ["a"], "ts": [5], "price": [1.0], "status": ["concurrent"]},
                                  schema=SCHEMA), t.config, late.schema, "upsert"))
    t.update({"status": "updated"}, [("id", "in", [0, 2])])
    late.commit(writer.close())
    got = rows(t)
    assert got[0] == (("a", 5, 1.0, "concurrent") if merge_mode == "event_time" else ("a", 1, 10.0, "updated"))
    assert got[2] == ("a", 1, None, "updated")


def test_in_a_partial_update_table_an_update_leaves_the_columns_it_does_not_set_to_other_writers(tmp_path):
    # A null in a partial_update write means "unchanged": the update writes only what it sets,
    # so a concurrent writer's value of another column survives whichever completes first.
    t = new_table(str(tmp_path / "t"), "partial_update")
    other = t.begin_write(SCHEMA)  # owns price; began before the update, completes after it
    writer = t.log_writer(other, make_token(0, 0, 0))
    writer.write(prepare(pa.table({"id": [0], "day": ["a"], "ts": [1], "price": [99.0], "status": [None]},
                                  schema=SCHEMA), t.config, other.schema, "upsert"))
    t.update({"status": "shipped"}, [("id", "in", [0, 2])])
    other.commit(writer.close())
    got = rows(t)
    assert got[0] == ("a", 1, 99.0, "shipped") and got[2] == ("a", 1, None, "shipped")


def test_literals_are_recorded_as_written_and_a_float_that_a_decimal_would_round_is_refused(tmp_path):
    from decimal import Decimal

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("amount", pa.decimal128(10, 2)),
                        ("flag", pa.bool_()), ("note", pa.string())])
    t = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=1)
    t.write(pa.table({"id": [1], "amount": [Decimal("1.00")], "flag": [True], "note": ["x"]}, schema=schema))
    with pytest.raises(InvalidOptionError, match=r"update of column 'amount': 2.555 is not a value of its type "
                                                 r"decimal128\(10, 2\)"):
        t.update({"amount": 2.555})
    t.update({"amount": 2.5, "flag": 0, "note": 5})
    assert t.read().to_pylist() == [{"id": 1, "amount": Decimal("2.50"), "flag": False, "note": "5"}]
    assert t.history(1)[0].parameters["updates"] == "amount = 2.50, flag = false, note = '5'"
    # In an expression, Arrow takes a Python integer as a decimal of 19 digits: the error says what to give.
    with pytest.raises(InvalidOptionError, match=r"It should be at least 19 \(Arrow takes a Python integer as a decimal "
                                                 r"of 19 digits or more: .* pa.scalar\(Decimal\('2'\)\)\)"):
        t.update({"amount": pc.field("amount") * 2})
    t.update({"amount": pc.field("amount") * pa.scalar(Decimal("2"))})
    assert t.read().column("amount").to_pylist() == [Decimal("5.00")]
    # A result with more digits after the point than the column holds: the error says to round it.
    with pytest.raises(InvalidOptionError, match=r"Rescaling Decimal value would cause data loss \(a result has more "
                                                 r"digits after the point than its column holds: round it to the "
                                                 r"column's scale, amount: pc.round\(\.\.\., 2\)\)"):
        t.update({"amount": pc.field("amount") * pa.scalar(Decimal("1.0031"))})
    t.update({"amount": pc.round(pc.field("amount") * pa.scalar(Decimal("1.0031")), 2)})  # 5.0155
    assert t.read().column("amount").to_pylist() == [Decimal("5.02")]


def test_a_literal_that_its_column_would_cut_is_refused(tmp_path):
    # Arrow casts a datetime to a date by dropping its time of day, without a word.
    import datetime as dt

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("day", pa.date32()), ("n", pa.float64()),
                        ("small", pa.float32())])
    t = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=1)
    t.write(pa.table({"id": [1], "day": [None], "n": [None], "small": [None]}, schema=schema))
    with pytest.raises(InvalidOptionError, match=r"update of column 'day': datetime.datetime\(2026, 3, 4, 23, 59\) "
                                                 r"would be stored as datetime.date\(2026, 3, 4\) in its type "
                                                 r"date32\[day\], losing part of it"):
        t.update({"day": dt.datetime(2026, 3, 4, 23, 59)})
    with pytest.raises(InvalidOptionError, match="update of column 'n': 9007199254740993"):
        t.update({"n": 2**53 + 1})
    assert [i.state for i in t.timeline()] == ["completed"]
    with pytest.raises(InvalidOptionError, match="update of column 'small': 1e.39 would be stored as inf"):
        t.update({"small": 1e39})  # a float32 overflows; a write of it is refused too
    assert [i.state for i in t.timeline()] == ["completed"]
    # What fits is taken: midnight as a date, text as the column's type, a float as float32's nearest.
    t.update({"day": dt.datetime(2026, 3, 4), "n": pa.scalar("1e3", pa.large_string()), "small": 0.1})
    assert t.read().to_pylist() == [{"id": 1, "day": dt.date(2026, 3, 4), "n": 1000.0,
                                     "small": pa.scalar(0.1, pa.float32()).as_py()}]


def test_floats_nested_in_narrower_float_columns_and_integers_in_decimal_columns_are_taken(tmp_path):
    import math
    from decimal import Decimal

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("emb", pa.list_(pa.float32())),
                        ("pt", pa.struct([("x", pa.float32())])), ("amount", pa.decimal128(10, 2))])
    t = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=1)
    t.write(pa.table({"id": [1], "emb": [[1.0]], "pt": [{"x": 1.0}], "amount": [Decimal("1.00")]}, schema=schema))
    t.update({"emb": [0.1, float("nan")], "pt": {"x": 0.1}, "amount": 5})
    row = t.read().to_pylist()[0]
    f32 = pa.scalar(0.1, pa.float32()).as_py()
    assert row["emb"][0] == f32 and math.isnan(row["emb"][1]) and row["pt"] == {"x": f32}
    assert row["amount"] == Decimal("5.00")


def test_times_with_and_without_a_zone_do_not_stand_in_for_each_other(tmp_path):
    # As a write refuses them: a time with a zone is an instant, one without a wall-clock reading.
    import datetime as dt

    from nbcc.conditions import typed_value

    schema = pa.schema([pa.field("id", pa.int64(), nullable=False), ("at", pa.timestamp("us", tz="UTC")),
                        ("local", pa.timestamp("us"))])
    t = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=1)
    t.write(pa.table({"id": [1], "at": [None], "local": [None]}, schema=schema))
    zoned = dt.datetime(2026, 1, 1, 12, tzinfo=dt.timezone(dt.timedelta(hours=2)))
    wall = dt.datetime(2026, 1, 1, 12)
    with pytest.raises(InvalidOptionError, match="is a time without a zone, and the column holds times with one"):
        t.update({"at": wall})
    with pytest.raises(InvalidOptionError, match="is a time with a zone, and the column holds times without one"):
        t.update({"local": zoned})
    t.update({"at": zoned, "local": wall})
    assert t.read().to_pylist() == [{"id": 1, "at": dt.datetime(2026, 1, 1, 10, tzinfo=dt.timezone.utc),
                                     "local": wall}]
    # The command line's --set: a zone given for a column without one is refused, not converted.
    with pytest.raises(InvalidOptionError, match=r"--set local: '2026-01-01T12:00:00\+02:00' is not a value of type timestamp"):
        typed_value("local", "2026-01-01T12:00:00+02:00", t.schema())
    assert typed_value("LOCAL", "2026-01-01T12:00:00", t.schema())[1].as_py() == wall
