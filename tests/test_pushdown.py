"""Filter pushdown: partition pruning, bucket pruning for key lookups, min/max skipping, and the
Python API's `filter=`. Pruning may only ever change how much is read, never which rows come back:
every result here is checked against filtering the unpruned rows independently (Spark over the
rows read with pushdown off, or pyarrow over `table.read()`)."""

from __future__ import annotations

import datetime as dt
from collections import Counter
from contextlib import contextmanager
from decimal import Context, Decimal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest
from pyspark.sql import functions as F

import nbcc
import nbcc.writer
from nbcc.index_view import load_index
from nbcc.timeline import read_commit_metadata
from nbcc.expr import OPERATORS

PUSHDOWN = "spark.sql.python.filterPushdown.enabled"


@contextmanager
def pushdown(spark, enabled: bool):
    """Set the (session-wide) pushdown conf for the block, then put the previous value back."""
    previous = spark.conf.get(PUSHDOWN)
    spark.conf.set(PUSHDOWN, "true" if enabled else "false")
    try:
        yield
    finally:
        spark.conf.set(PUSHDOWN, previous)


def _sorted_rows(rows):
    return sorted((tuple(r) for r in rows), key=repr)


def _read(spark, uri, enabled, f=None, **options):
    """(sorted rows, number of Spark partitions) of a read with pushdown on or off. Small file
    groups are normally packed into few Spark partitions; max_partition_bytes=1 gives each file
    group read its own, so the partition count is the number of file groups read."""
    with pushdown(spark, enabled):
        r = spark.read.format("nbcc").option("max_partition_bytes", "1")
        for k, v in options.items():
            r = r.option(k, v)
        df = r.load(uri)
        if f is not None:
            df = df.where(_spark_filter(f))
        return _sorted_rows(df.collect()), df.rdd.getNumPartitions()


def _arrow_rows(table: pa.Table):
    return sorted((tuple(r.values()) for r in table.to_pylist()), key=repr)


def _fg(key, buckets):
    return nbcc.file_group_id(int(nbcc.bucket_ids([key], buckets)[0]))


def _keys_by_bucket(buckets, per_bucket, start=0):
    out = {b: [] for b in range(buckets)}
    k = start
    while any(len(v) < per_bucket for v in out.values()):
        b = int(nbcc.bucket_ids([k], buckets)[0])
        if len(out[b]) < per_bucket:
            out[b].append(k)
        k += 1
    return out


# -- a partitioned table with history: updates, stale updates, deletes, a compaction -------------

WIDE = pa.schema([
    ("id", pa.int64()), ("p", pa.string()), ("i", pa.int32()), ("s", pa.string()),
    ("d", pa.date32()), ("x", pa.float64()), ("flag", pa.bool_()), ("seq", pa.int64()),
])
PARTS = ["a", "b", None]
D0 = dt.date(2026, 11, 1)


def _gen(k, gen, seq):
    p = PARTS[k % 3]
    if gen == 1:
        return dict(id=k, p=p, i=None if k % 11 == 0 else k % 13,
                    s=None if k % 7 == 0 else ("x" if k % 5 == 0 else "v") + f"{k:03d}",
                    d=D0 + dt.timedelta(days=k % 30), x=k * 0.5, flag=k % 2 == 0, seq=seq)
    if gen == 2:
        return dict(id=k, p=p, i=k % 13 + 100, s=None if k % 9 == 0 else f"u{k:03d}",
                    d=dt.date(2026, 12, 10) + dt.timedelta(days=k % 10), x=-float(k), flag=k % 3 == 0, seq=seq)
    if gen == 3:
        return dict(id=k, p=p, i=None if k % 6 == 0 else k % 17 + 200, s=f"w{k:03d}-z",
                    d=dt.date(2027, 1, 1) + dt.timedelta(days=k % 5), x=k * 2.0, flag=True, seq=seq)
    # a stale update (older ordering value): it must lose everywhere
    return dict(id=k, p=p, i=999, s="stale", d=dt.date(2030, 1, 1), x=999.0, flag=False, seq=seq)


class Model:
    """The expected merged state (event_time: greatest seq wins, a later write wins ties; a delete
    removes the key whatever its seq)."""

    def __init__(self):
        self.rows = {}

    def upsert(self, rows):
        for r in rows:
            cur = self.rows.get(r["id"])
            if cur is None or r["seq"] >= cur["seq"]:
                self.rows[r["id"]] = r

    def delete(self, ids):
        for k in ids:
            self.rows.pop(k, None)

    def sorted_rows(self, names):
        return sorted((tuple(r[n] for n in names) for r in self.rows.values()), key=repr)


def _build_wide(uri):
    table = nbcc.Table.create(uri, WIDE, "id", partition_by="p", buckets=8, ordering_field="seq")
    model = Model()

    def upsert(rows):
        model.upsert(rows)
        table.write(pa.Table.from_pylist(rows, schema=WIDE))

    def delete(ids):
        model.delete(ids)
        table.write(pa.table({"id": pa.array(ids, pa.int64()), "p": pa.array([PARTS[k % 3] for k in ids])}),
                    operation="delete")

    upsert([_gen(k, 1, 1) for k in range(240)])
    upsert([_gen(k, 2, 2) for k in range(40, 120)])
    delete(list(range(10)) + list(range(100, 105)))
    assert table.compact() is not None
    upsert([_gen(k, 3, 3) for k in range(200, 280)] + [_gen(k, 4, 0) for k in range(60, 70)] + [_gen(5, 1, 1)])
    delete(list(range(250, 255)))
    return table, model


@pytest.fixture(scope="module")
def wide(tmp_path_factory, spark):
    """(uri, table, model, rows read by Spark with pushdown off, their Spark schema)."""
    uri = str(tmp_path_factory.mktemp("pushdown") / "wide")
    table, model = _build_wide(uri)
    with pushdown(spark, False):
        df = spark.read.format("nbcc").load(uri)
        rows, schema = _sorted_rows(df.collect()), df.schema
    return uri, table, model, rows, schema


class ColumnFilter:
    """A DataFrame Column filter, built when a session exists."""

    def __init__(self, label, build):
        self.label, self.build = label, build

    def __str__(self):
        return self.label


def _spark_filter(f):
    return f.build() if isinstance(f, ColumnFilter) else f


# (filter, may the result be empty)
WIDE_FILTERS = [
    # record key
    ("id = 42", False), ("id IN (3, 5, 42, 77, 150, 255, 999)", False), ("id > 230", False), ("id = 7", True),
    ("id <=> 42", False),
    # partition column
    ("p = 'a'", False), ("p > 'a'", False), ("p IS NULL", False), ("NOT (p = 'b')", False),
    ("p NOT IN ('a', 'zz')", False), ("p IN ('a', NULL)", False),
    # int
    ("i >= 100", False), ("i IS NULL", False), ("NOT (i = 3)", False), ("i NOT IN (1, 2, 3)", False),
    ("i IN (1, NULL)", False), ("i NOT IN (1, NULL)", True), ("i = 999", True),
    # string
    ("s = 'v012'", False), ("s < 'v'", False), ("s IS NULL", False), ("s NOT IN ('v012', 'u041')", False),
    ("NOT (s <=> 'v012')", False),
    (ColumnFilter("s.startswith('x')", lambda: F.col("s").startswith("x")), False),
    (ColumnFilter("s.endswith('-z')", lambda: F.col("s").endswith("-z")), False),
    (ColumnFilter("s.contains('04')", lambda: F.col("s").contains("04")), False),
    (ColumnFilter("~s.startswith('v')", lambda: ~F.col("s").startswith("v")), False),
    # date, boolean
    ("d >= DATE'2026-12-01'", False), ("d IN (DATE'2027-01-02', DATE'2026-11-10')", False), ("NOT flag", False),
    # double (not pushed)
    ("x < 0", False),
    # combinations; OR across columns cannot be pushed
    ("id < 100 AND p = 'b' AND s IS NOT NULL", False), ("i > 5 AND d < DATE'2026-12-01' AND s LIKE 'v%'", False),
    ("i = 3 OR p = 'b'", False), ("s IS NULL OR x > 100", False),
]


def test_wide_table_reads_the_modelled_state_with_pushdown_off(wide):
    uri, table, model, off_rows, _ = wide
    assert off_rows == model.sorted_rows(WIDE.names)
    assert _arrow_rows(table.read()) == off_rows


