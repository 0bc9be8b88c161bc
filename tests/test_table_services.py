"""Table services that never block writers, driven through the Python API and real OS processes:
compaction killed part-way and re-run, two executions of one plan, lazy rollback of failed
writes (and never of live or completed ones), cleaning, timeline archival, and crashes of the
cleaner and the archiver.

Every expected value comes from the test's own bookkeeping (`Ref`: the rows it handed to the
writers; `data_files`: what it sees on disk), never from the code under test. Crashes are made
deterministic: the child process patches one step of the service to signal through a file and
hang there, and the test SIGKILLs it once the signal exists.
"""

from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path
from typing import Any, Iterable

import pyarrow as pa
import pytest

import nbcc
from children import Children
from nbcc.writer import prepare

SCHEMA = pa.schema([("id", pa.int64()), ("part", pa.string()), ("ts", pa.int64()), ("v", pa.string())])
COLUMNS = SCHEMA.names
HEARTBEAT_TIMEOUT_S = 2
WAIT_S = 60  # deadline for anything a child or an expiring heartbeat must do


# -- bookkeeping -------------------------------------------------------------------------------

def part_of(key: int) -> str:
    """Each key lives in one partition for ever (its record is (part, id))."""
    return "a" if key % 2 else "b"


class Ref:
    """The rows the test wrote: each key's latest row (ts grows with every batch, so the latest
    batch wins), the state after each commit, and which keys each commit changed."""

    def __init__(self) -> None:
        self.rows: dict[int, dict[str, Any]] = {}
        self.ts = 0

    def batch(self, keys: Iterable[int], tag: str, part=part_of) -> tuple[pa.Table, list[dict[str, Any]]]:
        self.ts += 1
        rows = [{"id": k, "part": part(k), "ts": self.ts, "v": f"{tag}-{k}"} for k in keys]
        return pa.Table.from_pylist(rows, schema=SCHEMA), rows

    def apply(self, rows: list[dict[str, Any]]) -> None:
        for r in rows:
            self.rows[r["id"]] = r

    def expected(self, keys: Iterable[int] | None = None) -> list[dict[str, Any]]:
        wanted = sorted(self.rows) if keys is None else sorted(set(keys))
        return [self.rows[k] for k in wanted]

    def write(self, table: nbcc.Table, keys: Iterable[int], tag: str, write_options: dict[str, Any] | None = None,
              **kw) -> str:
        data, rows = self.batch(keys, tag, **kw)
        instant = table.write(data, **(write_options or {}))
        self.apply(rows)
        return instant


def rows_of(result: pa.Table) -> list[dict[str, Any]]:
    got = sorted(result.select(COLUMNS).to_pylist(), key=lambda r: r["id"])
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids)), f"duplicate keys in a read: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    return got


def snapshot(table: nbcc.Table, **kw) -> list[dict[str, Any]]:
    return rows_of(table.read(**kw))


def completion_of(table: nbcc.Table, instant: str) -> str:
    found = [i for i in table.timeline() if i.instant == instant]
    assert len(found) == 1 and found[0].completion, (instant, found)
    return found[0].completion


def timeline_tuples(table: nbcc.Table) -> list[tuple]:
    return [(i.instant, i.action, i.state, i.completion) for i in table.timeline()]


def data_files(uri: str) -> set[str]:
    """Every data file under the table (partition/name), found by walking the folders."""
    root = Path(uri)
    out = set()
    for p in root.rglob("*"):
        rel = p.relative_to(root)
        if p.is_file() and rel.parts[0] != ".nbcc" and not p.name.startswith("."):
            out.add(str(rel))
    return out


def files_of_instant(files: Iterable[str], instant: str) -> set[str]:
    """Data files an instant wrote: its log files, or (a compaction's) base files."""
    return {f for f in files if f"_{instant}.log." in f or f.endswith(f"_{instant}.parquet")}


def active_timeline_files(uri: str) -> list[str]:
    return sorted(n for n in os.listdir(Path(uri) / ".nbcc" / "timeline") if not n.startswith("."))


def new_table(uri: str, **kw) -> nbcc.Table:
    kw.setdefault("buckets", 2)
    kw.setdefault("heartbeat_timeout_s", HEARTBEAT_TIMEOUT_S)
    return nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", partition_by="part", **kw)


def table_with_rows(uri: str, **kw) -> tuple[nbcc.Table, Ref]:
    """A new table (new_table's) and its reference, after one commit of KEYS."""
    table = new_table(uri, **kw)
    ref = Ref()
    ref.write(table, KEYS, "c0")
    return table, ref


# -- child processes ---------------------------------------------------------------------------

# Shared by the child scripts: write JSON to a file atomically (the parent polls for it).
PRELUDE = """
import json, sys, time
from pathlib import Path
import pyarrow as pa
import nbcc

def report(path, obj):
    tmp = Path(str(path) + ".tmp")
    tmp.write_text(json.dumps(obj))
    tmp.rename(path)

def hang():
    while True:
        time.sleep(60)
"""

# Schedules a compaction and runs it, but stalls for ever after the second file group's base
# file is written (before the compaction completes), telling the parent so.
KILLED_COMPACTION = PRELUDE + """
import nbcc.compaction as compaction
uri, signal_file = sys.argv[1], sys.argv[2]
table = nbcc.Table.open(uri)
tc = table.schedule_compaction()
real = compaction.compact_file_group
written = []

def stalling(*args, **kwargs):
    out = real(*args, **kwargs)
    written.append(out["partition"] + "/" + out["name"])
    if len(written) == 2:
        report(signal_file, {"tc": tc, "written": written})
        hang()
    return out

compaction.compact_file_group = stalling
table.run_compaction(tc, parallelism=1)  # one file group after the other: exactly two written
sys.exit("the compaction completed although it was meant to stall")
"""

# Executes compaction argv[2]; after its first file group it waits until the other execution
# got that far too, so that the two really run at once. Reports its result or its error.
CONCURRENT_COMPACTION = PRELUDE + """
import nbcc.compaction as compaction
uri, tc, me, work = sys.argv[1], sys.argv[2], sys.argv[3], Path(sys.argv[4])
table = nbcc.Table.open(uri)
real = compaction.compact_file_group
calls = []

def gated(*args, **kwargs):
    out = real(*args, **kwargs)
    calls.append(out)
    if len(calls) == 1:
        (work / f"ready-{me}").write_text("ready")
        deadline = time.monotonic() + 60
        while not all((work / f"ready-{i}").exists() for i in ("0", "1")):
            if time.monotonic() > deadline:
                sys.exit("the other execution never started")
            time.sleep(0.005)
    return out

compaction.compact_file_group = gated
try:
    result = {"completion": table.run_compaction(tc)}
except nbcc.NbccError as exc:
    result = {"error": type(exc).__name__ + ": " + str(exc)}
report(work / f"result-{me}.json", result)
"""

# A writer that starts a write, writes its files and keeps its heartbeat alive, never committing.
LIVE_WRITER = PRELUDE + """
from nbcc.heartbeat import Heartbeat
from nbcc.writer import prepare
uri, signal_file, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
schema = pa.schema([("id", pa.int64()), ("part", pa.string()), ("ts", pa.int64()), ("v", pa.string())])
table = nbcc.Table.open(uri)
data = pa.Table.from_pylist(rows, schema=schema)
txn = table.begin_write(data.schema)
with Heartbeat(table.storage, txn.instant, interval_s=0.3):
    writer = table.log_writer(txn, "0-0-0")
    writer.write(prepare(data, table.config, txn.schema, "upsert"))
    files = writer.close()
    report(signal_file, {"instant": txn.instant, "files": [f["partition"] + "/" + f["name"] for f in files]})
    hang()
"""

# Runs archive (argv[3] = retain_commits) or clean, letting only argv[4] deletes of the given
# kind through before stalling for ever (the history file / the clean plan is already written).
KILLED_SERVICE = PRELUDE + """
import nbcc.storage as storage
uri, signal_file, service, retain, allowed = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
table = nbcc.Table.open(uri)
real_delete = storage.Storage.delete
deleted = []

def delete(self, rel):
    watched = rel.startswith(".nbcc/timeline/") if service == "archive" else not rel.startswith(".nbcc/")
    if watched:
        if len(deleted) >= allowed:
            report(signal_file, {"deleted": deleted})
            hang()
        deleted.append(rel)
    return real_delete(self, rel)

storage.Storage.delete = delete
if service == "archive":
    table.archive(retain_commits=retain)
else:
    table.clean(retain_commits=retain)
sys.exit(service + " finished although it was meant to stall")
"""

# A fresh process's view of the table: snapshot, timeline, and reads as of the given times.
FRESH_VIEW = PRELUDE + """
uri, out, times = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
compact = len(sys.argv) > 4 and sys.argv[4] == "compact"
table = nbcc.Table.open(uri)
result = {}
if compact:
    result["compaction"] = table.compact()
def rows(t):
    return sorted(t.select(["id", "part", "ts", "v"]).to_pylist(), key=lambda r: r["id"])
result["snapshot"] = rows(table.read())
result["timeline"] = [[i.instant, i.action, i.state, i.completion] for i in table.timeline()]
result["as_of"] = {t: rows(table.read(as_of=t)) for t in times}
report(out, result)
"""


def fresh_view(children: Children, uri: str, times: list[str], compact: bool = False) -> dict[str, Any]:
    out = children.work / f"view-{len(children.procs)}.json"
    proc = children.start(FRESH_VIEW, uri, str(out), json.dumps(times), *(["compact"] if compact else []))
    children.finish(proc)
    return json.loads(out.read_text())


KEYS = list(range(40))  # 20 per partition: every file group of 2 partitions x 2 buckets


# -- 1. compaction killed part-way, then re-run -----------------------------------------------

