"""The timeline: timeline file names, the latest state per instant, completion order, and the rule
that an instant is committed if and only if its completed file exists."""

from __future__ import annotations

import random

import pytest

from nbcc.clock import LockGrant, LockState
from nbcc.errors import CommitError
from nbcc.storage import Storage
from nbcc.timeline import (
    Instant,
    Timeline,
    create_completed,
    create_inflight,
    create_requested,
    parse_instant_file,
    read_commit_metadata,
    read_commit_metadatas,
    remove_pending_files,
)

T1 = "20240102030405001"
T2 = "20240102030405002"
T3 = "20240102030405003"
T4 = "20240102030405004"
T5 = "20240102030405005"
T6 = "20240102030405006"
TIMELINE = ".nbcc/timeline"


def _grant(completion: str) -> LockGrant:
    """The table lock as a commit holds it, having issued `completion`."""
    return LockGrant(completion, LockState(1, "test", 0, 0), wait_ms=0.0, lease_ms=30_000)


# -- parsing ------------------------------------------------------------------------------------

def test_parse_requested():
    assert parse_instant_file(f"{T1}.deltacommit.requested") == Instant(T1, "deltacommit", "requested", None)


def test_parse_inflight():
    assert parse_instant_file(f"{T1}.deltacommit.inflight") == Instant(T1, "deltacommit", "inflight", None)


def test_parse_completed():
    it = parse_instant_file(f"{T1}_{T3}.deltacommit")
    assert it == Instant(T1, "deltacommit", "completed", T3)
    assert it.is_completed


def test_parse_replacecommit():
    assert parse_instant_file(f"{T2}_{T4}.replacecommit") == Instant(T2, "replacecommit", "completed", T4)
    assert parse_instant_file(f"{T2}.replacecommit.inflight") == Instant(T2, "replacecommit", "inflight", None)


@pytest.mark.parametrize("state", ["requested", "inflight"])
def test_pending_file_names_round_trip(state):
    name = f"{T5}.deltacommit.{state}"
    assert parse_instant_file(name).file_name == name


def test_completed_file_name_round_trips():
    name = f"{T5}_{T6}.deltacommit"
    assert parse_instant_file(name).file_name == name


@pytest.mark.parametrize(
    "name",
    [
        "",
        "README",
        ".nbcc-tmp-0123abcd",
        "table.json",
        f"{T1}.deltacommit",                     # neither pending nor completed
        f"{T1}.deltacommit.completed",
        f"{T1}.deltacommit.requested.crc",
        f"{T1}.deltacommit.requested.tmp",
        f"{T1}_{T2}.deltacommit.crc",
        f"{T1}_{T2}.deltacommit.inflight",
        f"{T1}_.deltacommit",
        f"_{T2}.deltacommit",
        f"{T1}_{T2}_{T3}.deltacommit",
        f"{T1[:-1]}.deltacommit.requested",      # 16 digits
        f"{T1}0.deltacommit.requested",          # 18 digits
        f"{T1[:-1]}x.deltacommit.inflight",
        f"{T1}_{T2[:-1]}.deltacommit",
        f"{T1}_{T2[:-1]}x.deltacommit",
        f"{T1[:-1]}x_{T2}.deltacommit",
    ],
)
def test_junk_names_are_not_instants(name):
    assert parse_instant_file(name) is None


# -- Timeline -----------------------------------------------------------------------------------

def test_timeline_keeps_the_highest_state_of_each_instant_whatever_the_listing_order():
    files = [
        f"{T1}.deltacommit.requested", f"{T1}.deltacommit.inflight", f"{T1}_{T4}.deltacommit",
        f"{T2}.deltacommit.requested", f"{T2}.deltacommit.inflight",
        f"{T3}.deltacommit.requested",
    ]
    expected = [
        Instant(T1, "deltacommit", "completed", T4),
        Instant(T2, "deltacommit", "inflight", None),
        Instant(T3, "deltacommit", "requested", None),
    ]
    rng = random.Random(3)
    for _ in range(10):
        rng.shuffle(files)
        tl = Timeline(parse_instant_file(n) for n in files)
        assert tl.instants == expected
        assert tl.completion_times() == {T1: T4, T2: None, T3: None}
        assert [i.instant for i in tl.pending()] == [T2, T3]


