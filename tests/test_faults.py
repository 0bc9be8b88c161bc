"""Faults, each one injected and the table checked afterwards (issue 6):

1. a writer process SIGKILLed at each step of a write: before its first file, between files,
   after its files but before completion, after the completed file but before its cleanup;
2. a process SIGKILLed while it holds the table lock;
3. storage calls that fail, one at a time where it matters (a lost reply to a put-if-absent),
   and at random under many writers, readers and the table services (tests/faults.py: the fault
   layer sits under nbcc's Storage logic, so every retry and error path is nbcc's own).

(A compaction, a clean and an archival killed part-way are in test_table_services.py.)

Expected rows come from the test's own bookkeeping: the rows it handed to each write, and the
data files it finds on storage. Kills are deterministic: the child patches one step to report
through a file and hang there; the test SIGKILLs it once the report exists.
"""

from __future__ import annotations

import gc
import json
import random
import re
import threading
import time
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nbcc
import nbcc.clock
import nbcc.table
import nbcc.timeline
import nbcc.writer
from faults import AFTER, BEFORE, Faults, FaultyStorage, Stall, faulty_table, in_thread
from nbcc.clock import TimeGenerator, parse_time
from nbcc.config import TABLE_CONFIG_PATH
from nbcc.storage import Storage
from test_table_services import (
    KEYS,
    PRELUDE,
    SCHEMA,
    WAIT_S,
    Ref,
    active_timeline_files,
    completion_of,
    data_files,
    files_of_instant,
    new_table,
    snapshot,
    table_with_rows,
)

COLUMNS = SCHEMA.names


# -- 1. a writer killed at each step -------------------------------------------------------------

# Writes argv[4]'s rows as one commit of one file per row (max_log_file_bytes=1), stalling for
# ever at step argv[3] after telling the parent its instant and the files written so far.
KILLED_WRITER = PRELUDE + """
import nbcc.commit as commit
import nbcc.storage as storage
from nbcc.filenames import parse_data_file
uri, signal_file, step, rows = sys.argv[1], sys.argv[2], sys.argv[3], json.loads(sys.argv[4])
schema = pa.schema([("id", pa.int64()), ("part", pa.string()), ("ts", pa.int64()), ("v", pa.string())])
table = nbcc.Table.open(uri)
opened = []

def stall(instant):
    report(signal_file, {"instant": instant, "files": list(opened)})
    hang()

real_open_write = storage.Storage.open_write
def open_write(self, rel):
    # Opening file n + 1 means file n is written, closed and synced (each holds one row).
    if step == "before_first_file" or (step == "between_files" and len(opened) == 2):
        stall(parse_data_file(rel.rsplit("/", 1)[-1]).instant)
    opened.append(rel)
    return real_open_write(self, rel)
storage.Storage.open_write = open_write

real_commit = commit.WriteTransaction.commit
def commit_(self, files, extra=None, **more):
    if step == "after_files":
        stall(self.instant)
    return real_commit(self, files, extra, **more)
commit.WriteTransaction.commit = commit_

def pending_files(instant, action):  # runs once the completed file exists, to tidy
    stall(instant)
commit.pending_files = pending_files

table.write(pa.Table.from_pylist(rows, schema=schema), max_log_file_bytes=1)
sys.exit("the write finished although it was meant to stall")
"""

STEPS = ["before_first_file", "between_files", "after_files", "after_completed"]


def heartbeat_path(uri: str, instant: str) -> Path:
    return Path(uri) / ".nbcc" / "heartbeats" / f"{instant}.json"


def test_a_heartbeat_lost_or_left_unreadable_by_a_power_failure_reads_as_no_beat(tmp_path):
    # Heartbeats are not fsynced (storage.replace durable=False): after a power failure one can
    # be missing, empty or garbled, and then its writer is dead, which "no beat" says.
    from nbcc import heartbeat

    store = Storage(str(tmp_path))
    heartbeat.beat(store, "20261125100000000")
    assert heartbeat.last_beat_ms(store, "20261125100000000") is not None
    for content in (b"", b"\0\0\0\0", b"123", b"[1]", b'{"ms": "x"}'):
        (tmp_path / ".nbcc" / "heartbeats" / "20261125100000000.json").write_bytes(content)
        assert heartbeat.last_beat_ms(store, "20261125100000000") is None, content
    assert heartbeat.last_beat_ms(store, "20261125100000001") is None
    # A failed compaction execution's last beat says so; anything but true is not "failed".
    for content, failed in ((b'{"ms": 5, "failed": true}', True), (b'{"ms": 5, "failed": "yes"}', False),
                            (b'{"ms": 5}', False)):
        (tmp_path / ".nbcc" / "heartbeats" / "20261125100000000.json").write_bytes(content)
        assert heartbeat.read_beat(store, "20261125100000000") == (5, failed), content


def roll_back_dead(table: nbcc.Table, instant: str, with_clean: bool) -> None:
    """Roll the dead writer back with a short heartbeat timeout (it is dead: any timeout is
    safe), by the cleaner or by the lazy rollback; waits (bounded) for its beat to go stale."""
    deadline = time.monotonic() + WAIT_S
    while True:
        if with_clean:
            rolled = table.clean(heartbeat_timeout_s=0.3)["rolled_back"]
        else:
            rolled = table.rollback_failed_writes(heartbeat_timeout_s=0.3)
        if rolled:
            assert rolled == [instant]
            return
        assert time.monotonic() < deadline, "the killed writer was never rolled back"
        time.sleep(0.1)


