"""Log files as written: which columns Parquet dictionary- or delta-encodes (writer.column_encodings),
the meta columns each row gets, that small incoming batches are written in bigger pieces, and that
every data file is durable before a commit names it."""

from __future__ import annotations

import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import nbcc
from nbcc.writer import coalesced


def _encodings(path: str) -> dict[str, set[str]]:
    md = pq.ParquetFile(path).metadata
    out: dict[str, set[str]] = {}
    for rg in range(md.num_row_groups):
        for c in range(md.num_columns):
            col = md.row_group(rg).column(c)
            out.setdefault(col.path_in_schema, set()).update(col.encodings)
    return out


def test_log_files_dictionary_encode_repetitive_columns_only(tmp_path):
    n = 50_000
    ids = np.arange(n, dtype=np.int64)
    data = pa.table({
        "id": ids,  # unique
        "amount": np.random.default_rng(0).random(n),  # unique
        "region": pa.array(np.array(["eu", "us", "apac"])[ids % 3]),  # 3 values
        "score": ids % 10,  # 10 values
        "ts": np.ones(n, dtype=np.int64),
    })
    table = nbcc.Table.create(str(tmp_path / "t"), data.schema, "id", ordering_field="ts", buckets=1)
    table.write(data)
    [log] = [s.log_files[0] for s in table.file_slices()]
    enc = _encodings(str(tmp_path / "t" / log))
    dictionary = {name for name, e in enc.items() if "RLE_DICTIONARY" in e or "PLAIN_DICTIONARY" in e}
    assert {"region", "score", "ts", "_nbcc_commit_time"} <= dictionary
    assert not {"id", "amount", "_nbcc_record_key"} & dictionary
    assert table.read().sort_by("id").to_pydict() == data.to_pydict()