def test_completed_is_in_completion_order_not_instant_order():
    # T1 started first but completed last.
    tl = Timeline([
        Instant(T1, "deltacommit", "completed", T6),
        Instant(T2, "deltacommit", "completed", T4),
        Instant(T3, "deltacommit", "completed", T5),
        Instant("20240102030405000", "deltacommit", "inflight"),
    ])
    assert [i.instant for i in tl.completed()] == [T2, T3, T1]
    assert tl.latest_completion() == T6
    # Oldest first by instant for the whole listing.
    assert [i.instant for i in tl.instants] == ["20240102030405000", T1, T2, T3]


def test_empty_timeline():
    tl = Timeline([])
    assert tl.instants == [] and tl.completed() == [] and tl.latest_completion() is None


# -- the lifecycle on storage -------------------------------------------------------------------

def _state(storage: Storage, instant: str):
    it = Timeline.load(storage).get(instant)
    return None if it is None else it.state


def test_an_instant_is_completed_iff_its_completed_file_exists(memory_uri):
    st = Storage(memory_uri)
    assert _state(st, T1) is None
    create_requested(st, T1, "deltacommit", {"operation": "upsert"})
    assert _state(st, T1) == "requested"
    create_inflight(st, T1, "deltacommit", {"operation": "upsert"})
    assert _state(st, T1) == "inflight"
    assert Timeline.load(st).completed() == []

    create_completed(st, T1, _grant(T2), "deltacommit", {"files": [], "rows": 7})
    tl = Timeline.load(st)
    assert tl.get(T1) == Instant(T1, "deltacommit", "completed", T2)
    assert read_commit_metadata(st, tl.get(T1))["rows"] == 7

    # Cleaning up the pending files does not change anything.
    remove_pending_files(st, T1, "deltacommit")
    assert sorted(st.list_names(TIMELINE)) == [f"{T1}_{T2}.deltacommit"]
    assert Timeline.load(st).completion_times() == {T1: T2}

    # Without its completed file the instant is no longer committed.
    create_requested(st, T3, "deltacommit", {})
    create_inflight(st, T3, "deltacommit", {})
    create_completed(st, T3, _grant(T4), "deltacommit", {"files": []})
    st.delete(f"{TIMELINE}/{T3}_{T4}.deltacommit")
    tl = Timeline.load(st)
    assert tl.get(T3).state == "inflight"
    assert [i.instant for i in tl.completed()] == [T1]


def test_timeline_load_ignores_files_that_are_not_instants(local_table):
    uri, opts = local_table
    st = Storage(uri, opts)
    create_requested(st, T1, "deltacommit", {})
    st.put_if_absent(f"{TIMELINE}/notes.txt", b"x")
    st.put_if_absent(f"{TIMELINE}/{T2}_{T3}.deltacommit.crc", b"x")
    assert Timeline.load(st).instants == [Instant(T1, "deltacommit", "requested")]


def test_completing_an_instant_twice_raises_commit_error(any_table):
    uri, opts = any_table
    st = Storage(uri, opts)
    create_requested(st, T1, "deltacommit", {})
    create_inflight(st, T1, "deltacommit", {})
    create_completed(st, T1, _grant(T2), "deltacommit", {"attempt": 1, "files": []})
    with pytest.raises(CommitError, match=T1):
        create_completed(st, T1, _grant(T2), "deltacommit", {"attempt": 2, "files": []})
    # The first commit's metadata is untouched.
    assert read_commit_metadata(st, Timeline.load(st).get(T1))["attempt"] == 1


def test_completing_an_instant_again_with_a_new_completion_time_raises_commit_error(local_table):
    # A retried commit gets a new completion time from the lock. An instant has one completion
    # time: with two completed files, which one a reader picks would depend on listing order.
    uri, opts = local_table
    st = Storage(uri, opts)
    create_requested(st, T1, "deltacommit", {})
    create_inflight(st, T1, "deltacommit", {})
    create_completed(st, T1, _grant(T2), "deltacommit", {"attempt": 1, "files": []})
    with pytest.raises(CommitError, match=T1):
        create_completed(st, T1, _grant(T3), "deltacommit", {"attempt": 2, "files": []})
    assert Timeline.load(st).completion_times() == {T1: T2}
    assert [n for n in st.list_names(TIMELINE) if parse_instant_file(n).is_completed] == [
        f"{T1}_{T2}.deltacommit"
    ]


