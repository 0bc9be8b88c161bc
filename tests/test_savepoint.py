"""Savepoints (format.md §14.6): a state kept readable with as_of and restore whatever the
cleaner's window, until the savepoint is deleted; and a savepoint racing a clean, either way
round, never ends up kept with files missing."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pytest

import nbcc
from faults import Faults, Stall, faulty_table, in_thread
from nbcc.timeline import read_commit_metadata

SCHEMA = pa.schema([pa.field("id", pa.int64(), nullable=False), pa.field("p", pa.string()), pa.field("v", pa.int64())])
WAIT_S = 30


def write(table: nbcc.Table, version: int, ids=range(6)) -> str:
    ids = list(ids)
    return table.write(pa.table({"id": ids, "p": [f"p{i % 2}" for i in ids], "v": [version] * len(ids)},
                                schema=SCHEMA))


def rows(table: nbcc.Table, **read) -> list[tuple[int, int]]:
    return sorted((r["id"], r["v"]) for r in table.read(**read).to_pylist())


def completion(table: nbcc.Table, instant: str) -> str:
    return next(i.completion for i in table.timeline() if i.instant == instant)


def completion_of_file(table: nbcc.Table, path: str) -> str:
    """The completion time of the instant that wrote a data file ('' if none completed)."""
    done = {i.instant: i.completion for i in table.timeline() if i.completion}
    return next((c for i, c in done.items() if i in Path(path).name), "")


def data_files(uri: str) -> set[str]:
    return {str(f) for f in Path(uri).rglob("*") if f.is_file() and ".nbcc" not in f.parts}


def new_table(uri: str, **options) -> nbcc.Table:
    return nbcc.Table.create(uri, SCHEMA, "id", partition_by="p", buckets=2, **options)


@pytest.mark.parametrize("metadata_table", [False, True])
def test_a_savepoint_keeps_its_state_readable_through_compaction_cleaning_and_archival(tmp_path, metadata_table):
    uri = str(tmp_path / "t")
    table = new_table(uri)
    if metadata_table:
        table.build_index()
    first = completion(table, write(table, 0))
    month_end = completion(table, write(table, 1, ids=range(3)))
    expected = [(0, 1), (1, 1), (2, 1), (3, 0), (4, 0), (5, 0)]
    assert table.savepoint(user_metadata="month end") == month_end  # the latest state: its last completion
    assert json.loads(Path(uri, ".nbcc", "table.json").read_text())["format_version"] == 5  # older nbcc refuses it
    for version in range(2, 6):
        write(table, version)
        table.compact()
    table.clean(retain_commits=1)
    table.archive(retain_commits=1)
    assert [i for i in table.timeline() if i.archived]  # the savepoint's commits are in the history now
    # Every time whose state is the savepoint's reads it; the state before it, and after it
    # until the window, are gone as any state before the window.
    next_completion = min(i.completion for i in table.timeline() if i.completion and i.completion > month_end)
    for when in (month_end, str(int(next_completion) - 1)):
        assert rows(table, as_of=when) == expected
    for gone in (first, next_completion):
        with pytest.raises(nbcc.InvalidOptionError, match="before the oldest state that can be read.*or a "
                                                          r"savepoint \(nbcc savepoints\)"):
            table.read(as_of=gone)
    assert [(s["as_of"], s["user_metadata"]) for s in table.savepoints()] == [(month_end, "month end")]
    assert table.describe()["savepoints"] == [month_end]
    # A read as of it that finds a file missing fails, with the metadata table too (which
    # forgets the files cleans delete): it never returns fewer rows.
    [one] = [f for f in sorted(data_files(uri)) if completion_of_file(table, f) <= month_end][:1]
    moved = Path(one).rename(Path(one).with_name("aside"))
    with pytest.raises(nbcc.DataFileError, match="is missing"):
        table.read(as_of=month_end)
    moved.rename(one)
    # Restore takes it too; a clean after the restore still keeps it.
    table.restore(month_end)
    assert rows(table) == expected
    table.clean(retain_commits=1)
    assert rows(table, as_of=month_end) == expected
    # Deleted: the next clean deletes the files only it kept, and the time is refused again.
    before = data_files(uri)
    assert table.delete_savepoint(month_end) and not table.delete_savepoint(month_end)
    table.clean(retain_commits=1)
    assert data_files(uri) < before
    with pytest.raises(nbcc.InvalidOptionError, match="before the oldest state that can be read"):
        table.read(as_of=month_end)
    assert table.savepoints() == [] and rows(table) == expected


def test_a_savepoint_of_a_past_time_keeps_the_state_then_and_making_it_again_returns_it(tmp_path):
    table = new_table(str(tmp_path / "t"))
    write(table, 0)
    c0 = completion(table, table.compact())  # a state with base files: read-optimized reads them
    c1 = completion(table, write(table, 1))
    write(table, 2)
    table.compact()
    between = str(int(c1) - 1)  # after c0, before c1: the state as of c0
    assert table.savepoint(as_of=between) == c0
    assert table.savepoint(as_of=c0) == c0 and len(table.savepoints()) == 1  # found, not made again
    table.clean(retain_commits=1)
    assert rows(table, as_of=between) == [(i, 0) for i in range(6)]
    # Its note can change when the state is before the window: the files it keeps let it be made again.
    assert table.savepoint(as_of=c0, user_metadata="audit") == c0
    assert [(s["as_of"], s.get("user_metadata")) for s in table.savepoints()] == [(c0, "audit")]
    table.clean(retain_commits=1)
    assert rows(table, as_of=between, query_type="read_optimized") == [(i, 0) for i in range(6)]
    with pytest.raises(nbcc.InvalidOptionError, match="before the oldest state"):
        table.read(as_of=c1)


def test_a_savepoint_is_refused_where_there_is_no_state_to_keep(tmp_path):
    table = new_table(str(tmp_path / "t"))
    table.build_index("files")  # an instant completes, but no commit: still no state to keep
    with pytest.raises(nbcc.InvalidOptionError, match="the table has no commits yet: there is no state to keep"):
        table.savepoint()
    c0 = completion(table, write(table, 0))
    with pytest.raises(nbcc.InvalidOptionError, match=r"no commit had completed by then \(the first completed at"):
        table.savepoint(as_of="2020-01-01")
    for version in range(1, 4):
        write(table, version)
    table.clean(retain_commits=1)
    with pytest.raises(nbcc.InvalidOptionError, match=rf"as_of={c0}: the state then \({c0}\) is before the window "
                                                      "the cleaner retained, .* Only a state within the window"):
        table.savepoint(as_of=c0)
    with pytest.raises(nbcc.InvalidOptionError, match="is not a time"):
        table.savepoint(as_of="yesterday")
    with pytest.raises(nbcc.InvalidOptionError, match="user_metadata must be text"):
        table.savepoint(user_metadata=5)
    assert table.savepoints() == []
    assert json.loads(Path(table.uri, ".nbcc", "table.json").read_text())["format_version"] == 1


@pytest.fixture
def aged(local_table) -> tuple[str, nbcc.Table, str]:
    """A table whose first state (its time returned) a clean retaining 1 commit would delete."""
    uri, _ = local_table
    table = new_table(uri)
    state = completion(table, write(table, 0))
    superseded(table)
    return uri, table, state


def superseded(table: nbcc.Table) -> None:
    """More commits and a compaction: a clean retaining 1 commit plans to delete the files so far."""
    for version in range(1, 3):
        write(table, version)
    table.compact()
    write(table, 3)


def test_a_savepoint_made_while_a_clean_plans_keeps_its_files(aged):
    # The clean listed the savepoints before this one existed; it finds it after publishing its
    # plan, before deleting, and keeps its files (recorded as kept).
    uri, table, kept_state = aged
    stall = Stall()
    cleaner = faulty_table(table, Faults().plan("put", stall, where=r"\.clean\.requested$"))
    thread, out = in_thread(lambda: cleaner.clean(retain_commits=1))
    assert stall.entered.wait(WAIT_S)
    assert table.savepoint(as_of=kept_state) == kept_state  # the clean's plan is not published yet
    stall.release()
    thread.join(WAIT_S)
    assert "error" not in out, out
    done = read_commit_metadata(table.storage, table.timeline()[-1])
    assert done["action"] == "clean" and done["savepoints"] == [] and done["kept"]
    assert table.history(limit=1)[0].parameters["kept_for_new_savepoints"] == len(done["kept"])
    assert rows(table, as_of=kept_state) == [(i, 0) for i in range(6)]
    assert table.savepoint(as_of=kept_state, user_metadata="audit") == kept_state  # a new note, before the window
    assert [s.get("user_metadata") for s in table.savepoints()] == ["audit"]
    superseded(table)
    table.clean(retain_commits=1)  # the next clean plans with it
    assert rows(table, as_of=kept_state) == [(i, 0) for i in range(6)]
    assert table.history(limit=1)[0].parameters["savepoints"] == [kept_state]


def test_a_savepoint_that_a_clean_published_meanwhile_is_deleting_is_refused_and_not_kept(aged):
    # The savepoint's pending file lands after the clean published its plan (which lacks it)
    # and listed the savepoints: the maker finds the clean, deletes its pending file and says so.
    uri, table, old_state = aged
    put_savepoint, delete_files = Stall(), Stall()
    saver = faulty_table(table, Faults().plan("put", put_savepoint, where=r"/savepoints/"))
    saving, saved = in_thread(lambda: saver.savepoint(as_of=old_state))
    assert put_savepoint.entered.wait(WAIT_S)  # its checks passed: no clean yet
    cleaner = faulty_table(table, Faults().plan("delete", delete_files, where=r"/p=p\d/"))
    cleaning, cleaned = in_thread(lambda: cleaner.clean(retain_commits=1))
    assert delete_files.entered.wait(WAIT_S)  # plan published, savepoints listed, deleting
    put_savepoint.release()
    saving.join(WAIT_S)
    assert isinstance(saved.get("error"), nbcc.CommitError), saved
    assert "planned to delete files of the state as of" in str(saved["error"])
    assert table.savepoints() == [] and not list(Path(uri, ".nbcc", "savepoints").iterdir())
    delete_files.release()
    cleaning.join(WAIT_S)
    assert "error" not in cleaned, cleaned
    with pytest.raises(nbcc.InvalidOptionError, match="before the oldest state"):
        table.read(as_of=old_state)


def test_two_makers_of_one_savepoint_each_get_their_own_verdict(aged):
    # A's check runs after a clean that planned without the savepoint published its plan: A is
    # refused. B's check ran before that plan landed, so that clean found B's savepoint and kept
    # its files: B's savepoint stands, whatever A's refusal did.
    uri, table, state = aged
    plan_put, a_check = Stall(), Stall()
    cleaner = faulty_table(table, Faults().plan("put", plan_put, where=r"\.clean\.requested$"))
    cleaning, cleaned = in_thread(lambda: cleaner.clean(retain_commits=1))
    assert plan_put.entered.wait(WAIT_S)  # planned, with no savepoint
    maker_a = faulty_table(table, Faults().plan("list", None, a_check, where=r"/\.nbcc/timeline$"))
    making, made = in_thread(lambda: maker_a.savepoint(as_of=state, user_metadata="a"))
    assert a_check.entered.wait(WAIT_S)  # A's pending file is written; its check waits
    assert table.savepoint(as_of=state, user_metadata="b") == state  # B
    plan_put.release()
    cleaning.join(WAIT_S)
    assert "error" not in cleaned, cleaned
    a_check.release()
    making.join(WAIT_S)
    assert isinstance(made.get("error"), nbcc.CommitError), made
    assert [(s["as_of"], s["user_metadata"], s["confirmed"]) for s in table.savepoints()] == [(state, "b", True)]
    table.clean(retain_commits=1)
    assert rows(table, as_of=state) == [(i, 0) for i in range(6)]


def test_a_savepoint_whose_check_fails_is_not_kept_and_one_left_pending_only_makes_cleans_keep_more(aged):
    uri, table, state = aged
    lost = [ConnectionResetError(104, "injected: connection reset")] * 3  # every attempt of the storage call
    # The check cannot list the timeline: the error says so, and no savepoint is left.
    failing = faulty_table(table, Faults().plan("list", None, *lost, where=r"/\.nbcc/timeline$"))
    with pytest.raises(nbcc.StorageError, match="connection reset"):
        failing.savepoint(as_of=state)
    assert table.savepoints() == []
    # A maker cut short after its check, before it could confirm or tidy up (as a crash would):
    # its pending file is listed as such; reads before the window do not trust it, cleans keep
    # its state's files until it is deleted.
    cut = faulty_table(table, Faults().plan("put", None, *lost, where=r"/savepoints/"))
    with pytest.raises(nbcc.StorageError, match="may or may not have been made .* its pending file stays"):
        cut.savepoint(as_of=state)
    assert [(s["as_of"], s["confirmed"]) for s in table.savepoints()] == [(state, False)]
    assert table.describe()["savepoints"] == []
    table.clean(retain_commits=1)
    with pytest.raises(nbcc.InvalidOptionError, match="before the oldest state"):
        table.read(as_of=state)
    assert table.savepoint(as_of=state) == state  # made again: the files are all there, and it is checked
    assert rows(table, as_of=state) == [(i, 0) for i in range(6)]
    before = data_files(uri)
    assert table.delete_savepoint(state)  # the made one; the pending file of the cut maker stays
    assert [(s["as_of"], s["confirmed"]) for s in table.savepoints()] == [(state, False)]
    assert table.delete_savepoint(state, pending=True) and table.savepoints() == []
    table.clean(retain_commits=1)
    assert data_files(uri) < before


def test_deleting_a_savepoint_while_it_is_made_leaves_the_maker_kept(aged):
    # The maker's pending file keeps the state from before its check until its savepoint is
    # made: a delete of the savepoint meanwhile does not take it away.
    uri, table, state = aged
    check = Stall()
    maker = faulty_table(table, Faults().plan("list", None, check, where=r"/\.nbcc/timeline$"))  # its check's listing
    making, made = in_thread(lambda: maker.savepoint(as_of=state, user_metadata="m"))
    assert check.entered.wait(WAIT_S)
    assert not table.delete_savepoint(state)  # no savepoint made yet; the pending file is the maker's
    table.clean(retain_commits=1)
    check.release()
    making.join(WAIT_S)
    assert made.get("value") == state, made
    assert rows(table, as_of=state) == [(i, 0) for i in range(6)]


def test_spark_reads_a_savepoint_with_as_of(spark, local_table):
    uri, _ = local_table
    table = new_table(uri)
    state = completion(table, write(table, 0))
    table.savepoint()
    for version in range(1, 4):
        write(table, version)
    table.clean(retain_commits=1)
    got = spark.read.format("nbcc").option("as_of", state).load(uri).select("id", "v").collect()
    assert sorted((r.id, r.v) for r in got) == [(i, 0) for i in range(6)]