def test_compaction_killed_part_way_is_pending_harmless_and_finished_by_a_rerun(local_table, children):
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    for n in range(3):
        ref.write(table, KEYS[n::2] + KEYS[:10], f"c{n}")
    before = ref.expected()
    files_before = data_files(uri)
    assert snapshot(table) == before

    proc = children.start(KILLED_COMPACTION, uri, str(children.work / "stalled.json"))
    info = children.wait_for(children.work / "stalled.json", proc)
    children.kill(proc)
    tc = info["tc"]

    # The killed run left base files of tc behind: the orphans.
    orphans = data_files(uri) - files_before
    assert orphans == set(info["written"]) and len(orphans) == 2
    assert all(f.endswith(f"_{tc}.parquet") for f in orphans)
    # No read may ever open them: make them unreadable, and any read that did would fail.
    for f in orphans:
        (Path(uri) / f).write_bytes(b"not parquet: an orphan of a killed compaction")

    # The compaction is pending; reads are unchanged.
    assert table.pending_compactions() == [tc]
    entry = [i for i in table.timeline() if i.instant == tc]
    assert len(entry) == 1 and entry[0].state in ("requested", "inflight") and entry[0].completion is None
    assert snapshot(table) == before
    assert snapshot(table, query_type="read_optimized") == []  # no base file completed yet

    # Writers keep writing while it is pending.
    late = ref.write(table, [0, 1, 2, 3, 40, 41], "late")
    after_late = ref.expected()
    assert snapshot(table) == after_late
    assert nbcc.Table.open(uri).pending_compactions() == [tc]

    # Re-running finishes it: nothing lost, nothing duplicated, the late write kept.
    completion = table.run_compaction(tc)
    assert completion is not None and completion > tc
    assert table.pending_compactions() == []
    done = [i for i in table.timeline() if i.instant == tc]
    assert [(i.action, i.state, i.completion) for i in done] == [("commit", "completed", completion)]
    assert snapshot(table) == after_late
    assert snapshot(table, query_type="read_optimized") == before  # the base files hold the state at tc
    assert snapshot(table, as_of=completion) == after_late
    assert snapshot(table, as_of=completion_of(table, late)) == after_late
    new_bases = files_of_instant(data_files(uri), tc) - orphans
    assert new_bases and len(new_bases) == len({f.split("_")[0] for f in new_bases})  # one per file group
    run_again_is_noop(table, tc)

    # The cleaner removes the orphans of the killed run and nothing that a read needs.
    on_disk = data_files(uri)
    table.clean()
    assert data_files(uri) & orphans == set(), "the killed run's base files are still on disk"
    assert data_files(uri) == on_disk - orphans
    assert snapshot(table) == after_late
    assert snapshot(table, query_type="read_optimized") == before


def run_again_is_noop(table: nbcc.Table, tc: str) -> None:
    files, timeline = data_files(table.uri), timeline_tuples(table)
    assert table.run_compaction(tc) is None  # already completed: nothing to do
    assert data_files(table.uri) == files and timeline_tuples(table) == timeline


# -- 2. two processes executing the same plan at once -----------------------------------------

def test_two_processes_running_one_compaction_plan_at_once_cannot_corrupt_the_table(local_table, children):
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    for n in range(3):
        ref.write(table, KEYS[n::3] + [n, 39 - n], f"c{n}")
    expected = ref.expected()
    files_before = data_files(uri)
    tc = table.schedule_compaction()
    assert tc is not None and table.pending_compactions() == [tc]

    procs = [children.start(CONCURRENT_COMPACTION, uri, tc, str(me), str(children.work)) for me in (0, 1)]
    for proc in procs:
        children.finish(proc)
    results = [json.loads((children.work / f"result-{me}.json").read_text()) for me in (0, 1)]

    completions = [r["completion"] for r in results if r.get("completion")]
    assert len(completions) == 1, f"exactly one execution completes the compaction: {results}"
    for r in results:  # the other one returns None, or fails cleanly naming the completed instant
        if not r.get("completion"):
            assert r == {"completion": None} or ("CommitError" in r["error"] and tc in r["error"]), results
    assert table.pending_compactions() == []
    entries = [i for i in table.timeline() if i.instant == tc]
    assert [(i.state, i.completion) for i in entries] == [("completed", completions[0])]

    # Both executions wrote base files (different names); the table reads as one compaction.
    bases = files_of_instant(data_files(uri), tc)
    groups = {f.split("_")[0] for f in bases}
    assert len(bases) == 2 * len(groups), f"each execution writes one base file per file group: {sorted(bases)}"
    assert snapshot(table) == expected
    assert snapshot(table, query_type="read_optimized") == expected
    for slice_ in table.file_slices():
        assert slice_.base_file is not None and slice_.base_file.endswith(f"_{tc}.parquet") and not slice_.log_files
    assert snapshot(nbcc.Table.open(uri)) == expected

    # Writing and compacting go on as usual; the loser's files are orphans the cleaner removes.
    on_disk = data_files(uri)
    after = ref.write(table, [5, 6, 7], "after")
    after_files = data_files(uri) - on_disk
    assert snapshot(table) == ref.expected()
    table.clean(retain_commits=1)
    # The window starts at the last commit, after the compaction: the old logs and the losing
    # execution's base files are gone; one base file per group stays, with the new logs.
    remaining_bases = files_of_instant(data_files(uri), tc)
    assert remaining_bases < bases and len(remaining_bases) == len(groups), sorted(remaining_bases)
    assert data_files(uri) == remaining_bases | after_files
    assert data_files(uri).isdisjoint(files_before)
    assert after_files == files_of_instant(after_files, after)
    assert snapshot(table) == ref.expected()
    assert table.compact() is not None
    assert snapshot(table) == ref.expected()


# -- 3. lazy rollback of failed writes ---------------------------------------------------------

def test_a_live_writer_is_never_rolled_back_and_a_killed_one_is_once_its_heartbeat_expires(local_table, children):
    uri, _ = local_table
    # The live child beats every 0.3 s: a timeout of 6 s leaves room for a child starved of CPU
    # for seconds on a loaded machine, which must not pass for a dead one.
    timeout_s = 6
    table, ref = table_with_rows(uri, heartbeat_timeout_s=timeout_s)
    expected = ref.expected()
    _, pending_rows = ref.batch([0, 1, 2, 3, 100, 101], "never")  # 100, 101: keys no commit has

    proc = children.start(LIVE_WRITER, uri, str(children.work / "writing.json"), json.dumps(pending_rows))
    info = children.wait_for(children.work / "writing.json", proc)
    instant = info["instant"]
    written = files_of_instant(data_files(uri), instant)
    assert written == set(info["files"]) and len(written) >= 2  # files in both partitions

    # Alive (heartbeat refreshed): not rolled back, though it has been going for longer than the
    # timeout, by neither the rollback nor the cleaner.
    alive_until = time.monotonic() + 1.5 * timeout_s
    while time.monotonic() < alive_until:
        assert table.rollback_failed_writes() == []
        assert table.clean()["rolled_back"] == []
        time.sleep(0.25)
    assert proc.poll() is None
    assert [i.state for i in table.timeline() if i.instant == instant] in (["inflight"], ["requested"])
    assert files_of_instant(data_files(uri), instant) == written
    assert snapshot(table) == expected

    # Killed: rolled back once its heartbeat has expired (and not twice).
    children.kill(proc)
    deadline = time.monotonic() + WAIT_S
    rolled: list[str] = []
    while not rolled:
        assert time.monotonic() < deadline, "the killed writer was never rolled back"
        time.sleep(0.2)
        rolled = table.rollback_failed_writes()
    assert rolled == [instant]
    assert files_of_instant(data_files(uri), instant) == set(), "a rolled-back write's files must be deleted"
    assert [(i.action, i.state, i.completion) for i in table.timeline() if i.instant == instant] == \
        [("deltacommit", "rolledback", None)]
    assert snapshot(table) == expected

    files, timeline = data_files(uri), timeline_tuples(table)
    assert table.rollback_failed_writes() == []
    assert table.clean()["rolled_back"] == []
    assert table.rollback(instant) is True  # already rolled back: stays so, nothing else happens
    assert data_files(uri) == files and timeline_tuples(table) == timeline
    assert snapshot(nbcc.Table.open(uri)) == expected

    # The table goes on.
    ref.write(table, [0, 100], "next")
    assert snapshot(table) == ref.expected()


def _open_write(table: nbcc.Table, ref: Ref, keys: list[int], tag: str):
    data, rows = ref.batch(keys, tag)
    txn = table.begin_write(data.schema)
    writer = table.log_writer(txn, "0-0-0")
    writer.write(prepare(data, table.config, txn.schema, "upsert"))
    return txn, writer.close(), rows


def test_an_instant_that_just_completed_is_never_rolled_back(local_table, monkeypatch):
    """HUDI-5675: re-read the timeline before rolling back; a completed write is not failed."""
    uri, _ = local_table
    table, ref = table_with_rows(uri)

    # Rolling back a completed instant on request: refused.
    data, rows = ref.batch([1, 2, 50], "done")
    instant = table.write(data)
    ref.apply(rows)
    assert table.rollback(instant) is False
    assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]
    assert snapshot(table) == ref.expected()

    # The race: the cleaner lists the write as failed (no heartbeat for longer than the timeout),
    # and the write completes right after that listing, before the rollback acts.
    import nbcc.rollback as rollback

    txn, files, rows = _open_write(table, ref, [3, 4, 51], "racing")
    time.sleep(0.05)
    real = rollback.failed_writes
    seen: list[list[str]] = []

    def listing_then_commit(*args, **kwargs):
        out = real(*args, **kwargs)
        seen.append([f.instant for f in out])
        if len(seen) == 1:
            txn.commit(files)
            ref.apply(rows)
        return out

    monkeypatch.setattr(rollback, "failed_writes", listing_then_commit)
    assert table.rollback_failed_writes(heartbeat_timeout_s=0.001) == []
    assert seen[0] == [txn.instant], "the stale listing did see the write as failed"
    monkeypatch.undo()
    assert [i.state for i in table.timeline() if i.instant == txn.instant] == ["completed"]
    assert files_of_instant(data_files(uri), txn.instant) == {f"{f['partition']}/{f['name']}" for f in files}
    assert snapshot(table) == ref.expected()
    assert table.rollback_failed_writes(heartbeat_timeout_s=0.001) == []
    assert snapshot(nbcc.Table.open(uri)) == ref.expected()