def test_starting_an_existing_instant_raises_commit_error(memory_uri):
    st = Storage(memory_uri)
    create_requested(st, T1, "deltacommit", {})
    with pytest.raises(CommitError, match=T1):
        create_requested(st, T1, "deltacommit", {})
    create_inflight(st, T1, "deltacommit", {})
    with pytest.raises(CommitError, match=T1):
        create_inflight(st, T1, "deltacommit", {})


def test_metadata_of_a_pending_instant_is_an_error(memory_uri):
    st = Storage(memory_uri)
    create_requested(st, T1, "deltacommit", {})
    with pytest.raises(CommitError):
        read_commit_metadata(st, Timeline.load(st).get(T1))


def test_the_metadata_of_many_instants_is_each_instants_own_archived_or_not(any_table, monkeypatch):
    # On S3 the commit files are fetched concurrently (a plan of a long timeline waits for a
    # tenth of the round trips); each instant must still get its own file, archived or not.
    import pyarrow as pa

    import nbcc

    uri, opts = any_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", buckets=2, storage_options=opts)
    written = [table.write(pa.table({"id": [i]})) for i in range(24)]
    table.clean(retain_commits=8)
    assert table.archive(retain_commits=8)["archived"] > 0
    # As a fresh process would: nothing cached, so every active commit file is fetched.
    import threading

    import nbcc.timeline as timeline

    st = Storage(uri, opts)
    for cache in (timeline._CACHE, timeline._HISTORY_FILES, timeline._HISTORY_METADATA):
        for key in [k for k in cache if k[0] == st.uri]:
            del cache[key]
    completed = Timeline.load(st).completed()
    assert {i.archived for i in completed} == {True, False}
    real, fetched_by = timeline.read_commit_metadata, []

    def recording(storage, instant):
        fetched_by.append(threading.current_thread().name)
        return real(storage, instant)

    monkeypatch.setattr(timeline, "read_commit_metadata", recording)
    metas = read_commit_metadatas(st, completed)
    # On S3 the active ones are fetched concurrently; local files one by one.
    assert any(name.startswith("nbcc-read") for name in fetched_by) == uri.startswith("s3://")
    assert list(metas) == [i.instant for i in completed]
    for instant in written:  # every data file a commit lists carries its instant in its name
        names = [f["name"] for f in metas[instant]["files"]]
        assert names and all(f"_{instant}." in n for n in names), (instant, names)


def test_processes_that_read_the_archived_timeline_exit_cleanly(tmp_path):
    # Reading a history file used to leave pyarrow worker threads holding the Python bytes
    # they parsed; one that let go of them while the interpreter was exiting aborted the
    # process (status 134, "terminate called without an active exception") after its work
    # was done. Each child reads the history from a cold cache 20 times, then exits at once:
    # with one read per process the race shows too rarely to test; with 20, the old code
    # aborted 5-40% of the children (machines differ), so 8 children catch it most times.
    import subprocess
    import sys

    import pyarrow as pa

    import nbcc

    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", buckets=2)
    for i in range(16):
        table.write(pa.table({"id": [i]}))
    table.clean(retain_commits=4)
    assert table.archive(retain_commits=4)["archived"] > 0
    child = ("import sys\n"
             "from nbcc import timeline\n"
             "from nbcc.storage import Storage\n"
             "st = Storage(sys.argv[1], {})\n"
             "for _ in range(20):\n"
             "    timeline._HISTORY_FILES.clear()\n"
             "    assert len(timeline.load_history(st)) > 0\n")
    for _ in range(8):
        out = subprocess.run([sys.executable, "-c", child, uri], capture_output=True, text=True, timeout=120)
        assert (out.returncode, out.stderr) == (0, "")


def test_an_instant_whose_requested_file_is_gone_cannot_complete(memory_uri):
    # Rollback and archival delete the requested file; a writer that stalled through them can
    # put its inflight file again, which must not make the instant completable.
    st = Storage(memory_uri)
    create_inflight(st, T1, "deltacommit", {})
    with pytest.raises(CommitError, match=f"instant {T1} is not pending on the timeline"):
        create_completed(st, T1, _grant(T2), "deltacommit", {"files": []})
    assert Timeline.load(st).get(T1).state == "inflight"
