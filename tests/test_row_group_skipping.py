"""Reads filtered by record key skip the row groups whose Parquet statistics rule the key out
(format.md 12.9 rule 5). Compaction writes base files in key order in row groups of
`nbcc.compaction.BASE_ROW_GROUP_ROWS` rows; it is set to a few rows here so that small tables
have many row groups.

What a user sees: the same rows as filtering the whole read, and a lookup that decodes one row
group of a large base file, not all of them (shown by damaging the row groups it must not need).
"""

from __future__ import annotations

import datetime as dt
import glob
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nbcc
import nbcc.compaction
import nbcc.reader
from nbcc.errors import DataFileError
from nbcc.expr import Predicate
from test_pushdown import pushdown

ROWS_PER_GROUP = 10
N = 200


def _key_values(kind: str, ks: list[int]) -> pa.Array:
    if kind == "int":
        return pa.array(ks, pa.int64())
    if kind == "string":
        return pa.array([f"user-{k:05d}" for k in ks], pa.string())
    return pa.array([dt.date(2020, 1, 1) + dt.timedelta(days=k) for k in ks], pa.date32())


def _rows(kind: str, ks: list[int], tag: str) -> pa.Table:
    return pa.table({"k": _key_values(kind, ks), "v": pa.array([f"{tag}{k}" for k in ks]),
                     "ts": pa.array([len(tag)] * len(ks), pa.int64())})


def _table(uri: str, kind: str, monkeypatch) -> nbcc.Table:
    """One file group: a base file of N keys in N / ROWS_PER_GROUP row groups, then a log file
    that updates some keys, deletes others and inserts new ones."""
    monkeypatch.setattr(nbcc.compaction, "BASE_ROW_GROUP_ROWS", ROWS_PER_GROUP)
    table = nbcc.Table.create(uri, _rows(kind, [0], "a").schema, "k", ordering_field="ts", buckets=1)
    shuffled = [(k * 37) % N for k in range(N)]  # arrival order is not key order
    table.write(_rows(kind, shuffled, "a"))
    table.compact()
    table.write(_rows(kind, [3, 57, 120, N + 5], "bb"))
    table.write(pa.table({"k": _key_values(kind, [4, 121])}), operation="delete")
    return table


def _base_file(uri: str) -> str:
    (path,) = glob.glob(os.path.join(uri, "*.parquet"))
    return path


def _damage_all_row_groups_but(path: str, keep: int) -> None:
    """Overwrite the page headers of every row group's columns but `keep`'s: reading them fails."""
    md = pq.ParquetFile(path).metadata
    with open(path, "r+b") as f:
        for i in range(md.num_row_groups):
            if i == keep:
                continue
            for j in range(md.num_columns):
                col = md.row_group(i).column(j)
                f.seek(col.dictionary_page_offset if col.has_dictionary_page else col.data_page_offset)
                f.write(b"\xff" * 16)


def _sorted(t: pa.Table) -> list[dict]:
    return sorted(t.to_pylist(), key=lambda r: str(r["k"]))


@pytest.mark.parametrize("kind", ["int", "string", "date"])
def test_key_filters_read_the_same_rows_as_filtering_everything(tmp_path, monkeypatch, kind):
    table = _table(str(tmp_path / "t"), kind, monkeypatch)
    md = pq.ParquetFile(_base_file(table.uri)).metadata
    assert md.num_row_groups == N // ROWS_PER_GROUP and md.num_rows == N
    everything = table.read()
    v = _key_values(kind, [0, 3, 4, 57, 99, 120, 121, 150, N - 1, N + 5, N + 50]).to_pylist()
    cases = [
        [("k", "=", v[1])], [("k", "=", v[2])], [("k", "=", v[9])], [("k", "=", v[10])],
        [("k", "in", [v[0], v[3], v[6], v[10]])], [("k", "<", v[4])], [("k", "<=", v[0])],
        [("k", ">", v[7])], [("k", ">=", v[8])], [("k", ">=", v[4]), ("k", "<", v[5])],
        [("k", "!=", v[1])], [("k", "not_in", [v[1], v[5]])], [("k", "is_not_null")],
        [("k", "=", v[5]), ("v", "=", "bb120")], [("k", "in", [v[3], v[4]]), ("v", "starts_with", "a")],
    ]
    if kind == "string":
        cases += [[("k", "starts_with", "user-0012")], [("k", "ends_with", "7")]]
    for spec in cases:
        expr = None
        for column, op, *value in spec:
            e = Predicate(column, op, tuple(value[0]) if op in ("in", "not_in") else
                          (value[0] if value else None)).to_arrow()
            expr = e if expr is None else expr & e
        assert _sorted(table.read(filter=spec)) == _sorted(everything.filter(expr)), spec