def _assert_rolled_back(table: nbcc.Table, txn, expected: list[dict[str, Any]]) -> None:
    """`txn`'s instant is rolled back, its files are gone, and a fresh reader sees `expected`."""
    assert [i.state for i in table.timeline() if i.instant == txn.instant] == ["rolledback"]
    assert files_of_instant(data_files(table.uri), txn.instant) == set()
    assert snapshot(nbcc.Table.open(table.uri)) == expected


def test_a_slow_writer_rolled_back_after_its_heartbeat_expired_cannot_commit(local_table):
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    expected = ref.expected()

    txn, files, _ = _open_write(table, ref, [0, 1, 2, 60, 61], "slow")  # no heartbeat after begin
    assert files_of_instant(data_files(uri), txn.instant)
    deadline = time.monotonic() + WAIT_S
    rolled: list[str] = []
    while not rolled:
        assert time.monotonic() < deadline, "the expired write was never rolled back"
        time.sleep(0.2)
        rolled = table.rollback_failed_writes()
    assert rolled == [txn.instant]

    with pytest.raises(nbcc.CommitError, match=r"was rolled back: heartbeat expired \(\d+ s without one"):
        txn.commit(files)
    _assert_rolled_back(table, txn, expected)
    assert snapshot(table) == expected
    # Writing the data again works.
    ref.write(table, [0, 1, 2, 60, 61], "again")
    assert snapshot(table) == ref.expected()



def test_a_writer_whose_write_was_rolled_back_by_hand_is_told_so(local_table):
    # The error said "its heartbeat expired, or its job aborted" whatever the cause; it now
    # quotes the reason the rollback mark records, and says that much when the mark is unreadable.
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    expected = ref.expected()
    txn, files, _ = _open_write(table, ref, [0, 1, 70], "manual")
    assert table.rollback(txn.instant) is True
    with pytest.raises(nbcc.CommitError) as err:
        txn.commit(files)
    assert str(err.value) == (f"instant {txn.instant} was rolled back: a manual rollback (`nbcc rollback` or "
                              "Table.rollback); its files are gone: write the data again")
    _assert_rolled_back(table, txn, expected)

    txn, files, _ = _open_write(table, ref, [2, 71], "unreadable mark")
    assert table.rollback(txn.instant) is True
    [mark] = (Path(uri) / ".nbcc" / "timeline").glob(f"{txn.instant}.*.rolledback")
    mark.write_bytes(b"{not json")
    with pytest.raises(nbcc.CommitError, match=r"was rolled back \(its heartbeat expired, or its job aborted\); "
                                               "its files are gone"):
        txn.commit(files)
    assert snapshot(nbcc.Table.open(uri)) == expected

def test_a_write_rolled_back_while_it_writes_its_files_is_told_so(local_table):
    # A cleaner that took a slow write for dead deleted the files it was still writing: its
    # writer failed on a vanished file (FileNotFoundError from fsync), not saying why.
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    expected = ref.expected()
    schema = SCHEMA
    n = 140_000  # more than the rows a write gathers before it writes them (writer.COALESCE_ROWS)
    rows = pa.table({"id": range(n), "part": ["p"] * n, "ts": [1] * n, "v": [f"value {i:>20}" for i in range(n)]},
                    schema=schema)

    def batches():
        yield from rows.to_batches(max_chunksize=10_000)
        [txn] = [i.instant for i in table.timeline() if i.state == "inflight"]
        assert files_of_instant(data_files(uri), txn), "no file was open yet"
        assert table.rollback(txn) is True  # its files are deleted while its writer still has them open
        yield from rows.slice(0, 100).to_batches()

    with pytest.raises(nbcc.CommitError) as err:
        table.write(pa.RecordBatchReader.from_batches(schema, batches()), max_log_file_bytes=1 << 20)
    assert str(err.value).endswith("was rolled back: a manual rollback (`nbcc rollback` or Table.rollback); its "
                                   "files are gone: write the data again")
    assert snapshot(nbcc.Table.open(uri)) == expected


# -- 4. cleaning -------------------------------------------------------------------------------

@pytest.mark.parametrize("after_plan", ["upserts", "overwrite"])
def test_clean_never_deletes_the_inputs_of_a_pending_compaction_plan(local_table, after_plan):
    """Hudi #19290. With an overwrite after the plan, no read needs the plan's inputs any more;
    the plan still does."""
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    for n in range(3):
        ref.write(table, KEYS[n::2], f"c{n}")
    plan_inputs = data_files(uri)
    tc = table.schedule_compaction()
    assert tc is not None
    if after_plan == "overwrite":
        ref.rows.clear()
        data, rows = ref.batch([200, 201, 202, 203], "overwrite")
        table.write(data, mode="overwrite")
        ref.apply(rows)
    for n in range(3):
        ref.write(table, [200 + n, 7, 8] if after_plan == "overwrite" else KEYS[n::4], f"d{n}")
    expected = ref.expected()

    table.clean(retain_commits=1)
    assert plan_inputs <= data_files(uri), f"clean deleted inputs of pending compaction {tc}: " \
        f"{sorted(plan_inputs - data_files(uri))}"
    assert table.pending_compactions() == [tc]
    assert snapshot(table) == expected

    assert table.run_compaction(tc) is not None
    assert snapshot(table) == expected
    assert snapshot(nbcc.Table.open(uri)) == expected
    table.clean(retain_commits=1)
    assert snapshot(table) == expected
    assert table.compact() is not None
    assert snapshot(table) == expected


def test_clean_keeps_time_travel_in_the_window_and_refuses_reads_before_it(local_table):
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    states: dict[str, list[dict[str, Any]]] = {}  # completion time -> expected state as of it
    changed: dict[str, list[int]] = {}  # data commit's completion -> keys it wrote
    files: dict[str, set[str]] = {}  # step -> data files it created
    order: list[str] = []  # completion times of data commits, in order

    def commit(name: str, keys: list[int]) -> None:
        on_disk = data_files(uri)
        instant = ref.write(table, keys, name)
        t = completion_of(table, instant)
        states[t], changed[t] = ref.expected(), keys
        files[name] = data_files(uri) - on_disk
        order.append(t)

    def compact(name: str) -> None:
        on_disk = data_files(uri)
        tc = table.compact()
        assert tc is not None
        states[completion_of(table, tc)] = ref.expected()
        files[name] = data_files(uri) - on_disk

    commit("c1", KEYS)
    commit("c2", KEYS[::3])
    commit("c3", KEYS[1::3])
    compact("k1")
    commit("c4", KEYS[2::3])
    commit("c5", KEYS[::5])
    compact("k2")
    commit("c6", KEYS[1::4])
    commit("c7", [0, 1, 2, 3, 40, 41])
    times = sorted(states)
    before = {t: snapshot(table, as_of=t) for t in times}
    assert before == states  # sanity: time travel works before cleaning

    result = table.clean(retain_commits=3)
    window = order[-3]  # completion of c5: the oldest of the last 3 data commits
    assert result["earliest_retained"] == window

    # Superseded slices' files are gone; everything a read in the window needs is kept.
    kept = files["k1"] | files["c4"] | files["c5"] | files["k2"] | files["c6"] | files["c7"]
    assert data_files(uri) == kept
    assert data_files(uri).isdisjoint(files["c1"] | files["c2"] | files["c3"])

    assert snapshot(table) == ref.expected()
    for t in times:
        if t >= window:
            assert snapshot(table, as_of=t) == before[t], f"as_of={t} changed by cleaning"
        else:
            with pytest.raises(nbcc.InvalidOptionError, match=window) as err:
                table.read(as_of=t)
            assert "as_of" in str(err.value)

    # Incremental: begin before the window is a clear error; inside it works.
    for begin in (order[2], order[0], "earliest"):
        with pytest.raises(nbcc.InvalidOptionError, match=window) as err:
            table.read(query_type="incremental", begin=begin)
        assert "begin" in str(err.value)
    c5, c6, c7 = order[-3:]
    assert snapshot(table, query_type="incremental", begin=c5) == ref.expected(changed[c6] + changed[c7])
    assert snapshot(table, query_type="incremental", begin=c6) == ref.expected(changed[c7])
    assert snapshot(table, query_type="incremental", begin=c5, end=c6) == \
        [r for r in states[c6] if r["id"] in set(changed[c6])]

    # Cleaning again with nothing new changes nothing.
    table.clean(retain_commits=3)
    assert data_files(uri) == kept
    assert {t: snapshot(table, as_of=t) for t in times if t >= window} == \
        {t: before[t] for t in times if t >= window}