def test_pushdown_on_and_off_give_the_same_rows(spark, wide):
    uri, _, _, off_rows, schema = wide
    reference = spark.createDataFrame(off_rows, schema)  # the unpruned rows, filtered by Spark itself
    # Every filter is its own scan (filters are pushed per scan); one union runs them as one job.
    with pushdown(spark, True):
        scans = [spark.read.format("nbcc").load(uri).where(_spark_filter(f)).select(F.lit(n).alias("_q"), "*")
                 for n, (f, _) in enumerate(WIDE_FILTERS)]
        union = scans[0]
        for scan in scans[1:]:
            union = union.unionAll(scan)
        got = {n: [] for n in range(len(WIDE_FILTERS))}
        for row in union.collect():
            got[row[0]].append(tuple(row)[1:])
    mismatches = []
    for n, (f, may_be_empty) in enumerate(WIDE_FILTERS):
        expected = _sorted_rows(reference.where(_spark_filter(f)).collect())
        assert may_be_empty or 0 < len(expected) < len(off_rows), f"filter {f} does not test anything"
        on = _sorted_rows(got[n])
        if on != expected:
            mismatches.append((str(f), len(on), len(expected), sorted(set(on) - set(expected), key=repr)[:2],
                               sorted(set(expected) - set(on), key=repr)[:2]))
    assert not mismatches, "pushdown on differs (filter, rows on, rows expected, extra, missing):\n" + \
        "\n".join(map(repr, mismatches))


def test_pushdown_off_reads_with_filters(spark, wide):
    """With the conf off the read works (the reader must not push), reads every file group and
    Spark applies the filters."""
    uri, table, _, off_rows, schema = wide
    reference = spark.createDataFrame(off_rows, schema)
    for f in ["id = 42 AND s LIKE 'u%'", "i = 3 OR p = 'b'"]:
        rows, parts = _read(spark, uri, False, f)
        assert rows == _sorted_rows(reference.where(f).collect()) and rows, f
        assert parts == len(table.file_slices()), f


def test_pushdown_with_time_travel(spark, wide):
    uri, table, _, _, schema = wide
    commits = [i for i in table.timeline() if i.state == "completed" and i.action == "deltacommit"]
    first, second = commits[0].completion, commits[1].completion
    for as_of, f, present in [(first, "s = 'v051'", True), (second, "s = 'v051'", False),
                              (second, "i >= 100 AND p = 'a'", True), (first, "i >= 100", False),
                              (first, "id IN (3, 42)", True)]:
        state = [tuple(r.values()) for r in table.read(as_of=as_of).to_pylist()]
        expected = _sorted_rows(spark.createDataFrame(state, schema).where(f).collect())
        assert bool(expected) == present, (as_of, f)
        assert _read(spark, uri, True, f, as_of=as_of)[0] == expected, (as_of, f)
        if as_of == first and f == "s = 'v051'":
            assert _read(spark, uri, False, f, as_of=as_of)[0] == expected, (as_of, f)


# -- bucket pruning for key lookups --------------------------------------------------------------

KV = pa.schema([("id", pa.int64()), ("p", pa.string()), ("v", pa.string())])


def _kv_table(uri, partitioned):
    table = nbcc.Table.create(uri, KV, "id", partition_by="p" if partitioned else (), buckets=8)
    ids = list(range(400))
    table.write(pa.table({"id": ids, "p": [["a", "b", "c"][k % 3] for k in ids], "v": [f"one-{k}" for k in ids]},
                         schema=KV))
    upd = list(range(0, 400, 7))
    table.write(pa.table({"id": upd, "p": [["a", "b", "c"][k % 3] for k in upd], "v": [f"two-{k}" for k in upd]},
                         schema=KV))
    return table


def _v(k):
    return f"two-{k}" if k % 7 == 0 else f"one-{k}"


def test_point_lookup_reads_one_bucket_unpartitioned(spark, local_table):
    uri, _ = local_table
    table = _kv_table(uri, partitioned=False)
    n_groups = len(table.file_slices())
    assert n_groups == 8

    rows, parts = _read(spark, uri, True, "id = 42")
    assert rows == [(42, "a", _v(42))]
    assert parts == 1
    rows, parts = _read(spark, uri, False, "id = 42")
    assert rows == [(42, "a", _v(42))]
    assert parts == n_groups

    plan = table.plan(filter=[("id", "=", 42)])
    assert [t.file_group_id for t in plan.tasks] == [_fg(42, 8)]
    assert table.read(filter=[("id", "=", 42)]).to_pylist() == [{"id": 42, "p": "a", "v": _v(42)}]

    # IN on two keys in different buckets: two file groups; two keys in one bucket: one.
    by_bucket = _keys_by_bucket(8, 2)
    k1, k2 = by_bucket[1][0], by_bucket[5][0]
    plan = table.plan(filter=[("id", "in", [k1, k2])])
    assert sorted(t.file_group_id for t in plan.tasks) == sorted([_fg(k1, 8), _fg(k2, 8)])
    assert len(plan.tasks) == 2
    rows, parts = _read(spark, uri, True, f"id IN ({k1}, {k2})")
    assert parts == 2 and sorted(r[0] for r in rows) == sorted([k1, k2])
    same = by_bucket[3]
    assert len(table.plan(filter=[("id", "in", same)]).tasks) == 1
    rows, parts = _read(spark, uri, True, f"id IN ({same[0]}, {same[1]})")
    assert parts == 1 and sorted(r[0] for r in rows) == sorted(same)

    # A key that is not in the table: at most its one bucket is read, nothing comes back.
    assert len(table.plan(filter=[("id", "=", 10_000)]).tasks) <= 1
    assert table.read(filter=[("id", "=", 10_000)]).num_rows == 0
    assert _read(spark, uri, True, "id = 10000")[0] == []
    # Key lookups combined with other filters still filter exactly.
    assert _read(spark, uri, True, "id = 42 AND v LIKE 'two%'")[0] == ([(42, "a", "two-42")] if 42 % 7 == 0 else [])
    assert _read(spark, uri, True, "id = 43 AND v = 'one-43'")[0] == [(43, "b", "one-43")]


def test_point_lookup_partitioned(spark, local_table):
    uri, _ = local_table
    table = _kv_table(uri, partitioned=True)
    n_groups = len(table.file_slices())
    p42 = ["a", "b", "c"][42 % 3]
    rows, parts = _read(spark, uri, True, f"id = 42 AND p = '{p42}'")
    assert rows == [(42, p42, _v(42))] and parts == 1
    plan = table.plan(filter=[("id", "=", 42), ("p", "=", p42)])
    assert [(t.partition, t.file_group_id) for t in plan.tasks] == [(f"p={p42}", _fg(42, 8))]
    # Key alone: its bucket in each partition (the key could be in any of them).
    rows, parts = _read(spark, uri, True, "id = 42")
    assert rows == [(42, p42, _v(42))]
    assert parts == len({t.partition for t in table.plan().tasks})
    rows, parts = _read(spark, uri, False, "id = 42")
    assert rows == [(42, p42, _v(42))] and parts == n_groups


# -- partition pruning ---------------------------------------------------------------------------

def test_partition_pruning(spark, local_table):
    uri, _ = local_table
    table = _kv_table(uri, partitioned=True)
    everything = table.plan().tasks
    per_partition = Counter(t.partition for t in everything)
    assert set(per_partition) == {"p=a", "p=b", "p=c"}
    all_rows = table.read()

    for case, (spark_filter, tuples, parts) in enumerate([
        ("p = 'b'", [("p", "=", "b")], {"p=b"}),
        ("p IN ('a', 'c')", [("p", "in", ["a", "c"])], {"p=a", "p=c"}),
        ("p > 'a'", [("p", ">", "a")], {"p=b", "p=c"}),
        ("p <= 'a'", [("p", "<=", "a")], {"p=a"}),
        ("NOT (p = 'a')", [("p", "!=", "a")], {"p=b", "p=c"}),
        ("p NOT IN ('a', 'b')", [("p", "not_in", ["a", "b"])], {"p=c"}),
        ("p = 'zz'", [("p", "=", "zz")], set()),
    ]):
        plan = table.plan(filter=tuples)
        assert {t.partition for t in plan.tasks} == parts, spark_filter
        assert len(plan.tasks) == sum(per_partition[p] for p in parts), spark_filter
        expected = all_rows.filter(pc.field("p").isin(pa.array(sorted(p[2:] for p in parts), pa.string())))
        assert _arrow_rows(table.read(filter=tuples)) == _arrow_rows(expected), spark_filter
        rows, n = _read(spark, uri, True, spark_filter)
        assert rows == _arrow_rows(expected), spark_filter
        if parts:
            assert n == len(plan.tasks), spark_filter
        if case == 0:
            off_rows, off_n = _read(spark, uri, False, spark_filter)
            assert off_rows == rows and off_n == len(everything), spark_filter


