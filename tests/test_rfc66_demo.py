"""RFC-66's demo timeline, built with the real writer and compaction, read back through Spark.

    fg_t10: first state, compacted into a base file          [t10, t20]
    l1:     log file                                          [t21, t40]
    l2:     concurrent log file                               [t30, t50]
    fg_t60: base file of a compaction                         [t60, t80]
    l3:     concurrent log file that started before t60       [t35, t90]

Expected (the RFC): slices [{t60, fg_t60, [l3]}, {t10, fg_t10, [l1, l2]}]; l3 belongs to the new
slice because it *completed* after t60, so the compaction never loses it; a time-travel query
sees each commit exactly from its completion time on.
"""

from __future__ import annotations

import pyarrow as pa
import pytest

import nbcc
from nbcc.writer import prepare

SCHEMA = pa.schema([("id", pa.int64()), ("v", pa.string()), ("ts", pa.int64())])


def _open_write(table: nbcc.Table, rows: dict):
    """Start a write and write its files, but do not commit yet (a writer in flight)."""
    data = pa.table(rows, schema=SCHEMA)
    txn = table.begin_write(data.schema)
    writer = table.log_writer(txn, "0-0-0")
    writer.write(prepare(data, table.config, txn.schema, "upsert"))
    return txn, writer


def _finish(txn, writer) -> str:
    return txn.commit(writer.close())


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    uri = str(tmp_path_factory.mktemp("rfc66") / "t")
    table = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", buckets=1)
    t = {}
    table.write(pa.table({"id": [1, 2, 3], "v": ["a0", "b0", "c0"], "ts": [0, 0, 0]}, schema=SCHEMA))
    t["t10"] = table.compact()  # fg_t10
    t["t20"] = table.timeline()[-1].completion
    l1 = _open_write(table, {"id": [1, 4], "v": ["a1", "d1"], "ts": [1, 1]})
    t["t21"] = l1[0].instant
    l2 = _open_write(table, {"id": [2], "v": ["b2"], "ts": [2]})
    t["t30"] = l2[0].instant
    l3 = _open_write(table, {"id": [1, 5], "v": ["a3", "e3"], "ts": [3, 3]})
    t["t35"] = l3[0].instant
    t["t40"] = _finish(*l1)
    t["t50"] = _finish(*l2)
    t["t60"] = table.schedule_compaction()
    t["t80"] = table.run_compaction(t["t60"])
    t["t90"] = _finish(*l3)
    return table, t, (l1[0].instant, l2[0].instant, l3[0].instant)


def test_the_commits_have_the_demos_order(demo):
    _, t, _ = demo
    order = ["t10", "t20", "t21", "t30", "t35", "t40", "t50", "t60", "t80", "t90"]
    times = [t[k] for k in order]
    assert times == sorted(times) and len(set(times)) == len(times)


def test_file_slices_are_the_rfcs(demo):
    table, t, (i1, i2, i3) = demo
    fg = nbcc.file_group_id(0)
    slices = nbcc.build_file_slices(
        [s for s in _all_data_files(table)], {i.instant: i.completion for i in table.timeline()})[fg]
    assert [(s.base_instant, s.base_file is not None, [n.split("_")[1].split(".")[0] for n in s.log_files])
            for s in slices[:2]] == [(t["t60"], True, [i3]), (t["t10"], True, [i1, i2])]
    # Here fg_t10 came from compacting a first delta commit, whose log forms the oldest slice.
    assert len(slices) == 3 and slices[2].base_file is None and slices[2].base_instant < t["t10"]
    assert slices[0].base_file.endswith(f"_{t['t60']}.parquet")
    assert slices[1].base_file.endswith(f"_{t['t10']}.parquet")


def _all_data_files(table):
    import os
    return [n for n in os.listdir(table.uri) if "_" in n and not n.startswith(".")]


STATES = {
    # as_of -> expected {id: v}
    "t20": {1: "a0", 2: "b0", 3: "c0"},
    "t35": {1: "a0", 2: "b0", 3: "c0"},  # l1, l2, l3 started but none completed
    "t40": {1: "a1", 2: "b0", 3: "c0", 4: "d1"},
    "t50": {1: "a1", 2: "b2", 3: "c0", 4: "d1"},
    "t60": {1: "a1", 2: "b2", 3: "c0", 4: "d1"},  # compaction pending: same rows
    "t80": {1: "a1", 2: "b2", 3: "c0", 4: "d1"},  # compaction done: same rows, l3 still in flight
    "t90": {1: "a3", 2: "b2", 3: "c0", 4: "d1", 5: "e3"},  # l3 lands in the t60 slice
}


@pytest.mark.parametrize("point", list(STATES))
def test_time_travel_through_spark(spark, demo, point):
    table, t, _ = demo
    rows = spark.read.format("nbcc").option("as_of", t[point]).load(table.uri).collect()
    assert {r.id: r.v for r in rows} == STATES[point]


def test_latest_snapshot_and_read_optimized_through_spark(spark, demo):
    table, _, _ = demo
    snap = spark.read.format("nbcc").load(table.uri).collect()
    assert {r.id: r.v for r in snap} == STATES["t90"]
    ro = spark.read.format("nbcc").option("query_type", "read_optimized").load(table.uri).collect()
    assert {r.id: r.v for r in ro} == STATES["t80"]  # base file only: l3 is not compacted yet


def test_incremental_never_misses_the_late_commit(spark, demo):
    """l3 started at t35, before the compaction and before t80, but completed at t90: a consumer
    that read up to t80 gets it in its next range."""
    table, t, _ = demo
    rows = (spark.read.format("nbcc").option("query_type", "incremental").option("begin", t["t80"])
            .load(table.uri).collect())
    assert {r.id: r.v for r in rows} == {1: "a3", 5: "e3"}
    cdc = (spark.read.format("nbcc").option("query_type", "incremental").option("begin", t["t80"])
           .option("incremental_format", "cdc").load(table.uri).collect())
    got = {r.id: (r._change_type, r.before.v if r.before else None, r.after.v, r._nbcc_completion_time) for r in cdc}
    assert got == {1: ("update", "a1", "a3", t["t90"]), 5: ("insert", None, "e3", t["t90"])}
    up_to_80 = (spark.read.format("nbcc").option("query_type", "incremental").option("begin", t["t20"])
                .option("end", t["t80"]).load(table.uri).collect())
    assert {r.id: r.v for r in up_to_80} == {1: "a1", 2: "b2", 4: "d1"}