@pytest.mark.parametrize("step", STEPS)
def test_a_writer_killed_at_any_step_leaves_its_commit_whole_or_absent_and_is_tidied(
        local_table, children, step):
    uri, _ = local_table
    table, ref = table_with_rows(uri)
    before = ref.expected()
    files_before = data_files(uri)
    # Keys that exist and keys that are new, in both partitions: 8 rows, 8 files.
    _, rows = ref.batch([0, 1, 2, 3, 40, 41, 42, 43], "killed")

    signal_file = children.work / "stalled.json"
    proc = children.start(KILLED_WRITER, uri, str(signal_file), step, json.dumps(rows))
    info = children.wait_for(signal_file, proc)
    children.kill(proc)
    instant = info["instant"]

    written = data_files(uri) - files_before
    assert written == files_of_instant(written, instant) == set(info["files"])
    assert len(written) == {"before_first_file": 0, "between_files": 2}.get(step, len(rows))
    states = [i.state for i in table.timeline() if i.instant == instant]
    timeline_files = set(active_timeline_files(uri))
    assert {f"{instant}.deltacommit.requested", f"{instant}.deltacommit.inflight"} <= timeline_files
    assert heartbeat_path(uri, instant).exists()

    if step == "after_completed":
        # Published: visible, whole, in every reader, and never rolled back.
        assert states == ["completed"]
        ref.apply(rows)
        assert snapshot(table) == ref.expected()
        assert snapshot(nbcc.Table.open(uri)) == ref.expected()
        time.sleep(0.5)  # its heartbeat is stale by any short timeout now
        assert table.rollback_failed_writes(heartbeat_timeout_s=0.3) == []
        assert table.clean(heartbeat_timeout_s=0.3)["rolled_back"] == []
        assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]
        assert data_files(uri) - files_before == written
        # The leftover pending files and heartbeat are harmless: writes and reads go on...
        after = ref.write(table, [0, 50], "after")
        assert snapshot(table) == ref.expected()
        # ... and the services tidy them: the cleaner deletes the heartbeat, archival the
        # pending files (with the completed file, once the instant leaves the window).
        table.clean(retain_commits=1)
        assert not heartbeat_path(uri, instant).exists()
        table.archive(retain_commits=1)
        assert not [n for n in active_timeline_files(uri) if n.startswith(instant)]
        assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]
        assert snapshot(table) == ref.expected()
        assert completion_of(table, after) > completion_of(table, instant)
    else:
        # Not published: pending, none of its rows visible (not even the files it finished).
        assert states == ["inflight"]
        assert snapshot(table) == before
        assert snapshot(nbcc.Table.open(uri)) == before
        roll_back_dead(table, instant, with_clean=step != "between_files")
        assert [(i.action, i.state) for i in table.timeline() if i.instant == instant] == \
            [("deltacommit", "rolledback")]
        assert data_files(uri) == files_before, "a rolled-back write's files must be deleted"
        assert not heartbeat_path(uri, instant).exists()
        assert [n for n in active_timeline_files(uri) if n.startswith(instant)] == \
            [f"{instant}.deltacommit.rolledback"]
        assert snapshot(table) == before
        assert table.rollback_failed_writes(heartbeat_timeout_s=0.3) == []  # once only
        # The table goes on.
        ref.write(table, [0, 40], "next")
        assert snapshot(table) == ref.expected()
        assert snapshot(nbcc.Table.open(uri)) == ref.expected()


# -- 2. the lock holder killed ---------------------------------------------------------------------

LOCK_HOLDER = PRELUDE + """
uri, signal_file = sys.argv[1], sys.argv[2]
table = nbcc.Table.open(uri)
with table.clock.locked() as grant:
    report(signal_file, {"time": grant.time, "lease_until_ms": grant.state.lease_until_ms})
    hang()
"""


def test_a_writer_waits_for_a_killed_lock_holders_lease_and_then_commits(local_table, children):
    # test_clock.py has a holder that exits holding the lock; here it is SIGKILLed while a
    # writer of the table is already waiting for the lock.
    uri, _ = local_table
    lease_ms = 1500
    table, ref = table_with_rows(uri, lock_lease_ms=lease_ms)
    signal_file = children.work / "holding.json"
    proc = children.start(LOCK_HOLDER, uri, str(signal_file))
    held = children.wait_for(signal_file, proc)

    data, rows = ref.batch([0, 1, 60], "waited")
    outcome: dict[str, Any] = {}

    def write() -> None:
        try:
            outcome["instant"] = nbcc.Table.open(uri).write(data)
        except Exception as exc:  # noqa: BLE001 - reported below
            outcome["error"] = exc

    writer = threading.Thread(target=write)
    writer.start()
    assert proc.poll() is None, "the holder must be alive (holding the lock) while the writer starts"
    children.kill(proc)
    writer.join(WAIT_S)
    assert not writer.is_alive(), "the writer never got the lock"
    assert "error" not in outcome, outcome
    instant = outcome["instant"]
    ref.apply(rows)
    assert snapshot(table) == ref.expected()
    # Nothing was issued while the dead holder's lease ran: the writer's instant (issued only
    # while the lock is free) and its completion come after the lease's end.
    assert parse_time(instant) >= held["lease_until_ms"]
    assert completion_of(table, instant) > instant > held["time"]
    assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]


