"""Deleting the records that match a condition (`Table.delete`, SQL's DELETE ... WHERE): one
delete commit of their keys, which time travel and change reads see like any delete."""

from __future__ import annotations

import pyarrow as pa
import pytest

import nbcc
from nbcc.conditions import parse_condition, parse_conditions
from nbcc.filenames import make_token
from nbcc.writer import prepare

SCHEMA = pa.schema([("id", pa.int64()), ("region", pa.string()), ("day", pa.string()), ("ts", pa.int64()),
                    ("status", pa.string())])


def table_with_rows(location: tuple[str, dict]) -> nbcc.Table:
    # A composite key (id, region), partitioned by day: deletes must carry every key and partition column.
    uri, storage_options = location
    table = nbcc.Table.create(uri, SCHEMA, ["id", "region"], ordering_field="ts", partition_by="day", buckets=2,
                              storage_options=storage_options)
    table.write(pa.Table.from_pylist(
        [{"id": i % 6, "region": "eu" if i < 6 else "us", "day": f"d{i % 3}", "ts": 100 - i,
          "status": "test" if i % 4 == 0 else "ok"} for i in range(12)], schema=SCHEMA))
    return table


def records(table: nbcc.Table, **kw) -> set[tuple]:
    return {(r["id"], r["region"], r["day"]) for r in table.read(**kw).to_pylist()}


def test_delete_removes_the_matching_records_with_one_delete_commit(any_table):
    table = table_with_rows(any_table)
    before = records(table)
    written = table.timeline()[-1].completion
    matching = {(r["id"], r["region"], r["day"]) for r in table.read().to_pylist()
                if r["status"] == "test" and r["day"] != "d2"}
    assert len(matching) == 2
    instant = table.delete([("status", "=", "test"), ("day", "!=", "d2")])
    done = table.timeline()[-1]
    assert (done.instant, done.action) == (instant, "deltacommit")
    assert records(table) == before - matching
    assert records(table, as_of=written) == before  # time travel still sees them
    cdc = table.read(query_type="incremental", begin=written, incremental_format="cdc").to_pylist()
    assert {(r["id"], r["before"]["region"], r["before"]["day"], r["_change_type"]) for r in cdc} == \
        {(i, region, day, "delete") for i, region, day in matching}


@pytest.mark.parametrize("merge_mode", ["event_time", "commit_time", "partial_update"])
def test_every_merge_mode_and_the_metadata_table_give_the_same_deletes(tmp_path, merge_mode):
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, SCHEMA, ["id", "region"], ordering_field="ts", partition_by="day", buckets=2,
                              merge_mode=merge_mode)
    table.build_index()
    rows = [{"id": i, "region": "eu", "day": f"d{i % 2}", "ts": 10, "status": "test" if i % 3 == 0 else "ok"}
            for i in range(9)]
    table.write(pa.Table.from_pylist(rows, schema=SCHEMA))
    table.write(pa.Table.from_pylist([{"id": 1, "region": "eu", "day": "d1", "ts": 20, "status": "test"}],
                                     schema=SCHEMA))  # now matches
    table.delete([("status", "=", "test")])
    expected = {(i, "eu", f"d{i % 2}") for i in range(9) if i % 3 != 0 and i != 1}
    for use_mdt in (True, False):
        assert records(table, use_metadata_table=use_mdt) == expected
    table.compact()
    assert records(table) == expected
    # A key written again after the delete is back, with only what that write gave.
    table.write(pa.Table.from_pylist([{"id": 0, "region": "eu", "day": "d0", "ts": 1, "status": None}], schema=SCHEMA))
    assert [(r["id"], r["status"]) for r in table.read(filter=[("id", "=", 0)]).to_pylist()] == [(0, None)]


