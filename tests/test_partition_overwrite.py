"""Dynamic partition overwrite: `mode="overwrite"` with `partitionOverwriteMode=dynamic` replaces
only the partitions the write has rows in (Spark's file sources, Delta and Hudi's
`insert_overwrite` do the same); every other partition keeps its rows. A partition deletion
(`operation="delete_partition"`, `Table.delete_partitions`) replaces partitions with nothing.

The randomized test keeps its own model of the table in plain Python (one dict per key, and the
partition each key lives in) and checks every read the format offers against it: snapshots,
`as_of` every completed commit, and incremental ranges in both formats, with partition deletions,
compactions (some left pending across an overwrite) and the metadata table on and off.
"""

from __future__ import annotations

import datetime as dt
import json
import random
from pathlib import Path
from typing import Any

import pyarrow as pa
import pytest

import nbcc
from nbcc.conditions import parse_predicate
from nbcc.filenames import make_token
from nbcc.writer import prepare

SCHEMA = pa.schema([("id", pa.int64()), ("day", pa.string()), ("ts", pa.int64()), ("v", pa.string())])
DAYS = ("d1", "d2", "d3")
COLUMNS = ["id", "day", "ts", "v"]


def day_of(key: int) -> str:
    return DAYS[key % len(DAYS)]  # a key lives in one partition for ever


def new_table(uri: str, partition_by: str | None = "day") -> nbcc.Table:
    return nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", partition_by=partition_by, buckets=2)


def rows_of(result: pa.Table) -> dict[int, dict[str, Any]]:
    rows = result.select(COLUMNS).to_pylist()
    by_key = {r["id"]: r for r in rows}
    assert len(by_key) == len(rows), "a key read twice"
    return by_key


def batch(keys, ts: int, tag: str) -> pa.Table:
    return pa.Table.from_pylist([{"id": k, "day": day_of(k), "ts": ts, "v": f"{tag}-{k}"} for k in keys], schema=SCHEMA)


def last_completed(table: nbcc.Table) -> Any:
    return [i for i in table.timeline() if i.completion][-1]


def test_dynamic_overwrite_replaces_only_the_partitions_written_and_time_travel_sees_before(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(9), 1, "a"))  # keys 0..8: three per day
    before = last_completed(table).completion
    table.write(batch([0, 3, 30], 2, "o"), mode="overwrite", partition_overwrite_mode="dynamic")  # d1 only
    overwrite = last_completed(table)
    assert overwrite.action == "replacepartitions"
    got = rows_of(table.read())
    assert {k: r["v"] for k, r in got.items()} == {
        0: "o-0", 3: "o-3", 30: "o-30",  # d1: exactly the overwrite's rows (key 6 is gone)
        1: "a-1", 4: "a-4", 7: "a-7", 2: "a-2", 5: "a-5", 8: "a-8"}  # d2, d3 untouched
    assert set(rows_of(table.read(as_of=before))) == set(range(9))
    # A change feed shows the key the overwrite dropped (6) as deleted by it, and no other partition.
    cdc = table.read(query_type="incremental", begin=before, incremental_format="cdc").to_pylist()
    assert {r["id"]: (r["_change_type"], r["_nbcc_completion_time"]) for r in cdc} == {
        0: ("update", overwrite.completion), 3: ("update", overwrite.completion),
        30: ("insert", overwrite.completion), 6: ("delete", overwrite.completion)}
    # Writes after the overwrite merge with its rows, in every partition.
    table.write(batch([6, 1], 3, "n"))
    got = rows_of(table.read())
    assert got[6]["v"] == "n-6" and got[1]["v"] == "n-1" and got[0]["v"] == "o-0"
    # The same result through the metadata table.
    table.build_index()
    assert rows_of(table.read(use_metadata_table=True)) == rows_of(table.read(use_metadata_table=False)) == got


def test_the_first_dynamic_overwrite_raises_the_format_version_so_older_nbcc_refuse_the_table(tmp_path):
    # format.md §3: version 2 adds `replacepartitions`. An nbcc that reads only version 1 would
    # take it for an unknown action that adds files: it would read, and compact, the replaced
    # partitions' old rows back. Tables that never had one stay at version 1.
    uri = str(tmp_path / "t")
    table = new_table(uri)

    def version() -> int:
        return json.loads(Path(uri, ".nbcc", "table.json").read_text())["format_version"]

    table.write(batch(range(6), 1, "a"))
    table.write(batch([0], 2, "o"), mode="overwrite")
    table.build_index("files")  # rewrites table.json's metadata_table field: the version stays
    assert version() == 1
    doc = json.loads(Path(uri, ".nbcc", "table.json").read_text())
    table.write(batch([1], 3, "d"), mode="overwrite", partition_overwrite_mode="dynamic")
    after = json.loads(Path(uri, ".nbcc", "table.json").read_text())
    assert after == {**doc, "format_version": 2}  # nothing else changed
    assert nbcc.Table.open(uri).describe()["format_version"] == 2
    table.write(batch([4], 4, "d"), mode="overwrite", partition_overwrite_mode="dynamic")
    assert version() == 2
    assert set(rows_of(nbcc.Table.open(uri).read())) == {0, 4}