# -- 3a. lost replies, one at a time ------------------------------------------------------------------

COMPLETED_FILE = r"^(?!.*/\.nbcc/metadata/).*/timeline/\d{17}_\d{17}\.deltacommit$"  # the table's, not its metadata table's


def test_a_table_whose_creation_reply_was_lost_is_created(memory_uri, monkeypatch):
    # Without recognising its own file, the creator would be told its table already exists.
    faults = Faults().plan("put", AFTER, where=re.escape(TABLE_CONFIG_PATH))
    monkeypatch.setattr(nbcc.table, "Storage", lambda uri, opts: FaultyStorage(uri, opts, faults))
    table = nbcc.Table.create(memory_uri, SCHEMA, "id", ordering_field="ts", partition_by="part")
    assert faults.injected == {("put", AFTER): 1}
    monkeypatch.undo()
    with pytest.raises(nbcc.TableExistsError):  # a second creation is refused as before
        nbcc.Table.create(memory_uri, SCHEMA, "id")
    ref = Ref()
    ref.write(nbcc.Table.open(memory_uri), KEYS[:6], "c0")
    assert snapshot(table) == ref.expected()


def test_a_write_whose_every_put_lost_its_reply_once_completes_once(memory_uri):
    table, ref = table_with_rows(memory_uri)
    faults = Faults()
    # The lock's states, the requested and inflight files, and the completed file: each put
    # takes effect and its caller sees a timeout; the retry recognises its own file.
    for where in (r"lock/", r"\.requested$", r"\.inflight$", COMPLETED_FILE):
        faults.plan("put", AFTER, where=where)
    data, rows = ref.batch([0, 1, 41], "lost-replies")
    instant = faulty_table(table, faults).write(data)
    ref.apply(rows)
    assert faults.injected == {("put", AFTER): 4}
    assert snapshot(table) == ref.expected()
    completed = [n for n in table.storage.list_names(".nbcc/timeline") if n.startswith(f"{instant}_")]
    assert len(completed) == 1
    assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]
    ref.write(table, [0, 2], "after")  # the lock was released: the next writer goes on
    assert snapshot(table) == ref.expected()


def test_a_commit_whose_completed_file_never_answers_raises_but_is_committed(memory_uri):
    # The completed file was created but every attempt timed out: the writer cannot know, says
    # so, and the commit is visible whole; no rollback ever undoes it.
    table, ref = table_with_rows(memory_uri)
    faults = Faults().plan("put", AFTER, BEFORE, BEFORE, where=COMPLETED_FILE)
    data, rows = ref.batch([0, 1, 41], "unknown")
    with pytest.raises(nbcc.StorageError, match="may have created"):
        faulty_table(table, faults).write(data)
    ref.apply(rows)
    assert snapshot(table) == ref.expected()
    time.sleep(0.1)
    assert table.rollback_failed_writes(heartbeat_timeout_s=0.05) == []
    assert snapshot(table) == ref.expected()


def test_a_write_whose_tidying_fails_still_returns_its_commit(memory_uri):
    # Once the completed file exists the write is published: failing to delete its pending
    # files and its heartbeat afterwards must not make the write raise (a caller would write
    # the rows again, or a Spark job would abort a committed instant).
    table = new_table(memory_uri)
    ref = Ref()
    faults = Faults()
    attempts = FaultyStorage.RETRY_ATTEMPTS
    # The commit's own tidying stops at its first failed delete; the heartbeat thread's exit
    # then fails to delete the heartbeat too.
    faults.plan("delete", *[BEFORE] * attempts, where=r"\.inflight$")
    faults.plan("delete", *[BEFORE] * attempts, where=r"heartbeats/")
    data, rows = ref.batch([0, 1, 41], "untidy")
    instant = faulty_table(table, faults).write(data)
    ref.apply(rows)
    assert faults.injected == {("delete", BEFORE): 2 * attempts}  # the tidying did fail
    assert snapshot(table) == ref.expected()
    assert [i.state for i in table.timeline() if i.instant == instant] == ["completed"]
    left = [n for n in table.storage.list_names(".nbcc/timeline") if n.startswith(f"{instant}.")]
    assert sorted(left) == [f"{instant}.deltacommit.inflight", f"{instant}.deltacommit.requested"]
    assert table.storage.list_names(".nbcc/heartbeats") == [f"{instant}.json"]
    # What it left is harmless and tidied later: the heartbeat by the next clean that runs,
    # the pending files by archival.
    ref.write(table, [2], "next")
    table.clean(retain_commits=1)
    assert table.storage.list_names(".nbcc/heartbeats") == []
    table.archive(retain_commits=1)
    assert [n for n in table.storage.list_names(".nbcc/timeline") if n.startswith(instant)] == []
    assert snapshot(table) == ref.expected()


