"""Storage: put-if-absent (the one primitive every metadata change is built on), listings and
deletes, on memory://, local disk and the moto S3 server; and the retries of transient errors,
with faults injected under the Storage logic (tests/faults.py)."""

from __future__ import annotations

import errno
import os
import threading
import time

import aiohttp
import botocore.exceptions
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nbcc
from faults import AFTER, BEFORE, PARTLY, Faults, FaultyStorage
from nbcc.errors import InvalidOptionError, StorageError, TableExistsError
from nbcc.storage import Storage, is_transient


@pytest.fixture(params=["memory", "local", "s3"])
def storage(request, memory_uri, tmp_path):
    if request.param == "memory":
        return Storage(memory_uri)
    if request.param == "local":
        return Storage(str(tmp_path / "table"))
    uri, opts = request.getfixturevalue("s3_table")
    return Storage(uri, opts)


def test_put_if_absent_creates_once_and_keeps_the_first_content(storage):
    assert storage.put_if_absent(".nbcc/timeline/a.json", b'{"first": 1}') is True
    assert storage.put_if_absent(".nbcc/timeline/a.json", b'{"second": 2}') is False
    # Equal content again: on S3 it counts as this put's own, since a retry inside the S3 client
    # may have found the file its own first attempt created; nbcc never puts equal content twice.
    assert storage.put_if_absent(".nbcc/timeline/a.json", b'{"first": 1}') is storage.is_s3
    assert storage.read_bytes(".nbcc/timeline/a.json") == b'{"first": 1}'
    # Another name in the same folder is independent.
    assert storage.put_if_absent(".nbcc/timeline/b.json", b"b") is True
    assert sorted(storage.list_names(".nbcc/timeline")) == ["a.json", "b.json"]


def _record_syncs_and_names(monkeypatch) -> list[tuple[str, str]]:
    """Every fsync (of the path behind the descriptor) and every new name, in order."""
    events: list[tuple[str, str]] = []
    real_fsync, real_link, real_replace = os.fsync, os.link, os.replace

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        real_fsync(fd)

    def link(src, dst):
        events.append(("name", dst))
        real_link(src, dst)

    def replace(src, dst):
        events.append(("name", dst))
        real_replace(src, dst)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "link", link)
    monkeypatch.setattr(os, "replace", replace)
    return events


linux_only = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads descriptors' paths from /proc")


@linux_only
def test_a_local_put_or_replace_returns_once_its_bytes_and_its_name_are_on_disk(tmp_path, monkeypatch):
    # A power failure after a commit's put returned must not lose the commit: the file's bytes
    # are fsynced before the name appears, and its folder (which holds the name) after.
    (tmp_path / ".nbcc" / "timeline").mkdir(parents=True)
    events = _record_syncs_and_names(monkeypatch)
    store = Storage(str(tmp_path))
    for put in (lambda: store.put_if_absent(".nbcc/timeline/x.json", b"{}"),
                lambda: store.replace(".nbcc/config.json", b"{}")):
        events.clear()
        put()
        [(_, tmp), (_, final), (_, folder)] = events
        assert (os.path.dirname(tmp), folder) == (os.path.dirname(final), os.path.dirname(final))
        assert os.path.basename(tmp).startswith(".") and final.endswith(".json") and events[1][0] == "name"
    # Lock releases and heartbeats skip the fsyncs that only a crashed writer could miss.
    (tmp_path / ".nbcc" / "lock").mkdir()
    (tmp_path / ".nbcc" / "heartbeats").mkdir()
    events.clear()
    store.put_if_absent(".nbcc/lock/1.json", b"{}", durable=False)
    assert [kind for kind, _ in events] == ["fsync", "name"]
    events.clear()
    store.replace(".nbcc/heartbeats/1.json", b"{}", durable=False)
    assert [kind for kind, _ in events] == ["name"]


@linux_only
def test_folders_a_write_creates_are_made_durable_in_their_parents(tmp_path, monkeypatch):
    # The first file of a new partition (or of a new table) is only durable once every new
    # folder on its path is an entry its parent has fsynced.
    events = _record_syncs_and_names(monkeypatch)
    store = Storage(str(tmp_path / "t"))
    with store.open_write("region=eu/day=1/f.parquet") as f:
        f.write(b"data")
    synced = [path for kind, path in events if kind == "fsync"]
    for parent in (tmp_path, tmp_path / "t", tmp_path / "t" / "region=eu"):
        assert str(parent) in synced, synced
    events.clear()
    store.put_if_absent(".nbcc/lock/1.json", b"{}", durable=False)  # new folders even so
    synced = [path for kind, path in events if kind == "fsync"]
    assert str(tmp_path / "t") in synced and str(tmp_path / "t" / ".nbcc") in synced, synced


def test_a_put_whose_folder_cannot_be_synced_says_it_created_the_file(tmp_path, monkeypatch):
    import nbcc.local_disk

    store = Storage(str(tmp_path))
    store.put_if_absent(".nbcc/timeline/a.json", b"{}")  # the folders exist
    calls = []

    def failing(path):
        calls.append(path)
        raise OSError(errno.EIO, "injected: the disk could not write", path)
    monkeypatch.setattr(nbcc.local_disk, "_fsync_path", failing)
    with pytest.raises(StorageError, match=r"created .*b\.json, but could not make its name durable"):
        store.put_if_absent(".nbcc/timeline/b.json", b"{}")
    assert len(calls) == 1  # not retried: the file exists, and fsync again proves nothing
    assert store.read_bytes(".nbcc/timeline/b.json") == b"{}"


def test_put_if_absent_refuses_empty_content(storage):
    with pytest.raises(StorageError, match="empty"):
        storage.put_if_absent("x/empty", b"")
    assert not storage.exists("x/empty")
    assert storage.list_names("x") == []


def test_list_names_of_a_missing_folder_is_empty(storage):
    assert storage.list_names("no/such/folder") == []


def test_delete_of_a_missing_file_is_fine_and_delete_removes_a_file(storage):
    storage.delete("nothing/here.json")
    storage.put_if_absent("d/one", b"1")
    storage.put_if_absent("d/two", b"2")
    storage.delete("d/one")
    assert storage.list_names("d") == ["two"]
    assert not storage.exists("d/one")
    storage.delete("d/one")  # a second delete (a retried cleanup) is fine too
    # A deleted name can be created again.
    assert storage.put_if_absent("d/one", b"again") is True
    assert storage.read_bytes("d/one") == b"again"