def test_partition_pruning_with_null_and_int_partitions(spark, local_table):
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("year", pa.int32()), ("v", pa.int64())])
    table = nbcc.Table.create(uri, schema, "id", partition_by="year", buckets=2)
    ids = list(range(60))
    years = [None if k % 4 == 0 else 2020 + k % 4 for k in ids]
    table.write(pa.table({"id": ids, "year": years, "v": ids}, schema=schema))
    all_rows = table.read()
    for case, (spark_filter, tuples, ref) in enumerate([
        ("year = 2021", [("year", "=", 2021)], pc.field("year") == 2021),
        ("year >= 2022", [("year", ">=", 2022)], pc.field("year") >= 2022),
        ("year IS NULL", [("year", "is_null")], pc.field("year").is_null()),
        ("year IS NOT NULL", [("year", "is_not_null")], pc.field("year").is_valid()),
        ("NOT (year = 2021)", [("year", "!=", 2021)], pc.field("year") != 2021),
        ("year IN (2021, 2023)", [("year", "in", [2021, 2023])], pc.field("year").isin([2021, 2023])),
    ]):
        expected = _arrow_rows(all_rows.filter(ref))
        assert expected, spark_filter
        assert _arrow_rows(table.read(filter=tuples)) == expected, spark_filter
        assert _read(spark, uri, True, spark_filter)[0] == expected, spark_filter
        if case in (2, 4):
            assert _read(spark, uri, False, spark_filter)[0] == expected, spark_filter
    plan = table.plan(filter=[("year", "is_null")])
    assert {t.partition for t in plan.tasks} == {"year=__HIVE_DEFAULT_PARTITION__"}
    plan = table.plan(filter=[("year", "=", 2021)])
    assert {t.partition for t in plan.tasks} == {"year=2021"}


def test_the_null_partition_also_holds_the_string_that_names_it(local_table, monkeypatch):
    # Writers now refuse a string equal to the null folder's name (format.md §10); a table that
    # an earlier version wrote may hold one in that folder: a filter that the string satisfies
    # must not skip it.
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("p", pa.string())])
    table = nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=1)
    data = pa.table({"id": [1, 2, 3], "p": ["__HIVE_DEFAULT_PARTITION__", None, "x"]}, schema=schema)
    with pytest.raises(nbcc.SchemaError, match="equal to '__HIVE_DEFAULT_PARTITION__'"):
        table.write(data)
    monkeypatch.setattr(nbcc.writer, "check_partition_values", lambda data, partition_by: None)  # an earlier writer
    table.write(data)
    all_rows = table.read()
    for tuples, ref in [
        ([("p", "=", "__HIVE_DEFAULT_PARTITION__")], pc.field("p") == "__HIVE_DEFAULT_PARTITION__"),
        ([("p", "is_not_null")], pc.field("p").is_valid()),
        ([("p", "is_null")], pc.field("p").is_null()),
        ([("p", "starts_with", "__")], pc.starts_with(pc.field("p"), "__")),
        ([("p", "=", "x")], pc.field("p") == "x"),
    ]:
        expected = _arrow_rows(all_rows.filter(ref))
        assert expected, tuples
        assert _arrow_rows(table.read(filter=tuples)) == expected, tuples
    assert {t.partition for t in table.plan(filter=[("p", "=", "x")]).tasks} == {"p=x"}


# -- min/max skipping ----------------------------------------------------------------------------

MM = pa.schema([("id", pa.int64()), ("score", pa.int64()), ("day", pa.date32()), ("seq", pa.int64())])
DAY0 = dt.date(2026, 1, 1)


def _groups(plan):
    return {t.file_group_id for t in plan.tasks}


def test_min_max_skipping_never_skips_a_matching_merged_row(spark, local_table):
    uri, _ = local_table
    table = nbcc.Table.create(uri, MM, "id", buckets=4, ordering_field="seq")
    keys = _keys_by_bucket(4, 10)
    fg = {b: nbcc.file_group_id(b) for b in range(4)}
    # Bucket b holds scores 100*b .. 100*b+9 and days DAY0 + 30*b + j.
    rows = [{"id": k, "score": 100 * b + j, "day": DAY0 + dt.timedelta(days=30 * b + j), "seq": 1}
            for b, ks in keys.items() for j, k in enumerate(ks)]
    table.write(pa.Table.from_pylist(rows, schema=MM))

    def check(tuples, spark_filter, ref):
        got = table.read(filter=tuples)
        expected = table.read().filter(ref)
        assert _arrow_rows(got) == _arrow_rows(expected), tuples
        on, n = _read(spark, uri, True, spark_filter)
        assert on == _arrow_rows(expected), spark_filter
        return _groups(table.plan(filter=tuples)), n, {r["id"] for r in got.to_pylist()}

    groups, n, ids = check([("score", ">", 305)], "score > 305", pc.field("score") > 305)
    assert groups == {fg[3]} and n == 1 and ids == set(keys[3][6:])
    groups, _, _ = check([("score", "<", 5)], "score < 5", pc.field("score") < 5)
    assert groups == {fg[0]}
    groups, _, _ = check([("score", ">=", 100), ("score", "<=", 109)], "score BETWEEN 100 AND 109",
                         (pc.field("score") >= 100) & (pc.field("score") <= 109))
    assert groups == {fg[1]}
    groups, _, _ = check([("score", "in", [5, 305])], "score IN (5, 305)", pc.field("score").isin([5, 305]))
    assert groups == {fg[0], fg[3]}
    day = DAY0 + dt.timedelta(days=62)
    groups, _, ids = check([("day", "=", day)], f"day = DATE'{day}'", pc.field("day") == pa.scalar(day))
    assert groups == {fg[2]} and ids == {keys[2][2]}
    groups, n, ids = check([("score", "=", 1000)], "score = 1000", pc.field("score") == 1000)
    assert groups == set() and ids == set()

    # Commit 2: k0 (bucket 0, score 3) moves up to 400; k3 (bucket 3, score 303) moves down to 2;
    # a stale update (older seq) gives k2 (bucket 2) score 900, which must lose.
    k0, k3, k2 = keys[0][3], keys[3][3], keys[2][4]
    table.write(pa.Table.from_pylist([
        {"id": k0, "score": 400, "day": DAY0, "seq": 2},
        {"id": k3, "score": 2, "day": DAY0 + dt.timedelta(days=200), "seq": 2},
        {"id": k2, "score": 900, "day": DAY0 + dt.timedelta(days=500), "seq": 0},
    ], schema=MM))
    groups, _, ids = check([("score", ">", 305)], "score > 305", pc.field("score") > 305)
    assert ids == set(keys[3][6:]) | {k0}
    assert fg[0] in groups and fg[3] in groups
    _, _, ids = check([("score", "<", 5)], "score < 5", pc.field("score") < 5)
    assert ids == {keys[0][j] for j in (0, 1, 2, 4)} | {k3}
    _, _, ids = check([("score", "=", 3)], "score = 3", pc.field("score") == 3)  # k0's old value
    assert ids == set()
    _, _, ids = check([("score", "=", 303)], "score = 303", pc.field("score") == 303)  # k3's old value
    assert ids == set()
    _, _, ids = check([("score", ">", 800)], "score > 800", pc.field("score") > 800)  # the stale value
    assert ids == set()
    late = DAY0 + dt.timedelta(days=500)
    _, _, ids = check([("day", ">=", late)], f"day >= DATE'{late}'", pc.field("day") >= pa.scalar(late))
    assert ids == set()
    moved = DAY0 + dt.timedelta(days=200)
    _, _, ids = check([("day", "=", moved)], f"day = DATE'{moved}'", pc.field("day") == pa.scalar(moved))
    assert ids == {k3}

    # A delete, a compaction (slices now start with base files), then one more update in a log.
    table.write(pa.table({"id": pa.array([keys[3][9]], pa.int64())}), operation="delete")
    assert table.compact() is not None
    k1 = keys[1][5]
    table.write(pa.Table.from_pylist([{"id": k1, "score": 500, "day": DAY0, "seq": 3}], schema=MM))
    groups, n, ids = check([("score", ">", 450)], "score > 450", pc.field("score") > 450)
    assert ids == {k1} and groups == {fg[1]} and n == 1
    _, _, ids = check([("score", ">", 305)], "score > 305", pc.field("score") > 305)
    assert ids == set(keys[3][6:9]) | {k0, k1}
    _, _, ids = check([("score", "=", 303)], "score = 303", pc.field("score") == 303)
    assert ids == set()
    _, _, ids = check([("score", "<", 5)], "score < 5", pc.field("score") < 5)
    assert ids == {keys[0][j] for j in (0, 1, 2, 4)} | {k3}
    _, _, ids = check([("score", "is_null")], "score IS NULL", pc.field("score").is_null())
    assert ids == set()