def test_the_version_is_raised_by_whatever_begins_the_instant_and_describe_reads_it_afresh(tmp_path):
    # The streaming sink and other callers begin instants from prepare_write: the raise belongs
    # to the instant's beginning, not to one entry point. A Table opened before sees it too.
    uri = str(tmp_path / "t")
    table = new_table(uri)
    table.write(batch(range(3), 1, "a"))
    opened_before = nbcc.Table.open(uri)
    txn = table.prepare_write(SCHEMA, overwrite=True, partition_overwrite_mode="dynamic")
    assert opened_before.describe()["format_version"] == 1
    txn.begin()
    assert txn.action == "replacepartitions"
    assert json.loads(Path(uri, ".nbcc", "table.json").read_text())["format_version"] == 2
    assert opened_before.describe()["format_version"] == 2
    txn.rollback(reason="a test")  # the raise stays: the table may hold such instants from now
    assert nbcc.Table.open(uri).describe()["format_version"] == 2


def test_static_is_the_default_and_replaces_every_partition(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(9), 1, "a"))
    table.write(batch([0], 2, "o"), mode="overwrite")
    assert set(rows_of(table.read())) == {0}
    assert last_completed(table).action == "replacecommit"
    table.write(batch([1], 3, "s"), mode="overwrite", partition_overwrite_mode="STATIC")
    assert set(rows_of(table.read())) == {1}