def test_a_clean_keeps_the_heartbeat_of_a_write_that_began_while_it_ran(memory_uri):
    # A clean deletes the heartbeats of writes no longer pending. It listed the timeline before
    # the heartbeats: a write that began between the two had its heartbeat deleted at once.
    table = new_table(memory_uri)
    ref = Ref()
    for tag in ("a", "b"):
        ref.write(table, [1, 2], tag)
    table.compact()
    ref.write(table, [1], "c")  # the log files compaction replaced: a clean that deletes them
    faults = Faults()
    stall = Stall()
    faults.plan("list", stall, where=r"/\.nbcc/heartbeats$")
    cleaner, out = in_thread(lambda: faulty_table(table, faults).clean(retain_commits=1))
    assert stall.entered.wait(10)
    txn = table.begin_write(table.schema())  # its requested file, then its heartbeat
    stall.release()
    cleaner.join(30)
    assert "error" not in out and out["value"]["deleted"] and out["value"]["rolled_back"] == []
    assert table.storage.list_names(".nbcc/heartbeats") == [f"{txn.instant}.json"]
    txn.rollback(reason="the test is over")


class _Interleaved(FaultyStorage):
    """Runs `between()` at its first put of a lock state, then fails that put before it takes
    effect (the reply lost): a retry then finds another writer's state in the slot."""

    between: Any = None

    def _put_once(self, path: str, data: bytes, durable: bool = True, give_up_at: float | None = None) -> bool:
        if "/.nbcc/lock/" in path and self.between is not None:
            between, self.between = self.between, None
            between()
            raise TimeoutError("injected fault: the reply was lost")
        return super()._put_once(path, data, durable, give_up_at)


def test_two_writers_that_compute_the_same_lock_state_never_both_get_a_time(memory_uri, monkeypatch):
    # With a frozen clock, A and B read the same state and compute the same next one. A puts it
    # first; B's put fails, and its retry finds the slot taken. Were the states' bytes equal,
    # B would take A's state for its own and issue A's time a second time.
    frozen = nbcc.clock._now_ms()
    monkeypatch.setattr(nbcc.clock, "_now_ms", lambda: frozen)
    a = TimeGenerator(Storage(memory_uri))
    b_storage = _Interleaved(memory_uri)
    issued: list[str] = []
    b_storage.between = lambda: issued.append(a.new_instant())
    b = TimeGenerator(b_storage)
    issued.append(b.new_instant())
    assert len(issued) == 2 and issued[1] > issued[0]
    assert parse_time(issued[0]) == frozen


# -- 3c. a put under the table lock that lands after the lease ran out ------------------------------
# The put passed the lease check, then stalled inside the storage call (botocore retrying, say)
# for longer than the lease: another process took the lock over meanwhile.

LEASE_MS = 1000  # the smallest a table allows: each takeover below waits about one lease



def test_a_commit_published_after_a_compaction_that_missed_it_keeps_its_rows(local_table, caplog):
    uri, _ = local_table
    table, ref = table_with_rows(uri, lock_lease_ms=LEASE_MS)
    stall = Stall()
    slow = faulty_table(table, Faults().plan("put", stall, where=COMPLETED_FILE))
    data, rows = ref.batch(KEYS[:10], "late")
    writer, out = in_thread(lambda: slow.write(data))
    assert stall.entered.wait(WAIT_S)
    # Another process takes the lock over once the lease ran out; its listing lacks the commit.
    tc = nbcc.Table.open(uri).schedule_compaction()
    stall.release()
    writer.join(WAIT_S)
    instant = out["value"]
    ref.apply(rows)
    late_logs = files_of_instant(data_files(uri), instant)
    planned = {f for op in nbcc.timeline.read_compaction_plan(table.storage, tc)["operations"]
               for f in op["log_files"]}
    assert completion_of(table, instant) < tc and late_logs and not {Path(f).name for f in late_logs} & planned
    assert "past its 1000 ms lease" in caplog.text
    assert snapshot(table) == ref.expected()  # the compaction pending
    assert table.run_compaction(tc)
    assert snapshot(table) == ref.expected()
    newest = {(s.partition, s.file_group_id): s for s in table.file_slices()}
    for f in map(Path, late_logs):  # in the compaction's slice, as if it had completed after Tc
        got = newest[(str(f.parent), f.name.split("_")[0])]
        assert got.base_instant == tc and f.name in got.log_files
    # Cleaning keeps the late logs: they belong to the newest slice.
    for n in range(3):
        ref.write(table, KEYS[20 + n:30:3], f"after{n}")
    table.clean(retain_commits=1)
    assert late_logs <= data_files(uri)
    assert snapshot(table) == ref.expected()
    assert table.compact()
    assert snapshot(table) == ref.expected()