def test_skipping_in_a_partitioned_table_uses_each_partitions_statistics(spark, local_table):
    """One commit writes the same file group (bucket) in two partitions, with disjoint values."""
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("p", pa.string()), ("score", pa.int64())])
    table = nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=1)
    ids = list(range(20))
    table.write(pa.table({"id": ids, "p": ["lo" if k < 10 else "hi" for k in ids],
                          "score": [k if k < 10 else 1000 + k for k in ids]}, schema=schema))
    first = table.timeline()[-1].completion
    table.write(pa.table({"id": [3, 13], "p": ["lo", "hi"], "score": [7, 1017]}, schema=schema))
    cases = [([("score", "=", 5)], "score = 5", pc.field("score") == 5, [5]),
             ([("score", "=", 1015)], "score = 1015", pc.field("score") == 1015, [15]),
             ([("score", ">", 1012)], "score > 1012", pc.field("score") > 1012, [13, 14, 15, 16, 17, 18, 19]),
             ([("score", "<", 3)], "score < 3", pc.field("score") < 3, [0, 1, 2]),
             ([("score", "in", [7, 1017])], "score IN (7, 1017)", pc.field("score").isin([7, 1017]), [3, 7, 13, 17])]
    for when in ("logs", "compacted"):
        for tuples, spark_filter, ref, expected_ids in cases:
            got = table.read(filter=tuples)
            assert _arrow_rows(got) == _arrow_rows(table.read().filter(ref)), (when, tuples)
            assert sorted(got.column("id").to_pylist()) == expected_ids, (when, tuples)
            assert _read(spark, uri, True, spark_filter)[0] == _arrow_rows(got), (when, spark_filter)
        if when == "logs":
            # An incremental read after the first commit, filtered.
            inc = table.read(query_type="incremental", begin=first)
            for tuples, _, ref, _ in cases:
                got = table.read(query_type="incremental", begin=first, filter=tuples)
                assert _arrow_rows(got) == _arrow_rows(inc.filter(ref)), ("incremental", tuples)
            assert table.compact() is not None


def test_skipping_with_partial_update_joins_columns_from_different_files(spark, local_table):
    """A merged row can take one column from one file and another column from another: each
    predicate may hold in a different file."""
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("a", pa.int64()), ("b", pa.string())])
    table = nbcc.Table.create(uri, schema, "id", buckets=2, merge_mode="partial_update")
    table.write(pa.table({"id": [1, 2, 3], "a": [5, 6, 7], "b": pa.array([None, None, None], pa.string())},
                         schema=schema))
    table.write(pa.table({"id": [1, 2, 3], "a": pa.array([None, None, None], pa.int64()), "b": ["x", "y", "z"]},
                         schema=schema))
    cases = [
        ([("a", "=", 5), ("b", "=", "x")], "a = 5 AND b = 'x'", (pc.field("a") == 5) & (pc.field("b") == "x")),
        ([("a", ">=", 6), ("b", "in", ["y", "z"])], "a >= 6 AND b IN ('y', 'z')",
         (pc.field("a") >= 6) & pc.field("b").isin(["y", "z"])),
        ([("a", "is_not_null"), ("b", "is_not_null")], "a IS NOT NULL AND b IS NOT NULL",
         pc.field("a").is_valid() & pc.field("b").is_valid()),
        ([("a", "is_null")], "a IS NULL", pc.field("a").is_null()),
        ([("b", "starts_with", "y")], "b LIKE 'y%'", pc.starts_with(pc.field("b"), "y")),
    ]
    for tuples, spark_filter, ref in cases:
        expected = _arrow_rows(table.read().filter(ref))
        assert _arrow_rows(table.read(filter=tuples)) == expected, tuples
        assert _read(spark, uri, True, spark_filter)[0] == expected, spark_filter
    assert _arrow_rows(table.read(filter=cases[0][0])) == [(1, 5, "x")]


def test_starts_with_skipping_keeps_strings_sorting_after_the_prefix(local_table):
    """'a' + U+10FFFF + 'z' starts with 'a' but sorts after 'a' + U+10FFFF."""
    uri, _ = local_table
    schema = pa.schema([("id", pa.int64()), ("s", pa.string())])
    table = nbcc.Table.create(uri, schema, "id", buckets=1)
    table.write(pa.table({"id": [1], "s": ["a\U0010ffffz"]}, schema=schema))
    table.write(pa.table({"id": [2], "s": ["b"]}, schema=schema))
    assert table.read(filter=[("s", "starts_with", "a")]).to_pylist() == [{"id": 1, "s": "a\U0010ffffz"}]


# -- skipping after schema evolution -------------------------------------------------------------

def test_skipping_after_a_column_is_added(spark, local_table):
    uri, _ = local_table
    old = pa.schema([("id", pa.int64()), ("v", pa.int64())])
    new = pa.schema([("id", pa.int64()), ("v", pa.int64()), ("n", pa.string()), ("m", pa.int64())])
    table = nbcc.Table.create(uri, old, "id", buckets=4)
    table.write(pa.table({"id": list(range(40)), "v": list(range(40))}, schema=old))
    assert table.compact() is not None  # old base files, written before n and m existed
    table.write(pa.table({"id": list(range(40, 50)), "v": list(range(40, 50))}, schema=old))  # old log files
    # New rows (keys 100..109) and updates of keys 0..4 carry the new columns.
    ids = list(range(100, 110)) + list(range(5))
    table.write(pa.table({"id": ids, "v": ids, "n": [f"n{k % 3}" for k in ids], "m": [k % 3 for k in ids]},
                         schema=new))
    read = table.read()
    assert read.schema.names == ["id", "v", "n", "m"]

    def ids_of(t):
        return sorted(r["id"] for r in t.to_pylist())

    old_ids = sorted(set(range(50)) - set(range(5)))
    assert ids_of(table.read(filter=[("n", "is_null")])) == old_ids
    assert ids_of(table.read(filter=[("m", "is_null")])) == old_ids
    assert ids_of(table.read(filter=[("n", "=", "n1")])) == sorted(k for k in ids if k % 3 == 1)
    assert ids_of(table.read(filter=[("m", "=", 0)])) == sorted(k for k in ids if k % 3 == 0)
    assert ids_of(table.read(filter=[("m", "<", 5)])) == sorted(ids)
    assert ids_of(table.read(filter=[("n", "is_not_null")])) == sorted(ids)
    assert ids_of(table.read(filter=[("n", "!=", "n0")])) == sorted(k for k in ids if k % 3 != 0)
    assert ids_of(table.read(filter=[("m", "not_in", [1])])) == sorted(k for k in ids if k % 3 != 1)

    for spark_filter, ref in [("n IS NULL", pc.field("n").is_null()), ("m IS NULL", pc.field("m").is_null()),
                              ("n = 'n1'", pc.field("n") == "n1"), ("m >= 1", pc.field("m") >= 1),
                              ("n IS NOT NULL AND v < 5", pc.field("n").is_valid() & (pc.field("v") < 5)),
                              ("NOT (m = 2)", pc.field("m") != 2)]:
        expected = _arrow_rows(read.filter(ref))
        assert expected, spark_filter
        assert _read(spark, uri, True, spark_filter)[0] == expected, spark_filter
        if spark_filter in ("n IS NULL", "n = 'n1'"):
            assert _read(spark, uri, False, spark_filter)[0] == expected, spark_filter

    # After a compaction every base file has the new columns (all null for old rows).
    assert table.compact() is not None
    assert ids_of(table.read(filter=[("n", "is_null")])) == old_ids
    assert ids_of(table.read(filter=[("m", "=", 0)])) == sorted(k for k in ids if k % 3 == 0)


# -- the Python API's filter forms ---------------------------------------------------------------

PY = pa.schema([("id", pa.int64()), ("i", pa.int32()), ("s", pa.string()), ("d", pa.date32()),
                ("b", pa.bool_()), ("x", pa.float64())])


@pytest.fixture(scope="module")
def py_table(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("pushdown") / "py")
    table = nbcc.Table.create(uri, PY, "id", buckets=4)
    ids = list(range(60))

    def rows(ks, tag):
        return pa.table({
            "id": ks, "i": [None if k % 8 == 0 else k % 10 for k in ks],
            "s": [None if k % 9 == 0 else f"{tag}{k:02d}{'-end' if k % 4 == 0 else ''}" for k in ks],
            "d": [dt.date(2026, 11, 1) + dt.timedelta(days=k % 15) for k in ks],
            "b": [None if k % 10 == 0 else k % 3 == 0 for k in ks], "x": [k * 1.5 for k in ks]}, schema=PY)

    table.write(rows(ids, "a"))
    table.compact()
    table.write(rows(list(range(20, 40)), "b"))
    table.write(pa.table({"id": pa.array([21, 22], pa.int64())}), operation="delete")
    return table