def test_listings_are_fresh_after_changes(storage):
    # A stale (cached) listing would hide a commit from readers.
    assert storage.list_names("t") == []
    storage.put_if_absent("t/1", b"1")
    assert storage.list_names("t") == ["1"]
    storage.put_if_absent("t/2", b"2")
    assert sorted(storage.list_names("t")) == ["1", "2"]
    assert storage.exists("t/2")
    storage.delete("t/1")
    assert storage.list_names("t") == ["2"]


@pytest.mark.parametrize("where", ["local", "s3"])
def test_racing_threads_have_exactly_one_winner(where, tmp_path, request):
    if where == "local":
        uri, opts = str(tmp_path / "table"), {}
    else:
        uri, opts = request.getfixturevalue("s3_table")
    n = 16
    barrier = threading.Barrier(n, timeout=60)  # a thread that fails early must not hang the rest
    results: dict[int, bool] = {}
    errors: list[BaseException] = []

    def race(i: int) -> None:
        st = Storage(uri, opts)  # one client per thread, like separate writers
        barrier.wait()
        try:
            results[i] = st.put_if_absent(".nbcc/lock/00000000000000000001.json", f"writer {i}".encode())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=race, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert not any(t.is_alive() for t in threads), "a racing thread hangs"
    assert errors == []
    winners = [i for i, won in results.items() if won]
    assert len(results) == n and len(winners) == 1
    content = Storage(uri, opts).read_bytes(".nbcc/lock/00000000000000000001.json")
    assert content == f"writer {winners[0]}".encode()
    assert Storage(uri, opts).list_names(".nbcc/lock") == ["00000000000000000001.json"]


def test_temporary_files_are_never_listed_while_writers_race(tmp_path):
    # Local put-if-absent stages every write in a temporary file next to its target; a listing
    # taken at any moment must show only real names.
    uri = str(tmp_path / "table")
    names = {f"{i:04d}.json" for i in range(100)}
    stop = threading.Event()
    seen: set[str] = set()

    def lister() -> None:
        st = Storage(uri)
        while not stop.is_set():
            seen.update(st.list_names("meta"))

    def writer(start: int) -> None:
        st = Storage(uri)
        for i in range(100):
            st.put_if_absent(f"meta/{(i + start) % 100:04d}.json", b"x")

    threads = [threading.Thread(target=lister) for _ in range(2)]
    writers = [threading.Thread(target=writer, args=(s,)) for s in (0, 25, 50, 75)]
    for t in threads + writers:
        t.start()
    for t in writers:
        t.join()
    stop.set()
    for t in threads:
        t.join()
    seen.update(Storage(uri).list_names("meta"))
    assert seen == names
    assert set(Storage(uri).list_names("meta")) == names


class _Crash(BaseException):
    """The process dies here (kill -9 would also skip every cleanup)."""


def test_a_crashed_writers_leftover_temporary_file_is_not_listed(tmp_path, monkeypatch):
    uri = str(tmp_path / "table")
    st = Storage(uri)
    st.put_if_absent("meta/real.json", b"x")

    # Catch a staged write in the act: stop it between writing its temporary file and linking it.
    staged: list[str] = []

    def crash_link(src, dst, *a, **kw):
        staged.append(os.path.basename(src))
        raise _Crash

    with monkeypatch.context() as m:
        m.setattr(os, "link", crash_link)
        with pytest.raises(_Crash):
            st.put_if_absent("meta/other.json", b"y")
    assert len(staged) == 1 and staged[0] != "other.json"
    # Leave the staged file behind, as a killed process would.
    leftover = tmp_path / "table" / "meta" / staged[0]
    if not leftover.exists():
        leftover.write_bytes(b"y")
    assert st.list_names("meta") == ["real.json"]
    assert not st.exists("meta/other.json")
    # The name it was meant for is still free.
    assert st.put_if_absent("meta/other.json", b"z") is True
    assert sorted(st.list_names("meta")) == ["other.json", "real.json"]


# -- retries of transient errors (the storage fails under nbcc's Storage logic: tests/faults.py) --

@pytest.fixture(params=["memory", "local", "s3"])
def faulty(request, memory_uri, tmp_path):
    if request.param == "memory":
        return FaultyStorage(memory_uri)
    if request.param == "local":
        return FaultyStorage(str(tmp_path / "table"))
    uri, opts = request.getfixturevalue("s3_table")
    return FaultyStorage(uri, opts)


def plain(st: Storage) -> Storage:
    """The same storage without faults: what another process sees."""
    return Storage(st.uri, st.storage_options)


def test_a_put_whose_reply_was_lost_is_recognised_as_its_own(faulty):
    # The file was created, then the caller saw a timeout; the retry finds the name taken. It is
    # our own content, so the put succeeded (answering False would make a writer give up a lock
    # state, an instant or a table that it did create).
    faulty.faults.plan("put", AFTER)
    assert faulty.put_if_absent("meta/a.json", b'{"mine": 1}') is True
    assert faulty.faults.calls["put"] == 2
    assert plain(faulty).read_bytes("meta/a.json") == b'{"mine": 1}'
    assert plain(faulty).list_names("meta") == ["a.json"]
    # Asked again without any fault, the name is taken: False, but on S3 (see the first test).
    assert faulty.put_if_absent("meta/a.json", b'{"mine": 1}') is faulty.is_s3


@pytest.mark.parametrize("when", [BEFORE, AFTER])
def test_a_failed_put_that_finds_another_writers_file_is_refused(faulty, when):
    assert plain(faulty).put_if_absent("meta/a.json", b"theirs") is True
    faulty.faults.plan("put", when)  # failed, then the retry finds the name taken
    assert faulty.put_if_absent("meta/a.json", b"mine") is False
    assert faulty.faults.calls["put"] == 2
    assert plain(faulty).read_bytes("meta/a.json") == b"theirs"


def test_a_put_refused_by_a_conditional_conflict_never_claims_an_equal_file(memory_uri):
    # S3's 409 ConditionalRequestConflict is a refusal, not a lost reply: after it, a file with
    # the same bytes was written by someone else (here: the same content on purpose).
    st = FaultyStorage(memory_uri)
    assert plain(st).put_if_absent("lock/1.json", b"same") is True
    st.faults.plan("put", OSError(errno.EBUSY, "An error occurred (ConditionalRequestConflict) (409)"))
    assert st.put_if_absent("lock/1.json", b"same") is False
    assert st.faults.calls["put"] == 2


def test_a_put_whose_name_is_freed_again_puts_again(memory_uri):
    # Lost reply, then the name is taken and deleted again before the retry reads it (a lock
    # state collected in between): the put is made again and creates the file.
    st = FaultyStorage(memory_uri)
    st.faults.plan("put", AFTER, None)
    st.faults.plan("read", FileNotFoundError("collected"))
    assert st.put_if_absent("lock/1.json", b"mine") is True
    assert st.faults.calls["put"] == 3
    assert plain(st).read_bytes("lock/1.json") == b"mine"