@pytest.mark.parametrize("kind", ["int", "string", "date"])
def test_a_lookup_decodes_only_the_row_groups_that_may_hold_its_key(tmp_path, monkeypatch, kind):
    table = _table(str(tmp_path / "t"), kind, monkeypatch)
    path = _base_file(table.uri)
    key = _key_values(kind, [57]).to_pylist()[0]
    keep = 57 // ROWS_PER_GROUP  # the base file is in key order
    _damage_all_row_groups_but(path, keep)
    assert table.read(filter=[("k", "=", key)]).to_pylist() == [{"k": key, "v": "bb57", "ts": 2}]
    group = _key_values(kind, list(range(50, 60))).to_pylist()  # all in the kept row group
    got = table.read(filter=[("k", ">=", group[0]), ("k", "<=", group[-1])])
    expected = pa.table({"k": group, "v": [f"bb{k}" if k == 57 else f"a{k}" for k in range(50, 60)],
                         "ts": [2 if k == 57 else 1 for k in range(50, 60)]})
    assert _sorted(got) == _sorted(expected)
    with pytest.raises(DataFileError, match="cannot be read"):
        table.read()  # the damage is real: a full read needs those row groups
    with pytest.raises(DataFileError, match="cannot be read"):
        table.read(filter=[("k", "=", _key_values(kind, [120]).to_pylist()[0])])


def test_a_lookup_in_a_slice_too_large_to_merge_in_memory_stays_in_memory(tmp_path, monkeypatch):
    """Only the row groups that may hold the key count towards the merge budget: a lookup in a
    file group larger than the budget neither spills nor reads the whole group."""
    table = _table(str(tmp_path / "t"), "int", monkeypatch)
    monkeypatch.setattr(nbcc.reader, "DEFAULT_MERGE_ROWS", 50)
    spilled = []
    real = nbcc.reader._spilled_pieces
    monkeypatch.setattr(nbcc.reader, "_spilled_pieces", lambda *a, **k: spilled.append(1) or real(*a, **k))
    assert table.read(filter=[("k", "=", 57)]).to_pylist() == [{"k": 57, "v": "bb57", "ts": 2}]
    assert table.read(filter=[("k", "=", 4)]).num_rows == 0  # deleted by the log
    assert spilled == []
    assert table.read().num_rows == N + 1 - 2  # a full read does spill, and gets every live key
    assert spilled


def test_a_spark_lookup_with_pushdown_skips_row_groups_too(tmp_path, monkeypatch, spark):
    table = _table(str(tmp_path / "t"), "int", monkeypatch)
    _damage_all_row_groups_but(_base_file(table.uri), 57 // ROWS_PER_GROUP)
    with pushdown(spark, True):
        rows = spark.read.format("nbcc").load(table.uri).where("k = 57").collect()
    assert [r.asDict() for r in rows] == [{"k": 57, "v": "bb57", "ts": 2}]


def test_a_key_named_like_a_struct_field_is_judged_by_its_own_statistics(tmp_path, monkeypatch):
    """Parquet names the leaf b of a struct a by the path "a.b", the same as a column "a.b"."""
    monkeypatch.setattr(nbcc.compaction, "BASE_ROW_GROUP_ROWS", 2)
    schema = pa.schema([("a.b", pa.int64()), ("a", pa.struct([("b", pa.int64())]))])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "a.b", buckets=1)
    table.write(pa.table({"a.b": pa.array([1, 2, 3, 4], pa.int64()),
                          "a": pa.array([{"b": 100}, {"b": 100}, {"b": 1}, {"b": 1}], schema.field("a").type)}))
    table.compact()
    assert pq.ParquetFile(_base_file(table.uri)).metadata.num_row_groups == 2
    assert table.read(filter=[("a.b", "=", 1)]).to_pylist() == [{"a.b": 1, "a": {"b": 100}}]
    assert table.read(filter=[("a.b", "=", 3)]).to_pylist() == [{"a.b": 3, "a": {"b": 1}}]
