"""Type widening (format.md §4.2): a write given `type_widening=True` whose integer or
floating-point data is wider than a column's type widens the column (int -> bigint, float ->
double); older files read as the wider type, reads as of an earlier time keep the type they had,
and the table's format version becomes 4 so that an nbcc that knows only additive evolution
refuses it. Without the option such data is refused, as before."""

from __future__ import annotations

import json
import re

import pyarrow as pa
import pyarrow.compute as pc
import pytest

import nbcc
from nbcc.errors import SchemaError
from nbcc.writer import prepare

BIG = 3_000_000_000  # past int32
PRECISE = 0.1  # as a double; a float holds 0.10000000149011612

SCHEMA = pa.schema([pa.field("id", pa.int32(), nullable=False), pa.field("ts", pa.int32()),
                    pa.field("v", pa.float32()), pa.field("day", pa.int16())])


def narrow(ids, ts, v, day=1) -> pa.Table:
    n = len(ids)
    return pa.table({"id": pa.array(ids, pa.int32()), "ts": pa.array(ts, pa.int32()),
                     "v": pa.array(v, pa.float32()), "day": pa.array([day] * n, pa.int16())})


def wide(ids, ts, v, days=None) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()), "ts": pa.array(ts, pa.int64()),
                     "v": pa.array(v, pa.float64()), "day": pa.array(days or [1] * len(ids), pa.int32())})


def version(t: nbcc.Table) -> int:
    return json.loads(t.storage.read_bytes(".nbcc/table.json"))["format_version"]


def rows(table: pa.Table) -> list[dict]:
    return table.sort_by("id").to_pylist()


@pytest.mark.parametrize("merge_mode", ["event_time", "commit_time"])
def test_wider_data_widens_the_columns_and_every_file_reads_at_the_wider_type(tmp_path, merge_mode):
    t = nbcc.Table.create(str(tmp_path / "t"), SCHEMA, "id", partition_by="day", buckets=2,
                          ordering_field="ts" if merge_mode == "event_time" else None, merge_mode=merge_mode)
    t.write(narrow([1, 2], [10, 10], [0.5, 1.5]))
    before = t.history()[0].completion
    t.write(narrow([3], [10], [2.5]))
    assert version(t) == 1  # data that fits changes nothing
    # Only when asked: a widening cannot be undone, and older nbcc cannot read the table after it.
    with pytest.raises(SchemaError, match=r"column 'id' has type int64 in the data but int32 in the table; cast it "
                                          r"to int32 before writing, or widen the column to int64 with the write "
                                          r"option type_widening=true"):
        t.write(wide([BIG], [BIG], [PRECISE]))
    assert version(t) == 1 and t.schema() == SCHEMA
    # The key, the ordering field, a double and the partition column all widen in one write.
    t.write(wide([BIG, 2], [BIG, 11], [PRECISE, 7.25], days=[70_000, 1]), type_widening=True)
    assert t.schema() == pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("ts", pa.int64()),
                                    pa.field("v", pa.float64()), pa.field("day", pa.int32())])
    assert version(t) == 4
    assert t.history(1)[0].parameters["widened"] == ["id: int32 -> int64", "ts: int32 -> int64", "v: float -> double",
                                                     "day: int16 -> int32"]
    want = [{"id": 1, "ts": 10, "v": 0.5, "day": 1}, {"id": 2, "ts": 11, "v": 7.25, "day": 1},
            {"id": 3, "ts": 10, "v": 2.5, "day": 1}, {"id": BIG, "ts": BIG, "v": PRECISE, "day": 70_000}]
    assert rows(t.read()) == want
    # A later narrow write merges with the wide rows (by ordering value, or by commit).
    t.write(narrow([1], [12], [4.5]))
    want[0] = {"id": 1, "ts": 12, "v": 4.5, "day": 1}
    assert rows(t.read()) == want
    assert t.schema().field("ts").type == pa.int64()  # a narrower commit after a widening narrows nothing
    t.compact()
    assert rows(t.read()) == want
    # Point lookups of a key past the old type's range: through buckets, key filters, statistics.
    for use in (False, True):
        if use:
            t.build_index()
        assert rows(t.read(filter=[("id", "=", BIG)], use_metadata_table=use)) == [want[3]]
        assert rows(t.read(filter=[("id", "in", [BIG, 3])], use_metadata_table=use)) == [want[2], want[3]]
        assert rows(t.read(filter=pc.field("v") == PRECISE, use_metadata_table=use)) == [want[3]]
        assert rows(t.read(filter=[("day", "=", 70_000)], use_metadata_table=use)) == [want[3]]
        assert rows(t.read(filter=[("ts", ">", 2**31)], use_metadata_table=use)) == [want[3]]
    # As of before the widening, the table had the narrow types and their rows.
    old = t.read(as_of=before)
    assert old.schema.field("id").type == pa.int32() and old.schema.field("v").type == pa.float32()
    assert rows(old) == [{"id": 1, "ts": 10, "v": 0.5, "day": 1}, {"id": 2, "ts": 10, "v": 1.5, "day": 1}]
    # A change feed across the widening gives both sides at the wider type.
    cdc = t.read(query_type="incremental", begin=before, incremental_format="cdc")
    assert cdc.schema.field("after").type.field("v").type == pa.float64()
    changes = {(r["id"], r["_change_type"]) for r in cdc.to_pylist()}
    assert {(2, "update"), (BIG, "insert"), (3, "insert")} <= changes