def test_a_range_beginning_just_before_the_window_reads_the_oldest_retained_commit(local_table):
    # The window starts at the completion W of the oldest of the last N data commits. A range
    # beginning at W leaves that commit out; one beginning at the previous commit holds it, and
    # needs nothing the clean deleted when no instant with files completed in between.
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    c1 = completion_of(table, ref.write(table, KEYS[::2], "c1"))
    assert table.compact() is not None  # c0 and c1's files are superseded: the clean deletes them
    c2 = completion_of(table, ref.write(table, KEYS[::3], "c2"))
    c3 = completion_of(table, ref.write(table, KEYS[1::4], "c3"))
    ref.write(table, KEYS[::5], "c4")
    reads = {(fmt, begin): table.read(query_type="incremental", begin=begin, incremental_format=fmt)
             for fmt in ("latest_state", "cdc") for begin in (c2, c3)}
    assert {tuple(d) for d in table.clean(retain_commits=2)["deleted"]}  # W = c3
    assert table.read(query_type="incremental", begin=c2).num_rows == len(set(KEYS[1::4]) | set(KEYS[::5]))
    for (fmt, begin), before in reads.items():
        after = table.read(query_type="incremental", begin=begin, incremental_format=fmt)
        assert after.sort_by("id").equals(before.sort_by("id")), (fmt, begin)
    for begin in (c1, "earliest"):  # the compaction and c2 completed in between: refused
        with pytest.raises(nbcc.InvalidOptionError, match=f"Use begin >= {c2}"):
            table.read(query_type="incremental", begin=begin)


def test_a_range_needing_the_state_before_an_overwrite_that_opens_the_window_is_refused(local_table):
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    c1 = completion_of(table, ref.write(table, KEYS[::2], "c1"))
    overwrite = table.write(ref.batch(KEYS[:10], "o")[0], mode="overwrite")
    w = completion_of(table, overwrite)
    ref.write(table, KEYS[::3], "c3")
    table.clean(retain_commits=2)  # W = the overwrite's completion: it hid c0 and c1's files
    for fmt in ("latest_state", "cdc"):  # both need the state at begin: the overwrite is in the range
        with pytest.raises(nbcc.InvalidOptionError, match=f"Use begin >= {w}"):
            table.read(query_type="incremental", begin=c1, incremental_format=fmt)
    assert table.read(query_type="incremental", begin=w).num_rows == len(KEYS[::3])


@pytest.mark.parametrize("first_write", [{}, {"mode": "overwrite"}])
def test_a_window_by_hours_that_starts_at_the_first_commit_leaves_every_range_readable(
        local_table, monkeypatch, first_write):
    # A window by hours starts at the last data commit older than the hours: here the table's
    # first, an upsert or an overwrite. No data commit completed before it, so the state before
    # it is empty and every range, `earliest` included, reads only retained commits (§12.7).
    from nbcc.clock import format_time, parse_time

    uri, _ = local_table
    table, ref = new_table(uri), Ref()
    c0 = completion_of(table, ref.write(table, KEYS, "c0", first_write))
    c1 = completion_of(table, ref.write(table, KEYS[::2], "c1"))
    ref.write(table, KEYS[:10], "o2", {"mode": "overwrite", "partition_overwrite_mode": "dynamic"})
    assert table.compact() is not None
    ref.write(table, KEYS[::3], "c4")
    before_c0 = format_time(parse_time(c0) - 1000)
    ranges = [("earliest", None), (before_c0, None), ("earliest", c1), (before_c0, c0)]
    fmts = ("latest_state", "cdc")

    def read(begin, end, fmt):
        kw = {"end": end} if end else {}
        return sorted(table.read(query_type="incremental", begin=begin, incremental_format=fmt, **kw).to_pylist(),
                      key=repr)

    before = {(b, e, fmt): read(b, e, fmt) for b, e in ranges for fmt in fmts}
    # The hours reach back to just before c1: reads as of them see c0's state.
    monkeypatch.setattr(nbcc.clean, "_now_ms", lambda: parse_time(c1) - 1 + 3_600_000)
    assert table.clean(retain_hours=1)["earliest_retained"] == c0
    assert {key: read(*key) for key in before} == before
    assert rows_of(table.read(query_type="incremental")) == rows_of(table.read())  # every key was written
    assert table.describe()["earliest_begin"] is None
    # Once data commits completed before the window, ranges from `earliest` are refused again.
    c5 = completion_of(table, ref.write(table, KEYS[::5], "c5"))
    monkeypatch.setattr(nbcc.clean, "_now_ms", lambda: parse_time(c5) + 3_600_000)
    assert table.clean(retain_hours=1)["earliest_retained"] == c5
    for fmt in fmts:
        with pytest.raises(nbcc.InvalidOptionError, match="Use begin >= 2"):
            table.read(query_type="incremental", begin="earliest", incremental_format=fmt)
    assert table.describe()["earliest_begin"]["latest_state"] < c5


@pytest.mark.parametrize("seed", range(6))
def test_every_range_a_clean_leaves_readable_reads_what_it_read_before_the_clean(local_table, seed):
    # Random histories of upserts, deletes, overwrites (of the table or of one partition),
    # compactions (some left pending) and cleans: every incremental range, in both formats, is
    # either refused after a clean or gives exactly what it gave before the clean; and the range
    # beginning at the earliest begin the error names is never refused.
    import random

    rng = random.Random(seed)
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    pending: list[str] = []
    for step in range(14):
        roll = rng.random()
        if roll < 0.45:
            ref.write(table, rng.sample(KEYS, 8), f"u{step}")
        elif roll < 0.55:
            gone = rng.sample(KEYS, 4)
            table.write(pa.table({"id": pa.array(gone, pa.int64()), "part": [part_of(k) for k in gone]}),
                        operation="delete")
        elif roll < 0.62:
            table.write(ref.batch(rng.sample(KEYS, 10), f"o{step}")[0], mode="overwrite")
        elif roll < 0.7:  # replaces one partition: the keys of its parity
            keys = [k for k in rng.sample(KEYS, 10) if k % 2 == step % 2]
            table.write(ref.batch(keys, f"p{step}")[0], mode="overwrite", partition_overwrite_mode="dynamic")
        elif roll < 0.85:
            tc = table.schedule_compaction()
            if tc is not None and rng.random() < 0.7:
                table.run_compaction(tc)
            elif tc is not None:
                pending.append(tc)
        else:
            table.clean(retain_commits=rng.randint(2, 5))
    times = sorted({i.completion for i in table.timeline() if i.completion})
    ranges = [(b, e) for b in ["earliest"] + times for e in times if b == "earliest" or b < e]

    def read(begin: str, end: str, fmt: str) -> list[dict[str, Any]]:
        return sorted(table.read(query_type="incremental", begin=begin, end=end, incremental_format=fmt)
                      .to_pylist(), key=repr)

    before = {}
    for b, e in ranges:
        for fmt in ("latest_state", "cdc"):
            try:
                before[(b, e, fmt)] = read(b, e, fmt)
            except nbcc.InvalidOptionError:
                pass  # an earlier clean's window
    table.clean(retain_commits=rng.randint(2, 4))
    for tc in pending:
        table.run_compaction(tc)  # a pending compaction's inputs were kept for it
    read_after = 0
    for (b, e, fmt), rows in before.items():
        try:
            got = read(b, e, fmt)
        except nbcc.InvalidOptionError as exc:
            first = str(exc).rsplit("Use begin >= ", 1)[-1].rstrip(".")
            assert b == "earliest" or b < first, (b, first)
            if first < e and (first, e, fmt) in before:
                assert read(first, e, fmt) == before[(first, e, fmt)], (first, e, fmt)
            continue
        read_after += 1
        assert got == rows, (b, e, fmt)
    assert read_after > 0


# -- 5. archival -------------------------------------------------------------------------------

def test_archival_keeps_timeline_and_reads_and_an_archived_commits_live_log_survives_compaction(
        local_table, children):
    """Hudi #14365: the `cold` partition is written once (by c3) and never again, so its log
    file is still live when c3 is archived; compacting afterwards must keep its rows."""
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    hot = list(range(0, 20))
    cold = list(range(100, 110))

    def where(k: int) -> str:
        return "cold" if k >= 100 else "hot"

    states: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    changed: dict[str, list[int]] = {}

    def commit(name: str, keys: list[int]) -> None:
        instant = ref.write(table, keys, name, part=where)
        t = completion_of(table, instant)
        states[t], changed[t] = ref.expected(), keys
        order.append(t)

    commit("c1", hot)
    commit("c2", hot[::2])
    tc1 = table.compact()  # hot only: cold has no data yet
    states[completion_of(table, tc1)] = ref.expected()
    commit("c3", hot[1::2] + cold)
    for n in range(4, 13):
        commit(f"c{n}", hot[n % 5::3])
    cold_rows = ref.expected(cold)
    assert all(r["v"].startswith("c3-") for r in cold_rows)

    table.clean(retain_commits=3)
    window = order[-3]
    timeline_before = timeline_tuples(table)
    active_before = active_timeline_files(uri)
    old = [i for i in timeline_before if (i[3] or i[0]) < window]
    assert len(old) == 10  # c1..c9 and the compaction commit
    in_window = sorted(t for t in states if t >= window)
    reads_before = {t: snapshot(table, as_of=t) for t in in_window}
    assert reads_before == {t: states[t] for t in in_window}

    result = table.archive(retain_commits=3)
    assert result["archived"] > 0
    active_after = active_timeline_files(uri)
    assert len(active_after) < len(active_before)
    named = {n.split(".")[0].split("_")[0] for n in active_after}  # the instants the active files are of
    assert named == {i[0] for i in timeline_before} - {i[0] for i in old}, active_after
    history = list((Path(uri) / ".nbcc" / "history").glob("*.parquet"))
    assert len(history) == 1

    # The timeline still lists every instant with its completion time; reads are unchanged.
    assert timeline_tuples(table) == timeline_before
    assert snapshot(table) == ref.expected()
    for t in in_window:
        assert snapshot(table, as_of=t) == reads_before[t]
    assert snapshot(table, query_type="incremental", begin=window) == \
        ref.expected(changed[order[-2]] + changed[order[-1]])
    # begin in the archived and cleaned range, before W: format.md §12.7 says the read MUST fail,
    # with an error that names W (the files of commits before W may be gone).
    for begin in (order[4], "earliest"):  # c5, and before every instant
        with pytest.raises(nbcc.InvalidOptionError, match=window) as err:
            table.read(query_type="incremental", begin=begin)
        assert "begin" in str(err.value)

    # A fresh process sees the same.
    view = fresh_view(children, uri, in_window)
    assert [tuple(i) for i in view["timeline"]] == timeline_before
    assert view["snapshot"] == ref.expected()
    assert view["as_of"] == {t: reads_before[t] for t in in_window}

    # Compaction after archival (in a fresh process): the archived c3's cold log is compacted,
    # not lost.
    view = fresh_view(children, uri, in_window, compact=True)
    assert view["compaction"] is not None
    assert view["snapshot"] == ref.expected()
    assert snapshot(table) == ref.expected()
    assert snapshot(table, filter=[("part", "=", "cold")]) == cold_rows
    assert snapshot(table, query_type="read_optimized") == ref.expected()
    for t in in_window:
        assert snapshot(table, as_of=t) == reads_before[t]
    # ... and its base file holds the cold rows, so cleaning the old log away loses nothing.
    for n in range(13, 17):
        commit(f"c{n}", hot[n % 4::4])
    table.clean(retain_commits=2)
    table.archive(retain_commits=2)
    assert snapshot(table) == ref.expected()
    assert snapshot(table, filter=[("part", "=", "cold")]) == cold_rows
    assert not [f for f in data_files(uri) if f.startswith("part=cold/") and ".log." in f]