def _py_cases():
    day = dt.date(2026, 11, 5)
    f = pc.field
    return [
        (("i", "=", 3), f("i") == 3), (("i", "==", 3), f("i") == 3), (("i", "!=", 3), f("i") != 3),
        (("i", "<", 3), f("i") < 3), (("i", "<=", 3), f("i") <= 3), (("i", ">", 7), f("i") > 7),
        (("i", ">=", 7), f("i") >= 7), (("i", "in", [1, 4, 9]), f("i").isin([1, 4, 9])),
        (("i", "not_in", [1, 4, 9]), ~f("i").isin([1, 4, 9]) & f("i").is_valid()),
        (("i", "not in", [1, 4]), ~f("i").isin([1, 4]) & f("i").is_valid()),
        (("i", "is_null"), f("i").is_null()), (("i", "is null"), f("i").is_null()),
        (("i", "is_not_null"), f("i").is_valid()), (("i", "is not null"), f("i").is_valid()),
        (("x", "is_null"), f("x").is_null()), (("x", "is_not_null"), f("x").is_valid()),
        (("s", "starts_with", "b2"), pc.starts_with(f("s"), "b2")),
        (("s", "ends_with", "-end"), pc.ends_with(f("s"), "-end")),
        (("s", "contains", "3"), pc.match_substring(f("s"), "3")),
        (("s", "=", "a05"), f("s") == "a05"), (("s", ">", "b"), f("s") > "b"),
        (("s", "in", ["a05", "b25", "zz"]), f("s").isin(["a05", "b25", "zz"])),
        (("d", "=", day), f("d") == pa.scalar(day)), (("d", "<", day), f("d") < pa.scalar(day)),
        (("d", ">=", day), f("d") >= pa.scalar(day)),
        (("d", "in", [day, dt.date(2026, 11, 9)]), f("d").isin(pa.array([day, dt.date(2026, 11, 9)]))),
        (("b", "=", True), f("b") == True),  # noqa: E712
        (("b", "!=", True), f("b") != True),  # noqa: E712
        (("id", "=", 21), f("id") == 21), (("id", "in", [1, 2, 3, 50]), f("id").isin([1, 2, 3, 50])),
        (("id", ">", 55), f("id") > 55),
    ]


def test_python_tuple_filters_match_filtering_the_read(py_table):
    cases = _py_cases()
    assert {t[1] for t, _ in cases} >= set(OPERATORS)
    everything = py_table.read()
    for spec, ref in cases:
        expected = _arrow_rows(everything.filter(ref))
        assert _arrow_rows(py_table.read(filter=[spec])) == expected, spec
        assert _arrow_rows(py_table.read(filter=spec)) == expected, spec  # one tuple alone
    # Several tuples: all must hold.
    spec = [("i", ">", 2), ("s", "starts_with", "a"), ("d", "<", dt.date(2026, 11, 10)), ("id", "not_in", [13])]
    ref = (pc.field("i") > 2) & pc.starts_with(pc.field("s"), "a") & \
        (pc.field("d") < pa.scalar(dt.date(2026, 11, 10))) & (pc.field("id") != 13)
    expected = _arrow_rows(everything.filter(ref))
    assert expected and _arrow_rows(py_table.read(filter=spec)) == expected


def test_python_filter_dates_as_iso_text(py_table):
    """The documented form (README, nbcc.expr): dates may be given as ISO text."""
    everything = py_table.read()
    days = [dt.date(2026, 11, 5), dt.date(2026, 11, 9)]
    expected = _arrow_rows(everything.filter(pc.field("d").isin(pa.array(days))))
    assert expected
    assert _arrow_rows(py_table.read(filter=[("d", "in", [d.isoformat() for d in days])])) == expected
    expected = _arrow_rows(everything.filter(pc.field("d") >= pa.scalar(days[0])))
    assert _arrow_rows(py_table.read(filter=[("d", ">=", "2026-11-05")])) == expected


@pytest.mark.parametrize("key_type", [pa.uint8(), pa.uint32(), pa.uint64()])
def test_spark_lookups_on_an_unsigned_key_with_values_it_cannot_hold(spark, tmp_path, key_type):
    # Spark sees uint32 as bigint (uint64 as decimal(20,0)): -1 and 2**64 are values of its type
    # that the key cannot hold. Pushed down, they made planning fail instead of matching no row.
    top = int(np.iinfo(key_type.to_pandas_dtype()).max)
    schema = pa.schema([pa.field("k", key_type, nullable=False), pa.field("v", pa.string())])
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, schema, "k", buckets=4).write(
        pa.table({"k": pa.array([0, 1, 2, top], key_type), "v": ["a", "b", "c", "d"]}, schema=schema))
    cases = {"k = -1": [], "k IN (-1, 1)": [1], f"k = {top + 1}": [], "k <=> -1": [], f"k IN ({top}, {top + 1})": [top],
             f"k = {top}": [top], "k = 1.5": []}
    for enabled in (False, True):
        with pushdown(spark, enabled):
            for where, expected in cases.items():
                got = sorted(int(r.k) for r in spark.read.format("nbcc").load(uri).where(where).collect())
                assert got == expected, (enabled, where)


def test_spark_filters_on_uint64_columns_are_applied_by_nbcc(spark, tmp_path):
    # Spark sees a uint64 column as DECIMAL(20, 0) and pushes Decimal values; nbcc takes the whole
    # ones as integers, so a key lookup opens only its file group and a range skips by statistics.
    schema = pa.schema([pa.field("k", pa.uint64(), nullable=False), pa.field("u", pa.uint64())])
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, schema, "k", buckets=8)
    big = 2**63
    keys = [1, 2, 3, big, big + 1, 2**64 - 1] + list(range(10, 40))
    table.write(pa.table({"k": pa.array(keys, pa.uint64()), "u": pa.array(keys, pa.uint64())}, schema=schema))
    groups = len(table.file_slices())
    assert groups == 8
    for where, expected, most_groups in [(f"k = {big + 1}", [big + 1], 1), (f"k IN ({big}, 2)", [2, big], 2),
                                         (f"u >= {big}", [big, big + 1, 2**64 - 1], 3),
                                         ("u = 0", [], 0), (f"k > {2**64 - 1}", [], 0)]:
        counts = {}
        for enabled in (False, True):
            with pushdown(spark, enabled):
                df = spark.read.format("nbcc").option("max_partition_bytes", "1").load(uri).where(where)
                assert sorted(int(r.k) for r in df.collect()) == expected, (enabled, where)
                counts[enabled] = df.rdd.getNumPartitions()
        assert counts[False] == groups and counts[True] <= max(most_groups, 1), (where, counts)


def test_spark_date_filters_in_the_days_the_julian_calendar_skipped(spark, tmp_path):
    # Spark hands pushed date values over through the hybrid Julian/Gregorian calendar, where
    # 1582-10-05..14 do not exist: each arrived as 1582-10-15, and matched that date's rows.
    days = [dt.date(1582, 10, d) for d in (4, 5, 10, 14, 15, 16)] + [dt.date(1, 1, 1), dt.date(2026, 11, 26)]
    schema = pa.schema([("id", pa.int64()), ("d", pa.date32()), ("p", pa.date32())])
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=2).write(
        pa.table({"id": range(len(days)), "d": days, "p": days}, schema=schema))
    for column in ("d", "p"):
        cases = {**{f"{column} = DATE'{d}'": [d] for d in days},
                 f"{column} < DATE'1582-10-10'": [d for d in days if d < dt.date(1582, 10, 10)],
                 f"{column} >= DATE'1582-10-14'": [d for d in days if d >= dt.date(1582, 10, 14)],
                 f"{column} IN (DATE'1582-10-05', DATE'2026-11-26')": [days[1], days[-1]],
                 f"{column} NOT IN (DATE'1582-10-05', DATE'1582-10-15')": [d for d in days if d not in (days[1], days[4])],
                 f"{column} != DATE'1582-10-14'": [d for d in days if d != days[3]]}
        for where, expected in cases.items():
            for enabled in (False, True):
                with pushdown(spark, enabled):
                    got = sorted(r[column] for r in spark.read.format("nbcc").load(uri).where(where).collect())
                assert got == sorted(expected), (enabled, where)