def test_a_concurrent_write_is_ordered_against_the_delete_by_when_it_began(local_table):
    # Both update a matched record to no longer match, with a greater ordering value; the one that
    # began before the delete loses to it (the delete is the later write), the one after wins.
    table = table_with_rows(local_table)
    early = table.begin_write(SCHEMA)
    writer = table.log_writer(early, make_token(0, 0, 0))
    update = [{"id": 0, "region": "eu", "day": "d0", "ts": 10**6, "status": "ok"}]
    writer.write(prepare(pa.Table.from_pylist(update, schema=SCHEMA), table.config, early.schema, "upsert"))
    matched_late = {(4, "eu", "d1")}  # status test; updated by a write that begins after the delete
    instant = table.delete([("status", "=", "test")])
    late_update = [{"id": 4, "region": "eu", "day": "d1", "ts": 10**6, "status": "ok"}]
    late = table.begin_write(SCHEMA)
    assert late.instant > instant
    late_writer = table.log_writer(late, make_token(0, 0, 0))
    late_writer.write(prepare(pa.Table.from_pylist(late_update, schema=SCHEMA), table.config, late.schema, "upsert"))
    late.commit(late_writer.close())
    early.commit(writer.close())
    left = records(table)
    assert (0, "eu", "d0") not in left and matched_late <= left


def test_nothing_matching_writes_nothing_and_bad_filters_are_refused(local_table):
    table = table_with_rows(local_table)
    before, timeline = records(table), table.timeline()
    assert table.delete([("status", "=", "no such status")]) is None
    for bad, problem in [(None, "delete needs a filter"), ([], "delete needs a filter"),
                         ([("nosuch", "=", 1)], "filter column 'nosuch' is not in the table"),
                         ([("ts", "=", "x")], "are not integers")]:
        with pytest.raises(nbcc.InvalidOptionError, match=problem):
            table.delete(bad)
    assert (records(table), table.timeline()) == (before, timeline)


@pytest.mark.parametrize("text, expected", [
    ("day < 2026-09-01", ("day", "<", "2026-09-01")),
    ("s <> a", ("s", "!=", "a")),
    ("s == a", ("s", "=", "a")),
    ("s = =x", ("s", "=", "=x")),
    ("s = 'salt and pepper'", ("s", "=", "salt and pepper")),
    ("s = 'it''s'", ("s", "=", "it's")),
    ("s = ' p '", ("s", "=", " p ")),
    ("ts >= 2026-01-01 10:00:00", ("ts", ">=", "2026-01-01 10:00:00")),
    ("status NOT IN ('test')", ("status", "not_in", ["test"])),
    ("a in (1, 2)", ("a", "in", ["1", "2"])),
    ("s not in x, 'a,b', \"c \"\"d\"\"\"", ("s", "not_in", ["x", "a,b", 'c "d"'])),
    ("x is NOT null", ("x", "is_not_null")),
    # Column names as Spark SQL quotes them: in backticks, `` inside for one.
    ("`order date` < 2026-09-01", ("order date", "<", "2026-09-01")),
    ("`a=b`=1", ("a=b", "=", "1")),
    ("`it``s` in x, y", ("it`s", "in", ["x", "y"])),
    ("`my col` IS NULL", ("my col", "is_null")),
])
def test_command_line_conditions_are_read_as_sql_reads_them(text, expected):
    assert parse_condition(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("s = a and b = 2", [("s", "=", "a"), ("b", "=", "2")]),
    ("day >= 2026-11-01 AND s = 'salt and pepper' AND x IS NULL",
     [("day", ">=", "2026-11-01"), ("s", "=", "salt and pepper"), ("x", "is_null")]),
    ("a in (1, 2) And `b and c` not in ('x and y', z)", [("a", "in", ["1", "2"]), ("b and c", "not_in", ["x and y", "z"])]),
    ("ts >= '2026-01-01 10:00:00' and ts < 2026-01-02", [("ts", ">=", "2026-01-01 10:00:00"), ("ts", "<", "2026-01-02")]),
    ("s = sandy", [("s", "=", "sandy")]),
])
def test_command_line_where_takes_conditions_joined_by_and(text, expected):
    assert parse_conditions(text) == expected


@pytest.mark.parametrize("text", ["s = a and", "and s = a", "s = a and and b = 1", "s = a and b", "s = a or b = 1",
                                  "s = tom and jerry", "s = 'a' and t = 'b"])
def test_command_line_where_refuses_what_is_not_conditions_joined_by_and(text):
    with pytest.raises(nbcc.InvalidOptionError):
        parse_conditions(text)


@pytest.mark.parametrize("text", ["s >= ", "s<=", "s = ", "s = a and b = 2", "s = 'a", "s = a,b", "s in ()",
                                  "s in 'a' b", "day", "order date = 1", "`order date = 1", "a`b = 1"])
def test_command_line_conditions_that_would_mean_something_else_are_refused(text):
    with pytest.raises(nbcc.InvalidOptionError):
        parse_condition(text)