def test_a_range_refused_only_for_its_state_at_begin_names_the_compaction_not_missing_commits(local_table):
    # A compaction between begin and the window: no commit of the range is gone, the state at
    # begin may be. The errors said the range held commits older than the window.
    from nbcc.stream import plan_range

    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    c1, c2 = (completion_of(table, ref.write(table, [1, 2], f"a{n}")) for n in range(2))
    compaction = completion_of(table, table.compact())
    c3, c4 = (completion_of(table, ref.write(table, [2, 3], f"b{n}")) for n in range(2))
    table.clean(retain_commits=2)  # the window starts at c3
    assert table.read(query_type="incremental", begin=c2).num_rows == 2  # latest_state needs no state at begin
    with pytest.raises(nbcc.InvalidOptionError) as refused:
        table.read(query_type="incremental", begin=c2, incremental_format="cdc")
    message = str(refused.value)
    assert "needs the table's state at begin (a cdc read)" in message and "before the oldest retained" not in message
    assert f"the compaction that completed at {compaction} replaced the files" in message
    assert message.endswith(f"Use begin >= {compaction}.")
    with pytest.raises(nbcc.InvalidOptionError) as refused:
        plan_range(table.storage, table.config, c2, c4, incremental_format="cdc")
    message = str(refused.value)
    assert f"micro-batch ({c2}, {c4}] needs the table's state at {c2} (the stream reads changes)" in message
    assert f"the compaction that completed at {compaction}" in message and "commits it holds" not in message
    assert plan_range(table.storage, table.config, c2, c4).tasks  # a latest_state stream goes on
    # One that lacks a commit is still told so.
    with pytest.raises(nbcc.InvalidOptionError, match=f"reaches before the oldest retained commit.*Use begin >= {c2}"):
        table.read(query_type="incremental", begin=c1)


def test_archival_without_clean_keeps_every_read_and_incremental_from_archived_range(local_table, children):
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    states: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    changed: dict[str, list[int]] = {}
    for n in range(10):
        keys = KEYS[n % 4::4] + [50 + n]
        instant = ref.write(table, keys, f"c{n}")
        t = completion_of(table, instant)
        states[t], changed[t] = ref.expected(), keys
        order.append(t)
        if n == 4:
            tc = table.compact()
            states[completion_of(table, tc)] = ref.expected()
    timeline_before = timeline_tuples(table)
    times = sorted(states)
    active_before = active_timeline_files(uri)

    result = table.archive(retain_commits=3)
    assert result["archived"] > 0
    assert len(active_timeline_files(uri)) < len(active_before)
    assert list((Path(uri) / ".nbcc" / "history").glob("*.parquet"))
    assert timeline_tuples(table) == timeline_before
    assert snapshot(table) == ref.expected()
    for t in times:  # nothing was cleaned: every state is still readable, archived or not
        assert snapshot(table, as_of=t) == states[t], f"as_of={t}"
    # No clean, so no W (format.md §12.7, §14.4: archived instants stay on the timeline with
    # their completion times; reads do not change): every range reads, archived or not.
    for i, begin in enumerate(order[:-1]):
        expected = ref.expected([k for t in order[i + 1:] for k in changed[t]])
        assert snapshot(table, query_type="incremental", begin=begin) == expected, f"begin={begin}"
    assert snapshot(table, query_type="incremental", begin="earliest") == ref.expected()
    assert snapshot(table, query_type="incremental", begin=order[0], end=order[4]) == \
        [r for r in states[order[4]] if r["id"] in {k for t in order[1:5] for k in changed[t]}]
    assert snapshot(table, query_type="incremental", begin=order[-3]) == \
        ref.expected(changed[order[-2]] + changed[order[-1]])

    view = fresh_view(children, uri, times, compact=True)
    assert [tuple(i) for i in view["timeline"]][:len(timeline_before)] == timeline_before
    assert view["as_of"] == states
    assert view["snapshot"] == ref.expected()
    assert snapshot(table) == ref.expected()


# -- 6. crashes of the archiver and the cleaner ------------------------------------------------

@pytest.mark.parametrize("deletes_before_kill", [0, 5])
def test_archive_killed_after_writing_history_leaves_reads_unchanged(local_table, children, deletes_before_kill):
    """The history file is written, then the active files are removed: killed in between, an
    instant is in both places (or some are in one, some in both); readers see each once."""
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    states: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []
    changed: dict[str, list[int]] = {}
    for n in range(8):
        keys = KEYS[n % 3::3]
        instant = ref.write(table, keys, f"c{n}")
        t = completion_of(table, instant)
        states[t], changed[t] = ref.expected(), keys
        order.append(t)
        if n == 3:
            states[completion_of(table, table.compact())] = ref.expected()
    timeline_before = timeline_tuples(table)
    times = sorted(states)
    active_before = active_timeline_files(uri)

    proc = children.start(KILLED_SERVICE, uri, str(children.work / "stalled.json"), "archive", "3",
                          str(deletes_before_kill))
    children.wait_for(children.work / "stalled.json", proc)
    children.kill(proc)
    assert list((Path(uri) / ".nbcc" / "history").glob("*.parquet")), "the history file was written first"

    def check_reads(t: nbcc.Table) -> None:
        assert timeline_tuples(t) == timeline_before
        assert snapshot(t) == ref.expected()
        for when in times:
            assert snapshot(t, as_of=when) == states[when], f"as_of={when}"
        assert snapshot(t, query_type="incremental", begin=order[-3]) == \
            ref.expected(changed[order[-2]] + changed[order[-1]])

    check_reads(table)
    check_reads(nbcc.Table.open(uri))
    view = fresh_view(children, uri, times)
    assert [tuple(i) for i in view["timeline"]] == timeline_before
    assert view["as_of"] == states

    # Archiving again finishes the job, and says so; reads stay the same; compaction still works.
    left = len(active_timeline_files(uri))
    result = table.archive(retain_commits=3)
    assert result["archived"] == 0 and 0 < result["finished"] <= left - len(active_timeline_files(uri))
    assert len(active_timeline_files(uri)) < len(active_before)
    check_reads(table)
    view = fresh_view(children, uri, times, compact=True)
    assert view["compaction"] is not None
    assert view["as_of"] == states and view["snapshot"] == ref.expected()


def test_archive_finishes_an_earlier_archival_with_nothing_new_to_archive(local_table, monkeypatch):
    # An archival killed after writing its history file leaves the instants on the active
    # timeline too; the next one finishes that, even when it has nothing of its own to archive.
    import nbcc.archive

    uri, _ = local_table
    table, ref = table_with_rows(uri)
    for n in range(5):
        ref.write(table, KEYS[n::3], f"c{n}")
    finish = nbcc.archive._finish

    def killed(storage):
        raise KeyboardInterrupt

    monkeypatch.setattr(nbcc.archive, "_finish", killed)
    with pytest.raises(KeyboardInterrupt):
        table.archive(retain_commits=2)
    monkeypatch.setattr(nbcc.archive, "_finish", finish)
    left = active_timeline_files(uri)
    result = table.archive()  # retains 10 data commits: the table has 6
    assert result["archived"] == 0 and result["finished"] == 4  # the 4 oldest of 6 commits
    assert len(active_timeline_files(uri)) == len(left) - 4
    assert snapshot(nbcc.Table.open(uri)) == ref.expected()


