"""The time generator and the table lock built on put-if-absent (nbcc.clock).

Times must be 17-digit UTC `yyyyMMddHHmmssSSS`, strictly increasing and unique for every writer of
a table in every process; the lock must exclude other processes and must not outlive a dead holder.
The cross-process tests run real processes (the venv's python) against one local table folder.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
import threading
import time
from datetime import datetime, timedelta, timezone

import pytest

import nbcc.clock
from nbcc.clock import TimeGenerator, format_time, parse_time
from nbcc.errors import LockLostError, LockTimeoutError
from nbcc.storage import Storage
from nbcc.timeline import Timeline, create_completed, create_inflight, create_requested


def _ms(dt: datetime) -> int:
    return (dt - datetime(1970, 1, 1, tzinfo=timezone.utc)) // timedelta(milliseconds=1)


def _all_files(root: str) -> list[str]:
    return [os.path.join(d, n) for d, _, names in os.walk(root) for n in names]


# -- format_time / parse_time -------------------------------------------------------------------

@pytest.mark.parametrize(
    "dt, text",
    [
        (datetime(2024, 1, 2, 3, 4, 5, 678000, tzinfo=timezone.utc), "20240102030405678"),
        (datetime(1999, 12, 31, 23, 59, 59, 999000, tzinfo=timezone.utc), "19991231235959999"),
        (datetime(2030, 6, 15, 0, 0, 0, 0, tzinfo=timezone.utc), "20300615000000000"),
        (datetime(2024, 2, 29, 12, 0, 0, 1000, tzinfo=timezone.utc), "20240229120000001"),
    ],
)
def test_format_and_parse_time_are_utc_milliseconds(dt, text):
    assert format_time(_ms(dt)) == text
    assert parse_time(text) == _ms(dt)


def test_format_time_round_trips_every_millisecond_of_a_second_boundary():
    base = _ms(datetime(2025, 3, 30, 0, 59, 59, tzinfo=timezone.utc))
    for ms in range(base - 5, base + 2005):
        text = format_time(ms)
        assert len(text) == 17 and text.isdigit()
        assert parse_time(text) == ms


@pytest.mark.parametrize("text", ["2024010203040567", "202401020304056789", "2024010203040567x", ""])
def test_parse_time_refuses_what_is_not_a_17_digit_time(text):
    with pytest.raises(ValueError, match="17-digit"):
        parse_time(text)


# -- one process --------------------------------------------------------------------------------

def test_times_are_17_digit_and_strictly_increasing_in_one_process(local_table):
    uri, opts = local_table
    gen = TimeGenerator(Storage(uri, opts))
    times = []
    for i in range(120):
        if i % 10 == 0:
            with gen.locked() as grant:
                times.append(grant.time)
        else:
            times.append(gen.new_instant())
    assert all(len(t) == 17 and t.isdigit() for t in times)
    assert all(a < b for a, b in zip(times, times[1:]))
    # They are real UTC times, close to now.
    now = _ms(datetime.now(timezone.utc))
    assert abs(parse_time(times[-1]) - now) < 60_000


def test_two_generators_on_one_table_never_issue_the_same_time(memory_uri):
    a = TimeGenerator(Storage(memory_uri))
    b = TimeGenerator(Storage(memory_uri))
    times = []
    for i in range(60):
        times.append((a if i % 2 else b).new_instant())
    assert all(x < y for x, y in zip(times, times[1:]))


def test_threads_with_their_own_generators_get_unique_times_on_s3(s3_table):
    uri, opts = s3_table
    results: dict[int, list[str]] = {}

    def work(n: int) -> None:
        gen = TimeGenerator(Storage(uri, opts))
        out = []
        for i in range(6):
            if i % 3 == 2:
                with gen.locked() as grant:
                    out.append(grant.time)
            else:
                out.append(gen.new_instant())
        results[n] = out

    threads = [threading.Thread(target=work, args=(n,)) for n in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sorted(results) == [0, 1, 2]
    every = [t for out in results.values() for t in out]
    assert len(every) == 18 and len(set(every)) == 18
    for out in results.values():
        assert all(x < y for x, y in zip(out, out[1:]))


def test_a_clock_that_goes_backwards_does_not_make_times_go_backwards(local_table, monkeypatch):
    uri, opts = local_table
    gen = TimeGenerator(Storage(uri, opts))
    before = gen.new_instant()
    future = _ms(datetime.now(timezone.utc)) + 3_600_000  # one hour ahead

    with monkeypatch.context() as m:
        m.setattr(time, "time_ns", lambda: future * 1_000_000)
        ahead = gen.new_instant()
    # The clock is back to the present: one hour behind the last issued time.
    assert parse_time(ahead) >= future > parse_time(before)

    after = gen.new_instant()
    assert after > ahead
    with gen.locked() as grant:
        assert grant.time > after
    # Another writer (a fresh generator, as in another process) also continues from there.
    other = TimeGenerator(Storage(uri, opts)).new_instant()
    assert other > grant.time


def test_lock_grant_check_raises_lock_lost_once_half_the_lease_has_passed(memory_uri):
    # A 2 s lease: the first check has 1 s to run even on a loaded machine.
    gen = TimeGenerator(Storage(memory_uri), lease_ms=2_000)
    with gen.locked() as grant:
        grant.check()  # just taken: well inside the lease
        time.sleep(1.1)  # > half of the 2000 ms lease
        with pytest.raises(LockLostError, match="lease"):
            grant.check()
    # The lock was released on the way out: the next grant is immediate and later.
    with TimeGenerator(Storage(memory_uri), lease_ms=2_000, timeout_ms=5_000).locked() as again:
        again.check()
        assert again.time > grant.time


class _SlowFirstPut(Storage):
    """The first put lands at once but its answer comes back late (a slow network, a GC pause)."""

    delay_s = 0.0

    def put_if_absent(self, rel: str, data: bytes, durable: bool = True, **kw) -> bool:
        created = super().put_if_absent(rel, data, durable, **kw)
        if self.delay_s:
            time.sleep(self.delay_s)
            self.delay_s = 0.0
        return created


class _RecordingPuts(Storage):
    """Records (the state has a holder, the put is durable) for every lock state put."""

    def __init__(self, uri: str):
        super().__init__(uri)
        self.durability: list[tuple[bool, bool]] = []

    def put_if_absent(self, rel: str, data: bytes, durable: bool = True, **kw) -> bool:
        self.durability.append((json.loads(data).get("holder") is not None, durable))
        return super().put_if_absent(rel, data, durable, **kw)


def test_every_lock_state_that_issues_a_time_is_durable_and_releases_need_not_be(memory_uri):
    # A state that issued a time must survive a power failure, or the clock could issue it
    # again; a lost release only leaves a lock whose lease runs out.
    store = _RecordingPuts(memory_uri)
    gen = TimeGenerator(store)
    gen.new_instant()
    with gen.locked():
        pass
    assert store.durability == [(False, True), (True, True), (False, False)]


def test_lock_grant_check_counts_the_time_spent_taking_the_lock(memory_uri):
    # The lease starts when the lock state is written, not when the caller gets the grant back.
    # If taking the lock took longer than the lease, another writer may already hold it, and
    # the late holder must not go on to commit.
    slow = _SlowFirstPut(memory_uri)
    slow.delay_s = 0.4
    gen = TimeGenerator(slow, lease_ms=300)
    with gen.locked() as grant:
        other = TimeGenerator(Storage(memory_uri), lease_ms=300, timeout_ms=5_000)
        with other.locked() as other_grant:  # the lease has run out: the other writer takes over
            assert other_grant.time > grant.time
            with pytest.raises(LockLostError):
                grant.check()


def _take_with_clock_off_by(gen: TimeGenerator, offset_ms: int, monkeypatch) -> str:
    """`gen` takes the lock with a wall clock `offset_ms` off, and never releases it (a holder on
    a machine whose clock is wrong, that crashed or is still writing); its time."""
    real = nbcc.clock._now_ms
    monkeypatch.setattr(nbcc.clock, "_now_ms", lambda: real() + offset_ms)
    state, _, _ = gen._acquire(take=True)
    monkeypatch.setattr(nbcc.clock, "_now_ms", real)
    return format_time(state.last_time_ms)


def test_a_holder_whose_clock_runs_fast_blocks_others_only_for_one_lease(memory_uri, monkeypatch):
    # Its lease_until_ms is a minute ahead of everyone else's clock. Waiters judge the lease by
    # how long they have seen the same state, so they take over after one lease, not a minute.
    fast = _take_with_clock_off_by(TimeGenerator(Storage(memory_uri), lease_ms=1000), 60_000, monkeypatch)
    other = TimeGenerator(Storage(memory_uri), lease_ms=1000, timeout_ms=10_000)
    with other.locked() as grant:
        assert grant.time > fast  # still after every time issued, the fast one included


def test_a_holder_whose_clock_runs_slow_is_not_taken_over_within_its_lease(memory_uri, monkeypatch):
    # Its lease_until_ms is already past on everyone else's clock when it takes the lock.
    holder = TimeGenerator(Storage(memory_uri), lease_ms=1000)
    slow = _take_with_clock_off_by(holder, -10_000, monkeypatch)
    with pytest.raises(LockTimeoutError):
        TimeGenerator(Storage(memory_uri), lease_ms=1000, timeout_ms=300).new_instant()
    # Once a whole lease has passed with the same state, it is taken over.
    other = TimeGenerator(Storage(memory_uri), lease_ms=1000, timeout_ms=10_000)
    with other.locked() as grant:
        assert grant.time > slow
        assert grant.state.holder == other.holder_id


class _SlowListing(Storage):
    """Listings of the timeline take `delay_s` (a slow store), puts into it `put_delay_s`."""

    delay_s = put_delay_s = 0.0

    def list_names(self, rel_dir: str, prefix: str = "") -> list[str]:
        if rel_dir.endswith("timeline"):
            time.sleep(self.delay_s)
        return super().list_names(rel_dir, prefix)

    def put_if_absent(self, rel: str, data: bytes, durable: bool = True, **kw) -> bool:
        if "/timeline/" in rel:
            time.sleep(self.put_delay_s)
        return super().put_if_absent(rel, data, durable, **kw)


def _pending(st: Storage, instant: str) -> None:
    create_requested(st, instant, "deltacommit", {})
    create_inflight(st, instant, "deltacommit", {})


def test_a_commit_whose_listing_outlasts_half_the_lease_publishes_nothing(memory_uri):
    # The lease is checked after the commit's listing, right before its put: the put always has
    # half a lease to land before another process may take the lock over.
    st = _SlowListing(memory_uri)
    gen = TimeGenerator(st, lease_ms=400)
    instant = gen.new_instant()
    _pending(st, instant)
    st.delay_s = 0.3
    with pytest.raises(LockLostError):
        with gen.locked() as grant:
            create_completed(st, instant, grant, "deltacommit", {"files": []})
    assert Timeline.load(Storage(memory_uri)).get(instant).state == "inflight"


def test_a_commit_published_past_its_lease_is_logged_as_an_error(memory_uri, caplog):
    st = _SlowListing(memory_uri)
    gen = TimeGenerator(st, lease_ms=400)
    instant = gen.new_instant()
    _pending(st, instant)
    st.put_delay_s = 0.5
    with caplog.at_level(logging.ERROR, logger="nbcc.clock"):
        with gen.locked() as grant:
            completion = create_completed(st, instant, grant, "deltacommit", {"files": []})
    assert Timeline.load(Storage(memory_uri)).get(instant).completion == completion
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and f"deltacommit {instant} (completed at {completion}) was published" in errors[0]
    assert "past its 400 ms lease" in errors[0]


def test_lock_state_files_are_collected_after_many_acquisitions(local_table):
    uri, opts = local_table
    gen = TimeGenerator(Storage(uri, opts))
    times = []
    for _ in range(150):
        with gen.locked() as grant:
            times.append(grant.time)
    # Each acquisition and each release writes one state file: 300 without collection.
    assert len(_all_files(uri)) < 40
    # Writers that only ask for instant times (they never take the lock) collect too.
    for _ in range(150):
        times.append(gen.new_instant())
    with gen.locked() as grant:
        times.append(grant.time)
    assert len(_all_files(uri)) < 40
    # Collecting never lost the state: times kept increasing, also for a fresh generator.
    times.append(TimeGenerator(Storage(uri, opts)).new_instant())
    assert all(a < b for a, b in zip(times, times[1:]))


# -- several real processes ---------------------------------------------------------------------

_CHILD_PRELUDE = textwrap.dedent(
    """
    import json, os, sys, time
    from nbcc.clock import TimeGenerator
    from nbcc.storage import Storage

    uri, go = sys.argv[1], sys.argv[2]
    deadline = time.monotonic() + 60
    while not os.path.exists(go):  # start together, so the processes really contend
        if time.monotonic() > deadline:
            sys.exit("start signal never came")
        time.sleep(0.005)
    """
)

_UNIQUE_CHILD = _CHILD_PRELUDE + textwrap.dedent(
    """
    gen = TimeGenerator(Storage(uri))
    out = []
    for i in range(50):
        out.append(gen.new_instant())
        if i % 10 == 5:
            with gen.locked() as grant:
                out.append(grant.time)
    print(json.dumps(out))
    """
)

_COUNTER_CHILD = _CHILD_PRELUDE + textwrap.dedent(
    """
    counter = sys.argv[3]
    gen = TimeGenerator(Storage(uri))
    for _ in range(int(sys.argv[4])):
        with gen.locked() as grant:
            # read-modify-write of a shared file: loses updates unless the lock excludes others
            with open(counter) as f:
                lines = f.read().splitlines()
            time.sleep(0.001)
            lines.append(f"{len(lines) + 1} {grant.time} {os.getpid()}")
            with open(counter, "w") as f:
                f.write("\\n".join(lines) + "\\n")
    """
)

_DEAD_HOLDER_CHILD = textwrap.dedent(
    """
    import os, sys
    from nbcc.clock import TimeGenerator
    from nbcc.storage import Storage

    gen = TimeGenerator(Storage(sys.argv[1]), lease_ms=int(sys.argv[2]))
    with gen.locked() as grant:
        print(grant.time, flush=True)
        os._exit(0)  # dies holding the lock: no release
    """
)


def _spawn(script: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", script, *map(str, args)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(procs: list[subprocess.Popen]) -> list[str]:
    outs = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 0, err
        outs.append(out)
    return outs


def test_times_are_unique_and_increasing_across_processes(local_table, tmp_path):
    uri, _ = local_table
    go = tmp_path / "go"
    procs = [_spawn(_UNIQUE_CHILD, uri, go) for _ in range(4)]
    go.write_text("go")
    outs = [json.loads(o) for o in _finish(procs)]

    for times in outs:
        assert len(times) == 55  # 50 instants + 5 lock grants
        assert all(len(t) == 17 and t.isdigit() for t in times)
        assert all(a < b for a, b in zip(times, times[1:])), "times went backwards within a process"
    every = [t for times in outs for t in times]
    assert len(set(every)) == len(every) == 220
    # A generator started after all of them issues a later time than any of them.
    assert TimeGenerator(Storage(uri)).new_instant() > max(every)


def test_locked_excludes_other_processes(local_table, tmp_path):
    uri, _ = local_table
    go = tmp_path / "go"
    counter = tmp_path / "counter.txt"
    counter.write_text("")
    per_process = 20
    procs = [_spawn(_COUNTER_CHILD, uri, go, counter, per_process) for _ in range(4)]
    go.write_text("go")
    _finish(procs)

    lines = counter.read_text().splitlines()
    assert len(lines) == 4 * per_process, "updates were lost: two processes held the lock at once"
    rows = [line.split() for line in lines]
    assert [int(r[0]) for r in rows] == list(range(1, 4 * per_process + 1))
    assert len({r[2] for r in rows}) == 4
    # The file lists grants in lock order, and each grant's time is later than the previous one.
    grant_times = [r[1] for r in rows]
    assert all(a < b for a, b in zip(grant_times, grant_times[1:]))


def test_a_dead_holder_blocks_others_only_until_its_lease_expires(local_table):
    uri, _ = local_table
    lease_ms = 1500
    dead = _spawn(_DEAD_HOLDER_CHILD, uri, lease_ms)
    (out,) = _finish([dead])
    dead_time = out.strip()
    assert len(dead_time) == 17

    # Another process (here: this one) proceeds once the lease has run out, well before its own
    # timeout, and issues a time after the dead holder's.
    gen = TimeGenerator(Storage(uri), lease_ms=lease_ms, timeout_ms=30_000)
    after = gen.new_instant()
    assert after > dead_time
    # The dead holder took the lock at its own time, so the lease ran until 1.5 s after it:
    # nobody got a time (or the lock) while the lease was live.
    assert parse_time(after) >= parse_time(dead_time) + lease_ms
    with gen.locked() as grant:
        assert grant.time > after
    assert TimeGenerator(Storage(uri), lease_ms=lease_ms, timeout_ms=30_000).new_instant() > grant.time


def test_a_waiter_opened_with_a_shorter_lease_waits_out_the_holders(memory_uri, monkeypatch):
    # A TimeGenerator opened with another lease than the table's (a tool given the default)
    # must not take over a holder early: the state records the holder's lease.
    holder = TimeGenerator(Storage(memory_uri), lease_ms=3_000)
    _take_with_clock_off_by(holder, 0, monkeypatch)
    with pytest.raises(LockTimeoutError):
        TimeGenerator(Storage(memory_uri), lease_ms=1000, timeout_ms=2_000).new_instant()


def _lock_seqs(st: Storage) -> list[int]:
    return sorted(int(n.split(".")[0]) for n in st.list_names(".nbcc/lock"))


def test_a_process_alone_on_a_table_swaps_without_reading_the_lock(memory_uri):
    # Each swap starts from the free state this process installed last: a put and the list that
    # checks no later state exists; a release is one put. Reading the state is for contention.
    from faults import Faults, FaultyStorage
    faults = Faults()
    gen = TimeGenerator(FaultyStorage(memory_uri, faults=faults))
    gen.new_instant()
    faults.calls.clear()
    with gen.locked():
        pass
    gen.new_instant()
    assert dict(faults.calls) == {"put": 3, "list": 2}


@pytest.mark.parametrize("others", [1, 3 * 8 + 5])  # the slot taken; the slot taken and collected
def test_a_process_whose_last_state_others_moved_past_reads_the_lock_again(memory_uri, caplog, others):
    # The slot after this process's release holds another's state, or held one that was
    # collected since: its put lands there, the listing after it shows later states, and the
    # swap reads the lock and goes on from the current state.
    a, b = TimeGenerator(Storage(memory_uri)), TimeGenerator(Storage(memory_uri))
    with caplog.at_level(logging.WARNING, logger="nbcc.clock"):
        with a.locked() as first:
            pass
        b_times = [b.new_instant() for _ in range(others)]
        with a.locked() as second:
            pass
        after = b.new_instant()
    assert first.time < b_times[0] and b_times[-1] < second.time < after
    assert "taken over" not in caplog.text, caplog.text
    assert _lock_seqs(Storage(memory_uri))[-1] == second.state.seq + 2  # a's release, then b's instant


def test_lock_states_a_collection_failed_to_delete_go_at_the_next_one(memory_uri):
    # A process alone on the table never lists the lock's states: it must remember those it
    # failed to delete, or they would stay for good.
    from faults import BEFORE, Faults, FaultyStorage
    faults = Faults()
    gen = TimeGenerator(FaultyStorage(memory_uri, faults=faults))
    for _ in range(15):
        gen.new_instant()
    faults.plan("delete", *[BEFORE] * FaultyStorage.RETRY_ATTEMPTS, where=r"/0+1\.json$")
    gen.new_instant()  # state 16: deletes states 1 to 7, but state 1's delete fails
    assert _lock_seqs(Storage(memory_uri))[0] == 1
    for _ in range(8):
        gen.new_instant()  # state 24: deletes 8 to 15, and 1 again
    assert _lock_seqs(Storage(memory_uri)) == list(range(16, 25))


def test_lock_states_left_behind_are_collected_once_a_listing_finds_them(memory_uri):
    # A collector that failed leaves old states; the next process that lists them deletes them.
    st = Storage(memory_uri)
    gen = TimeGenerator(st)
    for _ in range(60):
        gen.new_instant()
    for seq in range(3, 20):  # as a crashed collector (or a lost swap in a collected slot) leaves them
        st.put_if_absent(f".nbcc/lock/{seq:020d}.json", json.dumps(
            {"seq": seq, "holder": None, "lease_until_ms": 0, "last_time_ms": 1}).encode())
    other = TimeGenerator(Storage(memory_uri))
    with other.locked():  # it lists, so it finds them; it deletes them once it released the lock
        pass
    seqs = _lock_seqs(st)
    assert seqs[0] >= seqs[-1] - 3 * 8 and len(seqs) <= 3 * 8, seqs
    issued = other.new_instant()
    assert gen.new_instant() > issued  # nothing that issued times went


def test_a_long_wait_for_the_lock_names_its_holder_once(memory_uri, monkeypatch, caplog):
    # A holder that crashed stalls every writer for up to its lease: the wait says who holds it.
    monkeypatch.setattr(nbcc.clock, "SLOW_LOCK_MS", 200)
    holder = TimeGenerator(Storage(memory_uri), lease_ms=1_000)
    waiter = TimeGenerator(Storage(memory_uri), lease_ms=1_000)
    host, pid, _ = holder.holder_id.split(":")
    with caplog.at_level("WARNING", logger="nbcc.clock"):
        with holder.locked():
            done = []
            t = threading.Thread(target=lambda: done.append(waiter.new_instant()))
            t.start()
            time.sleep(0.8)
        t.join(10)
    assert done, "the waiter never got the lock"
    warnings = [r.getMessage() for r in caplog.records if "waiting for the table lock" in r.getMessage()]
    assert len(warnings) == 1 and f"held by {host} (pid {pid})" in warnings[0], warnings


def test_a_long_wait_for_a_free_lock_says_others_took_it_first_not_that_a_holder_crashed(memory_uri, monkeypatch,
                                                                                         caplog):
    # Under contention the lock is free when read and another process swaps first: the warning
    # named holder "?" with a lease until 1970 and sent users looking for a crashed process.
    monkeypatch.setattr(nbcc.clock, "SLOW_LOCK_MS", 0)
    waiter, other = TimeGenerator(Storage(memory_uri)), TimeGenerator(Storage(memory_uri))
    raced: list[str] = []
    swap = waiter._swap

    def swap_after_another_process(new):  # another process issues a time between our read and swap
        if len(raced) < 3:
            raced.append(other.new_instant())
        return swap(new)

    monkeypatch.setattr(waiter, "_swap", swap_after_another_process)
    with caplog.at_level("WARNING", logger="nbcc.clock"):
        issued = waiter.new_instant()
    assert len(raced) == 3 and issued > max(raced)
    warnings = [r.getMessage() for r in caplog.records if "waiting for the table lock" in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "it is free between holds, and other processes (writers committing, table services) took it first 1 " \
           "time;" in warnings[0] and "held by" not in warnings[0] and "1970" not in warnings[0], warnings