def test_a_write_whose_instant_was_published_after_its_lease_writes_nothing(local_table):
    # A compaction scheduled meanwhile would not have seen the instant pending, and its base
    # files would keep too little for it (format.md §15.2): the write stops before any data.
    uri, _ = local_table
    table, ref = table_with_rows(uri, lock_lease_ms=LEASE_MS)
    stall = Stall()
    slow = faulty_table(table, Faults().plan("put", stall, where=r"timeline/\d{17}\.deltacommit\.requested$"))
    data, _ = ref.batch(KEYS[:10], "late")
    writer, out = in_thread(lambda: slow.write(data))
    assert stall.entered.wait(WAIT_S)
    ref.write(nbcc.Table.open(uri), KEYS[10:20], "other")  # takes the lock over meanwhile
    stall.release()
    writer.join(WAIT_S)
    assert isinstance(out.get("error"), nbcc.LockLostError), out
    assert "nothing was written" in str(out["error"]) and "lock_lease_ms" in str(out["error"])
    [stalled] = [i for i in table.timeline() if i.state != "completed"]
    assert stalled.state == "rolledback"
    assert not files_of_instant(data_files(uri), stalled.instant)
    assert snapshot(table) == ref.expected()


def test_a_rollback_mark_published_after_the_write_completed_deletes_nothing(local_table, caplog):
    uri, _ = local_table
    table, ref = table_with_rows(uri, lock_lease_ms=LEASE_MS)
    data, rows = ref.batch(KEYS[:10], "slow")
    txn = table.begin_write(data.schema)
    writer = table.log_writer(txn, "0-0-0")
    writer.write(nbcc.writer.prepare(data, table.config, txn.schema, "upsert"))
    files = writer.close()
    stall = Stall()
    slow = faulty_table(table, Faults().plan("put", stall, where=r"\.rolledback$"))
    rollback, out = in_thread(lambda: slow.rollback(txn.instant))
    assert stall.entered.wait(WAIT_S)
    txn.commit(files)  # the writer takes the lock over and completes before the mark lands
    ref.apply(rows)
    stall.release()
    rollback.join(WAIT_S)
    assert out == {"value": False}
    assert "the mark is withdrawn and nothing is deleted" in caplog.text
    assert [i.state for i in table.timeline() if i.instant == txn.instant] == ["completed"]
    assert not [n for n in active_timeline_files(uri) if n.endswith(".rolledback")]
    assert {Path(f).name for f in files_of_instant(data_files(uri), txn.instant)} == {f["name"] for f in files}
    assert snapshot(table) == ref.expected()


S3_LEASE_MS = 3000  # moto on a loaded machine needs more than LEASE_MS for an ordinary commit


class StalledS3Put:
    """Holds the S3 client's put of a key matching `pattern` (a request stuck in botocore's
    and s3fs's own retries) until `release`, or for ten leases; then the put lands, unless the
    caller cancelled it meanwhile. With `lands_first`, the put lands at once and its reply is
    what is held (a lost reply). `ended` is set once the held request is over either way."""

    def __init__(self, fs, pattern: str, monkeypatch, lands_first: bool = False):
        import asyncio
        self.stalled, self.release, self.ended = threading.Event(), threading.Event(), threading.Event()
        real = fs._call_s3

        async def stalling(method, *args, **kwargs):
            if method != "put_object" or not re.search(pattern, f"/{kwargs.get('Key', '')}"):
                return await real(method, *args, **kwargs)
            self.stalled.set()
            try:
                reply = await real(method, *args, **kwargs) if lands_first else None
                give_up = time.monotonic() + 10 * S3_LEASE_MS / 1000
                while not self.release.is_set() and time.monotonic() < give_up:
                    await asyncio.sleep(0.05)
                return reply if lands_first else await real(method, *args, **kwargs)
            finally:
                self.ended.set()
        monkeypatch.setattr(fs, "_call_s3", stalling)  # s3fs caches one client per options

    def finish(self) -> None:
        assert self.stalled.is_set()
        self.release.set()
        assert self.ended.wait(WAIT_S)  # the held request is over: cancelled, or it landed


def _s3_table_with_rows(s3_table) -> tuple[nbcc.Table, Ref]:
    """A table on moto with a short lease, and one commit of KEYS."""
    uri, opts = s3_table
    return table_with_rows(uri, storage_options=opts, lock_lease_ms=S3_LEASE_MS)


def test_on_s3_a_compaction_plan_whose_put_stalls_past_the_lease_is_given_up(s3_table, monkeypatch):
    # A plan must not be published after another process may have taken the lock over (a read
    # as of a time issued meanwhile would change when it lands, format.md §15.5): the put is
    # cancelled when the lease runs out, and scheduling fails with no plan published.
    table, ref = _s3_table_with_rows(s3_table)
    stall = StalledS3Put(table.storage.fs, r"timeline/\d{17}\.compaction\.requested$", monkeypatch)
    with pytest.raises(nbcc.StorageError, match="lease ran out.*not tried again"):
        table.schedule_compaction()
    stall.finish()
    monkeypatch.undo()
    assert table.pending_compactions() == []
    assert table.compact() is not None and table.pending_compactions() == []
    assert snapshot(table) == ref.expected()


def test_on_s3_a_data_commit_whose_put_stalls_past_the_lease_is_not_given_up(s3_table, monkeypatch, caplog):
    # Given up, the put could still land after the failed write was rolled back (its files
    # deleted): a completed commit with no files, which no read survives. It waits instead, and
    # a commit published that late is logged (format.md §6.4).
    table, ref = _s3_table_with_rows(s3_table)
    stall = StalledS3Put(table.storage.fs, COMPLETED_FILE, monkeypatch)
    threading.Timer(2 * S3_LEASE_MS / 1000, stall.release.set).start()  # lands two leases late
    ref.write(table, KEYS[:10], "late")
    stall.finish()
    monkeypatch.undo()
    assert "past its 3000 ms lease" in caplog.text
    assert [i.state for i in table.timeline()] == ["completed", "completed"]
    assert snapshot(table) == ref.expected()