def test_on_a_table_without_partition_columns_dynamic_replaces_the_whole_table_as_in_spark(tmp_path):
    table = new_table(str(tmp_path / "t"), partition_by=None)
    table.write(batch(range(6), 1, "a"))
    table.write(batch([1, 2], 2, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    assert set(rows_of(table.read())) == {1, 2}
    assert last_completed(table).action == "replacecommit"


def test_an_empty_dynamic_overwrite_replaces_nothing(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(9), 1, "a"))
    before = rows_of(table.read())
    table.write(batch([], 2, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    assert last_completed(table).action == "replacepartitions"
    assert rows_of(table.read()) == before
    begin = [i for i in table.timeline() if i.completion][-2].completion
    assert table.read(query_type="incremental", begin=begin, incremental_format="cdc").num_rows == 0


def test_a_bad_partition_overwrite_mode_is_refused_and_nothing_is_written(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(3), 1, "a"))
    timeline = table.timeline()
    with pytest.raises(nbcc.InvalidOptionError, match="'partitionOverwriteMode' must be one of static, dynamic; got 'partitions'"):
        table.write(batch([0], 2, "o"), mode="overwrite", partition_overwrite_mode="partitions")
    # The same check where the Spark connector begins its writes: a typo must not replace the table.
    with pytest.raises(nbcc.InvalidOptionError, match="must be one of static, dynamic; got 'dynamc'"):
        table.begin_write(SCHEMA, overwrite=True, partition_overwrite_mode="dynamc")
    assert table.timeline() == timeline
    # None is the default, as for the other write arguments.
    table.write(batch([1], 2, "o"), mode="overwrite", partition_overwrite_mode=None)
    assert set(rows_of(table.read())) == {1}


def test_clean_deletes_the_replaced_partitions_files_only_and_reads_survive_archival(tmp_path):
    uri = str(tmp_path / "t")
    table = new_table(uri)
    table.write(batch(range(9), 1, "a"))
    table.write(batch(range(9), 2, "b"))
    old = {p.relative_to(uri).as_posix() for p in Path(uri).glob("day=*/*")}
    table.write(batch([0, 3], 3, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    table.write(batch([1], 4, "n"))
    expected = rows_of(table.read())
    table.clean(retain_commits=1)
    left = {p.relative_to(uri).as_posix() for p in Path(uri).glob("day=*/*")}
    assert {f for f in old if f not in left} == {f for f in old if f.startswith("day=d1/")}
    assert rows_of(table.read()) == expected
    table.archive(retain_commits=1)
    assert any(i.archived for i in table.timeline())
    assert rows_of(table.read()) == expected
    assert table.compact() is not None
    assert rows_of(table.read()) == expected


def test_a_compaction_planned_before_a_dynamic_overwrite_does_not_bring_back_the_replaced_rows(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(9), 1, "a"))
    table.write(batch(range(0, 9, 2), 2, "b"))
    tc = table.schedule_compaction()  # plans every file group of d1, d2 and d3
    table.write(batch([3], 3, "o"), mode="overwrite", partition_overwrite_mode="dynamic")  # d1
    expected = {3: "o-3", 1: "a-1", 4: "b-4", 7: "a-7", 2: "b-2", 5: "a-5", 8: "b-8"}
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == expected
    table.run_compaction(tc)
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == expected
    assert {k: r["v"] for k, r in rows_of(table.read(query_type="read_optimized")).items()} == {
        k: v for k, v in expected.items() if day_of(k) != "d1"}  # d1's base files predate the overwrite


def test_through_the_metadata_table_an_overwrite_keeps_its_partitions_after_its_files_are_cleaned(tmp_path):
    # The metadata table drops the entries of cleaned files. An overwrite whose only file was
    # compacted and cleaned must still hide what it replaced: here the input a compaction planned
    # before it keeps, and then that compaction's base file.
    table = new_table(str(tmp_path / "t"))
    table.build_index("files")
    old, new = _keys_in_two_buckets("d1")
    table.write(batch([old], 1, "a"))
    tc = table.schedule_compaction()  # plans old's file group; left pending
    table.write(batch([new], 2, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    table.run_compaction(table.schedule_compaction())  # folds the overwrite's one log file
    table.write(batch([2], 3, "n"))  # another partition
    table.clean(retain_commits=1)  # deletes that log file; keeps the pending compaction's input
    expected = {new: "o-" + str(new), 2: "n-2"}
    for when in ("before", "after"):
        for use_mdt in (True, False):
            assert {k: r["v"] for k, r in rows_of(table.read(use_metadata_table=use_mdt)).items()} == expected, \
                (when, use_mdt)
        table.run_compaction(tc)


def _keys_in_two_buckets(day: str) -> tuple[int, int]:
    """Two keys of one partition that hash to different buckets of a 2-bucket table."""
    keys = [k for k in range(100) if day_of(k) == day]
    buckets = [int(b) for b in nbcc.bucket_ids(pa.array(keys, pa.int64()), 2)]
    return keys[buckets.index(0)], keys[buckets.index(1)]


# -- randomized: every read against a model kept in plain Python -------------------------------------

def _cdc(before: dict, after: dict) -> dict[int, tuple]:
    """The changes from one state to another, as a cdc read gives them."""
    out = {}
    for k in before.keys() | after.keys():
        b, a = before.get(k), after.get(k)
        if b != a:
            out[k] = ("insert" if b is None else "delete" if a is None else "update", b, a)
    return out


@pytest.mark.parametrize("seed", range(4))
def test_every_read_matches_the_model_through_random_partition_overwrites(tmp_path, memory_uri, seed):
    rng = random.Random(seed)
    uri = str(tmp_path / "t") if seed % 2 else memory_uri
    table = new_table(uri)
    if seed >= 2:
        table.build_index()
    now: dict[int, dict[str, Any]] = {}
    states = [("earliest", {}, set())]  # (completion, key -> row after it, keys the commit wrote)
    pending = []
    keys = list(range(30))
    for step in range(1, 16):
        roll = rng.random()
        chosen = rng.sample(keys, rng.randint(1, 8))
        if roll < 0.3:
            data = batch(chosen, step, f"u{step}")
            table.write(data)
        elif roll < 0.4:
            table.write(batch(chosen, step, "x").select(["id", "day"]), operation="delete")
            now = {k: r for k, r in now.items() if k not in chosen}
            data = batch([], step, "x")
        elif step == 8 or roll < 0.5:
            days = set(rng.sample(DAYS, rng.randint(1, 2)))
            if rng.random() < 0.5:
                instant = table.delete_partitions([("day", "in", sorted(days))])
            else:  # the rows name the partitions; their other columns do not matter
                instant = table.write(batch([k for k in keys if day_of(k) in days][:3], step, "x").select(["day"]),
                                      operation="delete_partition")
            if instant is None:  # no partition matched: nothing written
                continue
            now = {k: r for k, r in now.items() if r["day"] not in days}
            chosen, data = [], batch([], step, "x")
        elif roll < 0.6:  # replaceWhere: the matching days, with rows in some of them or none
            days = set(rng.sample(DAYS, rng.randint(1, 2)))
            where = rng.choice([f"day IN ({', '.join(repr(d) for d in sorted(days))})",
                                [("day", "in", sorted(days))]])
            chosen = [k for k in chosen if day_of(k) in days][:rng.randint(0, 3)]
            data = batch(chosen, step, f"w{step}")
            table.write(data, mode="overwrite", replace_where=where)
            now = {k: r for k, r in now.items() if r["day"] not in days}
        elif roll < 0.75:
            days = set(rng.sample(DAYS, rng.randint(1, 2)))
            chosen = [k for k in chosen if day_of(k) in days] or [k for k in keys if day_of(k) in days][:2]
            data = batch(chosen, step, f"p{step}")
            table.write(data, mode="overwrite", partition_overwrite_mode="dynamic")
            now = {k: r for k, r in now.items() if r["day"] not in {day_of(c) for c in chosen}}
        elif roll < 0.8:
            data = batch(chosen, step, f"o{step}")
            table.write(data, mode="overwrite")
            now = {}
        else:
            tc = table.schedule_compaction()
            if tc is not None and rng.random() < 0.5:
                table.run_compaction(tc)
            elif tc is not None:
                pending.append(tc)
            continue
        now = {**now, **{r["id"]: r for r in data.to_pylist()}}
        states.append((last_completed(table).completion, now, set(chosen)))
        if pending and rng.random() < 0.3:
            table.run_compaction(pending.pop())
    assert any(i.action == "replacepartitions" for i in table.timeline())
    assert table.describe()["format_version"] == 3  # a partition deletion began

    def check_all() -> None:
        for use_mdt in ((False, True) if seed >= 2 else (False,)):
            assert rows_of(table.read(use_metadata_table=use_mdt)) == now
            for completion, state, _ in states[1:]:
                assert rows_of(table.read(as_of=completion, use_metadata_table=use_mdt)) == state, completion
        for i, (begin, before, _) in enumerate(states):
            for j in range(i + 1, len(states)):
                end, after, _ = states[j]
                written = set().union(*(w for _, _, w in states[i + 1:j + 1]))
                got = rows_of(table.read(query_type="incremental", begin=begin, end=end))
                assert got == {k: after[k] for k in written if k in after}, (begin, end)
                cdc = table.read(query_type="incremental", begin=begin, end=end, incremental_format="cdc")
                changes = {r["id"]: (r["_change_type"], r["before"], r["after"]) for r in cdc.to_pylist()}
                assert len(changes) == cdc.num_rows
                assert changes == _cdc(before, after), (begin, end)

    check_all()
    for tc in pending:
        table.run_compaction(tc)
    check_all()


# -- partition deletion -----------------------------------------------------------------------------

def test_delete_partitions_removes_their_rows_in_one_commit_and_time_travel_and_cdc_see_it(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(9), 1, "a"))
    before = rows_of(table.read())
    written = last_completed(table).completion
    assert table.partitions() == ["day=d1", "day=d2", "day=d3"]
    assert table.partitions([("day", "<", "d3")]) == ["day=d1", "day=d2"]
    files_before = sorted(p.name for p in Path(table.uri).rglob("*.log.*"))
    instant = table.delete_partitions([("day", "<", "d3")])
    done = last_completed(table)
    assert (done.instant, done.action) == (instant, "replacepartitions")
    assert sorted(p.name for p in Path(table.uri).rglob("*.log.*")) == files_before  # no file written
    assert rows_of(table.read()) == {k: r for k, r in before.items() if r["day"] == "d3"}
    assert table.partitions() == ["day=d3"]
    assert rows_of(table.read(as_of=written)) == before
    assert table.describe()["format_version"] == 3
    cdc = table.read(query_type="incremental", begin=written, incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["_nbcc_completion_time"]) for r in cdc.to_pylist()) == \
        [(k, "delete", done.completion) for k in sorted(before) if day_of(k) != "d3"]
    assert table.read(query_type="incremental", begin=written).num_rows == 0  # latest_state: nothing live
    table.write(batch([0], 2, "n"))  # the partition takes new rows again
    assert rows_of(table.read())[0]["v"] == "n-0"
    assert table.delete_partitions([("day", "=", "d9")]) is None  # no match: nothing written
    assert last_completed(table).action == "deltacommit"


def test_cdc_dates_a_change_by_the_overwrite_that_made_it_after_the_write_of_the_key(tmp_path):
    # A key written in the range and then removed by an overwrite of its partition in the range
    # was dated by its write, before the overwrite that deleted it.
    table = new_table(str(tmp_path / "t"))
    table.write(batch([0, 1], 1, "a"))  # 0 in d1, 1 in d2
    begin = last_completed(table).completion
    table.write(batch([0, 3, 1], 2, "b"))  # 0 changes and 3 is new in d1; 1 changes in d2
    written = last_completed(table).completion
    table.write(batch([6], 3, "o"), mode="overwrite", partition_overwrite_mode="dynamic")  # replaces d1
    overwrite = last_completed(table).completion
    table.write(batch([9], 4, "c"))  # a new key in d1 after the overwrite
    later = last_completed(table).completion
    cdc = table.read(query_type="incremental", begin=begin, incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["_nbcc_completion_time"]) for r in cdc.to_pylist()) == [
        (0, "delete", overwrite),  # existed at begin, changed, then the overwrite removed it
        (1, "update", written),  # its partition was not replaced
        (6, "insert", overwrite), (9, "insert", later)]  # key 3 came and went in the range: no row
    cdc = table.read(query_type="incremental", begin=written, end=overwrite, incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["_nbcc_completion_time"]) for r in cdc.to_pylist()) == [
        (0, "delete", overwrite), (3, "delete", overwrite), (6, "insert", overwrite)]
    cdc = table.read(query_type="incremental", begin=begin, end=overwrite, incremental_format="cdc")
    assert sorted((r["id"], r["_change_type"], r["_nbcc_completion_time"]) for r in cdc.to_pylist()) == [
        (0, "delete", overwrite), (1, "update", written), (6, "insert", overwrite)]


def test_the_rows_form_deletes_the_partitions_the_rows_are_in_and_ignores_their_other_columns(tmp_path):
    table = new_table(str(tmp_path / "t"), partition_by="day,ts")
    table.write(batch(range(6), 1, "a"))
    table.write(batch([6], 2, "b"))
    names = pa.table({"day": ["d1", "d1", "d2"], "ts": [1, 1, 2], "v": ["whatever", None, "x"]})
    table.write(names, operation="delete_partition")  # d1/1; d2/2 holds nothing, and is named all the same
    assert sorted(rows_of(table.read())) == [1, 2, 4, 5, 6]
    meta = json.loads(next(Path(table.uri, ".nbcc", "timeline").glob("*_*.replacepartitions")).read_text())
    assert (meta["operation"], meta["files"], meta["replaced_partitions"]) == \
        ("delete_partition", [], ["day=d1/ts=1", "day=d2/ts=2"])


def test_a_write_that_completes_after_a_deletion_is_kept_and_one_before_it_is_not(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch([0, 3], 1, "a"))
    early = table.begin_write(SCHEMA)  # begins before the deletion, completes after it
    writer = table.log_writer(early, make_token(0, 0, 0))
    writer.write(prepare(batch([6], 2, "late"), table.config, early.schema, "upsert"))
    table.write(batch([9], 3, "done-before"))  # completes before the deletion
    table.delete_partitions([("day", "=", "d1")])
    early.commit(writer.close())
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == {6: "late-6"}


@pytest.mark.parametrize("how", ["delete_partitions", "replace_where"])
def test_a_partition_created_after_the_listing_is_replaced_as_a_listed_one_is(tmp_path, monkeypatch, how):
    # A deletion or replaceWhere lists the partitions that match, then commits. A commit that
    # completes in between and creates a matching partition must lose its rows as one into a
    # listed partition does: the commit adds such partitions under the table lock (format.md §8).
    uri = str(tmp_path / "t")
    table = new_table(uri)
    table.write(batch([0, 1], 1, "a"))  # d1, d2; d3 does not exist yet
    listing = nbcc.Table.match_partitions

    def listed_then_created(self, filter):
        match = listing(self, filter)
        assert match.listed == ("day=d2",)
        nbcc.Table.open(uri).write(batch([2, 4], 2, "meanwhile"))  # creates d3, updates d2
        return match

    monkeypatch.setattr(nbcc.Table, "match_partitions", listed_then_created)
    if how == "delete_partitions":
        table.delete_partitions([("day", ">=", "d2")])
        want = {0: "a-0"}
    else:
        table.write(batch([7], 3, "new"), mode="overwrite", replace_where="day >= 'd2'")
        want = {0: "a-0", 7: "new-7"}
    monkeypatch.undo()
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == want
    latest = table.history(1)[0]  # latest completion (its instant began before the write meanwhile)
    assert latest.action == "replacepartitions" and latest.partitions == ("day=d2", "day=d3")
    # What completes after it is kept, in a listed partition and a created one alike.
    table.write(batch([2, 5], 4, "after"))
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == {**want, 2: "after-2", 5: "after-5"}


def test_a_compaction_planned_before_a_deletion_and_clean_and_archival_do_not_bring_rows_back(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.build_index("files")
    table.write(batch(range(9), 1, "a"))
    tc = table.schedule_compaction()
    table.delete_partitions([("day", "in", ["d1", "d2"])])
    expected = {k: r for k, r in rows_of(table.read()).items()}
    assert sorted(expected) == [2, 5, 8]
    table.run_compaction(tc)
    table.write(batch([2], 2, "n"))
    table.write(batch([5], 3, "n"))
    expected = rows_of(table.read())
    table.clean(retain_commits=1)
    assert not list(Path(table.uri).glob("day=d1/*")) and not list(Path(table.uri).glob("day=d2/*"))
    table.archive(retain_commits=1)
    assert any(i.archived for i in table.timeline())
    for use_mdt in (True, False):
        assert rows_of(table.read(use_metadata_table=use_mdt)) == expected
        assert rows_of(table.read(query_type="read_optimized", use_metadata_table=use_mdt)).keys() <= expected.keys()
    assert table.partitions() == ["day=d3"]


def test_the_version_goes_from_2_to_3_and_a_later_dynamic_overwrite_does_not_lower_it(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(3), 1, "a"))
    table.write(batch([0], 2, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    assert table.describe()["format_version"] == 2
    table.write(pa.table({"day": ["d2"]}), operation="delete_partition")
    assert table.describe()["format_version"] == 3
    table.write(batch([1], 3, "o"), mode="overwrite", partition_overwrite_mode="dynamic")
    assert table.describe()["format_version"] == 3
    assert {k: r["v"] for k, r in rows_of(table.read()).items()} == {0: "o-0", 1: "o-1", 2: "a-2"}


def test_partition_values_of_every_kind_are_matched_by_their_values(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("region", pa.string()), ("day", pa.date32()), ("flag", pa.bool_()),
                        ("at", pa.timestamp("us", tz="UTC"))])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", partition_by=["region", "day", "flag", "at"],
                              buckets=1)
    at = [dt.datetime(2026, 1, 1, h, tzinfo=dt.timezone.utc) for h in range(4)]
    table.write(pa.table({"id": [0, 1, 2, 3], "region": ["eu west", "us", None, "eu west"],
                          "day": [dt.date(2026, 1, d) for d in (1, 2, 3, 4)], "flag": [True, False, True, None],
                          "at": pa.array(at, pa.timestamp("us", tz="UTC"))}, schema=schema))

    def ids() -> list[int]:
        return sorted(table.read().column("id").to_pylist())

    assert table.partitions([("region", "=", "eu west"), ("day", ">=", "2026-01-04")]) == \
        ["region=eu%20west/day=2026-01-04/flag=__HIVE_DEFAULT_PARTITION__/at=2026-01-01%2003%3A00%3A00.000000Z"]
    table.delete_partitions([("region", "is_null")])
    assert ids() == [0, 1, 3]
    table.delete_partitions([("flag", "=", False)])
    assert ids() == [0, 3]
    import pyarrow.compute as pc  # a pyarrow expression reaches column types the tuple form does not
    table.delete_partitions(pc.field("at") < pa.scalar(at[1], pa.timestamp("us", tz="UTC")))
    assert ids() == [3]
    # Tuples and expressions in one list: both must hold.
    table.write(pa.table({"id": [5], "region": ["eu west"], "day": [dt.date(2026, 1, 5)], "flag": [None],
                          "at": pa.array([at[3]], pa.timestamp("us", tz="UTC"))}, schema=schema))
    assert table.partitions([("region", "=", "eu west"), pc.field("day") > pa.scalar(dt.date(2026, 1, 4))]) == \
        ["region=eu%20west/day=2026-01-05/flag=__HIVE_DEFAULT_PARTITION__/at=2026-01-01%2003%3A00%3A00.000000Z"]


@pytest.mark.parametrize("call, problem", [
    (lambda t: t.delete_partitions(None), "needs a filter on partition columns"),
    (lambda t: t.delete_partitions([]), "needs a filter on partition columns"),
    (lambda t: t.delete_partitions([("ts", "<", 5)]), r"filter column\(s\) \['ts'\] are not partition columns"),
    (lambda t: t.delete_partitions([("day", "=", 3)]), "are not strings"),
    (lambda t: t.delete_partitions(pa.compute.field("ts") < 5), "cannot be applied to the partition columns"),
    (lambda t: t.write(pa.table({"id": [1]}), operation="delete_partition"), r"lacks partition column\(s\) \['day'\]"),
    (lambda t: t.write(pa.table({"day": [1.5]}), operation="delete_partition"), "has type double in the data"),
    (lambda t: t.write(pa.table({"day": ["d1"]}), operation="delete_partition", mode="overwrite"),
     "cannot be combined with overwrite mode"),
    (lambda t: t.write(pa.table({"day": ["__HIVE_DEFAULT_PARTITION__"]}), operation="delete_partition"),
     "has the value '__HIVE_DEFAULT_PARTITION__', the folder name of null values; to delete the null "
     "partition, give null"),
    (lambda t: t.partitions(pa.compute.field("id") > 1),
     r"cannot be applied to the partition columns \['day'\] alone .*: column 'id' is not a partition column .*\. "
     r"To find the rows that match a condition on other columns, read them"),
    (lambda t: t.partitions([("id", "=", 1)]), r"filter column\(s\) \['id'\] are not partition columns .* "
                                               r"To find the rows that match a condition on other columns, read them"),
])
def test_bad_partition_deletions_are_refused_and_nothing_is_written(tmp_path, call, problem):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(6), 1, "a"))
    before, timeline = rows_of(table.read()), table.timeline()
    with pytest.raises(nbcc.NbccError, match=problem):
        call(table)
    assert (rows_of(table.read()), table.timeline()) == (before, timeline)
    assert table.describe()["format_version"] == 1