def test_clean_killed_part_way_is_finished_by_the_next_clean(local_table, children):
    uri, _ = local_table
    table = new_table(uri)
    ref = Ref()
    files: dict[str, set[str]] = {}
    states: dict[str, list[dict[str, Any]]] = {}
    order: list[str] = []

    def commit(name: str, keys: list[int]) -> None:
        on_disk = data_files(uri)
        instant = ref.write(table, keys, name)
        t = completion_of(table, instant)
        states[t] = ref.expected()
        order.append(t)
        files[name] = data_files(uri) - on_disk

    commit("c1", KEYS)
    commit("c2", KEYS[::2])
    on_disk = data_files(uri)
    tc = table.compact()
    files["k1"] = data_files(uri) - on_disk
    states[completion_of(table, tc)] = ref.expected()
    commit("c3", KEYS[1::2])
    commit("c4", KEYS[::3])
    commit("c5", KEYS[1::3])
    times = sorted(states)
    window = order[-2]  # clean(retain_commits=2): the window starts at c4's completion
    garbage = files["c1"] | files["c2"]
    assert len(garbage) >= 2

    proc = children.start(KILLED_SERVICE, uri, str(children.work / "stalled.json"), "clean", "2", "1")
    children.wait_for(children.work / "stalled.json", proc)
    children.kill(proc)
    gone = garbage - data_files(uri)
    assert len(gone) == 1, "the clean was killed after deleting one file"

    # The clean's plan is published before anything is deleted: reads in the window work, reads
    # before it are a clear error (never a read that finds files missing).
    assert snapshot(table) == ref.expected()
    for t in times:
        if t >= window:
            assert snapshot(table, as_of=t) == states[t]
        else:
            with pytest.raises(nbcc.InvalidOptionError, match=window):
                table.read(as_of=t)
    # Writers are not blocked.
    commit("c6", [0, 1, 2])

    # A dry run says that the next clean finishes the killed one first, with the files of its
    # plan still there, and plans the rest without them (they were listed as if still there).
    [killed] = [i.instant for i in table.timeline() if i.action == "clean" and i.state != "completed"]
    dry = table.clean(retain_commits=3, dry_run=True)
    assert [f["instant"] for f in dry["finished_cleans"]] == [killed]
    assert {f"{p}/{n}" for p, n in dry["finished_cleans"][0]["deleted"]} == garbage - gone
    assert garbage.isdisjoint(f"{p}/{n}" for p, n in dry["deleted"])

    # The next clean finishes the job, and says so.
    result = table.clean(retain_commits=3)  # same window: c4, c5, c6
    assert [f["instant"] for f in result["finished_cleans"]] == [killed]
    assert {f"{p}/{n}" for p, n in result["finished_cleans"][0]["deleted"]} == garbage
    assert sorted(result["deleted"]) == sorted(dry["deleted"])
    [finished] = [c for c in table.history() if c.instant == killed]
    assert finished.user and finished.host  # recorded by the run that finished it
    assert data_files(uri).isdisjoint(garbage)
    expected_files = files["k1"] | files["c3"] | files["c4"] | files["c5"] | files["c6"]
    assert data_files(uri) == expected_files
    assert snapshot(table) == ref.expected()
    for t in sorted(states):
        if t >= window:
            assert snapshot(table, as_of=t) == states[t]
    # ... and the killed clean does not hold archival back for ever: later, every completed
    # instant older than the window leaves the active timeline.
    for n in range(7, 12):
        commit(f"c{n}", KEYS[n % 5::5])
    table.clean(retain_commits=2)
    window = order[-2]
    table.archive(retain_commits=2)
    active = active_timeline_files(uri)
    left = [i.instant for i in table.timeline() if i.completion and i.completion < window
            and any(n.startswith(f"{i.instant}_") for n in active)]
    assert left == [], f"completed instants before the window still on the active timeline: {left}"
    assert snapshot(table) == ref.expected()
    for t in sorted(states):
        if t >= window:
            assert snapshot(table, as_of=t) == states[t]
    # No clean is left pending on the timeline.
    assert [i for i in table.timeline() if i.action == "clean" and i.state != "completed"] == []


def test_a_compaction_plan_names_the_earliest_write_still_pending(tmp_path):
    """What a base file must keep depends on which older writes can still complete (merge.py):
    the plan records the earliest pending data instant, or Tc when none is."""
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    table.write(pa.table({"id": [1], "ts": [1]}, schema=schema))
    tc = table.schedule_compaction()
    plan = json.loads((tmp_path / "t" / ".nbcc" / "timeline" / f"{tc}.compaction.requested").read_text())
    assert plan["earliest_pending"] == tc
    table.run_compaction(tc)

    slow = table.begin_write(schema)  # begun, not completed: it may complete after the next plan
    table.write(pa.table({"id": [1], "ts": [2]}, schema=schema))
    tc2 = table.schedule_compaction()
    plan = json.loads((tmp_path / "t" / ".nbcc" / "timeline" / f"{tc2}.compaction.requested").read_text())
    assert slow.instant < tc2 and plan["earliest_pending"] == slow.instant
    table.run_compaction(tc2)
    # The late write with an older instant still merges in log order with the compacted rows.
    writer = table.log_writer(slow, "0-0-0")
    writer.write(prepare(pa.table({"id": [1], "ts": [3]}, schema=schema), table.config, slow.schema, "upsert"))
    slow.commit(writer.close())
    assert table.read().to_pylist() == [{"id": 1, "ts": 3}]


def test_a_failing_inline_compaction_leaves_the_write_committed_and_logs_why(tmp_path, monkeypatch, caplog):
    import nbcc.compaction

    table = nbcc.Table.create(str(tmp_path / "t"), pa.schema([("id", pa.int64()), ("v", pa.string())]), "id",
                              buckets=2)
    table.write(pa.table({"id": [1, 2], "v": ["a", "b"]}))

    def fail(*args, **kwargs):
        raise OSError("disk full while writing the base file")

    monkeypatch.setattr(nbcc.compaction, "run_compaction", fail)
    with caplog.at_level("WARNING", logger="nbcc.table"):
        instant = table.write(pa.table({"id": [2], "v": ["B"]}), compaction_delta_commits=1, compaction_inline=True)
    done = {i.instant: i for i in table.timeline()}
    assert (done[instant].action, done[instant].state) == ("deltacommit", "completed")
    assert table.read().sort_by("id").to_pydict() == {"id": [1, 2], "v": ["a", "B"]}
    assert f"commit {instant} completed, but the compaction after it failed" in caplog.text
    assert "disk full" in caplog.text
    pending = table.pending_compactions()
    assert len(pending) == 1  # scheduled before the failure: `nbcc compact` finishes it
    monkeypatch.undo()
    assert table.run_compaction(pending[0]) is not None
    assert table.read().sort_by("id").to_pydict() == {"id": [1, 2], "v": ["a", "B"]}



def test_inline_compaction_finishes_a_compaction_that_nothing_executes(tmp_path, caplog):
    # A process killed between scheduling and completing a compaction left it pending. Inline
    # writers left it alone for good (it was "the job's"), and log files piled up. Now one that
    # sees it abandoned (no heartbeat within heartbeat_timeout_s) finishes it; one being
    # executed (a fresh heartbeat) is left to its executor.
    table, ref = table_with_rows(str(tmp_path / "t"))
    left = table.schedule_compaction()  # its executor dies before running it
    inline = {"compaction_delta_commits": 1, "compaction_inline": True}
    nbcc.heartbeat.beat(table.storage, left)  # as an executor in progress does
    ref.write(table, KEYS[:10], "c1", inline)
    assert table.pending_compactions() == [left]
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)  # the executor's heartbeat expires
    with caplog.at_level("WARNING", logger="nbcc.table"):
        ref.write(table, KEYS[10:20], "c2", inline)
    assert f"compaction {left} was left pending" in caplog.text
    done = [i.instant for i in table.timeline() if i.action == "commit" and i.state == "completed"]
    assert table.pending_compactions() == [] and done[0] == left and len(done) == 2  # then a new one
    assert snapshot(table) == ref.expected()
    assert all(s.log_files == [] for s in table.file_slices())  # c2 is compacted too



def test_inline_compaction_runs_a_compaction_nobody_started_without_waiting_for_the_heartbeat_timeout(
        tmp_path, monkeypatch):
    # One scheduled by `nbcc compact --schedule-only` (or a writer that only schedules) has no
    # execution: inline writers leave it only for the moment its scheduler needs to start one,
    # not for heartbeat_timeout_s (300 s here), while log files pile up.
    from nbcc.clock import parse_time

    table, ref = table_with_rows(str(tmp_path / "t"), heartbeat_timeout_s=300)
    left = table.schedule_compaction()
    inline = {"compaction_delta_commits": 1, "compaction_inline": True}
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: parse_time(left) + 2_000)
    ref.write(table, KEYS[:10], "c1", inline)  # its scheduler may be starting it
    assert table.pending_compactions() == [left]
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: parse_time(left) + 11_000)
    ref.write(table, KEYS[10:20], "c2", inline)
    done = [i.instant for i in table.timeline() if i.action == "commit" and i.state == "completed"]
    assert table.pending_compactions() == [] and done[0] == left and len(done) == 2  # then a new one
    assert all(s.log_files == [] for s in table.file_slices())
    assert snapshot(table) == ref.expected()


def test_a_compaction_that_keeps_failing_is_tried_again_once_per_heartbeat_timeout(tmp_path, monkeypatch):
    # Its failed execution leaves its heartbeat: inline writers do not run it again after every
    # commit, only once nothing has beaten for heartbeat_timeout_s.
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"))
    tc = table.schedule_compaction()
    runs = []

    def failing(storage, config, tc_, op, token, **_):
        runs.append(token)  # an execution's token: its file groups may merge in parallel
        raise OSError("a damaged input file")
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", failing)
    inline = {"compaction_delta_commits": 1, "compaction_inline": True}
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)  # abandoned: nothing ever executed it
    ref.write(table, KEYS[:5], "c1", inline)
    assert len(set(runs)) == 1
    ref.write(table, KEYS[5:10], "c2", inline)  # it failed just now: not again yet
    assert len(set(runs)) == 1
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)
    ref.write(table, KEYS[10:15], "c3", inline)
    assert len(set(runs)) == 2 and table.pending_compactions() == [tc]
    assert snapshot(table) == ref.expected()