@pytest.mark.parametrize("when", [BEFORE, AFTER])
def test_a_put_under_the_lock_is_not_retried_past_its_deadline(faulty, when):
    # Under the table lock a write may only start while the lease allows (LockGrant.deadline):
    # a retry after it could land once another process took the lock over.
    faulty.faults.plan("put", when)
    with pytest.raises(StorageError, match="failed 1 time .* and was not tried again: the table lock") as err:
        faulty.put_if_absent("meta/a.json", b"mine", deadline=time.monotonic())
    assert faulty.faults.calls["put"] == 1
    if when == AFTER:  # the reply was lost: the error says the put may have taken effect
        assert "an attempt may have created the file" in str(err.value)
        assert plain(faulty).read_bytes("meta/a.json") == b"mine"


@pytest.mark.parametrize("op, call", [
    ("read", lambda st: st.read_bytes("meta/a.json")),
    ("list", lambda st: st.list_names("meta")),
    ("exists", lambda st: st.exists("meta/a.json")),
    ("delete", lambda st: st.delete("meta/a.json")),
    ("put", lambda st: st.put_if_absent("meta/b.json", b"b")),
    ("replace", lambda st: st.replace("meta/a.json", b"new")),
])
def test_errors_that_asking_again_cannot_fix_are_not_retried(faulty, op, call):
    faulty.put_if_absent("meta/a.json", b"a")
    calls = faulty.faults.calls[op]
    faulty.faults.plan(op, PermissionError(errno.EACCES, "Access Denied"))
    # On S3 access denied is a StorageError that says what to check, raised from the original.
    with pytest.raises(StorageError if faulty.is_s3 else PermissionError, match="Access Denied") as err:
        call(faulty)
    assert isinstance(err.value if not faulty.is_s3 else err.value.__cause__, PermissionError)
    assert faulty.faults.calls[op] == calls + 1
    assert sorted(plain(faulty).list_names("meta")) == ["a.json"]
    assert plain(faulty).read_bytes("meta/a.json") == b"a"


def test_a_missing_file_is_reported_at_once_not_retried(faulty):
    with pytest.raises(FileNotFoundError):
        faulty.read_bytes("meta/none.json")
    assert faulty.faults.calls["read"] == 1
    faulty.delete("meta/none.json")  # a missing file is fine for a delete
    assert faulty.faults.calls["delete"] == 1


def test_transient_errors_are_retried_until_the_operation_succeeds(faulty):
    st = faulty
    st.faults.plan("put", BEFORE, BEFORE)
    assert st.put_if_absent("meta/a.json", b"a") is True
    st.faults.plan("read", BEFORE, BEFORE)
    assert st.read_bytes("meta/a.json") == b"a"
    st.faults.plan("list", BEFORE)
    assert st.list_names("meta") == ["a.json"]
    st.faults.plan("exists", BEFORE)
    assert st.exists("meta/a.json")
    st.faults.plan("replace", AFTER, BEFORE)  # replaced, reply lost; then a failure; then again
    st.replace("meta/h.json", b"beat")
    assert plain(st).read_bytes("meta/h.json") == b"beat"
    st.faults.plan("delete", AFTER)  # deleted, reply lost: the retry finds it gone
    st.delete("meta/a.json")
    assert plain(st).list_names("meta") == ["h.json"]
    assert sum(st.faults.injected.values()) == 9
    assert st.faults.calls == {"put": 3, "read": 3, "list": 2, "exists": 2, "replace": 3, "delete": 2}
    if st.is_local:  # no temporary file of a failed attempt is left behind
        assert sorted(os.listdir(os.path.join(st.root, "meta"))) == ["h.json"]


@pytest.mark.parametrize("op, call", [
    ("read", lambda st: st.read_bytes("meta/a.json")),
    ("list", lambda st: st.list_names("meta")),
    ("delete", lambda st: st.delete("meta/a.json")),
    ("replace", lambda st: st.replace("meta/a.json", b"new")),
])
def test_a_storage_error_after_the_last_attempt_names_the_operation_and_the_path(memory_uri, op, call):
    st = FaultyStorage(memory_uri)
    st.put_if_absent("meta/a.json", b"a")
    st.faults.plan(op, *[BEFORE] * st.RETRY_ATTEMPTS)
    calls = st.faults.calls[op]
    with pytest.raises(StorageError) as info:
        call(st)
    text = str(info.value)
    assert f"{op} " in text and st.full_path("meta") in text and f"{st.RETRY_ATTEMPTS} times" in text
    assert isinstance(info.value.__cause__, OSError) and "injected fault" in str(info.value.__cause__)
    assert st.faults.calls[op] == calls + st.RETRY_ATTEMPTS
    # The next call, with the storage back, works.
    call(st)


def test_a_put_that_runs_out_of_attempts_says_it_may_have_created_the_file(memory_uri):
    st = FaultyStorage(memory_uri)
    st.faults.plan("put", AFTER, BEFORE, BEFORE)
    with pytest.raises(StorageError, match="may have created") as info:
        st.put_if_absent("meta/c.json", b"c")
    assert st.full_path("meta/c.json") in str(info.value)
    assert plain(st).read_bytes("meta/c.json") == b"c"  # it had: the first attempt did
    # Any timeout may have come after the write (the caller cannot tell); only refusals are
    # certain to have changed nothing, and then the error does not say so.
    conflict = OSError(errno.EBUSY, "An error occurred (ConditionalRequestConflict) (409)")
    st.faults.plan("put", *[conflict] * st.RETRY_ATTEMPTS)
    with pytest.raises(StorageError) as info:
        st.put_if_absent("meta/d.json", b"d")
    assert "may have created" not in str(info.value)
    assert not plain(st).exists("meta/d.json")


def test_the_default_policy_retries_six_times(memory_uri):
    class Quick(FaultyStorage):
        RETRY_ATTEMPTS = Storage.RETRY_ATTEMPTS

    st = Quick(memory_uri)
    st.faults.plan("read", *[BEFORE] * 5)
    st.put_if_absent("a", b"a")
    assert st.read_bytes("a") == b"a"
    assert st.faults.calls["read"] == 6 == Storage.RETRY_ATTEMPTS