def test_python_filters_on_uint64_past_the_int64_range(tmp_path):
    """Values >= 2**63 fit a uint64 column but not int64, which is what Arrow infers for a Python
    int: every operator on a uint64 key and a uint64 data column, before and after compaction."""
    big = 2**63
    schema = pa.schema([pa.field("id", pa.uint64(), nullable=False), ("u", pa.uint64()), ("v", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "u64"), schema, "id", buckets=4)
    ids = [1, 7, big - 1, big, big + 5, 2**64 - 1]
    table.write(pa.table({"id": pa.array(ids, pa.uint64()), "u": pa.array([big + i for i in range(6)], pa.uint64()),
                          "v": list(range(6))}, schema=schema))
    table.write(pa.table({"id": pa.array([big + 5, 3], pa.uint64()), "u": pa.array([5, None], pa.uint64()),
                          "v": [50, 30]}, schema=schema))
    u64 = pa.uint64()
    cases = [(("id", op, value), ref) for op, value, ref in [
        ("=", big + 5, lambda f: f == pa.scalar(big + 5, u64)), ("!=", 1, lambda f: f != pa.scalar(1, u64)),
        ("<", big, lambda f: f < pa.scalar(big, u64)), (">=", big, lambda f: f >= pa.scalar(big, u64)),
        ("in", [2**64 - 1, 7], lambda f: f.isin(pa.array([2**64 - 1, 7], u64))),
        ("not_in", [big, 1], lambda f: ~f.isin(pa.array([big, 1], u64)) & f.is_valid())]]
    cases += [(("u", ">", big + 2), pc.field("u") > pa.scalar(big + 2, u64)),
              (("u", "in", [5, big]), pc.field("u").isin(pa.array([5, big], u64)))]
    cases = [(spec, ref if isinstance(ref, pc.Expression) else ref(pc.field("id"))) for spec, ref in cases]
    for when in ("log files only", "after compaction"):
        everything = table.read()
        assert everything.num_rows == 7, when
        for spec, ref in cases:
            expected = _arrow_rows(everything.filter(ref))
            assert expected, (when, spec)
            assert _arrow_rows(table.read(filter=[spec])) == expected, (when, spec)
        table.compact()


def test_python_filters_with_integers_outside_the_column_type_compare_as_sql_does(py_table):
    # `i` is int32: 2**40 fits no value of it, yet `i < 2**40` holds for every non-null one.
    everything = py_table.read()
    wide = pc.field("i").cast(pa.int64())
    big = 2**40
    for spec, ref in [(("i", "<", big), wide < big), (("i", "<=", -big), wide <= -big), (("i", ">", -big), wide > -big),
                      (("i", ">=", big), wide >= big), (("i", "=", big), wide == big), (("i", "!=", big), wide != big),
                      (("i", "in", [big, 3]), wide.isin([big, 3])),
                      (("i", "not_in", [big, 3]), ~wide.isin([big, 3]) & wide.is_valid()),
                      (("id", "=", 2**70), pc.field("id") == -1), (("id", "in", [2**70]), pc.field("id") == -1)]:
        assert _arrow_rows(py_table.read(filter=[spec])) == _arrow_rows(everything.filter(ref)), spec
    assert py_table.read(filter=[("i", "<", big)]).num_rows == everything.filter(pc.field("i").is_valid()).num_rows


def test_python_arrow_expression_filters(py_table):
    everything = py_table.read()
    for expr in [pc.field("x") > 30, (pc.field("i") > 3) & pc.field("s").is_valid(),
                 pc.field("x") == 1.5, pc.field("s").is_null() | (pc.field("id") < 3)]:
        expected = _arrow_rows(everything.filter(expr))
        assert expected
        assert _arrow_rows(py_table.read(filter=expr)) == expected
    assert py_table.read(filter=pc.field("x") > 1e9).num_rows == 0


def test_python_filter_on_a_column_added_after_the_time_read_is_a_clear_error(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.int64())]), "id")
    table.write(pa.table({"id": [1, 2], "v": [1, 2]}))
    first = table.timeline()[-1].completion
    table.write(pa.table({"id": [3], "v": [3], "e": [7]}))
    assert _arrow_rows(table.read(filter=[("e", "is_null")])) == _arrow_rows(table.read(filter=pc.field("e").is_null()))
    for spec in ([("e", "is_null")], [("e", "=", 7)]):
        with pytest.raises(nbcc.InvalidOptionError, match=r"filter column 'e' is not in the table \(as of the time "
                                                          r"read\); its columns are \['id', 'v'\]"):
            table.read(as_of=first, filter=spec)
    with pytest.raises(nbcc.InvalidOptionError, match="the filter cannot be applied to the rows read"):
        table.read(as_of=first, filter=pc.field("e").is_null())