def test_a_compaction_job_leaves_a_compaction_that_another_process_is_executing(tmp_path, monkeypatch, caplog):
    # A job (cron, or `nbcc compact` by hand) that started while a writer's inline compaction
    # or another job executed a compaction ran it too: the same work twice, and twice the files.
    # It leaves one whose execution's heartbeat is fresh to that execution.
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"), heartbeat_timeout_s=300)
    ref.write(table, KEYS[:10], "c1")
    tc = table.schedule_compaction()
    real, merged_by, started, release = nbcc.compaction.compact_file_group, [], threading.Event(), threading.Event()

    def merge(storage, config, tc_, op, token, **kw):
        merged_by.append(threading.current_thread().name)
        if threading.current_thread() is not threading.main_thread():  # the executor's, held
            started.set()
            assert release.wait(WAIT_S)
        return real(storage, config, tc_, op, token, **kw)
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", merge)
    done: list[str | None] = []
    executor = threading.Thread(target=lambda: done.append(nbcc.Table.open(table.uri).run_compaction(tc)),
                                name="executor")
    executor.start()
    try:
        assert started.wait(WAIT_S)
        with caplog.at_level("WARNING", logger="nbcc.compaction"):
            assert table.compact() is None  # nothing else to compact: every file group is planned in tc
        assert f"compaction {tc} is being executed by another process" in caplog.text
        assert f"--instant {tc}" in caplog.text  # how to run it anyway, if that process is gone
        assert table.pending_compactions() == [tc]
        assert threading.current_thread().name not in merged_by  # the job merged nothing
    finally:
        release.set()
        executor.join(WAIT_S)
    assert done and done[0] is not None  # the executor completed it, not the job
    assert table.pending_compactions() == []
    bases = files_of_instant(data_files(table.uri), tc)
    groups = {(f.rsplit("/", 1)[0], f.rsplit("/", 1)[1].split("_")[0]) for f in bases}
    assert len(bases) == len(groups) > 0  # one base file per file group: one execution wrote them
    assert snapshot(table) == ref.expected()


@pytest.mark.parametrize("parallelism", [1, 3])
def test_one_process_merges_file_groups_in_parallel_threads(tmp_path, monkeypatch, parallelism):
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"), buckets=4)  # 8 file groups in 2 partitions
    ref.write(table, KEYS[:30], "c1")
    real, merged_on, together = nbcc.compaction.compact_file_group, [], threading.Barrier(2, timeout=WAIT_S)

    def merge(*args, **kwargs):
        merged_on.append(threading.current_thread())
        if parallelism > 1 and len(merged_on) <= 2:
            together.wait()  # the first two merge at the same time, or this fails
        return real(*args, **kwargs)
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", merge)
    progress: list[tuple[int, int, str]] = []
    assert table.compact(lambda done, total: progress.append((done, total, threading.current_thread().name)),
                         parallelism=parallelism) is not None
    groups = {(s.partition, s.file_group_id) for s in table.file_slices()}
    assert len(groups) == 8 and all(s.log_files == [] and s.base_file for s in table.file_slices())
    assert progress == [(n, 8, threading.current_thread().name) for n in range(1, 9)]  # told in order, here
    assert len(merged_on) == 8
    if parallelism == 1:
        assert set(merged_on) == {threading.current_thread()}
    else:
        assert threading.current_thread() not in merged_on and 2 <= len(set(merged_on)) <= parallelism
    assert snapshot(table) == ref.expected()
    ref.write(table, KEYS[:5], "c2")
    for wrong in (0, -1, 1.5, "2", True):
        with pytest.raises(nbcc.NbccError, match=rf"parallelism must be a positive integer.*got {re.escape(repr(wrong))}"):
            table.compact(parallelism=wrong)
    assert table.pending_compactions() == []  # checked before anything was scheduled


def test_by_default_a_process_merges_one_file_group_per_usable_cpu_at_most_four(monkeypatch):
    from nbcc.compaction import check_parallelism
    for cpus, expected in ((1, 1), (3, 3), (64, 4)):
        monkeypatch.setattr(os, "sched_getaffinity", lambda _, n=cpus: set(range(n)))
        assert check_parallelism(None) == expected
    assert check_parallelism(16) == 16  # asked for


def test_a_writers_inline_compaction_merges_in_the_writers_thread(tmp_path, monkeypatch):
    # Inside a writer's process (a Spark driver, a stream) it takes no more CPUs and memory than
    # a merge of one file group at a time.
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"), buckets=4)
    real, merged_on = nbcc.compaction.compact_file_group, []

    def merge(*args, **kwargs):
        merged_on.append(threading.current_thread())
        return real(*args, **kwargs)
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", merge)
    ref.write(table, KEYS[:30], "c1", {"compaction_delta_commits": 1, "compaction_inline": True})
    assert len(merged_on) == 8 and set(merged_on) == {threading.current_thread()}
    assert table.pending_compactions() == [] and snapshot(table) == ref.expected()


def test_a_failing_file_group_stops_a_parallel_execution_at_once(tmp_path, monkeypatch):
    # The first failure fails the execution: merges not started never start, and those running
    # stop at their next piece rather than merging on to their end (minutes, for large groups).
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"), buckets=4)
    ref.write(table, KEYS[:30], "c1")
    tc = table.schedule_compaction()
    real, calls, second, stopped = nbcc.compaction.compact_file_group, [], threading.Event(), []

    def merge(storage, config, tc_, op, token, stop=None):
        calls.append(op["file_group"])
        if len(calls) == 1:
            assert second.wait(WAIT_S)
            raise OSError("a damaged input file")
        second.set()
        assert stop.wait(WAIT_S)  # the failure stops it
        try:
            return real(storage, config, tc_, op, token, stop=stop)
        except nbcc.compaction.MergeStopped as exc:
            stopped.append(str(exc))
            raise
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", merge)
    with pytest.raises(OSError, match="damaged"):
        table.run_compaction(tc, parallelism=2)
    # The other file groups never started, but one that the failed merge's thread may take
    # before they are cancelled; every merge but the failed one stopped at its first piece.
    assert 2 <= len(calls) <= 3
    assert len(stopped) == len(calls) - 1 and all(m.startswith("the merge of file group") for m in stopped)
    assert table.pending_compactions() == [tc]
    monkeypatch.undo()
    assert table.compact(parallelism=2) == tc and table.pending_compactions() == []
    assert snapshot(table) == ref.expected()


def test_a_compaction_job_runs_a_compaction_whose_execution_failed_at_once(tmp_path, monkeypatch):
    # A failed execution keeps its heartbeat (inline writers wait heartbeat_timeout_s before
    # trying it again), marked failed: a job, which someone runs to get it done, does not wait.
    import nbcc.compaction
    table, ref = table_with_rows(str(tmp_path / "t"), heartbeat_timeout_s=300)
    ref.write(table, KEYS[:10], "c1")
    tc = table.schedule_compaction()

    def failing(*args, **kwargs):
        raise OSError("a damaged input file")
    with monkeypatch.context() as m:
        m.setattr(nbcc.compaction, "compact_file_group", failing)
        with pytest.raises(OSError, match="damaged"):
            table.run_compaction(tc)
    heartbeat = json.loads((Path(table.uri) / ".nbcc" / "heartbeats" / f"{tc}.json").read_text())
    assert heartbeat["failed"] is True and isinstance(heartbeat["ms"], int)
    inline = {"compaction_delta_commits": 1, "compaction_inline": True}
    ref.write(table, KEYS[10:15], "c2", inline)  # an inline writer waits for it to expire
    assert table.pending_compactions() == [tc]
    assert table.compact() is not None  # the job runs it now, then compacts c2's logs
    assert tc in [i.instant for i in table.timeline() if i.action == "commit" and i.is_completed]
    assert table.pending_compactions() == []
    assert snapshot(table) == ref.expected()


def test_a_compaction_job_runs_one_whose_executor_stopped_beating_for_the_timeout(tmp_path, monkeypatch):
    # An executor killed mid-run (kill -9) leaves a heartbeat that looks alive until it expires.
    from nbcc.clock import parse_time
    table, ref = table_with_rows(str(tmp_path / "t"), heartbeat_timeout_s=300)
    tc = table.schedule_compaction()
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: parse_time(tc) + 1_000)
    nbcc.heartbeat.beat(table.storage, tc)  # its last beat, 1 s after scheduling
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: parse_time(tc) + 300_000)
    assert table.compact() is None and table.pending_compactions() == [tc]  # 299 s: still alive
    monkeypatch.setattr(nbcc.heartbeat, "_now_ms", lambda: parse_time(tc) + 302_000)
    assert table.compact() == tc and table.pending_compactions() == []
    assert snapshot(table) == ref.expected()


def test_compact_finishes_the_compactions_writes_scheduled_then_compacts_what_is_left(tmp_path):
    # compaction_delta_commits without compaction_inline only schedules: executing is the
    # compaction job's, and table.compact() is one.
    table, ref = table_with_rows(str(tmp_path / "t"))
    ref.write(table, KEYS[:10], "c1", {"compaction_delta_commits": 2})
    [scheduled] = table.pending_compactions()
    ref.write(table, KEYS[::4], "c2")  # after the plan: compacted by a new compaction
    assert table.compact() != scheduled
    assert table.pending_compactions() == []
    done = [i.instant for i in table.timeline() if i.action == "commit" and i.state == "completed"]
    assert done[0] == scheduled and len(done) == 2
    assert all(s.base_file and not s.log_files for s in table.file_slices())
    assert snapshot(table) == ref.expected()
    # Nothing new to plan: what compact returns is the scheduled one it finished.
    ref.write(table, KEYS[:10], "c3", {"compaction_delta_commits": 1})
    [scheduled] = table.pending_compactions()
    assert table.compact() == scheduled and table.pending_compactions() == []
    assert table.compact() is None
    assert snapshot(table) == ref.expected()


