"""Storage: put-if-absent (the one primitive every metadata change is built on), listings and
deletes, on memory://, local disk and the moto S3 server."""

from __future__ import annotations

import os
import threading

import pytest

from nbcc.errors import StorageError
from nbcc.storage import Storage


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
    assert storage.put_if_absent(".nbcc/timeline/a.json", b'{"first": 1}') is False
    assert storage.read_bytes(".nbcc/timeline/a.json") == b'{"first": 1}'
    # Another name in the same folder is independent.
    assert storage.put_if_absent(".nbcc/timeline/b.json", b"b") is True
    assert sorted(storage.list_names(".nbcc/timeline")) == ["a.json", "b.json"]


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
    barrier = threading.Barrier(n)
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
        t.join()
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