def test_a_deletion_of_no_rows_writes_nothing(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(6), 1, "a"))
    timeline = table.timeline()
    assert table.write(SCHEMA.empty_table().select(["day"]), operation="delete_partition") is None
    assert table.timeline() == timeline and table.describe()["format_version"] == 1


def test_an_unpartitioned_table_has_no_partitions_to_delete(tmp_path):
    table = new_table(str(tmp_path / "t"), partition_by=None)
    table.write(batch(range(3), 1, "a"))
    assert table.partitions() == []
    for call in (lambda: table.delete_partitions([("day", "=", "d1")]),
                 lambda: table.write(pa.table({"day": ["d1"]}), operation="delete_partition")):
        with pytest.raises(nbcc.NbccError, match="no partition columns.*overwrite it with no rows"):
            call()
    with pytest.raises(nbcc.NbccError, match="the table has no partition columns, so it has no partitions to list"):
        table.partitions([("day", "=", "d1")])
    assert sorted(rows_of(table.read())) == [0, 1, 2] and len(table.timeline()) == 1


# -- replaceWhere ----------------------------------------------------------------------------------

def test_replace_where_replaces_the_matching_partitions_rows_or_not(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("day", pa.date32()), ("v", pa.string())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", partition_by="day", buckets=2)
    days = [dt.date(2026, 11, d) for d in range(1, 8)] + [None]
    table.write(pa.table({"id": list(range(8)), "day": days, "v": ["a"] * 8}, schema=schema))
    written = last_completed(table).completion

    def state() -> dict[int, str]:
        return {r["id"]: r["v"] for r in table.read().to_pylist()}

    new = pa.table({"id": [100, 2], "day": [days[2], days[2]], "v": ["n", "n"]}, schema=schema)
    table.write(new, mode="overwrite", replace_where="day BETWEEN DATE '2026-11-02' AND DATE '2026-11-04'")
    assert state() == {0: "a", 2: "n", 100: "n", 4: "a", 5: "a", 6: "a", 7: "a"}  # 11-02 and 11-04 emptied
    assert table.describe()["format_version"] == 3
    meta = json.loads(sorted(Path(table.uri, ".nbcc", "timeline").glob("*_*.replacepartitions"))[-1].read_text())
    assert meta["replaced_partitions"] == ["day=2026-11-02", "day=2026-11-03", "day=2026-11-04"]
    assert table.read(as_of=written).num_rows == 8
    # The null partition, IN lists, and the Python filter form.
    table.write(pa.table({"id": [], "day": [], "v": []}, schema=schema), mode="overwrite",
                replace_where="day IS NULL AND day IS NULL")
    table.write(pa.table({"id": [6], "day": [days[6]], "v": ["m"]}, schema=schema), mode="overwrite",
                replace_where=[("day", "in", ["2026-11-06", "2026-11-07"])])
    assert state() == {0: "a", 2: "n", 100: "n", 4: "a", 6: "m"}


@pytest.mark.parametrize("where, problem", [
    ("day = 'd1'", r"1 row\(s\) do not match replaceWhere \"day = 'd1'\" \(one has day=d2\)"),
    ("day = 'd1' OR day = 'd2'", "OR, LIKE and functions are not supported"),
    ("to_date(day) = '2026-11-01'", "'to_date\\(day\\)' is not a column name"),
    ("day >= DATE '2026-11-01'", "DATE '2026-11-01' is compared as SQL casts it"),
    ("DAY = 'd1'", r"1 row\(s\) do not match"),  # column names in any letter case, as SQL's
    ("NOT day = 'd1'", "NOT is not supported here"),
    ("ts > 3", r"filter column\(s\) \['ts'\] are not partition columns.*replaceWhere replaces whole partitions"),
    ("", "replaceWhere is empty"),
    # What SQL reads otherwise is refused rather than misread into other partitions.
    ("day >= 1", r"1 is a number, which SQL compares numerically; quote it"),
    ("day != NULL", "'NULL' is not a literal"),
    ("day = other_column", "'other_column' is not a literal"),
    ("day = 'd1", "unbalanced quote"),
    ("day = true", "is a boolean, which SQL compares as one"),
    (r"day = \x000\x00 AND day = 'd1'", r"'\\\\x000\\\\x00' is not a literal"),  # no other literal taken for it
])
def test_a_bad_replace_where_is_refused_and_nothing_is_written(tmp_path, where, problem):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(6), 1, "a"))
    before, timeline = rows_of(table.read()), table.timeline()
    with pytest.raises(nbcc.NbccError, match=problem):
        table.write(batch([0, 1], 2, "n"), mode="overwrite", replace_where=where)  # days d1 and d2
    assert (rows_of(table.read()), table.timeline()) == (before, timeline)
    assert table.describe()["format_version"] == 1