def test_a_compaction_that_fails_does_not_keep_compact_from_the_other_file_groups(tmp_path, monkeypatch, caplog):
    # A damaged input fails a pending compaction's every execution: compact() still compacts
    # the file groups outside its plan, then raises that failure.
    import nbcc.compaction

    table, ref = table_with_rows(str(tmp_path / "t"))
    broken = table.schedule_compaction()
    ref.write(table, range(1000, 1010), "c1", part=lambda k: "new")  # file groups outside its plan
    real = nbcc.compaction.compact_file_group

    def failing(storage, config, tc, op, token, **kw):
        if tc == broken:
            raise OSError("a damaged input file")
        return real(storage, config, tc, op, token, **kw)

    monkeypatch.setattr(nbcc.compaction, "compact_file_group", failing)
    with caplog.at_level("WARNING", logger="nbcc.compaction"), pytest.raises(OSError, match="a damaged input file"):
        table.compact()
    assert f"compaction {broken} failed: a damaged input file; going on with the others" in caplog.text
    assert table.pending_compactions() == [broken]
    new = [s for s in table.file_slices() if s.partition == "part=new"]
    assert new and all(s.base_file and not s.log_files for s in new)
    assert snapshot(table) == ref.expected()


def test_a_scheduling_only_writer_says_when_a_compaction_stays_pending(tmp_path, caplog):
    table, ref = table_with_rows(str(tmp_path / "t"))
    left = table.schedule_compaction()
    time.sleep(HEARTBEAT_TIMEOUT_S + 0.5)
    with caplog.at_level("WARNING", logger="nbcc.table"):
        ref.write(table, KEYS[:10], "c1", {"compaction_delta_commits": 1})
    assert f"compaction {left} is pending and nothing has executed it" in caplog.text
    assert f"`nbcc compact {table.uri}` finishes it" in caplog.text
    assert table.pending_compactions() == [left]

def test_a_base_file_that_keeps_two_records_of_a_key_is_merged_when_read(tmp_path):
    """While an older write is pending, compaction keeps a key's records from it on (a late
    record may still outrank the winner), so the base file can hold two rows of one key with no
    delete among them. It must not be marked live (read without merging), or reads would return
    both rows."""
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("v", pa.string())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    table.write(pa.table({"id": [1, 2], "ts": [1, 1], "v": ["a", "b"]}, schema=schema))
    txn = table.begin_write(schema, "upsert")  # older instant, completes after the compaction
    table.write(pa.table({"id": [1], "ts": [5], "v": ["c"]}, schema=schema))
    table.write(pa.table({"id": [1], "ts": [3], "v": ["d"]}, schema=schema))
    tc = table.compact()
    (done,) = [i for i in table.timeline() if i.instant == tc]
    (base,) = nbcc.timeline.read_commit_metadata(table.storage, done)["files"]
    assert base["rows"] == 3 and base["live"] is False, base
    assert sorted(table.read().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "ts": 5, "v": "c"}, {"id": 2, "ts": 1, "v": "b"}]
    lw = table.log_writer(txn, "0-0-0")
    lw.write(prepare(pa.table({"id": [1], "ts": [4], "v": ["late"]}, schema=schema), table.config, txn.schema, "upsert"))
    txn.commit(lw.close())
    assert sorted(table.read().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "ts": 5, "v": "c"}, {"id": 2, "ts": 1, "v": "b"}]


@pytest.mark.parametrize("merge_mode", ["event_time", "commit_time", "partial_update"])
def test_compaction_drops_deletes_no_commit_still_to_come_can_be_older_than(tmp_path, merge_mode):
    """A natural delete decides nothing once every commit that can still complete is newer: it
    is not carried from base file to base file, and a base file of live rows only is `live`."""
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1,
                              merge_mode=merge_mode)
    table.write(pa.table({"id": list(range(100)), "ts": [1] * 100}, schema=schema))
    table.write(pa.table({"id": list(range(3, 100))}), operation="delete")  # keys only: natural deletes
    for _ in range(2):
        tc = table.compact()
        (done,) = [i for i in table.timeline() if i.instant == tc]
        (base,) = nbcc.timeline.read_commit_metadata(table.storage, done)["files"]
        assert (base["rows"], base["live"]) == (3, True), base
        assert table.read().sort_by("id").to_pylist() == [{"id": i, "ts": 1} for i in range(3)]
        table.write(pa.table({"id": [0], "ts": [1]}, schema=schema))  # something for the next compaction


def test_a_delete_a_pending_older_write_must_lose_to_stays_in_the_base_file(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    table.write(pa.table({"id": [1, 2], "ts": [1, 1]}, schema=schema))
    older = table.begin_write(schema)  # pending: may complete after the compaction
    table.write(pa.table({"id": [1]}), operation="delete")
    tc = table.compact()
    (done,) = [i for i in table.timeline() if i.instant == tc]
    (base,) = nbcc.timeline.read_commit_metadata(table.storage, done)["files"]
    assert (base["rows"], base["live"]) == (2, False)  # key 2, and key 1's delete
    writer = table.log_writer(older, "0-0-0")
    writer.write(prepare(pa.table({"id": [1], "ts": [9]}, schema=schema), table.config, older.schema, "upsert"))
    older.commit(writer.close())
    # The delete came after the older write: it still wins, though the older one completed later.
    assert table.read().to_pylist() == [{"id": 2, "ts": 1}]


def test_a_write_that_stalled_through_its_rollback_and_archival_cannot_commit(tmp_path, monkeypatch):
    """A writer stalled between its requested and inflight files past its heartbeat timeout is
    rolled back; archival then moves the rollback mark into the history. When the writer resumes,
    putting its inflight file again must not make the instant committable: its commit would be
    acknowledged, then erased by the next archival (the history says rolled back)."""
    import nbcc.commit

    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1,
                              heartbeat_timeout_s=1)
    table.write(pa.table({"id": [1], "ts": [1]}, schema=schema))
    real = nbcc.commit.create_inflight
    seen: dict[str, object] = {}

    def stalled(storage, instant, action, info):
        monkeypatch.setattr(nbcc.commit, "create_inflight", real)
        nbcc.heartbeat.remove(storage, instant)
        time.sleep(1.2)  # the stall: no heartbeat for longer than heartbeat_timeout_s
        seen["rolled_back"] = table.clean(retain_commits=1)["rolled_back"]
        for k in range(3):  # newer commits move the retained window past it
            table.write(pa.table({"id": [10 + k], "ts": [1]}, schema=schema))
        table.clean(retain_commits=1)
        table.archive(retain_commits=1)
        seen["archived"] = [i.state for i in table.timeline() if i.instant == instant and i.archived]
        real(storage, instant, action, info)  # the writer resumes
    monkeypatch.setattr(nbcc.commit, "create_inflight", stalled)
    with pytest.raises(nbcc.CommitError, match="not pending on the timeline"):
        table.write(pa.table({"id": [2], "ts": [1]}, schema=schema))
    assert len(seen["rolled_back"]) == 1 and seen["archived"] == ["rolledback"]
    assert sorted(table.read().column("id").to_pylist()) == [1, 10, 11, 12]
    table.archive(retain_commits=50)
    table.clean(retain_commits=50)
    assert sorted(table.read().column("id").to_pylist()) == [1, 10, 11, 12]


def test_a_compaction_run_that_lost_to_another_whose_clean_deleted_its_inputs_returns_none(tmp_path, monkeypatch):
    """Two executions of one plan: the other completes it, a clean then deletes the log files it
    replaced, and this one finds its inputs gone. That is the harmless race of §15.5: it reports
    'completed by another run' (None), not a missing data file."""
    import nbcc.compaction

    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    for ts in range(3):
        table.write(pa.table({"id": [1, 2], "ts": [ts, ts]}, schema=schema))
    tc = table.schedule_compaction()
    real = nbcc.compaction.compact_file_group
    deleted: list = []

    def racing(*args, **kwargs):
        monkeypatch.setattr(nbcc.compaction, "compact_file_group", real)
        assert table.run_compaction(tc) is not None  # the other execution
        for ts in range(3, 6):
            table.write(pa.table({"id": [3], "ts": [ts]}, schema=schema))
        deleted.extend(table.clean(retain_commits=1)["deleted"])
        return real(*args, **kwargs)
    monkeypatch.setattr(nbcc.compaction, "compact_file_group", racing)
    assert table.run_compaction(tc) is None
    assert deleted  # the plan's log files
    assert table.read().sort_by("id").to_pylist() == [{"id": 1, "ts": 2}, {"id": 2, "ts": 2}, {"id": 3, "ts": 5}]


def test_an_archiver_whose_listing_another_archiver_outran_archives_the_rest(tmp_path, monkeypatch):
    """Archiver A lists the timeline; archiver B then archives the same instants and deletes them
    (a rollback mark among them). A must not fail on the mark it can no longer read."""
    import nbcc.archive

    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    table.write(pa.table({"id": [0], "ts": [1]}, schema=schema))
    table.rollback(table.begin_write(schema).instant)
    for i in range(1, 5):
        table.write(pa.table({"id": [i], "ts": [1]}, schema=schema))
    before = table.timeline()
    listing = nbcc.timeline.Timeline.load(table.storage)  # A's listing
    assert table.archive(retain_commits=1)["archived"] > 0  # B, to the end
    monkeypatch.setattr(nbcc.archive.Timeline, "load", staticmethod(lambda storage: listing))
    nbcc.archive.archive(table.storage, 1)
    monkeypatch.undo()
    assert [(i.instant, i.state, i.completion) for i in table.timeline()] == [
        (i.instant, i.state, i.completion) for i in before]
    assert sorted(table.read().column("id").to_pylist()) == [0, 1, 2, 3, 4]