@pytest.mark.parametrize("exc, transient", [
    (ConnectionResetError(errno.ECONNRESET, "reset"), True),
    (TimeoutError("timed out"), True),
    (OSError(errno.EBUSY, "SlowDown"), True),  # s3fs: 503
    (OSError(errno.EREMOTEIO, "InternalError"), True),  # s3fs: 500
    (OSError(errno.EBUSY, "An error occurred (ConditionalRequestConflict)"), True),  # s3fs: 409
    (botocore.exceptions.EndpointConnectionError(endpoint_url="http://s3"), True),
    (aiohttp.ClientConnectionError("connection lost"), True),  # s3fs's transport, given up
    (aiohttp.ClientPayloadError("response payload is not completed"), True),
    (OSError(errno.EIO, "unknown S3 error or a failing disk"), False),
    (FileNotFoundError(errno.ENOENT, "gone"), False),
    (FileExistsError(errno.EEXIST, "taken"), False),
    (PermissionError(errno.EACCES, "denied"), False),
    (OSError(errno.ENOSPC, "disk full"), False),
    (ValueError("bad"), False),
    (StorageError("already reported"), False),
])
def test_which_errors_are_transient(exc, transient):
    assert is_transient(exc) is transient


def test_a_data_file_that_fails_while_written_raises_a_storage_error_naming_it(faulty):
    faulty.faults.plan("sink", BEFORE)
    with pytest.raises(StorageError, match="p=1/f.log") as info:
        with faulty.open_write("p=1/f.log") as sink:
            sink.write(b"rows")
    assert "injected fault" in str(info.value.__cause__)
    faulty.faults.plan("sink", AFTER)  # all of it written, then the upload's reply is lost
    with pytest.raises(StorageError, match="closing data file .*p=1/g.log"):
        with faulty.open_write("p=1/g.log") as sink:
            sink.write(b"rows")
    # Opening is retried.
    faulty.faults.plan("open_write", BEFORE, BEFORE)
    with faulty.open_write("p=1/h.log") as sink:
        sink.write(b"rows")
    assert plain(faulty).read_bytes("p=1/h.log") == b"rows"


def test_data_file_reads_retry_transient_errors_and_resume_where_they_failed(faulty):
    data = pa.table({"id": list(range(5000)), "v": [f"value {i}" for i in range(5000)]})
    with plain(faulty).open_write("data/f.parquet") as sink:
        pq.write_table(data, sink, row_group_size=1000)
    fs = faulty.arrow_filesystem()
    faulty.faults.plan("open_read", BEFORE)
    faulty.faults.plan("read_data", BEFORE, None, BEFORE, None, None, BEFORE)  # each fails half-way
    assert pq.read_table(faulty.full_path("data/f.parquet"), filesystem=fs).equals(data)
    with fs.open_input_file(faulty.full_path("data/f.parquet")) as source:
        assert pq.ParquetFile(source).read(columns=["v"]).column("v").equals(data.column("v"))
    assert faulty.faults.injected[("open_read", BEFORE)] == 1
    assert faulty.faults.injected[("read_data", BEFORE)] == 3
    # A read that keeps failing ends in a StorageError naming the file.
    faulty.faults.plan("read_data", *[BEFORE] * faulty.RETRY_ATTEMPTS)
    with pytest.raises(StorageError, match="read .*data/f.parquet"):
        pq.read_table(faulty.full_path("data/f.parquet"), filesystem=fs)