def test_integer_columns_with_small_steps_are_delta_encoded_in_log_and_base_files(tmp_path):
    # Sorted keys, close event times and small ids take a few bits per value with
    # DELTA_BINARY_PACKED; wide random integers stay plain (delta would only cost CPU there).
    n = 50_000
    rng = np.random.default_rng(1)
    ids = np.arange(n, dtype=np.int64) * 3 - 70_000  # negative too
    data = pa.table({
        "id": ids,
        "event": pa.array(1_700_000_000_000_000 + ids * 1000, pa.timestamp("us", tz="UTC")),
        "day": pa.array((19_000 + ids // 5000).astype(np.int32), pa.date32()),
        "small": pa.array(np.where(ids % 7 == 0, None, rng.integers(-2**20, 2**20, n))),  # unsorted, nulls
        "wide": rng.integers(-2**62, 2**62, n),
        "extremes": np.where(ids % 2 == 0, np.iinfo(np.int64).min, np.iinfo(np.int64).max),
        "amount": rng.random(n),
        "ts": np.ones(n, dtype=np.int64),
    })
    table = nbcc.Table.create(str(tmp_path / "t"), data.schema, "id", ordering_field="ts", buckets=2)
    table.write(data)
    logs = [str(tmp_path / "t" / s.log_files[0]) for s in table.file_slices()]
    table.compact()
    bases = [str(tmp_path / "t" / s.base_file) for s in table.file_slices()]
    assert len(logs) == len(bases) == 2
    for path in logs + bases:
        enc = _encodings(path)
        delta = {name for name, e in enc.items() if "DELTA_BINARY_PACKED" in e}
        assert {"id", "event", "small"} <= delta, (path, enc)
        assert not {"wide", "extremes", "amount", "ts", "_nbcc_commit_time"} & delta, (path, enc)
    # Within a bucket consecutive days repeat: the dictionary wins, not delta.
    assert all("DELTA_BINARY_PACKED" not in _encodings(p)["day"] for p in logs)
    assert table.read().sort_by("id").to_pydict() == data.sort_by("id").to_pydict()


def test_every_row_of_every_log_file_carries_its_commit_instant_and_key(tmp_path):
    # The writer adds `_nbcc_commit_time` to each file after splitting the rows by bucket,
    # instead of reordering it with them; each row must still get the instant and its own key.
    n = 40_000
    data = pa.table({"id": np.arange(n, dtype=np.int64), "ts": np.ones(n, dtype=np.int64)})
    table = nbcc.Table.create(str(tmp_path / "t"), data.schema, "id", ordering_field="ts", buckets=4)
    table.write(data)
    table.write(data.slice(0, 10))
    instants = [i.instant for i in table.timeline() if i.state == "completed"]
    seen: dict[str, int] = {}
    for s in table.file_slices():
        for log in s.log_files:
            rows = pq.read_table(str(tmp_path / "t" / log))
            [instant] = set(rows.column("_nbcc_commit_time").to_pylist())
            assert instant in log  # the file's own instant
            assert rows.column("_nbcc_record_key").to_pylist() == [str(k) for k in rows.column("id").to_pylist()]
            seen[instant] = seen.get(instant, 0) + rows.num_rows
    assert seen == {instants[0]: n, instants[1]: 10}


# format.md §11.3's worked examples (buckets=16), with the record key text of §9.4/§11.2: the
# file group a row lands in and its `_nbcc_record_key`, as a reader of the spec computes them.
SPEC_KEY_EXAMPLES = [
    # (record_key, key columns, values, expected `_nbcc_record_key`, expected file group id)
    (["id"], [("id", pa.string())], ("id1",), "id1", "00000005-0000-0000-0000-000000000000"),
    (["id"], [("id", pa.string())], ("user_001",), "user_001", "00000012-0000-0000-0000-000000000000"),
    (["id"], [("id", pa.string())], ("emoji\U0001F600key",), "emoji\U0001F600key",
     "00000005-0000-0000-0000-000000000000"),
    (["id"], [("id", pa.int64())], (-7,), "-7", "00000009-0000-0000-0000-000000000000"),
    (["id", "n"], [("id", pa.string()), ("n", pa.int64())], ("id1", 42), "id:id1,n:42",
     "00000009-0000-0000-0000-000000000000"),
]


@pytest.mark.parametrize("record_key,key_fields,values,key_text,file_group", SPEC_KEY_EXAMPLES,
                         ids=[e[3] for e in SPEC_KEY_EXAMPLES])
def test_log_file_holds_the_spec_worked_examples_key_text_in_their_file_group(
        tmp_path, record_key, key_fields, values, key_text, file_group):
    schema = pa.schema(key_fields + [("ts", pa.int64()), ("v", pa.string())])
    row = dict(zip(record_key, values), ts=1, v="x")
    table = nbcc.Table.create(str(tmp_path / "t"), schema, record_key, ordering_field="ts", buckets=16)
    instant = table.write(pa.Table.from_pylist([row], schema=schema))
    root = tmp_path / "t"
    [log] = [p for p in root.rglob("*") if p.is_file() and ".nbcc" not in p.relative_to(root).parts]
    # §9.1: <file_group_id>_<instant>.log.<version>_<token>, version 1, the Python API's token 0-0-0
    assert log.name == f"{file_group}_{instant}.log.1_0-0-0"
    rows = pq.read_table(str(log)).to_pylist()
    assert rows == [{**row, "_nbcc_commit_time": instant, "_nbcc_record_key": key_text, "_nbcc_is_deleted": False}]


def test_constant_strings_are_valid_string_arrays():
    from nbcc.schema import constant_strings

    for value in ["20260101000000000", "", "é/ü"]:
        for n in [0, 1, 3]:
            arr = constant_strings(value, n)
            arr.validate(full=True)
            assert arr.type == pa.string() and arr.to_pylist() == [value] * n


def test_every_data_file_is_fsynced_before_the_commit_that_names_it(tmp_path, monkeypatch):
    # On local disk a commit must never point at files a power failure could still lose: each
    # log file (also those rolled over mid-write) and each compacted base file is fsynced, and
    # before its commit is published.
    import nbcc.commit
    import nbcc.compaction
    import nbcc.local_disk

    events: list[tuple[str, str]] = []
    real_fsync, real_complete = nbcc.local_disk._fsync_path, nbcc.commit.create_completed
    sizes: dict[str, int] = {}

    def fsync(path):
        if os.path.isfile(path):
            sizes[path] = os.path.getsize(path)  # synced once every byte was written
        events.append(("fsync", path))
        real_fsync(path)
    monkeypatch.setattr(nbcc.local_disk, "_fsync_path", fsync)

    def completing(storage, instant, grant, action, metadata):
        events.append(("commit", instant))
        return real_complete(storage, instant, grant, action, metadata)
    monkeypatch.setattr(nbcc.commit, "create_completed", completing)
    monkeypatch.setattr(nbcc.compaction, "create_completed", completing)

    n = 20_000
    data = pa.table({"id": np.arange(n, dtype=np.int64), "ts": np.ones(n, dtype=np.int64),
                     "s": pa.array([f"value-{i:08d}" for i in range(n)])})
    root = tmp_path / "t"
    table = nbcc.Table.create(str(root), data.schema, "id", ordering_field="ts", buckets=3)
    table.write(pa.RecordBatchReader.from_batches(data.schema, data.to_batches(max_chunksize=2000)),
                max_log_file_bytes=60_000)
    table.compact()

    from nbcc.filenames import parse_data_file

    files = {str(p): parse_data_file(p.name) for p in root.iterdir() if p.is_file()}
    kinds = [type(f).__name__ for f in files.values()]
    assert kinds.count("BaseFile") == 3 and kinds.count("LogFile") > 3, "expected rolled-over log files"
    synced = [path for kind, path in events if kind == "fsync" and os.path.isfile(path)]
    assert sorted(synced) == sorted(files)
    assert sizes == {path: os.path.getsize(path) for path in files}
    dir_syncs = [i for i, e in enumerate(events) if e == ("fsync", str(root))]
    for path, parsed in files.items():  # each before the commit (or compaction) that publishes it
        assert events.index(("fsync", path)) < events.index(("commit", parsed.instant)), path
        # and then its directory, which makes its name durable
        assert any(events.index(("fsync", path)) < i < events.index(("commit", parsed.instant))
                   for i in dir_syncs), path


def _id_rows(start: int, stop: int) -> pa.Table:
    return pa.table({"id": np.arange(start, stop, dtype=np.int64), "ts": np.ones(stop - start, dtype=np.int64)})


def test_small_batches_are_regrouped_in_order_without_losing_rows():
    sizes = [700, 0, 300, 999, 1, 0, 2500, 40, 0]
    rows = _id_rows(0, sum(sizes))
    batches, start = [], 0
    for size in sizes:
        batches.append(rows.slice(start, size).combine_chunks().to_batches()[0] if size else
                       pa.RecordBatch.from_pylist([], schema=rows.schema))
        start += size
    pieces = list(coalesced(iter(batches), rows=1000))
    # A piece ends with the batch that brings it to 1000 rows; the last holds what is left.
    assert [p.num_rows for p in pieces] == [700 + 300, 999 + 1, 2500, 40]
    assert pa.concat_tables(pieces).combine_chunks().equals(rows.combine_chunks())
    assert all(c.num_rows for p in pieces for c in p.to_batches())  # empty batches dropped
    assert list(coalesced(iter([]))) == []


def test_a_stream_of_small_batches_writes_the_same_table_as_one_big_write(tmp_path):
    schema = pa.schema([("id", pa.int64()), ("ts", pa.int64()), ("v", pa.string())])
    n = 30_000
    ids = np.arange(n, dtype=np.int64) % 10_000  # every key three times in one write
    data = pa.table({"id": ids, "ts": np.arange(n, dtype=np.int64), "v": [f"v{i}" for i in range(n)]},
                    schema=schema)
    whole = nbcc.Table.create(str(tmp_path / "whole"), schema, "id", ordering_field="ts", buckets=4)
    whole.write(data)
    streamed = nbcc.Table.create(str(tmp_path / "streamed"), schema, "id", ordering_field="ts", buckets=4)
    streamed.write(pa.RecordBatchReader.from_batches(schema, data.to_batches(max_chunksize=777)))
    got = streamed.read().sort_by("id")
    assert got.equals(whole.read().sort_by("id"))
    assert got.column("v").to_pylist() == [f"v{i}" for i in range(20_000, 30_000)]  # the latest ts wins
    assert len(list((tmp_path / "streamed").glob("*.log.*"))) == 4  # one log file per bucket


def test_a_failed_fsync_fails_the_write_and_publishes_nothing(tmp_path, monkeypatch):
    import errno

    import nbcc.local_disk

    real = nbcc.local_disk._fsync_path

    def failing(path):
        if os.path.isdir(path):  # the timeline's own puts go through
            return real(path)
        raise OSError(errno.EIO, "injected: the disk could not write the file", path)

    data = _id_rows(0, 100)
    table = nbcc.Table.create(str(tmp_path / "t"), data.schema, "id", ordering_field="ts", buckets=4)
    monkeypatch.setattr(nbcc.local_disk, "_fsync_path", failing)
    with pytest.raises(OSError) as failed:  # the files could not be made durable
        table.write(data)
    assert failed.value.errno == errno.EIO
    monkeypatch.undo()
    assert [(i.state, i.completion) for i in table.timeline()] == [("rolledback", None)]  # undone at once
    assert table.read().num_rows == 0


def _write_in_forked_child(uri: str) -> None:
    nbcc.Table.open(uri).write(_id_rows(100, 200))


def test_a_forked_child_makes_its_files_durable_after_its_parent_did(tmp_path):
    """The fsync threads are kept per process. Spark forks its Python workers, and a child has
    none of its parent's threads: a pool inherited as it was would never run the child's fsyncs
    and its write would hang."""
    import multiprocessing

    data = _id_rows(0, 100)
    uri = str(tmp_path / "t")
    table = nbcc.Table.create(uri, data.schema, "id", ordering_field="ts", buckets=4)
    table.write(data)  # the parent's fsync threads now exist
    child = multiprocessing.get_context("fork").Process(target=_write_in_forked_child, args=(uri,))
    child.start()
    child.join(timeout=60)
    if child.is_alive():
        child.kill()
    assert child.exitcode == 0
    assert table.read().num_rows == 200


def test_a_write_from_an_atexit_handler_commits(any_table):
    """At interpreter shutdown no new threads may start, so the fsyncs (local disk) and the
    concurrent reads of commit files (S3) run one after another there: a job that writes its
    last rows from an atexit handler still commits them."""
    import json
    import subprocess
    import sys
    import textwrap

    uri, opts = any_table
    data = _id_rows(0, 100)
    table = nbcc.Table.create(uri, data.schema, "id", ordering_field="ts", buckets=4, storage_options=opts)
    table.write(data)
    table.write(_id_rows(100, 200))
    # A fresh process has no commit file cached: its write at exit reads both to plan.
    script = textwrap.dedent("""
        import atexit, json, sys
        import numpy as np, pyarrow as pa, nbcc
        table = nbcc.Table.open(sys.argv[1], json.loads(sys.argv[2]))
        ids = np.arange(200, 300, dtype=np.int64)
        atexit.register(lambda: table.write(pa.table({"id": ids, "ts": np.ones(100, dtype=np.int64)})))
    """)
    done = subprocess.run([sys.executable, "-c", script, uri, json.dumps(opts)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and "Error" not in done.stderr, done.stderr
    table = nbcc.Table.open(uri, opts)
    assert [i.state for i in table.timeline()] == ["completed"] * 3
    assert sorted(table.read().column("id").to_pylist()) == list(range(300))


def test_nanosecond_ordering_values_are_written_and_merged_at_full_precision(tmp_path):
    # Python datetimes stop at microseconds: the writer took the ordering field's min and max
    # through them and failed on any value off the microsecond (pandas is not a dependency).
    from nbcc.timeline import Timeline, read_commit_metadatas

    ns = pa.timestamp("ns", tz="UTC")
    base = 1_700_000_000_000_000_000
    schema = pa.schema([("id", pa.int64()), ("ts", ns), ("v", pa.string())])
    table = nbcc.Table.create(str(tmp_path / "t"), schema, "id", ordering_field="ts", buckets=1)
    table.write(pa.table({"id": [1, 2], "ts": pa.array([base + 5, base + 5], ns), "v": ["a", "b"]}, schema=schema))
    # One nanosecond decides each merge: 4 < 5 keeps "a", 6 > 5 takes "new".
    table.write(pa.table({"id": [1, 2], "ts": pa.array([base + 4, base + 6], ns), "v": ["old", "new"]},
                         schema=schema))
    rows = table.read().sort_by("id")
    assert rows.column("v").to_pylist() == ["a", "new"]
    assert rows.column("ts").cast(pa.int64()).to_pylist() == [base + 5, base + 6]
    metas = read_commit_metadatas(table.storage, Timeline.load(table.storage).completed())
    ranges = [(f["ordering_min"], f["ordering_max"]) for m in metas.values() for f in m["files"]]
    assert sorted(ranges) == [("2023-11-14T22:13:20.000000004+00:00", "2023-11-14T22:13:20.000000006+00:00"),
                              ("2023-11-14T22:13:20.000000005+00:00", "2023-11-14T22:13:20.000000005+00:00")]


@pytest.mark.parametrize("failure", ["bad rows", "storage"])
def test_a_failed_write_with_open_files_leaves_no_stray_error_or_file(any_table, failure, monkeypatch):
    # The aborted write's Parquet writers were left to the garbage collector, whose close wrote
    # to the aborted file and printed "Exception ignored ... stays pending until it is rolled
    # back" after the write had been rolled back already.
    import gc
    import sys

    from faults import BEFORE, Faults, FaultyStorage

    uri, opts = any_table
    table = nbcc.Table.create(uri, pa.schema([("id", pa.int64()), ("v", pa.int64())]), "id", buckets=2,
                              storage_options=opts)
    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: unraisable.append(f"{u.exc_type.__name__}: {u.exc_value}"))
    n = 200_000  # past one 128k-row chunk: both buckets' files are open when the write fails

    def rows():
        yield pa.record_batch({"id": np.arange(n), "v": np.arange(n)})
        yield pa.record_batch({"id": pa.array([None], pa.int64()), "v": [1]})

    if failure == "bad rows":
        with pytest.raises(nbcc.SchemaError, match="record key column 'id' has 1 null"):
            table.write(rows(), max_log_file_bytes=4096)
    else:
        faulty = nbcc.Table(FaultyStorage(uri, opts, Faults().plan("sink", None, BEFORE, where=r"/00000001-")),
                            table.config)
        with pytest.raises(nbcc.StorageError, match="00000001-"):
            faulty.write(rows(), max_log_file_bytes=4096)
        del faulty
    gc.collect()
    assert unraisable == []
    assert [i.state for i in table.timeline()] == ["rolledback"]
    assert table.read().num_rows == 0
    data_files = [p for p in table.storage.fs.find(table.storage.root) if "/.nbcc/" not in p]
    assert data_files == []