def test_on_s3_a_write_whose_requested_file_landed_but_its_reply_was_lost_is_rolled_back_at_once(
        s3_table, monkeypatch):
    # The put landed, its reply never came, and the write gave up at the lease's end: it
    # withdraws its instant at once rather than leave it pending until the cleaner's heartbeat
    # timeout (five minutes by default).
    table, ref = _s3_table_with_rows(s3_table)
    stall = StalledS3Put(table.storage.fs, r"timeline/\d{17}\.deltacommit\.requested$", monkeypatch,
                          lands_first=True)
    data, _ = ref.batch(KEYS[:10], "late")
    with pytest.raises(nbcc.StorageError, match="lease ran out.*not tried again"):
        table.write(data)
    stall.finish()
    monkeypatch.undo()
    [withdrawn] = [i for i in table.timeline() if i.state != "completed"]
    assert withdrawn.state == "rolledback"
    assert snapshot(table) == ref.expected()
    ref.write(table, KEYS[10:20], "next")
    assert snapshot(table) == ref.expected()


# -- 3b. random faults under many writers ----------------------------------------------------------

ROWS_PER_COMMIT = 12


def commit_no(v: str) -> int:
    return int(v.split("-", 1)[0][1:])  # "c17-42" -> 17


def merged(commits: dict[int, list[dict[str, Any]]], numbers) -> list[dict[str, Any]]:
    """The expected snapshot after `numbers` completed: each key's row of greatest ts (every
    commit has its own ts, so the order of completion does not matter)."""
    best: dict[int, dict[str, Any]] = {}
    for n in numbers:
        for r in commits[n]:
            if r["id"] not in best or r["ts"] > best[r["id"]]["ts"]:
                best[r["id"]] = r
    return [best[k] for k in sorted(best)]


def rows_of(result: pa.Table) -> list[dict[str, Any]]:
    got = sorted(result.select(COLUMNS).to_pylist(), key=lambda r: r["id"])
    ids = [r["id"] for r in got]
    assert len(ids) == len(set(ids)), f"a key appears twice: {sorted(i for i in set(ids) if ids.count(i) > 1)}"
    return got


def files_on_storage(storage: Storage) -> dict[str, set[str]]:
    """instant -> its data files (paths under the table), found by walking the storage."""
    out: dict[str, set[str]] = {}
    for path in storage.fs.find(storage.root):
        rel = path[len(storage.root):].lstrip("/")
        m = re.search(r"_(\d{17})\.log\.", rel.rsplit("/", 1)[-1])
        if not rel.startswith(".nbcc/") and m:
            out.setdefault(m.group(1), set()).add(rel)
    return out


def rows_in_files(storage: Storage, files: set[str]) -> list[dict[str, Any]]:
    rows = []
    for rel in sorted(files):
        with storage.fs.open(storage.full_path(rel), "rb") as f:
            rows += pq.read_table(f, columns=COLUMNS).to_pylist()
    return sorted(rows, key=lambda r: r["id"])


class Run:
    """Writers and a reader on one table through faulty storages; what each call returned."""

    def __init__(self, table: nbcc.Table, faults: Faults, seed: int):
        self.table, self.faults, self.rng = table, faults, random.Random(seed)
        self.commits: dict[int, list[dict[str, Any]]] = {}
        self.succeeded: dict[int, str] = {}  # commit number -> the instant write() returned
        self.failed: dict[int, BaseException] = {}
        self.unclean: list[BaseException] = []  # anything but an nbcc error
        self.reads: list[list[dict[str, Any]]] = []
        self.read_errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._ts = 0

    def next_commit(self) -> tuple[int, pa.Table]:
        with self._lock:
            self._ts += 1
            n = self._ts
            keys = self.rng.sample(range(60), ROWS_PER_COMMIT)
        rows = [{"id": k, "part": "a" if k % 2 else "b", "ts": n, "v": f"c{n}-{k}"} for k in sorted(keys)]
        self.commits[n] = rows
        return n, pa.Table.from_pylist(rows, schema=SCHEMA)

    def writer(self, commits: int) -> None:
        table = faulty_table(self.table, self.faults)
        for _ in range(commits):
            n, data = self.next_commit()
            try:
                self.succeeded[n] = table.write(data)
            except nbcc.NbccError as exc:
                self.failed[n] = exc
            except Exception as exc:  # noqa: BLE001 - a failure that is not clean
                self.failed[n] = exc
                self.unclean.append(exc)

    def reader(self, stop: threading.Event, pause_s: float) -> None:
        table = faulty_table(self.table, self.faults)
        attempts = 0
        # At least 5 reads, and more (up to 50) until one got through the faults; a pause between
        # them leaves the writers (and moto) some CPU.
        while not stop.wait(pause_s) or attempts < 5 or (not self.reads and attempts < 50):
            attempts += 1
            try:
                self.reads.append(rows_of(table.read()))
            except nbcc.NbccError as exc:
                self.read_errors.append(exc)
            except Exception as exc:  # noqa: BLE001
                self.unclean.append(exc)

    def run(self, writers: int, commits: int, read_pause_s: float) -> None:
        stop = threading.Event()
        threads = [threading.Thread(target=self.writer, args=(commits,)) for _ in range(writers)]
        reader = threading.Thread(target=self.reader, args=(stop, read_pause_s))
        for t in threads + [reader]:
            t.start()
        for t in threads:
            t.join(WAIT_S)
        stop.set()
        reader.join(WAIT_S)
        assert not any(t.is_alive() for t in threads + [reader]), "a writer or the reader hung"