def test_data_reads_through_fsspec_leave_no_python_buffer_to_arrow_threads(memory_uri, monkeypatch):
    # On S3 and memory:// Arrow reads data files through Python: each read returns Python bytes.
    # An Arrow thread still holding one after the read returned drops it later and needs the GIL
    # for that; once the interpreter has begun to exit, that aborts the process after its work
    # is done ("terminate called without an active exception"). So no such buffer may be
    # released on a thread Python did not start (threading calls those dummy threads), by a
    # snapshot read, a read of a few row groups, a change read or a compaction.
    import gc

    import nbcc
    from nbcc import storage as storage_module

    released_by_python: list[bool] = []

    class Tracked(bytes):
        def __del__(self):
            released_by_python.append(not isinstance(threading.current_thread(), threading._DummyThread))

    real_read = storage_module._RetryingReader.read
    monkeypatch.setattr(storage_module._RetryingReader, "read", lambda self, size=-1: Tracked(real_read(self, size)))
    table = nbcc.Table.create(memory_uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id", buckets=2)
    for c in range(3):
        table.write(pa.table({"id": list(range(c * 1000, c * 1000 + 20_000)), "v": [f"v{c}"] * 20_000}))
    first = table.timeline()[0].instant
    for _ in range(20):
        assert table.read().num_rows == 22_000
        assert table.read(filter=("id", "=", 5)).num_rows == 1
        assert table.read(query_type="incremental", begin=first, incremental_format="cdc").num_rows > 0
    table.compact()
    assert table.read().num_rows == 22_000
    gc.collect()
    assert released_by_python and all(released_by_python), released_by_python.count(False)


# -- S3: the client's own retries, its listing cache, its options and its errors ---------------------

def _client_retries_after_landing(monkeypatch, st: Storage) -> None:
    """Every conditional put of `st`'s S3 client lands and its reply is lost, and the client
    (botocore or s3fs, not nbcc) sends it again: the second request gets 412."""
    real = st.fs.pipe_file

    def landed_then_retried(path, data, **kwargs):
        real(path, data, **kwargs)
        return real(path, data, **kwargs)
    monkeypatch.setattr(st.fs, "pipe_file", landed_then_retried)


def test_an_s3_put_the_client_retried_after_it_landed_is_its_own(s3_table, monkeypatch):
    uri, opts = s3_table
    st = Storage(uri, opts)
    assert Storage(uri, opts).put_if_absent("meta/theirs.json", b"theirs") is True
    _client_retries_after_landing(monkeypatch, st)
    assert st.put_if_absent("meta/mine.json", b"mine") is True
    assert st.put_if_absent("meta/theirs.json", b"mine") is False  # another writer's file
    assert st.read_bytes("meta/theirs.json") == b"theirs"


def test_a_table_created_on_s3_by_a_put_the_client_retried_is_created(s3_table, monkeypatch):
    # Before, the create raised TableExistsError for the table it had just made. Two creators
    # of the same table with the same settings still get one table and one TableExistsError:
    # each table.json carries its own table_id.
    uri, opts = s3_table
    schema = pa.schema([("id", pa.int64())])
    with monkeypatch.context() as m:
        _client_retries_after_landing(m, Storage(uri, opts))
        table = nbcc.Table.create(uri, schema, "id", buckets=2, storage_options=opts)
    table.write(pa.table({"id": [1, 2]}))
    with pytest.raises(TableExistsError):
        nbcc.Table.create(uri, schema, "id", buckets=2, storage_options=opts)
    assert nbcc.Table.open(uri, opts).read().num_rows == 2


def test_s3_files_another_process_added_since_a_listing_are_read(s3_table):
    # s3fs caches every listing, for good, and opens files through it: a process that had
    # listed a partition folder (a clean, a rollback) then missed every file committed there by
    # others, and failed their reads with "committed data file ... is missing".
    uri, opts = s3_table
    schema = pa.schema([("id", pa.int64()), ("p", pa.string())])
    nbcc.Table.create(uri, schema, "id", partition_by="p", buckets=1, storage_options=opts)
    this = nbcc.Table.open(uri, opts)
    this.write(pa.table({"id": [1], "p": ["a"]}))
    this.clean()  # lists p=a/
    other = nbcc.Table.open(uri, {**opts, "skip_instance_cache": True})  # another process's client
    assert other.storage.fs is not this.storage.fs
    other.write(pa.table({"id": [2], "p": ["a"]}))
    assert sorted(this.read().column("id").to_pylist()) == [1, 2]


def test_an_unknown_s3_storage_option_is_an_error_that_lists_the_valid_ones(s3_table):
    uri, opts = s3_table
    with pytest.raises(InvalidOptionError, match=r"unknown S3 storage option regoin_name; .*endpoint_url.*region_name"):
        Storage(uri, {**opts, "regoin_name": "eu-west-1"})


def test_a_local_or_memory_table_ignores_s3_options_and_refuses_unknown_ones(tmp_path, memory_uri):
    # One job's settings (a properties file) often serve S3 and local tables alike.
    schema = pa.schema([("id", pa.int64())])
    for uri in (str(tmp_path / "t"), memory_uri):
        table = nbcc.Table.create(uri, schema, "id", storage_options={"endpoint_url": "http://127.0.0.1:1", "key": "k"})
        table.write(pa.table({"id": [1]}))
        assert nbcc.Table.open(uri, {"endpoint_url": "http://127.0.0.1:1"}).read().num_rows == 1
        with pytest.raises(InvalidOptionError, match="unknown S3 storage option endpoint; "):
            nbcc.Table.open(uri, {"endpoint": "http://127.0.0.1:1"})


def test_s3_storage_option_values_are_converted_by_what_they_are(s3_table):
    uri, opts = s3_table
    st = Storage(uri, {**opts, "key": "12345", "use_ssl": "false", "max_concurrency": "4",
                       "region_name": "eu-west-1", "config_kwargs": '{"read_timeout": 30}'})
    assert st.fs.key == "12345"  # digits, but a key is text (it used to become an int)
    assert st.fs.use_ssl is False and st.fs.max_concurrency == 4
    assert st.fs.client_kwargs == {"region_name": "eu-west-1"}
    assert st.fs.config_kwargs == {"read_timeout": 30}
    with pytest.raises(InvalidOptionError, match="client_kwargs=.* is not a JSON object"):
        Storage(uri, {**opts, "client_kwargs": "{region_name: x}"})


def test_a_dict_or_boolean_s3_option_of_the_wrong_form_is_refused_and_nothing_is_written(s3_table):
    # s3fs took config_kwargs="notjson" and failed at the first request with a raw AttributeError
    # ('str' object has no attribute 'copy'), and took anon="maybe" as true.
    uri, opts = s3_table
    schema = pa.schema([("id", pa.int64())])
    cases = [("config_kwargs", "notjson", r"config_kwargs='notjson' is not a JSON object .*give one"),
             ("client_kwargs", "[1]", r"client_kwargs='\[1\]' is not a JSON object; give one"),
             ("s3_additional_kwargs", '"text"', r"s3_additional_kwargs='\"text\"' is not a JSON object"),
             ("client_kwargs", ["region_name"], r"client_kwargs=\['region_name'\] is not a JSON object"),
             ("anon", "maybe", r"anon='maybe' is not a boolean; give true or false"),
             ("use_ssl", "1", r"use_ssl='1' is not a boolean; give true or false"),
             ("use_listings_cache", "yes", r"use_listings_cache='yes' is not a boolean; give true or false")]
    for name, value, message in cases:
        bad = {**opts, name: value}
        with pytest.raises(InvalidOptionError, match=f"^storage option {message}"):
            nbcc.Table.create(uri, schema, "id", storage_options=bad)
        with pytest.raises(InvalidOptionError, match=f"^storage option {message}"):
            Storage(uri, bad)
    assert not Storage(uri, opts).exists("")  # the table's folder was never made
    nbcc.Table.create(uri, schema, "id", storage_options=opts).write(pa.table({"id": [1]}))
    with pytest.raises(InvalidOptionError, match="config_kwargs='notjson' is not a JSON object"):
        nbcc.Table.open(uri, {**opts, "config_kwargs": "notjson"})
    # the right forms, as text (Spark, the CLI) or as Python values
    st = Storage(uri, {**opts, "anon": "False", "use_ssl": False, "client_kwargs": None,
                       "s3_additional_kwargs": {"ACL": "private"}})
    assert st.fs.anon is False and st.fs.use_ssl is False and st.fs.s3_additional_kwargs == {"ACL": "private"}


def test_a_local_table_refuses_s3_option_values_of_the_wrong_form_too(tmp_path):
    # As it refuses unknown names: the same settings would fail on an S3 table.
    uri = str(tmp_path / "t")
    with pytest.raises(InvalidOptionError, match="storage option anon='maybe' is not a boolean"):
        nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options={"anon": "maybe"})
    with pytest.raises(InvalidOptionError, match=r"endpoint_url='127.0.0.1:9000' needs its scheme: "
                                                 r"http://127.0.0.1:9000 or https://"):
        nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id",
                          storage_options={"endpoint_url": "127.0.0.1:9000"})
    assert not os.path.exists(uri)


def test_a_missing_bucket_is_named_not_taken_for_a_missing_table(s3_server):
    opts = s3_server["storage_options"]
    uri = "s3://no-such-bucket-nbcc/t"
    with pytest.raises(StorageError, match="the bucket of s3://no-such-bucket-nbcc/t does not exist"):
        nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options=opts)
    with pytest.raises(StorageError, match="bucket .* does not exist"):
        nbcc.Table.open(uri, opts)