def test_a_writer_that_began_before_a_widening_still_commits(tmp_path):
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=1)
    slow = nbcc.Table.open(uri)
    data = narrow([1, 2], [5, 5], [1.5, 2.5])
    txn = slow.begin_write(data.schema)  # began at the narrow types
    writer = slow.log_writer(txn, "0-0-0")
    writer.write(prepare(data, slow.config, txn.schema, "upsert"))
    fast = nbcc.Table.open(uri)
    fast.write(wide([2, BIG], [6, 6], [PRECISE, 3.5]), type_widening=True)
    assert fast.schema().field("v").type == pa.float64()  # folded before the slow commit (and cached)
    txn.commit(writer.close())  # completes after the widening, with the narrow schema
    for t in (fast, nbcc.Table.open(uri)):
        assert t.schema().field("v").type == pa.float64() and t.schema().field("id").type == pa.int64()
        assert rows(t.read()) == [{"id": 1, "ts": 5, "v": 1.5, "day": 1}, {"id": 2, "ts": 6, "v": PRECISE, "day": 1},
                                  {"id": BIG, "ts": 6, "v": 3.5, "day": 1}]


def test_refused_changes_write_nothing(tmp_path):
    t = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int32()), ("f", pa.float32()), ("n", pa.int32())]),
                          "id", partition_by="f")
    t.write(pa.table({"id": pa.array([1], pa.int32()), "f": pa.array([1.5], pa.float32()),
                      "n": pa.array([1], pa.int32())}))
    with pytest.raises(SchemaError, match="partition column 'f' has type double in the data but float in the table"):
        t.write(pa.table({"id": [2], "f": [1.5], "n": pa.array([1], pa.int32())}), type_widening=True)
    with pytest.raises(SchemaError, match=re.escape("column 'n' has type double in the data but int32 in the table")):
        t.write(pa.table({"id": pa.array([2], pa.int32()), "f": pa.array([1.5], pa.float32()), "n": [2.0]}),
                type_widening=True)
    with pytest.raises(SchemaError, match="a delete does not widen a column"):
        t.write(pa.table({"id": pa.array([1], pa.int64()), "f": pa.array([1.5], pa.float32())}), operation="delete",
                type_widening=True)
    assert version(t) == 1 and len(t.timeline()) == 1
    assert t.read().to_pylist() == [{"id": 1, "f": 1.5, "n": 1}]


@pytest.mark.parametrize("widening", [False, True])
def test_writers_adding_one_column_at_two_widths_combine_as_narrower_and_wider_data_do(tmp_path, widening):
    # Both begin before either commits, so each adds `c`. The narrower commit after the wider
    # one is read as the wider type; the wider one after the narrower widens the column, if it
    # may (else it is refused at commit, and writes nothing).
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, pa.schema([pa.field("id", pa.int64(), nullable=False)]), "id", buckets=1)

    def begin(key: int, c: pa.Array):
        t = nbcc.Table.open(uri)
        data = pa.table({"id": [key], "c": c})
        txn = t.begin_write(data.schema, type_widening=widening)
        writer = t.log_writer(txn, "0-0-0")
        writer.write(prepare(data, t.config, txn.schema, "upsert"))
        return txn, writer

    narrow_txn, narrow_writer = begin(1, pa.array([1], pa.int32()))
    wide_txn, wide_writer = begin(2, pa.array([BIG], pa.int64()))
    later_txn, later_writer = begin(3, pa.array([3], pa.int16()))
    narrow_txn.commit(narrow_writer.close())
    if not widening:
        with pytest.raises(SchemaError, match=rf"column 'c' was added as int32 by commit {narrow_txn.instant} while "
                                              r"this write added it as int64; cast it to int32 \(or give the write "
                                              r"option type_widening=true\)"):
            wide_txn.commit(wide_writer.close())
        wide_txn.rollback()
        later_txn.commit(later_writer.close())
        t = nbcc.Table.open(uri)
        assert t.schema().field("c").type == pa.int32() and version(t) == 1
        assert rows(t.read()) == [{"id": 1, "c": 1}, {"id": 3, "c": 3}]
        return
    wide_txn.commit(wide_writer.close())
    later_txn.commit(later_writer.close())  # narrower than the folded int64: read as int64
    t = nbcc.Table.open(uri)
    assert t.schema().field("c").type == pa.int64() and version(t) == 4
    assert rows(t.read()) == [{"id": 1, "c": 1}, {"id": 2, "c": BIG}, {"id": 3, "c": 3}]


def test_a_partition_created_at_a_widened_type_while_a_replace_where_runs_is_replaced_too(tmp_path, monkeypatch):
    # The replaceWhere began at int32 and lists int32 partitions; a commit in between widens the
    # column and creates a partition past int32's range, whose folder must still be matched.
    uri = str(tmp_path / "t")
    t = nbcc.Table.create(uri, pa.schema([pa.field("id", pa.int64(), nullable=False), ("p", pa.int32())]), "id",
                          partition_by="p", buckets=1)
    t.write(pa.table({"id": [1], "p": pa.array([1], pa.int32())}))
    listing = nbcc.Table.match_partitions

    def listed_then_widened(self, filter):
        match = listing(self, filter)
        nbcc.Table.open(uri).write(pa.table({"id": [2], "p": pa.array([2**40], pa.int64())}), type_widening=True)
        return match

    monkeypatch.setattr(nbcc.Table, "match_partitions", listed_then_widened)
    t.write(pa.table({"id": [3], "p": pa.array([1], pa.int32())}), mode="overwrite", replace_where="p >= 1")
    monkeypatch.undo()
    assert t.read().to_pylist() == [{"id": 3, "p": 1}]
    assert t.history(1)[0].partitions == ("p=1", f"p={2**40}")
