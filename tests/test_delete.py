"""Deleting the records that match a condition (`Table.delete`, SQL's DELETE ... WHERE): one
delete commit of their keys, which time travel and change reads see like any delete."""

from __future__ import annotations

import pyarrow as pa
import pytest

import nbcc

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


def test_a_delete_wins_over_a_greater_ordering_value_written_before_it(local_table):
    table = table_with_rows(local_table)
    table.write(pa.Table.from_pylist([{"id": 1, "region": "eu", "day": "d1", "ts": 10**9, "status": "gone"}],
                                     schema=SCHEMA))
    table.delete([("status", "=", "gone")])
    assert (1, "eu", "d1") not in records(table)


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