def test_missing_s3_credentials_say_how_to_give_them(s3_table, monkeypatch, tmp_path):
    uri, opts = s3_table
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN", "AWS_PROFILE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    with pytest.raises(StorageError, match="NoCredentialsError.*give storage options key and secret"):
        nbcc.Table.open(uri, {"endpoint_url": opts["endpoint_url"]})
    # Doing what it says works in the same process (a notebook): fsspec kept the filesystem that
    # had found no credentials, and every later open with the same options failed the same way.
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", opts["key"])
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", opts["secret"])
    nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options={"endpoint_url": opts["endpoint_url"]})
    assert nbcc.Table.open(uri, {"endpoint_url": opts["endpoint_url"]}).read().num_rows == 0


def test_reading_a_small_s3_file_whole_is_one_request(s3_table, monkeypatch):
    # s3fs asks for the size first (a HEAD) unless its listing cache has it, and nbcc keeps that
    # cache off: every commit file a plan reads cost two requests.
    uri, opts = s3_table
    Storage(uri, opts).put_if_absent(".nbcc/timeline/a.json", b'{"a": 1}')
    st = Storage(uri, {**opts, "skip_instance_cache": True})
    calls: list[str] = []
    real = st.fs._call_s3

    async def counted(method, *args, **kwargs):
        calls.append(method)
        return await real(method, *args, **kwargs)
    monkeypatch.setattr(st.fs, "_call_s3", counted)
    assert st.read_bytes(".nbcc/timeline/a.json") == b'{"a": 1}'
    assert calls == ["get_object"]


def _s3_calls(storage: Storage, monkeypatch, lists: bool = False) -> list[tuple[str, str]]:
    """The (method, key) of every S3 request `storage` sends from now on, as they are sent: a
    DeleteObjects with its first key; with `lists`, a listing with its prefix."""
    calls: list[tuple[str, str]] = []
    real = storage.fs._call_s3

    async def counted(method, *args, **kwargs):
        key = kwargs.get("Key", "")
        if method == "delete_objects":
            key = kwargs["Delete"]["Objects"][0]["Key"]
        elif lists and method == "list_objects_v2":
            key = kwargs.get("Prefix", "")
        calls.append((method, key))
        return await real(method, *args, **kwargs)
    monkeypatch.setattr(storage.fs, "_call_s3", counted)
    return calls


def test_an_s3_uri_with_empty_or_dot_segments_names_the_same_table_as_hadoop_reads_it(s3_table):
    # S3 keeps "//" and "./" in keys literally: s3://lake//t was created, but its first write
    # failed ("not pending on the timeline": s3fs listed another key than it wrote), and
    # s3://lake/./t was another table than s3://lake/t. Hadoop's Path (Spark, Delta) drops them.
    uri, opts = s3_table
    bucket, name = uri[len("s3://"):].split("/", 1)
    odd = f"s3://{bucket}//./{name}/"
    table = nbcc.Table.create(odd, pa.schema([("id", pa.int64())]), "id", storage_options=opts)
    assert table.uri == uri
    table.write(pa.table({"id": pa.array([1], pa.int64())}))
    assert nbcc.Table.open(uri, opts).read().to_pylist() == [{"id": 1}]
    assert nbcc.Table.open(f"s3://{bucket}/x/../{name}", opts).read().to_pylist() == [{"id": 1}]
    assert Storage("memory://a//b/./c/").uri == "memory://a/b/c"
    with pytest.raises(nbcc.NbccError, match=r"goes above its bucket \('\.\.'\); give the table's path without it"):
        Storage(f"s3://{bucket}/../{name}", opts)


def test_a_listing_on_s3_is_one_request_even_of_an_empty_folder(s3_table, monkeypatch):
    # fs.ls lists the parent folder again when a folder is empty, to tell a file from nothing:
    # every timeline load paid it for an empty .nbcc/history.
    uri, opts = s3_table
    st = Storage(uri, opts)
    _put_files(st, ["t/a.json", "t/b.json", "t/p=1/f.parquet", "t/p=2/g.parquet", "u/x.json"])
    calls = _s3_calls(st, monkeypatch, lists=True)
    assert st.list_names("t") == ["a.json", "b.json", "p=1", "p=2"]  # files and folders, as before
    assert st.list_names("t", prefix="p=") == ["p=1", "p=2"]
    assert st.list_names("t/empty") == [] and st.list_names("nothing/here", prefix="x") == []
    assert [m for m, _ in calls] == ["list_objects_v2"] * 4, calls
    st.put_if_absent("t/c.json", b"c")  # and no listing answers from a cache
    assert st.list_names("t", prefix="c") == ["c.json"] and "c.json" in st.list_names("t")


def test_a_clean_on_s3_loads_the_timeline_once_before_planning(s3_table, monkeypatch):
    # Rolling back failed writes and finishing unfinished cleans each loaded the timeline (and
    # its history), as did planning: the first two now share one load.
    uri, opts = s3_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", buckets=1, storage_options=opts)
    table.write(pa.table({"id": pa.array([1], pa.int64())}))
    calls = _s3_calls(table.storage, monkeypatch, lists=True)
    assert table.clean()["deleted"] == []  # nothing to delete: no clean instant, no heartbeat tidying
    timeline = [k for m, k in calls if m == "list_objects_v2" and k.endswith("/.nbcc/timeline/")]
    assert len(timeline) == 2, calls  # before planning, and planning
    assert table.read().to_pylist() == [{"id": 1}]


def test_reads_and_compaction_on_s3_open_each_data_file_with_one_request(s3_table, monkeypatch):
    # A data file's size is in its commit: opening it asked S3 for the size first (a HEAD per
    # file), half the requests of a read of small log files, and of a compaction.
    uri, opts = s3_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id", buckets=2,
                              storage_options=opts)
    first = table.write(pa.table({"id": pa.array([1, 2, 3, 4], pa.int64()), "v": list("abcd")}))
    table.write(pa.table({"id": pa.array([2, 3], pa.int64()), "v": ["B", "C"]}))
    table.delete([("id", "=", 4)])
    first = next(i.completion for i in table.timeline() if i.instant == first)
    calls = _s3_calls(table.storage, monkeypatch)

    def data_file_calls() -> list[tuple[str, str]]:
        seen = [(m, k.rsplit("/", 1)[-1]) for m, k in calls if k and "/.nbcc/" not in k]
        calls.clear()
        return seen

    def one_get_each(seen: list[tuple[str, str]]) -> None:
        assert seen and all(m == "get_object" for m, _ in seen), seen
        assert len({k for _, k in seen}) == len(seen), seen

    assert sorted(table.read().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "v": "a"}, {"id": 2, "v": "B"}, {"id": 3, "v": "C"}]
    one_get_each(data_file_calls())
    assert sorted(r["id"] for r in table.read(query_type="incremental", begin=first).to_pylist()) == [2, 3]
    one_get_each(data_file_calls())
    assert table.read(query_type="incremental", incremental_format="cdc", begin=first).num_rows == 3
    assert {m for m, _ in data_file_calls()} == {"get_object"}
    assert table.compact() is not None
    one_get_each([c for c in data_file_calls() if c[0] != "put_object"])
    assert sorted(table.read().to_pylist(), key=lambda r: r["id"]) == [
        {"id": 1, "v": "a"}, {"id": 2, "v": "B"}, {"id": 3, "v": "C"}]
    one_get_each(data_file_calls())
    # A file gone from S3 is still named as missing, now found at the first read, not at the open.
    name = next(n for s in table.file_slices() for n in s.file_names())
    table.storage.delete(name)
    with pytest.raises(nbcc.DataFileError, match=f"{name} is missing"):
        table.read()