@pytest.mark.parametrize("where, indexed, writers, commits, rate", [
    ("memory", False, 3, 8, 0.15),
    ("local", False, 3, 8, 0.15),
    ("s3", False, 2, 4, 0.1),  # moto is slower: fewer calls
    # With the metadata table: writers add its entries and readers plan from it, under faults.
    ("memory", True, 3, 8, 0.15),
    ("local", True, 3, 8, 0.15),
])
def test_random_storage_faults_never_lose_duplicate_or_half_show_a_commit(where, indexed, writers, commits, rate,
                                                                          tmp_path, memory_uri, request):
    if where == "memory":
        uri, opts = memory_uri, {}
    elif where == "local":
        uri, opts = str(tmp_path / "table"), {}
    else:
        uri, opts = request.getfixturevalue("s3_table")
    table = nbcc.Table.create(uri, SCHEMA, "id", ordering_field="ts", partition_by="part", buckets=2,
                              storage_options=opts, lock_lease_ms=2000)
    if indexed:
        table.build_index()
    seed = {"memory": 1, "local": 2, "s3": 3}[where] + 10 * indexed
    # 10-15% of every storage call fails, half of the failing changes after taking effect; a
    # data file being written (not retried: its content streams) fails 4% of the time.
    faults = Faults(seed, rate, rates={"sink": 0.04})
    # Besides, for sure: two writes whose data file fails, and one whose completed file is
    # created but never answers (it raises, yet it is committed).
    faults.plan("sink", None, BEFORE, None, None, AFTER, where=r"^(?!.*/\.nbcc/)")  # data files of the table
    faults.plan("put", AFTER, BEFORE, BEFORE, where=COMPLETED_FILE)
    run = Run(table, faults, seed)
    run.run(writers, commits, read_pause_s=0.2 if where == "s3" else 0.05)
    # A write that failed leaves its other data files open (the writer does not close them);
    # collect them while the storage is up: fsspec uploads a buffered file when it is collected.
    gc.collect()
    assert run.unclean == [], f"failures that are not nbcc errors: {run.unclean!r}"
    assert faults.total() > 10 and faults.injected[("put", AFTER)] > 0, faults.injected
    if indexed:
        assert any("/.nbcc/metadata/" in path for path in faults.injected_paths), "no fault met the metadata table"

    # -- what storage holds (faults off from here on) --
    faults.enabled = False
    timeline = table.timeline()
    completed = {i.instant: i for i in timeline if i.action == "deltacommit" and i.is_completed}
    pending = {i.instant for i in timeline if i.state in ("requested", "inflight")}
    assert {i.action for i in timeline} == {"deltacommit"} | ({"indexing"} if indexed else set())
    on_storage = files_on_storage(table.storage)
    visible: dict[int, str] = {}  # commit number -> instant
    for instant, inst in completed.items():
        # Whole: the files of a completed instant are exactly those its metadata lists, and
        # they hold exactly the rows of one write.
        meta = nbcc.timeline.read_commit_metadata(table.storage, inst)
        listed = {f"{f['partition']}/{f['name']}" for f in meta["files"]}
        assert on_storage.get(instant) == listed, instant
        rows = rows_in_files(table.storage, listed)
        numbers = {commit_no(r["v"]) for r in rows}
        assert len(numbers) == 1, f"instant {instant} holds rows of writes {numbers}"
        (n,) = numbers
        assert rows == run.commits[n], f"instant {instant} holds part of write {n}"
        assert n not in visible, f"write {n} completed twice ({visible[n]}, {instant})"
        visible[n] = instant
    for n, instant in run.succeeded.items():  # a write that returned is visible, whole
        assert visible.get(n) == instant, (n, instant)
    ambiguous = set(visible) - set(run.succeeded)  # raised, and yet completed
    assert ambiguous <= set(run.failed) and ambiguous, (ambiguous, run.failed)
    # A write that raised and did not complete left at most one instant behind: pending (its
    # rollback failed before marking it), or marked rolled back with files left (its rollback was
    # cut short after the mark; a cleaner deletes them as orphans). Its files are never read.
    rolled_back = {i.instant for i in timeline if i.state == "rolledback"}
    not_visible = set(run.failed) - set(visible)
    assert len(pending) + len(rolled_back) <= len(not_visible)
    assert set(on_storage) <= set(completed) | pending | rolled_back, "data files of an instant that never started"
    owners: dict[int, str] = {}
    for instant in (pending | rolled_back) & set(on_storage):  # files a failed write left: its own rows only
        numbers: set[int] = set()
        for rel in on_storage[instant]:
            try:
                numbers |= {commit_no(r["v"]) for r in rows_in_files(table.storage, {rel})}
            except (pa.ArrowInvalid, OSError):
                continue  # the file whose writing failed half-way
        assert len(numbers) <= 1 and numbers <= not_visible, (instant, numbers, not_visible)
        for n in numbers:
            assert n not in owners, f"write {n} started two instants ({owners[n]}, {instant})"
            owners[n] = instant
    assert run.succeeded and len(not_visible) >= 2, (len(run.succeeded), run.failed)

    # Every read taken while the writers wrote was the state after some prefix of the completed
    # writes (in completion order): never a row too many, too few or twice.
    order = [commit for _, commit in sorted((completed[i].completion, n) for n, i in visible.items())]
    states = [merged(run.commits, order[:k]) for k in range(len(order) + 1)]
    for got in run.reads:
        assert got in states, "a read under faults returned rows of no committed state"
    assert run.reads, "no read under faults succeeded"

    # Reads under faults of the now stable table: the right rows or a clean error.
    expected = merged(run.commits, visible)
    reader = faulty_table(table, faults)
    faults.enabled = True
    outcomes: list[str] = []
    # The snapshot, and as of each completion in turn: 12 reads, and more until one got its rows
    # (a read opens many files, and at this fault rate about half of them fail cleanly).
    for k in range(100):
        if len(outcomes) >= 12 and "rows" in outcomes:
            break
        j = k % len(order)
        as_of = completed[visible[order[j]]].completion if k % 2 else None
        want = states[j + 1] if as_of else expected
        try:
            assert rows_of(reader.read(as_of=as_of)) == want
            outcomes.append("rows")
        except nbcc.NbccError:
            outcomes.append("error")
    assert "rows" in outcomes, outcomes

    # The services under faults: each either does its work or fails cleanly.
    for service in (lambda t: t.compact(), lambda t: t.clean(retain_commits=2, heartbeat_timeout_s=0.2)):
        try:
            service(reader)
        except nbcc.NbccError:
            pass
    faults.enabled = False

    # Faults off: the failed writes are rolled back (their writers are done), pending
    # compactions are finished, and the table holds exactly the completed writes.
    time.sleep(0.3)
    table.rollback_failed_writes(heartbeat_timeout_s=0.2)
    for tc in table.pending_compactions():
        table.run_compaction(tc)
    table.clean(retain_commits=2)
    after = table.timeline()
    assert [i for i in after if i.state in ("requested", "inflight")] == []
    assert {i.instant for i in after if i.state == "rolledback"} >= pending
    assert rows_of(table.read()) == expected
    assert rows_of(nbcc.Table.open(uri, opts).read()) == expected
    if indexed:  # the metadata table came through the faults whole: its plan is the timeline's
        indexed_plan = table.plan()
        assert indexed_plan.metadata_used and indexed_plan.tasks == table.plan(use_metadata_table=False).tasks
    left = files_on_storage(table.storage)
    assert set(left) <= {i.instant for i in after if i.is_completed}, "files of rolled-back writes remain"
    # And the table goes on.
    n, data = run.next_commit()
    table.write(data)
    assert rows_of(table.read()) == merged(run.commits, list(visible) + [n])