def test_a_stream_of_batches_with_a_row_outside_replace_where_is_rolled_back(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.write(batch(range(6), 1, "a"))
    before = rows_of(table.read())
    batches = [batch([0], 2, "n").to_batches()[0], batch([1], 2, "n").to_batches()[0]]  # d1, then d2
    with pytest.raises(nbcc.NbccError, match="do not match replaceWhere"):
        table.write(iter(batches), mode="overwrite", replace_where="day = 'd1'")
    assert rows_of(table.read()) == before
    assert table.timeline()[-1].state == "rolledback"


def test_replace_where_goes_with_overwrite_and_a_partitioned_table_only(tmp_path):
    table = new_table(str(tmp_path / "t"))
    flat = new_table(str(tmp_path / "flat"), partition_by=None)
    for call, problem in [
        (lambda: table.write(batch([0], 1, "n"), replace_where="day = 'd1'"), "goes with mode overwrite"),
        (lambda: table.write(batch([0], 1, "n").select(["day"]), operation="delete_partition",
                             replace_where="day = 'd9'"), "goes with mode overwrite"),
        (lambda: table.write(batch([0], 1, "n"), mode="overwrite", partition_overwrite_mode="dynamic",
                             replace_where="day = 'd1'"), "give either replaceWhere"),
        # An append that names the dynamic mode most likely forgot mode overwrite.
        (lambda: table.write(batch([0], 1, "n"), partition_overwrite_mode="dynamic"),
         "partitionOverwriteMode=dynamic goes with mode overwrite"),
        (lambda: table.write(batch([0], 1, "n").select(["day"]), operation="delete_partition",
                             partition_overwrite_mode="dynamic"), "partitionOverwriteMode=dynamic goes with mode"),
        (lambda: flat.write(batch([0], 1, "n"), mode="overwrite", replace_where="day = 'd1'"),
         "no partition columns, so replaceWhere"),
    ]:
        with pytest.raises(nbcc.InvalidOptionError, match=problem):
            call()
    assert table.timeline() == [] and flat.timeline() == []


@pytest.mark.parametrize("text, expected", [
    ("day >= '2026-11-01' AND day < '2026-11-08'", [("day", ">=", "2026-11-01"), ("day", "<", "2026-11-08")]),
    ("day BETWEEN DATE '2026-11-01' AND DATE '2026-11-07'", [("day", ">=", "2026-11-01"), ("day", "<=", "2026-11-07")]),
    ("region IN ('eu', 'us')", [("region", "in", ["eu", "us"])]),
    ("(kind != 'by date') and `p` NOT IN ('date', 'it''s')", [("kind", "!=", "by date"), ("p", "not_in", ["date", "it's"])]),
    ("p <> 'q between a and b'", [("p", "!=", "q between a and b")]),
    ("d IS NULL AND\n flag = TRUE", [("d", "is_null"), ("flag", "=", "TRUE")]),
    ("`order date` >= '2026-11-01' AND `it's ``x``` IN ('a')", [("order date", ">=", "2026-11-01"),
                                                             ("it's `x`", "in", ["a"])]),
])
def test_replace_where_text_is_read_as_sql_reads_it(text, expected):
    assert parse_predicate(text) == expected