def test_a_file_group_whose_files_open_at_once_names_the_first_missing_one(memory_uri):
    # Off local disk a file group's files open at once (reader._open_files): a failure must
    # still name the file, the first one of the group that fails, and leave nothing open.
    table = nbcc.Table.create(memory_uri, pa.schema([("id", pa.int64()), ("v", pa.string())]), "id", buckets=1)
    for n in range(6):
        table.write(pa.table({"id": pa.array([n, n + 1], pa.int64()), "v": [str(n)] * 2}))
    assert table.read().num_rows == 7
    names = [n for s in table.file_slices() for n in s.file_names()]
    assert len(names) == 6
    for gone in (names[4], names[1]):
        table.storage.delete(gone)
        with pytest.raises(nbcc.DataFileError, match=f"{gone} is missing"):
            table.read()


def test_a_parquet_file_whose_recorded_size_is_wrong_is_read_at_its_actual_size(s3_table, caplog):
    uri, opts = s3_table
    st = Storage(uri, opts)
    with st.open_write("f.parquet") as sink:
        pq.write_table(pa.table({"a": [1, 2, 3]}), sink)
    size = len(st.read_bytes("f.parquet"))
    for wrong in (size - 10, size + 10, size + 100_000, 5):
        caplog.clear()
        with st.open_parquet("f.parquet", wrong) as pf:
            assert pf.read().to_pylist() == [{"a": 1}, {"a": 2}, {"a": 3}]
        assert f"not a Parquet file of {wrong} bytes" in caplog.text
    with st.open_parquet("f.parquet", size) as pf:
        assert pf.read().num_rows == 3


def test_a_write_on_s3_puts_its_heartbeat_once(s3_table, monkeypatch):
    # begin_write beat, and the write's heartbeat thread beat again at once: a request of about 40.
    uri, opts = s3_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", buckets=1, storage_options=opts)
    calls = _s3_calls(table.storage, monkeypatch)
    instant = table.write(pa.table({"id": pa.array([1], pa.int64())}))
    assert [m for m, k in calls if k.endswith(f"/.nbcc/heartbeats/{instant}.json")][:1] == ["put_object"]
    assert [m for m, k in calls if k.endswith(f"/.nbcc/heartbeats/{instant}.json")].count("put_object") == 1
    assert table.storage.list_names(".nbcc/heartbeats") == []
    assert table.read().to_pylist() == [{"id": 1}]


def _put_files(st: Storage, names: list[str]) -> None:
    for name in names:
        st.put_if_absent(name, name.encode())


def test_delete_many_on_s3_deletes_a_batch_with_one_request(s3_table, monkeypatch):
    uri, opts = s3_table
    st = Storage(uri, opts)
    doomed = [f"p=1/f{i}.parquet" for i in range(5)] + [f"p=2/g{i}.parquet" for i in range(2)]
    _put_files(st, [*doomed, "p=1/kept.parquet"])
    monkeypatch.setattr(nbcc.storage, "_DELETE_BATCH", 3)
    calls = _s3_calls(st, monkeypatch)
    st.delete_many([*doomed, "p=1/never-written.parquet"])  # a missing file is no error, as with delete
    assert [m for m, _ in calls] == ["delete_objects"] * 3
    assert st.list_names("p=1") == ["kept.parquet"] and st.list_names("p=2") == []


def _faulty_files(s3_table, folder: str, n: int) -> tuple[Faults, FaultyStorage, list[str]]:
    """A faulty storage of the S3 table, with `n` files written in `folder` (their names)."""
    uri, opts = s3_table
    faults = Faults()
    st = FaultyStorage(uri, opts, faults)
    names = [f"{folder}/f{i}" for i in range(n)]
    _put_files(st, names)
    return faults, st, names


def test_delete_many_deletes_again_one_by_one_what_s3_failed_to_delete(s3_table):
    # S3 answers a DeleteObjects with the keys it failed to delete (an InternalError for one key,
    # an object it may not delete): those are deleted again, and an error that lasts is raised.
    faults, st, names = _faulty_files(s3_table, "d", 4)
    faults.plan("delete_many", PARTLY)
    st.delete_many(names)
    assert st.list_names("d") == [] and faults.calls["delete"] == 1
    _put_files(st, names)
    faults.plan("delete_many", PARTLY).plan("delete", PermissionError(errno.EACCES, "AccessDenied"))
    with pytest.raises(StorageError, match=r"delete .*/d/f0 failed: access denied"):
        st.delete_many(names)
    assert st.list_names("d") == ["f0"]


def test_delete_many_on_a_store_that_refuses_bulk_deletes_deletes_one_by_one(s3_table, caplog):
    # Some S3-compatible stores refuse DeleteObjects (or botocore's checksum header for it): a
    # clean, a rollback or archival must still delete their files, and stop asking.
    faults, st, names = _faulty_files(s3_table, "r", 3)
    faults.plan("delete_many", OSError(errno.EIO, "InvalidRequest (400): Missing required header for this "
                                                  "request: Content-MD5"))
    st.delete_many(names)
    assert st.list_names("r") == [] and faults.calls["delete"] == 3
    assert "refused to delete 3 files in one request" in caplog.text
    _put_files(st, names)
    st.delete_many(names)
    assert st.list_names("r") == [] and faults.calls["delete_many"] == 1 and faults.calls["delete"] == 6