def test_python_filter_with_decimal_arithmetic_pyarrow_cannot_do_says_how_to_write_it(tmp_path):
    from decimal import Decimal

    schema = pa.schema([("id", pa.int64()), ("price", pa.decimal128(10, 2)), ("qty", pa.int32())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id")
    table.write(pa.table({"id": [1, 2], "price": [Decimal("10.50"), Decimal("99.99")], "qty": [5, 20]}, schema=schema))
    with pytest.raises(nbcc.InvalidOptionError, match=r"Precision is not great enough.*cast the decimal column first "
                                                      r"\(pc.field\(...\).cast\(pa.float64\(\)\)\)"):
        table.read(filter=pc.field("price") * pc.field("qty") > 100)
    # What the message suggests reads the row whose total is over 100.
    assert table.read(filter=pc.field("price").cast(pa.float64()) * pc.field("qty") > 100)["id"].to_pylist() == [2]


@pytest.mark.parametrize("spec, words", [
    ([("nope", "=", 1)], ["nope", "not in the table"]),
    ([("i", "~", 1)], ["'~'", "unknown"]),
    ([("i", "=", "abc")], ["'i'", "abc"]),
    ([("d", "<", 5.5)], ["'d'"]),
    ([("d", "=", 5)], ["'d'"]),
    ([("i", "in", 5)], ["'i'", "list"]),
    ([("s", "in", "abc")], ["'s'", "list"]),
    ([("i", "starts_with", "1")], ["'i'", "string"]),
    ([("i", "=", None)], ["is_null"]),
    ([("i", "=")], ["('i', '=')", "= takes a value: give (column, op, value)"]),
    ([("i", "is_null", 3)], ["('i', 'is_null', 3)", "is_null takes no value: give (column, op)"]),
    ([("i", "is not null", None)], ["is_not_null takes no value"]),
    ([("x", ">", "3")], ["'x'", "not numbers"]),
    ([("x", "starts_with", "3")], ["'x'", "string column"]),
    ("id = 5", ["list of (column, op, value) tuples"]),
    ([["i", "=", 3]], ["tuples"]),
])
def test_python_bad_filters_are_clear_errors(py_table, spec, words):
    with pytest.raises(nbcc.InvalidOptionError) as err:
        py_table.read(filter=spec)
    for w in words:
        assert w in str(err.value), (spec, str(err.value))
    with pytest.raises(nbcc.InvalidOptionError):
        py_table.plan(filter=spec)


# -- meta columns through Spark ------------------------------------------------------------------

def test_filters_with_meta_columns(spark, wide):
    uri, table, *_ = wide
    meta = table.read(include_meta_columns=True)
    writes = [i for i in table.timeline() if i.state == "completed" and i.action == "deltacommit"]
    fourth = writes[3].instant  # the upsert after the compaction
    counts = Counter(r["_nbcc_commit_time"] for r in meta.to_pylist())
    assert counts[fourth] > 0 and counts[fourth] < meta.num_rows
    names = meta.schema.names
    for spark_filter, ref in [
        (f"_nbcc_commit_time = '{fourth}'", pc.field("_nbcc_commit_time") == fourth),
        (f"_nbcc_commit_time < '{fourth}' AND p = 'a'",
         (pc.field("_nbcc_commit_time") < fourth) & (pc.field("p") == "a")),
        ("_nbcc_record_key = '42' AND id = 42", (pc.field("_nbcc_record_key") == "42") & (pc.field("id") == 42)),
        ("_nbcc_file_group LIKE '00000003%' AND i >= 100", pc.starts_with(pc.field("_nbcc_file_group"), "00000003")
         & (pc.field("i") >= 100)),
    ]:
        expected = _arrow_rows(meta.filter(ref).select(names))
        assert expected, spark_filter
        assert _read(spark, uri, True, spark_filter, include_meta_columns="true")[0] == expected, spark_filter
    off, _ = _read(spark, uri, False, f"_nbcc_commit_time = '{fourth}'", include_meta_columns="true")
    assert off == _arrow_rows(meta.filter(pc.field("_nbcc_commit_time") == fourth).select(names))


def test_the_shipped_spark_properties_read_right_when_a_dataframe_is_queried_again(spark, local_table):
    # Spark 4.1-4.3 apply the filters pushed by one query on a DataFrame to a later query on it
    # that pushes none; spark_conf/nbcc-defaults.conf leaves pushdown off for that reason.
    from pathlib import Path
    uri, _ = local_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id").write(pa.table({"id": list(range(100))}))
    conf = Path(__file__).resolve().parents[1] / "spark_conf" / "nbcc-defaults.conf"
    shipped = dict(line.split(None, 1) for line in conf.read_text().splitlines()
                   if line.strip() and not line.startswith("#"))
    with pushdown(spark, shipped[PUSHDOWN].strip() == "true"):
        df = spark.read.format("nbcc").load(uri)
        assert [df.count(), df.where("id < 10").count(), df.count()] == [100, 10, 100]
        assert df.where("id < 10 OR id IS NULL").count() == 10 and df.where("id >= 90").count() == 10
        assert df.where("id >= 95 OR id < 5").count() == 10


def test_a_filter_is_described_as_given_in_sqls_spelling_for_the_history():
    from nbcc.expr import describe
    spec = [("name", "=", "O'Brien"), ("d", ">=", dt.date(2026, 11, 1)), ("ok", "==", True),
            ("n", "not in", [1, None]), ("name", "is not null"), ("name", "starts_with", "x"),
            ("tiny", "<", 300),  # nbcc applies it as `tiny IS NOT NULL` on an int8 column: recorded as given
            pc.field("n") > 3]
    assert describe(spec) == (
        "name = 'O''Brien' AND d >= '2026-11-01' AND ok = true AND n NOT IN (1, NULL) AND name IS NOT NULL "
        "AND starts_with(name, 'x') AND tiny < 300 AND (n > 3)")
    assert describe(("n", "=", 1)) == "n = 1" and describe([]) == ""
    # A commit records it: a long IN list is abbreviated, and any text is cut at 1000 characters.
    assert describe([("id", "in", list(range(0, 100_000, 2)))]) == \
        "id IN (0, 2, 4, 6, 8, 10, 12, 14, 16, 18, ... 50000 values)"
    assert "\n" not in describe([pc.field("id").isin(list(range(100_000)))])  # pyarrow prints it on lines
    long = describe([pc.field("s") == "y" * 3000])
    assert len(long) == 1000 and long.endswith("...")
    assert describe("day = '" + "x" * 2000 + "'") == "day = '" + "x" * 990 + "..."


# -- timestamps and decimals: compared exactly, as SQL compares them, and pruned by statistics ----

UTC = dt.timezone.utc
T0 = dt.datetime(2026, 11, 20, tzinfo=UTC)
TD = pa.schema([("id", pa.int64()), ("seq", pa.int64()), ("at", pa.timestamp("ms", tz="UTC")),
                ("wall", pa.timestamp("ns")), ("amount", pa.decimal128(10, 2)), ("big", pa.decimal128(38, 4))])


def _td_rows(keys):
    """Bucket b's rows: `at` on day b, `amount` in [100 b, 100 b + 1), `wall` on day b at a
    nanosecond off the microsecond, `big` past what a float or Python's default context holds."""
    rows = []
    for b, ks in keys.items():
        for j, k in enumerate(ks):
            rows.append({"id": k, "seq": 1, "at": T0 + dt.timedelta(days=b, milliseconds=j),
                         "wall": pa.scalar(int((T0 + dt.timedelta(days=b)).timestamp()) * 10**9 + 1000 * j + 7,
                                           pa.timestamp("ns")),
                         "amount": Decimal(100 * b) + Decimal(j) / 100,
                         "big": Decimal(10**30 * b + j) + Decimal("0.0001")})
    return rows


def _td_arrow_rows(table):
    """`_arrow_rows` with `wall` as integers: its nanoseconds have no Python datetime."""
    at = table.schema.get_field_index("wall")
    return _arrow_rows(table.set_column(at, "wall", table.column(at).cast(pa.int64())))


def _ns(text):
    """An ISO time (UTC) as a nanosecond timestamp scalar with a zone: the finer type the
    references compare in."""
    return pc.cast(pa.array([text + "Z"]), pa.timestamp("ns", "UTC"))[0]


def test_python_timestamp_and_decimal_filters_compare_exactly_and_skip_by_statistics(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), TD, "id", buckets=4, ordering_field="seq")
    keys = _keys_by_bucket(4, 10)
    fg = {b: nbcc.file_group_id(b) for b in range(4)}
    table.write(pa.Table.from_pylist(_td_rows(keys), schema=TD))
    at_ns, dec = pc.field("at").cast(pa.timestamp("ns", "UTC")), pc.field("amount").cast(pa.decimal128(38, 4))
    wall_us = pc.field("wall")

    def d(text):
        return pa.scalar(Decimal(text), pa.decimal128(38, 4))

    day3 = T0 + dt.timedelta(days=3)
    cases = [  # (filter tuple, reference on the unfiltered rows, the file groups statistics leave)
        (("at", ">=", day3), pc.field("at") >= pa.scalar(day3, TD.field("at").type), {fg[3]}),
        (("at", ">=", "2026-11-23"), pc.field("at") >= pa.scalar(day3, TD.field("at").type), {fg[3]}),  # UTC
        (("at", ">=", day3.date()), pc.field("at") >= pa.scalar(day3, TD.field("at").type), {fg[3]}),  # midnight
        (("at", "<", np.datetime64("2026-11-20T00:00:00.0025")), at_ns < _ns("2026-11-20T00:00:00.0025"), {fg[0]}),
        (("at", "<", "2026-11-20T00:00:00.0025Z"), at_ns < _ns("2026-11-20T00:00:00.0025"), {fg[0]}),
        (("at", ">", "2026-11-20T00:00:00.0025+00:00"), at_ns > _ns("2026-11-20T00:00:00.0025"), set(fg.values())),
        (("at", "=", "2026-11-20T00:00:00.0025Z"), at_ns == _ns("2026-11-20T00:00:00.0025"), set()),
        (("at", "!=", "2026-11-20T00:00:00.0025Z"), at_ns != _ns("2026-11-20T00:00:00.0025"), set(fg.values())),
        (("at", "<=", dt.datetime(2026, 11, 20, 1, 0, 0, 1000, tzinfo=dt.timezone(dt.timedelta(hours=1)))),
         at_ns <= _ns("2026-11-20T00:00:00.001"), {fg[0]}),
        (("at", "in", [T0 + dt.timedelta(days=2, milliseconds=4), "2026-11-21T00:00:00.0005Z", None]),
         at_ns.isin(pa.array([_ns("2026-11-22T00:00:00.004"), _ns("2026-11-21T00:00:00.0005")])), {fg[2]}),
        (("at", "not_in", [T0, "2026-11-21T00:00:00.0005Z"]), (at_ns != _ns("2026-11-20T00:00:00")) & at_ns.is_valid(),
         set(fg.values())),
        (("wall", ">", "2026-11-21T00:00:00.000002007"),
         wall_us > pc.cast(pa.array(["2026-11-21T00:00:00.000002007"]), pa.timestamp("ns"))[0], {fg[1], fg[2], fg[3]}),
        (("wall", "=", dt.datetime(2026, 11, 21, 1, tzinfo=dt.timezone(dt.timedelta(hours=1)))),  # its UTC wall time
         wall_us == pa.scalar(dt.datetime(2026, 11, 21), pa.timestamp("ns")), set()),
        (("wall", "<", "3000-01-01"), wall_us.is_valid(), set(fg.values())),  # past the nanoseconds' range
        (("amount", "<", Decimal("100")), dec < d("100"), {fg[0]}),
        (("amount", ">", "200.005"), dec > d("200.005"), {fg[2], fg[3]}),
        (("amount", ">=", "300.085"), dec >= d("300.085"), {fg[3]}),
        (("amount", "in", ["100.5", 200, "100.01", "1.005"]), dec.isin(pa.array([d("200"), d("100.01")])),
         {fg[1], fg[2]}),
        (("amount", "=", "99999999999"), dec == d("99999999999"), set()),  # more digits than decimal(10, 2) holds
        (("amount", ">", -10**20), dec.is_valid(), set(fg.values())),
        (("amount", "<", "1e999999999"), dec.is_valid(), set(fg.values())),  # decided without 10**999999999
        (("amount", ">", "1e-999999999"), dec > d("0"), set(fg.values())),
        (("big", "=", Decimal(10**30 * 2 + 3) + Decimal("0.0001")),
         pc.field("big") == pa.scalar(Decimal(10**30 * 2 + 3) + Decimal("0.0001"), pa.decimal128(38, 4)), {fg[2]}),
    ]
    for when in ("one commit", "moved and stale values", "compacted", "with the metadata table"):
        everything = table.read()
        for spec, ref, groups in cases:
            expected = _td_arrow_rows(everything.filter(ref))
            assert _td_arrow_rows(table.read(filter=[spec])) == expected, (when, spec)
            if when in ("one commit", "with the metadata table"):
                assert _groups(table.plan(filter=[spec])) == groups, (when, spec)
        if when == "one commit":
            # k0 moves from bucket 0's ranges to bucket 3's; a stale write to k1 (older seq) loses.
            k0, k1 = keys[0][0], keys[1][0]
            table.write(pa.Table.from_pylist([
                {"id": k0, "seq": 2, "at": day3, "wall": None, "amount": Decimal("399.99"), "big": None},
                {"id": k1, "seq": 0, "at": T0, "wall": None, "amount": Decimal("0.5"), "big": Decimal(1)}], schema=TD))
            assert table.read(filter=[("at", "<", "2026-11-20T00:00:00.0025Z")]).column("id").to_pylist() \
                == [k for k in keys[0][1:3]]
        elif when == "moved and stale values":
            assert table.compact() is not None
        elif when == "compacted":
            # Statistics from the metadata table's column_stats instead of the commit files:
            # only a fresh table of the same rows prunes as the first commit did.
            table = nbcc.Table.create(str(tmp_path / "indexed"), TD, "id", buckets=4, ordering_field="seq")
            table.build_index(["files", "column_stats"])
            table.write(pa.Table.from_pylist(_td_rows(keys), schema=TD))
            assert table.index_state()["partitions"]["column_stats"] == "ready"
    # The statistics as recorded (format.md §7.3), the same from the commit file and the index.
    write = [i for i in table.timeline() if i.action == "deltacommit"][-1]
    f = next(f for f in read_commit_metadata(table.storage, write)["files"] if f["name"].startswith(fg[3]))
    rows = [r for r in _td_rows(keys) if r["id"] in keys[3]]
    assert f["stats"]["at"] == {"min": int(day3.timestamp() * 1000), "max": int(day3.timestamp() * 1000) + 9,
                                "nulls": 0}
    assert f["stats"]["amount"] == {"min": "300.00", "max": "300.09", "nulls": 0}
    assert f["stats"]["wall"]["min"] == min(r["wall"].value for r in rows)
    index = load_index(table.storage, None, ["files", "column_stats"])
    assert index.file_stats(f["partition"], f["name"], {x.name: x.type for x in TD}) == f["stats"]


def test_python_timestamp_and_decimal_filter_errors_say_what_to_give(tmp_path):
    table = nbcc.Table.create(str(tmp_path / "t"), TD, "id")
    for spec, words in [(("amount", "=", 9.99), "a float holds another number than the one it prints: "
                                                "give Decimal('9.99') or '9.99'"),
                        (("amount", "in", ["1", "lots"]), "'lots' is not a decimal number"),
                        (("at", ">", "tomorrow"), "'tomorrow' is not a timestamp"),
                        # ISO's basic form: Python 3.11 reads it, but only to the microsecond
                        (("at", ">", "20261120T101500.123456789Z"), "is not a timestamp"),
                        (("at", ">", "2026-11-31"), "is not a timestamp"),
                        (("at", ">", "2026-11-20T10:00:00+24:00"), "is not a timestamp"),
                        (("at", ">", np.datetime64("NaT")), "is not a time (NaT"),
                        (("at", "starts_with", "2026"), "needs a string column")]:
        with pytest.raises(nbcc.InvalidOptionError) as err:
            table.read(filter=[spec])
        assert words in str(err.value), spec


def test_spark_timestamp_and_decimal_filters_are_pushed_exactly_in_any_session_time_zone(spark, tmp_path):
    schema = pa.schema([("id", pa.int64()), ("at", pa.timestamp("us", tz="UTC")), ("wall", pa.timestamp("us")),
                        ("ms", pa.timestamp("ms", tz="Europe/Paris")), ("n", pa.timestamp("ns", tz="UTC")),
                        ("amount", pa.decimal128(10, 2)), ("p", pa.timestamp("us", tz="UTC")),
                        ("big", pa.decimal128(38, 4))])
    keys = _keys_by_bucket(4, 4)
    big = Decimal("1234567890123456789012345678901.2345")  # 35 digits: PySpark rounds such values to 28
    exact = Context(prec=60)  # Python's default context rounds sums to 28 digits too
    old = [dt.datetime(2, 1, 1), dt.datetime(1582, 10, 10, 12), dt.datetime(1900, 1, 1), dt.datetime(9999, 12, 31)]
    rows = []
    for b, ks in keys.items():
        for j, k in enumerate(ks):
            when = (T0 + dt.timedelta(days=b, microseconds=j)).replace(tzinfo=None) if b else old[j]
            rows.append({"id": k, "at": when.replace(tzinfo=UTC), "wall": when, "ms": when.replace(tzinfo=UTC),
                         "n": pa.scalar(int(when.replace(tzinfo=UTC).timestamp()) * 10**9 + 1000 * j + 1,
                                        pa.timestamp("ns", "UTC")) if b else None,
                         "amount": Decimal(100 * b) + Decimal(j) / 100, "p": T0 + dt.timedelta(days=b % 2),
                         "big": exact.add(big, Decimal(b) + Decimal(j) / 10**4)})
    uri = str(tmp_path / "t")
    nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=4).write(pa.Table.from_pylist(rows, schema=schema))
    at3 = "TIMESTAMP'2026-11-23 00:00:00+00:00'"
    # Bucket 0 holds times from year 2 to 9999 and amounts 0.00-0.03, bucket b > 0 times on day b
    # and amounts 100 b + 0.00-0.03; partition p is day b % 2.
    cases = {  # where -> the file groups it leaves (Spark partitions with max_partition_bytes=1)
        f"at >= {at3}": 2,
        # A TIMESTAMP value before 1900 may reach nbcc as another time (_SAFE_TIMESTAMPS_FROM): Spark applies it.
        "at < TIMESTAMP'1582-10-11 00:00:00+00:00'": 4,
        "at = TIMESTAMP'1582-10-10 12:00:00+00:00'": 4, "at = TIMESTAMP'0002-01-01 00:00:00+00:00'": 4,
        "at > TIMESTAMP'9999-12-30 00:00:00+00:00'": 1, "at IN (TIMESTAMP'1900-01-01 00:00:00Z', " + at3 + ")": 2,
        f"NOT (at = {at3})": None, f"at != {at3}": None,
        "wall >= TIMESTAMP_NTZ'2026-11-22 00:00:00'": 3, "wall = TIMESTAMP_NTZ'1582-10-10 12:00:00'": 1,
        "wall < TIMESTAMP_NTZ'1000-01-01 00:00:00'": 1,
        f"ms >= {at3}": 2, "ms < TIMESTAMP'2026-11-21 00:00:00.000002+00:00'": None,
        f"n >= {at3}": None,  # nanoseconds: Spark compares them cut to microseconds, so it applies them
        "amount >= 300": 1, "amount < 100.01": 2, "amount IN (200.02, 300)": 2, "amount = 0.5": None,
        "p = TIMESTAMP'2026-11-21 00:00:00+00:00'": 2,
        # 28 digits or more: maybe rounded by PySpark, so applied by Spark
        f"big = {exact.add(big, 1)}": 4, f"big > {exact.add(big, 2)}": 4, f"big IN ({big}, 7)": 4,
        f"NOT (big = {big})": 4,
        "big > 1234567890123456789012345678901": 4, "big > 1234567890123456789012345678": 4,
        "big < 123456789012345678901234567": None,  # 27 digits: pushed, and no file holds such a value f"p < {at3} AND amount > 100": 3,
    }
    previous = spark.conf.get("spark.sql.session.timeZone")
    try:
        for zone in ("America/Los_Angeles", "UTC"):
            spark.conf.set("spark.sql.session.timeZone", zone)
            for where, groups in cases.items():
                off, _ = _read(spark, uri, False, where)
                on, n = _read(spark, uri, True, where)
                assert on == off, (zone, where)
                assert off or where in ("amount = 0.5", "big < 123456789012345678901234567"), (zone, where)
                if groups is not None:
                    assert n == groups, (zone, where)
    finally:
        spark.conf.set("spark.sql.session.timeZone", previous)