def test_a_read_whose_data_file_keeps_failing_says_to_read_again(memory_uri):
    # Transient errors that outlast the retries are not a lost or corrupt file: the error must
    # not tell the user to restore files or roll the table back.
    table, ref = table_with_rows(memory_uri)
    faults = Faults().plan("open_read", *[BEFORE] * FaultyStorage.RETRY_ATTEMPTS, where=r"part=b/00000001-")
    with pytest.raises(nbcc.DataFileError, match="run the read again") as err:
        faulty_table(table, faults).read()
    assert "roll the table back" not in str(err.value)
    assert snapshot(table) == ref.expected()


def test_a_failed_write_drops_its_other_open_files(memory_uri, monkeypatch):
    # When one file of a write fails, the write's other open files are aborted at once, not left
    # for the garbage collector to close (on S3 that would upload them, after any rollback).
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("payload", pa.string())])
    table = nbcc.Table.create(memory_uri, schema, "id", ordering_field="ts", buckets=4)
    aborted = []
    real_abort = nbcc.storage._DataSink.abort

    def abort(sink):
        aborted.append(sink._path)
        real_abort(sink)
    monkeypatch.setattr(nbcc.storage._DataSink, "abort", abort)
    # Rows big enough that each bucket's first piece is flushed (its file opened) while the
    # write goes on; bucket 2's file then fails on its first write.
    ids = list(range(2000))
    data = pa.table({"id": ids, "ts": [1] * 2000, "payload": ["x" * 100] * 2000}, schema=schema)
    faults = Faults().plan("sink", BEFORE, where=r"/00000002-")
    with pytest.raises(nbcc.StorageError, match="00000002-"):
        faulty_table(table, faults).write(data, max_log_file_bytes=200_000)
    assert any("/00000000-" in p for p in aborted) and any("/00000001-" in p for p in aborted), aborted
    assert table.read().num_rows == 0