def test_a_write_on_s3_takes_the_table_lock_without_reading_it_and_deletes_in_bulk(s3_table, monkeypatch):
    # A writer alone on a table knows the lock's state (it released it): each swap is a put and a
    # list, a release one put, and old states go without a listing. The commit's requested,
    # inflight and heartbeat files go in one request, the heartbeat's thread stopped before it
    # (no late beat can put the file back, so it is not deleted again).
    uri, opts = s3_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", buckets=1, storage_options=opts)
    table.write(pa.table({"id": pa.array([0], pa.int64())}))
    calls = _s3_calls(table.storage, monkeypatch, lists=True)
    for n in range(1, 9):  # 32 lock states: old ones are collected 3 or 4 times
        table.write(pa.table({"id": pa.array([n], pa.int64())}))
    lock = [m for m, k in calls if "/.nbcc/lock/" in k]
    assert sorted(set(lock)) == ["delete_objects", "list_objects_v2", "put_object"], lock
    assert lock.count("put_object") == 8 * 4 and lock.count("list_objects_v2") == 8 * 2
    assert lock.count("delete_objects") in (3, 4)
    others = [m for m, k in calls if m.startswith("delete") and "/.nbcc/lock/" not in k]
    assert others == ["delete_objects"] * 8
    assert len(table.storage.list_names(".nbcc/lock")) <= 3 * 8
    assert sorted(r["id"] for r in table.read().to_pylist()) == list(range(9))
    assert table.storage.list_names(".nbcc/heartbeats") == []
    assert not [n for n in table.storage.list_names(".nbcc/timeline") if n.endswith(("requested", "inflight"))]


def test_a_retry_stopped_by_its_deadline_reports_the_last_failure(memory_uri):
    class Failing(Storage):
        calls = 0

        def _replace_once(self, path, data, durable=True, give_up_at=None):
            self.calls += 1
            if self.calls == 1:
                raise ConnectionResetError(errno.ECONNRESET, "first")
            time.sleep(0.4)  # the second attempt ends past the deadline
            raise TimeoutError(errno.ETIMEDOUT, "second")

    st = Failing(memory_uri)
    with pytest.raises(StorageError, match=r"failed 2 times \(TimeoutError: .*second\).*not tried again.*"
                                           r"an attempt may have replaced the file"):
        st.replace("meta/a.json", b"new", deadline=time.monotonic() + 0.3)
    assert st.calls == 2


def test_wrong_s3_credentials_and_an_endpoint_without_scheme_say_what_to_fix(s3_table, monkeypatch):
    import moto.settings
    uri, opts = s3_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options=opts)
    monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # the server checks keys now
    with pytest.raises(StorageError, match="access denied .*check the storage options key, secret and profile"):
        nbcc.Table.open(uri, {**opts, "key": "wrong", "secret": "wrong"})
    monkeypatch.undo()
    bare = opts["endpoint_url"].removeprefix("http://")
    with pytest.raises(nbcc.InvalidOptionError, match=f"endpoint_url='{bare}' needs its scheme: http://{bare}"):
        nbcc.Table.open(uri, {**opts, "endpoint_url": bare})


def test_an_s3_endpoint_that_never_answered_fails_at_once_and_one_that_did_is_retried(monkeypatch):
    # A wrong endpoint_url is a mistake no retry fixes: opening a table must say what to check
    # without six rounds of retries (45 s). An endpoint that answered before is having an
    # outage, and so is one that any later call (a Spark task's, in a fresh process) meets.
    import socket

    from moto_s3 import start_server
    with socket.socket() as sock:  # a port on loopback that nobody listens on
        sock.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{sock.getsockname()[1]}"
    no_retries = {"key": "testing", "secret": "testing", "config_kwargs": {"retries": {"max_attempts": 1}}}
    calls = []
    real_once = Storage._read_once
    monkeypatch.setattr(Storage, "_read_once", lambda self, *a, **kw: calls.append(1) or real_once(self, *a, **kw))
    with pytest.raises(StorageError, match=f"cannot connect to the S3 endpoint {closed} .*check the storage "
                                           "options endpoint_url and region_name"):
        nbcc.Table.open("s3://nbcc-tests/t", {**no_retries, "endpoint_url": closed})
    assert len(calls) == 1
    server, opts = start_server("nbcc-outage")
    try:
        uri = "s3://nbcc-outage/t"
        table = nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options={**opts, **no_retries})
    finally:
        server.stop()
    import nbcc.storage as storage_module
    answered = storage_module._ANSWERED_ENDPOINTS
    for forget in (False, True):  # opening, after it answered; a call that is not opening, before
        calls.clear()
        monkeypatch.setattr(storage_module, "_ANSWERED_ENDPOINTS", set() if forget else answered)
        call = table.storage.read_bytes if forget else lambda _: nbcc.Table.open(uri, {**opts, **no_retries})
        with pytest.raises(StorageError, match=f"failed {Storage.RETRY_ATTEMPTS} times in a row .*unreachable"):
            call(".nbcc/table.json")
        assert len(calls) == Storage.RETRY_ATTEMPTS


def test_a_relative_path_given_s3_options_is_taken_for_an_s3_uri_without_its_scheme(tmp_path, monkeypatch, caplog):
    # "lake/orders" with S3 options made a local table under the current folder, without a word.
    monkeypatch.chdir(tmp_path)
    options = {"endpoint_url": "http://127.0.0.1:1", "key": "k", "secret": "s"}
    with pytest.raises(nbcc.TableNotFoundError) as err:
        nbcc.Table.open("lake/orders", options)
    assert str(err.value).startswith(f"lake/orders is not an nbcc table (a local path: {tmp_path}/lake/orders; an "
                                     "S3 table's URI starts with s3://)"), str(err.value)
    with caplog.at_level("WARNING", logger="nbcc.storage_options"):
        nbcc.Table.create("lake/orders", pa.schema([("id", pa.int64())]), "id", storage_options=options)
    assert (tmp_path / "lake" / "orders" / ".nbcc" / "table.json").is_file()  # as documented: a local table
    assert ("storage options ['endpoint_url', 'key', 'secret'] ignored: lake/orders is not on S3 but a folder "
            f"under the current one ({tmp_path}/lake/orders); for S3, write s3://lake/orders") in caplog.text
    # An absolute path with a job's S3 settings is a local table on purpose: no warning.
    caplog.clear()
    with caplog.at_level("WARNING", logger="nbcc.storage_options"):
        nbcc.Table.create(str(tmp_path / "local"), pa.schema([("id", pa.int64())]), "id", storage_options=options)
    assert "ignored" not in caplog.text


def test_an_uppercase_scheme_is_the_same_storage(s3_table):
    # "S3://..." failed with fsspec's "Protocol not known: S3".
    uri, opts = s3_table
    nbcc.Table.create(uri, pa.schema([("id", pa.int64())]), "id", storage_options=opts).write(pa.table({"id": [1]}))
    assert nbcc.Table.open("S3" + uri[2:], opts).read().to_pylist() == [{"id": 1}]