def test_python_float_filters_compare_as_arrow_does_and_a_nan_equals_nothing(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("x", pa.float64()), ("f", pa.float32())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", buckets=2, partition_by="f")
    nan = float("nan")
    table.write(pa.table({"id": [1, 2, 3, 4, 5], "x": [0.5, nan, None, 2.0, -float("inf")],
                          "f": pa.array([0.1, 1e30, nan, None, 0.1], pa.float32())}, schema=schema))
    for spec, ids in [(("x", ">", 0.5), [4]), (("x", "<=", 0.5), [1, 5]), (("x", "=", nan), []),
                      (("x", "!=", 0.5), [2, 4, 5]), (("x", "in", [nan, 0.5]), [1]), (("x", "not_in", [nan]), [1, 2, 4, 5]),
                      (("x", "not_in", [2, None]), []), (("x", ">", -float("inf")), [1, 4]), (("x", "=", 2), [4]),
                      (("f", "=", 0.1), [1, 5]),  # a float32 partition: 0.1 as the column holds it
                      (("f", "<", 1e300), [1, 2, 5]), (("f", "is_null"), [4])]:
        assert sorted(table.read(filter=[spec]).column("id").to_pylist()) == ids, spec
    assert table.partitions([("f", "=", 0.1)]) == ["f=0.1"]
